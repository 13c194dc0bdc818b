"""The audit log against its own host, on real files and real guard processes (``uomp guard serve``):
a rolled-back, truncated, swapped, forked, edited or gap-holed ``audit.db`` is refused at start (or
by the background verify) with a named code, answered to every request, shown by ``uomp status``
and ``uomp doctor``, and red in ``uomp audit verify`` with the first bad event; and no second root
is ever signed for a size already signed."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from guardkit import guard_config
from integritykit import Guard
from shortdir import short_dir

from gateway.cli.main import main
from gateway.config import Paths
from gateway.core.checkpoint import Checkpoint
from gateway.guard.audit import AuditLog, LedgerOptions, make_row, open_audit
from gateway.keys import init_home
from gateway.ledger import auditkey

pytestmark = pytest.mark.timeout(120)

# the background full verify only where a test needs it (a process of its own per guard start)
CONFIG = "[guard]\naudit_checkpoint_seconds = 0.3\naudit_checkpoint_events = 100\naudit_full_verify_at_start = {}\n"


def _uomp(paths: Paths, *args: str) -> subprocess.CompletedProcess[str]:
    """``uomp`` in this process (its own output streams): the CLI's code as a subprocess runs it, without
    a second of interpreter start per call."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["--home", str(paths.home), *args])
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def _row(i: int, *, allowed: bool = True, session: str = "sess_int") -> tuple[Any, ...]:
    return make_row(
        session_id=session,
        agent_id="agent-1",
        action="read",
        allowed=allowed,
        reason="scope matched" if allowed else "not in scope",
        key=f"k.{i}",
        response_size=3,
        extra=None if allowed else {"code": "ACCESS_DENIED"},
    )


def _fill(paths: Paths, n: int, *, refused_every: int = 0) -> None:
    """``n`` events through the guard's own writer code (checkpoints and witness record as the guard
    writes them), quickly, in-process."""
    log = open_audit(paths, guard_config(audit_checkpoint_events=100))
    try:
        for b in range(0, n, 500):
            log.write_now(
                [_row(i, allowed=not (refused_every and i % refused_every == 0)) for i in range(b, min(n, b + 500))]
            )
    finally:
        log.close()


def _db(paths: Paths) -> sqlite3.Connection:
    return sqlite3.connect(paths.audit_db, isolation_level=None)


def _size(paths: Paths) -> int:
    with _db(paths) as conn:
        return int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM ledger_events").fetchone()[0])


def _checkpoints(paths: Paths) -> dict[int, bytes]:
    with _db(paths) as conn:
        return {
            int(s): Checkpoint.parse(str(n).split("\n\n")[0] + "\n").root
            for s, n in conn.execute("SELECT size, note FROM ledger_checkpoints")
        }


def _rollback(paths: Paths, keep: int) -> None:
    """What someone without the key can do: delete the last events, their tree nodes, checkpoints and
    anchor rows, leaving a log that is consistent in itself."""
    with _db(paths) as conn:
        conn.execute("DELETE FROM ledger_events WHERE seq > ?", (keep,))
        conn.execute("DELETE FROM merkle_nodes WHERE ((idx + 1) << level) > ?", (keep,))
        conn.execute("DELETE FROM ledger_checkpoints WHERE size > ?", (keep,))
        conn.execute("DELETE FROM ledger_anchors WHERE size > ?", (keep,))
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _copy_db(src: Paths, dst: Path) -> None:
    with _db(src) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for suffix in ("", "-wal", "-shm"):
        s = Path(str(src.audit_db) + suffix)
        d = Path(str(dst) + suffix)
        if s.exists():
            shutil.copyfile(s, d)
        elif d.exists():
            d.unlink()


@pytest.fixture
def guards() -> Iterator[list[Guard]]:
    started: list[Guard] = []
    yield started
    for g in started:
        g.stop()
        if g.proc.stdout is not None:
            g.proc.stdout.close()


@pytest.fixture
def paths(home: Paths) -> Paths:
    home.config_file.write_text(CONFIG.format("false"))
    return home


def _start(paths: Paths, guards: list[Guard], env: dict[str, str] | None = None) -> Guard:
    g = Guard(paths, env)
    guards.append(g)
    return g


def _assert_refused(g: Guard, paths: Paths, code: str, *, first_bad: int | None) -> None:
    """Refused in every place the user or an agent looks: the guard's answers (and no event appended
    after the damage), uomp status, uomp doctor, uomp audit verify."""
    err = g.refusing(within=15)
    assert err is not None and err["code"] == code, err
    before = _size(paths)
    status, body = g.call(
        "POST",
        "/v1/sessions",
        {"agent_id": "a", "agent_name": "A", "requested_scopes": {"read": {"tags": ["x"]}}},
        admin=True,
    )
    assert status == 503 and body["error"]["code"] == code, body
    assert "uomp audit verify" in body["error"]["message"] or "witness record" in body["error"]["message"]
    status, body = g.call("GET", "/v1/audit")
    assert status == 503 and body["error"]["code"] == code
    assert _size(paths) == before  # nothing appended on a refused log
    st = _uomp(paths, "status", "--json")
    assert st.returncode != 0
    assert json.loads(st.stdout)["audit_log"]["code"] == code
    doc = _uomp(paths, "doctor")
    assert doc.returncode == 1 and code in doc.stdout, doc.stdout
    ver = _uomp(paths, "audit", "verify", "--json")
    assert ver.returncode == 1, ver.stdout + ver.stderr
    out = json.loads(ver.stdout)
    assert out["ok"] is False and out["problems"]
    if first_bad is not None:
        assert out["first_bad_seq"] == first_bad, out


def test_a_sound_log_is_served_and_its_witness_record_follows_every_checkpoint(
    paths: Paths, guards: list[Guard]
) -> None:
    """The allowed partner: a sound log starts, serves, is green everywhere; the witness record is
    the newest checkpoint, outside audit.db, 0600."""
    _fill(paths, 250)
    g = _start(paths, guards)
    assert g.health == {"status": "ok"}
    status, _ = g.call(
        "POST",
        "/v1/sessions",
        {"agent_id": "a", "agent_name": "A", "requested_scopes": {"read": {"tags": ["x"]}}},
        admin=True,
    )
    assert status == 201
    g.stop()
    rec = json.loads(paths.audit_witness.read_text())
    cps = _checkpoints(paths)
    assert Checkpoint.parse(rec["note"].split("\n\n")[0] + "\n").size == max(cps)
    assert paths.audit_witness.stat().st_mode & 0o777 == 0o600
    assert _uomp(paths, "audit", "verify").returncode == 0
    st = json.loads(_uomp(paths, "status", "--json").stdout)
    assert st["audit_log"]["ok"] is True and st["audit_log"]["witness_size"] == max(cps)


def test_a_rolled_back_log_is_refused_with_the_first_missing_size(paths: Paths, guards: list[Guard]) -> None:
    _fill(paths, 300)
    _rollback(paths, 180)
    g = _start(paths, guards)
    _assert_refused(g, paths, "AUDIT_LOG_INCONSISTENT", first_bad=181)
    ver = _uomp(paths, "audit", "verify")
    assert "events 181-300 are gone" in ver.stdout, ver.stdout


def test_a_rollback_is_never_signed_over_while_the_guard_runs(paths: Paths, guards: list[Guard]) -> None:
    """Rolled back under a running guard: the next write refuses, and no checkpoint for a size
    already signed gets a second root."""
    _fill(paths, 300)
    signed = _checkpoints(paths)
    g = _start(paths, guards)
    _rollback(paths, 150)
    g.call(
        "POST",
        "/v1/sessions",
        {"agent_id": "a", "agent_name": "A", "requested_scopes": {"read": {"tags": ["x"]}}},
        admin=True,
    )
    time.sleep(0.8)  # past a checkpoint interval
    g.call(
        "POST",
        "/v1/sessions",
        {"agent_id": "a", "agent_name": "A", "requested_scopes": {"read": {"tags": ["x"]}}},
        admin=True,
    )
    err = g.refusing(within=5)
    assert err is not None and err["code"] == "AUDIT_LOG_INCONSISTENT"
    for size, root in _checkpoints(paths).items():
        assert signed.get(size, root) == root  # never a second root for one size


def test_a_truncated_log_is_an_audit_finding_never_internal(paths: Paths, guards: list[Guard]) -> None:
    _fill(paths, 400)
    with _db(paths) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = paths.audit_db.stat().st_size
    with paths.audit_db.open("r+b") as fh:
        fh.truncate(size // 2)
    ver = _uomp(paths, "audit", "verify", "--json")
    assert ver.returncode == 1 and "INTERNAL" not in ver.stdout + ver.stderr, ver.stdout + ver.stderr
    out = json.loads(ver.stdout)
    assert out["ok"] is False and out["first_bad_seq"] is not None and out["first_bad_seq"] <= 400
    g = _start(paths, guards)
    text = g.output()
    assert g.proc.returncode != 0 and "AUDIT_LOG_DAMAGED" in text, text  # refused at start, named
    st = _uomp(paths, "status", "--json")
    assert st.returncode != 0 and json.loads(st.stdout)["audit_log"]["code"] == "AUDIT_LOG_DAMAGED"
    assert "AUDIT_LOG_DAMAGED" in _uomp(paths, "doctor").stdout


def test_another_homes_audit_db_is_refused(paths: Paths, guards: list[Guard]) -> None:
    _fill(paths, 120)
    other = Paths(short_dir("uomp-o-"))
    try:
        init_home(other)
        _fill(other, 400)
        _copy_db(other, paths.audit_db)
    finally:
        shutil.rmtree(other.home, ignore_errors=True)
    g = _start(paths, guards)
    _assert_refused(g, paths, "AUDIT_LOG_INCONSISTENT", first_bad=None)


def test_a_fork_same_size_another_root_is_refused(paths: Paths, guards: list[Guard]) -> None:
    """A backup restored and written on to the same size with the key (another history under one
    key) is refused: its root at the witness record's size is not the one signed."""
    _fill(paths, 200)
    backup = paths.home / "backup.db"
    _copy_db(paths, backup)
    _fill(paths, 100)  # the real history goes on to 300
    witnessed = _checkpoints(paths)[300]
    for suffix in ("", "-wal", "-shm"):
        Path(str(paths.audit_db) + suffix).unlink(missing_ok=True)
        if Path(str(backup) + suffix).exists():
            shutil.copyfile(str(backup) + suffix, str(paths.audit_db) + suffix)
    key = auditkey.load(paths)
    forger = AuditLog(
        paths.audit_db, ledger=LedgerOptions(key, auditkey.origin_for(key.public_key()), checkpoint_events=100)
    )  # keeps no witness
    try:
        forger.write_now([_row(10_000 + i) for i in range(100)])
    finally:
        forger.close()
    assert _size(paths) == 300 and _checkpoints(paths)[300] != witnessed  # same size, another root
    g = _start(paths, guards)
    _assert_refused(g, paths, "AUDIT_LOG_INCONSISTENT", first_bad=300)


def test_a_flipped_body_byte_deep_in_the_log_is_found_by_the_background_verify(
    paths: Paths, guards: list[Guard]
) -> None:
    """Beyond the start-up check's tail (1,024 events before the newest checkpoint): the guard
    starts, and its full verify in the background refuses the log within seconds."""
    paths.config_file.write_text(CONFIG.format("true"))
    _fill(paths, 1500)
    with _db(paths) as conn:
        body = str(conn.execute("SELECT body FROM ledger_events WHERE seq = 7").fetchone()[0])
        conn.execute("UPDATE ledger_events SET body = ? WHERE seq = 7", (body.replace("k.6", "k.X"),))
    g = _start(paths, guards)
    _assert_refused(g, paths, "AUDIT_LOG_DAMAGED", first_bad=7)


def test_a_flipped_body_byte_in_the_tail_is_refused_at_start(paths: Paths, guards: list[Guard]) -> None:
    _fill(paths, 300)
    with _db(paths) as conn:
        body = str(conn.execute("SELECT body FROM ledger_events WHERE seq = 290").fetchone()[0])
        conn.execute("UPDATE ledger_events SET body = ? WHERE seq = 290", (body.replace("k.289", "k.28X"),))
    g = _start(paths, guards, env={})
    assert g.health.get("status") == "refusing" and g.health["audit"]["error"]["code"] == "AUDIT_LOG_DAMAGED"
    _assert_refused(g, paths, "AUDIT_LOG_DAMAGED", first_bad=290)


def test_one_deleted_row_is_refused_at_start(paths: Paths, guards: list[Guard]) -> None:
    _fill(paths, 1500)
    with _db(paths) as conn:
        conn.execute("DELETE FROM ledger_events WHERE seq = 5")
    g = _start(paths, guards)
    assert g.health.get("status") == "refusing"  # the row count, not the background verify
    _assert_refused(g, paths, "AUDIT_LOG_DAMAGED", first_bad=5)


@pytest.mark.parametrize("edit", ["allowed", "id", "session_id"])
def test_an_edited_index_column_is_red_and_never_shown(paths: Paths, guards: list[Guard], edit: str) -> None:
    """A refused read hidden from --refused (allowed flipped), renamed (id) or moved to another
    session's view: verify is red; the readers never show or select what the body does not say."""
    _fill(paths, 200, refused_every=10)  # events 1, 11, 21, ... refused
    sql = {
        "allowed": "UPDATE ledger_events SET allowed = 1 WHERE seq = 191",
        "id": "UPDATE ledger_events SET id = 'log_forged' WHERE seq = 191",
        "session_id": "UPDATE ledger_events SET session_id = 'sess_other' WHERE seq = 191",
    }[edit]
    with _db(paths) as conn:
        conn.execute(sql)
    shown = _uomp(paths, "audit", "--allowed", "--json", "--limit", "1000")
    assert shown.returncode == 0, shown.stderr
    events = json.loads(shown.stdout)
    assert all(e["allowed"] for e in events) and 191 not in [e["seq"] for e in events]
    assert "left out" in shown.stderr or edit != "allowed"
    if edit == "session_id":
        other = _uomp(paths, "audit", "--session", "sess_other", "--json")
        assert json.loads(other.stdout or "[]") == [] and "left out" in other.stderr
    g = _start(paths, guards)
    _assert_refused(g, paths, "AUDIT_LOG_DAMAGED", first_bad=191)


@pytest.mark.parametrize("point", ["audit_events_committed", "audit_witness_written"])
def test_a_kill_around_the_witness_write_recovers_with_one_root_per_size(
    paths: Paths, guards: list[Guard], point: str
) -> None:
    """kill -9 after the events committed (nothing signed yet) and after the witness record was
    written (its checkpoint row not committed: the record is ahead of audit.db, over events that are
    there). Either way the next start serves, stores what the record signed, and verify is green."""
    _fill(paths, 150)
    arm = paths.home / "arm"
    arm.write_text("")
    g = _start(paths, guards, env={"UOMP_FAULT": point, "UOMP_FAULT_ARM": str(arm)})
    with contextlib.suppress(aiohttp.ClientError, OSError):
        g.call(
            "POST",
            "/v1/sessions",
            {"agent_id": "a", "agent_name": "A", "requested_scopes": {"read": {"tags": ["x"]}}},
            admin=True,
        )
    assert g.proc.wait(timeout=15) == -signal.SIGKILL
    witness = Checkpoint.parse(json.loads(paths.audit_witness.read_text())["note"].split("\n\n")[0] + "\n")
    stored = _checkpoints(paths)
    if point == "audit_witness_written":
        assert witness.size == _size(paths) > max(stored)  # the record is ahead of the stored checkpoints
    else:
        assert witness.size == max(stored) < _size(paths)  # events durable, not signed yet
    g2 = _start(paths, guards)
    assert g2.health == {"status": "ok"}
    deadline = time.monotonic() + 10
    while max(_checkpoints(paths)) < _size(paths) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _checkpoints(paths)
    assert after.get(witness.size) == witness.root  # the size the record signed keeps that root
    assert max(after) == _size(paths)
    g2.stop()
    assert _uomp(paths, "audit", "verify").returncode == 0


async def test_the_dashboard_shows_a_refused_log(paths: Paths) -> None:
    """The overview and the appliance page name the refusal (the partner: a sound log shows none)."""
    from e2e.test_dashboard import browser, dashboard

    _fill(paths, 150)
    async with dashboard(paths) as d, browser(d) as b:
        await b.login()
        status, html, _ = await b.get("/")
        assert status == 200 and "The audit log is refused" not in html
        with _db(paths) as conn:
            conn.execute("DELETE FROM ledger_events WHERE seq = 40")
        status, html, _ = await b.get("/")
        assert status == 200 and "The audit log is refused (AUDIT_LOG_DAMAGED, from event #40)" in html, html
        status, html, _ = await b.get("/appliance")
        assert status == 200 and "REFUSED AUDIT_LOG_DAMAGED" in html


def test_a_running_appliance_on_a_refused_log_is_unhealthy_in_uomp_status(tmp_path: Path) -> None:
    """The whole appliance (``uomp gateway start``): it runs, its guard refuses, ``uomp status`` exits
    1 naming the code (the partner: exit 0 on the sound log first)."""
    from client.test_refresh_crash import Appliance

    home = short_dir("uomp-app-") / "home"
    paths = Paths(home)
    try:
        assert _uomp(paths, "init").returncode == 0
        _fill(paths, 150)
        app = Appliance(home, tmp_path / "arm")
        app.start()
        try:
            deadline = time.monotonic() + 20  # the gateway's status file says the guard answers
            while (st := _uomp(paths, "status", "--json")).returncode != 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert st.returncode == 0, st.stdout
        finally:
            app.stop()
        with _db(paths) as conn:
            conn.execute("UPDATE ledger_events SET allowed = 1 - allowed WHERE seq = 149")
        app.start()
        try:
            st = _uomp(paths, "status", "--json")
            s = json.loads(st.stdout)
            assert st.returncode == 1 and s["running"] and s["audit_log"]["code"] == "AUDIT_LOG_DAMAGED", s
            assert s["audit_log"]["first_bad_seq"] == 149
            text = _uomp(paths, "status")
            assert "audit log: REFUSED AUDIT_LOG_DAMAGED" in text.stdout
        finally:
            app.stop()
    finally:
        shutil.rmtree(home.parent, ignore_errors=True)


def test_the_last_event_deleted_without_its_nodes_is_refused_not_a_crash(paths: Paths, guards: list[Guard]) -> None:
    _fill(paths, 200)
    with _db(paths) as conn:
        conn.execute("DELETE FROM ledger_events WHERE seq = 200")
    g = _start(paths, guards)
    assert g.health.get("status") == "refusing"  # served as refusals, the guard runs
    _assert_refused(g, paths, "AUDIT_LOG_INCONSISTENT", first_bad=200)  # the witness record signed 200
