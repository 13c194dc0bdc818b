"""The audit log against its own host: the witness record and the bounded start-up check.

**Witness record** (``$UOMP_HOME/.secrets/audit-witness.json``, 0600, beside the audit key and
outside ``audit.db``): the latest signed checkpoint. Every signer writes it (atomically, fsynced)
*after* the events the checkpoint covers are committed and *before* the checkpoint's own row is
committed, so it is never behind a checkpoint ``audit.db`` holds: a crash between the two leaves the
record one checkpoint ahead of ``audit.db``'s checkpoint rows, over events that are there; the next
opener finds the events consistent with it and stores the checkpoint from the record. Before every
signing and at every open, ``audit.db`` must extend the record (:func:`witness_problem`: the tree
holds at least that many events and a consistency proof from the record's root to the current
tree, computed from the stored nodes, verifies); otherwise it was rolled back, forked or replaced
and nothing is signed or served (``AUDIT_LOG_INCONSISTENT``). So no size is ever signed twice with
two roots.

What it stops: a restored backup, a copy from another home, a deleted tail (events, nodes,
checkpoints and anchors) by someone without the audit key. Someone who can write ``.secrets/`` can
read the key and rewrite both; only the chain, agents and kept checkpoints stop them
(docs/audit.md). A missing record is started from ``audit.db``'s newest checkpoint (an appliance
of an older version, or a record the user removed on purpose to adopt the current log): said in
the log, by ``uomp doctor`` and by ``uomp audit verify``.

**Start-up check** (:func:`check_log`), bounded whatever the log's size: the row count against the
sequence numbers (one deleted row anywhere), the tree's leaf count, the newest checkpoint's
signature, the witness record's consistency, and the last :data:`TAIL_EVENTS` events before the
newest checkpoint plus every event after it, in full (body against leaf, sequence, every index
column, the tree recomputed from those leaves and the stored right edge of the prefix, equal to the
newest checkpoint's root). Every checkpoint inside that window is parsed and its root compared with
the recomputed tree; the signatures of the newest :data:`TAIL_SIGNATURES` of them are verified (a
short-lived writer, the CLI, signs one per change: the window may hold a thousand, and a signature
costs more than an event). A short-lived writer that opens the log for one change (the user's
command, a dashboard decision: :mod:`gateway.cli.userlog`) reads :data:`CHANGE_TAIL_EVENTS` events
before the newest checkpoint instead, so a change costs the same whatever the log holds; the counts,
the tree against the witness record, the newest checkpoints' signatures and every event after the
newest checkpoint are checked as at any open. What that gives up: an in-place edit of an event
further back than that is not seen by a change; the guard's check at its start (:data:`TAIL_EVENTS`)
and ``uomp audit verify`` (every event) see it.

What the start-up check does not see: a changed body, leaf or node *inside* the older part of the
log, a damaged signature of an older checkpoint whose root is right (that needs every leaf and
signature: ``uomp audit verify``, or the guard's background verify
at start, ``audit_full_verify_at_start``).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gateway import sqldriver
from gateway.atrest import auditdb
from gateway.core import merkle
from gateway.core.checkpoint import Checkpoint, NoteError
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write
from gateway.ledger import tree as stored_tree
from gateway.ledger.verify import Report, TrustedCheckpoint, verify_log

WITNESS_VERSION = 1
MAX_WITNESS_BYTES = 16 * 1024
TAIL_EVENTS = 1024  # events before the newest checkpoint checked in full at start
MAX_TAIL_EVENTS = 100_000  # at most this many events checked in full at start (a long run without a checkpoint)
CHANGE_TAIL_EVENTS = 128  # the same, when a short-lived writer opens the log for one change (gateway.cli.userlog)
TAIL_SIGNATURES = 8  # the newest checkpoints whose signatures the start-up check verifies

FIX = {
    ErrorCode.AUDIT_LOG_INCONSISTENT: (
        "put back the audit.db that extends the witness record .secrets/audit-witness.json (a backup taken after "
        "that checkpoint); see docs/audit.md, 'When the log disagrees with its witness'"
    ),
    ErrorCode.AUDIT_LOG_DAMAGED: (
        "run 'uomp audit verify' for the first bad event and restore audit.db from a backup (docs/audit.md)"
    ),
}


def refusal(code: ErrorCode, problem: str, *, first_bad_seq: int | None = None) -> UompError:
    """The error every reader and writer of a log in this state answers (with its one-line fix)."""
    details = {"first_bad_seq": first_bad_seq} if first_bad_seq is not None else None
    return UompError(code, f"the audit log is refused: {problem}; {FIX[code]}", details=details)


def report_refusal(report: Report) -> UompError | None:
    """The refusal a failed verify report stands for (inconsistent or damaged), or None when it passed."""
    if report.ok:
        return None
    code = ErrorCode.AUDIT_LOG_INCONSISTENT if report.inconsistent else ErrorCode.AUDIT_LOG_DAMAGED
    return refusal(
        code, report.problems[0] if report.problems else "it does not verify", first_bad_seq=report.first_bad_seq
    )


# ----------------------------------------------------------------------------------- witness record


@dataclass(frozen=True)
class Witness:
    """The witness record: the latest signed checkpoint, kept outside ``audit.db``."""

    note: str
    checkpoint: Checkpoint

    def trusted(self) -> TrustedCheckpoint:
        return TrustedCheckpoint(self.checkpoint.size, self.checkpoint.root, "the witness record")


def read_witness(path: Path, *, origin: str, public_key: Ed25519PublicKey) -> Witness | None:
    """The witness record, None when there is none; a record that is not a checkpoint signed by this
    audit key is ``AUDIT_LOG_INCONSISTENT`` (it cannot vouch for anything)."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_WITNESS_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise refusal(ErrorCode.AUDIT_LOG_INCONSISTENT, f"the witness record cannot be read ({exc.strerror})") from None
    try:
        if len(raw) > MAX_WITNESS_BYTES:
            raise ValueError("too large")
        data = json.loads(raw)
        if (
            not isinstance(data, dict)
            or data.get("version") != WITNESS_VERSION
            or not isinstance(data.get("note"), str)
        ):
            raise ValueError("not a version 1 witness record")
        note = str(data["note"])
        return Witness(note, Checkpoint.open(note, origin, public_key))
    except (ValueError, NoteError) as exc:
        raise refusal(
            ErrorCode.AUDIT_LOG_INCONSISTENT,
            f"the witness record is not a checkpoint signed by this appliance's audit key ({exc})",
        ) from None


def write_witness(path: Path, note: str) -> None:
    """Atomically (temp file, fsync, rename, directory fsync), 0600."""
    atomic_write(path, json.dumps({"version": WITNESS_VERSION, "note": note}).encode() + b"\n")


def witness_problem(conn: sqlite3.Connection, size: int, witness: Witness | None) -> UompError | None:
    """None when the tree of ``size`` stored leaves extends the witness record (a consistency proof
    from the record's root to the tree's current root, from the stored nodes, verifies)."""
    if witness is None:
        return None
    w = witness.checkpoint
    if size < w.size:
        return refusal(
            ErrorCode.AUDIT_LOG_INCONSISTENT,
            f"audit.db holds {size} events but the witness record signed {w.size}: events {size + 1}-"
            f"{w.size} are gone (rolled back, truncated or replaced)",
            first_bad_seq=size + 1,
        )
    node = stored_tree.node_reader(conn)
    try:
        if w.size == size:
            if merkle.root(node, size) != w.root:
                raise merkle.ProofError("the roots differ")
        else:
            merkle.verify_consistency(
                w.size, size, w.root, merkle.root(node, size), merkle.consistency_proof(node, w.size, size)
            )
    except merkle.ProofError:
        return refusal(
            ErrorCode.AUDIT_LOG_INCONSISTENT,
            f"audit.db's first {w.size} events are not the ones the witness record signed (a forked or "
            f"replaced log, diverging at or before event {w.size})",
            first_bad_seq=w.size,
        )
    return None


# ----------------------------------------------------------------------------------- start-up check


@dataclass
class Checked:
    """What :func:`check_log` found. ``error``: the refusal, None when the log may be served.
    ``recover``: the witness note to store as a checkpoint (a crash after the record was written)."""

    error: UompError | None
    events: int
    checked_from: int  # events after this one were checked in full
    recover: str | None = None
    witness_size: int | None = None
    signatures: int = 0  # checkpoint signatures verified


def check_log(
    conn: sqlite3.Connection,
    *,
    origin: str,
    public_key: Ed25519PublicKey,
    witness: Witness | None,
    tail: int = TAIL_EVENTS,
    signatures: int = TAIL_SIGNATURES,
) -> Checked:
    """The bounded start-up check (module docstring), in the caller's snapshot (a read transaction).
    ``tail``: events before the newest checkpoint checked in full; ``signatures``: the newest
    checkpoints whose signatures are verified (at least 1)."""
    try:
        size = int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM ledger_events").fetchone()[0])
        rows = int(conn.execute("SELECT COUNT(*) FROM ledger_events").fetchone()[0])
        wsize = None if witness is None else witness.checkpoint.size
        if rows != size:
            gap = conn.execute(
                "SELECT MIN(seq) + 1 FROM ledger_events e WHERE seq < ? AND NOT EXISTS "
                "(SELECT 1 FROM ledger_events f WHERE f.seq = e.seq + 1)",
                (size,),
            ).fetchone()[0]
            first = 1 if conn.execute("SELECT 1 FROM ledger_events WHERE seq = 1").fetchone() is None else int(gap or 1)
            return Checked(
                refusal(
                    ErrorCode.AUDIT_LOG_DAMAGED,
                    f"event {first} is missing ({size - rows} of {size} events deleted)",
                    first_bad_seq=first,
                ),
                size,
                size,
                witness_size=wsize,
            )
        leaves = stored_tree.leaf_count(conn)
        problem = witness_problem(conn, min(size, leaves), witness)
        if problem is not None:
            return Checked(problem, size, size, witness_size=wsize)
        if leaves != size:
            first = min(size, leaves) + 1
            return Checked(
                refusal(
                    ErrorCode.AUDIT_LOG_DAMAGED,
                    f"the log has {size} events but its tree has {leaves} leaves (truncated)",
                    first_bad_seq=first,
                ),
                size,
                size,
                witness_size=wsize,
            )
        top = conn.execute("SELECT COALESCE(MAX(size), 0) FROM ledger_checkpoints").fetchone()
        newest = int(top[0])
        after = max(0, min(newest, size) - max(0, tail))
        after = max(after, size - MAX_TAIL_EVENTS)
        trusted = [witness.trusted()] if witness is not None and witness.checkpoint.size >= after else []
        nth = conn.execute(
            "SELECT size FROM ledger_checkpoints WHERE size >= ? ORDER BY size DESC LIMIT 1 OFFSET ?",
            (after, max(1, signatures) - 1),
        ).fetchone()
        report = verify_log(
            conn,
            origin=origin,
            public_key=public_key,
            trusted=trusted,
            after=after,
            signed_from=0 if nth is None else int(nth[0]),
        )
        if report.ok and newest and newest <= after:  # the newest checkpoint is before the window: its root here
            note = conn.execute("SELECT note FROM ledger_checkpoints WHERE size = ?", (newest,)).fetchone()[0]
            try:
                if (
                    merkle.root(stored_tree.node_reader(conn), newest)
                    != Checkpoint.open(str(note), origin, public_key).root
                ):
                    report.fail(1, f"the checkpoint at {newest} events does not match the stored tree")
            except NoteError as exc:
                report.fail(newest, f"the checkpoint at {newest} events: {exc}")
        recover = None
        if report.ok and witness is not None and newest < witness.checkpoint.size:
            recover = witness.note
        return Checked(report_refusal(report), size, after, recover, wsize, report.signatures)
    except sqldriver.database_errors(merkle.ProofError) as exc:
        return Checked(
            refusal(ErrorCode.AUDIT_LOG_DAMAGED, f"audit.db cannot be read ({type(exc).__name__}: {exc})"), 0, 0
        )


def home_state(audit_db: Path, witness_path: Path, *, origin: str, public_key: Ed25519PublicKey) -> dict[str, object]:
    """The bounded check on a home's files, read-only (``uomp status``, ``uomp doctor``, the
    dashboard): ``ok``, and for a refused log its ``code``, ``message`` and ``first_bad_seq``."""
    out: dict[str, object] = {"ok": True, "events": 0, "witness_size": None}
    if not audit_db.exists():
        return out
    try:
        witness = read_witness(witness_path, origin=origin, public_key=public_key)
        out["witness_size"] = None if witness is None else witness.checkpoint.size
        conn = auditdb.connect(audit_db, readonly=True, timeout=2.0)
        try:
            if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ledger_events'").fetchone() is None:
                return out  # not opened by a guard yet
            conn.execute("BEGIN")
            checked = check_log(conn, origin=origin, public_key=public_key, witness=witness)
            conn.execute("COMMIT")
        finally:
            conn.close()
        out["events"] = checked.events
        error = checked.error
    except UompError as exc:
        if exc.code == ErrorCode.SECRETS_LOCKED:  # a sealed home not unlocked here: not a finding about the log
            return {**out, "ok": None, "message": f"audit.db could not be checked ({exc.message})"}
        error = exc
    except sqldriver.OPERATIONAL as exc:  # locked, or cannot be opened: not a finding about the log
        return {**out, "ok": None, "message": f"audit.db could not be checked ({exc})"}
    except sqldriver.DATABASE as exc:
        error = refusal(ErrorCode.AUDIT_LOG_DAMAGED, f"audit.db cannot be read ({exc})")
    if error is not None:
        out.update(
            ok=False,
            code=str(error.code),
            message=error.message,
            first_bad_seq=(error.details or {}).get("first_bad_seq"),
        )
    return out
