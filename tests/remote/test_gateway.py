"""The remote gateway end to end: real TLS 1.3 on 127.0.0.1, certificates made here, the real guard
behind it on a Unix socket. Every allowed case has refused partners with their stable codes."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import os
import socket
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gatewaykit import Appliance, agent_call, agent_session, appliance, ledger_events, verify_ledger
from guardkit import admin_headers, call

from gateway import ca_store, keys
from gateway.config import Paths
from gateway.core import jose, tokens

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def app(home: Paths) -> Any:
    async with appliance(home) as a:
        yield a


def access_events(paths: Paths) -> list[dict[str, Any]]:
    """The one log: the guard's ledger holds the gateway's events too."""
    return ledger_events(paths)


async def test_granted_reads_pass_and_are_audited(app: Appliance) -> None:
    a = app.agent("calendar_agent")
    g = await app.grant(a, read={"tags": ["preference", "portfolio:holdings"], "keys": []})
    async with agent_session(a, app.paths) as s:
        status, body, hdrs = await agent_call(
            s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
        )
        assert status == 200 and body["value"] == "dark"
        assert hdrs["X-UOMP-Quota-Remaining"] == "99"
        status, body, _ = await agent_call(
            s, app.base, "/v1/memory?tag=preference", token=g["token"], agent_id=a.agent_id
        )
        assert status == 200 and {i["key"] for i in body["items"]} >= {"preference.theme"}
        status, body, _ = await agent_call(
            s,
            app.base,
            "/v1/memory/aggregate?tag=portfolio:holdings&op=sum&field=value.market_value",
            token=g["token"],
            agent_id=a.agent_id,
        )
        assert status == 200 and body["result"] == 39000
        status, body, _ = await agent_call(
            s, app.base, f"/v1/audit?session_id={g['session_id']}", token=g["token"], agent_id=a.agent_id
        )
        assert status == 200 and len(body["logs"]) >= 3
        status, body, _ = await agent_call(s, app.base, "/v1/health", token=None, agent_id=None)
        assert (status, body) == (200, {"status": "ok"})
    events = access_events(app.paths)
    assert hdrs["Server"] == "uomp-gateway"
    reads = [e for e in events if e["action"] == "read" and e.get("key")]
    assert reads and reads[0]["allowed"] is True and reads[0]["key"] == "preference.theme"
    assert reads[0]["cert_serial"] == a.files.serial and reads[0]["session_id"] == g["session_id"]
    assert reads[0]["listener"] == "mtls" and reads[0]["via"] == f"gateway:mtls:{a.files.serial}"
    assert verify_ledger(app.paths).ok


async def test_no_client_certificate_is_401_json_and_audited(app: Appliance) -> None:
    a = app.agent("calendar_agent")
    g = await app.grant(a)
    async with agent_session(None, app.paths) as s:
        status, body, _ = await agent_call(
            s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
        )
    assert status == 401 and body["error"]["code"] == "CERT_REQUIRED"
    ev = access_events(app.paths)[-1]
    assert ev["allowed"] is False and ev["code"] == "CERT_REQUIRED"


async def test_a_refused_request_leaves_no_exception_being_handled(app: Appliance) -> None:
    """The gateway writes a refused request's event (which waits for the guard) after the clause that
    caught the refusal, not inside it: nothing stays "being handled" on the loop's thread afterwards,
    where it would become the context of unrelated exceptions (a parser's refusal among them) and keep
    the request's objects alive. Partners: a granted read, and the loop's state after each."""
    a = app.agent("calendar_agent")
    g = await app.grant(a)
    loop = asyncio.get_running_loop()

    async def handled_on_the_loop() -> BaseException | None:
        seen: list[BaseException | None] = []
        loop.call_soon(lambda: seen.append(sys.exc_info()[1]))
        await asyncio.sleep(0.05)
        return seen[0]

    signing = keys.load_signing_key(app.paths)
    now = time.time()
    claims = {**jose.parse_compact(g["token"]).payload, "exp": int(now) - 5, "expires_at": tokens.iso(now - 5)}
    expired = tokens.sign_token(claims, signing.key, signing.kid)
    async with agent_session(a, app.paths) as s:
        for token, want in (("not-a-token", 401), (expired, 401), (g["token"], 200), (g["token"] + "x", 401)):
            answers = await asyncio.gather(
                *(
                    agent_call(s, app.base, "/v1/memory/preference.theme", token=token, agent_id=a.agent_id)
                    for _ in range(10)
                )
            )
            assert {status for status, _, _ in answers} == {want}, answers[0][1]
            assert await handled_on_the_loop() is None


async def test_tls12_client_refused(app: Appliance) -> None:
    a = app.agent("calendar_agent")
    ctx = a.ssl()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _r, _w = await asyncio.open_connection("127.0.0.1", app.gateway.port, ssl=ctx, server_hostname="localhost")


async def test_certificate_from_another_ca_refused(app: Appliance, tmp_path: Path) -> None:
    other = Paths(tmp_path / "other")
    keys.init_home(other)
    ca_store.init_all(other)
    files = ca_store.issue_with_key(other, "calendar_agent", tmp_path / "foreign")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(ca_store.ca_cert_path(app.paths))
    ctx.load_cert_chain(files.cert_file, files.key_file)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        with pytest.raises(aiohttp.ClientError):
            async with s.get(app.base + "/v1/health") as resp:
                await resp.read()


async def test_revoked_certificate_refused_without_restart(app: Appliance) -> None:
    a = app.agent("calendar_agent")
    g = await app.grant(a)
    async with agent_session(a, app.paths) as s:
        status, _, _ = await agent_call(
            s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
        )
        assert status == 200
    ca_store.revoke(app.paths, "calendar_agent")
    assert app.gateway.reloader is not None
    app.gateway.reloader.reload_if_changed()  # what the watcher does within its interval
    async with agent_session(a, app.paths) as s:
        status, body, _ = await agent_call(
            s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
        )
    assert (status, body["error"]["code"], body["error"]["reason"]) == (401, "CERT_REQUIRED", "revoked")


async def test_management_routes_never_reachable(app: Appliance) -> None:
    a = app.agent("calendar_agent")
    g = await app.grant(a)
    async with agent_session(a, app.paths) as s:
        for method, path in (
            ("POST", "/v1/sessions"),
            ("GET", "/v1/sessions"),
            ("POST", f"/v1/sessions/{g['session_id']}/grant"),
            ("POST", f"/v1/sessions/{g['session_id']}/revoke"),
            # close, status and validate exist for the token's own session only: test_agent_self.py
            ("PATCH", "/v1/memory/preference.theme"),
            ("GET", "/v1/nothing"),
            ("GET", "/"),
        ):
            status, body, _ = await agent_call(
                s,
                app.base,
                path,
                token=g["token"],
                agent_id=a.agent_id,
                method=method,
                headers=admin_headers(app.paths) | {"Authorization": f"Bearer {g['token']}"},
                json_body={},
            )
            assert status in (404, 405) and body["error"]["code"] in ("NOT_FOUND", "METHOD_NOT_ALLOWED"), path
        # the admin credential is no token at the gateway: the shared paths refuse it, the session lives on
        for method, path in (
            ("POST", f"/v1/sessions/{g['session_id']}/close"),
            ("GET", f"/v1/sessions/{g['session_id']}"),
        ):
            status, body, _ = await agent_call(
                s, app.base, path, token=None, agent_id=a.agent_id, method=method, headers=admin_headers(app.paths)
            )
            assert (status, body["error"]["code"]) == (401, "INVALID_TOKEN"), path
        status, body, _ = await agent_call(
            s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
        )
        assert status == 200, body


async def test_revocation_is_seen_within_one_second(app: Appliance) -> None:
    a = app.agent("calendar_agent")
    g = await app.grant(a)
    async with agent_session(a, app.paths) as s:
        assert (await agent_call(s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id))[
            0
        ] == 200
        await call(app.admin, "POST", f"/v1/sessions/{g['session_id']}/revoke", headers=admin_headers(app.paths))
        revoked_at = time.monotonic()
        # the embedded guard refuses at once; the gateway's own status cache expires within 1 s
        status, body, _ = await agent_call(
            s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
        )
        assert status == 401 and body["error"]["code"] == "SESSION_REVOKED"
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - revoked_at)))
        status, body, _ = await agent_call(s, app.base, "/v1/audit", token=g["token"], agent_id=a.agent_id)
        assert status == 401 and body["error"]["code"] == "SESSION_REVOKED"
        ev = access_events(app.paths)[-1]
        assert ev["code"] == "SESSION_REVOKED" and ev["listener"] == "mtls"
        # one log: the guard checked the session (uncached) and wrote the one event of the refusal
        assert ev["action"] == "audit" and "origin" not in ev


async def test_gateway_quota_atomic_and_persisted(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("calendar_agent")
        g = await app.grant(a, limits={"max_read_queries": 5})
        async with agent_session(a, app.paths) as s:
            results = await asyncio.gather(
                *[
                    agent_call(s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id)
                    for _ in range(3)
                ]
            )
            assert [r[0] for r in results] == [200] * 3
    first_base = app.base
    async with appliance(home, endpoints=[first_base]) as app:
        async with agent_session(a, app.paths) as s:
            results = await asyncio.gather(
                *[
                    agent_call(s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id)
                    for _ in range(6)
                ]
            )
            codes = sorted(r[0] for r in results)
            assert codes == [200, 200, 429, 429, 429, 429]
            refused = [r for r in results if r[0] == 429]
            assert refused[0][1]["error"]["code"] == "QUOTA_EXCEEDED"
            assert refused[0][2]["X-UOMP-Quota-Remaining"] == "0"


def _forge(claims: dict[str, Any], header: dict[str, Any], secret: bytes) -> str:
    h = jose.b64u_encode(json.dumps(header).encode())
    p = jose.b64u_encode(json.dumps(claims).encode())
    sig = hmac.new(secret, f"{h}.{p}".encode(), hashlib.sha256).digest()
    return f"{h}.{p}.{jose.b64u_encode(sig)}"


async def test_bad_requests_table(app: Appliance) -> None:
    """Each row: a stable error code, an audit event, never a 500."""
    a = app.agent("agent_a")
    b = app.agent("agent_b")
    ga = await app.grant(a)
    gb = await app.grant(b)
    signing = keys.load_signing_key(app.paths)
    now = time.time()
    base_claims = dict(jose.parse_compact(ga["token"]).payload)

    def signed(**changes: Any) -> str:
        claims = {**base_claims, **changes}
        return tokens.sign_token(claims, signing.key, signing.kid)

    pub_x = jose.public_jwk(signing.key)["x"].encode()
    none_tok = jose.b64u_encode(b'{"alg":"none"}') + "." + jose.b64u_encode(json.dumps(base_claims).encode()) + "."
    closed = await app.grant(a)
    await call(app.admin, "POST", f"/v1/sessions/{closed['session_id']}/close", headers=admin_headers(app.paths))
    revoked = await app.grant(a)
    await call(app.admin, "POST", f"/v1/sessions/{revoked['session_id']}/revoke", headers=admin_headers(app.paths))
    local = await app.grant(a, profile="local", audience="http://127.0.0.1:9374")
    refresh_claims = tokens.refresh_claims(
        session_id=ga["session_id"],
        agent_id="agent_a",
        now=now,
        expires=now + 600,
        family_id="fam_x",
        audience=app.base,
        cnf={"x5t#S256": a.x5t},
    )
    refresh_tok = tokens.sign_token(refresh_claims, signing.key, signing.kid, refresh=True)
    mem = "/v1/memory/preference.theme"
    rows: list[tuple[str, str, str | None, str | None, str, int]] = [
        # name, path, token, agent header, code, status
        ("missing authorization", mem, None, "agent_a", "INVALID_TOKEN", 401),
        ("malformed jwt", mem, "not-a-jwt", "agent_a", "INVALID_TOKEN", 401),
        ("alg none", mem, none_tok, "agent_a", "INVALID_TOKEN", 401),
        (
            "hs256 with public key",
            mem,
            _forge(base_claims, {"alg": "HS256", "kid": signing.kid}, pub_x),
            "agent_a",
            "INVALID_TOKEN",
            401,
        ),
        (
            "unknown kid",
            mem,
            tokens.jose.sign_compact({"alg": "EdDSA", "kid": "nope"}, base_claims, signing.key),
            "agent_a",
            "INVALID_TOKEN",
            401,
        ),
        ("expired", mem, signed(exp=int(now) - 5, expires_at=tokens.iso(now - 5)), "agent_a", "TOKEN_EXPIRED", 401),
        ("wrong audience", mem, signed(audience="https://evil.example"), "agent_a", "INVALID_TOKEN", 401),
        ("profile local", mem, local["token"], "agent_a", "INVALID_TOKEN", 401),
        ("token for agent b with a's cert", mem, gb["token"], "agent_b", "AGENT_MISMATCH", 403),
        ("header agent mismatch", mem, ga["token"], "agent_b", "AGENT_MISMATCH", 403),
        ("missing agent header", mem, ga["token"], None, "INVALID_REQUEST", 400),
        ("bound to another cert", mem, signed(cnf={"x5t#S256": b.x5t}), "agent_a", "TOKEN_BINDING_MISMATCH", 401),
        ("revoked session", mem, revoked["token"], "agent_a", "SESSION_REVOKED", 401),
        ("closed session", mem, closed["token"], "agent_a", "SESSION_REVOKED", 401),
        ("refresh token on memory route", mem, refresh_tok, "agent_a", "INVALID_TOKEN", 401),
        (
            "allowed_endpoints excludes this host",
            mem,
            signed(allowed_endpoints=["gw.example.net"]),
            "agent_a",
            "ACCESS_DENIED",
            403,
        ),
        (
            "other session's audit",
            f"/v1/audit?session_id={gb['session_id']}",
            ga["token"],
            "agent_a",
            "ACCESS_DENIED",
            403,
        ),
    ]
    async with agent_session(a, app.paths) as s:
        for name, path, tok, agent, code, status in rows:
            before = len(access_events(app.paths))
            got_status, body, _ = await agent_call(s, app.base, path, token=tok, agent_id=agent)
            assert (got_status, body["error"]["code"]) == (status, code), name
            events = access_events(app.paths)
            assert len(events) == before + 1 and events[-1]["allowed"] is False, name
            assert events[-1]["code"] == code, name
        # path tricks a client library would normalise away: sent byte for byte
        for raw_target in (
            "/v1/memory/../sessions",
            "/v1/memory/%2e%2e/sessions",
            "/v1/memory/%2E%2E/x",
            "/v1/memory/a%2Fb",
            "/v1/memory/a%252Fb",
            "/v1/memory/a%5Cb",
            "/v1//memory/x",
            "http://evil.example/v1/memory/x",
            "/v1/memory/./preference.theme",
        ):
            before = len(access_events(app.paths))
            status, body = await _raw_request(app, a, f"GET {raw_target} HTTP/1.1", ga["token"])
            assert status == 400 and body["error"]["code"] == "INVALID_REQUEST", raw_target
            events = access_events(app.paths)
            assert len(events) == before + 1 and events[-1]["code"] == "INVALID_REQUEST", raw_target


async def _raw_request(app: Appliance, agent: Any, request_line: str, token: str, extra: str = "") -> tuple[int, Any]:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", app.gateway.port, ssl=agent.ssl(), server_hostname="localhost"
    )
    writer.write(
        (
            f"{request_line}\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n"
            f"X-UOMP-Agent-Id: {agent.agent_id}\r\n{extra}Connection: close\r\n\r\n"
        ).encode()
    )
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


async def test_oversized_header_and_body(app: Appliance) -> None:
    a = app.agent("agent_a")
    g = await app.grant(a)
    status, body = await _raw_request(
        app, a, "GET /v1/memory/preference.theme HTTP/1.1", g["token"], extra=f"X-Big: {'a' * 20000}\r\n"
    )
    # 431 Request Header Fields Too Large (RFC 6585 §5), the §8.4 body's code INVALID_REQUEST
    assert status == 431 and body["error"]["code"] == "INVALID_REQUEST"
    async with agent_session(a, app.paths) as s:
        status, body, _ = await agent_call(
            s,
            app.base,
            f"/v1/sessions/{g['session_id']}/deletion-proof",
            token=g["token"],
            agent_id=a.agent_id,
            method="POST",
            data=b"x" * (2 * 1024 * 1024),
            headers={"Content-Type": "application/json"},
        )
        assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE"
    events = access_events(app.paths)
    assert events[-1]["code"] == "PAYLOAD_TOO_LARGE"
    assert any(e["action"] == "malformed" and e["status"] == 431 for e in events)


async def test_client_sent_identity_headers_are_not_forwarded(app: Appliance) -> None:
    a = app.agent("agent_a")
    g = await app.grant(a)
    async with agent_session(a, app.paths) as s:
        # a client never sends the gateway's assertion: refused outright
        status, body, _ = await agent_call(
            s,
            app.base,
            "/v1/memory/preference.theme",
            token=g["token"],
            agent_id=a.agent_id,
            headers={"X-UOMP-Verified-Agent": "someone_else", "X-UOMP-Verified-Via": "forged"},
        )
        assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
        status, body, _ = await agent_call(
            s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
        )
        assert status == 200 and body["value"] == "dark"
    from gateway.guard.audit import AuditLog

    audit = AuditLog(app.paths.audit_db)
    rows = audit.for_session(g["session_id"], agent_view=False)
    audit.close()
    read = next(r for r in rows if r["action"] == "read")
    assert read["via"] == f"gateway:mtls:{a.files.serial}"


async def test_upstream_down_then_recovers(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
    # guard stopped, gateway alone
    from guardkit import running_guard

    from gateway.config import GatewayConfig
    from gateway.remote.server import GatewayRunner

    gw = GatewayRunner(home, GatewayConfig(listen_port=0, endpoints=[app.base]))
    await gw.start()
    base = f"https://localhost:{gw.port}"
    try:
        async with agent_session(a, home) as s:
            status, body, _ = await agent_call(
                s, base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 503 and body["error"]["code"] == "STORE_UNAVAILABLE"
            async with running_guard(home, serve_tcp=False):
                status, body, _ = await agent_call(
                    s, base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
                )
                assert status == 200, body
    finally:
        await gw.stop()


async def _fake_upstream(path: str, behaviour: str) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            if behaviour == "garbage":
                writer.write(b"NOT HTTP AT ALL\r\n\r\n\x00\x01")
                await writer.drain()
                writer.close()
            else:
                await asyncio.sleep(30)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    return await asyncio.start_unix_server(handle, path=path)


@pytest.mark.parametrize(
    ("behaviour", "code", "status"), [("garbage", "UPSTREAM_ERROR", 502), ("hang", "UPSTREAM_TIMEOUT", 504)]
)
async def test_upstream_garbage_or_hang(home: Paths, behaviour: str, code: str, status: int) -> None:
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
    from gateway.config import GatewayConfig
    from gateway.remote.server import GatewayRunner

    sock = str(home.home / "fake.sock")
    fake = await _fake_upstream(sock, behaviour)
    gw = GatewayRunner(
        home, GatewayConfig(listen_port=0, endpoints=[app.base], upstream=f"unix:{sock}", upstream_timeout_seconds=1.0)
    )
    await gw.start()
    try:
        async with agent_session(a, home) as s:
            got, body, _ = await agent_call(
                s, f"https://localhost:{gw.port}", "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert (got, body["error"]["code"]) == (status, code)
    finally:
        await gw.stop()
        fake.close()


async def test_slow_client_is_cut_off(home: Paths) -> None:
    async with appliance(home, client_timeout_seconds=0.5) as app:
        a = app.agent("agent_a")
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", app.gateway.port, ssl=a.ssl(), server_hostname="localhost"
        )
        writer.write(b"GET /v1/health HTTP/1.1\r\nHost: loc")  # never finishes its headers
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout=5)
        assert data == b""  # closed by the gateway
        assert app.gateway.registry.slow_closed == 1
        writer.close()


async def test_connection_cap(home: Paths) -> None:
    async with appliance(home, max_connections=2) as app:
        a = app.agent("agent_a")
        conns = [
            await asyncio.open_connection("127.0.0.1", app.gateway.port, ssl=a.ssl(), server_hostname="localhost")
            for _ in range(2)
        ]
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            r, w = await asyncio.open_connection(
                "127.0.0.1", app.gateway.port, ssl=a.ssl(), server_hostname="localhost"
            )
            w.write(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await w.drain()
            data = await asyncio.wait_for(r.read(), 5)
            if not data:
                raise ConnectionError("closed")
        assert app.gateway.registry.refused >= 1
        for _, w in conns:
            w.close()


async def test_no_secrets_in_logs(home: Paths, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, read={"tags": ["preference"], "keys": ["user.passport"]})
        async with agent_session(a, app.paths) as s:
            for path in ("/v1/memory/user.passport", "/v1/memory/user.password", "/v1/memory?tag=preference"):
                await agent_call(s, app.base, path, token=g["token"], agent_id=a.agent_id)
            await agent_call(s, app.base, "/v1/memory/x", token=g["token"] + "x", agent_id=a.agent_id)
    secrets_ = [
        g["token"],
        g["token"].split(".")[2],
        "X1234567",
        "hunter2",
        "lockpicking",
        keys.load_admin(home),
        jose.private_jwk(keys.load_signing_key(home).key, kid="k")["d"],
        a.files.key_file.read_text().splitlines()[1],
    ]
    texts = [caplog.text, (home.gateway_dir / "access.jsonl").read_text(), json.dumps(ledger_events(home))]
    for t in texts:
        for secret in secrets_:
            assert secret not in t
    # the memory values really went over the wire (the test could not pass vacuously)
    assert any(e["allowed"] and e.get("key") == "user.passport" for e in access_events(home))


def test_loopback_default_and_refusal_of_public_bind(home: Paths) -> None:
    from gateway.config import GatewayConfig
    from gateway.errors import UompError
    from gateway.remote.server import GatewayRunner

    assert GatewayConfig().listen_host == "127.0.0.1"
    gw = GatewayRunner(home, GatewayConfig(listen_host="0.0.0.0", listen_port=0))
    with pytest.raises(UompError) as exc:
        asyncio.run(gw.start())
    assert exc.value.code == "CONFIG_ERROR"


def _unused() -> None:  # keep imports honest for linters
    _ = (base64, os, socket)


async def test_metrics_on_separate_loopback_port(home: Paths) -> None:
    async with appliance(home, metrics_port=0) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        async with agent_session(a, app.paths) as s:
            await agent_call(s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id)
            await agent_call(s, app.base, "/v1/memory/preference.theme", token=None, agent_id=a.agent_id)
        assert app.gateway.metrics_port
        async with (
            aiohttp.ClientSession() as plain,
            plain.get(f"http://127.0.0.1:{app.gateway.metrics_port}/metrics") as resp,
        ):
            text = await resp.text()
        assert resp.status == 200 and resp.content_type == "text/plain"
        assert 'uomp_gateway_requests_total{route="read_key",code="OK"} 1' in text
        assert 'uomp_gateway_requests_total{route="read_key",code="INVALID_TOKEN"} 1' in text
        assert g["token"] not in text and "preference.theme" not in text
        # the metrics are not served on the agents' port
        async with agent_session(a, app.paths) as s:
            status, body, _ = await agent_call(s, app.base, "/metrics", token=g["token"], agent_id=a.agent_id)
        assert status == 404 and body["error"]["code"] == "NOT_FOUND"


async def test_fronts_another_guard_over_loopback_http(home: Paths) -> None:
    """Upstream = http://127.0.0.1:PORT (e.g. the TypeScript reference server): same checks, then forwarded."""
    from aiohttp import web

    from gateway.config import GatewayConfig
    from gateway.remote.server import GatewayRunner

    seen: list[dict[str, str]] = []

    async def validate(request: web.Request) -> web.Response:
        return web.json_response({"valid": True, "session_id": "s"})

    async def read(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"key": request.match_info["key"], "value": "from-other-guard"})

    other = web.Application()
    other.router.add_post("/v1/tokens/validate", validate)
    other.router.add_get("/v1/memory/{key}", read)
    runner = web.AppRunner(other)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
    gw = GatewayRunner(home, GatewayConfig(listen_port=0, endpoints=[app.base], upstream=f"http://127.0.0.1:{port}"))
    await gw.start()
    try:
        async with agent_session(a, home) as s:
            status, body, _ = await agent_call(
                s,
                f"https://localhost:{gw.port}",
                "/v1/memory/preference.theme",
                token=g["token"],
                agent_id=a.agent_id,
                headers={"Cookie": "x=1"},
            )
            assert (status, body["value"]) == (200, "from-other-guard")
            # still refused before forwarding: wrong agent header
            status, body, _ = await agent_call(
                s, f"https://localhost:{gw.port}", "/v1/memory/preference.theme", token=g["token"], agent_id="someone"
            )
            assert status == 403 and body["error"]["code"] == "AGENT_MISMATCH"
    finally:
        await gw.stop()
        await runner.cleanup()
    assert len(seen) == 1
    h = {k.lower(): v for k, v in seen[0].items()}
    assert h["x-uomp-verified-agent"] == "agent_a" and "cookie" not in h
    assert h["authorization"] == f"Bearer {g['token']}"
