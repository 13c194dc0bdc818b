"""The shared group-commit writer (gateway.durable) and the guard audit log on top of it.

After one failed audit write, a later flush with nothing pending never returned.
A full audit.db answered 500 and rows recorded what the agent did not get.
"""

from __future__ import annotations

import asyncio
import errno
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Paths
from gateway.durable import GroupCommitWriter, RefusalTally, describe_failure
from gateway.errors import UompError
from gateway.guard.audit import AuditLog


def enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


class FailFirst:
    """A write hook failing the first ``n`` batches with ENOSPC, then passing through."""

    def __init__(self, real: Any, n: int = 1) -> None:
        self.real, self.n, self.calls = real, n, 0

    def __call__(self, *args: Any) -> None:
        self.calls += 1
        if self.n > 0:
            self.n -= 1
            raise sqlite3.OperationalError("database or disk is full")
        self.real(*args)


async def test_audit_flush_after_a_failed_batch_returns(home: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    """First _write_batch raises, then flush() twice must return (it hung)."""
    hook = FailFirst(AuditLog._write_batch)
    monkeypatch.setattr(AuditLog, "_write_batch", lambda self, rows: hook(self, rows))
    log = AuditLog(home.audit_db)
    try:
        log.record(session_id="s1", agent_id="a", action="read", allowed=True, reason="r")
        with pytest.raises(Exception):  # noqa: B017 - the old code raised the raw sqlite error
            await asyncio.wait_for(log.flush(), 20)
        await asyncio.wait_for(log.flush(), 20)  # nothing pending: returns at once
        await asyncio.wait_for(log.flush(), 20)
        t = log.record(session_id="s1", agent_id="a", action="read", allowed=True, reason="later")
        await asyncio.wait_for(log.flush(t), 20)  # the writer is still usable
        assert next(r["reason"] for r in log.for_session("s1")) == "later"
    finally:
        log.close()


async def test_failed_batch_reaches_every_waiter_once(tmp_path: Path) -> None:
    written: list[list[int]] = []
    fail = threading.Event()
    fail.set()
    gate = threading.Event()

    def write(batch: list[int]) -> None:
        gate.wait(30)
        if fail.is_set():
            raise enospc()
        written.append(batch)

    failed: list[list[int]] = []
    w: GroupCommitWriter[int] = GroupCommitWriter(
        "test log", write, max_pending=100, on_failed=lambda b, e: failed.append(b)
    )
    try:
        tickets = [w.submit(i) for i in range(5)]
        waiters = [asyncio.ensure_future(w.flush(t)) for t in tickets]
        await asyncio.sleep(0)
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 20)
        assert all(isinstance(r, UompError) and r.code == "STORE_UNAVAILABLE" for r in results)
        assert "disk full" in str(results[0])
        assert failed == [[0, 1, 2, 3, 4]]
        assert w.failing == "disk full"
        await asyncio.wait_for(w.flush(), 20)  # reported once: nothing pending returns
        with pytest.raises(UompError):  # asked about its own ticket, a waiter still learns it failed
            await w.flush(tickets[0])
        fail.clear()
        t = w.submit(9)
        await asyncio.wait_for(w.flush(t), 20)
        assert written == [[9]] and w.failing is None
    finally:
        gate.set()
        w.close()


def test_pending_bound_refuses_rather_than_grows() -> None:
    w: GroupCommitWriter[int] = GroupCommitWriter("test log", lambda b: None, max_pending=3)
    try:
        for i in range(3):
            w.submit(i)
        with pytest.raises(UompError) as exc:
            w.submit(4)
        assert exc.value.code == "STORE_UNAVAILABLE"
        w.flush_sync()
        w.submit(4)
    finally:
        w.close()


@pytest.mark.parametrize(
    "exc,reason",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "disk full"),
        (sqlite3.OperationalError("database or disk is full"), "disk full"),
        (sqlite3.OperationalError("database is locked"), "database is locked"),
        (OSError(errno.EIO, "Input/output error"), "input/output error"),
    ],
    ids=["enospc", "sqlite-full", "sqlite-locked", "eio"],
)
def test_failure_reasons(exc: BaseException, reason: str) -> None:
    assert describe_failure(exc) == reason


def test_tally_take_and_done() -> None:
    t = RefusalTally(max_buckets=2)
    for k in ("a", "b", "c", "a"):
        t.add(k, reason="disk full", now=100.0)
    snap = t.take()
    assert snap is not None and snap["counts"] == {"a": 2, "b": 1, "other": 1}
    t.add("a", now=101.0)
    t.done(snap)
    assert t.counts == {"a": 1}


async def test_full_audit_db_is_503_and_rows_say_what_the_agent_got(
    home: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full audit.db: STORE_UNAVAILABLE (503), the lost rows counted per session, recovery at the
    next batch that fits, and the row finally written says 503, not the intended 'allowed'."""
    log = AuditLog(home.audit_db)
    hook = FailFirst(log._insert, n=3)
    monkeypatch.setattr(log, "_insert", hook)
    try:
        for _ in range(3):  # three requests while full: each waiter gets 503, nothing queues up
            t = log.record(session_id="s1", agent_id="a", action="read", allowed=True, reason="scope matched")
            with pytest.raises(UompError) as exc:
                await log.flush(t)
            assert exc.value.code == "STORE_UNAVAILABLE" and exc.value.status == 503
            assert log.writer.pending == 0
        assert log.lost.counts == {"s1|a": 3}
        t = log.record(session_id="s1", agent_id="a", action="read", allowed=True, reason="after")
        await log.flush(t)  # space is back: the next small batch fits
        rows = log.for_session("s1")
        assert [r["action"] for r in rows] == ["read", "audit_gap"]
        gap = rows[1]
        assert gap["allowed"] is False and "3 request(s)" in gap["reason"] and "503" in gap["reason"]
        assert "disk full" in gap["reason"]
        assert not any(r["reason"] == "scope matched" for r in rows)  # never recorded as allowed
        assert log.lost.total == 0
    finally:
        log.close()


# ------------------------------------------------------------------------ auth.db pruning, WAL


def test_prune_drops_expired_token_rows_only(home: Paths) -> None:
    from guardkit import guard_config

    from gateway import keys
    from gateway.guard.auth import PRUNE_MARGIN_SECONDS, AuthService

    keys.rotate(home, max_token_lifetime=3600)
    audit = AuditLog(home.audit_db)
    auth = AuthService(home, guard_config(), audit)
    try:
        now = auth.clock()
        old, live = now - PRUNE_MARGIN_SECONDS - 10, now + 600
        for i, exp in enumerate((old, old, live)):
            auth.db.execute(
                "INSERT INTO issued_tokens (token_hash, session_id, jti, kind, expires_at) VALUES (?,?,?,?,?)",
                (f"h{i}", "s", f"j{i}", "access", exp),
            )
            auth.db.execute("INSERT INTO token_blacklist VALUES (?,?,?,?)", (f"h{i}", "s", exp, "revoked"))
            auth.db.execute(
                "INSERT INTO refresh_tokens (jti, family_id, session_id, status, expires_at) VALUES (?,?,?,?,?)",
                (f"r{i}", "f", "s", "spent", exp),
            )
        out = auth.prune(batch=1)  # sliced: one row per table per call
        assert out["issued_tokens"] == out["token_blacklist"] == out["refresh_tokens"] == 1
        auth.prune()
        for table in ("issued_tokens", "token_blacklist", "refresh_tokens"):
            left = [r[0] for r in auth.db.execute(f"SELECT expires_at FROM {table}")]
            assert left == [live], table
    finally:
        auth.close_db()
        audit.close()


def test_large_wal_left_by_a_killed_writer_is_truncated_at_open(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from gateway.db import WAL_TRUNCATE_AT_OPEN_BYTES, connect

    db = tmp_path / "x.db"
    # a writer that commits a lot into the WAL and is killed before any checkpoint
    script = (
        "import sqlite3, os, signal\n"
        f"c = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
        "c.execute('PRAGMA journal_mode=WAL'); c.execute('PRAGMA wal_autocheckpoint=0')\n"
        "c.execute('CREATE TABLE t (b BLOB)')\n"
        "c.execute('BEGIN'); [c.execute('INSERT INTO t VALUES (?)', (os.urandom(4096),)) for _ in range(3000)]\n"
        "c.execute('COMMIT')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=False)
    wal = tmp_path / "x.db-wal"
    assert wal.stat().st_size > WAL_TRUNCATE_AT_OPEN_BYTES
    conn = connect(db, schema="", what="test database")
    try:
        assert wal.stat().st_size == 0
        assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 3000  # nothing lost
    finally:
        conn.close()
    assert os.path.exists(db)


# ------------------------------------------------------------------ caller-runs


class Recorder:
    """A write hook that records each batch and the thread that wrote it, and fails on overlap."""

    def __init__(self, fail: int = 0) -> None:
        self.batches: list[tuple[list[int], str]] = []
        self.fail = fail
        self.inside = 0
        self.overlaps = 0
        self.gate: threading.Event | None = None  # set: the next batch waits for it
        self.entered = threading.Event()
        self.slow = 0.0  # seconds each batch takes (widens any window for an overlap)

    def __call__(self, batch: list[int]) -> None:
        self.inside += 1
        try:
            if self.inside > 1:
                self.overlaps += 1
            self.entered.set()
            gate, self.gate = self.gate, None
            if gate is not None:
                assert gate.wait(10)
            time.sleep(self.slow)
            if self.fail > 0:
                self.fail -= 1
                raise enospc()
            self.batches.append((list(batch), threading.current_thread().name))
        finally:
            self.inside -= 1


def test_write_here_writes_the_pending_batch_on_the_calling_thread() -> None:
    rec = Recorder()
    w: GroupCommitWriter[int] = GroupCommitWriter("t", rec, max_pending=100)
    try:
        assert w.idle
        t1, t2, t3 = w.submit(1), w.submit(2), w.submit(3)
        assert not w.idle
        w.write_here(t2)
        # one batch, everything pending (the records of others too), written by this thread
        assert rec.batches == [([1, 2, 3], threading.current_thread().name)]
        assert w.idle and w.batches_here == 1 and w.batches_written == 1
        w.flush_sync(t3)  # durable already: nothing more is written
        w.write_here(t1)
        assert len(rec.batches) == 1
        # and the writer thread still serves the others
        t4 = w.submit(4)
        w.flush_sync(t4)
        assert rec.batches[1] == ([4], "t-writer")
    finally:
        w.close()


def test_write_here_if_idle_leaves_a_busy_writer_alone_and_never_overlaps() -> None:
    rec = Recorder()
    w: GroupCommitWriter[int] = GroupCommitWriter("t", rec, max_pending=100)
    try:
        rec.gate = gate = threading.Event()
        t1 = w.submit(1)
        w.kick()  # the writer thread starts the batch and is held in it
        assert rec.entered.wait(10)
        t2 = w.submit(2)
        assert not w.idle
        assert w.write_here_if_idle(t2) is False  # at once, nothing written by this thread
        assert w.batches_here == 0
        gate.set()
        w.flush_sync(t1)
        assert w.write_here_if_idle(t2) is True  # idle now: written here
        assert rec.batches == [([1], "t-writer"), ([2], threading.current_thread().name)]
        # many threads at once, each submitting and writing here, the writer thread flushing too
        rec.slow = 0.001
        done: list[int] = []

        def agent(i: int) -> None:
            for j in range(30):
                t = w.submit(1000 * (i + 1) + j)
                if j % 3 == 0:
                    w.flush_sync(t)
                else:
                    w.write_here(t)
                done.append(t)

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert rec.overlaps == 0
        written = [r for batch, _ in rec.batches for r in batch]
        assert sorted(written) == sorted([1, 2] + [1000 * (i + 1) + j for i in range(6) for j in range(30)])
        assert len(written) == len(set(written))  # each record exactly once
        assert len(done) == 180 and w.idle
    finally:
        w.close()


def test_write_here_failure_is_the_batch_failure_for_every_waiter() -> None:
    failed: list[list[int]] = []
    rec = Recorder(fail=1)
    w: GroupCommitWriter[int] = GroupCommitWriter(
        "t", rec, max_pending=100, on_failed=lambda batch, exc: failed.append(list(batch))
    )
    try:
        t1, t2 = w.submit(1), w.submit(2)
        with pytest.raises(UompError) as exc:
            w.write_here(t2)
        assert exc.value.code == "STORE_UNAVAILABLE" and "disk full" in exc.value.message
        assert failed == [[1, 2]] and w.failing == "disk full"
        with pytest.raises(UompError):
            w.flush_sync(t1)  # the other record of that batch failed with it
        assert rec.batches == []
        t3 = w.submit(3)
        w.write_here(t3)  # space is back
        assert rec.batches == [([3], threading.current_thread().name)] and w.failing is None
    finally:
        w.close()
