"""Anchoring signed checkpoints on a chain: a durable backlog and the worker that drains it.

* The backlog is a table beside the checkpoints (``ledger_anchors``). A checkpoint is queued in
  the same transaction that stores it, so a crash can never lose one, and a chain RPC that is down
  for an hour only makes the queue longer: the worker catches up when it returns.
* Only the newest open checkpoint is sent: a later root covers every earlier event (each
  checkpoint is proven consistent with the one before it), so older open ones (``queued`` or
  ``rejected``) are marked ``superseded`` instead of costing a transaction each.
* ``confirmed`` means checked, never "the node said so": the worker sets it only after the
  backend's ``verify`` read the chain itself (chain id, contract code hash, the receipt's target
  and status, the exact event sequence emitted by the contract, the event log, ``anchoredBlock``,
  the confirmation depth). The same check runs for an anchor ``submit`` found already on chain and
  for every row left ``submitted`` by a restart.
* A chain that does not show what it claims makes the row ``rejected`` with the reason (durable,
  counted, logged at error level). A rejected row is retried by a fresh ``submit`` after a backoff
  (doubling up to the cap) once ``check_contract`` passes again, and is superseded like a queued
  one by a newer checkpoint: a cause that persists keeps the newest checkpoint rejected.
* Confirmed anchors are read from the chain again at start and every ``recheck_seconds``: the
  newest ``recheck_count`` of them, and all of them once one is found gone. One the chain no longer
  shows (a reorg past the depth, a fresh node, a chain reset or revert) goes back to ``queued``
  (re-anchored) with the reason kept in ``rejected_reason``; until then nothing shows or bundles it.
* Errors the chain may get over (unreachable, not final yet) are retried with exponential backoff;
  a refusal that will not change (reverted, not the owner, out of funds) is ``failed`` and
  reported, and the next checkpoint is tried on its own.
* The worker runs in its own task with its own connection; nothing on a request path waits for it.

Other kinds of anchored records (the §18.4.1 events) get their own backlog table with the same
states and the same rule: a row counts only after ``verify`` passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.anchor.base import Anchor, AnchorBackend, AnchorError, AnchorMismatch, Submitted
from gateway.ledger.log import ANCHOR_SCHEMA

log = logging.getLogger("uomp.anchor")

STATES = ("queued", "submitted", "confirmed", "rejected", "superseded", "failed")
OPEN_STATES = ("queued", "submitted", "rejected")  # the backlog: not anchored yet, still to do
MAX_RECHECK_ALL = 1000  # confirmed anchors read again in one round once one was found gone
MAX_REASON = 300  # characters of an error kept in the table

# Columns this module adds to ledger_anchors (older databases get them on the worker's first open).
_EXTRA_COLUMNS = (
    ("verified_at", "REAL"),  # when verify() last passed for this row's transaction
    ("checked_at", "REAL"),  # when the chain was last read for it (submit, verify or recheck)
    ("rejections", "INTEGER NOT NULL DEFAULT 0"),  # how often the chain did not show it
    ("rejected_reason", "TEXT"),  # the newest reason (kept after a retry or re-anchor)
    ("rejected_at", "REAL"),
)


def _columns(conn: sqlite3.Connection) -> set[str]:
    return {str(r[1]) for r in conn.execute("PRAGMA table_info(ledger_anchors)")}


def ensure_schema(conn: sqlite3.Connection) -> None:
    """The backlog table with this module's columns; a row ``confirmed`` by an earlier version
    without a recorded check goes back to ``submitted`` (checked before it counts again)."""
    have = _columns(conn)
    if not have:
        conn.executescript(ANCHOR_SCHEMA)
        have = _columns(conn)
    for name, decl in _EXTRA_COLUMNS:
        if name not in have:
            try:
                conn.execute(f"ALTER TABLE ledger_anchors ADD COLUMN {name} {decl}")
            except sqlite3.OperationalError as exc:
                if "duplicate column" not in str(exc):  # another process added it first: fine
                    raise  # busy (the writer holds the lock): the caller tries again next round
    unchecked = ("FROM ledger_anchors WHERE state = 'confirmed' AND verified_at IS NULL AND ref IS NOT NULL"
                 " AND ref != ''")
    if conn.execute(f"SELECT 1 {unchecked} LIMIT 1").fetchone() is not None:  # nothing written otherwise
        conn.execute(f"UPDATE ledger_anchors SET state = 'submitted', next_at = 0 WHERE rowid IN (SELECT rowid"
                     f" {unchecked})")


def backlog(conn: sqlite3.Connection, *, now: float | None = None) -> dict[str, Any]:
    """Counts per state, the open backlog (size, oldest, last error), the newest confirmed anchor
    and the newest rejection (for `uomp status`, `uomp anchor status`, the dashboard, metrics)."""
    now = time.time() if now is None else now
    cols = _columns(conn)
    counts = {s: 0 for s in STATES}
    for state, n in conn.execute("SELECT state, COUNT(*) FROM ledger_anchors GROUP BY state"):
        counts[str(state)] = int(n)
    open_in = "('queued', 'submitted', 'rejected')"
    row = conn.execute(f"SELECT MIN(queued_at), MIN(size) FROM ledger_anchors WHERE state IN {open_in}").fetchone()
    last = conn.execute("SELECT size, ref, block_number, done_at FROM ledger_anchors WHERE state = 'confirmed'"
                        " ORDER BY size DESC LIMIT 1").fetchone()
    err = conn.execute("SELECT last_error FROM ledger_anchors WHERE last_error IS NOT NULL"
                       " AND state IN ('queued', 'submitted', 'rejected', 'failed') ORDER BY size DESC LIMIT 1"
                       ).fetchone()
    rejection = None
    checked = None
    if "rejected_reason" in cols:
        r = conn.execute("SELECT size, state, rejected_reason, rejected_at, rejections FROM ledger_anchors"
                         " WHERE rejected_reason IS NOT NULL ORDER BY rejected_at DESC, size DESC LIMIT 1").fetchone()
        if r is not None:
            rejection = {"tree_size": int(r[0]), "state": r[1], "reason": r[2], "at": r[3], "rejections": int(r[4])}
        checked = conn.execute("SELECT MAX(checked_at) FROM ledger_anchors WHERE state = 'confirmed'").fetchone()[0]
    return {
        "counts": counts,
        "backlog_size": sum(counts[s] for s in OPEN_STATES),
        "oldest_pending_seconds": None if row[0] is None else max(0.0, now - float(row[0])),
        "oldest_pending_tree_size": None if row[1] is None else int(row[1]),
        "last_confirmed": None if last is None else {"tree_size": int(last[0]), "tx": last[1],
                                                     "block": last[2], "at": last[3]},
        "last_checked_at": checked,
        "last_error": None if err is None else err[0],
        "last_rejection": rejection,
    }


def counts_of(db_path: Path) -> dict[str, int] | None:
    """The backlog's counts per state, read-only (metrics); None while there is no readable table."""
    try:
        conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=0.5)
        try:
            counts = {s: 0 for s in STATES}
            for state, n in conn.execute("SELECT state, COUNT(*) FROM ledger_anchors GROUP BY state"):
                counts[str(state)] = int(n)
            return counts
        finally:
            conn.close()
    except sqlite3.Error:
        return None


def summary(b: dict[str, Any] | None) -> str:
    """One line for `uomp status`, `uomp anchor status` and the dashboard."""
    if not b:
        return "no anchoring backlog (the audit log is not open yet)"
    c = b["counts"]
    last = b.get("last_confirmed")
    text = (f"{c.get('confirmed', 0)} anchored (checked on chain), {b.get('backlog_size', 0)} in the backlog"
            + (f" ({c['rejected']} REJECTED)" if c.get("rejected") else "")
            + (f", oldest {b['oldest_pending_seconds']:.0f} s" if b.get("oldest_pending_seconds") is not None else "")
            + (f", last in tx {last['tx']}" if last else ""))
    rej = b.get("last_rejection")
    if rej and rej.get("state") in OPEN_STATES:
        text += f"; !! the chain did not show checkpoint {rej['tree_size']}: {rej['reason']}"
    if b.get("last_error") and (not rej or b["last_error"] != rej.get("reason")):
        text += f"; last error: {b['last_error']}"
    return text


@dataclass(frozen=True)
class AnchorPolicy:
    poll_seconds: float = 2.0
    backoff_initial_seconds: float = 2.0
    backoff_max_seconds: float = 300.0
    recheck_seconds: float = 600.0  # confirmed anchors are read from the chain again this often (and at start)
    recheck_count: int = 32  # the newest this many confirmed anchors, per recheck


class Anchorer:
    """Drains the backlog of one ledger database into one backend."""

    def __init__(self, db_path: Path, backend: AnchorBackend, *, policy: AnchorPolicy | None = None,
                 backend_info: dict[str, Any] | None = None) -> None:
        self.db_path = db_path
        self.backend = backend
        self.policy = policy or AnchorPolicy()
        self._conn: sqlite3.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.info = backend_info or {}
        self._next_recheck: float | None = None  # None: at the first round (start)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False, timeout=2.0)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                ensure_schema(conn)
            except sqlite3.Error:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="anchorer")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("anchoring round failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.policy.poll_seconds)

    # ------------------------------------------------------------------ one round

    def _sql(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return list(self._db().execute(sql, args).fetchall())

    async def _q(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return await asyncio.to_thread(self._sql, sql, args)

    async def _anchor_of(self, size: int, cp_hash: bytes, now: float) -> Anchor | None:
        note = await self._q("SELECT note FROM ledger_checkpoints WHERE size = ?", (size,))
        if not note:
            await self._fail(size, "checkpoint missing from the log", now)
            return None
        anchor = Anchor.for_checkpoint(str(note[0][0]))
        if anchor.checkpoint_hash != bytes(cp_hash):
            await self._fail(size, "checkpoint changed since it was queued", now)
            return None
        return anchor

    async def step(self, *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        await self._q("SELECT 1")  # opens (and migrates) the table before anything reads it
        if self._next_recheck is None or now >= self._next_recheck:
            await self.recheck(now=now)
        # Supersede every open checkpoint below the newest one that is open or confirmed.
        await self._q("UPDATE ledger_anchors SET state = 'superseded', done_at = ?"
                      " WHERE state IN ('queued', 'rejected') AND size < (SELECT MAX(size) FROM ledger_anchors"
                      " WHERE state IN ('queued', 'submitted', 'rejected', 'confirmed'))", (now,))
        for size, cp_hash, state, ref, nonce, attempts, rejections in await self._q(
                "SELECT size, checkpoint_hash, state, ref, nonce, attempts, rejections FROM ledger_anchors"
                " WHERE state IN ('queued', 'submitted', 'rejected') AND next_at <= ? ORDER BY size", (now,)):
            anchor = await self._anchor_of(size, cp_hash, now)
            if anchor is not None:
                await self._advance(anchor, size, state, ref, nonce, attempts, rejections, now)

    async def _advance(self, anchor: Anchor, size: int, state: str, ref: str | None, nonce: int | None,
                       attempts: int, rejections: int, now: float) -> None:
        """One row one step on: send (queued, rejected), then status, then verify before confirmed."""
        phase = "check"  # a refusal while checking the chain is a rejection; while sending, a failure
        try:
            if state in ("queued", "rejected"):
                await self.backend.check_contract()
                phase = "send"
                sub = await self.backend.submit(anchor)
                phase = "check"
                await self._q("UPDATE ledger_anchors SET state = 'submitted', ref = ?, nonce = ?, attempts = ?,"
                              " last_error = NULL, next_at = ?, checked_at = ? WHERE size = ?",
                              (sub.ref, sub.nonce, attempts + 1, now, now, size))
                log.info("checkpoint %d: %s tx %s (%s)", size, self.backend.name, sub.ref or "-",
                         "found on chain" if sub.found_on_chain else "sent")
                ref, nonce = sub.ref, sub.nonce
            conf = await self.backend.status(Submitted(self.backend.name, anchor.anchor_id, ref or "", nonce))
            if conf.state == "confirmed" and conf.final:
                await self.backend.verify(anchor, ref or "")
        except AnchorError as exc:
            if exc.retryable:
                await self._retry(size, attempts + 1, str(exc), now)
            elif isinstance(exc, AnchorMismatch) or phase == "check":
                await self._reject(size, rejections, str(exc), now)
            else:
                await self._fail(size, str(exc), now)
            return
        if conf.state == "confirmed" and conf.final:
            await self._q("UPDATE ledger_anchors SET state = 'confirmed', block_number = ?, confirmations = ?,"
                          " done_at = ?, last_error = NULL, verified_at = ?, checked_at = ? WHERE size = ?",
                          (conf.block_number, conf.confirmations, now, now, now, size))
            log.info("checkpoint %d final on %s (block %s), checked on chain", size, self.backend.name,
                     conf.block_number)
        elif conf.state == "dropped":
            await self._q("UPDATE ledger_anchors SET state = 'queued', next_at = ? WHERE size = ?", (now, size))
        elif conf.state == "failed":
            await self._fail(size, "the anchoring transaction reverted", now)
        elif conf.state == "not_anchored":
            await self._q("UPDATE ledger_anchors SET state = 'confirmed', done_at = ?, verified_at = ? WHERE size = ?",
                          (now, now, size))
        else:  # pending or not deep enough yet
            await self._q("UPDATE ledger_anchors SET confirmations = ?, next_at = ? WHERE size = ?",
                          (conf.confirmations, now + self.policy.poll_seconds, size))

    async def recheck(self, *, now: float | None = None) -> int:
        """Read the newest ``recheck_count`` confirmed anchors from the chain again (all of them, up
        to MAX_RECHECK_ALL, once one is gone). One the chain no longer shows goes back to
        ``queued``. Returns how many were sent back. An unreachable chain ends the round quietly:
        the rows stay as they were last checked (``checked_at``)."""
        now = time.time() if now is None else now
        self._next_recheck = now + self.policy.recheck_seconds
        rows = await self._q("SELECT size, checkpoint_hash, ref, rejections FROM ledger_anchors"
                             " WHERE state = 'confirmed' AND ref IS NOT NULL AND ref != '' ORDER BY size DESC LIMIT ?",
                             (MAX_RECHECK_ALL,))
        gone = 0
        for i, (size, cp_hash, ref, rejections) in enumerate(rows):
            if i >= self.policy.recheck_count and not gone:
                break
            anchor = await self._anchor_of(size, cp_hash, now)
            if anchor is None:
                continue
            try:
                conf = await self.backend.status(Submitted(self.backend.name, anchor.anchor_id, str(ref)))
                await self.backend.verify(anchor, str(ref))
            except AnchorError as exc:
                if exc.retryable:
                    log.warning("anchor recheck of checkpoint %d postponed: %s", size, exc)
                    break
                gone += 1
                reason = f"recheck: tx {ref} no longer shows checkpoint {size} ({exc})"[:MAX_REASON]
                log.error("anchor of checkpoint %d is gone from the chain, re-anchoring: %s", size, exc)
                await self._q("UPDATE ledger_anchors SET state = 'queued', ref = NULL, nonce = NULL,"
                              " block_number = NULL, confirmations = 0, verified_at = NULL, done_at = NULL,"
                              " next_at = ?, last_error = ?,"
                              " rejected_reason = ?, rejected_at = ?, rejections = ?, checked_at = ? WHERE size = ?",
                              (now, reason, reason, now, int(rejections) + 1, now, size))
                continue
            await self._q("UPDATE ledger_anchors SET checked_at = ?, verified_at = ?, block_number = ?,"
                          " confirmations = ? WHERE size = ?",
                          (now, now, conf.block_number, conf.confirmations, size))
        return gone

    def _backoff(self, n: int) -> float:
        return float(min(self.policy.backoff_max_seconds,
                         self.policy.backoff_initial_seconds * 2 ** min(max(n, 1) - 1, 20)))

    async def _retry(self, size: int, attempts: int, error: str, now: float) -> None:
        wait = self._backoff(attempts)
        log.warning("anchoring checkpoint %d: %s; retrying in %.0f s", size, error, wait)
        await self._q("UPDATE ledger_anchors SET attempts = ?, last_error = ?, next_at = ? WHERE size = ?",
                      (attempts, error[:MAX_REASON], now + wait, size))

    async def _reject(self, size: int, rejections: int, error: str, now: float) -> None:
        wait = self._backoff(rejections + 1)
        log.error("anchor of checkpoint %d REJECTED (the chain does not show it): %s; a fresh send in %.0f s",
                  size, error, wait)
        await self._q("UPDATE ledger_anchors SET state = 'rejected', last_error = ?, rejected_reason = ?,"
                      " rejected_at = ?, rejections = ?, verified_at = NULL, next_at = ? WHERE size = ?",
                      (error[:MAX_REASON], error[:MAX_REASON], now, rejections + 1, now + wait, size))

    async def _fail(self, size: int, error: str, now: float) -> None:
        log.error("anchoring checkpoint %d failed: %s", size, error)
        await self._q("UPDATE ledger_anchors SET state = 'failed', last_error = ?, done_at = ? WHERE size = ?",
                      (error[:MAX_REASON], now, size))
