"""The hash-chained access log: durability across reopen, torn-line recovery, tamper evidence,
group commit under concurrency, bounds, and the guard against secrets in events."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import UompError
from gateway.remote import access_chain
from gateway.remote import access_log as al
from gateway.remote.access_log import (
    GENESIS_PREV,
    MAX_READ,
    AccessLog,
    ChainError,
    line_hash,
    verify_chain,
)


def ev(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "session_id": f"sess_{i % 7}",
        "agent_id": "agent-a",
        "endpoint": "/v1/memory/x",
        "allowed": i % 3 != 0,
        "status": 200,
        "n": i,
        **extra,
    }


@pytest.fixture
def logpath(tmp_path: Path) -> Path:
    return tmp_path / "audit" / "access.jsonl"


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


# --------------------------------------------------------------------------- format, durability


def test_format_and_chain(logpath: Path) -> None:
    with AccessLog(logpath, clock=lambda: 1_784_000_000.25) as log:
        assert [log.append(ev(i)) for i in range(1, 4)] == [1, 2, 3]
        log.flush_sync()
    raw = lines(logpath)
    assert len(raw) == 3
    recs = [json.loads(r) for r in raw]
    assert [r["seq"] for r in recs] == [1, 2, 3]
    assert recs[0]["prev"] == GENESIS_PREV
    assert recs[1]["prev"] == line_hash(raw[0])
    assert recs[2]["prev"] == line_hash(raw[1])
    assert all(r["type"] == "gateway_access" for r in recs)
    assert recs[0]["timestamp"] == "2026-07-14T03:33:20.250Z"
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["timestamp"]) for r in recs)
    # canonical: sorted keys, no spaces
    assert raw[0] == json.dumps(recs[0], sort_keys=True, separators=(",", ":")).encode()
    assert logpath.read_bytes().endswith(b"\n")
    assert verify_chain(logpath) == 3


def test_permissions(logpath: Path) -> None:
    AccessLog(logpath).close()
    assert stat.S_IMODE(logpath.stat().st_mode) == 0o600
    assert stat.S_IMODE(logpath.parent.stat().st_mode) == 0o700


def test_existing_loose_file_is_tightened(logpath: Path) -> None:
    logpath.parent.mkdir(parents=True)
    logpath.write_bytes(b"")
    os.chmod(logpath, 0o644)
    AccessLog(logpath).close()
    assert stat.S_IMODE(logpath.stat().st_mode) == 0o600


async def test_durable_across_reopen(logpath: Path) -> None:
    log = AccessLog(logpath)
    for i in range(5):
        log.append(ev(i))
    await log.flush()
    log.close()
    log = AccessLog(logpath)
    assert log.last_seq == log.durable_seq == 5
    assert log.append(ev(6)) == 6
    await log.flush()
    log.close()
    assert verify_chain(logpath) == 6
    log = AccessLog(logpath)
    assert [e["seq"] for e in log.read()] == [1, 2, 3, 4, 5, 6]
    log.close()


def test_unicode_survives(logpath: Path) -> None:
    with AccessLog(logpath) as log:
        log.append(ev(1, key="记忆/café"))
    assert "记忆/café".encode() in logpath.read_bytes()
    assert verify_chain(logpath) == 1
    with AccessLog(logpath) as log:
        assert log.read()[0]["key"] == "记忆/café"


def test_close_flushes_and_is_idempotent(logpath: Path) -> None:
    log = AccessLog(logpath)
    log.append(ev(1))
    log.close()
    log.close()
    assert verify_chain(logpath) == 1
    with pytest.raises(UompError) as exc:
        log.append(ev(2))
    assert exc.value.code == "STORE_UNAVAILABLE"


def test_second_writer_is_refused(logpath: Path) -> None:
    log = AccessLog(logpath)
    with pytest.raises(UompError) as exc:
        AccessLog(logpath)
    assert exc.value.code == "STORE_UNAVAILABLE"
    log.close()
    AccessLog(logpath).close()  # the lock goes with the file


# ---------------------------------------------------------------------------------- recovery


def test_torn_last_line_is_cut(logpath: Path) -> None:
    with AccessLog(logpath) as log:
        for i in range(3):
            log.append(ev(i))
    good = logpath.read_bytes()
    with open(logpath, "ab") as f:
        f.write(b'{"agent_id":"agent-a","seq":4,"prev":"ab')  # crash mid-write
    with pytest.raises(ChainError) as exc:
        verify_chain(logpath)
    assert exc.value.seq == 4
    log = AccessLog(logpath)
    assert log.recovered_bytes == len(b'{"agent_id":"agent-a","seq":4,"prev":"ab')
    assert logpath.read_bytes() == good
    assert log.append(ev(4)) == 4
    log.close()
    assert verify_chain(logpath) == 4


def test_torn_only_line_is_cut(logpath: Path) -> None:
    logpath.parent.mkdir(parents=True)
    logpath.write_bytes(b'{"seq":1,"ti')
    with AccessLog(logpath) as log:
        assert log.recovered_bytes == 12
        assert log.append(ev(1)) == 1
    assert verify_chain(logpath) == 1
    assert json.loads(lines(logpath)[0])["prev"] == GENESIS_PREV


def test_zero_filled_tail_is_cut(logpath: Path) -> None:
    """A crash after the size grew but before the data reached the disk leaves NUL bytes."""
    with AccessLog(logpath) as log:
        log.append(ev(1))
    with open(logpath, "ab") as f:
        f.write(b"\0" * 300)
    with AccessLog(logpath) as log:
        assert log.recovered_bytes == 300
        assert log.append(ev(2)) == 2
    assert verify_chain(logpath) == 2


def test_damaged_last_complete_line_refuses_to_open(logpath: Path) -> None:
    with AccessLog(logpath) as log:
        log.append(ev(1))
    with open(logpath, "ab") as f:
        f.write(b"not json\n")
    with pytest.raises(ChainError) as exc:
        AccessLog(logpath)
    assert exc.value.code == "INTERNAL"
    assert isinstance(exc.value, ValueError)


def test_large_last_line_recovered(logpath: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(access_chain, "_TAIL_CHUNK", 16)  # the backwards scan crosses many chunks
    with AccessLog(logpath) as log:
        log.append(ev(1))
        log.append(ev(2, note="x" * 500))
    with AccessLog(logpath) as log:
        assert log.append(ev(3)) == 3
    assert verify_chain(logpath) == 3


# --------------------------------------------------------------------------------- tampering


def _write_log(path: Path, n: int) -> list[bytes]:
    with AccessLog(path) as log:
        for i in range(1, n + 1):
            log.append(ev(i))
    return lines(path)


def _rewrite(path: Path, raw: list[bytes]) -> None:
    path.write_bytes(b"".join(r + b"\n" for r in raw))


def test_tamper_edit_detected(logpath: Path) -> None:
    raw = _write_log(logpath, 5)
    rec = json.loads(raw[1])
    rec["allowed"] = not rec["allowed"]
    raw[1] = json.dumps(rec, sort_keys=True, separators=(",", ":")).encode()
    _rewrite(logpath, raw)
    with pytest.raises(ChainError) as exc:
        verify_chain(logpath)
    assert exc.value.seq == 3  # seq 3's prev no longer matches the altered seq 2
    assert "seq 3" in str(exc.value)


def test_tamper_edit_and_relink_detected_at_next(logpath: Path) -> None:
    """Re-linking the successor moves the break one line on, it never removes it."""
    raw = _write_log(logpath, 5)
    r2 = json.loads(raw[1])
    r2["agent_id"] = "someone-else"
    raw[1] = json.dumps(r2, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    r3 = json.loads(raw[2])
    r3["prev"] = line_hash(raw[1])
    raw[2] = json.dumps(r3, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    _rewrite(logpath, raw)
    with pytest.raises(ChainError) as exc:
        verify_chain(logpath)
    assert exc.value.seq == 4


@pytest.mark.parametrize(
    ("name", "mutate", "bad_seq"),
    [
        ("delete middle", lambda raw: raw[:2] + raw[3:], 3),
        ("swap two", lambda raw: [raw[0], raw[2], raw[1], *raw[3:]], 2),
        ("duplicate", lambda raw: raw[:3] + raw[2:], 4),
        ("delete first", lambda raw: raw[1:], 1),
        ("garbage line", lambda raw: [*raw[:2], b"garbage", *raw[2:]], 3),
        ("non canonical spacing", lambda raw: [raw[0].replace(b",", b", ", 1), *raw[1:]], 1),
        ("seq as bool", lambda raw: [raw[0].replace(b'"seq":1', b'"seq":true'), *raw[1:]], 1),
    ],
)
def test_tamper_table(logpath: Path, name: str, mutate: Any, bad_seq: int) -> None:
    raw = _write_log(logpath, 5)
    _rewrite(logpath, mutate(raw))
    with pytest.raises(ChainError) as exc:
        verify_chain(logpath)
    assert exc.value.seq == bad_seq, name


def test_verify_empty(logpath: Path) -> None:
    AccessLog(logpath).close()
    assert verify_chain(logpath) == 0


# ------------------------------------------------------------------------- concurrency, commit


async def test_concurrent_appends_and_flushes(logpath: Path) -> None:
    log = AccessLog(logpath)
    rng = random.Random(7)

    async def worker(w: int) -> list[int]:
        seqs = []
        for j in range(20):
            seqs.append(log.append(ev(w * 100 + j, worker=w)))
            if rng.random() < 0.5:
                await asyncio.sleep(0)
            if j % 5 == 4:
                await log.flush()
        await log.flush()
        return seqs

    results = await asyncio.gather(*(worker(w) for w in range(50)))
    all_seqs = sorted(s for r in results for s in r)
    assert all_seqs == list(range(1, 1001))
    assert log.durable_seq == 1000
    for r in results:  # each task sees its own events in order
        assert r == sorted(r)
    log.close()
    assert verify_chain(logpath) == 1000
    recs = [json.loads(x) for x in lines(logpath)]
    assert sorted((r["worker"], r["n"]) for r in recs) == sorted((w, w * 100 + j) for w in range(50) for j in range(20))


async def test_flush_means_durable(logpath: Path) -> None:
    """When flush returns, the event is in the file (read by an independent reader)."""
    log = AccessLog(logpath)

    async def one(i: int) -> None:
        seq = log.append(ev(i))
        await log.flush()
        assert log.durable_seq >= seq
        assert len(logpath.read_bytes().splitlines()) >= seq

    await asyncio.gather(*(one(i) for i in range(100)))
    log.close()


async def test_group_commit(logpath: Path) -> None:
    log = AccessLog(logpath)
    n = 200

    async def one(i: int) -> None:
        log.append(ev(i))
        await log.flush()

    await asyncio.gather(*(one(i) for i in range(n)))
    assert log.durable_seq == n
    assert 1 <= log.batches_written <= 3
    assert log.batches_written < n // 10
    log.close()
    assert verify_chain(logpath) == n


async def test_flush_with_nothing_pending_writes_nothing(logpath: Path) -> None:
    log = AccessLog(logpath)
    await log.flush()
    log.flush_sync()
    assert log.batches_written == 0
    log.close()


def test_threads_append_and_flush_sync(logpath: Path) -> None:
    log = AccessLog(logpath)

    def worker(w: int) -> None:
        for j in range(50):
            log.append(ev(j, worker=w))
            if j % 10 == 9:
                log.flush_sync()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    assert verify_chain(logpath) == 400


async def test_failed_write_is_rolled_back_and_counted(logpath: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed batch is cut back; its events are not retried as they were (their clients got 503):
    one access_log_gap event saying so heads the next batch that fits, and the chain has no gap."""
    log = AccessLog(logpath)
    log.append(ev(1))
    await log.flush()
    real_fsync = os.fsync
    fail = {"on": True}

    def flaky_fsync(fd: int) -> None:
        if fail["on"]:
            raise OSError(5, "I/O error")
        real_fsync(fd)

    monkeypatch.setattr(al.os, "fsync", flaky_fsync)
    t2 = log.append(ev(2))
    log.append(ev(3))
    with pytest.raises(UompError) as exc:
        await log.flush(t2)
    assert exc.value.code == "STORE_UNAVAILABLE"
    assert log.durable_seq == 1
    assert len(lines(logpath)) == 1  # the unsynced batch was cut back
    assert log.failing == "i/o error"
    with pytest.raises(UompError):  # fail-closed: refused and counted, not queued
        log.append(ev(4))
    assert log.pending == 0
    fail["on"] = False
    await log.ready()  # the next small write fits: writing again
    t = log.append(ev(5))
    await log.flush(t)
    log.close()
    assert verify_chain(logpath) == 3
    recs = [json.loads(x) for x in lines(logpath)]
    assert [r["seq"] for r in recs] == [1, 2, 3]
    gap = recs[1]
    assert gap["type"] == "access_log_gap" and gap["count"] == 3 and gap["status"] == 503
    assert gap["code"] == "STORE_UNAVAILABLE" and "i/o error" in gap["reason"]
    assert recs[2]["n"] == 5


# ------------------------------------------------------------------------------------- bounds


def test_pending_bound(logpath: Path) -> None:
    log = AccessLog(logpath, max_pending=10)
    for i in range(10):
        log.append(ev(i))
    with pytest.raises(UompError) as exc:
        log.append(ev(11))
    assert exc.value.code == "STORE_UNAVAILABLE"
    log.flush_sync()
    assert log.last_seq == 10  # the refused event took no seq
    log.append(ev(11))
    log.close()
    assert verify_chain(logpath) == 11


def test_pending_bytes_bound(logpath: Path) -> None:
    log = AccessLog(logpath, max_pending_bytes=1000)
    with pytest.raises(UompError):
        for i in range(100):
            log.append(ev(i, pad="p" * 100))
    assert log.pending * 100 <= 1400
    log.close()


def test_event_size_bound(logpath: Path) -> None:
    with AccessLog(logpath) as log:
        with pytest.raises(ValueError, match="larger"):
            log.append(ev(1, pad="x" * al.MAX_EVENT_BYTES))
        assert log.append(ev(1)) == 1


# -------------------------------------------------------------------------------- event guard


@pytest.mark.parametrize(
    "event",
    [
        {"token": "eyJ..."},
        {"Authorization": "Bearer x"},
        {"refresh_token": "r"},
        {"gateway_token": "r"},
        {"value": "memory value"},
        {"ciphertext": "base64"},
        {"private_key": "k"},
        {"request": {"headers": {"authorization": "Bearer x"}}},
        {"items": [{"key": "a", "value": "secret"}]},
        {"seq": 5},
        {"timestamp": "2020-01-01T00:00:00Z"},
        {"prev": "00"},
        {"n": float("nan")},
        {"n": float("inf")},
        {"blob": b"bytes"},
        {"s": {1, 2}},
        {1: "int key"},
        {"type": ""},
        {"type": 5},
        {"bad": "\ud800"},
        {"deep": [[[[[[[[[["x"]]]]]]]]]]},
    ],
    ids=lambda e: repr(e)[:40],
)
def test_refused_events(logpath: Path, event: dict[Any, Any]) -> None:
    with AccessLog(logpath) as log:
        with pytest.raises(ValueError):
            log.append(event)
        assert log.last_seq == 0
    assert logpath.read_bytes() == b""


def test_secret_never_reaches_the_file(logpath: Path) -> None:
    with AccessLog(logpath) as log:
        with pytest.raises(ValueError) as exc:
            log.append({"authorization": "Bearer s3cr3t-token-bytes"})
        assert "s3cr3t" not in str(exc.value)
    assert b"s3cr3t" not in logpath.read_bytes()


def test_custom_type_kept(logpath: Path) -> None:
    with AccessLog(logpath) as log:
        log.append({"type": "session_revoked", "session_id": "s"})
        log.flush_sync()
        assert log.read()[0]["type"] == "session_revoked"


def test_caller_dict_not_mutated(logpath: Path) -> None:
    event = ev(1)
    before = dict(event)
    with AccessLog(logpath) as log:
        log.append(event)
    assert event == before


# ------------------------------------------------------------------------------------ reading


@pytest.mark.parametrize("window", [64, 4096, 64 * 1024])
def test_read_by_seq(logpath: Path, monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    monkeypatch.setattr(access_chain, "_SCAN_WINDOW", window)  # small windows exercise the bisection
    rng = random.Random(1)
    n = 1500
    with AccessLog(logpath) as log:
        for i in range(1, n + 1):
            log.append(ev(i, pad="z" * rng.randrange(0, 200)))
        log.flush_sync()
        for after in [0, 1, 2, 499, 500, 777, 1000, n - 1, n, n + 5, -3]:
            got = log.read(after_seq=after, limit=50)
            start = max(after, 0) + 1
            assert [e["seq"] for e in got] == list(range(start, min(start + 50, n + 1))), after
        assert len(log.read(limit=10**6)) == MAX_READ
        assert len(log.read(limit=0)) == 1
        # read_raw gives the exact chained bytes
        raw = log.read_raw(after_seq=10, limit=2)
        assert json.loads(raw[1])["prev"] == line_hash(raw[0])


def test_read_only_durable(logpath: Path) -> None:
    with AccessLog(logpath) as log:
        log.append(ev(1))
        log.flush_sync()
        log.append(ev(2))
        assert [e["seq"] for e in log.read()] == [1]
        log.flush_sync()
        assert [e["seq"] for e in log.read()] == [1, 2]


def test_read_page_through_everything(logpath: Path) -> None:
    with AccessLog(logpath) as log:
        for i in range(2345):
            log.append(ev(i))
        log.flush_sync()
        seen: list[int] = []
        after = 0
        while page := log.read(after_seq=after, limit=MAX_READ):
            seen.extend(e["seq"] for e in page)
            after = page[-1]["seq"]
        assert seen == list(range(1, 2346))


# ------------------------------------------------------------------------- rotation, retention


def segment_files(logpath: Path) -> list[str]:
    return sorted(p.name for p in logpath.parent.glob("access-*.jsonl"))


def test_rotation_continues_the_chain_across_segments(logpath: Path) -> None:
    with AccessLog(logpath, segment_bytes=4096) as log:
        for i in range(1, 101):
            log.append(ev(i, pad="x" * 100))
            log.flush_sync()
    segs = segment_files(logpath)
    assert len(segs) >= 3
    assert verify_chain(logpath) == 100
    # every line of every file, in order, is one chain
    recs = [json.loads(x) for name in segs for x in (logpath.parent / name).read_bytes().splitlines()]
    recs += [json.loads(x) for x in lines(logpath)]
    assert [r["seq"] for r in recs] == list(range(1, 101))
    with AccessLog(logpath, segment_bytes=4096) as log:  # reopen continues seq and prev
        assert log.last_seq == 100
        assert [r["n"] for r in log.read(after_seq=0, limit=1000)] == list(range(1, 101))
        assert [r["seq"] for r in log.read(after_seq=57, limit=5)] == [58, 59, 60, 61, 62]
        log.append(ev(101))
    assert verify_chain(logpath) == 101


def test_retention_by_total_size_keeps_the_chain_verifiable(logpath: Path) -> None:
    with AccessLog(logpath, segment_bytes=4096, max_total_bytes=12 * 1024) as log:
        for i in range(1, 301):
            log.append(ev(i, pad="x" * 100))
            log.flush_sync()
        oldest = log.read(after_seq=0, limit=1)[0]["seq"]
    total = sum(p.stat().st_size for p in logpath.parent.glob("access*.jsonl") if "index" not in p.name)
    assert total <= 12 * 1024 + 4096
    assert oldest > 1  # the oldest events are gone
    n = verify_chain(logpath)  # from the oldest kept segment, anchored at the index's hashes
    assert n == 300 - oldest + 1
    index = [json.loads(x) for x in (logpath.parent / "access.index.jsonl").read_bytes().splitlines()]
    assert any("pruned" in x for x in index) and all("last_hash" in x for x in index if "pruned" not in x)


def test_retention_by_age(logpath: Path) -> None:
    now = [1_000_000.0]
    with AccessLog(logpath, segment_bytes=4096, retention_days=1, clock=lambda: now[0]) as log:
        for i in range(1, 61):
            log.append(ev(i, pad="x" * 100))
            log.flush_sync()
        before = segment_files(logpath)
        now[0] += 2 * 86400
        for i in range(61, 121):
            log.append(ev(i, pad="x" * 100))
            log.flush_sync()
    after = segment_files(logpath)
    assert before and not set(before) & set(after)
    verify_chain(logpath)


@pytest.mark.parametrize("tamper", ["delete-kept-segment", "edit-kept-segment", "edit-index-hash"])
def test_segment_tampering_is_detected(logpath: Path, tamper: str) -> None:
    with AccessLog(logpath, segment_bytes=4096) as log:
        for i in range(1, 101):
            log.append(ev(i, pad="x" * 100))
            log.flush_sync()
    seg = logpath.parent / segment_files(logpath)[1]
    index = logpath.parent / "access.index.jsonl"
    if tamper == "delete-kept-segment":
        seg.unlink()
    elif tamper == "edit-kept-segment":
        seg.write_bytes(seg.read_bytes().replace(b'"status":200', b'"status":201', 1))
    else:
        rows = index.read_bytes().splitlines()
        rec = json.loads(rows[0])
        rec["last_hash"] = "0" * 64
        rows[0] = al.encode_record(rec)
        index.write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(ChainError):
        verify_chain(logpath)


def test_crash_between_index_line_and_rename_is_finished_on_open(logpath: Path) -> None:
    with AccessLog(logpath, segment_bytes=1 << 30) as log:
        for i in range(1, 11):
            log.append(ev(i))
        log.flush_sync()
        first = log.read(limit=1)[0]
        last_line = log.read_raw(after_seq=9, limit=1)[0]
    # the index line of a rotation is durable, the rename did not happen (killed in between)
    access_chain.append_index(
        logpath.parent / "access.index.jsonl",
        {
            "file": "access-000000000001.jsonl",
            "first_seq": 1,
            "last_seq": 10,
            "first_prev": first["prev"],
            "last_hash": al.line_hash(last_line),
            "bytes": logpath.stat().st_size,
            "closed": 1.0,
        },
    )
    with AccessLog(logpath) as log:
        assert (logpath.parent / "access-000000000001.jsonl").exists()
        assert log.last_seq == 10
        log.append(ev(11))
    assert verify_chain(logpath) == 11
