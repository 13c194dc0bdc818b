"""A burst of agent handshakes from one address, more than its unverified budget, on 127.0.0.1.

A client that opens many mTLS connections at once (``ab -k -c 50``, a pool warming up, agents
behind one NAT address) has more connections in their handshake from its address than
``max_unverified_connections_per_ip`` allows, some of them still silent (connected, ClientHello
not yet written). None of them is closed: a connection in its grace (``transport.LIVE_SECONDS``:
just accepted and silent, or its whole ClientHello in) is not evicted for a newcomer of its
address. The denied partners: past the grace the address is cut back to its budget (silent ones
first), and a ClientHello that stopped there is closed for a newcomer, as before. Real TLS,
certificates made in the test, the real appliance.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import ssl
import time
from collections.abc import Callable

import pytest
from gatewaykit import Appliance, appliance

from gateway.config import Paths

BUDGET = 4  # unverified connections per address
BURST = 24  # agent connections opened at once


def _finish(tls: ssl.SSLSocket, request: bytes) -> str:
    """Complete the handshake, send one request, read its status line: "200" or what went wrong."""
    try:
        tls.settimeout(20)
        tls.do_handshake()
        tls.sendall(request)
        got = b""
        while b"\r\n" not in got:
            chunk = tls.recv(4096)
            if not chunk:
                return "closed"
            got += chunk
        return got.split(b" ", 2)[1].decode()
    except (OSError, ssl.SSLError) as exc:
        return type(exc).__name__
    finally:
        tls.close()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _send_hello(ctx: ssl.SSLContext, raw: socket.socket) -> ssl.SSLSocket:
    tls = ctx.wrap_socket(raw, server_hostname="localhost", do_handshake_on_connect=False)
    tls.setblocking(False)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return tls


async def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


async def _agent_request(app: Appliance) -> tuple[int, bytes, ssl.SSLContext]:
    """The gateway's port, an agent's request for one memory item (its last on its connection) and
    the agent's TLS context."""
    a = app.agent("agent_a")
    g = await app.grant(a)
    port = app.gateway.port
    assert port is not None
    request = (
        f"GET /v1/memory/preference.theme HTTP/1.1\r\nHost: localhost:{port}\r\n"
        f"Authorization: Bearer {g['token']}\r\nX-UOMP-Agent-Id: {a.agent_id}\r\nConnection: close\r\n\r\n"
    ).encode()
    return port, request, a.ssl()


async def _burst(
    app: Appliance, when: str, *, held: Callable[[], None] | None = None
) -> tuple[int, bytes, ssl.SSLContext, list[str]]:
    """BURST connections of one agent at once, each ending its handshake and asking once: their
    outcomes. hello_before_accept: every ClientHello is in the kernel before the loop accepts any;
    hello_after_accept: the loop has accepted them all while still silent (then ``held`` runs)."""
    port, request, ctx = await _agent_request(app)
    reg = app.gateway.registry
    if when == "hello_before_accept":  # no await in between: one burst for the loop
        socks = [_send_hello(ctx, _connect(port)) for _ in range(BURST)]
    else:
        raws = [_connect(port) for _ in range(BURST)]
        assert await _wait_for(lambda: reg.accepted >= BURST)
        if held is not None:
            held()
        socks = [_send_hello(ctx, r) for r in raws]
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(max_workers=BURST) as pool:
        outcomes = await asyncio.gather(*(loop.run_in_executor(pool, _finish, t, request) for t in socks))
    return port, request, ctx, list(outcomes)


@pytest.mark.parametrize("when", ["hello_before_accept", "hello_after_accept"])
async def test_a_burst_of_handshakes_from_one_address_is_served_whole(home: Paths, when: str) -> None:
    """A burst above the address's budget, within the listener's."""
    async with appliance(home, max_unverified_connections_per_ip=BUDGET, max_unverified_connections=64) as app:
        reg = app.gateway.registry
        port, request, ctx, outcomes = await _burst(app, when)
        assert outcomes == ["200"] * BURST, outcomes
        assert reg.evicted == 0 and reg.accepted == BURST

        # Denied partners: past the grace, the address is cut back to its budget, the least
        # advanced first: silent connections, then ClientHellos that stopped there.
        loop = asyncio.get_running_loop()
        silent = [_connect(port) for _ in range(3)]
        stalled = [_send_hello(ctx, _connect(port)) for _ in range(BUDGET)]
        assert await _wait_for(lambda: reg.accepted >= BURST + 3 + BUDGET)
        assert len(reg.per_ip.get("127.0.0.1", ())) == 3 + BUDGET  # within their grace: kept
        assert await _wait_for(lambda: len(reg.per_ip.get("127.0.0.1", ())) <= BUDGET)
        assert reg.evicted == 3
        for raw in silent:  # the silent ones were closed (reset): nothing more to read
            raw.settimeout(10)
            try:
                assert raw.recv(1) == b""
            except ConnectionResetError:
                pass
        # a newcomer past the others' grace: one stalled ClientHello makes room for it
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            late = await loop.run_in_executor(pool, _finish, _send_hello(ctx, _connect(port)), request)
        assert late == "200"
        assert reg.evicted == 4
        for s in [*silent, *stalled]:
            s.close()


@pytest.mark.parametrize("when", ["hello_before_accept", "hello_after_accept"])
async def test_a_burst_beyond_the_listeners_unverified_budget_is_served_whole(home: Paths, when: str) -> None:
    """More handshakes at once than ``max_unverified_connections`` (``ab -k -c 200`` against 128):
    fresh ones are in their grace, so none is evicted while the listener holds fewer than
    ``transport.GRACE_CEILING`` times the budget. The denied partners are in
    tests/remote/test_floods.py: silent floods are cut back to the budget when their grace ends."""
    async with appliance(home, max_unverified_connections_per_ip=BUDGET, max_unverified_connections=BURST // 2) as app:
        reg = app.gateway.registry

        def all_held() -> None:
            assert len(reg.unverified) == BURST  # all held at once, above the budget

        *_, outcomes = await _burst(app, when, held=all_held)
        assert outcomes == ["200"] * BURST, outcomes
        assert reg.evicted == 0 and reg.accepted == BURST
