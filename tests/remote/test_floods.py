"""Connection floods against the real appliance on 127.0.0.1.

In every case an attacker without a verified identity opens many connections and a well-behaved
agent (valid certificate and token, or a DPoP-bound token on the tunnel origin) must keep being
served, the attacker must not hold more connections than its budget, and the flood's connections
must be closed by their deadlines. No timing is asserted beyond generous upper bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance, ca_file

from gateway.client.tls import build_client_context
from gateway.config import GatewayConfig, Paths
from gateway.core import dpop
from gateway.remote import transport

TUNNEL = "https://tunnel.example"
FLOOD = 300  # hostile connections per case
BUDGET = 16  # unverified budget (and per-address budget) in these tests
DEADLINE = 3.0  # first-byte / idle deadline in these tests (seconds)
LIMITS = {
    "max_connections": 8,
    "max_unverified_connections": BUDGET,
    "max_unverified_connections_per_ip": BUDGET,
    "tunnel_max_connections": 8,
    "tunnel_max_unverified_connections": BUDGET,
    "first_byte_timeout_seconds": DEADLINE,
    "tls_handshake_timeout_seconds": DEADLINE,
    "client_timeout_seconds": 2 * DEADLINE,
}


class Flood:
    """Hostile connections; each has a task that finishes when the gateway closes it."""

    def __init__(self) -> None:
        self.watchers: list[asyncio.Task[None]] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.failed_open = 0

    async def add(
        self, opener: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]], first: bytes = b""
    ) -> None:
        try:
            reader, writer = await asyncio.wait_for(opener(), 30)
        except (TimeoutError, OSError, ssl.SSLError):
            self.failed_open += 1  # closed while still in the handshake: not held either
            return
        self.writers.append(writer)
        if first:
            with contextlib.suppress(OSError):
                writer.write(first)

        async def watch() -> None:
            with contextlib.suppress(OSError, ssl.SSLError, asyncio.IncompleteReadError):
                while await reader.read(4096):
                    pass

        self.watchers.append(asyncio.create_task(watch()))

    @property
    def held(self) -> int:
        return sum(1 for t in self.watchers if not t.done())

    async def all_closed(self, timeout: float) -> bool:
        if not self.watchers:
            return True
        _done, pending = await asyncio.wait(self.watchers, timeout=timeout)
        return not pending

    def close(self) -> None:
        for t in self.watchers:
            t.cancel()
        for w in self.writers:
            w.transport.abort()


@contextlib.asynccontextmanager
async def flood_of(
    opener: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]],
    n: int = FLOOD,
    first: bytes = b"",
) -> AsyncIterator[Flood]:
    flood = Flood()
    try:
        sem = asyncio.Semaphore(50)

        async def one() -> None:
            async with sem:
                await flood.add(opener, first)

        await asyncio.gather(*(one() for _ in range(n)))
        yield flood
    finally:
        flood.close()


def no_cert_tls(port: int, paths: Paths) -> Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]:
    ctx = build_client_context(ca_file(paths))
    return lambda: asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")


def raw_tcp(port: int) -> Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]:
    return lambda: asyncio.open_connection("127.0.0.1", port)


async def served_mtls(app: Appliance, agent: Agent, token: str, *, rounds: int = 5) -> None:
    """The agent, on a new connection each time (a handshake in the middle of the flood), is served."""
    for _ in range(rounds):
        async with agent_session(agent, app.paths, force_close=True) as s:
            status, body, _ = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=token, agent_id=agent.agent_id
            )
        assert status == 200 and body["value"] == "dark", body


async def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


# ------------------------------------------------------------------------------- the cases


@pytest.mark.parametrize("kind", ["no_cert_idle_tls", "raw_tcp_no_clienthello", "partial_clienthello"])
async def test_mtls_flood_does_not_starve_a_verified_agent(home: Paths, kind: str) -> None:
    async with appliance(home, **LIMITS) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        port = app.gateway.port
        assert port is not None
        opener = no_cert_tls(port, home) if kind == "no_cert_idle_tls" else raw_tcp(port)
        # a ClientHello's first bytes (TLS record header, handshake type) and then nothing
        first = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" if kind == "partial_clienthello" else b""
        async with flood_of(opener, first=first) as flood:
            # a well-behaved agent is served, with new connections, while the flood goes on
            more = asyncio.create_task(flood.add(opener, first))
            await served_mtls(app, a, g["token"])
            await more
            # counted at accept, bounded however many were opened: fresh ones in their grace up to
            # GRACE_CEILING times the unverified budget, then cut back to the budget when it ends
            reg = app.gateway.registry
            assert flood.held <= BUDGET * transport.GRACE_CEILING + 1
            assert len(reg.unverified) <= BUDGET * transport.GRACE_CEILING
            assert await wait_for(lambda: len(reg.unverified) <= BUDGET, timeout=transport.LIVE_SECONDS * 5)
            assert await wait_for(lambda: flood.held <= BUDGET + 1, timeout=transport.LIVE_SECONDS * 5)
            assert reg.evicted >= FLOOD - BUDGET - 1
            # and kept-alive connections survive more flooding
            async with agent_session(a, home) as s:
                for _ in range(3):
                    async with flood_of(opener, n=BUDGET * 2, first=first):
                        status, _, _ = await agent_call(
                            s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
                        )
                        assert status == 200
            assert await flood.all_closed(timeout=DEADLINE * 10)
        # connections that fit in the budget (nothing evicts them) are closed by their deadline
        deadline_closed = reg.slow_closed
        async with flood_of(opener, n=BUDGET // 2, first=first) as quiet:
            assert await quiet.all_closed(timeout=DEADLINE * 10)
        assert reg.slow_closed - deadline_closed >= BUDGET // 2 - 1
        assert await wait_for(lambda: len(reg.unverified) == 0)


async def test_verified_budget_is_not_shared_with_unverified(home: Paths) -> None:
    """Unverified connections never take a verified slot, verified ones never an unverified slot."""
    async with appliance(home, **LIMITS) as app:
        a = app.agent("agent_a")
        port = app.gateway.port
        assert port is not None
        held = [
            await asyncio.open_connection("127.0.0.1", port, ssl=a.ssl(), server_hostname="localhost") for _ in range(8)
        ]
        reg = app.gateway.registry
        assert await wait_for(lambda: len(reg.verified) == 8)
        async with flood_of(raw_tcp(port), n=BUDGET) as flood:
            assert flood.held == BUDGET  # the verified budget being full does not refuse unverified ones
            # the ninth verified connection is over its own budget: refused after the handshake
            r, w = await asyncio.open_connection("127.0.0.1", port, ssl=a.ssl(), server_hostname="localhost")
            with contextlib.suppress(OSError, ssl.SSLError):
                assert await asyncio.wait_for(r.read(), 30) == b""
            assert reg.refused == 1 and len(reg.verified) == 8
            w.transport.abort()
        for _, w in held:
            w.transport.abort()


async def test_tunnel_origin_flood_does_not_starve_a_dpop_agent(home: Paths) -> None:
    async with appliance(home, tunnel_origin_port=0, tunnel_endpoints=[TUNNEL], **LIMITS) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, audience=TUNNEL)
        key = serialization.load_pem_private_key(a.files.key_file.read_bytes(), password=None)
        port = app.gateway.tunnel_port
        assert port is not None
        reg = app.gateway.tunnel_registry

        async def dpop_call(s: aiohttp.ClientSession) -> int:
            url = TUNNEL + "/v1/memory/preference.theme"
            proof = dpop.make_dpop_proof(
                key,
                method="GET",
                url=url,
                access_token=g["token"],  # type: ignore[arg-type]
                now=time.time(),
            )
            hdrs = {
                "Host": "tunnel.example",
                "X-UOMP-Agent-Id": a.agent_id,
                "Authorization": f"DPoP {g['token']}",
                "DPoP": proof,
            }
            async with s.get(f"http://127.0.0.1:{port}/v1/memory/preference.theme", headers=hdrs) as resp:
                await resp.read()
                return resp.status

        async with (
            flood_of(raw_tcp(port)) as flood,
            flood_of(raw_tcp(port), n=BUDGET, first=b"GET /v1/health HTTP/1.1\r\nHo") as partial,
        ):
            assert flood.held + partial.held <= BUDGET + 1
            for _ in range(5):
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                    assert await dpop_call(s) == 200
            # an authenticated connection leaves the unverified budget: more flooding does not touch it
            async with aiohttp.ClientSession() as s:
                assert await dpop_call(s) == 200
                assert await wait_for(lambda: len(reg.verified) == 1)
                async with flood_of(raw_tcp(port), n=BUDGET * 2):
                    assert await dpop_call(s) == 200
            assert await flood.all_closed(timeout=DEADLINE * 10)
            assert await partial.all_closed(timeout=DEADLINE * 10)
        # within the budget, silent and half-sent requests are closed by their deadlines
        async with (
            flood_of(raw_tcp(port), n=BUDGET // 2) as quiet,
            flood_of(raw_tcp(port), n=BUDGET // 2, first=b"GET /v1/health HTTP/1.1\r\nHo") as partial,
        ):
            assert await quiet.all_closed(timeout=DEADLINE * 10)
            assert await partial.all_closed(timeout=DEADLINE * 10)
        assert reg.closed_by_deadline["first_byte"] >= BUDGET // 2 - 1
        assert reg.closed_by_deadline["headers"] >= BUDGET // 2 - 1
        # the mTLS listener's budgets are another listener's: untouched by this flood
        assert app.gateway.registry.accepted == 0


async def test_eviction_order_silent_then_stalled_never_the_request(home: Paths) -> None:
    """With room for two unverified connections: a silent one goes first, then a stalled half
    request; a whole request (already in the kernel or being handled) is never the one closed."""
    async with appliance(
        home, tunnel_origin_port=0, tunnel_endpoints=[TUNNEL], **dict(LIMITS, tunnel_max_unverified_connections=2)
    ) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, audience=TUNNEL)
        key = serialization.load_pem_private_key(a.files.key_file.read_bytes(), password=None)
        port = app.gateway.tunnel_port
        assert port is not None
        reg = app.gateway.tunnel_registry
        silent = Flood()
        await silent.add(raw_tcp(port))
        stalled = Flood()
        await stalled.add(raw_tcp(port), b"GET /v1/health HT")
        assert await wait_for(lambda: any(c.phase == "headers" for c in reg.unverified))
        proof = dpop.make_dpop_proof(
            key,
            method="GET",
            url=TUNNEL + "/v1/memory/preference.theme",  # type: ignore[arg-type]
            access_token=g["token"],
            now=time.time(),
        )
        request = (
            "GET /v1/memory/preference.theme HTTP/1.1\r\nHost: tunnel.example\r\n"
            f"Authorization: DPoP {g['token']}\r\nX-UOMP-Agent-Id: {a.agent_id}\r\nDPoP: {proof}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        answer = await asyncio.wait_for(reader.read(), 30)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
        assert await silent.all_closed(timeout=30)
        assert stalled.held == 1  # the half request outlived the silent connection
        # two newer half requests: the stalled one, now the stalest receiver, is closed
        later = Flood()
        await later.add(raw_tcp(port), b"GET /v1/health HT")
        await later.add(raw_tcp(port), b"GET /v1/health HT")
        assert await stalled.all_closed(timeout=30)
        assert later.held >= 1
        for f in (silent, stalled, later):
            f.close()
        writer.transport.abort()


async def test_metrics_listener_flood_is_bounded(home: Paths) -> None:
    """The metrics listener shares the process's file descriptors: its flood is bounded too."""
    async with appliance(home, metrics_port=0, metrics_max_connections=4, **LIMITS) as app:
        port = app.gateway.metrics_port
        assert port is not None
        async with flood_of(raw_tcp(port), n=100) as flood:
            assert flood.held <= 4 + 1
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
            assert await flood.all_closed(timeout=DEADLINE * 10)
        assert app.gateway.metrics_registry.evicted >= 100 - 4 - 1


async def _trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> tuple[bool, float]:
    """Send ``head`` then one body byte every 0.2 s; (closed by the gateway, seconds it took)."""
    started = time.monotonic()
    writer.write(head)
    closed = asyncio.create_task(reader.read())
    try:
        for _ in range(600):  # 120 s of trickling at most
            if closed.done():
                return True, time.monotonic() - started
            try:
                writer.write(b"x")
                await writer.drain()
            except (OSError, ssl.SSLError):
                return True, time.monotonic() - started
            await asyncio.sleep(0.2)
        return False, time.monotonic() - started
    finally:
        closed.cancel()
        writer.transport.abort()


@pytest.mark.parametrize("who", ["agent_with_token", "certificate_only_renewal", "no_certificate"])
async def test_slow_trickled_body_is_cut_off(home: Paths, who: str) -> None:
    limits = dict(LIMITS, body_timeout_seconds=8.0, min_body_bytes_per_second=100, body_rate_grace_seconds=1.0)
    async with appliance(home, **limits) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        port = app.gateway.port
        assert port is not None
        ctx = build_client_context(ca_file(home)) if who == "no_certificate" else a.ssl()
        if who == "certificate_only_renewal":
            target, auth = "/v1/certificates/renew", b""
        else:
            target = f"/v1/sessions/{g['session_id']}/deletion-proof"
            auth = f"Authorization: Bearer {g['token']}\r\nX-UOMP-Agent-Id: {a.agent_id}\r\n".encode()
        head = (
            (
                f"POST {target} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: 10000\r\n"
            ).encode()
            + auth
            + b"\r\n"
        )
        tricklers = [
            await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost") for _ in range(3)
        ]
        jobs = [asyncio.create_task(_trickle(r, w, head)) for r, w in tricklers]
        await asyncio.sleep(1.0)
        await served_mtls(app, a, g["token"], rounds=3)  # served while the bodies trickle
        results = await asyncio.gather(*jobs)
        assert all(closed for closed, _ in results), results
        assert all(took < 60 for _, took in results), results
        reg = app.gateway.registry
        assert reg.closed_by_deadline["body_rate"] + reg.closed_by_deadline["body"] >= 1
        await served_mtls(app, a, g["token"], rounds=1)


# ------------------------------------------------------------------------------ fitting


def _limits(**kw: Any) -> transport.Limits:
    return transport.Limits.for_listener(GatewayConfig(**kw), "mtls")


def test_limits_fit_under_the_fd_limit() -> None:
    mtls = _limits()
    tunnel = transport.Limits.for_listener(GatewayConfig(), "tunnel")
    assert transport.fit_limits([mtls, tunnel], 20000, 256) == [mtls, tunnel]
    fitted = transport.fit_limits([mtls, tunnel], 1024, 256)
    backlog = transport.backlog_for(1024)
    assert sum(lim.total for lim in fitted) + 2 * backlog + 256 <= 1024
    assert all(lim.max_verified >= 1 and lim.max_unverified >= 1 for lim in fitted)
    assert fitted[0].max_unverified_per_ip <= fitted[0].max_unverified
    with pytest.raises(Exception, match="file descriptor limit"):
        transport.fit_limits([mtls, tunnel], 280, 256)


def test_fd_soft_limit_is_raised() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 64:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard // 2, hard))
        got = transport.raise_fd_limit()
        assert got == (hard if hard != resource.RLIM_INFINITY else got)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= soft
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), hard))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_unverified_connections", 0),
        ("first_byte_timeout_seconds", 0.0),
        ("body_timeout_seconds", -1.0),
        ("min_body_bytes_per_second", -1),
    ],
)
def test_bad_limits_are_config_errors(field: str, value: Any) -> None:
    from gateway.errors import UompError

    with pytest.raises(UompError) as err:
        _limits(**{field: value})
    assert err.value.code == "CONFIG_ERROR"


# ------------------------------------------------------- DPoP replay cache


@pytest.mark.parametrize("attacker", ["revoked_agent", "active_agent"])
async def test_dpop_replay_cache_cannot_lock_out_another_agent(home: Paths, attacker: str) -> None:
    per_key = 6  # 0.05 proofs/s x 2 windows of 60 s
    async with appliance(
        home,
        tunnel_origin_port=0,
        tunnel_endpoints=[TUNNEL],
        dpop_replay_cache_entries=100,
        dpop_max_proofs_per_second_per_key=0.05,
    ) as app:
        a, b = app.agent("agent_a"), app.agent("agent_b")
        ga, gb = await app.grant(a, audience=TUNNEL), await app.grant(b, audience=TUNNEL)
        if attacker == "revoked_agent":
            from guardkit import admin_headers, call

            await call(app.admin, "POST", f"/v1/sessions/{gb['session_id']}/revoke", headers=admin_headers(home))
        port = app.gateway.tunnel_port
        path = "/v1/memory/preference.theme"

        async def tunnel_get(agent: Agent, token: str, proof: str | None = None) -> tuple[int, Any, str]:
            key = serialization.load_pem_private_key(agent.files.key_file.read_bytes(), password=None)
            proof = proof or dpop.make_dpop_proof(
                key,
                method="GET",
                url=TUNNEL + path,  # type: ignore[arg-type]
                access_token=token,
                now=time.time(),
            )
            hdrs = {
                "Host": "tunnel.example",
                "X-UOMP-Agent-Id": agent.agent_id,
                "Authorization": f"DPoP {token}",
                "DPoP": proof,
            }
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}{path}", headers=hdrs) as r:
                return r.status, await r.json(content_type=None), proof

        codes = []
        for _ in range(per_key + 4):
            status, body, _ = await tunnel_get(b, gb["token"])
            codes.append(body.get("error", {}).get("code") if status != 200 else 200)
        # the other agent is served, and its proofs are still single-use
        status, body, proof = await tunnel_get(a, ga["token"])
        assert status == 200 and body["value"] == "dark", body
        status, body, _ = await tunnel_get(a, ga["token"], proof)
        assert status == 401 and body["error"]["code"] == "DPOP_INVALID"
        replay = app.gateway.state.replay if app.gateway.state else None
        assert replay is not None
        if attacker == "revoked_agent":
            assert set(codes) == {"SESSION_REVOKED"}
            assert len(replay) == 1  # agent_a's one proof: the refused ones were never recorded
        else:
            assert codes[:per_key] == [200] * per_key and set(codes[per_key:]) == {"RATE_LIMITED"}
            assert replay.partition_size(b.jkt) == per_key
