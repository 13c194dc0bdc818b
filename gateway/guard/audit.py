"""The guard's audit log (spec §18): its own SQLite file, apart from the Memory Store.

Longer than ~500 lines on purpose: one class, the log's writer, reader and proof paths over one
SQLite file and one group-commit writer, whose steps share the same connection rules.

Every decision, allowed or not, becomes a row with the §18.2 fields plus ``query_count_remaining``.
``reason`` is what the agent may see in ``GET /v1/audit`` (no existence leak, see core.policy);
``detail`` is for the user only.

Durability without an fsync per request: records are group-committed by the shared writer
(:mod:`gateway.durable`). A request handler takes the ticket :meth:`AuditLog.record` returns and
``await`` :meth:`AuditLog.flush` with it; every record pending at that moment is written in one
transaction (synchronous=FULL) on the writer thread, and the handler answers only once its record
is durable. Under load one fsync covers many requests.

Fail-closed, and true to what the agent got: when a batch cannot be written (``audit.db`` or the
disk full, an I/O error) its waiters get ``STORE_UNAVAILABLE`` (503) and the rows are not kept
one by one: they are *counted* per session, and the next batch that fits carries one
``audit_gap`` row per session saying how many requests were refused with 503 and why. Recovery is
as soon as that small batch fits. Rows are inserted with ``INSERT OR IGNORE`` on their unique id,
so a row replayed from the Auth Service's outbox after a crash is never doubled.

A lock held by another process past the busy timeout makes a batch fail with STORE_BUSY (503, retry
shortly) in the same way. Reads of the log run on their own thread (:attr:`AuditLog.reader`),
never on the event loop.

Verifiable (docs/audit.md): with :class:`LedgerOptions` (every production opener, see
:func:`open_audit`) each row is also an event of the Merkle event log (:mod:`gateway.ledger.log`)
in the *same* transaction: gap-free sequence, RFC 9162 leaf, tree nodes, and a signed C2SP
checkpoint every ``audit_checkpoint_events`` events or ``audit_checkpoint_seconds`` seconds (a
session grant, revocation or deletion proof gets one at once), queued for anchoring when a chain is
configured. The event log is the only store: what ``uomp audit verify`` checks, what proofs are cut
from, and what every reader queries (:mod:`gateway.ledger.query`); an older version's ``audit_logs``
table is migrated into it on open and dropped.

Integrity (:mod:`gateway.ledger.integrity`): the log is checked at open against the witness record
(the latest signed checkpoint, kept outside ``audit.db``) and in its tail; a checkpoint is signed in
a transaction of its own after the events it covers are committed, the record written before that
transaction commits. A log that fails refuses every write here (and the guard every request):
:attr:`AuditLog.integrity`. The checkpoint interval runs on the monotonic clock.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway import contract, sqldriver
from gateway.atrest import auditdb, writers
from gateway.config import AnchorConfig, GuardConfig, Paths, load_section
from gateway.core.tokens import iso
from gateway.db import DEFAULT_BUSY_TIMEOUT_SECONDS, DbWorker, connect, db_error
from gateway.durable import GroupCommitWriter, RefusalTally, describe_failure, fault_point
from gateway.errors import ErrorCode, UompError
from gateway.ledger import auditkey, integrity
from gateway.ledger.log import EventLog, LedgerError, oldest_body_ts
from gateway.ledger.query import AuditFilter, AuditPage, event_owner, query_events, session_known

log = logging.getLogger("uomp.audit")

# The table of older versions (before the Merkle event log): rows that exist only there are moved into the
# event log when the audit log is opened (:meth:`AuditLog._migrate_legacy`), then the table is dropped.
LEGACY_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit_logs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  ts REAL NOT NULL,
  timestamp TEXT NOT NULL,
  session_id TEXT NOT NULL,
  agent_id TEXT NOT NULL,
  action TEXT NOT NULL,
  key TEXT,
  tags TEXT,
  allowed INTEGER NOT NULL,
  reason TEXT NOT NULL,
  detail TEXT,
  request_size INTEGER,
  response_size INTEGER,
  query_count_remaining INTEGER,
  via TEXT
);
CREATE INDEX IF NOT EXISTS idx_audit_session ON audit_logs(session_id, seq);
CREATE INDEX IF NOT EXISTS idx_audit_ts ON audit_logs(ts);
"""
SCHEMA = ""  # every table is the event log's (gateway.ledger.log); nothing else is written
UNSIGNED_ORIGIN = "uomp-audit/unsigned"  # an AuditLog opened without LedgerOptions: events, no checkpoints

COLUMNS = (
    "id",
    "ts",
    "timestamp",
    "session_id",
    "agent_id",
    "action",
    "key",
    "tags",
    "allowed",
    "reason",
    "detail",
    "request_size",
    "response_size",
    "query_count_remaining",
    "via",
)
MAX_AUDIT_PAGE = 1000


MAX_PENDING_ROWS = 100_000  # rows waiting for the writer (beyond: STORE_UNAVAILABLE)
PURGE_SLICE_EVENTS = 2000  # events per retention transaction (see AuditLog.purge)
PURGE_PAUSE_SECONDS = 0.002  # between two slices
GAP_ACTION = "audit_gap"

Row = tuple[Any, ...]

# Events that get a signed checkpoint in the same write (spec §18.4.2: authorization events and
# deletion proofs near real time).
URGENT_ACTIONS = frozenset(
    {
        "session_granted",
        "session_revoked",
        "session_closed",
        "session_expired",
        "deletion_proof",
        "deletion_proof_missing",
        "refresh_reuse",
    }
)


@dataclass(frozen=True)
class LedgerOptions:
    """How the audit log signs: its key and origin, when checkpoints are due, and where the witness record lives."""

    key: Ed25519PrivateKey
    origin: str
    checkpoint_events: int = 1000
    checkpoint_seconds: float = 10.0
    anchor_backend: str | None = None
    witness: Path | None = None  # the witness record (gateway.ledger.integrity); None: not kept (tests, tools)

    @classmethod
    def for_home(cls, paths: Paths, cfg: GuardConfig, anchor: AnchorConfig | None = None) -> LedgerOptions:
        auditkey.ensure(paths)
        key = auditkey.load(paths)
        if anchor is None:
            anchor = load_section(AnchorConfig, "anchor", file=paths.config_file)
        return cls(
            key,
            auditkey.origin_for(key.public_key()),
            max(1, cfg.audit_checkpoint_events),
            max(0.1, cfg.audit_checkpoint_seconds),
            anchor.backend,
            paths.audit_witness,
        )


def open_audit(paths: Paths, cfg: GuardConfig, *, strict: bool = True, tail: int = integrity.TAIL_EVENTS) -> AuditLog:
    """The audit log as every process of the appliance opens it: with its verifiable event log,
    checked at open (:mod:`gateway.ledger.integrity`). ``strict``: a log that fails the check is an
    error (the CLI); otherwise (the guard) it is opened refusing everything, :attr:`AuditLog.integrity`
    says why. ``tail``: events before the newest checkpoint the check reads in full."""
    return AuditLog(
        paths.audit_db,
        retention_days=cfg.audit_retention_days,
        busy_timeout=cfg.db_busy_timeout_seconds,
        ledger=LedgerOptions.for_home(paths, cfg),
        strict=strict,
        tail=tail,
    )


def open_audit_writing(paths: Paths, cfg: GuardConfig, **kwargs: Any) -> AuditLog:
    """:func:`open_audit` for a user's command that may write the log: the home's writers' lock
    (:func:`gateway.atrest.writers.writing`) is held from before the log opens until it closes, so no
    seal or unseal rewrites audit.db under it."""
    hold = contextlib.ExitStack()
    hold.enter_context(writers.writing(paths))
    try:
        audit = open_audit(paths, cfg, **kwargs)
    except BaseException:
        hold.close()
        raise
    audit.on_close.append(hold.close)
    return audit


# Fields an event may carry besides :data:`COLUMNS` (the gateway's, in the one log): where and how
# the request arrived, its stable code and HTTP status, and counts of rate-limited events.
EXTRA_FIELDS = frozenset(
    {
        "listener",
        "client",
        "cert_serial",
        "cert_fp",
        "request_id",
        "code",
        "status",
        "method",
        "path",
        "tag",
        "origin",
        "count",
        "by",
        "first",
        "last",
        "expires_at",
        "memory_hash",
        "proposal_id",
        "change_hash",
    }
)  # §18.4.1 inputs: a grant's expiry, a deletion proof's hash
GATEWAY_ID_PREFIX = "gw_"  # ids the gateway gives its events: deduplicated on write (spool replays)


def row_event(row: Row) -> dict[str, Any]:
    """The event-log body of an audit row: its §18 fields and any extra fields, ``null``s left out."""
    d = dict(zip(COLUMNS, row[: len(COLUMNS)], strict=True))
    d["allowed"] = bool(d["allowed"])
    d["tags"] = json.loads(d["tags"]) if d["tags"] else None
    if len(row) > len(COLUMNS) and isinstance(row[len(COLUMNS)], dict):
        for k, v in row[len(COLUMNS)].items():
            if k in EXTRA_FIELDS and k not in d:
                d[k] = v
    return {k: v for k, v in d.items() if v is not None}


def anchor_chain(paths: Paths) -> dict[str, Any]:
    """What a proof bundle says about the chain its checkpoint may be anchored on ({} without one)."""
    acfg = load_section(AnchorConfig, "anchor", file=paths.config_file)
    return {} if acfg.backend == "none" else {"contract": acfg.contract, "chain_id": acfg.chain_id or None}


def ledger_refusal(exc: LedgerError, *, session_id: str | None = None) -> UompError:
    """A :class:`LedgerError` as the error a reader answers."""
    if exc.code == "PROOF_PENDING":
        return UompError(ErrorCode.STORE_BUSY, exc.message, session_id=session_id, details={"reason": "PROOF_PENDING"})
    if exc.code == "NOT_FOUND":
        return UompError(ErrorCode.NOT_FOUND, exc.message, session_id=session_id)
    return UompError(
        ErrorCode.STORE_UNAVAILABLE,
        f"the audit log cannot answer ({exc.message}); run 'uomp audit verify'",
        session_id=session_id,
    )


class _EventIds:
    """Unique event ids: ``log_`` + 12 hex digits of the time in milliseconds + 16 hex digits from the
    OS's CSPRNG (``log_0193d3a5c1f2`` ``9f0c...``).

    The random part makes an id unique and unguessable (64 bits). The time part puts the
    ids of one moment side by side in the log's ``id`` index, so a commit dirties the index's last
    page or two instead of one random page per event: with 200,000 events in the log a random id
    cost ~20-30 µs more per event, and the cost grows with the log
    (``benchmarks/bench_audit_commit.py``). Like the reference's ``generateId`` (time, then random),
    the spec (§18.1) only fixes the ``log_`` prefix. The random parts are drawn 512 at a time: one
    system call per event cost ~30 µs on the VMs this runs on."""

    BATCH = 512

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: list[str] = []

    def next(self, now: float | None = None) -> str:
        prefix = "log_" + contract.event_id_time(now)
        with self._lock:
            if not self._pool:
                raw = secrets.token_bytes(8 * self.BATCH).hex()
                self._pool = [raw[i : i + 16] for i in range(0, len(raw), 16)]
            return prefix + self._pool.pop()

    def forget(self) -> None:
        self._lock = threading.Lock()
        self._pool = []


_event_ids = _EventIds()
os.register_at_fork(after_in_child=_event_ids.forget)  # a forked child never repeats its parent's ids


def make_row(
    *,
    session_id: str,
    agent_id: str,
    action: str,
    allowed: bool,
    reason: str,
    key: str | None = None,
    tags: list[str] | None = None,
    detail: str | None = None,
    request_size: int | None = None,
    response_size: int | None = None,
    query_count_remaining: int | None = None,
    via: str | None = None,
    now: float | None = None,
    extra: dict[str, Any] | None = None,
    event_id: str | None = None,
) -> Row:
    """One audit row in :data:`COLUMNS` order (plus ``extra`` fields of the event, when given), with a
    fresh unique id unless ``event_id`` is given."""
    ts = time.time() if now is None else now
    row: Row = (
        event_id or _event_ids.next(ts),
        ts,
        iso(ts),
        session_id or "unknown",
        agent_id or "unknown",
        action,
        key,
        json.dumps(tags) if tags is not None else None,
        int(allowed),
        reason,
        detail,
        request_size,
        response_size,
        query_count_remaining,
        via,
    )
    if extra:
        row = (*row, {k: v for k, v in extra.items() if k in EXTRA_FIELDS and v is not None})
    return row


class AuditLog:
    """The audit log in ``audit.db``: group-committed events of the one Merkle log, signed checkpoints, and the
    integrity state."""

    def __init__(
        self,
        path: Path,
        *,
        retention_days: int = 90,
        max_pending: int = MAX_PENDING_ROWS,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT_SECONDS,
        ledger: LedgerOptions | None = None,
        strict: bool = True,
        tail: int = integrity.TAIL_EVENTS,
    ) -> None:
        self.path = path
        self.on_close: list[Callable[[], None]] = []  # run by close(), last (an opener's lock let go)
        self.startup: integrity.Checked | None = None  # what the check at open found (with LedgerOptions)
        self._tail = tail
        self.retention_days = retention_days
        try:

            def opener(p: Path) -> Any:  # a sealed home's audit.db is SQLCipher (gateway/atrest/auditdb.py)
                return auditdb.connect(p, timeout=busy_timeout, check_same_thread=False, rows=True)

            self._read = connect(path, schema=SCHEMA, what="audit log", busy_timeout=busy_timeout, opener=opener)
            self._write = connect(path, schema=SCHEMA, what="audit log", busy_timeout=busy_timeout, opener=opener)
        except UompError as exc:
            if (
                exc.code != ErrorCode.AUDIT_LOG_DAMAGED  # auditdb's refusal already says why
                and isinstance(exc.__cause__, sqldriver.DATABASE)
                and not isinstance(exc.__cause__, sqldriver.OPERATIONAL)
            ):
                raise integrity.refusal(
                    ErrorCode.AUDIT_LOG_DAMAGED,
                    f"{path.name} cannot be read ({exc.__cause__}): truncated or not an audit log",
                ) from exc
            raise
        self.ledger_options = ledger
        self.ledger: EventLog | None = None
        # Why this log refuses every read and write (gateway.ledger.integrity), None while it is sound.
        self.integrity: UompError | None = None
        self._known_size = 0  # the largest size this process saw: a smaller one later is a rollback
        self._cp_seen = (-1, 0.0)  # (newest checkpoint size, time.monotonic() when first seen)
        try:  # the event log is the only store; without LedgerOptions (tests, tools) it is not signed
            self.ledger = EventLog(
                self._write,
                origin=ledger.origin if ledger else UNSIGNED_ORIGIN,
                key=ledger.key if ledger else None,
                anchor_backend=ledger.anchor_backend if ledger else None,
                check=ledger is None,
            )
            if ledger is not None:
                self.integrity = self._startup_check(ledger)
                if self.integrity is not None and strict:
                    self._read.close()
                    self._write.close()
                    raise self.integrity
            if self.integrity is None:
                self._migrate_legacy()
            # proofs for agents, on the reader thread (see proof_for_session)
            self._read_ledger = EventLog(
                self._read, origin=self.ledger.origin, key=self.ledger.key, check=self.integrity is None
            )
        except LedgerError as exc:
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE, f"the audit log is inconsistent ({exc.message}); run 'uomp audit verify'"
            ) from exc
        except sqldriver.DATABASE as exc:
            if isinstance(exc, sqldriver.OPERATIONAL):
                raise db_error(exc, what="audit log") from exc
            raise integrity.refusal(ErrorCode.AUDIT_LOG_DAMAGED, f"{path.name} cannot be read ({exc})") from exc
        except sqldriver.ERRORS as exc:
            raise db_error(exc, what="audit log") from exc
        self.reader = DbWorker("audit-read", what="audit log")  # for_session / recent from the event loop
        self._maint = threading.Lock()  # the write connection: writer thread vs purge/replay
        self._purged_below: float | None = None  # every body older than this is gone (see purge)
        self.lost = RefusalTally()  # rows of failed batches, per session|agent, not yet summarised
        self.writer: GroupCommitWriter[Row] = GroupCommitWriter(
            "audit log", self._write_batch, max_pending=max_pending, on_failed=self._count_failed
        )

    # ------------------------------------------------------------------------------ integrity

    def _witness(self) -> integrity.Witness | None:
        opts = self.ledger_options
        if opts is None or opts.witness is None:
            return None
        return integrity.read_witness(opts.witness, origin=opts.origin, public_key=opts.key.public_key())

    def _startup_check(self, opts: LedgerOptions) -> UompError | None:
        """The bounded check at open (:func:`gateway.ledger.integrity.check_log`); stores a checkpoint
        the witness record holds and ``audit.db`` lost in a crash, and starts a missing record."""
        conn, ledger = self._write, self.ledger
        assert ledger is not None
        try:
            witness = self._witness()
        except UompError as exc:
            log.error("audit log: %s", exc.message)
            return exc
        conn.execute("BEGIN")
        try:
            checked = integrity.check_log(
                conn, origin=opts.origin, public_key=opts.key.public_key(), witness=witness, tail=self._tail
            )
        finally:
            conn.execute("COMMIT")
        self.startup = checked
        if checked.error is not None:
            log.error("audit log: %s", checked.error.message)
            return checked.error
        self._known_size = checked.events
        log.debug(
            "audit log: start-up check passed (%d events; events %d-%d in full; %d checkpoint signatures; "
            "witness record at %s)",
            checked.events,
            checked.checked_from + 1,
            checked.events,
            checked.signatures,
            "none" if witness is None else witness.checkpoint.size,
        )
        if checked.recover is not None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                size = witness.checkpoint.size if witness else 0
                if conn.execute("SELECT 1 FROM ledger_checkpoints WHERE size = ?", (size,)).fetchone() is None:
                    ledger.store_checkpoint(checked.recover, time.time())  # (another opener may have already)
                conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(*sqldriver.ERRORS):
                    conn.execute("ROLLBACK")
                raise
            ledger.reload()
            log.warning(
                "audit log: the checkpoint at %d events was signed but not stored (a crash): stored it from "
                "the witness record",
                witness.checkpoint.size if witness else 0,
            )
        elif witness is None and opts.witness is not None:
            newest = ledger.latest_checkpoint()
            if newest is not None:
                integrity.write_witness(opts.witness, newest[1])
                log.warning(
                    "audit log: no witness record; started one at the newest checkpoint (%d events)", newest[0].size
                )
        return None

    def refuse(self, error: UompError) -> None:
        """From now on this log refuses every write (and the guard every request): ``error`` says why."""
        if self.integrity is None:
            log.error("audit log: %s", error.message)
            self.integrity = error

    def record(
        self,
        *,
        session_id: str,
        agent_id: str,
        action: str,
        allowed: bool,
        reason: str,
        key: str | None = None,
        tags: list[str] | None = None,
        detail: str | None = None,
        request_size: int | None = None,
        response_size: int | None = None,
        query_count_remaining: int | None = None,
        via: str | None = None,
        now: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> int:
        """Queue one row; return its ticket for :meth:`flush`."""
        return self.submit(
            make_row(
                session_id=session_id,
                agent_id=agent_id,
                action=action,
                allowed=allowed,
                reason=reason,
                key=key,
                tags=tags,
                detail=detail,
                request_size=request_size,
                response_size=response_size,
                query_count_remaining=query_count_remaining,
                via=via,
                now=now,
                extra=extra,
            )
        )

    def submit(self, row: Row) -> int:
        return self.writer.submit(row)

    @property
    def failing(self) -> str | None:
        return self.writer.failing

    def _count_failed(self, rows: list[Row], exc: BaseException) -> None:
        reason = describe_failure(exc)
        for r in rows:
            if r[5] == GAP_ACTION:
                continue  # a summary that did not make it: its counts are still in the tally
            self.lost.add(f"{r[3]}|{r[4]}", reason=reason, now=r[1])

    def _gap_rows(self, snap: dict[str, Any]) -> list[Row]:
        rows = []
        for bucket, n in sorted(snap["counts"].items()):
            sid, _, agent = bucket.partition("|")
            rows.append(
                make_row(
                    session_id=sid if agent else "unknown",
                    agent_id=agent or "unknown",
                    action=GAP_ACTION,
                    allowed=False,
                    detail="STORE_UNAVAILABLE",
                    reason=f"{n} request(s) between {iso(snap['first'])} and {iso(snap['last'])} were refused with "
                    f"503 STORE_UNAVAILABLE: the audit log could not be written ({snap['reason'] or 'failed'})",
                )
            )
        return rows

    def _write_batch(self, rows: list[Row]) -> None:
        snap = self.lost.take()
        if snap is not None:
            rows = self._gap_rows(snap) + rows
        if not rows:
            if self.ledger is not None:
                self._insert([])  # a timer's probe: checkpoint what is due
            return
        self._insert(rows)
        if snap is not None:
            self.lost.done(snap)
            log.warning(
                "audit log: writing again; %d refused request(s) recorded as audit_gap rows",
                sum(snap["counts"].values()),
            )

    def _ledger_write(self, conn: sqlite3.Connection, rows: list[Row], *, dedupe: bool) -> bool:
        """Inside the batch's transaction: the rows as events. True when a checkpoint is due (signed
        in a transaction of its own once these events are durable: :meth:`_sign`)."""
        ledger = self.ledger
        opts = self.ledger_options
        assert ledger is not None
        ledger.refresh()  # another process (the CLI) may have appended since this one last wrote
        if ledger.size < self._known_size:
            raise integrity.refusal(
                ErrorCode.AUDIT_LOG_INCONSISTENT,
                f"audit.db went back from {self._known_size} to "
                f"{ledger.size} events while open (rolled back or replaced)",
                first_bad_seq=ledger.size + 1,
            )
        # An outbox replay (``dedupe``) or a gateway event (spooled and replayed, or sent again after
        # a lost answer): rows already in the log are not events twice (idempotent by event id).
        seen = "SELECT 1 FROM ledger_events WHERE id = ?"
        ids: set[str] = set()
        kept = []
        for r in rows:
            if dedupe or str(r[0]).startswith(GATEWAY_ID_PREFIX):
                if r[0] in ids or conn.execute(seen, (r[0],)).fetchone() is not None:
                    continue
                ids.add(r[0])
            kept.append(r)
        rows = kept
        if rows:
            ledger.append([row_event(r) for r in rows])
        if opts is None:
            return False
        last = ledger.latest_checkpoint()
        last_size = last[0].size if last else 0
        mono = time.monotonic()
        if last_size != self._cp_seen[0]:  # a new checkpoint (this process's or another's): the interval restarts
            self._cp_seen = (last_size, mono if self._cp_seen[0] >= 0 else mono - opts.checkpoint_seconds)
        # On the monotonic clock: a wall clock stepped back or forward neither stops nor hurries checkpoints.
        return ledger.size > last_size and (
            ledger.size - last_size >= opts.checkpoint_events
            or mono - self._cp_seen[1] >= opts.checkpoint_seconds
            or any(r[5] in URGENT_ACTIONS for r in rows)
        )

    def _sign(self, conn: sqlite3.Connection) -> None:
        """Inside its own write transaction, after the events it covers are committed: check the log
        against the witness record, sign a checkpoint of the current size, write the record (before
        this transaction commits: never behind audit.db), store the checkpoint."""
        ledger, opts = self.ledger, self.ledger_options
        assert ledger is not None and opts is not None
        ledger.refresh()
        last = ledger.latest_checkpoint()
        if last is not None and last[0].size >= ledger.size:
            return
        problem = integrity.witness_problem(conn, ledger.size, self._witness())
        if problem is not None:
            self.refuse(problem)
            raise problem
        fault_point("audit_events_committed")
        note = ledger.checkpoint(time.time())
        if note is not None and opts.witness is not None:
            integrity.write_witness(opts.witness, note)
            fault_point("audit_witness_written")
        self._cp_seen = (ledger.size, time.monotonic())

    def _transaction(self, body: Any) -> Any:
        """``body(conn)`` in one write transaction on the write connection (rolled back on any error)."""
        conn = self._write
        conn.execute("BEGIN IMMEDIATE")
        try:
            out = body(conn)
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(*sqldriver.ERRORS):
                conn.execute("ROLLBACK")
            if self.ledger is not None:
                with contextlib.suppress(*sqldriver.ERRORS, LedgerError):
                    self.ledger.reload()
            raise
        return out

    def _insert(self, rows: list[Row], *, dedupe: bool = False) -> None:
        """One transaction for the events (and, when one is due, a second one for the checkpoint); a
        SQLite failure is STORE_BUSY (a lock held too long) or STORE_UNAVAILABLE; a log that failed
        its integrity check refuses (``AUDIT_LOG_INCONSISTENT`` / ``AUDIT_LOG_DAMAGED``)."""
        if self.integrity is not None:
            raise self.integrity
        with self._maint:
            try:
                due = False
                if self.ledger is not None:
                    due = bool(self._transaction(lambda conn: self._ledger_write(conn, rows, dedupe=dedupe)))
                    if self.ledger is not None:
                        self._known_size = max(self._known_size, self.ledger.size)
                else:
                    self._transaction(lambda conn: None)
            except LedgerError as exc:  # (a UompError too: before the general clause)
                raise UompError(
                    ErrorCode.STORE_UNAVAILABLE,
                    f"the audit log is inconsistent ({exc.message}); run 'uomp audit verify'",
                ) from exc
            except UompError as exc:
                if exc.code in (ErrorCode.AUDIT_LOG_INCONSISTENT, ErrorCode.AUDIT_LOG_DAMAGED):
                    self.refuse(exc)
                raise
            except sqldriver.ERRORS as exc:
                raise self._write_error(exc) from exc
            if not due:
                return
            try:  # the events are durable: a checkpoint that fails now is retried at the next batch or probe
                self._transaction(self._sign)
            except sqldriver.errors(LedgerError, OSError) as exc:  # (a UompError too: before the general clause)
                log.warning("audit log: checkpoint not signed: %s", type(exc).__name__)
            except UompError as exc:
                log.warning("audit log: checkpoint not signed: %s", exc.code)

    @staticmethod
    def _write_error(exc: Exception) -> UompError:
        err = db_error(exc, what="audit log")
        if err.code == ErrorCode.STORE_UNAVAILABLE:
            err = UompError(
                ErrorCode.STORE_UNAVAILABLE, f"the audit log could not be written ({describe_failure(exc)})"
            )
        return err

    def sign_now(self) -> int | None:
        """Sign a checkpoint of every event written so far, now (a clean stop): pending rows are
        written first, and the checkpoint is signed as every other one (:meth:`_sign`: checked against
        the witness record, the record written before the commit). Returns the signed size, or None
        when the newest checkpoint already covers the log, this log signs nothing, or it is refused."""
        if self.ledger is None or self.ledger_options is None or self.integrity is not None:
            return None
        self.writer.flush_sync()
        with self._maint:
            ledger = self.ledger
            last = ledger.latest_checkpoint()
            before = last[0].size if last is not None else 0
            try:
                self._transaction(self._sign)
            except LedgerError as exc:
                raise UompError(
                    ErrorCode.STORE_UNAVAILABLE,
                    f"the audit log is inconsistent ({exc.message}); run 'uomp audit verify'",
                ) from exc
            except sqldriver.ERRORS as exc:
                raise db_error(exc, what="audit log") from exc
            last = ledger.latest_checkpoint()
            after = last[0].size if last is not None else 0
        return after if after > before else None

    def write_now(self, rows: list[Row]) -> None:
        """Write rows at once, bypassing the queue (replaying an outbox); idempotent on the row ids."""
        if rows:
            self._insert(rows, dedupe=True)

    def checkpoint_due(self) -> bool:
        """True when events wait for a checkpoint (the guard's timer then probes the writer)."""
        if self.ledger is None or self.ledger_options is None or self.integrity is not None:
            return False
        row = self._read.execute("SELECT MAX(seq) FROM ledger_events").fetchone()
        size = int(row[0] or 0)
        cp = self._read.execute("SELECT MAX(size) FROM ledger_checkpoints").fetchone()
        return size > int(cp[0] or 0)

    def flush_sync(self, ticket: int | None = None) -> None:
        self.writer.flush_sync(ticket)

    async def flush(self, ticket: int | None = None) -> None:
        """Return once ``ticket`` (default: every record appended before this call) is durable."""
        await self.writer.flush(ticket)

    # ----------------------------------------------------------------------------- reading
    # Every reader goes through gateway.ledger.query over ``ledger_events`` (the one log).

    def query(self, flt: AuditFilter, *, view: str = "user", include_pruned: bool = False) -> AuditPage:
        """:func:`gateway.ledger.query.query_events` on this log's read connection (newest last).
        Blocking: from the event loop, run it on :attr:`reader`."""
        return query_events(self._read, flt, view=view, include_pruned=include_pruned)

    def session_known(self, session_id: str) -> bool:
        return session_known(self._read, session_id)

    def for_session(self, session_id: str, *, limit: int = 100, agent_view: bool = True) -> list[dict[str, Any]]:
        """Newest first (the ``GET /v1/audit`` order). The agent view keeps only
        :data:`gateway.ledger.query.AGENT_FIELDS` (no ``detail``, ``via``, ``seq``)."""
        limit = max(1, min(limit, MAX_AUDIT_PAGE))
        page = self.query(AuditFilter(session_id=session_id, limit=limit), view="agent" if agent_view else "user")
        return page.events[::-1]

    def recent(self, *, limit: int = 100, session_id: str | None = None) -> list[dict[str, Any]]:
        """Newest first, every field (the user's view)."""
        limit = max(1, min(limit, MAX_AUDIT_PAGE))
        return self.query(AuditFilter(session_id=session_id, limit=limit)).events[::-1]

    def proof_for_session(
        self, event_id: str, session_id: str, *, chain: dict[str, Any] | None = None, since: int | None = None
    ) -> dict[str, Any]:
        """The proof bundle of one event (:meth:`EventLog.proof_bundle`) for an agent of
        ``session_id``. Another session's event and an unknown id are the same ``NOT_FOUND`` (no
        existence leak, spec §21). A refused event is not served: its body holds the user's
        ``detail`` (why, which can say whether an item exists), and a bundle cannot leave it out.
        With ``since``, the bundle also carries ``consistency`` (:meth:`_consistency`)."""
        unknown = UompError(ErrorCode.NOT_FOUND, "no such event in this session's audit log", session_id=session_id)
        if not 1 <= len(event_id) <= 128:
            raise unknown
        conn = self._read
        conn.execute("BEGIN")  # one snapshot: the event, the tree and the checkpoint agree
        try:
            owner = event_owner(conn, event_id)
            if owner is None or owner[0] != session_id:
                raise unknown
            if owner[1] is False:
                raise UompError(
                    ErrorCode.ACCESS_DENIED,
                    "proofs of refused events are for the user only: the event holds "
                    "the user's audit detail (ask the user: 'uomp audit proof')",
                    session_id=session_id,
                )
            self._read_ledger.reload()
            bundle = self._read_ledger.proof_bundle(event_id, chain=chain)
            body = bundle["event"]
            if body.get("session_id") != session_id or body.get("allowed") is not True:
                raise unknown  # the index columns said otherwise: the body decides (an edited row)
            if since is not None:
                bundle["consistency"] = self._consistency(since, int(bundle["tree_size"]), session_id)
            return bundle
        except LedgerError as exc:
            raise ledger_refusal(exc, session_id=session_id) from None
        finally:
            conn.execute("COMMIT")

    def checkpoint_since(self, since: int | None, session_id: str) -> dict[str, Any]:
        """``GET /v1/audit/checkpoint``: the newest signed checkpoint and, with ``since`` (a tree size
        the agent saw signed before), the RFC 9162 consistency proof from that size to it
        (docs/audit.md "Agents as witnesses")."""
        conn = self._read
        conn.execute("BEGIN")  # one snapshot: the checkpoint and the tree agree
        try:
            ledger = self._read_ledger
            ledger.reload()
            latest = ledger.latest_checkpoint()
            if latest is None:
                raise LedgerError(ErrorCode.PROOF_PENDING, "the log has no signed checkpoint yet; try again shortly")
            cp, note = latest
            out: dict[str, Any] = {"tree_size": cp.size, "checkpoint": note, "verifier_key": ledger.verifier_key()}
            if since is not None:
                out["consistency"] = self._consistency(since, cp.size, session_id)
            return out
        except LedgerError as exc:
            raise ledger_refusal(exc, session_id=session_id) from None
        finally:
            conn.execute("COMMIT")

    def _consistency(self, since: int, size: int, session_id: str) -> dict[str, Any]:
        """The consistency proof between tree size ``since`` and ``size`` (the smaller is ``old_size``),
        in the caller's read snapshot. ``since`` beyond the newest signed checkpoint is refused
        (AUDIT_SIZE_UNKNOWN): this log never signed that size, so the agent saw another history."""
        ledger = self._read_ledger
        assert ledger is not None
        latest = ledger.latest_checkpoint()
        newest = 0 if latest is None else latest[0].size
        if since > newest:
            raise UompError(
                ErrorCode.AUDIT_SIZE_UNKNOWN,
                f"since={since} is beyond the newest signed checkpoint "
                f"(tree size {newest}); send the size of a checkpoint this log gave you",
                session_id=session_id,
                details={"tree_size": newest},
            )
        old, new = sorted((since, size))
        path = ledger.tree.consistency_proof(old, new) if old > 0 else []
        return {"old_size": old, "new_size": new, "path": [base64.b64encode(h).decode() for h in path]}

    def purge(self, *, now: float | None = None) -> int:
        """Retention (default 90 days, §18.3): event bodies older than that are dropped, their
        leaves and tree nodes stay, so every proof issued before still verifies. Returns how many.

        In slices of :data:`PURGE_SLICE_EVENTS`, each its own short transaction, with the write
        connection let go between them: the group-commit writer's batches (every read's event) go in
        between, where one UPDATE of an hour's events held them for as long as it ran (0.6-0.75 s for
        200,000 events here). Each run starts where the last one
        stopped (events are pruned in time order), so the hourly run does not walk the pruned ones
        again: the first run of a process finds the oldest body once, on a connection of its own that
        blocks no writer. An event written later with a time before the last cutoff (a gateway spool
        replayed after more than the retention period) loses its body at the next start."""
        if self.integrity is not None:
            return 0
        cutoff = (time.time() if now is None else now) - self.retention_days * 86400
        ledger = self.ledger
        assert ledger is not None
        since = self._purged_below
        if since is None:
            since = self._oldest_body_ts()
            if since is None:  # no event has a body
                self._purged_below = cutoff
                return 0
        total = 0
        while since < cutoff:
            with self._maint:
                conn = self._write
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        n, since = ledger.prune_slice(since, cutoff, PURGE_SLICE_EVENTS)
                        conn.execute("COMMIT")
                    except BaseException:
                        with contextlib.suppress(*sqldriver.ERRORS):
                            conn.execute("ROLLBACK")
                        raise
                except sqldriver.ERRORS as exc:
                    raise db_error(exc, what="audit log") from exc
            total += n
            if n < PURGE_SLICE_EVENTS:
                break
            time.sleep(PURGE_PAUSE_SECONDS)  # the writer thread's turn, if it waits
        self._purged_below = max(since, cutoff)
        return total

    def _oldest_body_ts(self) -> float | None:
        conn = auditdb.connect(self.path, timeout=DEFAULT_BUSY_TIMEOUT_SECONDS)
        try:
            return oldest_body_ts(conn)
        except sqldriver.ERRORS as exc:
            raise db_error(exc, what="audit log") from exc
        finally:
            conn.close()

    def _migrate_legacy(self) -> None:
        """Rows of an older version's ``audit_logs`` that the event log does not hold become events
        (appended in their old order, original ids and times, marked ``"migrated": true``); then the
        old table is dropped. One transaction: all of it or nothing."""
        conn, ledger = self._write, self.ledger
        assert ledger is not None
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'audit_logs'").fetchone() is None:
            return
        # in __init__, before the writer thread exists: nothing else uses the connection yet
        conn.execute("BEGIN IMMEDIATE")
        try:
            ledger.reload()
            have = {str(r[1]) for r in conn.execute("PRAGMA table_info(audit_logs)")}
            cols = ", ".join(c if c in have else "NULL" for c in COLUMNS)
            cur = conn.execute(
                f"SELECT {cols} FROM audit_logs WHERE id NOT IN "
                "(SELECT id FROM ledger_events) ORDER BY " + ("seq" if "seq" in have else "ts")
            )
            moved = 0
            while batch := cur.fetchmany(5000):
                ledger.append([{**row_event(tuple(r)), "migrated": True} for r in batch])
                moved += len(batch)
            conn.execute("DROP TABLE audit_logs")
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(*sqldriver.ERRORS):
                conn.execute("ROLLBACK")
            with contextlib.suppress(*sqldriver.ERRORS, LedgerError):
                ledger.reload()
            raise
        if moved:
            self._known_size = ledger.size
            if self.ledger_options is not None:
                self._transaction(self._sign)
            log.warning("audit log: %d event(s) of an older version moved into the event log", moved)

    def close(self) -> None:
        try:
            if self.lost.total:
                with contextlib.suppress(UompError):
                    self.writer.probe_sync()
        finally:
            try:
                self.writer.close()
                self.reader.close()
                self._read.close()
                self._write.close()
            finally:
                for fn in self.on_close:
                    fn()
