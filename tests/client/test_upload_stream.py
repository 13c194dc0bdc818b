"""The streamed upload's bounds on the real appliance (guard on its Unix socket, gateway with real TLS
1.3 and mTLS): each read of the body may wait ``payload_body_idle_timeout_seconds`` for bytes (one
deadline re-armed per read, so a slow body within it is taken and a stall is refused); a body of many
write blocks arrives byte for byte, and one byte too many, a flipped byte or a short body across
those blocks is refused with nothing left behind."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from gatewaykit import Appliance
from test_payload_relay import Sealed, agent_for, audit_rows, chunks, seal_consistent, store_state
from test_sdk import sdk_appliance

from gateway.config import Paths
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
