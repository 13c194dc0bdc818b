"""The Memory Store: the user's Memory Items (spec §11) in one SQLite file.

The SQLite implementation of the seam :class:`~gateway.guard.storage.MemoryStorage` (declared, with
the values that cross it, in :mod:`gateway.guard.storage`); the item rules are
:mod:`gateway.guard.items`, bulk writes :mod:`gateway.guard.bulk`. Longer than ~500 lines on
purpose: the read path every request takes (:meth:`MemoryStore.get_meta`, ``get``, tag pages,
aggregates) stays in one class next to the SQL it runs, with no extra layer of calls.

Layout (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`)::

    items(key PRIMARY KEY, value JSON text, tags JSON text (item order), sensitivity, source,
          created_at, updated_at, description)
    item_tags(tag, item_key) WITHOUT ROWID, primary key (tag, item_key)   -- by_tag is a range scan
    index item_tags_by_key(item_key)                                       -- delete / replace
    index items_meta(key, sensitivity, tags)    -- covering: a policy decision never reads a value
    items.version                 -- 1 for a new key; +1 on every change (triggers, any writer)
    item_versions(key, version)   -- every earlier state of a key; a deletion adds a tombstone; a rowid
                                     table, unique index on (key, version)
    history_settings              -- how many earlier versions a key keeps (0: all; the trim trigger
                                     runs only when bounded)
    proposals(proposal_id)        -- agents' staged changes (gateway/guard/proposals.py)

Reads for the Memory Guard (spec §10, §21) decide on metadata before any value is loaded:
:meth:`MemoryStore.get_meta` answers from the covering index ``items_meta`` alone (the value, which may
be a megabyte in overflow pages, is never touched), so a denied item and a missing key cost the same;
:meth:`MemoryStore.get` (the value) is called only after an allow and is counted in ``value_loads``.
Tag pages (:meth:`MemoryStore.tag_page`) and aggregates (:meth:`MemoryStore.aggregate`) apply the key
rules of a grant in SQL (:class:`ReadFilter`), so only authorized rows are read and nothing is
collected in Python lists: an aggregate over a million items runs in constant memory.

Durability and concurrency: WAL journal (readers never wait for the writer), ``synchronous=FULL``
(a write that returned is on disk), a busy timeout so a second writer waits a few seconds before
giving up, ``secure_delete`` so removed rows' bytes are overwritten in the file (a deleted item's
last version stays in ``item_versions`` until it is purged or ages out of the retention). The file is
created 0600; SQLite gives its ``-wal``/``-shm`` companions the same mode. One connection per store,
usable from any thread (``check_same_thread=False``), serialised by a lock; long reads (tag pages,
aggregates) use a second, query-only connection with its own lock, so a scan of a million items
never holds up a read by key or a write.

Values of ``sensitivity: high`` items are sealed per item when the store has the home's sealer
(:mod:`gateway.atrest.itemseal`): sealed on every write (:meth:`MemoryStore.seal_text`), opened
only when an item is handed out whole (:meth:`MemoryStore.open_text`), sealed on open where an older
writer left them in clear; numeric aggregates that would include one are refused
(``AGGREGATE_HIGH_SENSITIVITY``).

Failures: every ``sqlite3`` error (file missing with ``create=False``, locked past the timeout,
not a database, corrupt, disk full, I/O error, closed) becomes
``UompError(ErrorCode.STORE_UNAVAILABLE, <fixed sentence>)`` with the SQLite error name in
``details["reason"]``; no message ever carries a key or a value. A bad item (invalid key, tag,
sensitivity, source, timestamp or a value that is not JSON) is ``INVALID_REQUEST``, and so is a
``put`` on an existing key without ``replace``.

A file written by a newer schema version is refused (``STORE_UNAVAILABLE``) rather than
misread; a SQLite file that holds tables but no UOMP schema is refused rather than adopted.

Bulk writes: :meth:`MemoryStore.bulk_writer` streams any number of items into ONE ``BEGIN
IMMEDIATE`` transaction, in chunks, so memory does not grow with the number of items; nothing is
visible to anyone else until :meth:`BulkWriter.commit`, and leaving the ``with`` block without it
(or on any exception, or a crash / SIGKILL of the process) leaves the store exactly as it was.
While it is open: other connections (the running guard) keep reading the last committed state
(WAL); another writer waits up to the busy timeout and then gets STORE_UNAVAILABLE (SQLITE_BUSY);
other threads using this same ``MemoryStore`` wait for the writer to finish (the store's lock is
held); a write through this store from the writer's own thread is a programming error
(``RuntimeError``). :meth:`MemoryStore.put_many` is a bulk writer over a sequence.

Longer than ~500 lines on purpose: the read path every request takes stays in one class next to the
SQL it runs; the seam is gateway.guard.storage, the item rules gateway.guard.items, bulk writes
gateway.guard.bulk.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from gateway import jsonio, sqldriver
from gateway.atrest import itemseal, memdb
from gateway.atrest.itemseal import ItemSealer
from gateway.db import trim_wal
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.guard.bulk import BULK_CHUNK, BulkHandle, BulkWriter
from gateway.guard.items import MemoryItem, Row
from gateway.guard.storage import AggregateRow, Atom, ItemMeta, MemoryStorage, ReadFilter, currency_path

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4

MAX_LIST_LIMIT = 100_000
DEFAULT_BUSY_TIMEOUT_SECONDS = 5.0

_SCHEMA = f"""
CREATE TABLE items (
    key         TEXT NOT NULL PRIMARY KEY,
    value       TEXT NOT NULL,
    tags        TEXT NOT NULL,
    sensitivity TEXT NOT NULL CHECK (sensitivity IN ('low', 'medium', 'high')),
    source      TEXT NOT NULL CHECK (source IN ('user', 'agent')),
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL,
    description TEXT
);
CREATE TABLE item_tags (
    tag      TEXT NOT NULL,
    item_key TEXT NOT NULL REFERENCES items(key) ON DELETE CASCADE,
    PRIMARY KEY (tag, item_key)
) WITHOUT ROWID;
CREATE INDEX item_tags_by_key ON item_tags(item_key);
CREATE INDEX items_meta ON items(key, sensitivity, tags);
PRAGMA user_version = {SCHEMA_VERSION};
"""
# Version 1 -> 2: the covering metadata index (decide on metadata before loading a value).
_MIGRATE_1_TO_2 = "CREATE INDEX IF NOT EXISTS items_meta ON items(key, sensitivity, tags)"
# Version 2 -> 3: item versions and their history (every change keeps the state it replaced, in
# the same transaction, whichever path wrote it: triggers), and the agents' staged proposals.
# ``item_versions`` holds every earlier state of a key, by version; a deletion leaves the last state
# and a tombstone (``deleted`` 1, no value) one version above it, so a key re-created later goes on
# counting. ``history_settings`` holds how many earlier versions a key keeps (0: all).
# Version 3 -> 4 (:func:`_migrate_history`): ``item_versions`` is an ordinary rowid table (a row of a
# few KiB stays on its leaf page; in an index b-tree, as WITHOUT ROWID made it, any row over ~1 KB took
# an overflow page of its own), its primary key a unique index on (key, version); and the trim of old
# versions is a trigger of its own that runs only when the retention is bounded (with 0 nothing of the
# key's history is visited on a change). Triggers are dropped and recreated by every migration, so an
# existing file gets the current ones.
_ADD_VERSION = "ALTER TABLE items ADD COLUMN version INTEGER NOT NULL DEFAULT 1"
_VERSIONS_COLUMNS = """(
    key         TEXT NOT NULL,
    version     INTEGER NOT NULL,
    deleted     INTEGER NOT NULL DEFAULT 0,
    value       TEXT,
    tags        TEXT,
    sensitivity TEXT,
    source      TEXT,
    created_at  TEXT,
    updated_at  TEXT,
    description TEXT,
    replaced_at TEXT NOT NULL,
    PRIMARY KEY (key, version)
)"""
_VERSIONS_FIELDS = (
    "key, version, deleted, value, tags, sensitivity, source, created_at, updated_at, description, replaced_at"
)
_HISTORY_TRIGGERS = ("items_keep_update", "items_keep_trim", "items_keep_delete", "items_keep_insert")
_HISTORY_SQL = f"""
CREATE TABLE IF NOT EXISTS item_versions {_VERSIONS_COLUMNS};
CREATE TABLE IF NOT EXISTS history_settings (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    max_versions INTEGER NOT NULL CHECK (max_versions >= 0)
);
INSERT OR IGNORE INTO history_settings (id, max_versions) VALUES (1, 50);
CREATE TRIGGER IF NOT EXISTS items_keep_update AFTER UPDATE OF value, tags, sensitivity, source, created_at, updated_at,
    description ON items
BEGIN
    INSERT OR REPLACE INTO item_versions (key, version, deleted, value, tags, sensitivity, source,
        created_at, updated_at, description, replaced_at)
    VALUES (OLD.key, OLD.version, 0, OLD.value, OLD.tags, OLD.sensitivity, OLD.source, OLD.created_at,
        OLD.updated_at, OLD.description, strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
    UPDATE items SET version = OLD.version + 1 WHERE key = NEW.key;
END;
CREATE TRIGGER IF NOT EXISTS items_keep_trim AFTER UPDATE OF value, tags, sensitivity, source, created_at, updated_at,
    description ON items
    WHEN (SELECT max_versions FROM history_settings WHERE id = 1) > 0
BEGIN
    DELETE FROM item_versions WHERE key = OLD.key
        AND version <= OLD.version - (SELECT max_versions FROM history_settings WHERE id = 1);
END;
CREATE TRIGGER IF NOT EXISTS items_keep_delete BEFORE DELETE ON items
BEGIN
    INSERT OR REPLACE INTO item_versions (key, version, deleted, value, tags, sensitivity, source,
        created_at, updated_at, description, replaced_at)
    VALUES (OLD.key, OLD.version, 0, OLD.value, OLD.tags, OLD.sensitivity, OLD.source, OLD.created_at,
        OLD.updated_at, OLD.description, strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
    INSERT OR REPLACE INTO item_versions (key, version, deleted, replaced_at)
    VALUES (OLD.key, OLD.version + 1, 1, strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
END;
CREATE TRIGGER IF NOT EXISTS items_keep_insert AFTER INSERT ON items
    WHEN EXISTS (SELECT 1 FROM item_versions WHERE key = NEW.key)
BEGIN
    UPDATE items SET version = (SELECT max(version) FROM item_versions WHERE key = NEW.key) + 1
        WHERE key = NEW.key;
END;
CREATE TABLE IF NOT EXISTS proposals (
    proposal_id   TEXT NOT NULL PRIMARY KEY,
    session_id    TEXT NOT NULL,
    agent_id      TEXT NOT NULL,
    op            TEXT NOT NULL CHECK (op IN ('put', 'delete')),
    key           TEXT NOT NULL,
    value         TEXT,
    tags          TEXT,
    sensitivity   TEXT CHECK (sensitivity IS NULL OR sensitivity IN ('low', 'medium')),
    description   TEXT,
    base_version  INTEGER NOT NULL,
    size          INTEGER NOT NULL,
    status        TEXT NOT NULL CHECK (status IN ('pending', 'approved', 'rejected', 'withdrawn', 'expired',
                      'stale')),
    created_at    REAL NOT NULL,
    expires_at    REAL NOT NULL,
    decided_at    REAL,
    decided_by    TEXT,
    applied_version INTEGER,
    via           TEXT
);
CREATE INDEX IF NOT EXISTS proposals_by_session ON proposals(session_id, status);
CREATE INDEX IF NOT EXISTS proposals_by_agent ON proposals(agent_id, created_at);
CREATE INDEX IF NOT EXISTS proposals_by_status ON proposals(status, created_at);
"""


def _migrate_history(conn: sqlite3.Connection) -> None:
    """Inside the caller's transaction: the history tables and triggers as :data:`_HISTORY_SQL`
    states them, whatever an older file holds. The triggers are dropped and recreated; an
    ``item_versions`` that is WITHOUT ROWID is copied, every row, into a rowid table that then
    takes its name. One transaction: a crash at any point leaves the old file or the new one."""
    for name in _HISTORY_TRIGGERS:
        conn.execute(f"DROP TRIGGER IF EXISTS {name}")
    row = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'item_versions'").fetchone()
    if row is not None and "WITHOUT ROWID" in " ".join(str(row[0]).upper().split()):
        conn.execute("DROP TABLE IF EXISTS item_versions_new")
        conn.execute(f"CREATE TABLE item_versions_new {_VERSIONS_COLUMNS}")
        conn.execute(
            f"INSERT INTO item_versions_new ({_VERSIONS_FIELDS}) SELECT {_VERSIONS_FIELDS} FROM item_versions "
            "ORDER BY key, version"
        )
        fault_point("store.history_copied")
        conn.execute("DROP TABLE item_versions")
        conn.execute("ALTER TABLE item_versions_new RENAME TO item_versions")
    _script(conn, _HISTORY_SQL)
    fault_point("store.history_migrated")


_SQL_GET = "SELECT key, value, tags, sensitivity, source, created_at, updated_at, description FROM items WHERE key = ?"
_SQL_META = "SELECT tags, sensitivity FROM items INDEXED BY items_meta WHERE key = ?"
_SQL_LIST = (
    "SELECT key, value, tags, sensitivity, source, created_at, updated_at, description "
    "FROM items ORDER BY key LIMIT ? OFFSET ?"
)
_SQL_BY_TAG = (
    "SELECT i.key, i.value, i.tags, i.sensitivity, i.source, i.created_at, i.updated_at, "
    "i.description FROM item_tags t JOIN items i ON i.key = t.item_key "
    "WHERE t.tag = ? ORDER BY t.item_key LIMIT ? OFFSET ?"
)
# Items carrying :tag after :after, for a tag page (the grant's filter is appended).
_SQL_PAGE = (
    "SELECT i.key, i.value, i.tags, i.sensitivity, i.source, i.created_at, i.updated_at, "
    "i.description FROM item_tags t JOIN items i ON i.key = t.item_key "
    "WHERE t.tag = :tag AND t.item_key > :after"
)
_SQL_AGG_FROM = "SELECT count(*) FROM item_tags t JOIN items i ON i.key = t.item_key WHERE t.tag = :tag"
_SQL_AGG_NUM_FROM = (
    "FROM (SELECT json_extract(i.value, :path) AS x FROM item_tags t JOIN items i "
    "ON i.key = t.item_key WHERE t.tag = :tag "
    "AND json_type(i.value, :path) IN ('integer', 'real')"
)
_P = "2147483647"  # HASH_PRIME
_SQL_CURRENCIES = (
    "SELECT count(DISTINCT c), count(*) - count(c) FROM (SELECT json_extract(i.value, :cpath) AS c "
    "FROM item_tags t JOIN items i ON i.key = t.item_key WHERE t.tag = :tag "
    "AND json_type(i.value, :path) IN ('integer', 'real')"
)
_SQL_ATOMS_HEAD = (
    "WITH q AS (SELECT key AS bit, value AS tag FROM json_each(:tags)), "
    "m AS (SELECT t.item_key AS k, sum(1 << q.bit) AS pattern FROM q JOIN item_tags t ON t.tag = q.tag "
    "GROUP BY t.item_key) "
    f"SELECT m.pattern, count(*), sum(((i.rowid % {_P}) * :a + :b) % {_P}), @TOTAL@, "
    f"sum((((CAST(json_extract(i.value, :path) * 1000000 AS INTEGER) % {_P}) + {_P}) % {_P} "
    f"* (((i.rowid % {_P}) * :c + :d) % {_P})) % {_P}) "
    "FROM m JOIN items i ON i.key = m.k WHERE json_type(i.value, :path) IN ('integer', 'real')"
)
_SQL_ATOMS_TAIL = " GROUP BY m.pattern LIMIT :max"
# SQLite error name (prefix) -> the fixed sentence the user sees.
_REASONS: tuple[tuple[str, str], ...] = (
    ("SQLITE_BUSY", "the memory store is locked by another process; try again"),
    ("SQLITE_LOCKED", "the memory store is locked by another process; try again"),
    ("SQLITE_NOTADB", "the memory store file is not a SQLite database"),
    ("SQLITE_CORRUPT", "the memory store file is corrupt"),
    ("SQLITE_CANTOPEN", "the memory store file cannot be opened"),
    ("SQLITE_FULL", "the disk holding the memory store is full"),
    ("SQLITE_READONLY", "the memory store is read-only"),
    ("SQLITE_IOERR", "disk I/O error on the memory store"),
    ("SQLITE_CONSTRAINT", "the memory store refused the write"),
)


def _script(conn: sqlite3.Connection, text: str) -> None:
    """Run the statements of ``text`` one by one inside the caller's transaction (``executescript``
    would commit it first); a statement ends where SQLite says it is complete (triggers included)."""
    pending = ""
    for part in text.split(";"):
        pending += part + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                conn.execute(pending)
            pending = ""


def _item_of(row: tuple[Any, ...]) -> MemoryItem:
    key, value, tags, sensitivity, source, created_at, updated_at, description = row
    try:
        decoded_value = jsonio.loads(value)
        decoded_tags = jsonio.loads(tags)
    except (TypeError, ValueError) as exc:
        raise UompError(
            ErrorCode.STORE_UNAVAILABLE, "the memory store file is corrupt", details={"reason": "BAD_JSON"}
        ) from exc
    if not isinstance(decoded_tags, builtins.list):
        raise UompError(ErrorCode.STORE_UNAVAILABLE, "the memory store file is corrupt", details={"reason": "BAD_TAGS"})
    return MemoryItem(
        key=key,
        value=decoded_value,
        tags=tuple(decoded_tags),
        sensitivity=sensitivity,
        source=source,
        created_at=created_at,
        updated_at=updated_at,
        description=description,
    )


def _unavailable(exc: BaseException) -> UompError:
    if isinstance(exc, sqldriver.PROGRAMMING):
        return UompError(ErrorCode.STORE_UNAVAILABLE, "the memory store is closed", details={"reason": "CLOSED"})
    if isinstance(exc, OSError):
        return UompError(
            ErrorCode.STORE_UNAVAILABLE,
            "the memory store file cannot be created or opened",
            details={"reason": "OS_ERROR"},
        )
    name = str(getattr(exc, "sqlite_errorname", "") or type(exc).__name__)
    sentence = "the memory store is unavailable"
    for prefix, text in _REASONS:
        if name.startswith(prefix):
            sentence = text
            break
    else:
        # No error name (older SQLite bindings): fall back on the exception text's usual phrases.
        lowered = str(exc).lower()
        if "locked" in lowered or "busy" in lowered:
            sentence = _REASONS[0][1]
        elif "not a database" in lowered:
            sentence = _REASONS[2][1]
    log.warning("memory store failure: %s", name)
    return UompError(ErrorCode.STORE_UNAVAILABLE, sentence, details={"reason": name})


_ItemList = list[MemoryItem]


def _meta_of(row: Any) -> ItemMeta | None:
    if row is None:
        return None
    try:
        tags = jsonio.loads(row[0])
    except (TypeError, ValueError) as exc:
        raise UompError(
            ErrorCode.STORE_UNAVAILABLE, "the memory store file is corrupt", details={"reason": "BAD_JSON"}
        ) from exc
    if not isinstance(tags, builtins.list):
        raise UompError(ErrorCode.STORE_UNAVAILABLE, "the memory store file is corrupt", details={"reason": "BAD_TAGS"})
    return ItemMeta(tuple(tags), str(row[1]))


class MemoryStore(MemoryStorage):
    """The Memory Store (see the module docstring). Every method may raise STORE_UNAVAILABLE."""

    def __init__(
        self,
        path: Path,
        *,
        create: bool = True,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT_SECONDS,
        key: bytes | None = None,
        sealer: ItemSealer | None = None,
    ) -> None:
        """``key``: the file is a SQLCipher database under this 256-bit key (a sealed home's store,
        :func:`gateway.atrest.memdb.key_for`); None: a plain SQLite file. ``sealer``: the home's
        item sealer (:func:`gateway.atrest.itemseal.sealer_for`): high-sensitivity values are
        sealed per item on write, opened when an item is read whole, and those left in clear by
        an older store are sealed when it opens; None: values are stored as given and a sealed
        one does not open (``ITEM_SEAL_INVALID``)."""
        self.path = Path(path)
        self._key = key
        self._sealer = sealer
        self._lock = threading.RLock()
        self._closed = False
        self.value_loads = 0  # calls that read an item's value by key (see get_meta)
        self._busy_timeout = busy_timeout
        self._scan_lock = threading.RLock()
        self._scanner: sqlite3.Connection | None = None
        if not create and not self.path.exists():
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE, "the memory store file does not exist", details={"reason": "MISSING"}
            )
        conn: sqlite3.Connection | None = None
        # mode=rw: SQLite never creates the file itself (that is done below, 0600).
        uri = self.path.resolve().as_uri() + "?mode=rw"
        try:
            if create:
                self._create_file()
            conn = self._connect(uri)
            self._conn = conn
            self._bulk = BulkHandle(conn, self._lock, self._guard, seal=self._seal_row)
            self._setup(busy_timeout, create=create)
            if sealer is not None:
                self._seal_clear_values()
        except UompError:
            if conn is not None:
                conn.close()
            raise
        except sqldriver.errors(OSError) as exc:
            if conn is not None:
                with contextlib.suppress(*sqldriver.ERRORS):
                    conn.close()
            mismatch = None if key is None else memdb.profile_mismatch(uri, key, exc, "memory store")
            raise mismatch or _unavailable(exc) from exc

    # ----------------------------------------------------------------- opening

    def _connect(self, uri: str) -> sqlite3.Connection:
        """A connection to the file: SQLCipher under the store's key when it has one (a sealed home,
        gateway/atrest/memdb.py), else the standard library's SQLite."""
        kwargs: dict[str, Any] = {
            "uri": True,
            "timeout": self._busy_timeout,
            "isolation_level": None,
            "check_same_thread": False,
        }
        conn: sqlite3.Connection
        if self._key is None:
            conn = sqlite3.connect(uri, **kwargs)
        else:
            conn = memdb.connect(uri, self._key, **kwargs)
        return conn

    def _create_file(self) -> None:
        """The file, 0600, made if absent. An existing regular file is not opened beside SQLite
        (closing that descriptor would drop the POSIX locks this process's other connections hold
        on it): its mode is set by path. Anything else goes to the open below (a link: refused)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            if st.st_mode & 0o777 != 0o600:
                os.chmod(self.path, 0o600)
            return
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if os.fstat(fd).st_mode & 0o777 != 0o600:
                os.fchmod(fd, 0o600)
        finally:
            os.close(fd)

    def _setup(self, busy_timeout: float, *, create: bool) -> None:
        conn = self._conn
        conn.execute(f"PRAGMA busy_timeout = {max(0, int(busy_timeout * 1000))}")
        # Look before changing anything: a newer schema or someone else's database is refused
        # while the file is still exactly as we found it.
        self._refuse_foreign(self._version())
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE,
                "the memory store cannot use write-ahead logging",
                details={"reason": "NO_WAL"},
            )
        conn.execute("PRAGMA synchronous = FULL")
        trim_wal(conn, self.path)  # a killed import can leave a large -wal behind
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA secure_delete = ON")
        conn.execute("PRAGMA trusted_schema = OFF")
        if self._version() == SCHEMA_VERSION:
            return
        # Version 0: a new, empty file. Create the schema unless another process just did.
        # Version 1: add the covering metadata index.
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = self._version()
            self._refuse_foreign(version)
            if version == 0:
                if not create:
                    raise UompError(
                        ErrorCode.STORE_UNAVAILABLE,
                        "the memory store has not been initialised",
                        details={"reason": "EMPTY"},
                    )
                _script(conn, _SCHEMA)
                conn.execute(_ADD_VERSION)
                _script(conn, _HISTORY_SQL)
            else:
                if version == 1:
                    conn.execute(_MIGRATE_1_TO_2)
                # each step only where it is missing (a file may have been labelled older than it is)
                if not any(r[1] == "version" for r in conn.execute("PRAGMA table_info(items)")):
                    conn.execute(_ADD_VERSION)
                _migrate_history(conn)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(*sqldriver.ERRORS):
                conn.execute("ROLLBACK")
            raise

    def _refuse_foreign(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE,
                f"the memory store was written by a newer uomp (schema version {version}, this one "
                f"understands up to {SCHEMA_VERSION}); upgrade uomp, the file is left untouched",
                details={"reason": "SCHEMA_TOO_NEW", "schema_version": version},
            )
        if version < 0:
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE,
                "the memory store has an unknown schema version",
                details={"reason": "SCHEMA_UNKNOWN"},
            )
        if version == 0 and self._conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE,
                "the file is a SQLite database but not a UOMP memory store; it is left untouched",
                details={"reason": "FOREIGN_DB"},
            )

    def _version(self) -> int:
        return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    # ----------------------------------------------------------------- sealed values

    def seal_text(self, key: str, sensitivity: str, text: str) -> str:
        """The stored text of an item's value text: sealed when the store has a sealer and the item
        is high (:mod:`gateway.atrest.itemseal`); a value of another sensitivity carrying the
        sealed marker is refused (INVALID_REQUEST)."""
        if self._sealer is None:
            return itemseal.refuse_marker(key, text)
        return self._sealer.seal(key, sensitivity, text)

    def open_text(self, key: str, sensitivity: str, text: str) -> str:
        """The value text behind a stored text (a sealed blob opened, ``ITEM_SEAL_INVALID`` if it
        does not open here); call it only for a read the caller has authorized."""
        if self._sealer is None:
            return itemseal.open_without_sealer(key, text)
        return self._sealer.open(key, sensitivity, text)

    def _seal_row(self, row: Row) -> Row:
        key, value, tags, sensitivity, source, created_at, updated_at, description = row
        return (
            key,
            self.seal_text(key, sensitivity, value),
            tags,
            sensitivity,
            source,
            created_at,
            updated_at,
            description,
        )

    def _item(self, row: tuple[Any, ...]) -> MemoryItem:
        """An item row handed out whole: its value opened first."""
        if itemseal.is_sealed_text(row[1]):
            row = (row[0], self.open_text(row[0], row[3], row[1]), *row[2:])
        return _item_of(row)

    def _refuse_high_aggregate(self, conn: sqlite3.Connection, where: str, params: dict[str, Any]) -> None:
        """Numeric aggregates never include high items (sealed per item: SQL cannot read them, and
        spec §10.4/§11.3 let them out by key only): AGGREGATE_HIGH_SENSITIVITY when the authorized
        items of the tag include one. Metadata only (the covering index), no value read."""
        sql = _SQL_AGG_FROM + " AND i.sensitivity = 'high' AND " + where + " LIMIT 1"  # fixed text only
        if conn.execute(sql.replace("count(*)", "1", 1), params).fetchone() is not None:
            raise UompError(
                ErrorCode.AGGREGATE_HIGH_SENSITIVITY,
                "the items of this tag that the grant reaches include high-sensitivity ones, which are "
                "sealed one by one and read by key only: a sum, average, min or max cannot include them; "
                "leave their keys out of the grant, or ask op=count",
                details={"reason": "HIGH_SENSITIVITY_ITEMS"},
            )

    def _seal_clear_values(self) -> None:
        """Seal the high values left in clear (a store from before per-item sealing, or written
        without the item key), in ``items`` and ``item_versions``, in ONE transaction: a crash
        leaves every one of them as it was or every one sealed. Item versions and history are
        unchanged (what the update triggers add for the rewrite is taken back in the same
        transaction). Afterwards the ``-wal`` is checkpointed and truncated, so the clear values'
        old pages are gone from it (``secure_delete`` overwrites them in the file)."""
        sealer = self._sealer
        assert sealer is not None
        conn = self._conn
        clear = "sensitivity = 'high' AND value IS NOT NULL AND substr(value, 1, :n) != :prefix"
        args = {"n": len(itemseal.STORED_PREFIX), "prefix": itemseal.STORED_PREFIX}
        with self._guard():
            found = conn.execute(
                f"SELECT EXISTS (SELECT 1 FROM items WHERE {clear}) "
                f"OR EXISTS (SELECT 1 FROM item_versions WHERE {clear})",
                args,
            ).fetchone()[0]
            if not found:
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                keep = conn.execute("SELECT max_versions FROM history_settings WHERE id = 1").fetchone()
                conn.execute("UPDATE history_settings SET max_versions = 0 WHERE id = 1")  # no trimming meanwhile
                for key, value, version in conn.execute(
                    f"SELECT key, value, version FROM items WHERE {clear}", args
                ).fetchall():
                    conn.execute("UPDATE items SET value = ? WHERE key = ?", (sealer.seal(key, "high", value), key))
                    # the update trigger kept the clear state as a version and counted one more: undo both
                    conn.execute("DELETE FROM item_versions WHERE key = ? AND version >= ?", (key, version))
                    conn.execute("UPDATE items SET version = ? WHERE key = ?", (version, key))
                for key, version, value in conn.execute(
                    f"SELECT key, version, value FROM item_versions WHERE {clear}", args
                ).fetchall():
                    conn.execute(
                        "UPDATE item_versions SET value = ? WHERE key = ? AND version = ?",
                        (sealer.seal(key, "high", value), key, version),
                    )
                if keep is not None:
                    conn.execute("UPDATE history_settings SET max_versions = ? WHERE id = 1", (keep[0],))
                fault_point("atrest.items_sealed_before_commit")
                conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(*sqldriver.ERRORS):
                    conn.execute("ROLLBACK")
                raise
            with contextlib.suppress(*sqldriver.ERRORS):
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    # ----------------------------------------------------------------- plumbing

    @contextlib.contextmanager
    def _guard(self) -> Iterator[sqlite3.Connection]:
        """Hold the lock; turn every sqlite3 failure into STORE_UNAVAILABLE."""
        with self._lock:
            try:
                if self._closed:
                    raise sqlite3.ProgrammingError("closed")
                yield self._conn
            except sqldriver.errors(OSError) as exc:
                raise _unavailable(exc) from exc

    @contextlib.contextmanager
    def _scan(self) -> Iterator[sqlite3.Connection]:
        """A second, read-only connection for long reads (tag pages, aggregates), opened on first
        use: a scan over a million items holds it for seconds while key reads and writes go on on
        the main connection (WAL: readers never wait for the writer, nor it for them)."""
        with self._scan_lock:
            try:
                if self._closed:
                    raise sqlite3.ProgrammingError("closed")
                if self._scanner is None:
                    uri = self.path.resolve().as_uri() + "?mode=rw"
                    conn = self._connect(uri)
                    conn.execute(f"PRAGMA busy_timeout = {max(0, int(self._busy_timeout * 1000))}")
                    conn.execute("PRAGMA query_only = ON")
                    conn.execute("PRAGMA trusted_schema = OFF")
                    self._scanner = conn
                yield self._scanner
            except sqldriver.errors(OSError) as exc:
                raise _unavailable(exc) from exc

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction: committed on success, rolled back on any exception."""
        with self._guard() as conn:
            if self._bulk.writer is not None:
                raise RuntimeError("a bulk writer is open on this memory store: write through it")
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(*sqldriver.ERRORS):
                    conn.execute("ROLLBACK")
                raise

    def reading(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """The store's connection under its lock, for the modules that keep their own tables in this
        file (:mod:`gateway.guard.proposals`, :mod:`gateway.guard.history`); sqlite3 failures become
        STORE_UNAVAILABLE."""
        return self._guard()

    def writing(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction on the store's connection (committed on success,
        rolled back on any exception): an item change and its proposal's decision together."""
        return self._write()

    @staticmethod
    def _check_limit(limit: int, offset: int = 0) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= MAX_LIST_LIMIT:
            raise UompError(ErrorCode.INVALID_REQUEST, f"limit must be between 1 and {MAX_LIST_LIMIT}")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise UompError(ErrorCode.INVALID_REQUEST, "offset must be zero or more")

    # ----------------------------------------------------------------- reads

    def get(self, key: str) -> MemoryItem | None:
        """The whole item, value included (counted in ``value_loads``)."""
        with self._guard() as conn:
            self.value_loads += 1
            row = conn.execute(_SQL_GET, (key,)).fetchone()
        return self._item(row) if row is not None else None

    @contextlib.contextmanager
    def read_snapshot(self) -> Iterator[None]:
        """One read transaction on the scan connection: every scan inside sees the same state."""
        with self._scan() as conn:
            conn.execute("BEGIN")
            try:
                yield
            finally:
                with contextlib.suppress(*sqldriver.ERRORS):
                    conn.execute("COMMIT")

    def get_meta(self, key: str) -> ItemMeta | None:
        """Tags and sensitivity from the covering index ``items_meta``: the value is never read, so
        the work is the same for a small and a large item, and close to that for a missing key."""
        with self._guard() as conn:
            row = conn.execute(_SQL_META, (key,)).fetchone()
        return _meta_of(row)

    def get_if(self, key: str, allow: Callable[[ItemMeta | None], bool]) -> tuple[ItemMeta | None, MemoryItem | None]:
        """See :meth:`MemoryStorage.get_if`: one read transaction (one shared lock taken and let go,
        where two autocommit reads take two) and the value only after ``allow``."""
        with self._guard() as conn:
            own = not conn.in_transaction  # (inside a bulk write's transaction: read in that one)
            if own:
                conn.execute("BEGIN")
            try:
                meta = _meta_of(conn.execute(_SQL_META, (key,)).fetchone())
                if not allow(meta):
                    return meta, None
                self.value_loads += 1
                row = conn.execute(_SQL_GET, (key,)).fetchone()
            finally:
                if own:
                    with contextlib.suppress(*sqldriver.ERRORS):
                        conn.execute("COMMIT")
        return meta, (self._item(row) if row is not None else None)

    def tag_page(
        self, tag: str, flt: ReadFilter, *, after: str | None, limit: int, max_bytes: int
    ) -> tuple[_ItemList, bool]:
        """Up to ``limit`` items carrying ``tag`` that pass ``flt``, in key order, after the key
        ``after`` (keyset paging: stable while items come and go), stopping early once the page holds
        ``max_bytes`` of value and tag text (always at least one item). Returns the items and whether
        more follow. Memory: one page."""
        self._check_limit(limit)
        where, params = flt.sql()
        sql = _SQL_PAGE + " AND " + where + " ORDER BY t.item_key LIMIT :lim"  # fixed text only
        params.update({"tag": tag, "after": after if after is not None else "", "lim": limit + 1})
        out: _ItemList = []
        size = 0
        more = False
        with self._scan() as conn:
            cur = conn.execute(sql, params)
            try:
                for row in cur:
                    row_size = len(row[1]) + len(row[2])
                    if len(out) >= limit or (out and size + row_size > max_bytes):
                        more = True
                        break
                    out.append(self._item(row))
                    size += row_size
            finally:
                cur.close()
        return out, more

    def aggregate(self, tag: str, flt: ReadFilter, *, path: str | None) -> AggregateRow:
        """Over the items carrying ``tag`` that pass ``flt``, in SQL: their count (``path`` None), or
        count/sum/min/max of the JSON numbers at ``path`` (see :func:`json_path`; booleans, strings
        and absent fields do not contribute). Integer sums are exact; one past 64 bits falls back to
        a floating-point total. Constant memory whatever the number of items."""
        where, params = flt.sql()
        params["tag"] = tag
        if path is None:
            with self._scan() as conn:
                n = conn.execute(_SQL_AGG_FROM + " AND " + where, params).fetchone()[0]  # fixed text
            return AggregateRow(int(n))
        params["path"] = path
        body = _SQL_AGG_NUM_FROM + " AND " + where + ")"
        with self._scan() as conn:
            self._refuse_high_aggregate(conn, where, params)
            try:
                row = conn.execute("SELECT count(*), sum(x), min(x), max(x) " + body, params).fetchone()
            except sqldriver.OPERATIONAL as exc:
                if "overflow" not in str(exc).lower():
                    raise
                row = conn.execute("SELECT count(*), total(x), min(x), max(x) " + body, params).fetchone()
        return AggregateRow(int(row[0]), row[1], row[2], row[3])

    def currencies(self, tag: str, flt: ReadFilter, *, path: str) -> int:
        where, params = flt.sql()
        params["tag"] = tag
        with self._scan() as conn:
            self._refuse_high_aggregate(conn, where, params)  # before any numeric aggregate is answered
        cpath = currency_path(path)
        if cpath is None:
            return 0
        params.update({"path": path, "cpath": cpath})
        with self._scan() as conn:
            named, unnamed = conn.execute(_SQL_CURRENCIES + " AND " + where + ")", params).fetchone()  # fixed text
        named = int(named or 0)
        return named + (1 if named and unnamed else 0)

    def atoms(
        self, tags: Sequence[str], flt: ReadFilter, *, path: str, keys: tuple[int, int, int, int], max_atoms: int
    ) -> builtins.list[Atom] | None:
        """Partition the items that ``tags`` (at most 62) reach through ``flt`` and that hold a number
        at ``path`` by which of the tags they carry (see :class:`Atom`); ``keys`` are the secret
        multipliers of the keyed sums. None when there are more than ``max_atoms`` groups."""
        if not 0 < len(tags) <= 62:
            raise ValueError("between 1 and 62 tags")
        where, params = flt.sql()
        a, b, c, d = keys
        params.update(
            {"tags": json.dumps(list(tags)), "path": path, "a": a, "b": b, "c": c, "d": d, "max": max_atoms + 1}
        )
        sql = _SQL_ATOMS_HEAD + " AND " + where + _SQL_ATOMS_TAIL  # fixed text only
        with self._scan() as conn:
            try:
                rows = conn.execute(sql.replace("@TOTAL@", "sum(json_extract(i.value, :path))"), params).fetchall()
            except sqldriver.OPERATIONAL as exc:
                if "overflow" not in str(exc).lower():
                    raise
                rows = conn.execute(sql.replace("@TOTAL@", "total(json_extract(i.value, :path))"), params).fetchall()
        if len(rows) > max_atoms:
            return None
        return [Atom(int(r[0]), int(r[1]), int(r[2]), int(r[4]), r[3]) for r in rows]

    def by_tag(self, tag: str, *, limit: int = 1000) -> _ItemList:
        """Items carrying ``tag``, ordered by key (an index range scan on item_tags)."""
        return self.list(tag=tag, limit=limit)

    def list(self, *, tag: str | None = None, limit: int = 100, offset: int = 0) -> _ItemList:
        """Items ordered by key, optionally only those carrying ``tag``."""
        self._check_limit(limit, offset)
        with self._guard() as conn:
            if tag is None:
                rows = conn.execute(_SQL_LIST, (limit, offset)).fetchall()
            else:
                rows = conn.execute(_SQL_BY_TAG, (tag, limit, offset)).fetchall()
        return [self._item(r) for r in rows]

    def count(self) -> int:
        with self._guard() as conn:
            return int(conn.execute("SELECT count(*) FROM items").fetchone()[0])

    # ----------------------------------------------------------------- writes

    def put(self, item: MemoryItem, *, replace: bool = False) -> None:
        """Store one item. An existing key is INVALID_REQUEST unless ``replace``."""
        self.put_many([item], replace=replace)

    def put_many(self, items: Sequence[MemoryItem], *, replace: bool = False) -> int:
        """Store ``items`` in ONE transaction: all of them or none. Returns how many were written.

        A :meth:`bulk_writer` over the sequence: rows are validated and encoded as they stream into
        SQLite (no second copy of a large batch); a bad item anywhere rolls everything back.
        """
        keys = {item.key for item in items}
        if len(keys) != len(items):
            raise UompError(ErrorCode.INVALID_REQUEST, "the same key appears twice in one write")
        if not items:
            return 0
        with self.bulk_writer(replace=replace) as writer:
            for item in items:
                writer.add(item)
            return writer.commit()

    def bulk_writer(self, *, replace: bool = False, dry_run: bool = False, chunk: int = BULK_CHUNK) -> BulkWriter:
        """A context manager streaming items into ONE transaction (``BEGIN IMMEDIATE`` on entry)::

            with store.bulk_writer(replace=False) as w:
                for item in items:
                    w.add(item)        # queued; every ``chunk`` items go to SQLite (executemany)
                w.commit()             # without this, leaving the block rolls everything back

        Memory is one chunk, whatever the number of items. Leaving the block without ``commit()``,
        an exception, or the process dying leaves the store exactly as it was. ``existing(keys)``
        looks keys up inside the transaction. ``dry_run``: items are validated but never written,
        the transaction is a read snapshot (no write lock taken), ``commit()`` is refused.
        Concurrency while it is open: see the module docstring.
        """
        return BulkWriter(self._bulk, replace=replace, dry_run=dry_run, chunk=chunk)

    def delete(self, key: str) -> bool:
        """Remove ``key``; False when there was no such item."""
        with self._write() as conn:
            conn.execute("DELETE FROM item_tags WHERE item_key = ?", (key,))
            cur = conn.execute("DELETE FROM items WHERE key = ?", (key,))
            return cur.rowcount > 0

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(*sqldriver.ERRORS):
                self._conn.close()
        with self._scan_lock:
            if self._scanner is not None:
                with contextlib.suppress(*sqldriver.ERRORS):
                    self._scanner.close()
                self._scanner = None

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
