"""A clean stop signs a final checkpoint; ``uomp audit proof`` on a stopped appliance signs one
itself (it holds the same audit key) instead of "try again shortly", and never beside a running
guard: not while ``uomp gateway start`` holds the appliance lock, not while a guard answers on its
socket. Real processes: ``uomp gateway start`` / ``uomp guard serve`` as subprocesses, SIGTERM."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from shortdir import short_dir

UOMP = [sys.executable, "-m", "gateway.cli.main"]
WAIT = 60.0  # a bound for a process to come up or stop (a safety net, not a timing claim)
CONFIG = "[guard]\naudit_checkpoint_seconds = 3600.0\naudit_checkpoint_events = 100000\n"

pytestmark = pytest.mark.timeout(120)


def uomp(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=90)


@pytest.fixture
def home() -> Iterator[Path]:
    d = short_dir("uomp-st-") / "home"
    assert uomp(d, "init").returncode == 0
    (d / "config.toml").write_text(CONFIG)
    yield d
    import shutil

    shutil.rmtree(d.parent, ignore_errors=True)


def log_state(home: Path) -> tuple[int, int, int]:
    """(events, newest checkpoint size, checkpoints) as on disk."""
    conn = sqlite3.connect(f"file:{home / 'audit.db'}?mode=ro", uri=True)
    try:
        events = conn.execute("SELECT COUNT(*) FROM ledger_events").fetchone()[0]
        size, count = conn.execute("SELECT COALESCE(MAX(size), 0), COUNT(*) FROM ledger_checkpoints").fetchone()
    finally:
        conn.close()
    return int(events), int(size), int(count)


def newest_event(home: Path) -> str:
    conn = sqlite3.connect(f"file:{home / 'audit.db'}?mode=ro", uri=True)
    try:
        return str(conn.execute("SELECT id FROM ledger_events ORDER BY seq DESC LIMIT 1").fetchone()[0])
    finally:
        conn.close()


def until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached")


def unsigned_event(home: Path, key: str) -> str:
    """A user event appended to the log with no checkpoint over it (what a guard killed before its next
    checkpoint leaves behind; the CLI's own writes sign at once). Its id."""
    from gateway.config import Paths
    from gateway.guard.audit import make_row, row_event
    from gateway.ledger import auditkey
    from gateway.ledger.log import EventLog

    paths = Paths(home)
    k = auditkey.load(paths)
    row = make_row(
        session_id="user",
        agent_id="user",
        action="memory_added",
        allowed=True,
        reason="the user added a memory item",
        key=key,
    )
    conn = sqlite3.connect(paths.audit_db, isolation_level=None, timeout=30)
    try:
        log = EventLog(conn, origin=auditkey.origin_for(k.public_key()), key=k)
        conn.execute("BEGIN IMMEDIATE")
        log.reload()
        log.append([row_event(row)])
        conn.execute("COMMIT")
    finally:
        conn.close()
    return str(row[0])


def add_item(home: Path, key: str) -> None:
    """A user event (memory_added), written by the CLI's code in this process, beside the appliance."""
    from gateway.cli.main import main

    assert (
        main(["--home", str(home), "memory", "add", key, "--value", '"x"', "--tag", "t", "--sensitivity", "low"]) == 0
    )


def proof_verifies(home: Path, event_id: str) -> None:
    out = home.parent / "p.json"
    res = uomp(home, "audit", "proof", event_id, "--out", str(out))
    assert res.returncode == 0, res.stderr
    res = uomp(home, "audit", "verify-proof", str(out))
    assert res.returncode == 0 and "proof OK" in res.stdout, res.stdout + res.stderr
    assert json.loads(out.read_text())["event"]["id"] == event_id


def test_clean_stop_signs_and_the_cli_never_signs_beside_a_running_guard(home: Path) -> None:
    add_item(home, "a.one")  # the first event is signed at once (no checkpoint yet)
    proc = subprocess.Popen(
        [*UOMP, "--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        until(lambda: uomp(home, "status").returncode == 0, "the appliance running")
        add_item(home, "a.two")
        pending = unsigned_event(home, "a.three")
        events, size, checkpoints = log_state(home)
        assert size < events  # the newest events are outside every signed checkpoint
        res = uomp(home, "audit", "proof", pending)
        assert res.returncode == 1 and "error STORE_BUSY" in res.stderr and "running guard" in res.stderr
        assert log_state(home)[1:] == (size, checkpoints)  # nothing signed beside the running guard
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events, size, _ = log_state(home)
    assert size == events  # the final checkpoint covers every event, the stop's own included
    proof_verifies(home, pending)


def test_stopped_appliance_cli_signs_itself_but_not_under_a_held_lock_or_a_live_guard(home: Path) -> None:
    add_item(home, "b.one")
    pending = unsigned_event(home, "b.two")  # left by a guard killed before its checkpoint: not signed yet
    events, size, checkpoints = log_state(home)
    assert size < events

    # an appliance holding the lock (a `uomp gateway start` starting up, say): no signing
    lock = home / "gateway" / "appliance.lock"
    lock.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        res = uomp(home, "audit", "proof", pending)
        assert res.returncode == 1 and "error STORE_BUSY" in res.stderr
        assert log_state(home)[1:] == (size, checkpoints)
    finally:
        os.close(fd)

    # a guard started on its own (no appliance lock), answering on its socket: no signing either
    guard = subprocess.Popen(
        [*UOMP, "--home", str(home), "guard", "serve", "--no-tcp"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        until(lambda: (home / "guard.sock").exists(), "the guard's socket")
        time.sleep(0.2)
        res = uomp(home, "audit", "proof", pending)
        assert res.returncode == 1 and "error STORE_BUSY" in res.stderr
        assert log_state(home)[1:] == (size, checkpoints)
        guard.send_signal(signal.SIGINT)
        assert guard.wait(WAIT) == 0
    finally:
        if guard.poll() is None:
            guard.kill()
            guard.wait()
    assert log_state(home)[1] == log_state(home)[0]  # its clean stop (SIGINT) signed every event

    # nothing running, an unsigned event: the CLI signs a checkpoint itself and the proof verifies
    pending = unsigned_event(home, "b.three")
    events, size, checkpoints = log_state(home)
    assert size < events
    proof_verifies(home, pending)
    assert log_state(home)[1:] == (events, checkpoints + 1)
    res = uomp(home, "audit", "verify")
    assert res.returncode == 0, res.stdout + res.stderr
