"""The gateway's events into the guard's log, batched by bytes: the guard (real, on its real Unix
socket) reads an internal request's body whole or refuses it with the right code; the gateway's
live drain and spool replay pack batches under the one shared limit
(gateway.contract.MAX_INTERNAL_EVENTS_BYTES), split a refused batch and set aside a single event
that stays refused, durably and reported, without holding back the rest."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from gatewaykit import ledger_events, verify_ledger
from guardkit import running_guard

from gateway import contract
from gateway.config import Paths
from gateway.remote.access_log import AccessLog
from gateway.remote.event_sink import EventSink, fits, new_event_id, spool_path, wire_size
from gateway.remote.guard_client import Forwarder, Upstream

PATH_PAD = "p" * 400  # events of ~600 bytes on the wire, as the gateway's refusals with long paths are


def refusal(i: int, pad: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "id": new_event_id(),
        "action": "read",
        "allowed": False,
        "code": "CERT_REQUIRED",
        "status": 401,
        "reason": f"refusal {i}",
        "path": f"/v1/memory/{PATH_PAD * pad}{i}",
        **extra,
    }


def sink_for(paths: Paths) -> tuple[EventSink, AccessLog, Forwarder]:
    paths.gateway_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    spool = AccessLog(spool_path(paths.gateway_dir))
    fwd = Forwarder(Upstream.parse(f"unix:{paths.guard_sock}"), timeout_seconds=10)
    return EventSink(fwd, spool, unauth_burst=1e9, unauth_events_per_second=1e9), spool, fwd


async def raw_post(
    paths: Paths, parts: list[bytes], *, length: int | None = None, pause: float = 0.0, close_early: bool = False
) -> tuple[int, dict[str, Any]]:
    """POST the internal events route over the guard's Unix socket, the body in ``parts`` with
    ``pause`` seconds between them; the status and JSON answer (0, {} when the guard closed)."""
    body_len = sum(len(p) for p in parts) if length is None else length
    reader, writer = await asyncio.open_unix_connection(str(paths.guard_sock))
    try:
        writer.write(
            (
                f"POST {contract.INTERNAL_EVENTS_PATH} HTTP/1.1\r\nHost: guard\r\n"
                f"Content-Type: application/json\r\nContent-Length: {body_len}\r\n\r\n"
            ).encode()
        )
        for p in parts:
            writer.write(p)
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)
        if close_early:
            writer.write_eof()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 40)
        status = int(head.split()[1])
        clen = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        return status, json.loads(await reader.readexactly(clen))
    except (asyncio.IncompleteReadError, ConnectionError):
        return 0, {}
    finally:
        writer.close()


def body_of(events: list[dict[str, Any]]) -> bytes:
    now = __import__("time").time()
    return json.dumps({"events": [dict(e, ts=now) for e in events]}).encode()


@pytest.mark.parametrize("count", [40, 400], ids=["under-64KiB", "over-64KiB"])
async def test_the_guard_reads_a_body_that_arrives_in_pieces_whole(home: Paths, count: int) -> None:
    async with running_guard(home, serve_tcp=False):
        events = [refusal(i) for i in range(count)]  # 400: ~250 KB, more than [guard] max_body_bytes (64 KiB)
        body = body_of(events)
        assert len(body) < contract.MAX_INTERNAL_EVENTS_BYTES
        pieces = [body[i : i + 7000] for i in range(0, len(body), 7000)]
        assert len(pieces) > 3
        status, answer = await raw_post(home, pieces, pause=0.02)
        assert (status, answer) == (200, {"accepted": count}), answer
        ids = {e["id"] for e in ledger_events(home, origin="gateway")}
        assert {e["id"] for e in events} <= ids


@pytest.mark.parametrize(
    ("case", "want_status", "want_code"),
    [
        pytest.param("over-declared", 413, "PAYLOAD_TOO_LARGE", id="declared-length-over-the-limit"),
        pytest.param("over-sent", 413, "PAYLOAD_TOO_LARGE", id="bytes-over-the-limit"),
        pytest.param("not-json", 400, "INVALID_REQUEST", id="malformed-json"),
        pytest.param("bad-event", 400, "INVALID_REQUEST", id="one-bad-event"),
    ],
)
async def test_the_guard_refuses_a_body_with_the_right_code(
    home: Paths, case: str, want_status: int, want_code: str
) -> None:
    limit = contract.MAX_INTERNAL_EVENTS_BYTES
    async with running_guard(home, serve_tcp=False):
        if case == "over-declared":
            status, answer = await raw_post(home, [b"{}"], length=limit + 1)
        elif case == "over-sent":
            big = body_of([refusal(i) for i in range(2000)])
            assert len(big) > limit
            status, answer = await raw_post(home, [big[i : i + 65536] for i in range(0, len(big), 65536)])
        elif case == "not-json":
            status, answer = await raw_post(home, [b'{"events": [', b'{"id": 1'])
        else:
            status, answer = await raw_post(home, [body_of([refusal(0), refusal(1, surprise="x")])])
        assert status == want_status and answer["error"]["code"] == want_code, (status, answer)
        # nothing of a refused body was written
        assert not ledger_events(home, origin="gateway")
        # and the guard still answers a good one
        status, answer = await raw_post(home, [body_of([refusal(7)])])
        assert (status, answer) == (200, {"accepted": 1})


async def test_a_body_that_breaks_off_writes_nothing_and_the_guard_goes_on(home: Paths) -> None:
    async with running_guard(home, serve_tcp=False):
        body = body_of([refusal(i) for i in range(50)])
        status, _ = await raw_post(home, [body[: len(body) // 2]], length=len(body), close_early=True)
        assert status in (0, 400)
        assert not ledger_events(home, origin="gateway")
        status, answer = await raw_post(home, [body])
        assert (status, answer) == (200, {"accepted": 50})


def test_batches_fit_the_shared_limit() -> None:
    big = [refusal(i, pad=4) for i in range(3000)]  # ~1.7 KB each: 1000 of them are over the limit
    n = fits([wire_size(e) for e in big])
    assert 1 <= n < contract.MAX_INTERNAL_EVENTS
    assert len(json.dumps({"events": big[:n]})) <= contract.MAX_INTERNAL_EVENTS_BYTES
    assert len(json.dumps({"events": big[: n + 1]})) > contract.MAX_INTERNAL_EVENTS_BYTES
    assert fits([10] * 5000) == contract.MAX_INTERNAL_EVENTS  # small events: the count decides
    assert fits([contract.MAX_INTERNAL_EVENTS_BYTES * 2, 10]) == 1  # a huge one goes alone (and is refused)
    assert fits([]) == 0


async def test_the_live_drain_sends_a_flood_in_byte_sized_batches(home: Paths) -> None:
    async with running_guard(home, serve_tcp=False):
        sink, spool, fwd = sink_for(home)
        try:
            futs = [sink.append(refusal(i, pad=4)) for i in range(1500)]  # one tick: ~2.5 MB
            await asyncio.wait_for(asyncio.gather(*[f for f in futs if f is not None]), 60)
            assert sink.events_spooled == 0 and sink.batches_refused == 0
            assert sink.requests_sent >= 2
            assert len(ledger_events(home, origin="gateway")) == 1500
        finally:
            await fwd.close()
            spool.close()


async def _spool_while_down(home: Paths, events: list[dict[str, Any]]) -> None:
    """The events, spooled: the guard is not running."""
    sink, spool, fwd = sink_for(home)
    try:
        futs = [sink.append(ev) for ev in events]
        await asyncio.wait_for(asyncio.gather(*[f for f in futs if f is not None]), 30)
        assert sink.events_spooled == len(events) and sink.backlog == len(events)
    finally:
        await fwd.close()
        spool.close()


async def test_a_poison_event_is_set_aside_and_the_rest_replays(home: Paths, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    events = [refusal(i) for i in range(300)]
    events[137] = refusal(137, surprise="secret-looking-field-value")  # the guard refuses this one, always
    await _spool_while_down(home, events)
    async with running_guard(home, serve_tcp=False):
        sink, spool, fwd = sink_for(home)
        try:
            done = await asyncio.wait_for(sink.replay(), 60)
            assert done == 299 and sink.backlog == 0
            assert sink.batches_refused >= 2 and sink.events_set_aside == 1
            logged = ledger_events(home, origin="gateway")
            ids = [e["id"] for e in logged]
            assert len(ids) == len(set(ids))  # no duplicates
            assert {e["id"] for e in events} - set(ids) == {events[137]["id"]}
            report = [e for e in logged if e["action"] == "gateway_event_set_aside"]
            assert len(report) == 1 and report[0]["detail"] == events[137]["id"]
            aside = sink.set_aside()
            assert [(a["id"], a["status"], a["code"]) for a in aside] == [(events[137]["id"], 400, "INVALID_REQUEST")]
            # the event itself is not lost: the spool keeps it, at the seq the list names
            kept = spool.read(after_seq=aside[0]["seq"] - 1, limit=1)[0]
            assert kept["id"] == events[137]["id"] and kept["surprise"] == "secret-looking-field-value"
            # neither the list nor the log lines carry the event's fields
            text = sink.set_aside_file.read_text() + caplog.text
            assert "secret-looking" not in text and PATH_PAD not in text
            assert "set aside" in caplog.text and "refused" in caplog.text
            # newer events go straight on
            fut = sink.append(refusal(999))
            assert fut is not None
            await asyncio.wait_for(fut, 10)
            assert sink.backlog == 0 and sink.events_spooled == 0
            assert verify_ledger(home).ok
            # a second replay has nothing to do
            assert await sink.replay() == 0
        finally:
            await fwd.close()
            spool.close()


async def test_replaying_the_same_events_again_writes_each_once(home: Paths) -> None:
    """The ack/marker window: the guard has a batch, the marker does not say so (a crash between
    the two); the replay sends it again and the guard dedupes by event id."""
    events = [refusal(i) for i in range(250)]
    await _spool_while_down(home, events)
    marker: Path = spool_path(home.gateway_dir).with_name("access.replayed")
    async with running_guard(home, serve_tcp=False):
        for _ in range(2):
            marker.unlink(missing_ok=True)
            sink, spool, fwd = sink_for(home)
            try:
                assert sink.backlog == 250
                assert await asyncio.wait_for(sink.replay(), 60) == 250
            finally:
                await fwd.close()
                spool.close()
        logged = [e["id"] for e in ledger_events(home, origin="gateway")]
        assert sorted(logged) == sorted(e["id"] for e in events)
        assert verify_ledger(home).ok


async def test_a_live_event_the_guard_refuses_is_spooled_then_set_aside_and_newer_ones_go_on(home: Paths) -> None:
    async with running_guard(home, serve_tcp=False):
        sink, spool, fwd = sink_for(home)
        try:
            bad = refusal(1, surprise="x")
            good = [refusal(i) for i in range(2, 40)]
            futs = [sink.append(bad), *[sink.append(ev) for ev in good]]  # one batch, refused whole
            await asyncio.wait_for(asyncio.gather(*[f for f in futs if f is not None]), 30)
            assert sink.batches_refused >= 1
            later = sink.append(refusal(99))
            assert later is not None
            await asyncio.wait_for(later, 30)  # the replay runs first: split, set aside, marker moved on
            assert sink.backlog == 0 and sink.events_set_aside == 1
            ids = {e["id"] for e in ledger_events(home, origin="gateway")}
            assert {e["id"] for e in good} <= ids and bad["id"] not in ids
            assert [a["id"] for a in sink.set_aside()] == [bad["id"]]
        finally:
            await fwd.close()
            spool.close()
