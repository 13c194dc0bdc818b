"""The memory store encrypted at rest: ``memory.db`` as a SQLCipher 4 database in a sealed home.

Why SQLCipher (``sqlcipher3``, binary wheels with their own SQLite for Linux x86-64 and aarch64 and
macOS) rather than encrypting each value in the application: every page is encrypted (AES-256,
HMAC-SHA512 per page), so keys, tags and metadata are covered as well as values, the ``-wal``
frames too; and the guard's SQL (covering index for metadata, tag pages, ``json_extract``
aggregates, the keyed sums of aggregate histories) runs unchanged, in SQLite, in constant memory.
Per-value AES-GCM would leave tags and keys in clear, and every aggregate would have to decrypt
each row through a Python callback.

The key is ``HKDF(master, "memory-db")`` (:class:`gateway.atrest.sealing.MasterKey`), given to
SQLCipher as a raw 256-bit key (no per-open PBKDF2); it exists only in the memory of a process
that unlocked the home. A plain home's ``memory.db`` stays a plain SQLite file.

Conversion (:func:`ensure_encrypted`, run by :func:`key_for` before the store is opened, and by
``uomp secrets seal``): with nothing else writing (the appliance is stopped, or this is its guard
starting), the plaintext file is checkpointed, exported with ``sqlcipher_export`` into
``memory.db.convert`` (fsynced, checked), its empty ``-wal``/``-shm`` removed, and the new file
renamed over the old one. A crash before the rename leaves the plaintext store as it was (the
leftover ``.convert`` file is removed by the next conversion); after it, the encrypted one.
:func:`ensure_plaintext` is the reverse, for ``uomp secrets unseal``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any

import sqlcipher3.dbapi2 as cipher  # type: ignore[import-untyped]

from gateway.atrest import vault
from gateway.config import Paths
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import fsync_dir

SQLITE_HEADER = b"SQLite format 3\x00"

# The exception classes of both drivers, for code that handles either kind of connection.
ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, cipher.Error)
PROGRAMMING: tuple[type[Exception], ...] = (sqlite3.ProgrammingError, cipher.ProgrammingError)
OPERATIONAL: tuple[type[Exception], ...] = (sqlite3.OperationalError, cipher.OperationalError)
INTEGRITY: tuple[type[Exception], ...] = (sqlite3.IntegrityError, cipher.IntegrityError)
DATABASE: tuple[type[Exception], ...] = (sqlite3.DatabaseError, cipher.DatabaseError)
ROW: Any = cipher.Row  # rows by column name, for a SQLCipher connection


def _key_pragma(key: bytes) -> str:
    if len(key) != 32:
        raise ValueError("a 256-bit key")
    return f"PRAGMA key = \"x'{key.hex()}'\""


def connect(target: str, key: bytes, **kwargs: Any) -> Any:
    """A SQLCipher connection to ``target`` with ``key`` (the first statement, as SQLCipher requires).
    Temporary tables and sort spills stay in memory."""
    conn = cipher.connect(target, **kwargs)
    try:
        conn.execute(_key_pragma(key))
        conn.execute("PRAGMA temp_store = MEMORY")
    except BaseException:
        conn.close()
        raise
    return conn


def is_plaintext(path: Path) -> bool:
    """True for a plain SQLite file (its fixed header); False for SQLCipher, empty or missing."""
    try:
        with open(path, "rb") as fh:
            return fh.read(16) == SQLITE_HEADER
    except FileNotFoundError:
        return False


def memory_key(paths: Paths) -> bytes:
    """The memory store's SQLCipher key, derived from the unlocked master key."""
    return vault.master(paths).subkey("memory-db")


# The memory.db files (path, device, inode) this process found SQLCipher (or converted): their header is
# not read again, since this process may hold connections to them by then (closing a descriptor of
# the file beside SQLite would drop their POSIX locks). A file replaced since (a restore, an
# unseal and a seal) is another inode, checked again.
_encrypted: set[tuple[str, int, int]] = set()


def _identity(path: Path) -> tuple[str, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (os.path.abspath(path), st.st_dev, st.st_ino) if st.st_size > 0 else None


def key_for(paths: Paths) -> bytes | None:
    """The key to open ``memory.db`` with: None in a plain home; in a sealed one, the store's key,
    after converting a plaintext store left from before the seal (the file's header is read once
    per process and file, see ``_encrypted``)."""
    if not vault.is_sealed_home(paths):
        return None
    key = memory_key(paths)
    if _identity(paths.memory_db) not in _encrypted:
        ensure_encrypted(paths, key)
        ident = _identity(paths.memory_db)
        if ident is not None:
            _encrypted.add(ident)
    return key


def _remove_companions(path: Path) -> None:
    for suffix in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(path) + suffix)


def convert_file(db: Path, tmp: Path, src_key: bytes | None, dst_key: bytes | None, *, what: str, fault: str) -> None:
    """Rewrite the SQLite file ``db`` under ``dst_key`` (None: plaintext) from ``src_key``, through
    ``tmp`` (fsynced, checked, renamed over ``db``): a crash leaves ``db`` old or new, never half.
    Nothing else may write ``db`` meanwhile (STORE_BUSY when its WAL cannot be checkpointed).
    ``fault``: the name of the fault point just before the rename."""
    _remove_companions(tmp)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    uri = db.resolve().as_uri() + "?mode=rw"
    conn = connect(uri, src_key, uri=True, isolation_level=None) if src_key else cipher.connect(uri, uri=True)
    try:
        conn.isolation_level = None
        conn.execute("PRAGMA busy_timeout = 5000")
        if conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()[0][0] != 0:
            raise UompError(ErrorCode.STORE_BUSY, f"the {what} is in use by another process; stop it and try again")
        version = int(conn.execute("PRAGMA user_version").fetchall()[0][0])
        rows = int(conn.execute("SELECT count(*) FROM sqlite_master").fetchall()[0][0])
        dst = f"\"x'{dst_key.hex()}'\"" if dst_key else "''"
        conn.execute(f"ATTACH DATABASE ? AS conv KEY {dst}", (str(tmp),))
        conn.execute("SELECT sqlcipher_export('conv')").fetchall()
        conn.execute(f"PRAGMA conv.user_version = {version}").fetchall()
        conn.execute("DETACH DATABASE conv").fetchall()
    finally:
        conn.close()
    check_uri = tmp.resolve().as_uri() + "?mode=rw"
    check = connect(check_uri, dst_key, uri=True) if dst_key else cipher.connect(check_uri, uri=True)
    try:
        check.isolation_level = None
        checked = check.execute("PRAGMA quick_check").fetchall()
        if checked != [("ok",)] or rows != int(check.execute("SELECT count(*) FROM sqlite_master").fetchall()[0][0]):
            raise UompError(ErrorCode.STORE_UNAVAILABLE, f"the converted {what} does not check; nothing changed")
    finally:
        check.close()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _remove_companions(tmp)
    fault_point(fault)
    _remove_companions(db)  # checkpointed and truncated above: nothing in them
    os.replace(tmp, db)
    fsync_dir(db.parent)


def _convert(paths: Paths, src_key: bytes | None, dst_key: bytes | None) -> None:
    convert_file(
        paths.memory_db,
        paths.memory_db_convert,
        src_key,
        dst_key,
        what="memory store",
        fault="atrest.memdb_before_rename",
    )


def ensure_encrypted(paths: Paths, key: bytes) -> bool:
    """Convert a plaintext ``memory.db`` to SQLCipher under ``key``; True when it converted."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.memory_db_convert)
    if not is_plaintext(paths.memory_db):
        return False
    _convert(paths, None, key)
    return True


def ensure_plaintext(paths: Paths, key: bytes) -> bool:
    """Convert an encrypted ``memory.db`` back to a plain SQLite file; True when it converted."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.memory_db_convert)
    db = paths.memory_db
    if not db.exists() or db.stat().st_size == 0 or is_plaintext(db):
        return False
    _convert(paths, key, None)
    return True
