"""The history tables' shape and cost: keep-all retention visits nothing of a key's history on a
change, a kept 1 KiB version costs about its size on disk, and a schema-3 store (WITHOUT ROWID
``item_versions``, the trim inside ``items_keep_update``) is migrated in one transaction, history
kept, a kill -9 at any point leaving the old file or the new one. Real SQLite files, real processes."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.guard import store as store_mod
from gateway.guard.history import set_retention
from gateway.guard.items import MemoryItem
from gateway.guard.store import SCHEMA_VERSION, MemoryStore

TS = "2026-07-12T10:00:00Z"
KIB = "x" * 1024

# The history part of schema 3 exactly as the previous release created it (the fixture of an old file).
_V3_HISTORY = """
CREATE TABLE item_versions (
    key TEXT NOT NULL, version INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0, value TEXT, tags TEXT,
    sensitivity TEXT, source TEXT, created_at TEXT, updated_at TEXT, description TEXT, replaced_at TEXT NOT NULL,
    PRIMARY KEY (key, version)
) WITHOUT ROWID;
CREATE TABLE history_settings (
    id INTEGER PRIMARY KEY CHECK (id = 1), max_versions INTEGER NOT NULL CHECK (max_versions >= 0)
);
INSERT INTO history_settings (id, max_versions) VALUES (1, 0);
CREATE TRIGGER items_keep_update AFTER UPDATE OF value, tags, sensitivity, source, created_at, updated_at,
    description ON items
BEGIN
    INSERT OR REPLACE INTO item_versions (key, version, deleted, value, tags, sensitivity, source,
        created_at, updated_at, description, replaced_at)
    VALUES (OLD.key, OLD.version, 0, OLD.value, OLD.tags, OLD.sensitivity, OLD.source, OLD.created_at,
        OLD.updated_at, OLD.description, strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
    UPDATE items SET version = OLD.version + 1 WHERE key = NEW.key;
    DELETE FROM item_versions WHERE key = OLD.key
        AND (SELECT max_versions FROM history_settings WHERE id = 1) > 0
        AND version <= OLD.version - (SELECT max_versions FROM history_settings WHERE id = 1);
END;
CREATE TRIGGER items_keep_delete BEFORE DELETE ON items
BEGIN
    INSERT OR REPLACE INTO item_versions (key, version, deleted, value, tags, sensitivity, source,
        created_at, updated_at, description, replaced_at)
    VALUES (OLD.key, OLD.version, 0, OLD.value, OLD.tags, OLD.sensitivity, OLD.source, OLD.created_at,
        OLD.updated_at, OLD.description, strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
    INSERT OR REPLACE INTO item_versions (key, version, deleted, replaced_at)
    VALUES (OLD.key, OLD.version + 1, 1, strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
END;
CREATE TRIGGER items_keep_insert AFTER INSERT ON items
    WHEN EXISTS (SELECT 1 FROM item_versions WHERE key = NEW.key)
BEGIN
    UPDATE items SET version = (SELECT max(version) FROM item_versions WHERE key = NEW.key) + 1
        WHERE key = NEW.key;
END;
CREATE TABLE proposals (proposal_id TEXT NOT NULL PRIMARY KEY, session_id TEXT NOT NULL, agent_id TEXT NOT NULL,
    op TEXT NOT NULL, key TEXT NOT NULL, value TEXT, tags TEXT, sensitivity TEXT, description TEXT,
    base_version INTEGER NOT NULL, size INTEGER NOT NULL, status TEXT NOT NULL, created_at REAL NOT NULL,
    expires_at REAL NOT NULL, decided_at REAL, decided_by TEXT, applied_version INTEGER, via TEXT);
"""


def _change(conn: sqlite3.Connection, key: str, j: int, value: str = "v") -> None:
    conn.execute("UPDATE items SET value = ?, updated_at = ? WHERE key = ?", (f'"{value}{j}"', TS, key))


def _steps(store: MemoryStore, work: Callable[[sqlite3.Connection], None]) -> int:
    """SQLite VM instructions run by ``work`` (triggers included): the work, not the time."""
    count = [0]

    def tick() -> int:
        count[0] += 1
        return 0

    with store.writing() as conn:
        conn.set_progress_handler(tick, 1)
        try:
            work(conn)
        finally:
            conn.set_progress_handler(None, 1)
    return count[0]


def _changes(store: MemoryStore, key: str, start: int, n: int, value: str = "v") -> None:
    with store.writing() as conn:
        for j in range(start, start + n):
            _change(conn, key, j, value)


def _seed(store: MemoryStore, key: str = "k") -> None:
    store.put(MemoryItem(key, "v0", ("t",), "low", "user", TS, TS))


def _v3_file(path: Path, changes: int, value: str = "v") -> list[tuple[object, ...]]:
    """A schema-3 store with one item ``k`` changed ``changes`` times (all kept); its history rows."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    for text in (store_mod._SCHEMA, store_mod._ADD_VERSION + ";", _V3_HISTORY):
        pending = ""
        for part in text.split(";"):
            pending += part + ";"
            if sqlite3.complete_statement(pending):
                if pending.strip(" \n;"):
                    conn.execute(pending)
                pending = ""
    conn.execute("PRAGMA user_version = 3")
    conn.execute(
        "INSERT INTO items (key, value, tags, sensitivity, source, created_at, updated_at) "
        "VALUES ('k', '\"v0\"', '[\"t\"]', 'low', 'user', ?, ?)",
        (TS, TS),
    )
    conn.execute("INSERT INTO item_tags VALUES ('t', 'k')")
    for j in range(1, changes + 1):
        _change(conn, "k", j, value)
    conn.execute("COMMIT")
    rows = conn.execute("SELECT * FROM item_versions ORDER BY key, version").fetchall()
    conn.close()
    return rows


def _history(path: Path) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT * FROM item_versions ORDER BY key, version").fetchall()
    finally:
        conn.close()


def _table_sql(path: Path, name: str) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (name,)).fetchone()
        return "" if row is None else str(row[0])
    finally:
        conn.close()


def _flat_then(store: MemoryStore, key: str, kept: int) -> tuple[int, int]:
    """VM steps of one change with ``kept`` versions behind it, then with ten times as many."""
    first = _steps(store, lambda c: _change(c, key, 10**6))
    _changes(store, key, 0, 9 * kept)
    return first, _steps(store, lambda c: _change(c, key, 10**6 + 1))


# ----------------------------------------------------------------------------- keep-all cost


def test_a_change_under_keep_all_costs_the_same_with_ten_times_the_history(tmp_path: Path) -> None:
    with MemoryStore(tmp_path / "m.db") as store:
        set_retention(store, 0)
        _seed(store)
        _changes(store, "k", 1, 300)
        first, later = _flat_then(store, "k", 300)
        with store.reading() as conn:
            assert conn.execute("SELECT count(*) FROM item_versions").fetchone()[0] == 9 * 300 + 300 + 2
        # a scan of the key's versions would make the second ~10x the first
        assert later < first * 1.3, (first, later)


def test_bounded_retention_still_trims_and_stays_flat(tmp_path: Path) -> None:
    with MemoryStore(tmp_path / "m.db") as store:
        set_retention(store, 5)
        _seed(store)
        _changes(store, "k", 1, 300)
        first, later = _flat_then(store, "k", 300)
        with store.reading() as conn:
            versions = [r[0] for r in conn.execute("SELECT version FROM item_versions WHERE key = 'k' ORDER BY 1")]
            current = conn.execute("SELECT version FROM items WHERE key = 'k'").fetchone()[0]
        assert versions == list(range(current - 5, current))
        assert later < first * 1.3, (first, later)


def test_switching_keep_all_to_bounded_trims_the_backlog_at_the_next_change(tmp_path: Path) -> None:
    with MemoryStore(tmp_path / "m.db") as store:
        set_retention(store, 0)
        _seed(store)
        _changes(store, "k", 1, 100)
        set_retention(store, 3)
        _changes(store, "k", 101, 1)
        with store.reading() as conn:
            assert conn.execute("SELECT count(*) FROM item_versions").fetchone()[0] == 3
        set_retention(store, 0)
        _changes(store, "k", 102, 10)
        with store.reading() as conn:
            assert conn.execute("SELECT count(*) FROM item_versions").fetchone()[0] == 13


# ----------------------------------------------------------------------------- bytes per version


def _bytes(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return int(conn.execute("PRAGMA page_count").fetchone()[0]) * int(
            conn.execute("PRAGMA page_size").fetchone()[0]
        )
    finally:
        conn.close()


@pytest.mark.parametrize("size", [60, 1024, 3000])
def test_a_kept_version_costs_under_twice_its_value_on_disk(tmp_path: Path, size: int) -> None:
    path = tmp_path / "m.db"
    n = 400
    with MemoryStore(path) as store:
        set_retention(store, 0)
        _seed(store)
        before = _bytes(path)
        _changes(store, "k", 1, n, "x" * size)
    per_version = (_bytes(path) - before) / n
    assert per_version < 2 * (size + 100), per_version  # the row's other fields: ~100 B


# ----------------------------------------------------------------------------- migration


def test_a_schema_3_store_gets_the_rowid_table_and_the_new_triggers_with_its_history(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    old = _v3_file(path, 200, KIB)
    assert "WITHOUT ROWID" in _table_sql(path, "item_versions")
    with MemoryStore(path, create=False) as store:
        with store.reading() as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            assert conn.execute("SELECT max_versions FROM history_settings").fetchone()[0] == 0
        assert _history(path) == old  # every version, every field
        assert "WITHOUT ROWID" not in _table_sql(path, "item_versions").upper()
        assert "DELETE FROM" not in _table_sql(path, "items_keep_update").upper()
        assert "max_versions" in _table_sql(path, "items_keep_trim")
        first, later = _flat_then(store, "k", 200)
        assert later < first * 1.3, (first, later)
        with store.reading() as conn:
            top = conn.execute("SELECT max(version) FROM item_versions").fetchone()[0]
            assert conn.execute("SELECT version FROM items").fetchone()[0] == top + 1 == 200 + 1800 + 3
        set_retention(store, 4)  # the migrated file still trims when bounded
        _changes(store, "k", 0, 1)
        assert len(_history(path)) == 4
    with MemoryStore(path, create=False) as store:  # opened again: nothing left to migrate
        assert store.get("k") is not None


def test_a_schema_3_store_keeps_deletions_and_recreation_counting(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    _v3_file(path, 3)
    with MemoryStore(path, create=False) as store:
        store.delete("k")
        store.put(MemoryItem("k", "again", ("t",), "low", "user", TS, TS))
        with store.reading() as conn:
            assert conn.execute("SELECT version FROM items").fetchone()[0] == 6
            tomb = conn.execute("SELECT deleted FROM item_versions WHERE version = 5").fetchone()
        assert tomb == (1,)


_OPEN = "import sys; from gateway.guard.store import MemoryStore; MemoryStore(__import__('pathlib').Path(sys.argv[1]))"


@pytest.mark.parametrize("point", ["store.history_copied", "store.history_migrated"])
def test_a_kill_during_the_migration_leaves_the_old_file_then_migrates(tmp_path: Path, point: str) -> None:
    path = tmp_path / "m.db"
    old = _v3_file(path, 50, KIB)
    arm = tmp_path / "arm"
    arm.touch()
    env = {**os.environ, "UOMP_FAULT": point, "UOMP_FAULT_ARM": str(arm)}
    proc = subprocess.run([sys.executable, "-c", _OPEN, str(path)], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not arm.exists()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    finally:
        conn.close()
    assert "item_versions_new" not in names and "items_keep_trim" not in names
    assert "WITHOUT ROWID" in _table_sql(path, "item_versions")
    assert _history(path) == old
    with MemoryStore(path, create=False) as store:
        with store.reading() as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert _history(path) == old
    assert "WITHOUT ROWID" not in _table_sql(path, "item_versions").upper()


def test_a_sealed_schema_3_store_is_migrated_under_its_key(tmp_path: Path) -> None:
    """The SQLCipher store (a sealed home) runs the same migration, inside the encrypted file."""
    from gateway.atrest import memdb
    from gateway.config import Paths
    from gateway.guard import history

    paths = Paths(tmp_path)
    old = _v3_file(paths.memory_db, 20, KIB)
    key = bytes(range(32))
    assert memdb.ensure_encrypted(paths, key) and not memdb.is_plaintext(paths.memory_db)
    with MemoryStore(paths.memory_db, key=key) as sealed:
        with sealed.reading() as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
            sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'item_versions'").fetchone()[0]
            assert "WITHOUT ROWID" not in str(sql).upper()
            assert conn.execute("SELECT * FROM item_versions ORDER BY key, version").fetchall() == old
        assert [e["version"] for e in history.history(sealed, "k")][:3] == [21, 20, 19]
        first, later = _flat_then(sealed, "k", 20)
        assert later < first * 1.3, (first, later)
