"""The anchoring worker: drains one ledger database's backlog of checkpoints (and the §18.4.1 facts
bound to them) into one backend, paced by :class:`AnchorPolicy`. The states, the facts' derivation
and the read-only backlog queries it works on are :mod:`gateway.ledger.anchoring`'s (which loads no
asyncio: ``uomp status`` and ``uomp audit`` read the backlog through it).

Each anchor's life (queued, sent, checked, confirmed or rejected) reads top to bottom here, against
the rules in :mod:`gateway.ledger.anchoring`'s docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway import sqldriver
from gateway.anchor.base import MAX_EVENTS_PER_ANCHOR, Anchor, AnchorBackend, AnchorError, AnchorMismatch, Submitted
from gateway.atrest import auditdb
from gateway.durable import fault_point
from gateway.eventloop import cancel_all
from gateway.ledger.anchoring import (
    MAX_DERIVE_BATCHES,
    MAX_REASON,
    MAX_RECHECK_ALL,
    anchor_for,
    derive_facts,
    ensure_schema,
)

log = logging.getLogger("uomp.anchor")


@dataclass(frozen=True)
class AnchorPolicy:
    """How the anchoring worker paces itself: polling, backoff, and re-checking confirmed anchors."""

    poll_seconds: float = 2.0
    backoff_initial_seconds: float = 2.0
    backoff_max_seconds: float = 300.0
    recheck_seconds: float = 600.0  # confirmed anchors are read from the chain again this often (and at start)
    recheck_count: int = 32  # the newest this many confirmed anchors, per recheck


class Anchorer:
    """Drains the backlog of one ledger database into one backend."""

    def __init__(
        self,
        db_path: Path,
        backend: AnchorBackend,
        *,
        policy: AnchorPolicy | None = None,
        backend_info: dict[str, Any] | None = None,
    ) -> None:
        self.db_path = db_path
        self.backend = backend
        self.policy = policy or AnchorPolicy()
        self._conn: sqlite3.Connection | None = None
        # Every use of the connection holds this, in a worker thread: a task cancelled while its
        # thread still runs a statement must not see the connection closed under it (stop() closes
        # it only once that statement is done; closing it mid-statement crashes the process).
        self._lock = threading.RLock()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.info = backend_info or {}
        self._next_recheck: float | None = None  # None: at the first round (start)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = auditdb.connect(self.db_path, check_same_thread=False, timeout=2.0)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                ensure_schema(conn)
            except sqldriver.ERRORS:
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
            await cancel_all([self._task])  # bounded: run()'s wait_for can lose a cancellation
            self._task = None
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        with self._lock:  # after the statement a cancelled round's thread may still be running
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _locked(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(connection, *args, **kwargs)`` holding the connection's lock (in a worker thread)."""
        with self._lock:
            return fn(self._db(), *args, **kwargs)

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
        with self._lock:
            return list(self._db().execute(sql, args).fetchall())

    async def _q(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return await asyncio.to_thread(self._sql, sql, args)

    async def _anchor_of(self, size: int, cp_hash: bytes, now: float) -> Anchor | None:
        note = await self._q("SELECT note FROM ledger_checkpoints WHERE size = ?", (size,))
        if not note:
            await self._fail(size, "checkpoint missing from the log", now)
            return None
        anchor: Anchor = await asyncio.to_thread(self._locked, anchor_for, size, str(note[0][0]))
        if anchor.checkpoint_hash != bytes(cp_hash):
            await self._fail(size, "checkpoint changed since it was queued", now)
            return None
        return anchor

    async def step(self, *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        await self._q("SELECT 1")  # opens (and migrates) the table before anything reads it
        if self._next_recheck is None or now >= self._next_recheck:
            await self.recheck(now=now)
        for _ in range(MAX_DERIVE_BATCHES):  # the §18.4.1 facts of new audit events, before the checkpoint
            if not await asyncio.to_thread(self._locked, derive_facts, now=now):  # that covers them is sent
                break
        # Supersede every open checkpoint below the newest one that is open or confirmed, unless it
        # carries §18.4.1 facts (those are sent themselves: the facts are bound to that transaction).
        await self._q(
            "UPDATE ledger_anchors SET state = 'superseded', done_at = ?"
            " WHERE state IN ('queued', 'rejected') AND size < (SELECT MAX(size) FROM ledger_anchors"
            " WHERE state IN ('queued', 'submitted', 'rejected', 'confirmed')) AND NOT EXISTS"
            " (SELECT 1 FROM ledger_anchor_events e WHERE e.anchor_size = ledger_anchors.size)",
            (now,),
        )
        for size, cp_hash, state, ref, nonce, attempts, rejections, fixed in await self._q(
            "SELECT size, checkpoint_hash, state, ref, nonce, attempts, rejections, events_fixed"
            " FROM ledger_anchors WHERE state IN ('queued', 'submitted', 'rejected') AND next_at <= ?"
            " ORDER BY size",
            (now,),
        ):
            if not fixed:
                await asyncio.to_thread(self._bind_facts, size)
                fault_point("anchor.facts_bound")
            anchor = await self._anchor_of(size, cp_hash, now)
            if anchor is not None:
                await self._advance(anchor, size, state, ref, nonce, attempts, rejections, now)

    def _bind_facts(self, size: int) -> None:
        """Bind the unbound facts checkpoint ``size`` covers to it, and fix its content, in one
        transaction: whatever is sent for this checkpoint from now on carries exactly these."""
        with self._lock:
            self._bind_facts_on(self._db(), size)

    def _bind_facts_on(self, conn: sqlite3.Connection, size: int) -> None:
        for _ in range(MAX_DERIVE_BATCHES):  # a checkpoint stored since this round's derivation: its facts first
            row = conn.execute("SELECT seq FROM ledger_anchor_scan WHERE one = 1").fetchone()
            if (row is not None and int(row[0]) >= size) or not derive_facts(conn):
                break
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute("SELECT events_fixed FROM ledger_anchors WHERE size = ?", (size,)).fetchone() == (0,):
                conn.execute(
                    "UPDATE ledger_anchor_events SET anchor_size = ? WHERE seq IN (SELECT seq FROM"
                    " ledger_anchor_events WHERE anchor_size IS NULL AND skipped IS NULL AND seq <= ?"
                    " ORDER BY seq LIMIT ?)",
                    (size, size, MAX_EVENTS_PER_ANCHOR),
                )
                conn.execute("UPDATE ledger_anchors SET events_fixed = 1 WHERE size = ?", (size,))
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(*sqldriver.ERRORS):
                conn.execute("ROLLBACK")
            raise

    async def _advance(
        self,
        anchor: Anchor,
        size: int,
        state: str,
        ref: str | None,
        nonce: int | None,
        attempts: int,
        rejections: int,
        now: float,
    ) -> None:
        """One row one step on: send (queued, rejected), then status, then verify before confirmed."""
        phase = "check"  # a refusal while checking the chain is a rejection; while sending, a failure
        try:
            if state in ("queued", "rejected"):
                await self.backend.check_contract()
                phase = "send"
                sub = await self.backend.submit(anchor)
                fault_point("anchor.sent")
                phase = "check"
                await self._q(
                    "UPDATE ledger_anchors SET state = 'submitted', ref = ?, nonce = ?, attempts = ?,"
                    " last_error = NULL, next_at = ?, checked_at = ? WHERE size = ?",
                    (sub.ref, sub.nonce, attempts + 1, now, now, size),
                )
                log.info(
                    "checkpoint %d: %s tx %s (%s)",
                    size,
                    self.backend.name,
                    sub.ref or "-",
                    "found on chain" if sub.found_on_chain else "sent",
                )
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
                await self._fail(size, str(exc), now, release=True)
            return
        if conf.state == "confirmed" and conf.final:
            await self._q(
                "UPDATE ledger_anchors SET state = 'confirmed', block_number = ?, confirmations = ?,"
                " done_at = ?, last_error = NULL, verified_at = ?, checked_at = ? WHERE size = ?",
                (conf.block_number, conf.confirmations, now, now, now, size),
            )
            log.info(
                "checkpoint %d final on %s (block %s), checked on chain", size, self.backend.name, conf.block_number
            )
        elif conf.state == "dropped":
            await self._q("UPDATE ledger_anchors SET state = 'queued', next_at = ? WHERE size = ?", (now, size))
        elif conf.state == "failed":
            try:  # reverted: was this checkpoint anchored by another transaction (a resend that raced it)?
                other = await self.backend.find(anchor)
            except AnchorError:
                other = None
            if other:
                await self._q(
                    "UPDATE ledger_anchors SET ref = ?, nonce = NULL, next_at = ? WHERE size = ?", (other, now, size)
                )
            else:
                await self._fail(size, "the anchoring transaction reverted", now, release=True)
        elif conf.state == "not_anchored":
            await self._q(
                "UPDATE ledger_anchors SET state = 'confirmed', done_at = ?, verified_at = ? WHERE size = ?",
                (now, now, size),
            )
        else:  # pending or not deep enough yet
            await self._q(
                "UPDATE ledger_anchors SET confirmations = ?, next_at = ? WHERE size = ?",
                (conf.confirmations, now + self.policy.poll_seconds, size),
            )

    async def recheck(self, *, now: float | None = None) -> int:
        """Read the newest ``recheck_count`` confirmed anchors from the chain again (all of them, up
        to MAX_RECHECK_ALL, once one is gone). One the chain no longer shows goes back to
        ``queued``. Returns how many were sent back. An unreachable chain ends the round quietly:
        the rows stay as they were last checked (``checked_at``)."""
        now = time.time() if now is None else now
        self._next_recheck = now + self.policy.recheck_seconds
        rows = await self._q(
            "SELECT size, checkpoint_hash, ref, rejections FROM ledger_anchors"
            " WHERE state = 'confirmed' AND ref IS NOT NULL AND ref != '' ORDER BY size DESC LIMIT ?",
            (MAX_RECHECK_ALL,),
        )
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
                await self._q(
                    "UPDATE ledger_anchors SET state = 'queued', ref = NULL, nonce = NULL,"
                    " block_number = NULL, confirmations = 0, verified_at = NULL, done_at = NULL,"
                    " next_at = ?, last_error = ?,"
                    " rejected_reason = ?, rejected_at = ?, rejections = ?, checked_at = ? WHERE size = ?",
                    (now, reason, reason, now, int(rejections) + 1, now, size),
                )
                continue
            await self._q(
                "UPDATE ledger_anchors SET checked_at = ?, verified_at = ?, block_number = ?,"
                " confirmations = ? WHERE size = ?",
                (now, now, conf.block_number, conf.confirmations, size),
            )
        return gone

    def _backoff(self, n: int) -> float:
        return float(
            min(self.policy.backoff_max_seconds, self.policy.backoff_initial_seconds * 2 ** min(max(n, 1) - 1, 20))
        )

    async def _retry(self, size: int, attempts: int, error: str, now: float) -> None:
        wait = self._backoff(attempts)
        log.warning("anchoring checkpoint %d: %s; retrying in %.0f s", size, error, wait)
        await self._q(
            "UPDATE ledger_anchors SET attempts = ?, last_error = ?, next_at = ? WHERE size = ?",
            (attempts, error[:MAX_REASON], now + wait, size),
        )

    async def _reject(self, size: int, rejections: int, error: str, now: float) -> None:
        wait = self._backoff(rejections + 1)
        log.error(
            "anchor of checkpoint %d REJECTED (the chain does not show it): %s; a fresh send in %.0f s",
            size,
            error,
            wait,
        )
        await self._q(
            "UPDATE ledger_anchors SET state = 'rejected', last_error = ?, rejected_reason = ?,"
            " rejected_at = ?, rejections = ?, verified_at = NULL, next_at = ? WHERE size = ?",
            (error[:MAX_REASON], error[:MAX_REASON], now, rejections + 1, now + wait, size),
        )

    async def _fail(self, size: int, error: str, now: float, *, release: bool = False) -> None:
        """``release``: the chain refused or reverted this anchor (its facts are not on chain), so
        they go with the next checkpoint sent; otherwise (the log itself is wrong) they stay bound."""
        log.error("anchoring checkpoint %d failed: %s", size, error)
        await self._q(
            "UPDATE ledger_anchors SET state = 'failed', last_error = ?, done_at = ? WHERE size = ?",
            (error[:MAX_REASON], now, size),
        )
        if release:
            await self._q("UPDATE ledger_anchor_events SET anchor_size = NULL WHERE anchor_size = ?", (size,))
