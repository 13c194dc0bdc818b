"""Retention (§18.3) on a log that has grown: the purge runs in short slices, so the reads' audit
commits go in between, the WAL stays small, and each run starts where the last one stopped."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from guardkit import guard_config, held_lock

from gateway.cli.main import main
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError
from gateway.guard import audit as audit_mod
from gateway.guard.audit import AuditLog, make_row, open_audit

DAY = 86_400.0


def _row(now: float | None = None) -> tuple[object, ...]:
    return make_row(
        session_id="sess_ret",
        agent_id="agent-1",
        action="read",
        allowed=True,
        reason="scope matched",
        key="preference.theme",
        tags=["preference"],
        response_size=12,
        query_count_remaining=9,
        via="gateway:mtls:test",
        now=now,
        extra={"listener": "mtls", "client": "127.0.0.1:40001", "request_id": "req_0011223344556677"},
    )


def _fill(log: AuditLog, n: int, start: float, step: float = 0.01) -> None:
    for b in range(0, n, 1000):
        log.write_now([_row(start + (b + i) * step) for i in range(min(1000, n - b))])


def _bodies(db: Path, before: float) -> int:
    with sqlite3.connect(db) as conn:
        return int(
            conn.execute("SELECT COUNT(*) FROM ledger_events WHERE ts < ? AND body IS NOT NULL", (before,)).fetchone()[
                0
            ]
        )


def test_a_large_purge_lets_reads_commit_between_its_slices(
    home: Paths, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """20,000 events past retention, pruned while another thread commits a read's event: the commit
    is durable while the purge still has bodies to drop (one UPDATE held every commit until it had
    dropped them all), the WAL stays bounded, and the pruned log still verifies."""
    monkeypatch.setattr(audit_mod, "PURGE_SLICE_EVENTS", 200, raising=False)
    # 100 slices with 20 ms between them: the read's commit has ~2 s to come in while bodies are left,
    # however loaded the machine (with the product's 2 ms a busy CI could see the purge end first)
    monkeypatch.setattr(audit_mod, "PURGE_PAUSE_SECONDS", 0.02, raising=False)
    db = home.audit_db
    now = time.time()
    log = open_audit(home, guard_config(audit_retention_days=90))
    try:
        _fill(log, 20_000, now - 95 * DAY)
        _fill(log, 100, now - DAY)  # kept
        cutoff = now - 90 * DAY
        assert _bodies(db, cutoff) == 20_000
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        got: list[int] = []
        purger = threading.Thread(target=lambda: got.append(log.purge(now=now)))
        purger.start()
        deadline = time.monotonic() + 30
        while _bodies(db, cutoff) == 20_000 and purger.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)  # until the first slice is committed
        log.flush_sync(log.submit(_row()))  # a read's event, committed by the writer thread
        left_when_durable = _bodies(db, cutoff)
        purger.join(60)
        assert got == [20_000]
        assert 0 < left_when_durable < 20_000, left_when_durable
        assert _bodies(db, cutoff) == 0 and _bodies(db, time.time() + 1) == 101  # the recent ones keep theirs
        assert os.path.getsize(str(db) + "-wal") < 8 * 1024 * 1024
    finally:
        log.close()
    assert main(["--home", str(home.home), "audit", "verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["events"] == 20_101


def test_each_run_starts_where_the_last_stopped(tmp_path: Path) -> None:
    """Events pruned in time order, each run from the last cutoff: a later run prunes only what came
    due since. An event written afterwards with a time before the last cutoff (a spool replayed
    after the retention period) keeps its body in this process and loses it at the next start."""
    db = tmp_path / "audit.db"
    now = time.time()
    log = AuditLog(db, retention_days=90)
    try:
        _fill(log, 300, now - 95 * DAY, step=60.0)  # 5 hours of events, 95 days ago
        _fill(log, 10, now - DAY)
        assert log.purge(now=now - 5 * DAY) == 0  # none due yet
        assert log.purge(now=now) == 300
        assert log.purge(now=now) == 0
        log.write_now([_row(now - 93 * DAY)])  # late, and already past the cutoff
        log.write_now([_row(now - 89.5 * DAY)])  # due in half a day
        assert log.purge(now=now) == 0
        assert log.purge(now=now + DAY) == 1  # the one that came due; not the late one
        assert _bodies(db, now - 90 * DAY) == 1
    finally:
        log.close()
    again = AuditLog(db, retention_days=90)  # the next start
    try:
        assert again.purge(now=now + DAY) == 1
        assert _bodies(db, now + DAY) == 10
    finally:
        again.close()


def test_a_log_with_no_body_left_is_not_walked_again(tmp_path: Path) -> None:
    """Every body pruned: the run finds none on its own connection and remembers the cutoff."""
    db = tmp_path / "audit.db"
    now = time.time()
    log = AuditLog(db, retention_days=90)
    try:
        _fill(log, 50, now - 100 * DAY)
        assert log.purge(now=now) == 50
    finally:
        log.close()
    again = AuditLog(db, retention_days=90)
    try:
        assert again.purge(now=now) == 0
        assert again._purged_below is not None and again._purged_below >= now - 90 * DAY
    finally:
        again.close()


def test_a_purge_that_meets_another_writer_is_store_busy_and_resumes_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """audit.db held by another process (a user's sqlite3 shell) in the middle of the bodies due: the
    purge is refused STORE_BUSY within the busy timeout, what it pruned before stays pruned, the rest
    keep their bodies, and the next run (the lock gone) finishes from where the log stands."""
    monkeypatch.setattr(audit_mod, "PURGE_SLICE_EVENTS", 100)
    db = tmp_path / "audit.db"
    now = time.time()
    log = AuditLog(db, retention_days=90, busy_timeout=0.2)
    try:
        _fill(log, 1000, now - 95 * DAY)
        cutoff = now - 90 * DAY
        held = held_lock(db)
        pauses = {"n": 0}

        class Clock:  # the module's time, with the pause between two slices as the moment to lock
            def __getattr__(self, name: str) -> object:
                return getattr(time, name)

            def sleep(self, seconds: float) -> None:
                pauses["n"] += 1
                if pauses["n"] == 3:  # three slices committed: another process takes the write lock
                    held.__enter__()
                time.sleep(seconds)

        monkeypatch.setattr(audit_mod, "time", Clock())
        try:
            with pytest.raises(UompError) as err:
                log.purge(now=now)
            assert err.value.code == ErrorCode.STORE_BUSY
            assert _bodies(db, cutoff) == 700  # three slices of 100 pruned, none half-done
        finally:
            held.__exit__(None, None, None)
        assert log.purge(now=now) == 700
        assert _bodies(db, cutoff) == 0
    finally:
        log.close()
