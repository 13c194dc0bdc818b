"""A one-shot command says only warnings and errors on stderr (its result is its output); -v shows its INFO
and DEBUG lines; services keep INFO (their stderr is the service's log)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from gateway.config import Paths
from gateway.guard.audit import make_row

UOMP = [sys.executable, "-m", "gateway.cli.main"]


def uomp(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=60)


def pending_outbox_row(home: Path) -> str:
    """An audit row a refresh left in auth.db's outbox (its audit write not done yet): the next command
    that opens the Auth Service replays it, which logs at INFO."""
    row = make_row(
        session_id="ses_quiet", agent_id="agent_quiet", action="refresh", allowed=True, reason="refresh token rotated"
    )
    db = sqlite3.connect(Paths(home).auth_db)
    with db:
        db.execute("INSERT INTO audit_outbox (id, row) VALUES (?, ?)", (row[0], json.dumps(row)))
    db.close()
    return str(row[0])


def test_one_shot_commands_are_quiet_unless_verbose(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert uomp(home, "init").returncode == 0
    assert uomp(home, "sessions", "list").returncode == 0  # creates auth.db and its outbox table
    first = pending_outbox_row(home)
    quiet = uomp(home, "sessions", "list")
    assert quiet.returncode == 0 and quiet.stderr == ""
    events = json.loads(uomp(home, "audit", "--json").stdout)
    assert [e["id"] for e in events if e["id"] == first] == [first]  # replayed, just not said
    pending_outbox_row(home)
    loud = uomp(home, "-v", "sessions", "list")
    assert loud.returncode == 0 and "INFO uomp.auth auth: 1 audit row(s) replayed from the outbox" in loud.stderr
