"""The Python agent SDK against the real appliance on 127.0.0.1: guard on a Unix socket, gateway with
real TLS 1.3 (mTLS listener) and the plain-http tunnel-origin listener (DPoP), bundles made by the real
``uomp authorize --remote`` where practical. Every allowed case has refused partners with their codes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from gatewaykit import Appliance, ledger_events
from guardkit import admin_headers, call, grant, guard_config, running_guard, seed, unix_session
from multidict import CIMultiDict

from gateway import ca_store, keys
from gateway.bundle import AgentBundle, load_bundle, write_bundle
from gateway.cli.main import main as uomp
from gateway.client import (
    AccessDenied,
    AuthError,
    CertificateError,
    ClientOptions,
    ConfigError,
    InvalidRequest,
    ProtocolError,
    UompClient,
    UompClientError,
    memory_hash,
)
from gateway.client.tls import build_client_context
from gateway.config import GatewayConfig, Paths
from gateway.core import ca, dpop, jose, manifest, tokens
from gateway.errors import ErrorCode, UompError
from gateway.remote.server import GatewayRunner

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
TUNNEL = "https://tunnel.example"
MANIFEST: dict[str, Any] = json.loads((ROOT / "examples" / "calendar_agent" / "uom.json").read_text())


# ------------------------------------------------------------------------------- fixtures


@contextlib.asynccontextmanager
async def sdk_appliance(
    paths: Paths, *, guard: dict[str, Any] | None = None, **gateway: Any
) -> AsyncIterator[Appliance]:
    """Gatewaykit.appliance with guard settings too (refresh grace window), and the tunnel listener."""
    ca_store.init_all(paths)
    seed(paths)
    gateway.setdefault("tunnel_origin_port", 0)
    gateway.setdefault("tunnel_endpoints", [TUNNEL])  # the ephemeral https://localhost:<port> is added at start
    cfg = dataclasses.replace(GatewayConfig(listen_port=0), **gateway)
    async with running_guard(paths, guard_config(**(guard or {})), serve_tcp=False), unix_session(paths) as admin:
        gw = GatewayRunner(paths, cfg)
        await gw.start()
        try:
            yield Appliance(paths, gw, admin)
        finally:
            await gw.stop()


@pytest.fixture
async def app(home: Paths) -> AsyncIterator[Appliance]:
    # refresh_reuse_grace_seconds is no longer used (the successor-used rule); status cache 0: revocation at once
    async with sdk_appliance(home, guard={"refresh_reuse_grace_seconds": 0}, status_cache_seconds=0) as a:
        yield a


def access_events(paths: Paths) -> list[dict[str, Any]]:
    """The one log: the guard's ledger holds the gateway's events too."""
    return ledger_events(paths)


def write_manifest(d: Path, doc: dict[str, Any] | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "uom.json").write_text(json.dumps(doc or MANIFEST))
    return d


def authorize_csr(
    app: Appliance, tmp: Path, *, url: str | None = None, doc: dict[str, Any] | None = None, name: str = "agent"
) -> Path:
    """The agent makes its key and CSR; the user signs it with ``uomp authorize --remote --csr``."""
    agent_dir = write_manifest(tmp / name, doc)
    key = ca.new_key("p256")
    key_file = agent_dir / "agent.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(ca.key_pem(key))
    agent_id = (doc or MANIFEST)["agent"]["id"]
    (agent_dir / "agent.csr").write_bytes(ca.make_csr(key, agent_id).public_bytes(serialization.Encoding.PEM))
    bundle = tmp / f"{name}-bundle.json"
    assert (
        uomp(
            [
                "--home",
                str(app.paths.home),
                "authorize",
                str(agent_dir),
                "--remote",
                "--gateway-url",
                url or app.base,
                "--csr",
                str(agent_dir / "agent.csr"),
                "--key-file",
                str(key_file),
                "--bundle",
                str(bundle),
                "--yes",
            ]
        )
        == 0
    )
    return bundle


def authorize_out(
    app: Appliance, tmp: Path, *, url: str, name: str = "agent", doc: dict[str, Any] | None = None
) -> Path:
    """``uomp authorize --remote --out DIR``: the user makes key and certificate (key inside the bundle)."""
    agent_dir = write_manifest(tmp / name, doc)
    bundle = tmp / f"{name}-bundle.json"
    assert (
        uomp(
            [
                "--home",
                str(app.paths.home),
                "authorize",
                str(agent_dir),
                "--remote",
                "--gateway-url",
                url,
                "--out",
                str(tmp / f"{name}-files"),
                "--bundle",
                str(bundle),
                "--yes",
            ]
        )
        == 0
    )
    return bundle


def cert_binding(cert_pem: bytes) -> dict[str, str]:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return {
        "x5t#S256": jose.cert_thumbprint(cert.public_bytes(serialization.Encoding.DER)),
        "jkt": jose.key_thumbprint(cert.public_key()),
    }  # type: ignore[arg-type]


async def bundle_for_files(
    app: Appliance, files: ca_store.IssuedFiles, path: Path, *, agent_id: str, cnf: dict[str, str] | None = None
) -> Path:
    """A bundle from a real grant answer for certificate files made here (own lifetimes / dates)."""
    cert_pem = files.cert_file.read_bytes()
    g = await grant(
        app.admin,
        app.paths,
        read={"tags": ["preference"], "keys": []},
        agent_id=agent_id,
        profile="remote",
        audience=app.base,
        cnf=cnf or cert_binding(cert_pem),
        refresh=True,
    )
    write_bundle(
        path,
        AgentBundle(
            agent_id=agent_id,
            session_id=g["session_id"],
            gateway_url=app.base,
            access_token=g["token"],
            access_expires_at=g["expires_at"],
            refresh_token=g["refresh_token"],
            refresh_expires_at=g["refresh_expires_at"],
            ca_cert=ca_store.ca_cert_path(app.paths).read_text(),
            agent_cert=cert_pem.decode(),
            agent_key=files.key_file.read_text(),
        ),
    )
    return path


def resign(token: str, paths: Paths, **changes: Any) -> str:
    """The same token with changed claims, signed with the Auth Service's key (expired tokens)."""
    signing = keys.load_signing_key(paths)
    claims = {**jose.parse_compact(token).payload, **changes}
    return tokens.sign_token(claims, signing.key, signing.kid)


async def admin(app: Appliance, method: str, path: str) -> Any:
    status, body, _ = await call(app.admin, method, path, headers=admin_headers(app.paths))
    assert status == 200, body
    return body


# ------------------------------------------------------------------------- mTLS, CLI path


async def test_csr_authorize_read_and_many_refreshes_each_persisted(
    app: Appliance, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = authorize_csr(app, tmp_path)
    b0 = load_bundle(bundle)
    assert b0.agent_key is None and b0.agent_key_file and b0.refresh_token
    assert b0.access_token not in capsys.readouterr().out
    seen_refresh = {b0.refresh_token}
    async with UompClient.from_bundle(bundle) as c:
        assert c.mode == "mtls" and c.session_id == b0.session_id
        assert (await c.get("preference.theme"))["value"] == "dark"
        assert {i["key"] for i in await c.by_tag("preference")} == {
            "preference.theme",
            "preference.lang",
            "preference.secret_hobby",
        }
        assert (await c.aggregate("preference", "count"))["result"] == 3
        assert any(e.get("action") for e in await c.audit(limit=5))
        # refused partners, each with its code and class
        with pytest.raises(AccessDenied) as denied:
            await c.get("user.password")
        assert (denied.value.code, denied.value.status, denied.value.session_id) == (
            "ACCESS_DENIED",
            403,
            b0.session_id,
        )
        with pytest.raises(AccessDenied):
            await c.by_tag("identity")
        with pytest.raises(InvalidRequest) as bad:
            await c.audit(limit=5000)
        assert bad.value.code == "INVALID_REQUEST"
        with pytest.raises(ValueError):
            await c.aggregate("preference", "median")
        for n in range(6):
            old_access = c._tokens.access_token
            await c.refresh()
            on_disk = load_bundle(bundle)
            assert on_disk.refresh_token == c._tokens.refresh_token and on_disk.refresh_token not in seen_refresh, n
            assert on_disk.access_token == c._tokens.access_token != old_access
            assert on_disk.agent_key_file == b0.agent_key_file and on_disk.agent_cert == b0.agent_cert
            seen_refresh.add(on_disk.refresh_token)
            assert (await c.get("preference.lang"))["value"] == "en"
        assert c.refresh_count == 6
    # a restarted agent starts from the live refresh token
    async with UompClient.from_bundle(bundle) as again:
        await again.refresh()
        assert (await again.get("preference.theme"))["value"] == "dark"
    refreshes = [e for e in access_events(app.paths) if e["action"] == "refresh"]
    assert len(refreshes) == 7 and all(e["allowed"] and e["listener"] == "mtls" for e in refreshes)


async def test_bundle_and_key_file_problems_are_config_errors(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    b = load_bundle(bundle)
    assert b.agent_key_file
    os.chmod(b.agent_key_file, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        UompClient.from_bundle(bundle)
    os.chmod(b.agent_key_file, 0o600)
    os.chmod(bundle, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        UompClient.from_bundle(bundle)
    os.chmod(bundle, 0o600)
    with pytest.raises(ConfigError):
        UompClient.from_bundle(tmp_path / "missing.json")
    keyless = tmp_path / "keyless.json"
    write_bundle(keyless, dataclasses.replace(b, agent_key_file=None))
    with pytest.raises(ConfigError, match="no agent certificate and key"):
        UompClient.from_bundle(keyless)
    other = ca.new_key("p256")
    mismatched = tmp_path / "mismatch.json"
    write_bundle(mismatched, dataclasses.replace(b, agent_key_file=None, agent_key=ca.key_pem(other).decode()))
    with pytest.raises(ConfigError, match="do not belong together"):
        UompClient.from_bundle(mismatched)


@pytest.mark.parametrize(
    ("mode", "url", "ok"),
    [
        ("mtls", "http://127.0.0.1:9443", False),  # mTLS is https only
        ("mtls", "https://gw.example:9443", True),
        ("dpop", "http://example.com:8080", False),  # non-loopback http refused
        ("dpop", "http://10.0.0.1:8080", False),
        ("dpop", "http://localhost.evil.example:80", False),
        ("dpop", "http://127.0.0.1:8080", True),
        ("dpop", "http://127.0.0.2:8080", True),
        ("dpop", "http://[::1]:8080", True),
        ("dpop", "http://localhost:8080", True),
        ("dpop", "ftp://127.0.0.1", False),
        ("dpop", "https://user:pw@tunnel.example", False),
        ("dpop", "https://tunnel.example/?x=1", False),
    ],
)
async def test_url_rules(app: Appliance, tmp_path: Path, mode: str, url: str, ok: bool) -> None:
    bundle = authorize_out(app, tmp_path, url=TUNNEL)
    if ok:
        c = UompClient.from_bundle(bundle, mode=mode, base_url=url)  # type: ignore[arg-type]
        assert c.base_url == url.rstrip("/")
        if mode == "dpop" and url.startswith("http:"):
            assert c.public_url == TUNNEL  # the bundle's gateway_url: what cloudflared serves
        await c.aclose()
    else:
        with pytest.raises(ConfigError):
            UompClient.from_bundle(bundle, mode=mode, base_url=url)  # type: ignore[arg-type]


async def test_no_way_to_skip_server_verification(app: Appliance, tmp_path: Path) -> None:
    """The gateway's certificate must chain to the bundled CA: another CA's bundle fails closed."""
    bundle = authorize_csr(app, tmp_path)
    other = Paths(tmp_path / "other-home")
    keys.init_home(other)
    ca_store.init_all(other)
    b = load_bundle(bundle)
    wrong = tmp_path / "wrong-ca.json"
    write_bundle(wrong, dataclasses.replace(b, ca_cert=ca_store.ca_cert_path(other).read_text()))
    async with UompClient.from_bundle(wrong) as c:
        with pytest.raises(CertificateError) as exc:
            await c.get("preference.theme")
    assert exc.value.code == "SERVER_CERT_INVALID"
    # host name checked: the gateway certificate does not name 127.0.0.2
    async with UompClient.from_bundle(bundle, base_url=f"https://127.0.0.2:{app.gateway.port}") as c:
        with pytest.raises(UompClientError) as exc2:
            await c.get("preference.theme")
    assert exc2.value.code in ("SERVER_CERT_INVALID", "CONNECTION_FAILED")


# ---------------------------------------------------------------------- refresh semantics


async def test_replayed_refresh_token_revokes_the_session(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    stale_copy = tmp_path / "stale.json"
    shutil.copy(bundle, stale_copy)
    async with UompClient.from_bundle(bundle) as live:
        await live.refresh()  # spends the refresh token the stale copy still holds
        assert (await live.get("preference.theme"))["value"] == "dark"
        async with UompClient.from_bundle(stale_copy) as replay:
            with pytest.raises(AuthError) as reused:
                await replay.refresh()
        assert reused.value.code == "REFRESH_REUSED" and reused.value.status == 401
        assert reused.value.session_id == live.session_id
        # the whole session is gone: the latest access token and the latest refresh token too
        with pytest.raises(AuthError) as revoked:
            await live.get("preference.theme")
        assert revoked.value.code == "SESSION_REVOKED"
        with pytest.raises(AuthError) as refresh_revoked:
            await live.refresh()
        assert refresh_revoked.value.code in ("SESSION_REVOKED", "REFRESH_REUSED")


async def test_revoked_session_refuses_refresh_and_reads(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    async with UompClient.from_bundle(bundle) as c:
        assert (await c.get("preference.theme"))["value"] == "dark"
        await admin(app, "POST", f"/v1/sessions/{c.session_id}/revoke")
        with pytest.raises(AuthError) as exc:
            await c.refresh()
        assert exc.value.code == "SESSION_REVOKED"
        with pytest.raises(AuthError) as exc2:
            await c.get("preference.theme")
        assert exc2.value.code == "SESSION_REVOKED"


async def test_two_clients_on_one_bundle_adopt_rather_than_reuse(app: Appliance, tmp_path: Path) -> None:
    """A second instance (another process, or a restart that raced) takes the rotated pair from the file
    instead of presenting the spent refresh token (which would revoke the session)."""
    bundle = authorize_csr(app, tmp_path)
    async with UompClient.from_bundle(bundle) as one, UompClient.from_bundle(bundle) as two:
        await one.refresh()
        await two.refresh()  # holds the spent token in memory: adopts the file's instead
        assert two.refresh_count == 0 and two._tokens.refresh_token == one._tokens.refresh_token
        assert (await one.get("preference.theme"))["value"] == "dark"
        assert (await two.get("preference.lang"))["value"] == "en"
        await two.refresh()  # now a real rotation; `one` adopts it next time
        await one.refresh()
        assert (await one.get("preference.theme"))["value"] == "dark"


async def test_concurrent_calls_share_one_refresh(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    b = load_bundle(bundle)
    # the bundle says the access token is already past its time: every call wants a refresh first
    write_bundle(bundle, dataclasses.replace(b, access_expires_at=tokens.iso(time.time() - 1)))
    async with UompClient.from_bundle(bundle) as c:
        items = await asyncio.gather(*(c.get("preference.theme") for _ in range(20)))
        assert all(i["value"] == "dark" for i in items)
        assert c.refresh_count == 1
        assert c.access_expires_at > time.time() + 60
    refreshes = [e for e in access_events(app.paths) if e["action"] == "refresh"]
    assert len(refreshes) == 1
    assert load_bundle(bundle).refresh_token != b.refresh_token


async def test_refresh_ahead_of_expiry_by_clock(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    offset = [0.0]
    async with UompClient.from_bundle(bundle, clock=lambda: time.time() + offset[0]) as c:
        await c.get("preference.theme")
        assert c.refresh_count == 0  # 10-minute token, fresh
        offset[0] = 600 - 100  # 100 s left < max(60 s, 20 % of 600 s = 120 s)
        await c.get("preference.theme")
        assert c.refresh_count == 1
        offset[0] = 0
        await c.get("preference.theme")
        assert c.refresh_count == 1


async def test_token_expired_answer_refreshes_once_and_retries(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    b = load_bundle(bundle)
    now = time.time()
    expired = resign(b.access_token, app.paths, exp=int(now) - 5, expires_at=tokens.iso(now - 5))
    # the bundle's clock says fresh; the gateway says TOKEN_EXPIRED; one refresh serves all ten callers
    write_bundle(bundle, dataclasses.replace(b, access_token=expired))
    async with UompClient.from_bundle(bundle) as c:
        items = await asyncio.gather(*(c.get("preference.lang") for _ in range(10)))
        assert all(i["value"] == "en" for i in items) and c.refresh_count == 1
    # partner: without a refresh token the TOKEN_EXPIRED answer is the caller's
    write_bundle(bundle, dataclasses.replace(b, access_token=expired, refresh_token=None, refresh_expires_at=None))
    async with UompClient.from_bundle(bundle) as c:
        with pytest.raises(AuthError) as exc:
            await c.get("preference.lang")
        assert exc.value.code == "TOKEN_EXPIRED"
    # partner: an expired refresh token is refused locally with a clear message
    write_bundle(bundle, dataclasses.replace(b, access_token=expired, refresh_expires_at=tokens.iso(now - 1)))
    async with UompClient.from_bundle(bundle) as c:
        with pytest.raises(AuthError, match="authorize the agent again") as exc:
            await c.get("preference.lang")
        assert exc.value.code == "TOKEN_EXPIRED"


# ------------------------------------------------------------------------ certificates


async def test_revoked_certificate_refused_by_name_at_next_connection_without_restart(
    app: Appliance, tmp_path: Path
) -> None:
    bundle = authorize_csr(app, tmp_path)
    async with UompClient.from_bundle(bundle) as c:
        assert (await c.get("preference.theme"))["value"] == "dark"
    assert ca_store.revoke(app.paths, "calendar_agent")
    assert app.gateway.reloader is not None
    app.gateway.reloader.reload_if_changed()  # what the watcher does within its interval
    async with UompClient.from_bundle(bundle) as c:
        with pytest.raises(CertificateError) as exc:
            await c.get("preference.theme")
        # the handshake completes; the gateway names the refusal in a 401
        assert (exc.value.code, exc.value.status) == ("CERT_REQUIRED", 401)
        assert "(agent calendar_agent, serial 0x" in str(exc.value) and " was revoked on " in str(exc.value)
        with pytest.raises(CertificateError) as exc:
            await c.renew_certificate()  # the renewal route refuses it too, before anything else
        assert (exc.value.code, exc.value.status) == ("CERT_REQUIRED", 401)


async def test_revoked_certificate_refused_on_a_kept_alive_connection(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    async with UompClient.from_bundle(bundle) as c:
        assert (await c.get("preference.theme"))["value"] == "dark"
        ca_store.revoke(app.paths, "calendar_agent")
        assert app.gateway.reloader is not None
        app.gateway.reloader.reload_if_changed()
        try:
            await c.get("preference.theme")  # same keep-alive connection: no new handshake
        except CertificateError:
            return
        raise AssertionError("a revoked certificate still reads on its open connection")


async def test_token_with_another_agents_certificate_refused(app: Appliance, tmp_path: Path) -> None:
    bundle_a = authorize_csr(app, tmp_path, name="a")
    doc_b = json.loads(json.dumps(MANIFEST))
    doc_b["agent"]["id"] = "other_agent"
    bundle_b = authorize_csr(app, tmp_path, name="b", doc=doc_b)
    a, b = load_bundle(bundle_a), load_bundle(bundle_b)
    key_b = Path(b.agent_key_file or "").read_bytes()
    key_b_obj = ca.load_private_key(key_b)
    # A's token on B's certificate (B's agent id in the header): agents differ
    c = UompClient(
        agent_id="other_agent",
        session_id=a.session_id,
        access_token=a.access_token,
        base_url=app.base,
        mode="mtls",
        ca_cert=a.ca_cert,
        agent_cert=b.agent_cert,
        agent_key=key_b_obj,
    )
    async with c:
        with pytest.raises(AuthError) as exc:
            await c.get("preference.theme")
    assert exc.value.code == "AGENT_MISMATCH"
    # A's token on another certificate for the same agent id (another key): not the bound one
    files = ca_store.issue_with_key(app.paths, "calendar_agent", tmp_path / "second")
    c2 = UompClient(
        agent_id="calendar_agent",
        session_id=a.session_id,
        access_token=a.access_token,
        refresh_token=a.refresh_token,
        base_url=app.base,
        mode="mtls",
        ca_cert=a.ca_cert,
        agent_cert=files.cert_file.read_text(),
        agent_key=ca.load_private_key(files.key_file.read_bytes()),
    )
    async with c2:
        with pytest.raises(AuthError) as exc2:
            await c2.get("preference.theme")
        assert exc2.value.code == "TOKEN_BINDING_MISMATCH"
        with pytest.raises(AuthError) as exc3:
            await c2.refresh()
        assert exc3.value.code == "TOKEN_BINDING_MISMATCH"
    # and the rightful holder is unaffected
    async with UompClient.from_bundle(bundle_a) as ok:
        assert (await ok.get("preference.theme"))["value"] == "dark"


async def test_renewal_at_two_thirds_of_lifetime_over_the_real_route(app: Appliance, tmp_path: Path) -> None:
    now = ca.utcnow()
    # issued 50 minutes ago for one hour: 83 % of its life has passed
    files = ca_store.issue_with_key(
        app.paths, "calendar_agent", tmp_path / "old", dt.timedelta(hours=1), now=now - dt.timedelta(minutes=50)
    )
    jkt = cert_binding(files.cert_file.read_bytes())["jkt"]
    # bound by key thumbprint (see the xfail test below for x5t#S256-bound tokens)
    bundle = await bundle_for_files(app, files, tmp_path / "b.json", agent_id="calendar_agent", cnf={"jkt": jkt})
    async with UompClient.from_bundle(bundle) as c:
        assert c.certificate_serial == files.serial
        # renews first (once, however many calls find it due), then reads
        items = await asyncio.gather(*(c.get("preference.theme") for _ in range(8)))
        assert all(i["value"] == "dark" for i in items)
        new_serial = c.certificate_serial
        assert new_serial != files.serial
        assert c.certificate_not_after is not None and c.certificate_not_after > now + dt.timedelta(hours=23)
        on_disk = load_bundle(bundle)
        cert = x509.load_pem_x509_certificate((on_disk.agent_cert or "").encode())
        assert ca.serial_hex(cert.serial_number) == new_serial
        assert on_disk.agent_key == files.key_file.read_text()  # same key
        reads = [e for e in access_events(app.paths) if e["action"] == "read" and e.get("key")]
        assert reads[-1]["cert_serial"] == new_serial and reads[-1]["allowed"]
        renews = [e for e in access_events(app.paths) if e["action"] == "renew"]
        assert len(renews) == 1 and renews[0]["cert_serial"] == files.serial
        await c.get("preference.lang")  # not due any more
        assert c.certificate_serial == new_serial
        # the certificate just renewed is fresh: renewing it again is refused (last third only)
        with pytest.raises(UompClientError) as early:
            await c.renew_certificate()
        assert early.value.code == "RENEWAL_TOO_EARLY"
    # explicit renewal with key rotation, from a certificate due for renewal: the new key lands in the bundle
    files = ca_store.issue_with_key(
        app.paths, "calendar_agent", tmp_path / "old", dt.timedelta(hours=1), now=now - dt.timedelta(minutes=50)
    )
    bundle = await bundle_for_files(app, files, tmp_path / "b.json", agent_id="calendar_agent", cnf={"jkt": jkt})
    async with UompClient.from_bundle(bundle) as c:
        new_key = ca.new_key("ed25519")
        renewed = await c.renew_certificate(csr_key=new_key)
        assert renewed.new_key and renewed.serial not in (files.serial, new_serial)
        on_disk = load_bundle(bundle)
        assert on_disk.agent_key == ca.key_pem(new_key).decode() and on_disk.agent_key_file is None
        cert = x509.load_pem_x509_certificate((on_disk.agent_cert or "").encode())
        assert isinstance(cert.public_key(), ed25519.Ed25519PublicKey)
    # after the key rotation the tokens (bound to the old key) are refused: the user authorizes again
    with pytest.raises(AuthError) as exc:
        async with UompClient.from_bundle(bundle) as c2:
            await c2.get("preference.theme")  # tokens are bound to the old key
    assert exc.value.code == "TOKEN_BINDING_MISMATCH"


async def test_renewed_certificate_keeps_cli_granted_tokens_usable(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    # the CA renews it for the same key (window_fraction=1: any time; the gateway only allows the last third)
    cert = x509.load_pem_x509_certificate((load_bundle(bundle).agent_cert or "").encode())
    renewed = ca_store.renew(app.paths, ca.cert_pem(cert), window_fraction=1.0)
    doc = json.loads(bundle.read_text())
    doc["agent_cert"] = renewed.decode()
    bundle.write_text(json.dumps(doc))
    async with UompClient.from_bundle(bundle) as c:
        assert c.certificate_serial == ca.serial_hex(x509.load_pem_x509_certificate(renewed).serial_number)
        assert (await c.get("preference.theme"))["value"] == "dark"


async def test_not_due_certificate_is_not_renewed(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    async with UompClient.from_bundle(bundle) as c:
        serial = c.certificate_serial
        await c.get("preference.theme")
        assert c.certificate_serial == serial
    assert not [e for e in access_events(app.paths) if e["action"] == "renew"]


async def test_expired_certificate_is_too_late_to_renew(app: Appliance, tmp_path: Path) -> None:
    now = ca.utcnow()
    files = ca_store.issue_with_key(
        app.paths, "calendar_agent", tmp_path / "expired", dt.timedelta(hours=1), now=now - dt.timedelta(hours=2)
    )
    bundle = await bundle_for_files(app, files, tmp_path / "b.json", agent_id="calendar_agent")
    async with UompClient.from_bundle(bundle) as c:
        with pytest.raises(CertificateError, match="too late to renew") as exc:
            await c.get("preference.theme")
        assert exc.value.code == "CERT_EXPIRED"
        with pytest.raises(CertificateError):
            await c.renew_certificate()
    # the gateway itself refuses it, by name (an SDK with a wrong clock still fails closed) ...
    async with UompClient.from_bundle(bundle, clock=lambda: time.time() - 7200) as lying:
        with pytest.raises(CertificateError) as exc2:
            await lying.get("preference.theme")
        assert (exc2.value.code, exc2.value.status) == ("CERT_REQUIRED", 401)
        assert "(agent calendar_agent, serial 0x" in str(exc2.value) and " expired on " in str(exc2.value)
        with pytest.raises(CertificateError):
            await lying.renew_certificate()
    ctx = build_client_context(files.ca_file, files.cert_file, files.key_file)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        async with s.post(app.base + "/v1/certificates/renew", json={}) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["reason"] == "expired"
    # ... and so does the CA
    with pytest.raises(UompError, match="expired") as ca_exc:
        ca_store.renew(app.paths, files.cert_file.read_bytes())
    assert ca_exc.value.code == "CA_ERROR"


# --------------------------------------------------------------------------------- DPoP


async def tunnel_call(
    app: Appliance,
    method: str,
    path: str,
    *,
    token: str | None,
    proof: str | list[str] | None,
    scheme: str = "DPoP",
    host: str = "tunnel.example",
    agent_id: str = "calendar_agent",
) -> tuple[int, Any]:
    headers: dict[str, str] = {"Host": host, "X-UOMP-Agent-Id": agent_id}
    if token is not None:
        headers["Authorization"] = f"{scheme} {token}"
    async with aiohttp.ClientSession() as s:
        hdrs: Any = headers
        if isinstance(proof, list):
            hdrs = CIMultiDict(headers)
            for p in proof:
                hdrs.add("DPoP", p)
        elif proof is not None:
            headers["DPoP"] = proof
        async with s.request(method, f"http://127.0.0.1:{app.gateway.tunnel_port}{path}", headers=hdrs) as resp:
            return resp.status, await resp.json(content_type=None)


async def test_dpop_through_the_tunnel_origin(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_out(app, tmp_path, url=TUNNEL)
    b = load_bundle(bundle)
    origin = f"http://127.0.0.1:{app.gateway.tunnel_port}"
    async with UompClient.from_bundle(bundle, mode="dpop", base_url=origin) as c:
        assert c.public_url == TUNNEL
        assert (await c.get("preference.theme"))["value"] == "dark"
        assert len(await c.by_tag("preference")) == 3
        with pytest.raises(AccessDenied):
            await c.get("user.password")
        for _ in range(3):
            await c.refresh()  # Authorization: DPoP <refresh token> + a proof for the refresh URL
            assert load_bundle(bundle).refresh_token == c._tokens.refresh_token
        assert (await c.get("preference.lang"))["value"] == "en"
        with pytest.raises(ConfigError):
            await c.renew_certificate()  # mTLS listener only
    env = {"UOMP_BUNDLE": str(bundle), "UOMP_MODE": "dpop", "UOMP_BASE_URL": origin}
    async with UompClient.from_env(env) as c:
        assert c.mode == "dpop" and (await c.get("preference.theme"))["value"] == "dark"
    with pytest.raises(ConfigError):
        UompClient.from_env({**env, "UOMP_MODE": "insecure"})
    events = [e for e in access_events(app.paths) if e.get("listener") == "tunnel"]
    assert events and all(e.get("cert_serial") is None for e in events)
    assert [e for e in events if e["action"] == "refresh" and e["allowed"]]
    # the mTLS-bound bundle (audience/allowed endpoint localhost) does not work through the tunnel host
    mtls_bundle = authorize_csr(app, tmp_path, name="m")
    async with UompClient.from_bundle(mtls_bundle, mode="dpop", base_url=origin, public_url=TUNNEL) as c:
        with pytest.raises(UompClientError) as exc:
            await c.get("preference.theme")
        assert exc.value.code in ("ACCESS_DENIED", "INVALID_TOKEN")
    assert b.agent_key


async def test_dpop_attack_table(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_out(app, tmp_path, url=TUNNEL)
    b = load_bundle(bundle)
    key = ca.load_private_key((b.agent_key or "").encode())
    other_key = ca.new_key("p256")
    tok = b.access_token
    url = TUNNEL + "/v1/memory/preference.theme"
    path = "/v1/memory/preference.theme"

    def proof(
        k: Any = key, *, method: str = "GET", u: str = url, access: str | None = tok, iat: float | None = None
    ) -> str:
        return dpop.make_dpop_proof(
            k, method=method, url=u, access_token=access, now=iat if iat is not None else time.time()
        )

    status, body = await tunnel_call(app, "GET", path, token=tok, proof=proof())
    assert status == 200 and body["value"] == "dark"
    replayed = proof()
    assert (await tunnel_call(app, "GET", path, token=tok, proof=replayed))[0] == 200
    rows: list[tuple[str, dict[str, Any], str]] = [
        ("replayed proof", {"proof": replayed}, "DPOP_INVALID"),
        ("no proof (DPoP scheme)", {"proof": None}, "DPOP_INVALID"),
        ("no proof (Bearer scheme)", {"proof": None, "scheme": "Bearer"}, "DPOP_INVALID"),
        ("proof for another URL", {"proof": proof(u=TUNNEL + "/v1/memory/preference.lang")}, "DPOP_INVALID"),
        ("proof for another host", {"proof": proof(u="https://evil.example" + path)}, "DPOP_INVALID"),
        ("proof for another method", {"proof": proof(method="POST")}, "DPOP_INVALID"),
        ("proof signed by another key", {"proof": proof(other_key)}, "DPOP_INVALID"),
        ("proof without ath", {"proof": proof(access=None)}, "DPOP_INVALID"),
        ("proof for another token", {"proof": proof(access=tok + "x")}, "DPOP_INVALID"),
        ("proof too old", {"proof": proof(iat=time.time() - 600)}, "DPOP_INVALID"),
        ("two proofs", {"proof": [proof(), proof()]}, "INVALID_REQUEST"),  # a single-valued header twice: 400
        (
            "Host not a gateway endpoint",
            {"proof": proof(u="https://evil.example" + path), "host": "evil.example"},
            "DPOP_INVALID",
        ),
        ("no token", {"proof": proof(access=None), "token": None}, "INVALID_TOKEN"),
    ]
    for name, kw, code in rows:
        token = kw.pop("token", tok)
        status, body = await tunnel_call(app, "GET", path, token=token, **kw)
        assert (status, body["error"]["code"]) == (400 if code == "INVALID_REQUEST" else 401, code), name
    # a token bound to another key (cnf.jkt) with a valid proof by the presenting key
    rebound = resign(tok, app.paths, cnf={"jkt": jose.key_thumbprint(other_key.public_key())})
    status, body = await tunnel_call(app, "GET", path, token=rebound, proof=proof(key, access=rebound))
    assert status == 401 and body["error"]["code"] in ("DPOP_INVALID", "TOKEN_BINDING_MISMATCH")
    # a token bound only to a certificate (no jkt) cannot be used through the tunnel
    x5t_only = resign(tok, app.paths, cnf={"x5t#S256": "A" * 43})
    status, body = await tunnel_call(app, "GET", path, token=x5t_only, proof=proof(access=x5t_only))
    assert (status, body["error"]["code"]) == (401, "TOKEN_BINDING_MISMATCH")
    # certificate renewal is not a tunnel route
    status, body = await tunnel_call(app, "POST", "/v1/certificates/renew", token=None, proof=None)
    assert status == 404 and body["error"]["code"] == "NOT_FOUND"
    # the SDK's own requests carry exactly one fresh proof each and pass
    async with UompClient.from_bundle(bundle, mode="dpop", base_url=f"http://127.0.0.1:{app.gateway.tunnel_port}") as c:
        assert (await c.get("preference.theme"))["value"] == "dark"


async def test_dpop_key_needing_percent_encoding(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_out(app, tmp_path, url=TUNNEL)
    async with UompClient.from_bundle(bundle, mode="dpop", base_url=f"http://127.0.0.1:{app.gateway.tunnel_port}") as c:
        with pytest.raises(AccessDenied):
            await c.get("preference.no such key")


# ------------------------------------------------------------------------ deletion proof


async def test_deletion_proof_signed_and_accepted(app: Appliance, tmp_path: Path) -> None:
    identity = ed25519.Ed25519PrivateKey.generate()
    doc = json.loads(json.dumps(MANIFEST))
    doc["data_retention_policy"]["proof_required"] = True
    signed = manifest.sign_manifest(doc, identity, manifest.did_key_from_public(identity.public_key()))
    bundle = authorize_csr(app, tmp_path, doc=signed)
    async with UompClient.from_bundle(bundle) as c:
        items = [await c.get("preference.theme"), await c.get("preference.lang")]
        h = memory_hash(items)
        assert h == memory_hash(list(reversed(items))) and h.startswith("sha256:") and len(h) == 71
        with pytest.raises(AccessDenied):  # not the manifest's identity key
            await c.submit_deletion_proof(
                identity_key=ed25519.Ed25519PrivateKey.generate(),
                memory_hash=h,
                fields_accessed=["key", "value"],
                method="process_termination",
            )
        with pytest.raises(InvalidRequest):  # not the manifest's deletion method
            await c.submit_deletion_proof(
                identity_key=identity, memory_hash=h, fields_accessed=["key", "value"], method="secure_wipe"
            )
        with pytest.raises(InvalidRequest):
            await c.submit_deletion_proof(
                identity_key=identity, memory_hash="sha256:xyz", fields_accessed=None, method="process_termination"
            )
        answer = await c.submit_deletion_proof(
            identity_key=identity,
            memory_hash=h,
            fields_accessed=["key", "value"],
            method="process_termination",
            deletion_proof_id="del_test_1",
        )
        assert answer == {"status": "accepted", "deletion_proof_id": "del_test_1"}
        logs = await c.audit()
        assert any(e.get("action") == "deletion_proof" and e.get("allowed") for e in logs)


# --------------------------------------------------------------------------- Local Profile


async def test_from_env_local_profile_and_bundle(home: Paths, tmp_path: Path) -> None:
    seed(home)
    async with running_guard(home) as guard, unix_session(home) as adm:
        status, created, _ = await call(
            adm,
            "POST",
            "/v1/sessions",
            headers=admin_headers(home),
            json_body={
                "agent_id": "calendar_agent",
                "agent_name": "Cal",
                "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
            },
        )
        assert status == 201
        status, g, _ = await call(
            adm,
            "POST",
            f"/v1/sessions/{created['session_id']}/grant",
            headers=admin_headers(home),
            json_body={"granted_scopes": {"read": {"tags": ["preference"], "keys": []}}},
        )
        assert status == 200, g
        env = {"UOM_TOKEN": g["token"], "UOMP_BASE_URL": f"http://127.0.0.1:{guard.tcp_port}"}
        async with UompClient.from_env(env) as c:
            assert c.mode == "bearer" and c.agent_id == "calendar_agent"
            assert (await c.get("preference.theme"))["value"] == "dark"
            with pytest.raises(AccessDenied):
                await c.get("user.password")
            with pytest.raises(ConfigError):
                await c.renew_certificate()
    for bad in ({}, {"UOM_TOKEN": "not-a-token"}, {"UOM_TOKEN": g["token"], "UOMP_BASE_URL": "http://192.0.2.1:9374"}):
        with pytest.raises(ConfigError):
            UompClient.from_env(bad)
    with pytest.raises(ConfigError):
        UompClient.from_env({"UOMP_BUNDLE": str(tmp_path / "none.json")})


# ------------------------------------------------------------------------------ secrets


async def test_no_token_or_key_in_logs_exceptions_or_repr(
    app: Appliance, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bundle = authorize_out(app, tmp_path, url=app.base)
    # the CLI (run in-process above) replaced the root handlers: capture everything from here on
    logging.getLogger().addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    b = load_bundle(bundle)
    try:
        await _exercise_and_check_secrets(app, bundle, b, caplog)
    finally:
        logging.getLogger().removeHandler(caplog.handler)


async def _exercise_and_check_secrets(
    app: Appliance, bundle: Path, b: AgentBundle, caplog: pytest.LogCaptureFixture
) -> None:
    secrets_seen = {b.access_token, b.refresh_token or "", b.agent_key or ""}
    texts: list[str] = []
    async with UompClient.from_bundle(bundle, options=ClientOptions(timeout_seconds=5)) as c:
        texts.append(repr(c))
        texts.append(str(c))
        await c.get("preference.theme")
        await c.refresh()
        await c.refresh()
        secrets_seen |= {c._tokens.access_token, c._tokens.refresh_token or ""}
        for call_ in (lambda: c.get("user.password"), lambda: c.by_tag("identity"), lambda: c.audit(limit=0)):
            try:
                await call_()
            except UompClientError as exc:
                texts += [str(exc), repr(exc), exc.message]
        await admin(app, "POST", f"/v1/sessions/{c.session_id}/revoke")
        for call_ in (c.refresh, lambda: c.get("preference.theme")):
            try:
                await call_()
            except UompClientError as exc:
                texts += [str(exc), repr(exc), exc.message]
    texts.append(caplog.text)
    texts += [r.getMessage() for r in caplog.records]
    assert "tokens rotated" in caplog.text  # the SDK does log, without the secrets
    blob = "\n".join(texts)
    for s in secrets_seen:
        assert s and s not in blob
        assert s[-40:] not in blob  # not even the signature part
    assert "<redacted>" in repr(c)


async def test_bundle_repr_redacts_tokens(app: Appliance, tmp_path: Path) -> None:
    b = load_bundle(authorize_out(app, tmp_path, url=app.base))
    text = repr(b)
    assert b.access_token not in text and (b.refresh_token or "") not in text and (b.agent_key or "") not in text


async def test_response_size_cap_and_timeouts(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    async with UompClient.from_bundle(bundle, options=ClientOptions(max_response_bytes=64)) as c:
        with pytest.raises(ProtocolError) as exc:
            await c.by_tag("preference")
        assert exc.value.code == "RESPONSE_TOO_LARGE"
    with pytest.raises(ConfigError):
        ClientOptions(timeout_seconds=0)
    # a listener that accepts and never answers: the call ends at the time-out
    held: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with UompClient.from_bundle(
            bundle,
            base_url=f"https://localhost:{port}",
            options=ClientOptions(timeout_seconds=0.5, connect_timeout_seconds=0.5),
        ) as c:
            t0 = time.monotonic()
            with pytest.raises(UompClientError) as exc2:
                await c.get("preference.theme")
            assert exc2.value.code == "TIMEOUT" and time.monotonic() - t0 < 5
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


# ------------------------------------------------------------------------------ the example


async def test_example_agent_cli(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_out(app, tmp_path, url=app.base)
    script = ROOT / "examples" / "remote_agent.py"

    async def run(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        return proc.returncode or 0, out.decode(), err.decode()

    code, out, err = await run("--bundle", str(bundle), "preference.theme", "preference.lang")
    assert code == 0, err
    assert json.loads(out.splitlines()[0]) == {"key": "preference.theme", "value": "dark"}
    code, out, err = await run("--bundle", str(bundle), "preference.theme", "user.password")
    assert code == 1 and "ACCESS_DENIED" in err and "dark" in out
    tunnel_bundle = authorize_out(app, tmp_path, url=TUNNEL, name="t")
    code, out, err = await run(
        "--bundle",
        str(tunnel_bundle),
        "--dpop",
        "--url",
        f"http://127.0.0.1:{app.gateway.tunnel_port}",
        "preference.lang",
    )
    assert code == 0, err
    assert json.loads(out) == {"key": "preference.lang", "value": "en"}
    code, _out, err = await run(
        "--bundle", str(tunnel_bundle), "--dpop", "--url", "http://example.com", "preference.lang"
    )
    assert code == 2 and "CONFIG_ERROR" in err
    for t in (load_bundle(bundle).access_token, load_bundle(tunnel_bundle).access_token):
        assert t not in out and t not in err


async def test_refresh_is_retried_on_503_and_keeps_working(
    app: Appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK retries a refresh that got 503 (here: the one log, the guard's audit log,
    cannot be written for the first two tries) with bounded back-off, and the session survives."""
    from gateway.client import ClientOptions
    from gateway.errors import UompError
    from gateway.guard import audit as audit_mod

    bundle = authorize_csr(app, tmp_path)
    real = audit_mod.AuditLog._insert
    fails = {"left": 0}

    def hook(self: audit_mod.AuditLog, rows: list[Any], *, dedupe: bool = False) -> None:
        if fails["left"] > 0 and rows:
            fails["left"] -= 1
            raise UompError(ErrorCode.STORE_UNAVAILABLE, "the audit log could not be written (disk full)")
        real(self, rows, dedupe=dedupe)

    monkeypatch.setattr(audit_mod.AuditLog, "_insert", hook)
    opts = ClientOptions(refresh_retry_attempts=5, refresh_retry_initial_seconds=0.05, refresh_retry_max_seconds=0.2)
    async with UompClient.from_bundle(bundle, options=opts) as c:
        assert (await c.get("preference.theme"))["value"] == "dark"
        fails["left"] = 2
        await c.refresh()
        assert fails["left"] == 0 and c.refresh_count == 1
        assert (await c.get("preference.theme"))["value"] == "dark"
    async with UompClient.from_bundle(bundle, options=ClientOptions(refresh_retry_attempts=1)) as c:
        fails["left"] = 1
        with pytest.raises(UompClientError) as exc:
            await c.refresh()
        assert exc.value.code == "STORE_UNAVAILABLE" and exc.value.status == 503
        await c.refresh()  # the spent token's successor was never used: a later retry works
        assert (await c.get("preference.theme"))["value"] == "dark"
