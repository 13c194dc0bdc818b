"""``uomp status`` checks the audit log once: its own bounded check (what it reports) reads the
guard's tail; listing the sessions opens the log with a one-shot command's short tail instead of
running that check a second time. The damage the report must show is still shown."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from guardkit import guard_config

from gateway.cli import status
from gateway.cli.guard import open_auth
from gateway.config import Paths
from gateway.guard.audit import make_row, open_audit
from gateway.ledger import integrity

EVENTS = 1500  # checkpoints every 100: the newest at 1500, the guard's tail (1024) reaches back to 476


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    home = tmp_path / "h"
    subprocess.run(
        [sys.executable, "-m", "gateway.cli.main", "--home", str(home), "init"], check=True, capture_output=True
    )
    p = Paths(home)
    log = open_audit(p, guard_config(audit_checkpoint_events=100))
    try:
        rows = [
            make_row(session_id="s", agent_id="a", action="read", allowed=True, reason="ok", key=f"k.{i}")
            for i in range(EVENTS)
        ]
        for b in range(0, EVENTS, 500):
            log.write_now(rows[b : b + 500])
    finally:
        log.close()
    auth = open_auth(p, guard_config())  # makes auth.db, as the guard's first start does
    auth.close_db()
    auth.audit.close()
    return p


def tails_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``tail`` of every check_log call from now on (the real check runs)."""
    seen: list[int] = []
    real = integrity.check_log

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(int(kwargs.get("tail", integrity.TAIL_EVENTS)))
        return real(*args, **kwargs)

    monkeypatch.setattr(integrity, "check_log", spy)
    return seen


def test_status_runs_the_guards_bounded_check_once(paths: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = tails_read(monkeypatch)
    s = status.collect(paths)
    assert s["audit_log"]["ok"] is True and s["audit_log"]["events"] == EVENTS
    assert s["active_sessions"] == []  # listed (none yet): the auth database was opened
    assert sorted(seen) == [integrity.CHANGE_TAIL_EVENTS, integrity.TAIL_EVENTS]


def test_damage_inside_the_guards_tail_is_still_reported(paths: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    """Event 1000: beyond a one-shot command's tail, inside the guard's: status reports it refused."""
    with sqlite3.connect(paths.audit_db, isolation_level=None) as conn:
        conn.execute("UPDATE ledger_events SET allowed = 1 - allowed WHERE seq = 1000")
    seen = tails_read(monkeypatch)
    s = status.collect(paths)
    assert s["audit_log"]["ok"] is False and s["audit_log"]["code"] == "AUDIT_LOG_DAMAGED"
    assert s["audit_log"]["first_bad_seq"] == 1000
    assert not s["healthy"]
    assert integrity.TAIL_EVENTS in seen
