"""A client certificate of the user's agent CA that is revoked, expired or not yet valid completes
the TLS handshake and is refused by name at its first request, on the real appliance (guard on a
Unix socket, gateway with real TLS 1.3, certificates made here):

* a JSON 401 CERT_REQUIRED with ``reason`` and the agent and serial named, ``Connection: close``,
  the connection closed after the answer, nothing forwarded to the guard, on every route;
* a connection of such a certificate that sends nothing is closed after a short idle, and it is
  never in the verified budget (it counts in its address's budget like a handshake in progress);
* the log line, the metric, the one log's events and the dashboard name the agent and the serial;
* certificates that do not chain to our CA (even expired ones), wrong purpose and TLS 1.2 are still
  refused in the handshake; a good certificate is not refused anywhere.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gatewaykit import Agent, Appliance, agent_call, appliance, ledger_events

from gateway import ca_store
from gateway.client.tls import build_client_context
from gateway.config import Paths
from gateway.core import ca
from gateway.dashboard.data import Filters, timeline
from gateway.remote.transport import REFUSED_CERT_IDLE_SECONDS

WAIT = 10.0


def _our_cert(paths: Paths, out: Path, variant: str, agent_id: str = "bot") -> tuple[ssl.SSLContext, str, Path, Path]:
    """A client context with a certificate of the appliance's CA (``expired``/``not_yet_valid``/``good``)
    or another CA's (``foreign``, ``foreign_expired``): (context, serial hex, cert file, key file)."""
    now = ca.utcnow()
    key = ca.new_key()
    ca_key, ca_cert = ca_store.load_ca(paths)
    if variant.startswith("foreign"):
        ca_key, ca_cert = ca.create_ca()
    if variant.endswith("expired"):
        cert = ca.issue_agent_cert(
            ca_key, ca_cert, key.public_key(), agent_id, dt.timedelta(hours=1), now=now - dt.timedelta(hours=2)
        )
    elif variant == "not_yet_valid":
        cert = ca.issue_agent_cert(ca_key, ca_cert, key.public_key(), agent_id, now=now + dt.timedelta(days=1))
    else:
        cert = ca.issue_agent_cert(ca_key, ca_cert, key.public_key(), agent_id, now=now)
    out.mkdir(parents=True, exist_ok=True)
    crt, kf = out / f"{variant}.crt", out / f"{variant}.key"
    crt.write_bytes(ca.cert_pem(cert))
    kf.write_bytes(ca.key_pem(key))
    return build_client_context(ca_store.ca_cert_path(paths), crt, kf), ca.serial_hex(cert.serial_number), crt, kf


def _revoked(app: Appliance, agent_id: str = "bot") -> tuple[Agent, str]:
    agent = app.agent(agent_id)
    serial = ca.serial_hex(ca.load_cert(agent.files.cert_file.read_bytes()).serial_number)
    ca_store.revoke(app.paths, agent_id)
    app.gateway.reload()
    return agent, serial


async def _raw(port: int, ctx: ssl.SSLContext, request: bytes | None, answers: int = 0) -> tuple[bytes, bool]:
    """One connection: send ``request`` (None: nothing), read until the server closes it (bounded),
    or until ``answers`` whole JSON answers are in. Returns (everything read, whether the server
    closed the connection)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost"), WAIT
    )
    data, closed = b"", False
    try:
        if request is not None:
            writer.write(request)
            await writer.drain()
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), WAIT)
            if not chunk:
                closed = True
                break
            data += chunk
            if answers and data.count(b"HTTP/1.1 ") >= answers and data.endswith(b"}"):
                break
    except (ConnectionError, ssl.SSLError):
        closed = True
    except TimeoutError:
        pass
    finally:
        writer.close()
    return data, closed


def _answer(data: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, json.loads(body)


def _get(path: str, headers: dict[str, str] | None = None) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n".encode()


async def _until(pred: Any, what: str) -> Any:
    for _ in range(400):
        got = pred()
        if got:
            return got
        await asyncio.sleep(0.025)
    raise AssertionError(f"timed out waiting for {what}")


def _reads_forwarded(app: Appliance) -> list[dict[str, Any]]:
    """Events the guard wrote for reads forwarded to it (action ``read``; the gateway's own refusals
    carry the route's name, ``read_key``)."""
    return ledger_events(app.paths, action="read")


async def test_revoked_certificate_gets_a_named_401_then_the_close(
    home: Paths, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="uomp.gateway")
    async with appliance(home) as app:
        good = app.agent("good")
        tok = (await app.grant(good))["token"]
        port = app.gateway.port
        assert port is not None
        path = "/v1/memory/preference.theme"
        hdrs = {"Authorization": f"Bearer {tok}", "X-UOMP-Agent-Id": "good"}
        # the partner first: a good certificate is answered and the connection stays open
        data, closed = await _raw(port, good.ssl(), _get(path, hdrs) + _get(path, hdrs), answers=2)
        assert data.count(b"HTTP/1.1 200 OK") == 2 and not closed
        forwarded = len(_reads_forwarded(app))
        assert forwarded >= 1

        bot, serial = _revoked(app)
        data, closed = await _raw(port, bot.ssl(), _get(path, hdrs) + _get(path, hdrs))
        status, headers, body = _answer(data)
        assert status == 401 and closed
        assert data.count(b"HTTP/1.1 ") == 1  # the second request on the connection got nothing
        assert headers["connection"] == "close"
        err = body["error"]
        assert (err["code"], err["reason"]) == ("CERT_REQUIRED", "revoked")
        assert err["details"] == {"agent_id": "bot", "serial": serial}
        assert re.fullmatch(
            rf"the client certificate \(agent bot, serial 0x{serial}\) was revoked on "
            r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC; ask the user for a new one",
            err["message"],
        ), err["message"]
        # nothing reached the guard: no read was forwarded for the revoked agent
        assert len(_reads_forwarded(app)) == forwarded
        # named in the log line, the metric and the one log (the handshake and the request)
        lines = [r.getMessage() for r in caplog.records if "TLS client certificate refused" in r.getMessage()]
        assert lines == [
            f"TLS client certificate refused on mtls from 127.0.0.1: revoked (agent bot, serial 0x{serial})"
            "; the agent's certificate is on the CRL (uomp agent list); it is told so in a 401"
        ], lines
        metrics = app.gateway.state.metrics  # type: ignore[union-attr]
        assert 'uomp_gateway_tls_handshakes_rejected_total{listener="mtls",reason="revoked"} 1' in metrics.render()
        hs = await _until(lambda: ledger_events(app.paths, action="tls_handshake"), "the handshake event")
        assert (hs[0]["agent_id"], hs[0]["cert_serial"], hs[0]["detail"]) == ("bot", serial, "revoked")
        # (refused before routing: the request's event has no route)
        req = await _until(lambda: ledger_events(app.paths, code="CERT_REQUIRED", status=401), "the 401 event")
        assert (req[0]["agent_id"], req[0]["cert_serial"], req[0]["allowed"]) == ("bot", serial, False)
        assert req[0]["reason"] == err["message"]
        # the dashboard's audit view names the agent, and says why in plain words
        rows = [r for r in timeline(app.paths, Filters(agent="bot")) if not r["allowed"]]
        assert {r["action"] for r in rows} == {"tls_handshake", "unknown"}, rows
        shown = next(r for r in rows if r["action"] == "tls_handshake")
        assert shown["agent_id"] == "bot" and shown["explained"].startswith("The agent's certificate is revoked")


@pytest.mark.parametrize(
    ("variant", "reason", "words"),
    [("expired", "expired", " expired on "), ("not_yet_valid", "not_yet_valid", " is not valid before ")],
)
async def test_out_of_validity_certificate_of_our_ca_gets_a_named_401(
    home: Paths, tmp_path: Path, variant: str, reason: str, words: str
) -> None:
    async with appliance(home) as app:
        port = app.gateway.port
        assert port is not None
        ctx, serial, _, _ = _our_cert(home, tmp_path, variant)
        data, closed = await _raw(port, ctx, _get("/v1/health"))
        status, headers, body = _answer(data)
        err = body["error"]
        assert (status, err["code"], err["reason"], closed) == (401, "CERT_REQUIRED", reason, True)
        assert err["message"].startswith(f"the client certificate (agent bot, serial 0x{serial}){words}")
        assert headers["connection"] == "close"


@pytest.mark.parametrize("variant", ["foreign", "foreign_expired", "tls12"])
async def test_certificates_not_of_our_ca_are_still_refused_in_the_handshake(
    home: Paths, tmp_path: Path, variant: str
) -> None:
    async with appliance(home) as app:
        port = app.gateway.port
        assert port is not None
        ctx, _, _, _ = _our_cert(home, tmp_path, "good" if variant == "tls12" else variant)
        if variant == "tls12":
            ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        try:
            data, _ = await _raw(port, ctx, _get("/v1/health"))
        except (ssl.SSLError, ConnectionError):
            data = b""
        assert data == b""  # no HTTP answer at all: the handshake failed
        reg = app.gateway.registry
        await _until(lambda: reg.closed_before_handshake["failed"] >= 1, "the refused handshake")


async def test_a_refused_certificate_that_sends_nothing_is_closed_and_never_verified(home: Paths) -> None:
    # a first-byte deadline far beyond the refused-certificate idle: the close comes from the latter
    async with appliance(home, first_byte_timeout_seconds=60.0) as app:
        port = app.gateway.port
        assert port is not None
        reg = app.gateway.registry
        good = app.agent("good")
        bot, _ = _revoked(app)
        g_reader, g_writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=good.ssl(), server_hostname="localhost"
        )
        await _until(lambda: len(reg.verified) == 1, "the good connection to be verified")
        b_reader, b_writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=bot.ssl(), server_hostname="localhost"
        )
        await _until(lambda: any(c.cert_refused for c in reg.unverified), "the refused connection")
        # the refused connection is in the unverified budget, counted for its address
        assert len(reg.verified) == 1 and len(reg.per_ip.get("127.0.0.1", {})) == 1
        # it is closed by the server without an answer, well before the first-byte deadline...
        got = await asyncio.wait_for(b_reader.read(100), REFUSED_CERT_IDLE_SECONDS * 5)
        assert got == b""
        b_writer.close()
        assert reg.closed_by_deadline["first_byte"] == 1
        # ...while the good one, as idle, is still open and answered
        g_writer.write(_get("/v1/health"))
        await g_writer.drain()
        assert (await asyncio.wait_for(g_reader.readline(), WAIT)).startswith(b"HTTP/1.1 200")
        g_writer.close()


def _sample_path(pattern: str) -> str:
    path = re.sub(r"\(\?P<\w+>\[\^/\]\+\)", "x1", pattern)
    return path.replace("\\", "")


async def test_every_route_refuses_a_revoked_certificate_and_not_a_good_one(home: Paths) -> None:
    async with appliance(home) as app:
        state = app.gateway.state
        assert state is not None
        good = app.agent("good")
        tok = (await app.grant(good))["token"]
        bot, serial = _revoked(app)
        routes = [r for r in state.routes if "mtls" in r.transports]
        assert len(routes) >= 20  # the whole table, gateway-served routes included
        extra = [("GET", "/v1/no-such-route"), ("PATCH", "/v1/health")]  # unknown route, wrong method
        walked = 0
        for method, path in [(r.method, _sample_path(r.pattern.pattern)) for r in routes] + extra:
            for agent, expect_refused in ((bot, True), (good, False)):
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=agent.ssl())) as s:
                    status, body, headers = await agent_call(
                        s, app.base, path, token=tok, agent_id="good", method=method, json_body={}
                    )
                code = body.get("error", {}).get("code") if isinstance(body, dict) else None
                if expect_refused:
                    assert status == 401, (method, path, status, body)
                    assert body["error"]["reason"] == "revoked" and body["error"]["details"]["serial"] == serial
                    assert headers["Connection"] == "close"
                else:
                    assert code != "CERT_REQUIRED", (method, path, status, body)
            walked += 1
        assert walked == len(routes) + len(extra)


async def test_a_keepalive_connection_is_refused_by_name_once_its_certificate_is_revoked(home: Paths) -> None:
    async with appliance(home) as app:
        bot = app.agent("bot")
        tok = (await app.grant(bot))["token"]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=bot.ssl(), limit=1)) as s:
            status, _, _ = await agent_call(s, app.base, "/v1/health", token=None, agent_id=None)
            assert status == 200
            ca_store.revoke(app.paths, "bot")
            app.gateway.reload()
            status, body, headers = await agent_call(s, app.base, "/v1/health", token=tok, agent_id="bot")
            assert (status, body["error"]["reason"], headers["Connection"]) == (401, "revoked", "close")


async def test_curl_shows_the_named_refusal(home: Paths, tmp_path: Path) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    async with appliance(home) as app:
        port = app.gateway.port
        bot, serial = _revoked(app)
        good = app.agent("good")

        def run(agent: Agent) -> subprocess.CompletedProcess[str]:
            f = agent.files
            return subprocess.run(
                [
                    curl,
                    "-sS",
                    "--cacert",
                    str(f.ca_file),
                    "--cert",
                    str(f.cert_file),
                    "--key",
                    str(f.key_file),
                    "-w",
                    "\\n%{http_code}",
                    f"https://localhost:{port}/v1/health",
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )

        out = await asyncio.to_thread(run, bot)
        body, _, code = out.stdout.rpartition("\n")
        assert code == "401", out
        err = json.loads(body)["error"]
        assert err["reason"] == "revoked" and f"(agent bot, serial 0x{serial}) was revoked on " in err["message"]
        ok = await asyncio.to_thread(run, good)
        assert ok.stdout.rpartition("\n")[2] == "200", ok


async def test_refused_certificates_count_in_their_address_budget(home: Paths) -> None:
    async with appliance(home, max_unverified_connections_per_ip=2, first_byte_timeout_seconds=60.0) as app:
        port = app.gateway.port
        assert port is not None
        reg = app.gateway.registry
        good = app.agent("good")
        bot, _ = _revoked(app)
        held = []
        for _ in range(4):  # more than the address's budget, each finishing its handshake
            held.append(await asyncio.open_connection("127.0.0.1", port, ssl=bot.ssl(), server_hostname="localhost"))
            await _until(lambda: reg.accepted >= len(held), "the connection to be counted")
        await _until(lambda: len(reg.per_ip.get("127.0.0.1", {})) <= 2, "the address cut back to its budget")
        assert reg.evicted >= 2 and not reg.verified
        # a good certificate from the same address is verified, outside that budget
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=good.ssl(), server_hostname="localhost")
        await _until(lambda: len(reg.verified) == 1, "the good connection to be verified")
        writer.write(_get("/v1/health"))
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), WAIT)).startswith(b"HTTP/1.1 200")
        writer.close()
        for _, w in held:
            w.close()


def test_the_reasons_are_in_the_published_error_shape() -> None:
    from gateway import openapi
    from gateway.remote.tls import REFUSAL_REASONS

    assert openapi.CERT_REFUSAL_REASONS == REFUSAL_REASONS
    schema = json.loads(openapi.render())["components"]["schemas"]["Error"]["properties"]["error"]
    assert schema["properties"]["reason"] == {"enum": list(REFUSAL_REASONS)}


async def test_a_certificate_of_our_ca_naming_no_agent_is_never_verified(
    home: Paths, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from tests.certutil import custom_agent_cert

    caplog.set_level(logging.WARNING, logger="uomp.gateway")
    async with appliance(home) as app:
        port = app.gateway.port
        assert port is not None
        key = ca.new_key()
        ca_key, ca_cert = ca_store.load_ca(home)
        cert = custom_agent_cert(
            ca_key, ca_cert, key.public_key(), "bot", eku=[ExtendedKeyUsageOID.CLIENT_AUTH], uri_san=False
        )
        (tmp_path / "nosan.crt").write_bytes(ca.cert_pem(cert))
        (tmp_path / "nosan.key").write_bytes(ca.key_pem(key))
        ctx = build_client_context(ca_store.ca_cert_path(home), tmp_path / "nosan.crt", tmp_path / "nosan.key")
        data, closed = await _raw(port, ctx, _get("/v1/health"))
        status, _, body = _answer(data)
        assert (status, body["error"]["code"], closed) == (401, "CERT_REQUIRED", True)
        assert "reason" not in body["error"] and "names no agent" in body["error"]["message"]
        assert not app.gateway.registry.verified
        lines = [r.getMessage() for r in caplog.records if " refused on mtls " in r.getMessage()]
        assert lines == [
            "TLS client certificate refused on mtls from 127.0.0.1: cert_invalid "
            "(the client certificate names no agent (needs one uomp://agent/<id> URI SAN))"
        ], lines
