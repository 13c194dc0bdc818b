"""The check a user's change runs on the audit log at open costs the same whatever the log's size
(counted: events read in full and checkpoint signatures verified), and still refuses a damaged,
truncated or forged log before anything changes. Real SQLite files, real keys, in-process."""

from __future__ import annotations

import base64
import logging
import re
import sqlite3

import pytest
from guardkit import guard_config

from gateway.cli import userlog
from gateway.config import Paths
from gateway.errors import UompError
from gateway.guard.audit import make_row, open_audit
from gateway.ledger import auditkey, integrity
from gateway.ledger.verify import verify_log

_LINE = re.compile(r"start-up check passed \((\d+) events; events (\d+)-(\d+) in full; (\d+) checkpoint signatures")


def _signed_events(paths: Paths, n: int) -> None:
    """``n`` events, each under a checkpoint of its own (as one short-lived writer per change leaves them)."""
    log = open_audit(paths, guard_config(audit_checkpoint_events=1))
    try:
        for i in range(n):
            log.write_now(
                [make_row(session_id="s", agent_id="a", action="read", allowed=True, reason="ok", key=f"k{i}")]
            )
    finally:
        log.close()


def _change(paths: Paths, caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    """One user change; (events read in full, checkpoint signatures verified) by its check at open."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="uomp.audit"):
        with userlog.change(paths) as event:
            event.action, event.key = "memory_added", "k"
    found = [m for r in caplog.records if (m := _LINE.search(r.getMessage()))]
    assert len(found) == 1, [r.getMessage() for r in caplog.records]
    events, first, last, signatures = (int(x) for x in found[0].groups())
    assert last == events
    return last - first + 1, signatures


def _checkpoints(paths: Paths) -> int:
    with sqlite3.connect(paths.audit_db) as conn:
        return int(conn.execute("SELECT count(*) FROM ledger_checkpoints").fetchone()[0])


def test_a_change_reads_the_same_whatever_the_log_and_its_checkpoints(
    home: Paths, caplog: pytest.LogCaptureFixture
) -> None:
    _signed_events(home, 150)
    small = _change(home, caplog)
    _signed_events(home, 300)
    assert _checkpoints(home) > 450
    large = _change(home, caplog)
    assert small == large  # flat: not the 150 -> 450 events and signatures of a window that grows
    in_full, signatures = large
    assert in_full <= integrity.CHANGE_TAIL_EVENTS + 2
    assert 1 <= signatures <= integrity.TAIL_SIGNATURES


def _refused(paths: Paths, code: str) -> None:
    ran = []
    with pytest.raises(UompError) as exc:
        with userlog.change(paths) as event:
            ran.append(1)
            event.action = "memory_added"
    assert exc.value.code == code
    assert ran == []  # refused before the change


def _edit_body(paths: Paths, seq: int) -> None:
    with sqlite3.connect(paths.audit_db) as conn:
        conn.execute("UPDATE ledger_events SET body = replace(body, '\"ok\"', '\"OK\"') WHERE seq = ?", (seq,))


def test_an_edited_event_in_the_changes_window_is_refused(home: Paths) -> None:
    _signed_events(home, 200)
    _edit_body(home, 200 - integrity.CHANGE_TAIL_EVENTS // 2)
    _refused(home, "AUDIT_LOG_DAMAGED")


def test_a_truncated_log_is_refused(home: Paths) -> None:
    _signed_events(home, 200)
    with sqlite3.connect(home.audit_db) as conn:
        conn.execute("DELETE FROM ledger_events WHERE seq = 50")
    _refused(home, "AUDIT_LOG_DAMAGED")


def test_a_rolled_back_log_is_refused_against_the_witness(home: Paths) -> None:
    _signed_events(home, 200)
    with sqlite3.connect(home.audit_db) as conn:
        conn.execute("DELETE FROM ledger_events WHERE seq > 190")
        conn.execute("DELETE FROM merkle_nodes WHERE ((idx + 1) << level) > 190")
        conn.execute("DELETE FROM ledger_checkpoints WHERE size > 190")
    _refused(home, "AUDIT_LOG_INCONSISTENT")


def _damage_signature(paths: Paths, size: int) -> str:
    """Flip the last byte of checkpoint ``size``'s signature; the note as it was."""
    with sqlite3.connect(paths.audit_db) as conn:
        note = str(conn.execute("SELECT note FROM ledger_checkpoints WHERE size = ?", (size,)).fetchone()[0])
        text, b64 = note[:-1].rsplit(" ", 1)
        blob = bytearray(base64.b64decode(b64))
        blob[-1] ^= 1
        damaged = f"{text} {base64.b64encode(bytes(blob)).decode()}\n"
        conn.execute("UPDATE ledger_checkpoints SET note = ? WHERE size = ?", (damaged, size))
    return note


def _put_note(paths: Paths, size: int, note: str) -> None:
    with sqlite3.connect(paths.audit_db) as conn:
        conn.execute("UPDATE ledger_checkpoints SET note = ? WHERE size = ?", (note, size))


def test_a_damaged_signature_on_a_recent_checkpoint_is_refused(home: Paths) -> None:
    _signed_events(home, 200)
    for size in (200, 200 - integrity.TAIL_SIGNATURES + 1):
        note = _damage_signature(home, size)
        _refused(home, "AUDIT_LOG_DAMAGED")
        _put_note(home, size, note)


def test_an_older_checkpoint_in_the_window_is_held_to_the_tree_and_its_signature_to_the_full_verify(
    home: Paths,
) -> None:
    _signed_events(home, 200)
    older = 200 - integrity.TAIL_SIGNATURES - 5  # inside the window, past the signatures verified at open
    _damage_signature(home, older)
    with userlog.change(home) as event:  # the root is right: the change goes on
        event.action = "memory_added"
    key = auditkey.load(home)
    with sqlite3.connect(home.audit_db) as conn:
        report = verify_log(conn, origin=auditkey.origin_for(key.public_key()), public_key=key.public_key())
        assert not report.ok and report.damaged  # what 'uomp audit verify' says
        # a wrong root in the same checkpoint is refused at open
        note = str(conn.execute("SELECT note FROM ledger_checkpoints WHERE size = ?", (older + 1,)).fetchone()[0])
        origin, size, _root, rest = note.split("\n", 3)
        other = str(conn.execute("SELECT note FROM ledger_checkpoints WHERE size = ?", (older + 2,)).fetchone()[0])
        conn.execute(
            "UPDATE ledger_checkpoints SET note = ? WHERE size = ?",
            ("\n".join((origin, size, other.split("\n")[2], rest)), older + 1),
        )
    _refused(home, "AUDIT_LOG_DAMAGED")


def test_the_guards_check_at_start_still_reads_the_long_tail(home: Paths) -> None:
    _signed_events(home, 400)
    _edit_body(home, 400 - integrity.CHANGE_TAIL_EVENTS - 100)  # before a change's window, inside the guard's
    with userlog.change(home) as event:
        event.action = "memory_added"
    with pytest.raises(UompError) as exc:
        open_audit(home, guard_config()).close()
    assert exc.value.code == "AUDIT_LOG_DAMAGED"
