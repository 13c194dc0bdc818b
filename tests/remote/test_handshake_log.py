"""Every refused TLS handshake at the gateway is one log line with its reason and a labelled
metric: a foreign certificate, TLS 1.2, plain HTTP on the TLS port; and so is a certificate of our
CA that is revoked, expired or not yet valid (its handshake completes, and the line names its agent
and serial). A good certificate is not logged; a handshake flood is not a log flood."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import ssl
from pathlib import Path

import pytest
from gatewaykit import appliance

from gateway import ca_store
from gateway.client.tls import build_client_context
from gateway.config import Paths
from gateway.core import ca
from gateway.remote.handshake_log import HandshakeLog, classify


def _client(paths: Paths, tmp: Path, variant: str) -> ssl.SSLContext:
    """A client context for ``variant``, with certificates made here."""
    now = ca.utcnow()
    key = ca.new_key()
    ca_key, ca_cert = ca_store.load_ca(paths)
    if variant == "foreign":
        ca_key, ca_cert = ca.create_ca()
    if variant == "expired":
        cert = ca.issue_agent_cert(
            ca_key, ca_cert, key.public_key(), "bot", dt.timedelta(hours=1), now=now - dt.timedelta(hours=2)
        )
    elif variant == "not_yet_valid":
        cert = ca.issue_agent_cert(ca_key, ca_cert, key.public_key(), "bot", now=now + dt.timedelta(days=1))
    else:
        cert = ca.issue_agent_cert(ca_key, ca_cert, key.public_key(), "bot", now=now)
    (tmp / f"{variant}.crt").write_bytes(ca.cert_pem(cert))
    (tmp / f"{variant}.key").write_bytes(ca.key_pem(key))
    ctx = build_client_context(ca_store.ca_cert_path(paths), tmp / f"{variant}.crt", tmp / f"{variant}.key")
    if variant == "tls12":
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


async def _handshake(port: int, ctx: ssl.SSLContext) -> None:
    """Connect, and (TLS 1.3 sends the verdict on a client certificate after the client's
    Finished) try one request; any refusal is fine, only the server's record matters."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
        writer.write(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(reader.read(100), 10)
        writer.close()
    except (ssl.SSLError, ConnectionError, OSError, TimeoutError):
        pass


async def _plain_http(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    await writer.drain()
    try:
        answer = await asyncio.wait_for(reader.read(1000), 10)
    except (ConnectionError, TimeoutError):
        answer = b""
    writer.close()
    return answer


CASES = [
    ("foreign", "unknown_ca", "unable to get local issuer certificate"),
    ("revoked", "revoked", "agent bot, serial 0x"),
    ("expired", "expired", "agent bot, serial 0x"),
    ("not_yet_valid", "not_yet_valid", "agent bot, serial 0x"),
    ("tls12", "tls_version", "UNSUPPORTED_PROTOCOL"),
    ("plain_http", "plain_http", "HTTP_REQUEST"),
]
OURS = ("revoked", "expired", "not_yet_valid")  # complete the handshake; refused by name (test_cert_refusal.py)


@pytest.mark.parametrize(("variant", "label", "words"), CASES, ids=[c[0] for c in CASES])
async def test_refused_handshake_is_logged_and_counted(
    home: Paths, tmp_path: Path, caplog: pytest.LogCaptureFixture, variant: str, label: str, words: str
) -> None:
    caplog.set_level(logging.WARNING, logger="uomp.gateway")
    async with appliance(home) as app:
        port = app.gateway.port
        assert port is not None
        if variant == "plain_http":
            answer = await _plain_http(port)
            assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") and answer.endswith(b"use https://\n")
        else:
            if variant == "revoked":
                files = ca_store.issue_with_key(home, "bot", tmp_path / "revoked")
                ca_store.revoke(home, "bot")
                app.gateway.reload()
                ctx = build_client_context(files.ca_file, files.cert_file, files.key_file)
            else:
                ctx = _client(home, tmp_path, variant)
            await _handshake(port, ctx)
        metrics = app.gateway.state.metrics  # type: ignore[union-attr]
        for _ in range(200):
            if f'listener="mtls",reason="{label}"' in metrics.render():
                break
            await asyncio.sleep(0.05)
        text = metrics.render()
        assert f'uomp_gateway_tls_handshakes_rejected_total{{listener="mtls",reason="{label}"}} 1' in text
        what = "client certificate" if variant in OURS else "handshake"
        lines = [r.getMessage() for r in caplog.records if " refused on mtls " in r.getMessage()]
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"TLS {what} refused on mtls from 127.0.0.1: {label} ({words}"), lines
        # a good agent afterwards: nothing more logged
        good = ca_store.issue_with_key(home, "good", tmp_path / "good")
        await _handshake(port, build_client_context(good.ca_file, good.cert_file, good.key_file))
        assert len([r for r in caplog.records if " refused on mtls " in r.getMessage()]) == 1


def test_a_flood_is_counted_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="uomp.gateway")
    counted: list[tuple[str, str]] = []

    class M:
        def tls_handshake_rejected(self, listener: str, reason: str) -> None:
            counted.append((listener, reason))

    hl = HandshakeLog(M(), "mtls", per_second=0.0, burst=3)
    exc = ssl.SSLError(1, "[SSL: HTTP_REQUEST] http request")
    exc.reason = "HTTP_REQUEST"  # type: ignore[misc]
    for _ in range(1000):
        hl(exc, "198.51.100.9")
    assert len(counted) == 1000 and set(counted) == {("mtls", "plain_http")}
    assert len([r for r in caplog.records if "TLS handshake refused" in r.getMessage()]) == 3
    assert hl.suppressed == 997


def test_classify_unknown_errors_as_other() -> None:
    assert classify(ssl.SSLError(1, "weird"))[0] == "other"
    assert classify(ConnectionResetError())[0] == "other"
