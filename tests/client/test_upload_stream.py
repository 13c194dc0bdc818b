"""The streamed upload's bounds on the real appliance (guard on its Unix socket, gateway with real TLS
1.3 and mTLS): each read of the body may wait ``payload_body_idle_timeout_seconds`` for bytes (one
deadline re-armed per read, so a slow body within it is taken and a stall is refused); a body of many
write blocks arrives byte for byte, and one byte too many, a flipped byte or a short body across
those blocks is refused with nothing left behind."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from gatewaykit import Appliance
from test_payload_relay import Sealed, agent_for, audit_rows, b64h, chunks, seal_consistent, store_state
from test_sdk import sdk_appliance

from gateway.config import Paths
from gateway.core import envelope
from gateway.remote.payload_service import WRITE_BLOCK

pytestmark = pytest.mark.timeout(60)

IDLE = 0.6  # the appliance's payload_body_idle_timeout_seconds here


@pytest.fixture
async def idle_app(home: Paths) -> AsyncIterator[Appliance]:
    async with sdk_appliance(
        home, status_cache_seconds=0, payload_max_bytes=8 << 20, payload_body_idle_timeout_seconds=IDLE
    ) as a:
        yield a


async def paced(data: bytes, pieces: int, pause: float) -> AsyncIterator[bytes]:
    """``data`` in ``pieces`` parts with ``pause`` seconds before each part after the first."""
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        if i:
            await asyncio.sleep(pause)
        yield data[i : i + step]


def refused_codes(paths: Paths) -> list[Any]:
    return [e.get("code") for e in audit_rows(paths, "payload_refused")]


async def test_each_read_has_the_idle_bound_not_the_whole_body(idle_app: Appliance) -> None:
    async with agent_for(idle_app) as a:
        # a stall longer than the bound, mid-body: refused, audited, nothing kept
        stalled = seal_consistent(idle_app.paths, a.session_id, a.agent_id, os.urandom(3000))
        got = await a.stream(stalled, paced(stalled.sealed, 2, IDLE * 2.5))
        assert (got[0], got[1]["error"]["code"]) == (400, "INVALID_REQUEST"), got
        assert "sent nothing" in got[1]["error"]["message"]
        assert store_state(idle_app.paths) == ([], [], [])
        assert refused_codes(idle_app.paths) == ["INVALID_REQUEST"]
        # the JSON form reads under the same bound
        doc = seal_consistent(idle_app.paths, a.session_id, a.agent_id)
        raw = json.dumps(doc.doc).encode()
        st, body = await a.send(
            "POST", "/v1/payload/upload", data=paced(raw, 2, IDLE * 2.5), headers={"Content-Type": "application/json"}
        )
        assert (st, body["error"]["code"]) == (400, "INVALID_REQUEST"), body
        # a slow body whose every pause is within the bound, though the whole takes longer: taken
        slow = seal_consistent(idle_app.paths, a.session_id, a.agent_id, os.urandom(3000))
        got = await a.stream(slow, paced(slow.sealed, 5, IDLE / 3))
        assert got[0] == 201, got
        # and the task that refused a stall serves the next upload normally
        fast = seal_consistent(idle_app.paths, a.session_id, a.agent_id)
        assert (await a.stream(fast))[0] == 201
    rows, blobs, tmp = store_state(idle_app.paths)
    assert sorted(rows) == sorted([slow.doc["payload_id"], fast.doc["payload_id"]]) == blobs and tmp == []


def big(paths: Paths, a: Any, size: int) -> Sealed:
    return seal_consistent(paths, a.session_id, a.agent_id, os.urandom(size))


async def test_a_body_of_many_blocks_is_kept_whole_and_its_faults_refused(idle_app: Appliance) -> None:
    size = 3 * WRITE_BLOCK + 12345  # several write blocks and a partial one
    async with agent_for(idle_app) as a:
        # one byte more than declared, arriving in the last block: refused, nothing left
        s = big(idle_app.paths, a, size)
        got = await a.stream(s, chunks(s.sealed + b"x", 65536))
        assert (got[0], got[1]["error"]["code"]) == (413, "PAYLOAD_TOO_LARGE"), got
        # one byte flipped in the second block: the hash over all blocks refuses it
        bad = bytearray(s.sealed)
        bad[WRITE_BLOCK + 7] ^= 1
        got = await a.stream(s, chunks(bytes(bad), 65536))
        assert (got[0], got[1]["error"]["code"]) == (400, "PAYLOAD_HASH_MISMATCH"), got
        # a body one block short (chunked: no Content-Length to refuse it early)
        got = await a.stream(s, chunks(s.sealed[:-WRITE_BLOCK], 65536))
        assert (got[0], got[1]["error"]["code"]) == (400, "PAYLOAD_SIZE_MISMATCH"), got
        assert store_state(idle_app.paths) == ([], [], [])
        # the same bytes whole, in pieces of several sizes: kept byte for byte
        for piece in (65536, 1 << 20, 3 * WRITE_BLOCK):
            s = big(idle_app.paths, a, size)
            got = await a.stream(s, chunks(s.sealed, piece))
            assert got[0] == 201, got
            blob = (idle_app.paths.payload_dir / "blobs" / s.doc["payload_id"]).read_bytes()
            assert blob == s.sealed
            assert s.doc["hash"] == "sha256:" + hashlib.sha256(blob).hexdigest()
    assert store_state(idle_app.paths)[2] == []


async def pieces_of(data: bytes, sizes: tuple[int, ...]) -> AsyncIterator[bytes]:
    """``data`` cut in turn into pieces of each of ``sizes`` (cycling), each its own write."""
    i = k = 0
    while i < len(data):
        step = sizes[k % len(sizes)]
        yield data[i : i + step]
        i += step
        k += 1


async def broken_off(data: bytes, after: int) -> AsyncIterator[bytes]:
    """The first ``after`` bytes, then the sender fails: the connection is dropped mid-body."""
    yield data[:after]
    raise ConnectionResetError("the sender went away")


async def test_the_body_is_kept_whatever_its_pieces_and_a_cut_body_leaves_nothing(idle_app: Appliance) -> None:
    """The relay takes each piece as it came off the wire: a body in one-byte pieces, in odd-sized
    ones (with Content-Length, and chunked where an HTTP chunk's end carries no bytes), and in one
    write of several blocks is kept byte for byte; a body cut off or longer than declared is refused
    and leaves nothing."""
    size = 2 * WRITE_BLOCK + 4099

    def length(s: Sealed) -> dict[str, str]:
        return {"Content-Length": str(len(s.sealed))}

    async with agent_for(idle_app) as a:
        kept: list[str] = []

        async def stored(s: Sealed, body: Any, headers: dict[str, str] | None = None) -> None:
            got = await a.send(
                "POST",
                "/v1/payload/upload",
                data=body,
                headers={
                    "Content-Type": "application/octet-stream",
                    envelope.HEADER_NAME: b64h(s.header()),
                    **(headers or {}),
                },
            )
            assert got[0] == 201, got
            blob = (idle_app.paths.payload_dir / "blobs" / s.doc["payload_id"]).read_bytes()
            assert blob == s.sealed
            assert got[1]["hash"] == s.doc["hash"] == "sha256:" + hashlib.sha256(blob).hexdigest()
            kept.append(s.doc["payload_id"])

        small = big(idle_app.paths, a, 3000)
        await stored(small, chunks(small.sealed, 1), length(small))  # Content-Length, one byte a write
        small = big(idle_app.paths, a, 3000)
        await stored(small, chunks(small.sealed, 1))  # chunked: one-byte HTTP chunks
        odd = (1, 7, 4093, 16385, 65537, 1, 999_983)
        s = big(idle_app.paths, a, size)
        await stored(s, pieces_of(s.sealed, odd), length(s))
        s = big(idle_app.paths, a, size)
        await stored(s, pieces_of(s.sealed, odd))
        s = big(idle_app.paths, a, size)
        await stored(s, s.sealed)  # one write of several blocks, with Content-Length

        # cut off mid-body (Content-Length promised more): refused, nothing of it kept
        s = big(idle_app.paths, a, size)
        with pytest.raises(aiohttp.ClientError):
            await a.send(
                "POST",
                "/v1/payload/upload",
                data=broken_off(s.sealed, WRITE_BLOCK + 5),
                headers={
                    "Content-Type": "application/octet-stream",
                    envelope.HEADER_NAME: b64h(s.header()),
                    **length(s),
                },
            )
        # longer than declared, in odd pieces (chunked, so only the relay's count can refuse it)
        got = await a.stream(s, pieces_of(s.sealed + b"\0" * 3, odd))
        assert (got[0], got[1]["error"]["code"]) == (413, "PAYLOAD_TOO_LARGE"), got
    for _ in range(100):  # the cut-off upload's refusal is recorded once its handler has seen the drop
        if len(refused_codes(idle_app.paths)) == 2:
            break
        await asyncio.sleep(0.05)
    assert sorted(refused_codes(idle_app.paths)) == ["INVALID_REQUEST", "PAYLOAD_TOO_LARGE"]
    rows, blobs, tmp = store_state(idle_app.paths)
    assert sorted(rows) == sorted(kept) == blobs and tmp == []


async def raw_upload(app: Appliance, agent: Any, token: str, s: Sealed, frames: list[bytes]) -> tuple[int, Any]:
    """A chunked upload over the agent's own mTLS connection, its chunked framing written by hand:
    each of ``frames`` is one write, a short pause after each so that it arrives on its own."""
    host, port = app.base.removeprefix("https://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), ssl=agent.ssl(), server_hostname="localhost")
    try:
        head = (
            f"POST /v1/payload/upload HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
            f"X-UOMP-Agent-Id: {agent.agent_id}\r\nContent-Type: application/octet-stream\r\n"
            f"{envelope.HEADER_NAME}: {b64h(s.header())}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        for frame in [head.encode(), *frames]:
            writer.write(frame)
            await writer.drain()
            await asyncio.sleep(IDLE / 6)
        status = int((await reader.readline()).split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        return status, json.loads(await reader.read())
    finally:
        writer.close()


async def test_a_chunk_end_arriving_after_its_bytes_is_not_the_body_end(idle_app: Appliance) -> None:
    """A chunked body whose chunk ends (the CRLF after a chunk's bytes) arrive apart from the bytes,
    after the relay has taken them: the body goes on to its last chunk and is kept whole."""
    agent = idle_app.agent("calendar_agent", sub="raw")
    g = await idle_app.grant(agent)
    s = seal_consistent(idle_app.paths, g["session_id"], agent.agent_id, os.urandom(5000))
    data = s.sealed
    cut = (0, 1, 1000, len(data) - 7, len(data))
    frames: list[bytes] = []
    for lo, hi in itertools.pairwise(cut):
        frames += [b"%x\r\n" % (hi - lo) + data[lo:hi], b"\r\n"]
    frames.append(b"0\r\n\r\n")
    got = await raw_upload(idle_app, agent, g["token"], s, frames)
    assert got[0] == 201, got
    assert (idle_app.paths.payload_dir / "blobs" / s.doc["payload_id"]).read_bytes() == data
