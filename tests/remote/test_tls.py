"""Gateway.remote.tls against real sockets on 127.0.0.1, with certificates made here (no ssl mocks).

The harness server accepts TCP and upgrades with ``start_tls`` so the server side of a failed
handshake is observable (the reason OpenSSL gave); the aiohttp test runs the real listener shape
(``TCPSite(ssl_context=reloader.context)``). In TLS 1.3 the client finishes its handshake before the
server has judged the client certificate, so a refused client sees an EOF/reset on its first read,
and the assertion that matters is the server's reason and that no application data flowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
import ssl
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gateway import ca_store
from gateway.client.tls import build_client_context
from gateway.config import Paths
from gateway.core import ca, jose
from gateway.errors import UompError
from gateway.remote.tls import (
    NO_TRUST_LIMITS,
    X509_V_FLAG_NO_CHECK_TIME,
    CertRefused,
    ClientCertChecker,
    TLSReloader,
    build_server_context,
    check_client_cert,
    install_sighup,
)
from tests.certutil import CertSet, make_cert_set

TIMEOUT = 5.0


def _peer_der(ssl_object: ssl.SSLObject | None) -> bytes | None:
    """The client certificate of a connection, as the gateway reads it (None: not TLS or none sent)."""
    return ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None


class Harness:
    """An asyncio TLS server: greets with ``OK <agent> <serial>`` or ``ERR <code> <message>``,
    then answers each ``PING`` with ``PONG``."""

    def __init__(self, ctx: ssl.SSLContext, reloader: TLSReloader | None = None) -> None:
        self.ctx = ctx
        self.reloader = reloader  # when set, the greeting and WHO judge the peer against reloader.trust
        self.failures: list[BaseException] = []
        self.checker = ClientCertChecker()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Harness:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await writer.start_tls(self.ctx)
        except (ssl.SSLError, OSError) as exc:
            self.failures.append(exc)
            writer.close()
            return
        try:
            ident = self.checker.check(_peer_der(writer.get_extra_info("ssl_object")), trust=self._trust())
            writer.write(f"OK {ident.agent_id} {ident.serial} {ident.x5t_s256}\n".encode())
        except UompError as exc:
            writer.write(f"ERR {exc.code} {exc.message}\n".encode())
        try:
            await writer.drain()
            while line := await reader.readline():
                if line.strip() == b"PING":
                    writer.write(b"PONG\n")
                elif line.strip() == b"WHO" and self.reloader is not None:
                    try:
                        ident = self.checker.check(_peer_der(writer.get_extra_info("ssl_object")), trust=self._trust())
                        writer.write(f"OK {ident.agent_id}\n".encode())
                    except UompError as exc:
                        writer.write(f"ERR {exc.code} {exc.message}\n".encode())
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    def _trust(self):  # type: ignore[no-untyped-def]
        return self.reloader.trust if self.reloader is not None else NO_TRUST_LIMITS

    async def failure(self) -> BaseException:
        for _ in range(200):
            if self.failures:
                return self.failures[-1]
            await asyncio.sleep(0.01)
        raise AssertionError("the server recorded no handshake failure")


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, greeting: str) -> None:
        self.reader, self.writer, self.greeting = reader, writer, greeting

    async def ping(self, word: str = "PING") -> str:
        self.writer.write(word.encode() + b"\n")
        await self.writer.drain()
        return (await asyncio.wait_for(self.reader.readline(), TIMEOUT)).decode().strip()

    def close(self) -> None:
        self.writer.close()


async def connect(ctx: ssl.SSLContext, port: int, server_hostname: str = "127.0.0.1") -> Conn:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=server_hostname), TIMEOUT
    )
    greeting = (await asyncio.wait_for(reader.readline(), TIMEOUT)).decode().strip()
    return Conn(reader, writer, greeting)


async def refused(ctx: ssl.SSLContext, port: int) -> None:
    """The connection must not get a greeting: it fails in the handshake or reads EOF."""
    try:
        conn = await connect(ctx, port)
    except (ssl.SSLError, ConnectionError):
        return
    conn.close()
    assert conn.greeting == "", f"expected a refused connection, got {conn.greeting!r}"


@pytest.fixture
def certs(tmp_path: Path) -> CertSet:
    return make_cert_set(tmp_path / "certs")


@pytest.fixture
async def harness(certs: CertSet) -> AsyncIterator[Harness]:
    ctx = build_server_context(certs.server_cert, certs.server_key, certs.ca_cert, certs.crl)
    h = await Harness(ctx).start()
    yield h
    await h.stop()


# ------------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("variant", ["good", "ed25519"])
async def test_good_cert_is_accepted_and_identified(certs: CertSet, harness: Harness, variant: str) -> None:
    conn = await connect(certs.client_context(variant), harness.port)
    a = certs.agents[variant]
    assert conn.greeting == f"OK agent-1 {a.serial} {jose.cert_thumbprint(a.der)}"
    assert await conn.ping() == "PONG"
    conn.close()
    assert harness.failures == []


async def test_longest_agent_id_works_over_tls(tmp_path: Path) -> None:
    """128-character id: empty subject + critical SAN must pass OpenSSL's strict checks."""
    long_id = "x" * 128
    certs = make_cert_set(tmp_path / "long", agent_id=long_id, variants=("good",))
    h = await Harness(build_server_context(certs.server_cert, certs.server_key, certs.ca_cert, certs.crl)).start()
    try:
        conn = await connect(certs.client_context("good"), h.port)
        assert conn.greeting.startswith(f"OK {long_id} ")
        conn.close()
    finally:
        await h.stop()


async def test_sni_and_ip_clients_both_work_through_reloader(certs: CertSet) -> None:
    reloader = TLSReloader(certs.server_cert, certs.server_key, certs.ca_cert, certs.crl)
    h = await Harness(reloader.context).start()
    try:
        for name in ("localhost", "127.0.0.1"):  # SNI sent / no SNI (IP address)
            conn = await connect(certs.client_context("good"), h.port, server_hostname=name)
            assert conn.greeting.startswith("OK agent-1 ")
            conn.close()
    finally:
        await h.stop()


async def test_no_client_cert_under_cert_optional_reaches_app_as_cert_required(
    certs: CertSet, harness: Harness
) -> None:
    conn = await connect(certs.client_context(None), harness.port)
    assert conn.greeting == "ERR CERT_REQUIRED no client certificate was presented"
    conn.close()
    assert harness.failures == []


async def test_no_client_cert_under_cert_required_fails_handshake(certs: CertSet) -> None:
    ctx = build_server_context(certs.server_cert, certs.server_key, certs.ca_cert, certs.crl, require_client_cert=True)
    h = await Harness(ctx).start()
    try:
        await refused(certs.client_context(None), h.port)
        exc = await h.failure()
        assert isinstance(exc, ssl.SSLError) and exc.reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE"
        ok = await connect(certs.client_context("good"), h.port)
        assert ok.greeting.startswith("OK agent-1 ")
        ok.close()
    finally:
        await h.stop()


# -------------------------------------------------------------------------------- refused


async def test_tls12_only_client_is_refused(certs: CertSet, harness: Harness) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(certs.ca_cert)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    a = certs.agents["good"]
    ctx.load_cert_chain(a.cert_file, a.key_file)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await connect(ctx, harness.port)
    exc = await harness.failure()
    assert isinstance(exc, ssl.SSLError) and exc.reason == "UNSUPPORTED_PROTOCOL"


HANDSHAKE_REFUSALS = [
    # (variant, OpenSSL's verify message on the server)
    ("wrong_ca", "unable to get local issuer certificate"),
    ("wrong_ca_expired", "unable to get local issuer certificate"),
    ("server_eku", "unsuitable certificate purpose"),
]


@pytest.mark.parametrize(("variant", "reason"), HANDSHAKE_REFUSALS, ids=[v for v, _ in HANDSHAKE_REFUSALS])
async def test_bad_client_cert_fails_handshake(certs: CertSet, harness: Harness, variant: str, reason: str) -> None:
    await refused(certs.client_context(variant), harness.port)
    exc = await harness.failure()
    assert isinstance(exc, ssl.SSLCertVerificationError)
    assert exc.verify_message == reason


TIME_REFUSALS = [
    # (variant, reason, words): our CA's certificates that complete the handshake and are refused by name
    ("expired", "expired", "expired on "),
    ("not_yet_valid", "not_yet_valid", "is not valid before "),
]


@pytest.mark.parametrize(("variant", "reason", "words"), TIME_REFUSALS, ids=[v for v, _, _ in TIME_REFUSALS])
async def test_our_cert_out_of_its_validity_completes_the_handshake_and_is_refused_by_name(
    certs: CertSet, harness: Harness, variant: str, reason: str, words: str
) -> None:
    conn = await connect(certs.client_context(variant), harness.port)
    serial = certs.agents[variant].serial
    assert conn.greeting.startswith(
        f"ERR CERT_REQUIRED the client certificate (agent agent-1, serial 0x{serial}) {words}"
    )
    conn.close()
    assert not harness.failures  # the handshake itself succeeded
    with pytest.raises(CertRefused) as err:
        check_client_cert(certs.agents[variant].der)
    assert err.value.reason == reason and err.value.body()["error"]["reason"] == reason


async def test_certutil_revoke_helper(certs: CertSet) -> None:
    certs.revoke("good")
    reloader = TLSReloader(certs.server_cert, certs.server_key, certs.ca_cert, certs.crl)
    h = await Harness(reloader.context, reloader).start()
    try:
        conn = await connect(certs.client_context("good"), h.port)  # the handshake completes...
        assert conn.greeting.startswith(  # ...and the certificate is refused by name
            f"ERR CERT_REQUIRED the client certificate (agent agent-1, serial 0x{certs.agents['good'].serial}) "
            "was revoked on "
        ), conn.greeting
        conn.close()
        assert not h.failures
        ok = await connect(certs.client_context("ed25519"), h.port)
        assert ok.greeting.startswith("OK agent-1 ")
        ok.close()
    finally:
        await h.stop()


async def test_gateway_server_cert_cannot_be_used_as_client_cert(certs: CertSet, harness: Harness) -> None:
    ctx = build_client_context(certs.ca_cert, certs.server_cert, certs.server_key)
    await refused(ctx, harness.port)
    exc = await harness.failure()
    assert isinstance(exc, ssl.SSLCertVerificationError)
    assert exc.verify_message == "unsuitable certificate purpose"


APP_REFUSALS = [
    # (variant, message from check_client_cert): OpenSSL accepts these, the gateway does not.
    ("no_eku", "the client certificate is not for client authentication (no clientAuth extended key usage)"),
    ("no_san", "the client certificate names no agent (needs one uomp://agent/<id> URI SAN)"),
]


@pytest.mark.parametrize(("variant", "message"), APP_REFUSALS, ids=[v for v, _ in APP_REFUSALS])
async def test_cert_refused_by_check_client_cert(certs: CertSet, harness: Harness, variant: str, message: str) -> None:
    conn = await connect(certs.client_context(variant), harness.port)
    assert conn.greeting == f"ERR CERT_REQUIRED {message}"
    conn.close()


async def test_client_refuses_server_with_wrong_name(certs: CertSet, harness: Harness) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        await connect(certs.client_context("good"), harness.port, server_hostname="not-the-gateway.example")


async def test_client_refuses_server_from_another_ca(certs: CertSet, harness: Harness) -> None:
    a = certs.agents["good"]
    ctx = build_client_context(certs.other_ca_cert, a.cert_file, a.key_file)
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        await connect(ctx, harness.port)


# ----------------------------------------------------------------- revocation and reloading


@pytest.fixture
def ca_home(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "home")
    ca_store.init_all(paths)
    return paths


def _reloader(paths: Paths) -> TLSReloader:
    return TLSReloader(
        ca_store.server_cert_path(paths),
        ca_store.server_key_path(paths),
        ca_store.ca_cert_path(paths),
        ca_store.crl_path(paths),
    )


def _agent_ctx(paths: Paths, out: Path) -> ssl.SSLContext:
    return build_client_context(ca_store.ca_cert_path(paths), out / "agent.crt", out / "agent.key")


async def _until(pred: object, what: str) -> None:
    assert callable(pred)
    for _ in range(300):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_revoked_cert_refused_after_crl_reload_while_live_connection_survives(
    ca_home: Paths, tmp_path: Path
) -> None:
    ca_store.issue_with_key(ca_home, "bot", tmp_path / "bot")
    ca_store.issue_with_key(ca_home, "other", tmp_path / "other")
    reloader = _reloader(ca_home)
    h = await Harness(reloader.context, reloader).start()
    watcher = asyncio.create_task(reloader.watch(0.02))
    try:
        live = await connect(_agent_ctx(ca_home, tmp_path / "bot"), h.port)
        assert live.greeting.startswith("OK bot ")

        revoked = ca_store.revoke(ca_home, "bot")  # the CLI's path: new CRL written atomically
        assert len(revoked) == 1
        await _until(lambda: reloader.generation >= 1, "the watcher to reload the CRL")

        again = await connect(_agent_ctx(ca_home, tmp_path / "bot"), h.port)
        assert again.greeting.startswith("ERR CERT_REQUIRED the client certificate (agent bot, serial 0x")
        assert " was revoked on " in again.greeting and not h.failures
        again.close()

        assert await live.ping() == "PONG"  # the connection made before the reload is untouched at TLS...
        # ...and the application layer refuses the revoked agent on it
        assert (await live.ping("WHO")).startswith("ERR CERT_REQUIRED the client certificate (agent bot, serial 0x")
        assert reloader.revoked == set(revoked)
        other = await connect(_agent_ctx(ca_home, tmp_path / "other"), h.port)
        assert other.greeting.startswith("OK other ")  # unrelated agents keep working
        assert await other.ping("WHO") == "OK other"
        other.close()
        live.close()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await h.stop()


async def test_without_reload_the_old_crl_still_applies(ca_home: Paths, tmp_path: Path) -> None:
    """The partner of the test above: proves the reload is what made the difference."""
    ca_store.issue_with_key(ca_home, "bot", tmp_path / "bot")
    reloader = _reloader(ca_home)
    h = await Harness(reloader.context, reloader).start()
    try:
        ca_store.revoke(ca_home, "bot")
        assert reloader.changed()
        conn = await connect(_agent_ctx(ca_home, tmp_path / "bot"), h.port)
        assert conn.greeting.startswith("OK bot ")
        conn.close()
        assert reloader.reload_if_changed() is True
        conn = await connect(_agent_ctx(ca_home, tmp_path / "bot"), h.port)
        assert conn.greeting.startswith("ERR CERT_REQUIRED the client certificate (agent bot, serial 0x")
        conn.close()
        assert reloader.reload_if_changed() is False
    finally:
        await h.stop()


async def test_failed_reload_keeps_serving_with_previous_context(ca_home: Paths, tmp_path: Path) -> None:
    ca_store.issue_with_key(ca_home, "bot", tmp_path / "bot")
    reloader = _reloader(ca_home)
    h = await Harness(reloader.context).start()
    try:
        crl = ca_store.crl_path(ca_home)
        good = crl.read_bytes()
        crl.write_bytes(b"-----BEGIN X509 CRL-----\nnot a crl\n-----END X509 CRL-----\n")
        with pytest.raises(UompError) as err:
            reloader.reload()
        assert err.value.code == "CONFIG_ERROR" and "keeping the previous certificates" in err.value.message
        assert reloader.generation == 0
        conn = await connect(_agent_ctx(ca_home, tmp_path / "bot"), h.port)
        assert conn.greeting.startswith("OK bot ")
        conn.close()
        crl.write_bytes(good)
        reloader.reload()
        assert reloader.generation == 1
    finally:
        await h.stop()


async def test_server_cert_reload_is_picked_up(ca_home: Paths, tmp_path: Path) -> None:
    """A re-issued gateway certificate (new host name) is served to new handshakes."""
    ca_store.issue_with_key(ca_home, "bot", tmp_path / "bot")
    reloader = _reloader(ca_home)
    h = await Harness(reloader.context).start()
    try:
        ctx = _agent_ctx(ca_home, tmp_path / "bot")
        with pytest.raises(ssl.SSLCertVerificationError):
            await connect(ctx, h.port, server_hostname="gw.example.org")
        ca_store.init_all(ca_home, ["gw.example.org"])
        assert reloader.reload_if_changed()
        conn = await connect(ctx, h.port, server_hostname="gw.example.org")
        assert conn.greeting.startswith("OK bot ")
        conn.close()
    finally:
        await h.stop()


async def test_sighup_reloads(ca_home: Paths) -> None:
    reloader = _reloader(ca_home)
    loop = asyncio.get_running_loop()
    assert install_sighup(loop, reloader)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        await _until(lambda: reloader.generation == 1, "SIGHUP reload")
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


class _ThreadNoting(TLSReloader):
    """A real reloader that notes which thread each reload ran on."""

    def __init__(self, paths: Paths) -> None:
        self.threads: list[int] = []
        super().__init__(
            ca_store.server_cert_path(paths),
            ca_store.server_key_path(paths),
            ca_store.ca_cert_path(paths),
            ca_store.crl_path(paths),
            crl_state=paths.home / "crl-state.json",
        )

    def _reload(self) -> None:
        self.threads.append(threading.get_ident())
        super()._reload()


async def test_sighup_reload_runs_off_the_event_loop(ca_home: Paths) -> None:
    """A reload reads four files and fsyncs the CRL state: never on the loop that serves requests."""
    reloader = _ThreadNoting(ca_home)
    loop = asyncio.get_running_loop()
    assert install_sighup(loop, reloader)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        await _until(lambda: reloader.generation == 1, "SIGHUP reload")
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
    assert reloader.threads and threading.get_ident() not in reloader.threads


async def test_watch_reload_runs_off_the_event_loop(ca_home: Paths) -> None:
    reloader = _ThreadNoting(ca_home)
    task = asyncio.create_task(reloader.watch(0.01))
    try:
        await asyncio.sleep(0)
        ca_store.refresh_crl(ca_home, min_remaining=dt.timedelta(days=30))  # a new CRL: the watcher reloads
        await _until(lambda: reloader.generation >= 1, "watch reload")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert reloader.threads and threading.get_ident() not in reloader.threads
    assert reloader.reload_if_changed() is False  # nothing new; the direct call still works (blocking)


async def test_watch_tick_errors_are_not_fatal(ca_home: Paths) -> None:
    reloader = _reloader(ca_home)
    calls: list[int] = []

    def tick() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        ca_store.refresh_crl(ca_home, min_remaining=dt.timedelta(days=30))  # forces a re-sign

    task = asyncio.create_task(reloader.watch(0.01, tick=tick))
    try:
        await _until(lambda: reloader.generation >= 1, "reload after the CRL refresh")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert len(calls) >= 2


# ------------------------------------------------------------------------------- aiohttp


async def test_aiohttp_listener_with_reloader(ca_home: Paths, tmp_path: Path) -> None:
    """The gateway's shape: aiohttp on the reloader's front context, identity checked per request."""
    ca_store.issue_with_key(ca_home, "bot", tmp_path / "bot")
    reloader = _reloader(ca_home)
    checker = ClientCertChecker()

    async def whoami(request: web.Request) -> web.Response:
        try:
            ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
            ident = checker.check(_peer_der(ssl_object), trust=reloader.trust)
        except UompError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return web.json_response({"agent_id": ident.agent_id, "serial": ident.serial})

    app = web.Application()
    app.router.add_get("/whoami", whoami)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=reloader.context)
    await site.start()
    assert site._server is not None
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"https://localhost:{port}/whoami"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url, ssl=_agent_ctx(ca_home, tmp_path / "bot")) as r:
                assert r.status == 200
                assert (await r.json())["agent_id"] == "bot"
            async with s.get(url, ssl=build_client_context(ca_store.ca_cert_path(ca_home))) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "CERT_REQUIRED"
        # keep one connection open across the revocation
        live = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        live_ctx = _agent_ctx(ca_home, tmp_path / "bot")  # same context object = same pooled connection
        try:
            async with live.get(url, ssl=live_ctx) as r:
                assert r.status == 200
            ca_store.revoke(ca_home, "bot")
            reloader.reload()
            async with aiohttp.ClientSession() as fresh:
                async with fresh.get(url, ssl=_agent_ctx(ca_home, tmp_path / "bot")) as r:
                    assert r.status == 401  # the handshake completes; the request is refused by name
                    assert (await r.json())["error"]["reason"] == "revoked"
            async with live.get(url, ssl=live_ctx) as r:
                assert r.status == 401  # pooled keep-alive connection, made before the reload: judged again
        finally:
            await live.close()
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------------------- settings


def test_server_context_settings(certs: CertSet) -> None:
    ctx = build_server_context(certs.server_cert, certs.server_key, certs.ca_cert, certs.crl)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_OPTIONAL
    # time and revocation are judged after the handshake (judge()), so the refusal can name the certificate
    assert not ctx.verify_flags & ssl.VERIFY_CRL_CHECK_LEAF
    assert ctx.verify_flags & X509_V_FLAG_NO_CHECK_TIME
    assert ctx.verify_flags & ssl.VERIFY_X509_STRICT
    assert ctx.options & ssl.OP_NO_COMPRESSION
    assert ctx.num_tickets == 0
    stats = ctx.cert_store_stats()
    assert stats["x509_ca"] == 1 and stats["crl"] == 0  # the user CA only, no system roots; the CRL is ours
    strict = build_server_context(
        certs.server_cert, certs.server_key, certs.ca_cert, certs.crl, require_client_cert=True
    )
    assert strict.verify_mode == ssl.CERT_REQUIRED


def test_client_context_settings(certs: CertSet) -> None:
    ctx = build_client_context(certs.ca_cert)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.cert_store_stats()["x509_ca"] == 1


def test_missing_crl_is_an_error(certs: CertSet, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        TLSReloader(certs.server_cert, certs.server_key, certs.ca_cert, tmp_path / "nope.pem")


# ------------------------------------------------------------------- check_client_cert unit


def _utc(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def test_check_client_cert_messages(certs: CertSet) -> None:
    good = certs.agents["good"]
    ident = check_client_cert(good.der)
    assert ident.agent_id == "agent-1"
    assert ident.serial == good.serial
    assert ident.x5t_s256 == jose.cert_thumbprint(good.der)
    assert ident.jkt == jose.key_thumbprint(good.cert.public_key())  # type: ignore[arg-type]
    named = f"the client certificate (agent agent-1, serial 0x{good.serial})"
    cases: list[tuple[bytes | None, dt.datetime | None, str]] = [
        (None, None, "no client certificate was presented"),
        (b"", None, "no client certificate was presented"),
        (b"\x30\x03garbage", None, "the client certificate cannot be parsed"),
        (
            good.der,
            ident.not_after + dt.timedelta(seconds=1),
            f"{named} expired on {_utc(ident.not_after)}; ask the user for a new one",
        ),
        (
            good.der,
            ident.not_before - dt.timedelta(seconds=1),
            f"{named} is not valid before {_utc(ident.not_before)}; check the clock of this machine and the gateway's",
        ),
        (certs.agents["no_eku"].der, None, APP_REFUSALS[0][1]),
        (certs.agents["server_eku"].der, None, APP_REFUSALS[0][1]),
        (certs.agents["no_san"].der, None, APP_REFUSALS[1][1]),
    ]
    for der, now, message in cases:
        with pytest.raises(UompError) as err:
            check_client_cert(der, now=now)
        assert err.value.code == "CERT_REQUIRED" and err.value.message == message


def test_checker_cache_still_checks_time(certs: CertSet) -> None:
    checker = ClientCertChecker(max_entries=2)
    good = certs.agents["good"]
    first = checker.check(good.der)
    assert checker.check(good.der) is first
    with pytest.raises(CertRefused, match="expired on"):
        checker.check(good.der, now=first.not_after + dt.timedelta(minutes=1))
    for _ in range(2):  # cached refusals raise the same error each time
        with pytest.raises(UompError, match="names no agent"):
            checker.check(certs.agents["no_san"].der)
    checker.check(certs.agents["ed25519"].der)
    assert len(checker._cache) == 2  # bounded


def test_expiry_is_rechecked_on_long_lived_connections(certs: CertSet) -> None:
    """Check_client_cert takes ``now``: the gateway re-checks per request on keep-alive connections."""
    ident = check_client_cert(certs.agents["good"].der)
    assert ident.not_after - ident.not_before == ca.AGENT_CERT_LIFETIME + ca.CLOCK_SKEW


# ------------------------------------------------------------------ TLS 1.3 resumption


def _get_over_tls(
    ctx: ssl.SSLContext, port: int, path: str, headers: dict[str, str], session: ssl.SSLSession | None = None
) -> tuple[bool, ssl.SSLSession | None, int, bytes]:
    """One blocking connection (the stdlib client can offer a session; asyncio's cannot): TLS 1.3
    handshake (resuming ``session`` if given), one GET with Connection: close, the whole answer.
    Returns (resumed, the session to offer next time, HTTP status, body)."""
    import socket

    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost", session=session) as tls,
    ):
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost:{port}\r\n{head}Connection: close\r\n\r\n".encode())
        data = b""
        try:
            while chunk := tls.recv(65536):
                data += chunk
        except (ssl.SSLError, ConnectionError):
            pass  # a refused TLS 1.3 client learns it on its first read (see the module docstring)
        if not data:
            return tls.session_reused, None, 0, b""  # no answer at all
        status = int(data.split(b" ", 2)[1])
        return tls.session_reused, tls.session, status, data.partition(b"\r\n\r\n")[2]


async def test_returning_agent_resumes_and_a_revoked_one_is_refused_at_its_next_request(home: Paths) -> None:
    import json

    from gatewaykit import appliance

    async with appliance(home) as app:
        assert app.gateway.cfg.tls_session_tickets >= 1  # the default: tickets on
        bot, other = app.agent("bot"), app.agent("other")
        hdrs = {}
        for agent in (bot, other):
            tok = (await app.grant(agent))["token"]
            hdrs[agent.agent_id] = {"Authorization": f"Bearer {tok}", "X-UOMP-Agent-Id": agent.agent_id}
        ctx = {a.agent_id: a.ssl() for a in (bot, other)}
        port, path = app.gateway.port, "/v1/memory/preference.theme"

        resumed, sess, status, _ = await asyncio.to_thread(_get_over_tls, ctx["bot"], port, path, hdrs["bot"])
        assert (resumed, status) == (False, 200) and sess is not None and sess.has_ticket
        resumed, sess2, status, _ = await asyncio.to_thread(_get_over_tls, ctx["bot"], port, path, hdrs["bot"], sess)
        assert (resumed, status) == (True, 200)  # the returning agent skipped the certificate exchange
        _, other_sess, status, _ = await asyncio.to_thread(_get_over_tls, ctx["other"], port, path, hdrs["other"])
        assert status == 200

        ca_store.revoke(app.paths, "bot")
        app.gateway.reloader.reload()  # what the watcher does within a second of the new CRL
        # the resumed handshake still succeeds at the TLS layer (no verification on resumption)...
        resumed, _, status, body = await asyncio.to_thread(_get_over_tls, ctx["bot"], port, path, hdrs["bot"], sess2)
        assert resumed is True
        # ...and its first request is refused: the per-request check against the live CRL
        err = json.loads(body)["error"]
        assert status == 401 and (err["code"], err["reason"]) == ("CERT_REQUIRED", "revoked"), body
        # a full handshake with the revoked certificate completes too, and gets the same named 401
        resumed, _, status, body = await asyncio.to_thread(_get_over_tls, ctx["bot"], port, path, hdrs["bot"])
        assert (resumed, status) == (False, 401) and json.loads(body)["error"]["reason"] == "revoked", body
        # another agent's resumed session is untouched
        resumed, _, status, _ = await asyncio.to_thread(
            _get_over_tls, ctx["other"], port, path, hdrs["other"], other_sess
        )
        assert (resumed, status) == (True, 200)


async def test_no_resumption_when_tickets_are_off(home: Paths) -> None:
    from gatewaykit import appliance

    async with appliance(home, tls_session_tickets=0) as app:
        bot = app.agent("bot")
        tok = (await app.grant(bot))["token"]
        hdrs = {"Authorization": f"Bearer {tok}", "X-UOMP-Agent-Id": "bot"}
        ctx, port = bot.ssl(), app.gateway.port
        resumed, sess, status, _ = await asyncio.to_thread(_get_over_tls, ctx, port, "/v1/health", hdrs)
        assert (resumed, status) == (False, 200)
        resumed, _, status, _ = await asyncio.to_thread(_get_over_tls, ctx, port, "/v1/health", hdrs, sess)
        assert (resumed, status) == (False, 200)  # no ticket was sent: every connection is a full handshake


# ------------------------------------------------------- what OpenSSL no longer checks: CA, CRL


def _expired_ca(certs: CertSet, out: Path) -> Path:
    """The cert set's CA key in a CA certificate that expired an hour ago (same name and key)."""
    key = ca.load_private_key(certs.ca_key_file.read_bytes())
    _, cert = ca.create_ca(key, now=ca.utcnow() - dt.timedelta(hours=3), validity=dt.timedelta(hours=2))
    out.write_bytes(ca.cert_pem(cert))
    return out


def test_an_expired_agent_ca_refuses_the_start_and_a_reload_keeps_the_previous(certs: CertSet, tmp_path: Path) -> None:
    expired = _expired_ca(certs, tmp_path / "expired-ca.crt")
    with pytest.raises(UompError) as err:
        TLSReloader(certs.server_cert, certs.server_key, expired, certs.crl)
    assert err.value.code == "CA_ERROR"
    assert f"the agent CA certificate {expired} expired on " in err.value.message
    # the partner: the same files with the valid CA start, and a reload onto the expired CA is refused
    live = tmp_path / "ca.crt"
    live.write_bytes(certs.ca_cert.read_bytes())
    reloader = TLSReloader(certs.server_cert, certs.server_key, live, certs.crl)
    before = reloader.current
    live.write_bytes(expired.read_bytes())
    with pytest.raises(UompError) as err:
        reloader.reload()
    assert err.value.code == "CA_ERROR" and reloader.current is before and reloader.generation == 0


def test_a_crl_not_signed_by_the_agent_ca_is_refused(certs: CertSet, tmp_path: Path) -> None:
    crl = tmp_path / "crl.pem"
    crl.write_bytes(certs.crl.read_bytes())
    reloader = TLSReloader(certs.server_cert, certs.server_key, certs.ca_cert, crl)
    other_key, other_ca = ca.create_ca()
    crl.write_bytes(ca.crl_pem(ca.build_crl(other_key, other_ca, [], ca.utcnow() + dt.timedelta(seconds=5))))
    with pytest.raises(UompError) as err:
        reloader.reload()
    assert err.value.code == "CONFIG_ERROR" and "is not signed by the agent CA" in err.value.message
    assert reloader.generation == 0


def test_judge_fails_closed_when_the_ca_or_the_crl_is_out_of_date(certs: CertSet) -> None:
    from gateway.remote.tls import Trust, judge

    ident = check_client_cert(certs.agents["good"].der)
    now = ca.utcnow()
    hour = dt.timedelta(hours=1)
    judge(ident, Trust(ca_not_before=now - hour, ca_not_after=now + hour, crl_next_update=now + hour), now)
    for trust, reason in (
        (Trust(ca_not_before=now - 2 * hour, ca_not_after=now - hour), "ca_invalid"),
        (Trust(ca_not_before=now + hour, ca_not_after=now + 2 * hour), "ca_invalid"),
        (Trust(crl_next_update=now - dt.timedelta(seconds=1)), "crl_expired"),
        (Trust(revoked=frozenset({ident.serial})), "revoked"),
    ):
        with pytest.raises(CertRefused) as err:
            judge(ident, trust, now)
        assert err.value.reason == reason and err.value.status == 401
        assert trust.open_at(now.timestamp()) is (reason == "revoked")
