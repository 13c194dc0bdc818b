"""Bulk writes into the Memory Store: :class:`BulkWriter` streams any number of items into ONE
``BEGIN IMMEDIATE`` transaction in chunks (the rules are in :mod:`gateway.guard.store`'s docstring,
"Bulk writes"); it is the SQLite implementation of :class:`~gateway.guard.storage.MemoryBulkWriting`.
Made by :meth:`MemoryStore.bulk_writer`, which hands it the store's :class:`BulkHandle` (its
connection, its lock and the slot naming the one open writer) and nothing else of the store; the
write side of imports, not the read path.
"""

from __future__ import annotations

import builtins
import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType

from gateway import sqldriver
from gateway.errors import ErrorCode, UompError
from gateway.guard.items import MemoryItem, Row, row_of

# Chunk size for ``key IN (...)`` look-ups: far below SQLite's bound-variable limit.
IN_CHUNK = 500
# Items a BulkWriter buffers before handing them to SQLite in one executemany.
BULK_CHUNK = 1000

_SQL_INSERT = (
    "INSERT INTO items (key, value, tags, sensitivity, source, created_at, updated_at, "
    "description) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_SQL_UPSERT = (
    "INSERT INTO items (key, value, tags, sensitivity, source, created_at, updated_at, "
    "description) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT(key) DO UPDATE SET value = excluded.value, tags = excluded.tags, "
    "sensitivity = excluded.sensitivity, source = excluded.source, "
    "created_at = excluded.created_at, updated_at = excluded.updated_at, "
    "description = excluded.description"
)


def _integrity(exc: Exception) -> UompError | None:
    """The INVALID_REQUEST for an insert over an existing key; None for any other constraint."""
    name = str(getattr(exc, "sqlite_errorname", ""))
    # SQLCipher's driver reports the primary result code only; its message names the constraint
    if name == "SQLITE_CONSTRAINT" and str(exc).startswith("UNIQUE constraint failed"):
        name = "SQLITE_CONSTRAINT_UNIQUE"
    if name in ("SQLITE_CONSTRAINT_PRIMARYKEY", "SQLITE_CONSTRAINT_UNIQUE"):
        return UompError(ErrorCode.INVALID_REQUEST, "an item with this key already exists (replace it explicitly)")
    return None


@dataclass(eq=False)
class BulkHandle:
    """What a :class:`BulkWriter` uses of its store. ``lock`` is the store's lock: the open writer
    holds it from ``__enter__`` to ``__exit__``, so the store's other threads wait. ``guarded()``
    holds it too and yields ``conn`` with every ``sqlite3`` failure turned into STORE_UNAVAILABLE.
    ``conn`` bare is for the ROLLBACK that must not raise. ``writer`` is the one open writer (None
    when there is none); the store refuses its own writes while it is set. ``seal`` turns a row as
    :func:`row_of` makes it into the row stored (the store's per-item sealing of high values)."""

    conn: sqlite3.Connection
    lock: threading.RLock
    guarded: Callable[[], AbstractContextManager[sqlite3.Connection]]
    writer: BulkWriter | None = None
    seal: Callable[[Row], Row] | None = None


class BulkWriter:
    """Items streamed into one transaction; made by :meth:`MemoryStore.bulk_writer` (see there)."""

    def __init__(self, handle: BulkHandle, *, replace: bool, dry_run: bool, chunk: int) -> None:
        self._handle = handle
        self.replace = replace
        self.dry_run = dry_run
        self._chunk = max(1, chunk)
        self._rows: builtins.list[Row] = []
        self._tags: builtins.list[tuple[str, str]] = []
        self._buffered_keys: set[str] = set()
        self._state = "new"  # new -> open -> committed | rolled_back
        self.written = 0  # items added (written when committed; validated only in a dry run)

    # ----------------------------------------------------------------- lifetime

    def __enter__(self) -> BulkWriter:
        if self._state != "new":
            raise RuntimeError("a BulkWriter is entered once")
        handle = self._handle
        handle.lock.acquire()
        try:
            if handle.writer is not None:
                raise RuntimeError("a bulk writer is already open on this memory store")
            with handle.guarded() as conn:
                if self.dry_run:
                    # A read transaction: one consistent snapshot for the look-ups, no write lock.
                    conn.execute("BEGIN")
                    conn.execute("SELECT count(*) FROM items WHERE key = ''").fetchone()
                else:
                    conn.execute("BEGIN IMMEDIATE")
            handle.writer = self
            self._state = "open"
        except BaseException:
            handle.lock.release()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        handle = self._handle
        try:
            if self._state == "open":
                self._rollback()
        finally:
            if handle.writer is self:
                handle.writer = None
                handle.lock.release()

    def _rollback(self) -> None:
        self._state = "rolled_back"
        self._drop_buffer()
        with contextlib.suppress(*sqldriver.ERRORS):
            self._handle.conn.execute("ROLLBACK")

    def _drop_buffer(self) -> None:
        self._rows.clear()
        self._tags.clear()
        self._buffered_keys.clear()

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"the bulk writer is {self._state.replace('_', ' ')}, not open")

    # ----------------------------------------------------------------- writing

    def add(self, item: MemoryItem) -> None:
        """Validate and queue one item. A bad item is INVALID_REQUEST and is not queued (the writer
        stays open: the caller decides whether to go on). Without ``replace`` an existing key, or one
        added twice, is INVALID_REQUEST when its chunk is written (see :meth:`flush`); with
        ``replace`` it is overwritten, the last one wins. In a dry run the item is only validated
        (use :meth:`existing` to look keys up)."""
        self._check_open()
        row = row_of(item)
        if self._handle.seal is not None:
            row = self._handle.seal(row)
        if self.dry_run:
            self.written += 1
            return
        if item.key in self._buffered_keys:
            self.flush()  # one key twice in one executemany would trip over its own tag rows
        self._rows.append(row)
        self._tags.extend((tag, item.key) for tag in item.tags)
        self._buffered_keys.add(item.key)
        self.written += 1
        if len(self._rows) >= self._chunk:
            self.flush()

    def flush(self) -> None:
        """Hand the queued items to SQLite now (still inside the open transaction). Any failure
        here (an existing key without ``replace``, disk full, ...) rolls the whole transaction back
        and ends the writer: a half-written chunk is never left behind to be committed."""
        self._check_open()
        if not self._rows:
            return
        rows, tags, keys = self._rows, self._tags, self._buffered_keys
        try:
            with self._handle.guarded() as conn:
                if self.replace:
                    conn.executemany("DELETE FROM item_tags WHERE item_key = ?", ((k,) for k in keys))
                    conn.executemany(_SQL_UPSERT, rows)
                else:
                    try:
                        conn.executemany(_SQL_INSERT, rows)
                    except sqldriver.INTEGRITY as exc:
                        refusal = _integrity(exc)
                        if refusal is not None:
                            raise refusal from exc
                        raise
                conn.executemany("INSERT INTO item_tags (tag, item_key) VALUES (?, ?)", tags)
        except BaseException:
            self._rollback()
            raise
        self._drop_buffer()

    def existing(self, keys: Iterable[str]) -> dict[str, str]:
        """Those of ``keys`` already in the store as this transaction sees it (the snapshot taken
        when the writer opened, plus what it has written), each with its ``created_at``."""
        self._check_open()
        if not self.dry_run:
            self.flush()
        found: dict[str, str] = {}
        with self._handle.guarded() as conn:
            for chunk in chunks(keys, IN_CHUNK):
                marks = ",".join("?" * len(chunk))
                found.update(
                    conn.execute(  # only "?" marks in the text
                        f"SELECT key, created_at FROM items WHERE key IN ({marks})", chunk
                    ).fetchall()
                )
        return found

    def commit(self) -> int:
        """Write what is queued and COMMIT; returns how many items were written. On failure the
        transaction is rolled back and STORE_UNAVAILABLE (or INVALID_REQUEST) raised."""
        self._check_open()
        if self.dry_run:
            raise RuntimeError("a dry-run bulk writer never commits")
        try:
            self.flush()
            with self._handle.guarded() as conn:
                conn.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        self._state = "committed"
        return self.written


def chunks(items: Iterable[str], size: int) -> Iterator[builtins.list[str]]:
    chunk: builtins.list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
