"""BodyReader, the upload body's reader, on a real aiohttp StreamReader fed by the test: each read
waits at most ``idle`` seconds (a stall is INVALID_REQUEST and leaves the task uncancelled), pauses
within the bound never add up to a refusal, a drop mid-body is INVALID_REQUEST, and a cancellation
asked by someone else stays a cancellation."""

from __future__ import annotations

import asyncio
import types

import pytest
from aiohttp import StreamReader
from aiohttp.base_protocol import BaseProtocol

from gateway.errors import ErrorCode, UompError
from gateway.remote.payload_service import BodyReader

pytestmark = pytest.mark.timeout(30)

IDLE = 0.3


def body() -> tuple[StreamReader, types.SimpleNamespace]:
    loop = asyncio.get_running_loop()
    proto = BaseProtocol(loop)
    proto.connection_made(asyncio.Transport())  # a connection that is open (never written to here)
    stream = StreamReader(proto, 2**16, loop=loop)
    return stream, types.SimpleNamespace(content=stream)


async def test_a_stall_is_refused_and_the_task_is_not_left_cancelled() -> None:
    stream, request = body()
    reader = BodyReader(request, IDLE)  # type: ignore[arg-type]
    stream.feed_data(b"first")
    assert await reader.read() == b"first"
    with pytest.raises(UompError) as e:
        await reader.read()  # nothing more comes
    assert e.value.code == ErrorCode.INVALID_REQUEST and "sent nothing" in e.value.message
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    with pytest.raises(UompError):  # a reader that refused stays refused
        await reader.read()
    reader.close()
    await asyncio.sleep(IDLE * 1.5)  # and nothing fires later at this task


async def test_pauses_within_the_bound_never_add_up() -> None:
    stream, request = body()
    reader = BodyReader(request, IDLE)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    for i in range(8):  # a read always waiting, 8 x IDLE/3 in all: far longer than IDLE
        loop.call_later(IDLE / 3 * (i + 1), stream.feed_data, b"%d" % i)
    got = b""
    while len(got) < 8:
        got += await reader.read()
    assert got == b"01234567"
    await asyncio.sleep(IDLE * 1.5)  # time between reads (the block's write) is no read's wait
    stream.feed_data(b"8")
    assert await reader.read() == b"8"
    loop.call_later(IDLE / 2, stream.feed_eof)
    assert await reader.read() == b""
    reader.close()


async def test_a_drop_is_refused_and_a_foreign_cancellation_stays_one() -> None:
    stream, request = body()
    reader = BodyReader(request, IDLE)  # type: ignore[arg-type]
    stream.set_exception(ConnectionResetError())
    with pytest.raises(UompError) as e:
        await reader.read()
    assert e.value.code == ErrorCode.INVALID_REQUEST and "broke off" in e.value.message
    reader.close()

    async def reading() -> bytes:
        _, req = body()
        r = BodyReader(req, 30.0)  # type: ignore[arg-type]
        try:
            return await r.read()
        finally:
            r.close()

    task = asyncio.ensure_future(reading())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
