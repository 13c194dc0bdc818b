"""Connection deadlines on a keep-alive connection, on real TLS 1.3 (certificates made here):
the header and body deadlines restart with every request, the idle timeout applies between
requests, and a slow header is cut on any request, not only the first one.

Small configured deadlines keep this quick: a header deadline of HEADER seconds, and a busy
connection that sends a request every STEP seconds for several header deadlines in a row."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import pytest
from gatewaykit import appliance, ca_file

from gateway.client.tls import build_client_context
from gateway.config import Paths
from gateway.remote import transport

HEADER = 1.0  # client_timeout_seconds: accept / a request's first byte -> its headers complete
IDLE = 0.8  # first_byte_timeout_seconds: unverified idle between requests
KEEPALIVE = 1.2  # keepalive_timeout_seconds: verified idle between requests
STEP = 0.15
DEADLINES = {
    "client_timeout_seconds": HEADER,
    "first_byte_timeout_seconds": IDLE,
    "keepalive_timeout_seconds": KEEPALIVE,
    "tls_handshake_timeout_seconds": 5.0,
    "body_timeout_seconds": HEADER,
}


class Wire:
    """One raw HTTP/1.1 keep-alive connection over TLS: we decide when each byte leaves."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, ctx: ssl.SSLContext) -> Wire:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
        return cls(reader, writer)

    def head(self, path: str, headers: dict[str, str]) -> bytes:
        lines = [f"GET {path} HTTP/1.1", "Host: localhost", *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, timeout: float = 5.0) -> int:
        """The next response's status (its body read and dropped)."""
        async with asyncio.timeout(timeout):
            status_line = await self.reader.readline()
            if not status_line:
                raise ConnectionResetError("closed by the gateway")
            length = 0
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            await self.reader.readexactly(length)
            return int(status_line.split()[1])

    async def closed_within(self, seconds: float) -> bool:
        """True when the gateway closes the connection (EOF or reset) within ``seconds``."""
        try:
            async with asyncio.timeout(seconds):
                while await self.reader.read(4096):
                    pass
                return True
        except TimeoutError:
            return False
        except (OSError, ssl.SSLError):
            return True

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


async def _busy(wire: Wire, head: bytes, seconds: float) -> list[int]:
    """Requests one after the other, STEP apart, for ``seconds``: every status."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    statuses = []
    while loop.time() < end:
        await wire.send(head)
        statuses.append(await wire.answer())
        await asyncio.sleep(STEP)
    return statuses


@pytest.mark.parametrize("verified", [True, False], ids=["mtls-agent", "no-certificate"])
async def test_a_busy_keepalive_connection_outlives_the_header_deadline(home: Paths, verified: bool) -> None:
    async with appliance(home, **DEADLINES) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        ctx = a.ssl() if verified else build_client_context(ca_file(app.paths))
        wire = await Wire.open(app.gateway.port or 0, ctx)
        try:
            head = wire.head(
                "/v1/memory/preference.theme", {"Authorization": f"Bearer {g['token']}", "X-UOMP-Agent-Id": a.agent_id}
            )
            statuses = await _busy(wire, head, 3 * HEADER)
            want = 200 if verified else 401
            assert len(statuses) >= 3 * HEADER / (STEP + 0.1), statuses
            assert statuses == [want] * len(statuses), statuses
            # still the same connection, and still answering
            await wire.send(head)
            assert await wire.answer() == want
            assert app.gateway.registry.accepted == 1
            assert not app.gateway.registry.closed_by_deadline, app.gateway.registry.closed_by_deadline
        finally:
            wire.close()


@pytest.mark.parametrize("verified", [True, False], ids=["mtls-agent", "no-certificate"])
async def test_a_slow_header_on_a_later_request_is_cut(home: Paths, verified: bool) -> None:
    async with appliance(home, **DEADLINES) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        ctx = a.ssl() if verified else build_client_context(ca_file(app.paths))
        wire = await Wire.open(app.gateway.port or 0, ctx)
        try:
            head = wire.head(
                "/v1/memory/preference.theme", {"Authorization": f"Bearer {g['token']}", "X-UOMP-Agent-Id": a.agent_id}
            )
            statuses = await _busy(wire, head, 1.5 * HEADER)
            assert len(statuses) >= 3 and len(set(statuses)) == 1, statuses
            # request N: a first part of its header, then a trickle that never ends it (slowloris)
            await wire.send(head[: head.index(b"\r\n") + 2])  # the request line, no header yet
            loop = asyncio.get_running_loop()
            started = loop.time()

            async def trickle() -> None:
                with contextlib.suppress(OSError, ssl.SSLError, RuntimeError):
                    for i in range(100):
                        await asyncio.sleep(0.1)
                        await wire.send(f"X-Slow-{i}: y\r\n".encode())

            task = asyncio.create_task(trickle())
            try:
                assert await wire.closed_within(HEADER + 2.0), "a slow header on a later request was not cut"
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            took = loop.time() - started
            assert took >= HEADER * 0.8, took  # the deadline of that request, not an earlier timer
            assert app.gateway.registry.closed_by_deadline["headers"] == 1, app.gateway.registry.stats()
        finally:
            wire.close()


@pytest.mark.parametrize(("verified", "idle"), [(True, KEEPALIVE), (False, IDLE)], ids=["mtls-agent", "no-certificate"])
async def test_idle_between_requests_is_cut_after_the_idle_timeout(home: Paths, verified: bool, idle: float) -> None:
    async with appliance(home, **DEADLINES) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        ctx = a.ssl() if verified else build_client_context(ca_file(app.paths))
        wire = await Wire.open(app.gateway.port or 0, ctx)
        try:
            head = wire.head(
                "/v1/memory/preference.theme", {"Authorization": f"Bearer {g['token']}", "X-UOMP-Agent-Id": a.agent_id}
            )
            statuses = await _busy(wire, head, 1.5 * HEADER)
            assert len(statuses) >= 3 and len(set(statuses)) == 1, statuses
            loop = asyncio.get_running_loop()
            started = loop.time()
            # a pause shorter than the idle timeout keeps it
            assert not await wire.closed_within(idle * 0.5)
            await wire.send(head)
            assert await wire.answer() == statuses[0]
            started = loop.time()
            assert await wire.closed_within(idle + 2.0), "an idle keep-alive connection was not cut"
            assert loop.time() - started >= idle * 0.8
        finally:
            wire.close()


async def test_the_connection_lifetime_ends_a_busy_connection_between_requests(home: Paths) -> None:
    """A configured total lifetime closes the connection after an answer (Connection: close), never
    in the middle of a request: every request sent gets its whole answer."""
    async with appliance(home, **DEADLINES, connection_max_lifetime_seconds=2 * HEADER) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        wire = await Wire.open(app.gateway.port or 0, a.ssl())
        try:
            head = wire.head(
                "/v1/memory/preference.theme", {"Authorization": f"Bearer {g['token']}", "X-UOMP-Agent-Id": a.agent_id}
            )
            statuses: list[int] = []
            loop = asyncio.get_running_loop()
            end = loop.time() + 3 * HEADER
            closed = False
            while loop.time() < end:
                await wire.send(head)
                try:
                    statuses.append(await wire.answer())
                except (ConnectionResetError, asyncio.IncompleteReadError):
                    pytest.fail(f"a request was cut mid-way after {len(statuses)} answers")
                if await wire.closed_within(STEP):
                    closed = True
                    break
            assert closed, "the lifetime did not end the connection"
            assert statuses and set(statuses) == {200}, statuses
            assert not app.gateway.registry.closed_by_deadline, app.gateway.registry.stats()
        finally:
            wire.close()


def test_the_lifetime_is_long_by_default_and_positive() -> None:
    from gateway.config import GatewayConfig

    cfg = GatewayConfig()
    assert cfg.connection_max_lifetime_seconds >= 3600
    with pytest.raises(Exception, match="lifetime"):
        transport.Limits.for_listener(GatewayConfig(connection_max_lifetime_seconds=0), "mtls")


def _post(wire: Wire, path: str, headers: dict[str, str], body: bytes, length: int | None = None) -> bytes:
    head = wire.head(
        path,
        {**headers, "Content-Type": "application/json", "Content-Length": str(len(body) if length is None else length)},
    )
    return head.replace(b"GET ", b"POST ", 1) + body


async def test_every_request_gets_its_own_body_deadline(home: Paths) -> None:
    """Requests with bodies, one after the other past several body deadlines, are all answered;
    then a later request whose body stalls is cut by its body deadline (and not before it)."""
    async with appliance(home, **DEADLINES) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        wire = await Wire.open(app.gateway.port or 0, a.ssl())
        try:
            hdrs = {"Authorization": f"Bearer {g['token']}", "X-UOMP-Agent-Id": a.agent_id}
            req = _post(wire, "/v1/memory/query", hdrs, b'{"keys": ["preference.theme"]}')
            statuses = await _busy(wire, req, 3 * HEADER)
            assert len(statuses) >= 3 * HEADER / (STEP + 0.1) and len(set(statuses)) == 1, statuses
            assert not app.gateway.registry.closed_by_deadline, app.gateway.registry.stats()
            # request N: its headers and a part of its body, then nothing
            await wire.send(_post(wire, "/v1/memory/query", hdrs, b'{"keys": [', length=200))
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await wire.closed_within(HEADER + 3.0), "a stalled body on a later request was not cut"
            assert loop.time() - started >= HEADER * 0.8
            assert app.gateway.registry.closed_by_deadline["body"] == 1, app.gateway.registry.stats()
        finally:
            wire.close()


async def test_a_refused_request_whose_body_comes_late_ends_its_connection_at_the_bodys_end(home: Paths) -> None:
    """A request refused before its body arrived (no certificate): the answer says the connection
    ends, the late body is read and dropped within its deadline, and the connection is closed at the
    body's end, neither before it (the client is still sending) nor later (no next request on it).
    The keep-alive timer is set far off, so nothing else closes it."""
    async with appliance(home, **{**DEADLINES, "keepalive_timeout_seconds": 30.0}) as app:
        wire = await Wire.open(app.gateway.port or 0, build_client_context(ca_file(app.paths)))
        try:
            body = b'{"keys": ["preference.theme"]}'
            req = _post(wire, "/v1/memory/query", {"Authorization": "Bearer x"}, body)
            cut = len(req) - len(body) + 5
            await wire.send(req[:cut])
            assert await wire.answer() == 401  # answered before the body is in
            assert not await wire.closed_within(0.3), "closed while the client was still sending its body"
            await wire.send(req[cut:])  # the rest of the body, late but within its deadline
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await wire.closed_within(HEADER), "the connection outlived its refused request's body"
            assert loop.time() - started < HEADER * 0.5
            assert sum(app.gateway.registry.closed_by_deadline.values()) == 0, app.gateway.registry.stats()
        finally:
            wire.close()
