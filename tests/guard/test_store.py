"""Memory Store: real SQLite files under tmp_path; every refusal is a UompError, never sqlite3."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import UompError
from gateway.guard.items import MAX_KEY_CHARS, MAX_TAG_CHARS, MAX_TAGS, MAX_VALUE_BYTES, MemoryItem
from gateway.guard.store import SCHEMA_VERSION, MemoryStore

TS = "2026-07-12T10:00:00Z"


def item(
    key: str = "preference.theme",
    value: Any = "dark",
    tags: tuple[str, ...] = ("preference", "ui"),
    sensitivity: str = "low",
    **kw: Any,
) -> MemoryItem:
    fields: dict[str, Any] = {"source": "user", "created_at": "2026-07-01T10:00:00Z", "updated_at": TS}
    fields.update(kw)
    return MemoryItem(key=key, value=value, tags=tags, sensitivity=sensitivity, **fields)


@pytest.fixture
def store(tmp_path: Path) -> MemoryStore:
    s = MemoryStore(tmp_path / "memory.db")
    yield s
    s.close()


def unavailable(excinfo: pytest.ExceptionInfo[UompError]) -> UompError:
    err = excinfo.value
    assert err.code == "STORE_UNAVAILABLE"
    assert err.status == 503
    assert "sqlite3" not in err.message and "Error" not in err.message
    return err


# ------------------------------------------------------------------------------------ basics


def test_round_trip_and_spec_shape(store: MemoryStore) -> None:
    it = item(description="User interface theme preference")
    store.put(it)
    got = store.get("preference.theme")
    assert got == it
    assert got is not None and got.to_dict() == {
        "key": "preference.theme",
        "value": "dark",
        "tags": ["preference", "ui"],
        "sensitivity": "low",
        "source": "user",
        "created_at": "2026-07-01T10:00:00Z",
        "updated_at": TS,
        "description": "User interface theme preference",
    }
    assert "description" not in item().to_dict()
    assert store.get("missing") is None


@pytest.mark.parametrize("value", ["dark", 42, 3.5, None, True, [1, "two", None], {"a": {"b": [1, 2]}, "ü": "ñ ✓"}, ""])
def test_any_json_value_round_trips(store: MemoryStore, value: Any) -> None:
    store.put(item(value=value))
    got = store.get("preference.theme")
    assert got is not None and got.value == value


def test_tags_keep_their_order(store: MemoryStore) -> None:
    store.put(item(tags=("zeta", "alpha", "mid")))
    got = store.get("preference.theme")
    assert got is not None and got.tags == ("zeta", "alpha", "mid")


def test_by_tag_ordered_by_key_and_limited(store: MemoryStore) -> None:
    store.put_many([item(key=k, tags=("t",) if k != "c" else ("other",)) for k in ("d", "b", "a", "c", "e")])
    assert [i.key for i in store.by_tag("t")] == ["a", "b", "d", "e"]
    assert [i.key for i in store.by_tag("t", limit=2)] == ["a", "b"]
    assert [i.key for i in store.by_tag("other")] == ["c"]
    assert store.by_tag("nope") == []


def test_by_tag_is_an_index_lookup(store: MemoryStore) -> None:
    plan = " ".join(
        str(r)
        for r in store._conn.execute(
            "EXPLAIN QUERY PLAN SELECT i.key FROM item_tags t JOIN items i ON i.key = t.item_key "
            "WHERE t.tag = ? ORDER BY t.item_key LIMIT 10",
            ("x",),
        ).fetchall()
    )
    assert "SEARCH t USING PRIMARY KEY (tag=?)" in plan
    assert "SCAN" not in plan and "TEMP B-TREE" not in plan


def test_list_with_tag_limit_offset(store: MemoryStore) -> None:
    store.put_many([item(key=f"k{i:02d}", tags=("even",) if i % 2 == 0 else ("odd",)) for i in range(10)])
    assert [i.key for i in store.list()] == [f"k{i:02d}" for i in range(10)]
    assert [i.key for i in store.list(limit=3, offset=2)] == ["k02", "k03", "k04"]
    assert [i.key for i in store.list(tag="odd", limit=2, offset=1)] == ["k03", "k05"]
    assert store.count() == 10
    for bad in ({"limit": 0}, {"limit": -1}, {"offset": -1}, {"limit": 10**9}):
        with pytest.raises(UompError) as e:
            store.list(**bad)
        assert e.value.code == "INVALID_REQUEST"


def test_put_existing_key_needs_replace(store: MemoryStore) -> None:
    store.put(item())
    with pytest.raises(UompError) as e:
        store.put(item(value="light"))
    assert e.value.code == "INVALID_REQUEST"
    got = store.get("preference.theme")
    assert got is not None and got.value == "dark"
    store.put(item(value="light", tags=("new",)), replace=True)
    got = store.get("preference.theme")
    assert got is not None and got.value == "light" and got.tags == ("new",)
    assert store.by_tag("preference") == []
    assert [i.key for i in store.by_tag("new")] == ["preference.theme"]
    assert store.count() == 1


def test_put_many_is_all_or_nothing(store: MemoryStore) -> None:
    store.put(item(key="b"))
    with pytest.raises(UompError) as e:
        store.put_many([item(key="a"), item(key="b"), item(key="c")])
    assert e.value.code == "INVALID_REQUEST"
    assert store.count() == 1 and store.get("a") is None and store.by_tag("ui")[0].key == "b"
    with pytest.raises(UompError) as e:
        store.put_many([item(key="x"), item(key="y", sensitivity="secret")])
    assert e.value.code == "INVALID_REQUEST"
    with pytest.raises(UompError) as e:
        store.put_many([item(key="x"), item(key="x")], replace=True)
    assert e.value.code == "INVALID_REQUEST"
    assert store.count() == 1
    assert store.put_many([]) == 0
    assert store.put_many([item(key="a"), item(key="c")]) == 2
    assert store.count() == 3


def test_delete(store: MemoryStore) -> None:
    store.put(item())
    assert store.delete("preference.theme") is True
    assert store.delete("preference.theme") is False
    assert store.get("preference.theme") is None
    assert store.by_tag("ui") == []
    assert store._conn.execute("SELECT count(*) FROM item_tags").fetchone()[0] == 0


def test_existing_keys_in_chunks(store: MemoryStore) -> None:
    """The importer's key lookup (BulkWriter.existing; MemoryStore.existing_keys was unused and is gone)."""
    store.put_many([item(key=f"k{i}") for i in range(0, 1500, 3)])
    asked = (f"k{i}" for i in range(1500))  # a generator, longer than one IN chunk
    with store.bulk_writer(dry_run=True) as writer:
        assert set(writer.existing(asked)) == {f"k{i}" for i in range(0, 1500, 3)}
        assert writer.existing([]) == {}


BAD_ITEMS: list[tuple[str, dict[str, Any]]] = [
    ("empty key", {"key": ""}),
    ("long key", {"key": "k" * (MAX_KEY_CHARS + 1)}),
    ("key with newline", {"key": "a\nb"}),
    ("key with NUL", {"key": "a\x00b"}),
    ("key padded", {"key": " a"}),
    ("key not str", {"key": 5}),
    ("empty tag", {"tags": ("",)}),
    ("long tag", {"tags": ("t" * (MAX_TAG_CHARS + 1),)}),
    ("too many tags", {"tags": tuple(f"t{i}" for i in range(MAX_TAGS + 1))}),
    ("repeated tag", {"tags": ("a", "a")}),
    ("tag control", {"tags": ("a\tb",)}),
    ("tags not list", {"tags": "a"}),
    ("sensitivity", {"sensitivity": "secret"}),
    ("sensitivity case", {"sensitivity": "LOW"}),
    ("source", {"source": "robot"}),
    ("created not iso", {"created_at": "yesterday"}),
    ("updated no zone", {"updated_at": "2026-07-12T10:00:00"}),
    ("created date only", {"created_at": "2026-07-12"}),
    ("description control", {"description": "a\x1bb"}),
    ("description type", {"description": 5}),
    ("value not json", {"value": {1, 2}}),
    ("value NaN", {"value": float("nan")}),
    ("value too big", {"value": "x" * (MAX_VALUE_BYTES + 1)}),
]


@pytest.mark.parametrize(("name", "change"), BAD_ITEMS, ids=[n for n, _ in BAD_ITEMS])
def test_invalid_items_refused(store: MemoryStore, name: str, change: dict[str, Any]) -> None:
    with pytest.raises(UompError) as e:
        store.put(item(**change))
    assert e.value.code == "INVALID_REQUEST"
    assert "x" * 50 not in e.value.message
    assert store.count() == 0


def test_limits_accepted_at_the_edge(store: MemoryStore) -> None:
    store.put(
        item(
            key="k" * MAX_KEY_CHARS,
            tags=tuple(f"t{i}" for i in range(MAX_TAGS)),
            description="line one\nline two",
            created_at="2026-07-01T10:00:00+02:00",
        )
    )
    assert store.count() == 1


# ------------------------------------------------------------------------------------ durability, files


def test_wal_full_sync_and_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    with MemoryStore(path) as s:
        s.put(item())
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert s._conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()


def test_files_are_private_even_with_a_loose_umask(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    old = os.umask(0)
    try:
        with MemoryStore(path) as s:
            s.put(item())
            modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    finally:
        os.umask(old)
    assert modes["memory.db"] == 0o600
    assert modes.get("memory.db-wal", 0o600) == 0o600
    assert modes.get("memory.db-shm", 0o600) == 0o600


def test_existing_file_mode_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    MemoryStore(path).close()
    path.chmod(0o644)
    MemoryStore(path).close()
    assert path.stat().st_mode & 0o777 == 0o600


def test_data_survives_reopen_and_is_seen_by_a_second_store(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    a = MemoryStore(path)
    b = MemoryStore(path, create=False)
    try:
        a.put(item())
        assert b.get("preference.theme") == item()
    finally:
        a.close()
        b.close()
    with MemoryStore(path, create=False) as c:
        assert c.get("preference.theme") == item()


def test_usable_from_another_thread(store: MemoryStore) -> None:
    store.put(item())
    seen: list[Any] = []
    t = threading.Thread(target=lambda: seen.append(store.get("preference.theme")))
    t.start()
    t.join()
    assert seen == [item()]


# ------------------------------------------------------------------------------------ STORE_UNAVAILABLE


def test_missing_file_without_create(tmp_path: Path) -> None:
    with pytest.raises(UompError) as e:
        MemoryStore(tmp_path / "nope.db", create=False)
    unavailable(e)
    assert not (tmp_path / "nope.db").exists()


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(UompError) as e:
        MemoryStore(tmp_path / "no" / "such" / "memory.db")
    unavailable(e)


def test_empty_file_without_create_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    path.touch()
    with pytest.raises(UompError) as e:
        MemoryStore(path, create=False)
    unavailable(e)


def test_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    junk = b"these are not the bytes of a SQLite database " * 100
    path.write_bytes(junk)
    for create in (True, False):
        with pytest.raises(UompError) as e:
            MemoryStore(path, create=create)
        assert unavailable(e).details == {"reason": "SQLITE_NOTADB"}
    assert path.read_bytes() == junk


def test_someone_elses_database_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (a)")
    conn.commit()
    conn.close()
    with pytest.raises(UompError) as e:
        MemoryStore(path)
    unavailable(e)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    conn.close()


def test_newer_schema_refused_loudly(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    with MemoryStore(path) as s:
        s.put(item())
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(UompError) as e:
        MemoryStore(path)
    err = unavailable(e)
    assert "newer" in err.message and err.details is not None and err.details["reason"] == "SCHEMA_TOO_NEW"
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    conn.close()


def test_write_locked_by_another_connection(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    store = MemoryStore(path, busy_timeout=0.2)
    store.put(item(key="before"))
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN EXCLUSIVE")
        other.execute("DELETE FROM item_tags")
        t0 = time.monotonic()
        with pytest.raises(UompError) as e:
            store.put(item(key="during"))
        assert unavailable(e).details == {"reason": "SQLITE_BUSY"}
        assert time.monotonic() - t0 >= 0.15  # it waited for the busy timeout first
        with pytest.raises(UompError) as e:
            store.delete("before")
        unavailable(e)
        # WAL: readers are not blocked by the writer, and see the last committed state.
        assert store.get("before") is not None and [i.key for i in store.by_tag("ui")] == ["before"]
        other.execute("ROLLBACK")
        store.put(item(key="after"))
        assert store.count() == 2
    finally:
        other.close()
        store.close()


def test_exclusive_lock_blocks_opening(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    MemoryStore(path).close()
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("PRAGMA locking_mode = EXCLUSIVE")
        other.execute("BEGIN EXCLUSIVE")
        other.execute("DELETE FROM items")
        with pytest.raises(UompError) as e:
            MemoryStore(path, busy_timeout=0.2)
        unavailable(e)
    finally:
        other.close()


def test_closed_store(tmp_path: Path) -> None:
    s = MemoryStore(tmp_path / "memory.db")
    s.close()
    s.close()  # idempotent
    for call in (lambda: s.get("a"), lambda: s.put(item()), lambda: s.count(), lambda: s.by_tag("t")):
        with pytest.raises(UompError) as e:
            call()
        unavailable(e)


def test_disk_full_mid_batch_leaves_the_store_as_it_was(store: MemoryStore) -> None:
    store.put_many([item(key=f"old{i}", value={"n": i}) for i in range(5)])
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages + 3}")
    big = [item(key=f"new{i}", value="v" * 2000) for i in range(200)]
    with pytest.raises(UompError) as e:
        store.put_many(big)
    assert unavailable(e).details == {"reason": "SQLITE_FULL"}
    assert store.count() == 5 and store.get("new0") is None
    assert [i.key for i in store.by_tag("ui")] == [f"old{i}" for i in range(5)]


def test_failure_on_the_last_row_rolls_back_everything(store: MemoryStore) -> None:
    store.put_many([item(key=f"k{i}", value="old") for i in range(3)])
    store._conn.execute(
        "CREATE TRIGGER fail_last BEFORE INSERT ON items WHEN NEW.key = 'k9' BEGIN SELECT RAISE(ABORT, 'injected'); END"
    )
    batch = [item(key=f"k{i}", value="new", tags=("new",)) for i in range(10)]
    with pytest.raises(UompError) as e:
        store.put_many(batch, replace=True)
    unavailable(e)
    assert store.count() == 3
    assert [i.value for i in store.list()] == ["old", "old", "old"]
    assert store.by_tag("new") == []


# ------------------------------------------------------------------------------------ bulk writer


def test_bulk_writer_commits_only_when_asked(store: MemoryStore) -> None:
    store.put(item(key="old"))
    with store.bulk_writer(chunk=7) as w:
        for i in range(50):
            w.add(item(key=f"k{i:02d}"))
        w.flush()
        assert w.written == 50
    assert store.count() == 1 and store.get("k00") is None  # left without commit(): rolled back
    with store.bulk_writer(chunk=7) as w:
        for i in range(50):
            w.add(item(key=f"k{i:02d}"))
        assert w.commit() == 50
        with pytest.raises(RuntimeError):
            w.add(item(key="late"))
    assert store.count() == 51 and [i.key for i in store.by_tag("ui", limit=3)] == ["k00", "k01", "k02"]


def test_bulk_writer_rolls_back_on_an_exception(store: MemoryStore) -> None:
    store.put(item(key="old", value="old"))
    with pytest.raises(KeyError), store.bulk_writer(replace=True, chunk=3) as w:
        for i in range(10):
            w.add(item(key=f"k{i}"))
        w.add(item(key="old", value="new", tags=("new",)))
        w.flush()
        raise KeyError("the caller failed")
    assert store.count() == 1 and store.by_tag("new") == []
    got = store.get("old")
    assert got is not None and got.value == "old"
    store.put(item(key="after"))  # the store is usable again
    assert store.count() == 2


def test_bulk_writer_is_invisible_to_other_connections_until_commit(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    a = MemoryStore(path)
    b = MemoryStore(path, create=False, busy_timeout=0.2)
    try:
        a.put(item(key="old", value="old"))
        with a.bulk_writer(replace=True, chunk=10) as w:
            for i in range(100):
                w.add(item(key=f"k{i:03d}", tags=("new",)))
            w.add(item(key="old", value="new"))
            w.flush()
            assert b.count() == 1 and b.by_tag("new") == []  # WAL: the last committed state
            got = b.get("old")
            assert got is not None and got.value == "old"
            t0 = time.monotonic()
            with pytest.raises(UompError) as e:  # a second writer waits for the busy timeout, then fails
                b.put(item(key="other"))
            assert unavailable(e).details == {"reason": "SQLITE_BUSY"}
            assert time.monotonic() - t0 >= 0.15
            w.commit()
        assert b.count() == 101 and len(b.by_tag("new")) == 100
        got = b.get("old")
        assert got is not None and got.value == "new"
    finally:
        a.close()
        b.close()


def test_bulk_writer_existing_sees_the_store_and_its_own_writes(store: MemoryStore) -> None:
    store.put(item(key="a", created_at="2020-01-01T00:00:00Z"))
    with store.bulk_writer(chunk=100) as w:
        w.add(item(key="b", created_at="2021-01-01T00:00:00Z"))  # still queued: existing() flushes first
        asked = (f"{c}" for c in "abcdefg" * 200)  # a generator, longer than one IN chunk
        assert w.existing(asked) == {"a": "2020-01-01T00:00:00Z", "b": "2021-01-01T00:00:00Z"}
        assert w.existing([]) == {}


def test_bulk_writer_existing_or_repeated_keys(store: MemoryStore) -> None:
    store.put(item(key="a", value="old"))
    with store.bulk_writer(replace=True) as w:  # replace: the last one wins, tags follow it
        w.add(item(key="x", value=1, tags=("one", "two")))
        w.add(item(key="x", value=2, tags=("two", "three")))
        w.add(item(key="a", value="new", tags=("three",)))
        w.commit()
    x = store.get("x")
    assert x is not None and x.value == 2 and x.tags == ("two", "three")
    assert store.by_tag("one") == [] and [i.key for i in store.by_tag("three")] == ["a", "x"]
    for keys in (["n1", "a"], ["n1", "n2", "n1"]):  # without replace: refused, all rolled back
        with pytest.raises(UompError) as e, store.bulk_writer() as w:
            for k in keys:
                w.add(item(key=k))
            w.commit()
        assert e.value.code == "INVALID_REQUEST" and "already exists" in e.value.message
        with pytest.raises(RuntimeError):
            w.add(item(key="n9"))  # the failed writer is closed
    assert store.count() == 2 and store.get("n1") is None


def test_bulk_writer_refuses_a_bad_item_and_stays_open(store: MemoryStore) -> None:
    with store.bulk_writer() as w:
        with pytest.raises(UompError) as e:
            w.add(item(key="bad", sensitivity="secret"))
        assert e.value.code == "INVALID_REQUEST"
        w.add(item(key="good"))
        assert w.commit() == 1
    assert [i.key for i in store.list()] == ["good"]


def test_bulk_writer_dry_run_writes_nothing_and_locks_nothing(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    a = MemoryStore(path)
    b = MemoryStore(path, create=False, busy_timeout=0.2)
    try:
        a.put(item(key="a", created_at="2020-01-01T00:00:00Z"))
        with a.bulk_writer(dry_run=True) as w:
            w.add(item(key="new"))
            with pytest.raises(UompError):
                w.add(item(key="bad", sensitivity="secret"))  # still validated
            b.put(item(key="b"))  # another writer is not blocked
            assert w.existing(["a", "b", "new"]) == {"a": "2020-01-01T00:00:00Z"}  # one snapshot
            assert w.written == 1
            with pytest.raises(RuntimeError):
                w.commit()
        assert sorted(i.key for i in a.list()) == ["a", "b"]
    finally:
        a.close()
        b.close()


def test_writes_through_the_store_while_a_bulk_writer_is_open_are_refused(store: MemoryStore) -> None:
    with store.bulk_writer() as w:
        w.add(item(key="a"))
        for call in (
            lambda: store.put(item(key="b")),
            lambda: store.delete("a"),
            lambda: store.bulk_writer().__enter__(),
        ):
            with pytest.raises(RuntimeError):
                call()
        w.commit()
    store.put(item(key="b"))
    assert store.count() == 2


def test_other_threads_wait_for_the_bulk_writer(store: MemoryStore) -> None:
    seen: list[int] = []
    with store.bulk_writer() as w:
        w.add(item(key="a"))
        w.flush()
        t = threading.Thread(target=lambda: seen.append(store.count()))
        t.start()
        t.join(0.2)
        assert t.is_alive() and seen == []  # blocked on the store's lock, not reading half a batch
        w.commit()
    t.join(5)
    assert seen == [1]


def test_bulk_writer_on_a_closed_store(tmp_path: Path) -> None:
    s = MemoryStore(tmp_path / "memory.db")
    s.close()
    with pytest.raises(UompError) as e, s.bulk_writer():
        pass
    unavailable(e)


def test_a_version_2_store_gains_history_and_proposals(tmp_path: Path) -> None:
    """A store written by schema 2 (no versions, no history, no proposals) is migrated in place: its
    items become version 1 and keep their history from then on."""
    import sqlite3

    from gateway.guard import store as store_mod

    path = tmp_path / "m.db"
    conn = sqlite3.connect(path)
    for statement in store_mod._SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 2")
    conn.execute(
        "INSERT INTO items VALUES (?, ?, ?, ?, ?, ?, ?, NULL)",
        ("a", "1", '["t"]', "low", "user", "2026-07-12T10:00:00Z", "2026-07-12T10:00:00Z"),
    )
    conn.execute("INSERT INTO item_tags VALUES ('t', 'a')")
    conn.commit()
    conn.close()
    with MemoryStore(path, create=False) as st:
        with st.reading() as c:
            assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
            assert c.execute("SELECT version FROM items WHERE key = 'a'").fetchone()[0] == 1
        old = st.get("a")
        assert old is not None
        st.put(MemoryItem("a", 2, ("t",), "low", "user", old.created_at, old.updated_at), replace=True)
        with st.reading() as c:
            assert c.execute("SELECT version, value FROM item_versions").fetchall() == [(1, "1")]
            assert c.execute("SELECT version FROM items").fetchone()[0] == 2


def test_a_sealed_homes_store_keeps_versions_and_history_through_the_conversion(tmp_path: Path) -> None:
    """Schema 3 on SQLCipher: the triggers keep versions there too, and sealing a plain store
    (sqlcipher_export) keeps every item's version and its history."""
    from gateway.atrest import memdb
    from gateway.config import Paths
    from gateway.guard import history

    paths = Paths(tmp_path)
    ts = "2026-07-12T10:00:00Z"
    with MemoryStore(paths.memory_db) as plain:
        plain.put(MemoryItem("k", "one", ("t",), "low", "user", ts, ts))
        plain.put(MemoryItem("k", "two", ("t",), "low", "user", ts, ts), replace=True)
    key = bytes(range(32))
    assert memdb.ensure_encrypted(paths, key) and not memdb.is_plaintext(paths.memory_db)
    with MemoryStore(paths.memory_db, key=key) as sealed:
        entries = history.history(sealed, "k")
        assert [(e["version"], e["value"]) for e in entries] == [(2, "two"), (1, "one")]
        sealed.put(MemoryItem("k", "three", ("t",), "low", "user", ts, ts), replace=True)
        assert [e["version"] for e in history.history(sealed, "k")] == [3, 2, 1]
        assert history.rollback(sealed, "k", 1) == 4 and sealed.get("k").value == "one"  # type: ignore[union-attr]
