"""Anchoring signed checkpoints on a chain: a durable backlog and the worker that drains it.

* The backlog is a table beside the checkpoints (``ledger_anchors``). A checkpoint is queued in
  the same transaction that stores it, so a crash can never lose one, and a chain RPC that is down
  for an hour only makes the queue longer: the worker catches up when it returns.
* Only the newest queued checkpoint is sent: a later root covers every earlier event (each
  checkpoint is proven consistent with the one before it), so older queued ones are marked
  ``superseded`` instead of costing a transaction each.
* An anchor counts once it is ``final`` (the backend's confirmation depth). Errors the chain may
  get over (unreachable, not final yet) are retried with exponential backoff; a refusal that will
  not change (reverted, not the owner, out of funds) is ``failed`` and reported, and the next
  checkpoint is tried on its own.
* The worker runs in its own task with its own connection; nothing on a request path waits for it.
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

from gateway.anchor.base import Anchor, AnchorBackend, AnchorError, Submitted
from gateway.ledger.log import ANCHOR_SCHEMA

log = logging.getLogger("uomp.anchor")

STATES = ("queued", "submitted", "confirmed", "superseded", "failed")


def backlog(conn: sqlite3.Connection, *, now: float | None = None) -> dict[str, Any]:
    """Counts per state and the age of the oldest checkpoint not yet final (for `uomp status`)."""
    now = time.time() if now is None else now
    counts = {s: 0 for s in STATES}
    for state, n in conn.execute("SELECT state, COUNT(*) FROM ledger_anchors GROUP BY state"):
        counts[str(state)] = int(n)
    row = conn.execute("SELECT MIN(queued_at) FROM ledger_anchors WHERE state IN ('queued', 'submitted')").fetchone()
    last = conn.execute("SELECT size, ref, block_number, done_at FROM ledger_anchors WHERE state = 'confirmed'"
                        " ORDER BY size DESC LIMIT 1").fetchone()
    err = conn.execute("SELECT last_error FROM ledger_anchors WHERE last_error IS NOT NULL"
                       " AND state IN ('queued', 'submitted', 'failed') ORDER BY size DESC LIMIT 1").fetchone()
    return {
        "counts": counts,
        "oldest_pending_seconds": None if row[0] is None else max(0.0, now - float(row[0])),
        "last_confirmed": None if last is None else {"tree_size": int(last[0]), "tx": last[1],
                                                     "block": last[2], "at": last[3]},
        "last_error": None if err is None else err[0],
    }


@dataclass(frozen=True)
class AnchorPolicy:
    poll_seconds: float = 2.0
    backoff_initial_seconds: float = 2.0
    backoff_max_seconds: float = 300.0


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

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False, timeout=2.0)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.executescript(ANCHOR_SCHEMA)
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

    async def step(self, *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        # Supersede every queued checkpoint below the newest queued one.
        await self._q("UPDATE ledger_anchors SET state = 'superseded', done_at = ? WHERE state = 'queued'"
                      " AND size < (SELECT MAX(size) FROM ledger_anchors WHERE state = 'queued')", (now,))
        for size, cp_hash, state, ref, nonce, attempts in await self._q(
                "SELECT size, checkpoint_hash, state, ref, nonce, attempts FROM ledger_anchors"
                " WHERE state IN ('queued', 'submitted') AND next_at <= ? ORDER BY size", (now,)):
            note = await self._q("SELECT note FROM ledger_checkpoints WHERE size = ?", (size,))
            if not note:
                await self._fail(size, "checkpoint missing from the log", now)
                continue
            anchor = Anchor.for_checkpoint(str(note[0][0]))
            if anchor.checkpoint_hash != bytes(cp_hash):
                await self._fail(size, "checkpoint changed since it was queued", now)
                continue
            try:
                if state == "queued":
                    sub = await self.backend.submit(anchor)
                    await self._q("UPDATE ledger_anchors SET state = 'submitted', ref = ?, nonce = ?, attempts = ?,"
                                  " last_error = NULL, next_at = ? WHERE size = ?",
                                  (sub.ref, sub.nonce, attempts + 1, now, size))
                    log.info("anchored checkpoint %d: %s tx %s", size, self.backend.name, sub.ref or "-")
                    state, ref, nonce = "submitted", sub.ref, sub.nonce
                conf = await self.backend.status(Submitted(self.backend.name, anchor.anchor_id, ref or "", nonce))
            except AnchorError as exc:
                if exc.retryable:
                    await self._retry(size, attempts + 1, str(exc), now)
                else:
                    await self._fail(size, str(exc), now)
                continue
            if conf.state == "confirmed" and conf.final:
                await self._q("UPDATE ledger_anchors SET state = 'confirmed', block_number = ?, confirmations = ?,"
                              " done_at = ?, last_error = NULL WHERE size = ?",
                              (conf.block_number, conf.confirmations, now, size))
                log.info("checkpoint %d final on %s (block %s)", size, self.backend.name, conf.block_number)
            elif conf.state == "dropped":
                await self._q("UPDATE ledger_anchors SET state = 'queued', next_at = ? WHERE size = ?", (now, size))
            elif conf.state == "failed":
                await self._fail(size, "the anchoring transaction reverted", now)
            elif conf.state == "not_anchored":
                await self._q("UPDATE ledger_anchors SET state = 'confirmed', done_at = ? WHERE size = ?", (now, size))
            else:  # pending or not deep enough yet
                await self._q("UPDATE ledger_anchors SET confirmations = ?, next_at = ? WHERE size = ?",
                              (conf.confirmations, now + self.policy.poll_seconds, size))

    async def _retry(self, size: int, attempts: int, error: str, now: float) -> None:
        wait = min(self.policy.backoff_max_seconds, self.policy.backoff_initial_seconds * 2 ** min(attempts - 1, 20))
        log.warning("anchoring checkpoint %d: %s; retrying in %.0f s", size, error, wait)
        await self._q("UPDATE ledger_anchors SET attempts = ?, last_error = ?, next_at = ? WHERE size = ?",
                      (attempts, error[:300], now + wait, size))

    async def _fail(self, size: int, error: str, now: float) -> None:
        log.error("anchoring checkpoint %d failed: %s", size, error)
        await self._q("UPDATE ledger_anchors SET state = 'failed', last_error = ?, done_at = ? WHERE size = ?",
                      (error[:300], now, size))
