"""`uomp audit` over the real event log (events written by the real audit writer into a real
audit.db): filters, newest last in text and --json, an unknown session as an error, bad arguments
refused, pruned events counted, `--help`, and `--follow` as a real subprocess that sees a new event
appear and ends cleanly on SIGTERM / Ctrl-C."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from gateway.cli.main import main
from gateway.config import GuardConfig, Paths
from gateway.guard.audit import AuditLog, open_audit

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400.0
WAIT = 60.0  # a bound for a line to appear from the subprocess (a safety net, not a timing claim)


def _cfg() -> GuardConfig:
    return dataclasses.replace(GuardConfig(tcp_port=0))


def _record(
    audit: AuditLog,
    sid: str,
    action: str,
    allowed: bool,
    *,
    ts: float | None = None,
    agent: str = "a1",
    reason: str = "r",
) -> None:
    audit.record(
        session_id=sid, agent_id=agent, action=action, allowed=allowed, reason=reason, detail="d", key="k", now=ts
    )
    audit.flush_sync()


@pytest.fixture
def events(home: Paths) -> Paths:
    now = time.time()
    audit = open_audit(home, _cfg())
    try:
        _record(audit, "s1", "session_granted", True, ts=now - 3 * DAY, reason="first")
        _record(audit, "s1", "read", True, ts=now - 2 * DAY)
        _record(audit, "s1", "read", False, ts=now - DAY)
        _record(audit, "s2", "aggregate", False, ts=now - 3600, agent="a2")
        _record(audit, "unknown", "gateway_refused", False, ts=now - 600, agent="unknown")
        _record(audit, "s1", "audit", True, ts=now - 60, reason="last")
    finally:
        audit.close()
    return home


def run(home: Paths, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["--home", str(home.home), "audit", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def as_json(home: Paths, capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    rc, out, err = run(home, capsys, *args, "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert isinstance(data, list)
    return data


def test_newest_last_in_text_and_json(events: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    data = as_json(events, capsys)
    assert len(data) == 6 and data[0]["reason"] == "first" and data[-1]["reason"] == "last"
    assert [e["seq"] for e in data] == sorted(e["seq"] for e in data)
    assert [e["ts"] for e in data] == sorted(e["ts"] for e in data)
    rc, out, _ = run(events, capsys)
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 6
    assert [line.rsplit("(", 1)[1].rstrip(")") for line in lines] == [e["id"] for e in data]
    assert "DENY" in lines[2] and "ALLOW" in lines[1] and "[d]" in lines[1]  # the user sees the detail
    rc, out, _ = run(events, capsys, "--limit", "2")
    assert [line.rsplit("(", 1)[1].rstrip(")") for line in out.splitlines()] == [e["id"] for e in data[-2:]]


def test_filters(events: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    def sel(*args: str) -> list[tuple[str, str, bool]]:
        return [(e["session_id"], e["action"], e["allowed"]) for e in as_json(events, capsys, *args)]

    assert sel("--session", "s1") == [
        ("s1", "session_granted", True),
        ("s1", "read", True),
        ("s1", "read", False),
        ("s1", "audit", True),
    ]
    assert sel("--session", "s2") == [("s2", "aggregate", False)]
    assert sel("--agent", "a2") == [("s2", "aggregate", False)]
    assert sel("--agent", "nobody") == []  # an agent filter is a filter, not a lookup
    assert sel("--action", "gateway_refused") == [("unknown", "gateway_refused", False)]
    assert sel("--action", "read,aggregate") == sel("--action", "read", "--action", "aggregate")
    assert len(sel("--action", "read,aggregate")) == 3
    assert sel("--action", "write") == []
    assert sel("--refused") == [
        ("s1", "read", False),
        ("s2", "aggregate", False),
        ("unknown", "gateway_refused", False),
    ]
    assert all(a for _, _, a in sel("--allowed")) and len(sel("--allowed")) == 3
    assert sel("--since", "2h") == [
        ("s2", "aggregate", False),
        ("unknown", "gateway_refused", False),
        ("s1", "audit", True),
    ]
    assert sel("--until", "36h") == [("s1", "session_granted", True), ("s1", "read", True)]
    assert sel("--since", "4d", "--until", "1d", "--session", "s1", "--allowed") == [
        ("s1", "session_granted", True),
        ("s1", "read", True),
    ]
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1800))
    assert sel("--since", iso) == [("unknown", "gateway_refused", False), ("s1", "audit", True)]


def test_unknown_session_is_an_error_not_empty_output(events: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(events, capsys, "--session", "sess_nope")
    assert rc == 1 and out == "" and "SESSION_NOT_FOUND" in err
    rc, out, err = run(events, capsys, "--session", "sess_nope", "--json")
    assert rc == 1 and out == "" and "SESSION_NOT_FOUND" in err
    # a known session with nothing matching the other filters is an empty answer, not an error
    assert as_json(events, capsys, "--session", "s2", "--allowed") == []


@pytest.mark.parametrize(
    "args,code",
    [
        (["--since", "yesterday"], "INVALID_REQUEST"),
        (["--until", "2026-13-40"], "INVALID_REQUEST"),
        (["--limit", "0"], "INVALID_REQUEST"),
        (["--limit", "-5"], "INVALID_REQUEST"),
        (["--since", "1h", "--until", "2h"], "INVALID_REQUEST"),
    ],
)
def test_bad_arguments_are_refused(
    events: Paths, capsys: pytest.CaptureFixture[str], args: list[str], code: str
) -> None:
    rc, out, err = run(events, capsys, *args)
    assert rc == 1 and out == "" and code in err


def test_allowed_and_refused_exclude_each_other(events: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--home", str(events.home), "audit", "--allowed", "--refused"])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_help_tells_the_truth(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["audit", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--session",
        "--agent",
        "--action",
        "--allowed",
        "--refused",
        "--since",
        "--until",
        "--limit",
        "--json",
        "--follow",
        "--include-pruned",
        "verify",
        "proof",
        "verify-proof",
    ):
        assert flag in text, flag
    for fact in ("newest last", "SESSION_NOT_FOUND", "SIGTERM", "JSON lines", "1h", "ISO 8601", "retention"):
        assert fact in text, fact


def test_pruned_events_are_counted_or_listed_as_such(events: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    audit = open_audit(events, dataclasses.replace(_cfg(), audit_retention_days=2))
    try:
        assert audit.purge() == 2  # the grant (3 days old) and the first read (2 days old)
    finally:
        audit.close()
    rc, out, err = run(events, capsys, "--session", "s1")
    assert rc == 0 and len(out.splitlines()) == 2 and "first" not in out
    assert "2 older matching event(s) past retention" in err
    data = as_json(events, capsys, "--session", "s1", "--include-pruned")
    assert [e.get("pruned", False) for e in data] == [True, True, False, False]
    assert data[0]["action"] == "session_granted" and "reason" not in data[0]
    rc, out, _ = run(events, capsys, "--session", "s1", "--include-pruned")
    assert out.count("past retention; leaf kept") == 2
    rc, out, err = run(events, capsys, "--session", "s2")
    assert rc == 0 and "past retention" not in err  # nothing of s2 was pruned


# ------------------------------------------------------------------------------------------ --follow


def _reader(stream: IO[str]) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _next(lines: queue.Queue[str | None]) -> str:
    line = lines.get(timeout=WAIT)
    assert line is not None, "uomp audit --follow ended early"
    return line


def _follow(home: Paths, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli.main", "--home", str(home.home), "audit", "--follow", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_follow_json_lines_sees_new_events_and_stops_on_sigterm(events: Paths) -> None:
    proc = _follow(events, "--json", "--session", "s1", "--limit", "2")
    try:
        lines = _reader(proc.stdout)  # type: ignore[arg-type]
        first = [json.loads(_next(lines)) for _ in range(2)]  # the newest two, newest last, one object a line
        assert [e["action"] for e in first] == ["read", "audit"] and first[1]["reason"] == "last"
        audit = open_audit(events, _cfg())
        try:
            _record(audit, "s2", "read", True, reason="not mine")  # filtered out
            _record(audit, "s1", "read", False, reason="new one")
        finally:
            audit.close()
        new = json.loads(_next(lines))
        assert new["reason"] == "new one" and new["session_id"] == "s1" and new["seq"] > first[1]["seq"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0
        assert lines.get(timeout=WAIT) is None  # nothing else was printed (the s2 event was not)
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_follow_text_stops_on_ctrl_c(events: Paths) -> None:
    proc = _follow(events, "--refused", "--limit", "1")
    try:
        lines = _reader(proc.stdout)  # type: ignore[arg-type]
        assert "gateway_refused" in _next(lines)
        audit = open_audit(events, _cfg())
        try:
            _record(audit, "s9", "read", True, reason="allowed, not shown")
            _record(audit, "s9", "gateway_refused", False, reason="refused, shown")
        finally:
            audit.close()
        line = _next(lines)
        assert "refused, shown" in line and "DENY" in line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=WAIT) == 0
        assert lines.get(timeout=WAIT) is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_proof_of_an_event_not_yet_signed_says_so(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    """An event outside every checkpoint: STORE_BUSY (retry) while an appliance holds the lock; with
    none running the CLI signs the checkpoint itself (tests/cli/test_audit_proof_stopped.py)."""
    import fcntl
    import os

    audit = open_audit(home, dataclasses.replace(_cfg(), audit_checkpoint_seconds=3600))
    try:
        _record(audit, "s1", "read", True, reason="signed")  # the first batch is checkpointed at once
        _record(audit, "s1", "read", True, reason="not yet")
    finally:
        audit.close()
    signed, pending = (e["id"] for e in as_json(home, capsys, "--session", "s1"))
    home.gateway_dir.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(home.appliance_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        rc, out, err = run(home, capsys, "proof", pending)
    finally:
        os.close(fd)
    assert rc == 1 and out == "" and "error STORE_BUSY" in err and "checkpoint" in err
    rc, out, err = run(home, capsys, "proof", pending)
    assert rc == 0 and json.loads(out)["event"]["id"] == pending
    rc, out, err = run(home, capsys, "proof", signed)
    assert rc == 0 and json.loads(out)["event"]["id"] == signed
    rc, out, err = run(home, capsys, "proof", "log_nope")
    assert rc == 1 and "error NOT_FOUND" in err


def test_a_limit_above_one_page_pages_through_the_log(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    audit = open_audit(home, _cfg())
    try:
        for i in range(1203):
            audit.record(session_id="s1" if i % 3 else "s2", agent_id="a1", action="read", allowed=True, reason=f"r{i}")
        audit.flush_sync()
    finally:
        audit.close()
    every = as_json(home, capsys, "--session", "s1", "--limit", "1000000")
    assert len(every) == 802 and every[0]["reason"] == "r1" and every[-1]["reason"] == "r1202"
    assert [e["seq"] for e in every] == sorted(e["seq"] for e in every)
    newest = as_json(home, capsys, "--session", "s1", "--limit", "1001")
    assert newest == every  # fewer than asked for: all of them
    assert as_json(home, capsys, "--limit", "1100") == as_json(home, capsys, "--limit", "1000000")[-1100:]
    assert len(as_json(home, capsys, "--limit", "1000")) == 1000
