"""Faults on the uplink: a full uplink, garbage frames, a flood of streams, a stalled home side."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import h2.config
import h2.connection
import pytest
from gatewaykit import agent_call, agent_session
from uplinkkit import split, stalling_guard

from gateway.config import Paths
from gateway.uplink import tlsctx

pytestmark = pytest.mark.timeout(60)

# a DATA frame on stream 0 (RFC 9113 §6.1: a connection error of type PROTOCOL_ERROR), then noise
BAD_FRAME = b"\x00\x00\x04\x00\x00\x00\x00\x00\x00abcd" + b"not HTTP/2" * 8


async def _wait(pred, what: str, seconds: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(seconds / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not reached: {what}")


async def test_full_uplink_answers_store_busy_at_once_and_timeouts_are_stable(home: Paths) -> None:
    async with (
        stalling_guard() as stall,
        split(home, home_side=False, uplink_max_in_flight=2, uplink_max_queue=1, upstream_timeout_seconds=3.0) as s,
    ):
        app = s.app
        hub = s.gateway.uplink
        assert hub is not None
        task = asyncio.get_running_loop().create_task(s.home_side(guard=stall).run())
        try:
            await s.wait_connected()
            a = app.agent("calendar_agent")
            g = await app.grant(a)
            async with agent_session(a, app.paths, limit=10) as sess:

                def read() -> asyncio.Task[tuple[int, object, object]]:
                    return asyncio.ensure_future(
                        agent_call(sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id)
                    )

                held = [read(), read(), read()]
                await _wait(lambda: hub._in_flight == 2 and len(hub._waiters) == 1, "two in flight, one queued")
                status, body, hdrs = await read()
                assert status == 503 and body["error"]["code"] == "STORE_BUSY" and "Retry-After" in hdrs  # type: ignore[index]
                assert not any(t.done() for t in held)  # refused while the others still wait
                for t in held:
                    status, body, _ = await t
                    assert status == 504 and body["error"]["code"] == "UPSTREAM_TIMEOUT"  # type: ignore[index]
                await _wait(lambda: hub._in_flight == 0 and not hub._waiters, "every place given back")
        finally:
            task.cancel()


# a frame header announcing 16 MiB (over the 64 KiB allowed): refused at its header, not buffered
HUGE_FRAME = b"\xff\xff\xff\x00\x00\x00\x00\x00\x01" + b"x" * 64


@pytest.mark.parametrize("garbage", [BAD_FRAME, HUGE_FRAME], ids=["data-on-stream-0", "huge-frame"])
async def test_garbage_on_the_uplink_listener_drops_only_that_connection(home: Paths, garbage: bytes) -> None:
    async with split(home, home_side=False) as s:
        hub = s.gateway.uplink
        assert hub is not None
        ctx = tlsctx.client_context(home.uplink_home_cert, home.uplink_home_key, home.uplink_ca_cert)
        reader, writer = await asyncio.open_connection("localhost", s.gateway.uplink_port, ssl=ctx)
        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        server.initiate_connection()  # a home side's preface: its SETTINGS
        writer.write(server.data_to_send())
        await _wait(lambda: hub.connected, "the pinned home certificate is accepted")
        writer.write(garbage)
        await writer.drain()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while await reader.read(65536):
                pass  # the gateway's SETTINGS, then EOF once it has dropped the connection
        writer.close()
        await _wait(lambda: not hub.connected, "the garbage connection dropped")
        assert "protocol" in str(hub.last_error), hub.last_error
        task = asyncio.get_running_loop().create_task(s.home_side().run())
        try:
            await s.wait_connected()  # the next, well-behaved home side is served
        finally:
            task.cancel()


@contextlib.asynccontextmanager
async def rogue_gateway(vps: Paths, behaviour: str):  # type: ignore[no-untyped-def]
    """A server with the VPS's pinned uplink identity that misbehaves toward the home side."""
    ctx = tlsctx.server_context(vps.uplink_server_cert, vps.uplink_server_key, vps.uplink_ca_cert)
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            if behaviour == "garbage":
                writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + BAD_FRAME)
            elif behaviour == "streams":
                conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
                conn.initiate_connection()
                for _ in range(200):
                    sid = conn.get_next_available_stream_id()
                    conn.send_headers(
                        sid, [(":method", "GET"), (":scheme", "https"), (":authority", "x"), (":path", "/v1/health")]
                    )
                writer.write(conn.data_to_send())
            # "stall": TLS up, then nothing at all
            await writer.drain()
            while data := await reader.read(65536):
                seen.append(data)
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    try:
        yield srv.sockets[0].getsockname()[1], seen
    finally:
        srv.close()


@pytest.mark.parametrize("behaviour", ["garbage", "streams", "stall"])
async def test_home_side_drops_a_misbehaving_gateway_and_dials_again(home: Paths, behaviour: str) -> None:
    async with split(home, home_side=False) as s:
        async with rogue_gateway(s.vps, behaviour) as (port, _seen):
            side = s.home_side(max_streams=8, keepalive=0.2)
            side.port = port
            task = asyncio.get_running_loop().create_task(side.run())
            try:
                await _wait(lambda: side.connects >= 2, f"{behaviour}: dropped and dialled again")
                why = str(side.last_error)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        expected = {"garbage": "protocol", "streams": "more streams", "stall": "silent"}[behaviour]
        assert expected in why, why


async def test_a_silent_home_side_never_takes_the_uplink(home: Paths) -> None:
    """TLS and the pin pass, then nothing: not the uplink (no SETTINGS), dropped by the keep-alive,
    and a real home side connecting meanwhile is served."""
    async with split(home, home_side=False) as s:
        hub = s.gateway.uplink
        assert hub is not None
        ctx = tlsctx.client_context(home.uplink_home_cert, home.uplink_home_key, home.uplink_ca_cert)
        reader, writer = await asyncio.open_connection("localhost", s.gateway.uplink_port, ssl=ctx)
        task = asyncio.get_running_loop().create_task(s.home_side().run())
        try:
            await s.wait_connected()
            assert hub.connects == 1  # the real one; the silent one was never taken
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                while await reader.read(65536):
                    pass  # the gateway's SETTINGS and PINGs, then EOF: dropped as silent
            assert hub.connected
        finally:
            task.cancel()
            writer.close()
