"""The memory store of a sealed home encrypted at rest (SQLCipher, gateway/atrest/memdb.py): no
value, key or tag in memory.db, its -wal or -shm; the guard's queries give the same answers as on
a plain store; the conversion of an existing store at seal (and back at unseal), killed -9 before
its rename; and the refusals: no key, a wrong key, a store copied from another home."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_sealed_cli import env, pp_file, uomp
from test_sealed_keys import FAST, PASSPHRASE, make_home

from gateway.atrest import memdb, migrate, vault
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError
from gateway.guard.store import MemoryItem, MemoryStore, ReadFilter

TS = "2026-01-01T00:00:00Z"
MARK_VALUE = "value-marker-5c1e9d"
MARK_KEY = "key-marker-a7b2"
MARK_TAG = "tag-marker-0f4d"


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()


def items(n: int = 50) -> list[MemoryItem]:
    out = [MemoryItem(MARK_KEY, {"note": MARK_VALUE}, (MARK_TAG,), "high", "user", TS, TS)]
    for i in range(n):
        out.append(
            MemoryItem(f"h{i:03}", {"shares": i, "cost": i * 1.5}, ("portfolio", f"g{i % 3}"), "low", "user", TS, TS)
        )
    return out


def files_of(db: Path) -> dict[str, bytes]:
    out = {}
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(db) + suffix)
        if p.exists():
            out[p.name] = p.read_bytes()
    return out


def sealed_home() -> Paths:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    return paths


def test_no_value_key_or_tag_in_the_files_of_an_encrypted_store() -> None:
    paths = sealed_home()
    key = memdb.key_for(paths)
    assert key is not None
    store = MemoryStore(paths.memory_db, key=key)
    try:
        store.put_many(items())
        # the connection is open and nothing was checkpointed: the items are in -wal frames
        found = files_of(paths.memory_db)
        assert len(found.get("memory.db-wal", b"")) > 4096, "the WAL holds the writes"
        for name, data in found.items():
            for mark in (MARK_VALUE, MARK_KEY, MARK_TAG, "portfolio"):
                assert mark.encode() not in data, (name, mark)
        assert not memdb.is_plaintext(paths.memory_db)
    finally:
        store.close()
    # the partner: the same items in a plain store are there to be found
    plain = make_home()
    p = MemoryStore(plain.memory_db)
    try:
        p.put_many(items())
        assert any(MARK_VALUE.encode() in d for d in files_of(plain.memory_db).values())
    finally:
        p.close()


def test_the_guards_queries_answer_the_same_on_an_encrypted_store(tmp_path: Path) -> None:
    plain = MemoryStore(tmp_path / "plain.db")
    enc = MemoryStore(tmp_path / "enc.db", key=os.urandom(32))
    try:
        for s in (plain, enc):
            s.put_many(items(300))
        flt = ReadFilter(keys=(MARK_KEY,), deny_keys=("h007",), deny_tags=("g2",))
        for s_a, s_b in [(plain, enc)]:
            assert s_a.tag_page("portfolio", flt, after=None, limit=50, max_bytes=10**6) == s_b.tag_page(
                "portfolio", flt, after=None, limit=50, max_bytes=10**6
            )
            for path in (None, '$."shares"', '$."cost"'):
                assert s_a.aggregate("portfolio", flt, path=path) == s_b.aggregate("portfolio", flt, path=path)
            args = {"path": '$."shares"', "keys": (3, 5, 7, 11), "max_atoms": 16}
            assert s_a.atoms(["g0", "g1", "portfolio"], flt, **args) == s_b.atoms(
                ["g0", "g1", "portfolio"], flt, **args
            )  # type: ignore[arg-type]
            _meta, got = s_b.get_if(MARK_KEY, lambda m: m is not None and m.sensitivity == "high")
            assert got is not None and got.value == {"note": MARK_VALUE}
            loads = s_b.value_loads
            meta, refused = s_b.get_if(MARK_KEY, lambda m: False)  # denied: the value is never read
            assert refused is None and meta is not None and s_b.value_loads == loads
            assert s_b.get_meta("h001") == s_a.get_meta("h001")
        assert enc.aggregate("portfolio", ReadFilter(), path='$."shares"').total == sum(range(300))
    finally:
        plain.close()
        enc.close()


@pytest.mark.parametrize("how", ["no_key", "wrong_key", "other_home"])
def test_an_encrypted_store_does_not_open_without_its_key(how: str) -> None:
    paths = sealed_home()
    store = MemoryStore(paths.memory_db, key=memdb.key_for(paths))
    store.put_many(items(3))
    store.close()
    if how == "no_key":
        key = None
        target = paths
    elif how == "wrong_key":
        key = os.urandom(32)
        target = paths
    else:  # memory.db copied into another sealed home: that home's key does not open it
        target = sealed_home()
        target.memory_db.unlink(missing_ok=True)
        shutil.copy2(paths.memory_db, target.memory_db)
        key = memdb.key_for(target)
    with pytest.raises(UompError) as exc:
        MemoryStore(target.memory_db, key=key, create=False).get(MARK_KEY)
    assert exc.value.code == ErrorCode.STORE_UNAVAILABLE
    assert exc.value.details == {"reason": "SQLITE_NOTADB"}
    assert MemoryStore(paths.memory_db, key=memdb.key_for(paths)).get(MARK_KEY) is not None  # the partner


def test_seal_encrypts_an_existing_store_and_unseal_decrypts_it(tmp_path: Path) -> None:
    paths = make_home()
    with MemoryStore(paths.memory_db) as s:
        s.put_many(items(20))
    res = uomp(paths.home, "secrets", "seal", "--passphrase-file", str(pp_file(tmp_path)))
    assert res.returncode == 0, res.stderr
    assert "encrypted:" in res.stdout
    assert not memdb.is_plaintext(paths.memory_db)
    assert not any(MARK_VALUE.encode() in d for d in files_of(paths.memory_db).values())
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    with MemoryStore(paths.memory_db, key=memdb.key_for(paths), create=False) as s:
        assert s.count() == 21 and s.get(MARK_KEY).value == {"note": MARK_VALUE}  # type: ignore[union-attr]
    vault.forget()
    listed = uomp(paths.home, "memory", "list", "--tag", MARK_TAG, e=env(UOMP_PASSPHRASE_FILE=str(pp_file(tmp_path))))
    assert listed.returncode == 0 and MARK_KEY in listed.stdout, listed.stderr
    locked = uomp(paths.home, "memory", "list", stdin="")
    assert locked.returncode == 1 and "error SECRETS_LOCKED" in locked.stderr, locked.stderr

    res = uomp(paths.home, "secrets", "unseal", "--passphrase-file", str(pp_file(tmp_path)))
    assert res.returncode == 0, res.stderr
    assert memdb.is_plaintext(paths.memory_db)
    with MemoryStore(paths.memory_db, create=False) as s:
        assert s.count() == 21


def test_conversion_killed_before_its_rename_leaves_the_store_whole(tmp_path: Path) -> None:
    paths = make_home()
    with MemoryStore(paths.memory_db) as s:
        s.put_many(items(20))
    arm = tmp_path / "arm"
    arm.touch()
    res = uomp(
        paths.home,
        "secrets",
        "seal",
        "--passphrase-file",
        str(pp_file(tmp_path)),
        e=env(UOMP_FAULT="atrest.memdb_before_rename", UOMP_FAULT_ARM=str(arm)),
    )
    assert res.returncode == -9, res.stderr
    assert memdb.is_plaintext(paths.memory_db) and paths.memory_db_convert.exists()
    with MemoryStore(paths.memory_db, create=False) as s:  # the old store, whole
        assert s.count() == 21
    # the keys are sealed (their journal committed first); the next open finishes the store
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    key = memdb.key_for(paths)
    assert not memdb.is_plaintext(paths.memory_db) and not paths.memory_db_convert.exists()
    with MemoryStore(paths.memory_db, key=key, create=False) as s:
        assert s.count() == 21 and s.get(MARK_KEY) is not None


def test_the_plain_sqlite3_shell_sees_nothing(tmp_path: Path) -> None:
    paths = sealed_home()
    with MemoryStore(paths.memory_db, key=memdb.key_for(paths)) as s:
        s.put_many(items(2))
    res = subprocess.run(
        [
            "python3",
            "-c",
            f"import sqlite3; sqlite3.connect('{paths.memory_db}').execute('select count(*) from items').fetchone()",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "not a database" in res.stderr
