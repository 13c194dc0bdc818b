"""§19.5: a session that ends although its agent owed a deletion proof is marked abnormal, in the
session view (CLI list/show, dashboard) and by the audit's deletion_proof_missing event; a session
that gave its proof, or never owed one, or is still running, is not."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.main import main
from gateway.config import GuardConfig, Paths
from gateway.guard.audit import open_audit
from gateway.guard.auth import AuthService

READ = {"tags": ["preference"], "keys": []}
OWES = {"proof_required": True, "max_retention_seconds": 0, "deletion_method": "process_termination"}
FREE = {"proof_required": False, "max_retention_seconds": 0, "deletion_method": "process_termination"}


def _session(auth: AuthService, agent: str, retention: dict[str, Any] | None, minutes: float = 1) -> str:
    body: dict[str, Any] = {"agent_id": agent, "requested_scopes": {"read": READ}, "duration_minutes": minutes}
    if retention is not None:
        body["data_retention_policy"] = retention
    sid = str(auth.create_session(body)["session_id"])
    auth.grant(sid, {"granted_scopes": {"read": READ}})
    return sid


def test_abnormal_only_when_an_owed_proof_is_missing_at_the_end(
    home: Paths, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    clock = [time.time()]
    cfg = GuardConfig()
    audit = open_audit(home, cfg)
    auth = AuthService(home, cfg, audit, clock=lambda: clock[0])
    try:
        owed = _session(auth, "owes", OWES)
        proved = _session(auth, "proved", OWES)
        free = _session(auth, "free", FREE)
        none = _session(auth, "none", None)
        running = _session(auth, "running", OWES, minutes=60)
        revoked = _session(auth, "revoked", OWES, minutes=60)
        auth.record_deletion_proof(proved, "dp_1")
        assert auth.session(owed).public()["abnormal"] is False  # still running: nothing owed yet
        auth.revoke(revoked)
        clock[0] += 61
        views = {r["session_id"]: r for r in auth.list_sessions()}
    finally:
        auth.close_db()
        audit.close()
    assert views[owed]["abnormal"] is True and "deletion proof" in views[owed]["abnormal_reason"]
    assert views[revoked]["abnormal"] is True
    for sid in (proved, free, none, running):
        assert views[sid]["abnormal"] is False and "abnormal_reason" not in views[sid]
    # the CLI's list marks it; its JSON carries it
    assert main(["--home", str(home.home), "sessions", "list"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert "ABNORMAL" in lines[owed] and "ABNORMAL" in lines[revoked]
    assert not any("ABNORMAL" in lines[s] for s in (proved, free, none, running))
    assert main(["--home", str(home.home), "sessions", "show", owed]) == 0
    assert json.loads(capsys.readouterr().out)["abnormal"] is True


def test_the_dashboard_shows_abnormal_sessions() -> None:
    """The sessions page's table, rendered with the dashboard's own templates and autoescaping."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("gateway.dashboard", "templates"), autoescape=True)
    table = env.get_template("sessions.html").make_module({"csrf_field": "c", "csrf": "x"}).table
    row = {"session_id": "s1", "agent_id": "a", "status": "expired", "scope_words": [], "quota": 1, "expires_at": "t"}
    abnormal = {**row, "abnormal": True, "abnormal_reason": "ended without the deletion proof its agent owed"}
    assert "abnormal: ended without the deletion proof its agent owed" in str(table([abnormal], False))
    assert "abnormal" not in str(table([{**row, "abnormal": False}], False))
