"""Request authentication across the gateway and the guard, spoken byte for byte over real mTLS,
the real tunnel-origin listener, the guard's real Unix socket and its real Local Profile TCP port.

The gateway and the guard must act on one token: a request with a second ``Authorization`` (or any
single-valued header we rely on) is refused before anything reads it; what the gateway forwards is
the token it verified, and the guard checks that (by hash) on every route and listener.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance, ledger_events
from guardkit import admin_headers, call, grant, guard_config, running_guard, seed, unix_session

from gateway import keys
from gateway.config import Paths
from gateway.core import capability, dpop, jose, tokens
from gateway.errors import UompError
from gateway.guard.audit import AuditLog

pytestmark = pytest.mark.timeout(120)

TUNNEL = "https://tunnel.example"
WIDE = {"tags": ["preference", "identity"], "keys": []}
OWN = {"tags": ["preference"], "keys": []}


# ----------------------------------------------------------------------------------- helpers


def access_events(paths: Paths) -> list[dict[str, Any]]:
    """The one log: the guard's ledger holds the gateway's events too."""
    if not paths.audit_db.exists():
        return []
    return ledger_events(paths)


def audit_rows(paths: Paths, session_id: str) -> list[dict[str, Any]]:
    audit = AuditLog(paths.audit_db)
    try:
        return audit.for_session(session_id, agent_view=False)
    finally:
        audit.close()


async def new_events(paths: Paths, before: int, *, at_least: int = 1) -> list[dict[str, Any]]:
    """Access events after the first ``before``; an event aiohttp's own refusals cause is made durable
    just after the answer, so poll (bounded) rather than sleep."""
    for _ in range(400):
        events = access_events(paths)[before:]
        if len(events) >= at_least:
            return events
        await asyncio.sleep(0.05)
    return access_events(paths)[before:]


def _parse(data: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    try:
        return status, headers, json.loads(body)
    except ValueError:
        return status, headers, body


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes
) -> tuple[int, dict[str, str], Any]:
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    return _parse(data)


async def raw_tls(
    app: Appliance, agent: Agent | None, raw: bytes, *, sni: str | None = "localhost"
) -> tuple[int, dict[str, str], Any]:
    """One request, byte for byte, over real TLS 1.3 with the agent's certificate."""
    if agent is not None:
        ctx = agent.ssl()
    else:
        ctx = ssl.create_default_context(cafile=str(app.paths.home / "ca" / "ca.crt"))
    ctx.check_hostname = False
    reader, writer = await asyncio.open_connection("127.0.0.1", app.gateway.port, ssl=ctx, server_hostname=sni)
    return await _exchange(reader, writer, raw)


async def raw_unix(paths: Paths, raw: bytes) -> tuple[int, dict[str, str], Any]:
    reader, writer = await asyncio.open_unix_connection(str(paths.guard_sock))
    return await _exchange(reader, writer, raw)


async def raw_tcp(port: int, raw: bytes) -> tuple[int, dict[str, str], Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return await _exchange(reader, writer, raw)


def request(method: str, path: str, headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclasses.dataclass
class World:
    app: Appliance
    a: Agent  # the attacker's own certificate (agent_a)
    own: dict[str, Any]  # agent_a's own narrow remote grant, bound to its certificate
    stolen_bound: dict[str, Any]  # agent_a's wide grant elsewhere, bound to another key
    stolen_local: dict[str, Any]  # agent_a's wide local-profile grant

    @property
    def host(self) -> str:
        return f"localhost:{self.app.gateway.port}"


@pytest.fixture
async def world(home: Paths) -> AsyncIterator[World]:
    async with appliance(home) as app:
        a = app.agent("agent_a")
        elsewhere = app.agent("agent_a", sub="agent_a_elsewhere")  # the same agent id, another key
        own = await app.grant(a, read=OWN)
        stolen_bound = await grant(
            app.admin,
            home,
            read=WIDE,
            agent_id="agent_a",
            profile="remote",
            audience=app.base,
            cnf={"x5t#S256": elsewhere.x5t, "jkt": elsewhere.jkt},
        )
        stolen_local = await grant(app.admin, home, read=WIDE, agent_id="agent_a")
        yield World(app, a, own, stolen_bound, stolen_local)


# ------------------------------------------------ one token, gateway and guard

SPELLINGS = [
    ("Authorization", "Authorization"),
    ("Authorization", "authorization"),
    ("AUTHORIZATION", "authorization"),
    ("authorization", "AuThOrIzAtIoN"),
]
STOLEN = ["stolen_bound", "stolen_local"]
ORDERS = ["own_first", "stolen_first"]
PATHS = ["read_outside_grant", "audit_of_stolen_session"]


@pytest.mark.parametrize("where", PATHS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("stolen", STOLEN)
@pytest.mark.parametrize("spelling", SPELLINGS, ids=["-".join(s) for s in SPELLINGS])
async def test_two_authorization_headers_are_refused(
    world: World, spelling: tuple[str, str], stolen: str, order: str, where: str
) -> None:
    theirs = getattr(world, stolen)
    path = (
        "/v1/memory/user.display_name"
        if where == "read_outside_grant"
        else f"/v1/audit?session_id={theirs['session_id']}"
    )
    toks = [world.own["token"], theirs["token"]]
    if order == "stolen_first":
        toks.reverse()
    headers = [
        ("Host", world.host),
        (spelling[0], f"Bearer {toks[0]}"),
        (spelling[1], f"Bearer {toks[1]}"),
        ("X-UOMP-Agent-Id", "agent_a"),
    ]
    before = len(access_events(world.app.paths))
    status, _, body = await raw_tls(world.app, world.a, request("GET", path, headers))
    assert (status, body["error"]["code"]) == (400, "INVALID_REQUEST")
    events = access_events(world.app.paths)[before:]
    assert len(events) == 1 and events[0]["allowed"] is False and events[0]["code"] == "INVALID_REQUEST"
    # the guard never acted on the stolen token
    rows = audit_rows(world.app.paths, theirs["session_id"])
    assert not [r for r in rows if r["action"] in ("read", "audit", "aggregate")]


async def test_stolen_token_alone_is_refused_and_own_token_works(world: World) -> None:
    """The partners of the table above: each token alone, once."""
    async with agent_session(world.a, world.app.paths) as s:
        status, body, _ = await agent_call(
            s, world.app.base, "/v1/memory/preference.theme", token=world.own["token"], agent_id="agent_a"
        )
        assert status == 200 and body["value"] == "dark"
        status, body, _ = await agent_call(
            s, world.app.base, "/v1/memory/user.display_name", token=world.stolen_bound["token"], agent_id="agent_a"
        )
        assert (status, body["error"]["code"]) == (401, "TOKEN_BINDING_MISMATCH")
        status, body, _ = await agent_call(
            s, world.app.base, "/v1/memory/user.display_name", token=world.stolen_local["token"], agent_id="agent_a"
        )
        assert (status, body["error"]["code"]) == (401, "INVALID_TOKEN")


DUPLICATES = [
    ("dpop twice", [("DPoP", "a.b.c"), ("dpop", "d.e.f")]),
    ("agent id twice", [("X-UOMP-Agent-Id", "agent_a"), ("x-uomp-agent-id", "agent_b")]),
    ("agent id twice same value", [("X-UOMP-Agent-Id", "agent_a"), ("X-UOMP-AGENT-ID", "agent_a")]),
    ("host twice", [("Host", "evil.example")]),
    ("content-type twice", [("Content-Type", "application/json"), ("content-type", "text/plain")]),
    ("client verified agent", [("X-UOMP-Verified-Agent", "agent_a")]),
    ("client verified token", [("X-UOMP-Verified-Token", "00")]),
    ("client verified other name", [("x-uomp-verified-anything", "1")]),
    ("any x-uomp header twice", [("X-UOMP-Whatever", "1"), ("x-uomp-whatever", "2")]),
]


@pytest.mark.parametrize(("name", "extra"), DUPLICATES, ids=[d[0] for d in DUPLICATES])
async def test_single_valued_headers_once_at_the_gateway(world: World, name: str, extra: list[tuple[str, str]]) -> None:
    headers = [("Host", world.host), ("Authorization", f"Bearer {world.own['token']}")]
    if not any(k.lower() == "x-uomp-agent-id" for k, _ in extra):
        headers.append(("X-UOMP-Agent-Id", "agent_a"))
    before = len(access_events(world.app.paths))
    status, hdrs, body = await raw_tls(
        world.app, world.a, request("GET", "/v1/memory/preference.theme", headers + extra)
    )
    assert (status, body["error"]["code"]) == (400, "INVALID_REQUEST"), name
    assert hdrs["content-type"].startswith("application/json")
    events = await new_events(world.app.paths, before)
    assert len(events) == 1 and events[0]["code"] == "INVALID_REQUEST"
    # partner: the same request without the extra header(s) is served
    if not any(k.lower() == "x-uomp-agent-id" for k, _ in headers):
        headers.append(("X-UOMP-Agent-Id", "agent_a"))
    status, _, body = await raw_tls(world.app, world.a, request("GET", "/v1/memory/preference.theme", headers))
    assert status == 200 and body["value"] == "dark"


def assertion(token: str, agent: Agent, **override: str | None) -> list[tuple[str, str]]:
    """What the gateway sends the guard for ``token`` presented with ``agent``'s certificate."""
    h: dict[str, str | None] = {
        "X-UOMP-Agent-Id": agent.agent_id,
        "X-UOMP-Verified-Agent": agent.agent_id,
        "X-UOMP-Verified-Via": "gateway:mtls:01",
        "X-UOMP-Verified-Token": digest(token),
        "X-UOMP-Verified-X5t": agent.x5t,
        "X-UOMP-Verified-Jkt": agent.jkt,
    }
    h.update(override)
    return [(k, v) for k, v in h.items() if v is not None]


GUARD_ROUTES = [("read", "GET", "/v1/memory/preference.theme"), ("audit", "GET", "/v1/audit")]


@pytest.mark.parametrize(("route", "method", "path"), GUARD_ROUTES, ids=[r[0] for r in GUARD_ROUTES])
async def test_guard_checks_the_gateway_assertion_on_its_socket(
    world: World, route: str, method: str, path: str
) -> None:
    own, bound, local = world.own["token"], world.stolen_bound["token"], world.stolen_local["token"]
    other = world.app.agent("agent_b")
    rows: list[tuple[str, str, list[tuple[str, str]], int, str]] = [
        ("hash of another token", bound, assertion(own, world.a), 401, "INVALID_TOKEN"),
        ("local token asserted as remote", local, assertion(local, world.a), 401, "INVALID_TOKEN"),
        ("bound to another key", bound, assertion(bound, world.a), 401, "TOKEN_BINDING_MISMATCH"),
        (
            "asserted agent differs",
            own,
            assertion(own, world.a, **{"X-UOMP-Verified-Agent": "agent_b"}),
            403,
            "AGENT_MISMATCH",
        ),
        (
            "asserted key of another agent",
            own,
            assertion(own, other, **{"X-UOMP-Agent-Id": "agent_a", "X-UOMP-Verified-Agent": "agent_a"}),
            401,
            "TOKEN_BINDING_MISMATCH",
        ),
        (
            "no proof asserted",
            own,
            assertion(own, world.a, **{"X-UOMP-Verified-X5t": None, "X-UOMP-Verified-Jkt": None}),
            401,
            "CERT_REQUIRED",
        ),
        ("incomplete assertion", own, [("X-UOMP-Verified-Agent", "agent_a")], 400, "INVALID_REQUEST"),
        (
            "unknown verified header",
            own,
            [*assertion(own, world.a), ("X-UOMP-Verified-Admin", "1")],
            400,
            "INVALID_REQUEST",
        ),
        (
            "verified token twice",
            own,
            [*assertion(own, world.a), ("x-uomp-verified-token", digest(own))],
            400,
            "INVALID_REQUEST",
        ),
        ("remote token without the gateway", own, [], 401, "INVALID_TOKEN"),
    ]
    for name, tok, extra, status, code in rows:
        raw = request(method, path, [("Host", "guard"), ("Authorization", f"Bearer {tok}"), *extra])
        got, _, body = await raw_unix(world.app.paths, raw)
        assert (got, body["error"]["code"]) == (status, code), name
    # a second Authorization on the socket, in another case
    raw = request(
        method,
        path,
        [
            ("Host", "guard"),
            ("Authorization", f"Bearer {own}"),
            ("authorization", f"Bearer {bound}"),
            *assertion(own, world.a),
        ],
    )
    got, _, body = await raw_unix(world.app.paths, raw)
    assert (got, body["error"]["code"]) == (400, "INVALID_REQUEST")
    # partners: the exact assertion passes; a local token without any assertion passes too
    raw = request(method, path, [("Host", "guard"), ("Authorization", f"Bearer {own}"), *assertion(own, world.a)])
    got, _, body = await raw_unix(world.app.paths, raw)
    assert got == 200, body
    raw = request(method, path, [("Host", "guard"), ("Authorization", f"Bearer {local}")])
    got, _, body = await raw_unix(world.app.paths, raw)
    assert got == 200, body


# ---------------------------------------- the Local Profile port, every route

TCP_ROUTES = [
    ("read key", "GET", "/v1/memory/preference.theme", None, 200),
    ("read tag", "GET", "/v1/memory?tag=preference", None, 200),
    ("aggregate", "GET", "/v1/memory/aggregate?tag=preference&op=count", None, 200),
    ("audit", "GET", "/v1/audit", None, 200),
    ("write", "PUT", "/v1/memory/preference.theme", b"{}", 403),
    ("delete", "DELETE", "/v1/memory/preference.theme", None, 403),
    ("query", "POST", "/v1/memory/query", b"{}", 501),
    ("deletion proof", "POST", "/v1/sessions/SID/deletion-proof", b"{}", 400),
]


@pytest.mark.parametrize(("name", "method", "path", "body", "local_status"), TCP_ROUTES, ids=[r[0] for r in TCP_ROUTES])
async def test_local_port_takes_local_tokens_only_on_every_route(
    home: Paths, name: str, method: str, path: str, body: bytes | None, local_status: int
) -> None:
    seed(home)
    cfg = guard_config()
    async with running_guard(home, cfg) as g, unix_session(home) as s:
        assert g.tcp_port is not None
        local = await grant(s, home, read=OWN, audience=f"http://127.0.0.1:{g.tcp_port}")
        remote = await grant(
            s, home, read=OWN, profile="remote", audience="https://localhost:9443", cnf={"x5t#S256": "A" * 43}
        )
        unbound_remote = await grant(s, home, read=OWN, profile="remote", audience=f"http://127.0.0.1:{g.tcp_port}")
        host = f"127.0.0.1:{g.tcp_port}"
        for tok, sid, want in (
            (remote["token"], remote["session_id"], (401, "INVALID_TOKEN")),
            (unbound_remote["token"], unbound_remote["session_id"], (401, "INVALID_TOKEN")),
            (local["token"], local["session_id"], None),
        ):
            raw = request(
                method, path.replace("SID", sid), [("Host", host), ("Authorization", f"Bearer {tok}")], body or b""
            )
            got, _, answer = await raw_tcp(g.tcp_port, raw)
            if want is None:
                assert got == local_status, answer
            else:
                assert (got, answer["error"]["code"]) == want, answer
        # a client-sent assertion is refused on TCP, even when it is "right"
        raw = request(
            method,
            path.replace("SID", local["session_id"]),
            [
                ("Host", host),
                ("Authorization", f"Bearer {local['token']}"),
                ("X-UOMP-Verified-Token", digest(local["token"])),
                ("X-UOMP-Verified-Agent", "calendar_agent"),
                ("X-UOMP-Verified-Via", "gateway:mtls:1"),
            ],
            body or b"",
        )
        got, _, answer = await raw_tcp(g.tcp_port, raw)
        assert (got, answer["error"]["code"]) == (400, "INVALID_REQUEST")


# POST /v1/tokens/validate is on both listeners now, an agent's own token only off the socket:
# tests/client/test_agent_self.py (test_unauthenticated_validation_only_on_the_socket)
INTERNAL = [("refresh", "POST", "/v1/sessions/SID/refresh")]


@pytest.mark.parametrize(("name", "method", "path"), INTERNAL, ids=[r[0] for r in INTERNAL])
async def test_internal_routes_are_unix_socket_only(home: Paths, name: str, method: str, path: str) -> None:
    seed(home)
    async with running_guard(home) as g, unix_session(home) as s:
        assert g.tcp_port is not None
        local = await grant(s, home, read=OWN, audience=f"http://127.0.0.1:{g.tcp_port}")
        async with aiohttp.ClientSession() as tcp:
            status, body, _ = await call(
                tcp,
                method,
                path.replace("SID", local["session_id"]),
                token=local["token"],
                json_body={"token": local["token"]},
                base=f"http://127.0.0.1:{g.tcp_port}",
            )
        assert (status, body["error"]["code"]) == (404, "NOT_FOUND")


# --------------------------------------------------- endpoints per listener


def agent_key(agent: Agent) -> Any:
    return serialization.load_pem_private_key(agent.files.key_file.read_bytes(), password=None)


async def tunnel_raw(app: Appliance, raw: bytes) -> tuple[int, dict[str, str], Any]:
    assert app.gateway.tunnel_port is not None
    return await raw_tcp(app.gateway.tunnel_port, raw)


async def test_endpoint_checks_follow_the_listener(home: Paths) -> None:
    async with appliance(home, tunnel_origin_port=0, tunnel_endpoints=[TUNNEL]) as app:
        a = app.agent("agent_a")
        direct_host = f"localhost:{app.gateway.port}"
        tunnel_tok = (await app.grant(a, audience=TUNNEL, allowed_endpoints=["tunnel.example"]))["token"]
        direct_tok = (await app.grant(a, allowed_endpoints=[direct_host]))["token"]
        path = "/v1/memory/preference.theme"

        def direct(tok: str, host: str) -> bytes:
            return request(
                "GET", path, [("Host", host), ("Authorization", f"Bearer {tok}"), ("X-UOMP-Agent-Id", "agent_a")]
            )

        # partners that pass: each token on its own listener
        status, _, body = await raw_tls(app, a, direct(direct_tok, direct_host))
        assert status == 200, body
        proof = dpop.make_dpop_proof(
            agent_key(a), method="GET", url=TUNNEL + path, access_token=tunnel_tok, now=time.time()
        )
        status, _, body = await tunnel_raw(
            app,
            request(
                "GET",
                path,
                [
                    ("Host", "tunnel.example"),
                    ("Authorization", f"DPoP {tunnel_tok}"),
                    ("DPoP", proof),
                    ("X-UOMP-Agent-Id", "agent_a"),
                ],
            ),
        )
        assert status == 200, body

        # the tunnel-only token on the direct listener with a forged Host: the SNI disagrees ...
        status, _, body = await raw_tls(app, a, direct(tunnel_tok, "tunnel.example"))
        assert (status, body["error"]["code"]) == (400, "INVALID_REQUEST")
        # ... and with SNI forged too, the direct listener does not serve the tunnel's endpoint
        status, _, body = await raw_tls(app, a, direct(tunnel_tok, "tunnel.example"), sni="tunnel.example")
        assert (status, body["error"]["code"]) == (401, "INVALID_TOKEN")
        # ... nor with no SNI at all
        status, _, body = await raw_tls(app, a, direct(tunnel_tok, "tunnel.example"), sni=None)
        assert (status, body["error"]["code"]) == (401, "INVALID_TOKEN")
        # the direct token with a Host naming no endpoint of this listener (allowed_endpoints fails)
        status, _, body = await raw_tls(app, a, direct(direct_tok, "127.0.0.1"), sni=None)
        assert (status, body["error"]["code"]) == (403, "ACCESS_DENIED")

        # the reverse: the direct token through the tunnel listener, Host forged to the direct one
        proof = dpop.make_dpop_proof(
            agent_key(a), method="GET", url=f"https://{direct_host}{path}", access_token=direct_tok, now=time.time()
        )
        status, _, body = await tunnel_raw(
            app,
            request(
                "GET",
                path,
                [
                    ("Host", direct_host),
                    ("Authorization", f"DPoP {direct_tok}"),
                    ("DPoP", proof),
                    ("X-UOMP-Agent-Id", "agent_a"),
                ],
            ),
        )
        assert status == 401 and body["error"]["code"] in ("DPOP_INVALID", "INVALID_TOKEN")
        # and with the tunnel's Host: the direct token's audience is not a tunnel endpoint
        proof = dpop.make_dpop_proof(
            agent_key(a), method="GET", url=TUNNEL + path, access_token=direct_tok, now=time.time()
        )
        status, _, body = await tunnel_raw(
            app,
            request(
                "GET",
                path,
                [
                    ("Host", "tunnel.example"),
                    ("Authorization", f"DPoP {direct_tok}"),
                    ("DPoP", proof),
                    ("X-UOMP-Agent-Id", "agent_a"),
                ],
            ),
        )
        assert (status, body["error"]["code"]) == (401, "INVALID_TOKEN")


# ------------------------------------------- what aiohttp would answer itself

MALFORMED = [
    ("encoded newline in path", b"GET /v1/memory/a%0Ab HTTP/1.1\r\nHost: H\r\nConnection: close\r\n\r\n"),
    ("encoded nul in path", b"GET /v1/memory/a%00b HTTP/1.1\r\nHost: H\r\nConnection: close\r\n\r\n"),
    ("garbage request line", b"GARBAGE\r\n\r\n"),
    ("bad method token", b"G(T / HTTP/1.1\r\nHost: H\r\n\r\n"),
    ("bad http version", b"GET / HTTP/9.9\r\nHost: H\r\n\r\n"),
    ("control byte in header", b"GET /v1/health HTTP/1.1\r\nHost: H\r\nX-A: a\x01b\r\n\r\n"),
    ("space in header name", b"GET /v1/health HTTP/1.1\r\nHost: H\r\nBad Name: x\r\n\r\n"),
    ("obs-fold", b"GET /v1/health HTTP/1.1\r\nHost: H\r\nX-A: a\r\n b\r\n\r\n"),
    ("space before the colon", b"GET /v1/health HTTP/1.1\r\nHost: H\r\nAuthorization : Bearer x\r\n\r\n"),
    (
        "folded second authorization",
        b"GET /v1/health HTTP/1.1\r\nHost: H\r\nAuthorization: Bearer a\r\n\tAuthorization: Bearer b\r\n\r\n",
    ),
    (
        "two content-lengths",
        b"POST /v1/memory/query HTTP/1.1\r\nHost: H\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    ),
    (
        "content-length and chunked",
        b"POST /v1/memory/query HTTP/1.1\r\nHost: H\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
    ),
    ("bad chunk size", b"POST /v1/memory/query HTTP/1.1\r\nHost: H\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
    (
        "absolute-form to another host",
        b"GET http://evil.example/v1/health HTTP/1.1\r\nHost: H\r\nConnection: close\r\n\r\n",
    ),
    ("asterisk form", b"OPTIONS * HTTP/1.1\r\nHost: H\r\nConnection: close\r\n\r\n"),
]


def _json_error(status: int, hdrs: dict[str, str], body: Any) -> None:
    assert 400 <= status < 500, (status, body)
    assert hdrs.get("content-type", "").startswith("application/json"), hdrs
    assert isinstance(body, dict) and isinstance(body["error"]["code"], str) and body["error"]["message"]


@pytest.mark.parametrize(("name", "raw"), MALFORMED, ids=[m[0] for m in MALFORMED])
async def test_malformed_requests_get_json_and_an_event_at_the_gateway(world: World, name: str, raw: bytes) -> None:
    before = len(access_events(world.app.paths))
    status, hdrs, body = await raw_tls(world.app, world.a, raw.replace(b"Host: H", f"Host: {world.host}".encode()))
    _json_error(status, hdrs, body)
    assert await new_events(world.app.paths, before)


GUARD_MALFORMED = [
    *(m for m in MALFORMED if m[0] != "absolute-form to another host"),  # the guard has no host
    # the guard's own limits (gateway/httpd.py): target, header line, header count
    ("target too long", b"GET /v1/memory/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: H\r\n\r\n"),
    ("header line too long", b"GET /v1/health HTTP/1.1\r\nHost: H\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n"),
    ("too many headers", b"GET /v1/health HTTP/1.1\r\nHost: H\r\n" + b"X-A: a\r\n" * 200 + b"\r\n"),
]


@pytest.mark.parametrize("listener", ["unix", "tcp"])
@pytest.mark.parametrize(("name", "raw"), GUARD_MALFORMED, ids=[m[0] for m in GUARD_MALFORMED])
async def test_malformed_requests_get_json_at_the_guard(home: Paths, name: str, raw: bytes, listener: str) -> None:
    seed(home)
    async with running_guard(home) as g:
        assert g.tcp_port is not None
        if listener == "unix":
            status, hdrs, body = await raw_unix(home, raw)
        else:
            status, hdrs, body = await raw_tcp(g.tcp_port, raw)
        _json_error(status, hdrs, body)


async def test_deeply_nested_json_is_400_not_500(world: World) -> None:
    sid = world.own["session_id"]
    # through the gateway (forwarded body) and on the guard's socket directly
    async with agent_session(world.a, world.app.paths) as s:
        status, body, _ = await agent_call(
            s,
            world.app.base,
            f"/v1/sessions/{sid}/deletion-proof",
            token=world.own["token"],
            agent_id="agent_a",
            method="POST",
            data=b"[" * 20000 + b"]" * 20000,
            headers={"Content-Type": "application/json"},
        )
        assert (status, body["error"]["code"]) == (400, "INVALID_REQUEST")
        # a token whose payload is nested too deep (fits in the header limit)
        nested = jose.b64u_encode(b'{"alg":"EdDSA"}') + "." + jose.b64u_encode(b"[" * 3000 + b"]" * 3000) + ".AA"
        status, body, _ = await agent_call(
            s, world.app.base, "/v1/memory/preference.theme", token=nested, agent_id="agent_a"
        )
        assert (status, body["error"]["code"]) == (401, "INVALID_TOKEN")
    status, body, _ = await call(world.app.admin, "POST", "/v1/sessions", headers=admin_headers(world.app.paths))
    async with world.app.admin.post(
        "http://guard/v1/sessions",
        data=b"[" * 20000 + b"]" * 20000,
        headers={**admin_headers(world.app.paths), "Content-Type": "application/json"},
    ) as resp:
        got = await resp.json(content_type=None)
        assert (resp.status, got["error"]["code"]) == (400, "INVALID_REQUEST")


# ------------------------------------------------------ the §7.2 MUST claims


def _claims(session_id: str, agent_id: str, **change: Any) -> dict[str, Any]:
    now = int(time.time())
    claims = tokens.capability_claims(
        session_id=session_id,
        agent_id=agent_id,
        now=now,
        expires=now + 600,
        read=capability.Scope(tags=("preference",)),
        max_read_queries=100,
        audience="http://127.0.0.1:9374",
    )
    for k, v in change.items():
        if v is None:
            claims.pop(k, None)
        else:
            claims[k] = v
    return claims


MISSING = [
    ("no version", {"version": None}),
    ("version 2", {"version": "2.0"}),
    ("version number", {"version": 1}),
    ("no issued_at", {"issued_at": None}),
    ("no expires_at", {"expires_at": None}),
    ("limits not an object", {"limits": [1]}),
]


@pytest.mark.parametrize(("name", "change"), MISSING, ids=[m[0] for m in MISSING])
async def test_tokens_without_must_claims_are_refused_by_every_verifier(
    home: Paths, name: str, change: dict[str, Any]
) -> None:
    seed(home)
    signing = keys.load_signing_key(home)
    pub = keys.load_public_keys(home)
    async with running_guard(home) as g, unix_session(home) as s:
        assert g.tcp_port is not None
        ok = await grant(s, home, read=OWN, audience=f"http://127.0.0.1:{g.tcp_port}")
        good = _claims(ok["session_id"], "calendar_agent", audience=f"http://127.0.0.1:{g.tcp_port}")
        bad = _claims(ok["session_id"], "calendar_agent", audience=f"http://127.0.0.1:{g.tcp_port}", **change)
        good_tok = tokens.sign_token(good, signing.key, signing.kid)
        bad_tok = tokens.sign_token(bad, signing.key, signing.kid)
        tokens.verify_token(good_tok, pub, now=time.time())
        with pytest.raises(UompError) as err:
            tokens.verify_token(bad_tok, pub, now=time.time())
        assert err.value.code == "INVALID_TOKEN"
        async with aiohttp.ClientSession() as tcp:
            for session, base in ((s, "http://guard"), (tcp, f"http://127.0.0.1:{g.tcp_port}")):
                status, body, _ = await call(session, "GET", "/v1/memory/preference.theme", token=good_tok, base=base)
                assert status == 200, body
                status, body, _ = await call(session, "GET", "/v1/memory/preference.theme", token=bad_tok, base=base)
                assert (status, body["error"]["code"]) == (401, "INVALID_TOKEN"), base
        status, body, _ = await call(s, "POST", "/v1/tokens/validate", json_body={"token": bad_tok})
        assert (body["valid"], body["code"]) == (False, "INVALID_TOKEN")


@pytest.mark.parametrize("name", ["no version", "no issued_at", "no expires_at"])
async def test_gateway_refuses_tokens_without_must_claims(world: World, name: str) -> None:
    signing = keys.load_signing_key(world.app.paths)
    change = {
        "no version": {"version": None},
        "no issued_at": {"issued_at": None},
        "no expires_at": {"expires_at": None},
    }
    claims = _claims(
        world.own["session_id"],
        "agent_a",
        profile="remote",
        audience=world.app.base,
        cnf={"x5t#S256": world.a.x5t},
        **change[name],
    )
    tok = tokens.sign_token(claims, signing.key, signing.kid)
    async with agent_session(world.a, world.app.paths) as s:
        status, body, _ = await agent_call(
            s, world.app.base, "/v1/memory/preference.theme", token=tok, agent_id="agent_a"
        )
    assert (status, body["error"]["code"]) == (401, "INVALID_TOKEN")


def test_camel_case_time_claims_are_read() -> None:
    key = jose.generate_ed25519() if hasattr(jose, "generate_ed25519") else None
    from cryptography.hazmat.primitives.asymmetric import ed25519

    priv = key or ed25519.Ed25519PrivateKey.generate()
    now = int(time.time())
    claims = _claims("sess_x", "a", issued_at=None, expires_at=None)
    claims |= {
        "issuedAt": tokens.iso(now),
        "expiresAt": tokens.iso(now + 600),
        "limits": {"maxReadQueries": 7, "maxWriteQueries": 0},
    }
    tok = tokens.sign_token(claims, priv, "k1")
    cap = tokens.verify_token(tok, {"k1": priv.public_key()}, now=now)
    assert cap.max_read_queries == 7 and cap.expires_at == now + 600


# ------------------------------------------------ writes answer alike through both

WRITES = [
    ("put", "PUT", "/v1/memory/preference.theme", 403, "WRITE_NOT_AVAILABLE"),
    ("delete", "DELETE", "/v1/memory/preference.theme", 403, "WRITE_NOT_AVAILABLE"),
    ("put unknown key", "PUT", "/v1/memory/no.such.key", 403, "WRITE_NOT_AVAILABLE"),
    ("query", "POST", "/v1/memory/query", 501, "NOT_IMPLEMENTED"),
]


@pytest.mark.parametrize(("name", "method", "path", "status", "code"), WRITES, ids=[w[0] for w in WRITES])
async def test_writes_answer_the_same_through_the_gateway(
    world: World, name: str, method: str, path: str, status: int, code: str
) -> None:
    local = world.stolen_local["token"]
    _, _, guard_body = await raw_unix(
        world.app.paths, request(method, path, [("Host", "guard"), ("Authorization", f"Bearer {local}")], b"{}")
    )
    async with agent_session(world.a, world.app.paths) as s:
        before = len(access_events(world.app.paths))
        got, body, _ = await agent_call(
            s,
            world.app.base,
            path,
            token=world.own["token"],
            agent_id="agent_a",
            method=method,
            json_body={"value": "x"},
        )
        assert (got, body["error"]["code"]) == (status, code)
        assert body["error"]["message"] == guard_body["error"]["message"]
        events = access_events(world.app.paths)[before:]
        assert len(events) == 1 and events[0]["code"] == code and events[0]["allowed"] is False
        # refused partners: no token, a stolen token
        got, body, _ = await agent_call(
            s, world.app.base, path, token=None, agent_id="agent_a", method=method, json_body={}
        )
        assert (got, body["error"]["code"]) == (401, "INVALID_TOKEN")
        got, body, _ = await agent_call(
            s, world.app.base, path, token=world.stolen_bound["token"], agent_id="agent_a", method=method, json_body={}
        )
        assert (got, body["error"]["code"]) == (401, "TOKEN_BINDING_MISMATCH")
    rows = audit_rows(world.app.paths, world.own["session_id"])
    assert any(r["allowed"] is False and r["action"] in ("write", "delete", "query") for r in rows)
