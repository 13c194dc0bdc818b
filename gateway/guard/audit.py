"""The guard's audit log (spec §18): its own SQLite file, apart from the Memory Store.

Every decision, allowed or not, becomes a row with the §18.2 fields plus ``query_count_remaining``.
``reason`` is what the agent may see in ``GET /v1/audit`` (no existence leak, see core.policy);
``detail`` is for the user only.

Durability without an fsync per request: records are group-committed. A request handler calls
:meth:`AuditLog.record` then ``await`` :meth:`AuditLog.flush`; every record pending at that moment
is written in one transaction (synchronous=FULL) on a single writer thread, and the handler answers
only once its record is durable. Under load one fsync covers many requests.

A batch that cannot be written (another process holds a lock on ``audit.db`` past the busy
timeout, a full disk) raises STORE_BUSY / STORE_UNAVAILABLE to the requests waiting for it, which
answer 503 rather than unaudited data; its records go back to the front of the queue and are
written with the next batch, so a later flush neither hangs nor loses them. Reads of the log run
on their own thread (:attr:`AuditLog.reader`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gateway.core.tokens import iso
from gateway.guard.db import DEFAULT_BUSY_TIMEOUT_SECONDS, DbWorker, connect, db_error

SCHEMA = """
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

COLUMNS = ("id", "ts", "timestamp", "session_id", "agent_id", "action", "key", "tags", "allowed", "reason",
           "detail", "request_size", "response_size", "query_count_remaining", "via")
MAX_AUDIT_PAGE = 1000


class AuditLog:
    def __init__(self, path: Path, *, retention_days: int = 90,
                 busy_timeout: float = DEFAULT_BUSY_TIMEOUT_SECONDS) -> None:
        self.path = path
        self.retention_days = retention_days
        self._read = connect(path, schema=SCHEMA, what="audit log", busy_timeout=busy_timeout)
        self._write = connect(path, schema=SCHEMA, what="audit log", busy_timeout=busy_timeout)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-writer")
        self.reader = DbWorker("audit-read", what="audit log")  # for_session / recent from the event loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, ...]] = []
        self._seq = 0  # records appended
        self._committed = 0  # records durable
        self._writer: asyncio.Task[None] | None = None

    def record(self, *, session_id: str, agent_id: str, action: str, allowed: bool, reason: str,
               key: str | None = None, tags: list[str] | None = None, detail: str | None = None,
               request_size: int | None = None, response_size: int | None = None,
               query_count_remaining: int | None = None, via: str | None = None,
               now: float | None = None) -> int:
        ts = time.time() if now is None else now
        row = ("log_" + secrets.token_hex(8), ts, iso(ts), session_id or "unknown", agent_id or "unknown", action,
               key, json.dumps(tags) if tags is not None else None, int(allowed), reason, detail,
               request_size, response_size, query_count_remaining, via)
        with self._lock:
            self._pending.append(row)
            self._seq += 1
            return self._seq

    def _write_batch(self, rows: list[tuple[Any, ...]]) -> None:
        conn = self._write
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(
                    f"INSERT INTO audit_logs ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                    rows)
                conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise db_error(exc, what="audit log") from exc

    def _requeue(self, rows: list[tuple[Any, ...]]) -> None:
        """A batch failed: its rows go back to the front, to be written with the next batch."""
        with self._lock:
            self._pending[:0] = rows

    def flush_sync(self) -> None:
        """flush() for threads other than the event loop's (the Auth Service's worker, shutdown)."""
        with self._lock:
            rows, self._pending = self._pending, []
            upto = self._seq
        if rows:
            try:
                self._executor.submit(self._write_batch, rows).result()
            except BaseException:
                self._requeue(rows)
                raise
        self._committed = max(self._committed, upto)

    async def flush(self) -> None:
        """Return once every record appended before this call is durable (group commit)."""
        target = self._seq
        while self._committed < target:
            if self._writer is None or self._writer.done():
                self._writer = asyncio.get_running_loop().create_task(self._drain())
            await asyncio.shield(self._writer)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                rows, self._pending = self._pending, []
                upto = self._seq
            if not rows:
                return
            try:
                await loop.run_in_executor(self._executor, self._write_batch, rows)
            except BaseException:
                self._requeue(rows)
                raise
            self._committed = max(self._committed, upto)

    # ----------------------------------------------------------------------------- reading

    def _rows(self, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        out = []
        for r in self._read.execute(sql, args).fetchall():
            d = {k: r[k] for k in r.keys() if k not in ("seq", "ts")}
            d["allowed"] = bool(d["allowed"])
            d["tags"] = json.loads(d["tags"]) if d["tags"] else None
            out.append({k: v for k, v in d.items() if v is not None})
        return out

    def for_session(self, session_id: str, *, limit: int = 100, agent_view: bool = True) -> list[dict[str, Any]]:
        """Newest first. The agent view omits the user-only ``detail`` and ``via`` columns."""
        limit = max(1, min(limit, MAX_AUDIT_PAGE))
        rows = self._rows("SELECT * FROM audit_logs WHERE session_id = ? ORDER BY seq DESC LIMIT ?",
                          (session_id, limit))
        if agent_view:
            for r in rows:
                r.pop("detail", None)
                r.pop("via", None)
        return rows

    def recent(self, *, limit: int = 100, session_id: str | None = None) -> list[dict[str, Any]]:
        if session_id:
            return self.for_session(session_id, limit=limit, agent_view=False)
        limit = max(1, min(limit, MAX_AUDIT_PAGE))
        return self._rows("SELECT * FROM audit_logs ORDER BY seq DESC LIMIT ?", (limit,))

    def purge(self, *, now: float | None = None) -> int:
        """Drop rows older than the retention (default 90 days, §18.3)."""
        cutoff = (time.time() if now is None else now) - self.retention_days * 86400
        cur = self._executor.submit(self._purge, cutoff).result()
        return cur

    def _purge(self, cutoff: float) -> int:
        cur = self._write.execute("DELETE FROM audit_logs WHERE ts < ?", (cutoff,))
        return int(cur.rowcount)

    def close(self) -> None:
        try:
            self.flush_sync()
        finally:
            self.reader.close()
            self._executor.shutdown(wait=True)
        self._read.close()
        self._write.close()
