"""A backup taken by a process that holds connections to the home's databases (the guard's own
store, a tool's) leaves their SQLite locks in place: the backup never opens and closes a database
file beside SQLite (closing any descriptor of a file drops every POSIX lock the process holds on
it, SQLite's own among them). Checked from another process: with the locks held, the SHARED
byte range SQLite locks on the database file is taken, and (a plain home) SQLite there cannot take
the file's exclusive lock (``PRAGMA journal_mode=DELETE`` is "database is locked"); once the
connection closes, both can. A plain home (SQLite) and a sealed one (SQLCipher)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from backupkit import MARKED_KEY, put_marked
from guardkit import seed
from test_sealed_keys import FAST, PASSPHRASE, make_home

from gateway.atrest import backup, memdb, migrate, vault
from gateway.config import Paths
from gateway.guard.store import MemoryStore
from gateway.guard.stores import open_user_store

BACKUP_PASS = b"locks-pass-0c4e"
REPO = Path(__file__).resolve().parents[2]

# Another process: open the database (with the key read from stdin, if any) and ask for the file's
# exclusive lock, without waiting; prints "locked" or the new journal mode.
PROBE = """
import sqlite3, sys
from gateway import sqldriver
from gateway.atrest import memdb
key = sys.stdin.read().strip()
db = sys.argv[1]
conn = memdb.connect(db, bytes.fromhex(key), timeout=0) if key else sqlite3.connect(db, timeout=0)
conn.isolation_level = None
try:
    print(conn.execute("PRAGMA journal_mode=DELETE").fetchall()[0][0])
except sqldriver.OPERATIONAL as exc:
    print("locked" if "locked" in str(exc) else f"error {exc}")
"""

# Another process: can it write-lock the SHARED range of SQLite's lock bytes (after PENDING_BYTE,
# 1 GiB, and the RESERVED byte) of the file? Its own descriptor, closed on exit.
SHARED_RANGE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 510, 0x40000000 + 2)
    print("free")
except OSError:
    print("held")
"""


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()


def shared_lock(db: Path) -> str:
    res = subprocess.run([sys.executable, "-c", SHARED_RANGE, str(db)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def probe(db: Path, key: bytes | None) -> str:
    res = subprocess.run(
        [sys.executable, "-c", PROBE, str(db)],
        input=key.hex() if key else "",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def home(sealed: bool) -> tuple[Paths, bytes | None]:
    paths = make_home()
    seed(paths)
    if sealed:
        migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    put_marked(paths, "locks-marker-5b21")
    return paths, memdb.key_for(paths)


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_backup_leaves_this_processs_database_locks_held(sealed: bool, tmp_path: Path) -> None:
    paths, key = home(sealed)
    store = MemoryStore(paths.memory_db, key=key)  # this process's connection, as a guard's
    try:
        assert store.get(MARKED_KEY) is not None
        assert (shared_lock(paths.memory_db), probe(paths.memory_db, key)) == ("held", "locked")  # before
        backup.create(paths, tmp_path / "b.uompbak", BACKUP_PASS, kdf=FAST)
        assert (shared_lock(paths.memory_db), probe(paths.memory_db, key)) == ("held", "locked")  # and after
        assert store.get(MARKED_KEY) is not None
    finally:
        store.close()
    # the partner: with the connection closed, the other process takes the locks
    assert shared_lock(paths.memory_db) == "free"
    assert probe(paths.memory_db, key) == "delete"
    manifest = backup.verify(tmp_path / "b.uompbak", BACKUP_PASS)
    assert "memory.db" in {f["path"] for f in manifest["files"]}


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_second_store_opened_in_the_same_process_leaves_the_first_ones_locks_held(sealed: bool) -> None:
    """The same class in the store's own opener: a tool or the dashboard opening the store again in
    a process that has it open (the existing file is not opened to set its mode; the plaintext
    check of a sealed home's file runs once per process and file)."""
    paths, _key = home(sealed)
    first = open_user_store(paths)
    try:
        assert first.get(MARKED_KEY) is not None
        assert shared_lock(paths.memory_db) == "held"
        with open_user_store(paths) as second:
            assert second.get(MARKED_KEY) is not None
        assert shared_lock(paths.memory_db) == "held"  # the first store's lock is still there
    finally:
        first.close()
    assert shared_lock(paths.memory_db) == "free"
