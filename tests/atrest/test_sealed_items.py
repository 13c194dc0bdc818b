"""High-sensitivity items sealed per item (gateway/atrest/itemseal.py) in a plain and in a sealed
home: memory.db (even decrypted with its SQLCipher key) never holds a high value in clear, history
rows and rollback keep the sealed blob, authorized reads open it; a blob moved to another key,
relabelled, from another home or read without the item key is ITEM_SEAL_INVALID; numeric aggregates
over high items are AGGREGATE_HIGH_SENSITIVITY (count and the aggregates that leave them out are
answered); an old store's clear high values are sealed when it opens, in one transaction (kill -9
before its commit leaves the old store whole); export and import."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from test_sealed_keys import FAST, PASSPHRASE, make_home

from gateway.atrest import itemseal, memdb, migrate, vault
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError
from gateway.guard import exchange, history
from gateway.guard.store import MemoryItem, MemoryStore, ReadFilter
from gateway.guard.stores import open_user_store

REPO = Path(__file__).resolve().parents[2]
TS = "2026-01-01T00:00:00Z"
HIGH_MARK = "high-marker-31c7e0"
HIGH_OLD = "high-old-marker-9a4b"
LOW_MARK = "low-marker-77d2aa"


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()


def home(kind: str) -> Paths:
    paths = make_home()
    if kind == "sealed":
        migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    return paths


def some_items() -> list[MemoryItem]:
    return [
        MemoryItem("bank.pin", {"pin": HIGH_MARK, "amount": 7}, ("bank",), "high", "user", TS, TS),
        MemoryItem("bank.note", {"note": LOW_MARK, "amount": 5}, ("bank",), "low", "user", TS, TS),
        MemoryItem("bank.other", {"amount": 3}, ("bank",), "medium", "user", TS, TS),
        MemoryItem("bank.more", {"amount": 4}, ("bank",), "low", "user", TS, TS),
    ]


def file_bytes(db: Path) -> bytes:
    return b"".join(Path(str(db) + s).read_bytes() for s in ("", "-wal") if Path(str(db) + s).exists())


def decrypted_bytes(paths: Paths, tmp: Path) -> bytes:
    """memory.db as a plain SQLite file (for a sealed home: exported with its SQLCipher key)."""
    key = memdb.key_for(paths)
    if key is None:
        return file_bytes(paths.memory_db)
    out = tmp / f"plain-{os.urandom(4).hex()}.db"
    conn = memdb.connect(str(paths.memory_db), key)
    try:
        conn.execute("ATTACH DATABASE ? AS p KEY ''", (str(out),))
        conn.execute("SELECT sqlcipher_export('p')").fetchall()
        conn.execute("DETACH DATABASE p")
    finally:
        conn.close()
    return out.read_bytes()


def raw(paths: Paths) -> sqlite3.Connection | object:
    key = memdb.key_for(paths)
    if key is None:
        return sqlite3.connect(paths.memory_db, isolation_level=None)
    return memdb.connect(str(paths.memory_db), key, isolation_level=None)


def stored_value(paths: Paths, key: str) -> str:
    conn = raw(paths)
    try:
        return str(conn.execute("SELECT value FROM items WHERE key = ?", (key,)).fetchone()[0])  # type: ignore[attr-defined]
    finally:
        conn.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["plain", "sealed"])
def test_high_values_are_sealed_in_the_file_and_open_on_an_authorized_read(kind: str, tmp_path: Path) -> None:
    paths = home(kind)
    with open_user_store(paths) as store:
        store.put_many(some_items())
        changed = MemoryItem("bank.pin", {"pin": HIGH_MARK + "-v2"}, ("bank",), "high", "user", TS, TS)
        store.put(changed, replace=True)  # the first version goes to item_versions
        got = store.get("bank.pin")
        assert got is not None and got.value == {"pin": HIGH_MARK + "-v2"}
        _meta, item = store.get_if("bank.pin", lambda m: m is not None)
        assert item is not None and item.value["pin"] == HIGH_MARK + "-v2"
        flt = ReadFilter(keys=("bank.pin",))
        page, _ = store.tag_page("bank", flt, after=None, limit=10, max_bytes=1 << 20)
        assert {i.key: i.value for i in page}["bank.pin"] == {"pin": HIGH_MARK + "-v2"}
        # history: the earlier version is a sealed blob in item_versions, opened for the user
        versions = history.history(store, "bank.pin")
        assert [v["value"] for v in versions] == [{"pin": HIGH_MARK + "-v2"}, {"pin": HIGH_MARK, "amount": 7}]
        # rollback copies the sealed blob back; it opens where it lands
        history.rollback(store, "bank.pin", versions[1]["version"])
        back = store.get("bank.pin")
        assert back is not None and back.value == {"pin": HIGH_MARK, "amount": 7}
        assert [i.key for i in store.list()] == ["bank.more", "bank.note", "bank.other", "bank.pin"]
    assert itemseal.is_sealed_text(stored_value(paths, "bank.pin"))
    assert not itemseal.is_sealed_text(stored_value(paths, "bank.note"))
    data = decrypted_bytes(paths, tmp_path)
    assert HIGH_MARK.encode() not in data
    assert LOW_MARK.encode() in data  # the partner: a low value is there to be found once decrypted
    assert HIGH_MARK.encode() not in file_bytes(paths.memory_db)


def test_a_moved_relabelled_or_foreign_blob_does_not_open(tmp_path: Path) -> None:
    paths = home("plain")
    with open_user_store(paths) as store:
        store.put_many(some_items())
        store.put(MemoryItem("bank.pin2", {"pin": "x"}, ("bank",), "high", "user", TS, TS))
    blob = stored_value(paths, "bank.pin")
    conn = sqlite3.connect(paths.memory_db, isolation_level=None)
    conn.execute("UPDATE items SET value = ? WHERE key = 'bank.pin2'", (blob,))  # moved to another key
    conn.execute("UPDATE items SET sensitivity = 'medium' WHERE key = 'bank.pin'")  # relabelled
    conn.close()
    with open_user_store(paths) as store:
        for key, reason in (("bank.pin2", "AUTHENTICATION_FAILED"), ("bank.pin", "SEALED_BUT_NOT_HIGH")):
            with pytest.raises(UompError) as ei:
                store.get(key)
            assert ei.value.code is ErrorCode.ITEM_SEAL_INVALID and ei.value.details == {"reason": reason}
            assert HIGH_MARK not in ei.value.message
        # the partner: an untouched item of the same store reads
        other = store.get("bank.note")
        assert other is not None and other.value["note"] == LOW_MARK
    conn = sqlite3.connect(paths.memory_db, isolation_level=None)
    conn.execute("UPDATE items SET sensitivity = 'high' WHERE key = 'bank.pin'")
    conn.close()
    with open_user_store(paths) as store:
        assert store.get("bank.pin") is not None  # labelled back: it opens again
    # another home's item key does not open this home's blobs
    other_home = home("plain")
    shutil.copy(paths.memory_db, other_home.memory_db)
    with open_user_store(other_home) as store, pytest.raises(UompError) as ei:
        store.get("bank.pin")
    assert ei.value.code is ErrorCode.ITEM_SEAL_INVALID
    # and a store opened without the item key does not pretend
    with MemoryStore(paths.memory_db) as bare, pytest.raises(UompError) as ei:
        bare.get("bank.pin")
    assert ei.value.details == {"reason": "NO_ITEM_KEY"}


def test_numeric_aggregates_refuse_high_items_and_count_or_a_grant_without_them_answer() -> None:
    paths = home("plain")
    with open_user_store(paths) as store:
        store.put_many(some_items())
        with_high = ReadFilter(keys=("bank.pin",))
        without = ReadFilter()
        for call in (
            lambda: store.aggregate("bank", with_high, path="$.amount"),
            lambda: store.currencies("bank", with_high, path="$.amount"),
        ):
            with pytest.raises(UompError) as ei:
                call()
            assert ei.value.code is ErrorCode.AGGREGATE_HIGH_SENSITIVITY
        assert store.aggregate("bank", with_high, path=None).count == 4  # count reads no value
        row = store.aggregate("bank", without, path="$.amount")  # high left out by the grant's key rules
        assert (row.count, row.total) == (3, 12)
        assert store.currencies("bank", without, path="$.amount") == 0


def test_a_low_value_carrying_the_sealed_marker_is_refused_and_a_high_one_is_sealed() -> None:
    paths = home("plain")
    tricky = itemseal.MARKER + "AAAA"
    with open_user_store(paths) as store:
        with pytest.raises(UompError) as ei:
            store.put(MemoryItem("a.low", tricky, ("t",), "low", "user", TS, TS))
        assert ei.value.code is ErrorCode.INVALID_REQUEST
        assert store.get("a.low") is None
        store.put(MemoryItem("a.high", tricky, ("t",), "high", "user", TS, TS))
        got = store.get("a.high")
        assert got is not None and got.value == tricky


def _old_store(paths: Paths) -> None:
    """A store as written before per-item sealing: high values in clear, in items and history."""
    with MemoryStore(paths.memory_db, key=memdb.key_for(paths)) as old:
        old.put_many(some_items())
        old.put(MemoryItem("bank.pin", {"pin": HIGH_OLD}, ("bank",), "high", "user", TS, TS), replace=True)
        old.put(MemoryItem("bank.pin", {"pin": HIGH_MARK}, ("bank",), "high", "user", TS, TS), replace=True)


def _versions(paths: Paths) -> tuple[list[tuple[str, int]], list[tuple[str, int, int]]]:
    conn = raw(paths)
    try:
        items = conn.execute("SELECT key, version FROM items ORDER BY key").fetchall()  # type: ignore[attr-defined]
        hist = conn.execute(  # type: ignore[attr-defined]
            "SELECT key, version, deleted FROM item_versions ORDER BY key, version"
        ).fetchall()
        return [tuple(r) for r in items], [tuple(r) for r in hist]
    finally:
        conn.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["plain", "sealed"])
def test_an_old_store_is_sealed_when_it_opens_versions_and_history_unchanged(kind: str, tmp_path: Path) -> None:
    paths = home(kind)
    _old_store(paths)
    before = _versions(paths)
    assert HIGH_OLD.encode() in decrypted_bytes(paths, tmp_path)  # the partner: in clear before
    with open_user_store(paths) as store:
        got = store.get("bank.pin")
        assert got is not None and got.value == {"pin": HIGH_MARK}
        assert [v["value"] for v in history.history(store, "bank.pin")][1:] == [
            {"pin": HIGH_OLD},
            {"pin": HIGH_MARK, "amount": 7},
        ]
    assert _versions(paths) == before
    data = decrypted_bytes(paths, tmp_path)
    for mark in (HIGH_MARK, HIGH_OLD):
        assert mark.encode() not in data, mark
    assert LOW_MARK.encode() in data


def test_the_sealing_of_an_old_store_killed_before_its_commit_leaves_it_whole(tmp_path: Path) -> None:
    paths = home("plain")
    _old_store(paths)
    before = _versions(paths)
    arm = tmp_path / "arm"
    arm.touch()
    script = (
        "import sys; from pathlib import Path; from gateway.config import Paths; "
        "from gateway.guard.stores import open_user_store; open_user_store(Paths(Path(sys.argv[1]))).close()"
    )
    env = {**os.environ, "UOMP_FAULT": "atrest.items_sealed_before_commit", "UOMP_FAULT_ARM": str(arm)}
    res = subprocess.run(
        [sys.executable, "-c", script, str(paths.home)], env=env, cwd=REPO, capture_output=True, timeout=60
    )
    assert res.returncode == -9, res.stderr
    assert _versions(paths) == before
    assert not itemseal.is_sealed_text(stored_value(paths, "bank.pin"))  # old: nothing half-sealed
    assert HIGH_MARK.encode() in file_bytes(paths.memory_db)
    # the next open (the arm is used up) seals all of it
    res = subprocess.run(
        [sys.executable, "-c", script, str(paths.home)], env=env, cwd=REPO, capture_output=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert _versions(paths) == before
    assert itemseal.is_sealed_text(stored_value(paths, "bank.pin"))
    assert HIGH_MARK.encode() not in file_bytes(paths.memory_db)


def test_export_opens_high_values_and_import_seals_them(tmp_path: Path) -> None:
    src = home("plain")
    with open_user_store(src) as store:
        store.put_many(some_items())
        store.put(MemoryItem("bank.pin", {"pin": HIGH_OLD}, ("bank",), "high", "user", TS, TS), replace=True)
        out = tmp_path / "export.json"
        exchange.export_file(store, out)
    text = out.read_text()
    assert HIGH_OLD in text and itemseal.MARKER not in text  # the user's own export holds the values
    dst = home("sealed")
    with open_user_store(dst) as store:
        written, _ = exchange.restore(store, exchange.parse_envelope(out.read_bytes()), replace=False)
        assert written == 4
        got = store.get("bank.pin")
        assert got is not None and got.value == {"pin": HIGH_OLD}
        assert [v["value"] for v in history.history(store, "bank.pin")][1] == {"pin": HIGH_MARK, "amount": 7}
    data = decrypted_bytes(dst, tmp_path)
    assert HIGH_OLD.encode() not in data and HIGH_MARK.encode() not in data
    assert LOW_MARK.encode() in data
    assert json.loads(stored_value(dst, "bank.pin")).startswith(itemseal.MARKER)
