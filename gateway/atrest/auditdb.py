"""The audit log encrypted at rest: ``audit.db`` as a SQLCipher 4 database in a sealed home.

Every process that opens ``audit.db`` (the guard's :class:`gateway.guard.audit.AuditLog`, the
anchorer, ``uomp audit``, the dashboard, status, backup) opens it through :func:`connect`, which
finds the home from the file's path: in a plain home it is a plain SQLite file (the standard
library's driver); in a sealed home it is SQLCipher under ``HKDF(master, "audit-db")``, a key of
its own (never memory.db's), known only to a process that unlocked the home or was handed its
master key (:func:`gateway.atrest.vault.child_handover`: the guard, and the guard's background
``uomp audit verify``).

Only the file's pages are encrypted: the events, their leaves, the tree, the checkpoints (C2SP
signed notes) and the anchors are the same bytes, so a proof or checkpoint exported before the
encryption verifies after it, and ``uomp audit verify-proof FILE`` needs no key.

Conversion (:func:`ensure_encrypted`, ``uomp secrets seal`` and the first open of a plaintext
``audit.db`` in a sealed home in a process; :func:`ensure_plaintext`, ``uomp secrets unseal``): as
for memory.db (:func:`gateway.atrest.memdb.convert_file`), through ``audit.db.convert`` renamed
over the old file, under the home's at-rest lock: a kill at any point leaves the old file or the
new one, whole; :func:`is_encrypted` says which. The check for a plaintext file reads the file's
header, so it runs once per process and file, before that process holds any connection to it
(closing a second descriptor of a SQLite file would drop the process's POSIX locks on it).

A file that does not open with the key (copied from another home, a wrong key, a damaged first
page) is ``AUDIT_LOG_DAMAGED`` with reason ``key_mismatch``, never INTERNAL (:func:`check_opens`);
one that opens under another file format than the home's slot records is ``KEY_ERROR`` with reason
``profile_mismatch`` (formats: :mod:`gateway.atrest.memdb`).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

from gateway import sqldriver
from gateway.atrest import journal, memdb, vault
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError

LABEL = "audit-db"  # the HKDF purpose of the audit log's key (memory.db's is "memory-db")
FAULT_BEFORE_RENAME = "atrest.auditdb_before_rename"


_checked: set[str] = set()  # audit.db files this process found encrypted (or converted)
_lock = threading.Lock()


def home_of(path: Path) -> Paths | None:
    """The home whose ``audit.db`` is ``path``; None for a database elsewhere (a test's, a tool's)."""
    p = Path(os.path.abspath(path))
    paths = Paths(p.parent)
    return paths if paths.audit_db == p else None


def audit_key(paths: Paths) -> memdb.DbKey:
    """The audit log's SQLCipher key, derived from the unlocked master key (SECRETS_LOCKED if not),
    with the home's file format (:func:`gateway.atrest.memdb.home_profile`)."""
    return memdb.DbKey(vault.master(paths).subkey(LABEL), memdb.home_profile(paths))


def convert_path(db: Path) -> Path:
    """The file a conversion writes before renaming it over ``db``."""
    return db.with_name(db.name + ".convert")


def is_encrypted(db: Path) -> bool:
    """True when ``db`` exists, is not empty, and is not a plain SQLite file (SQLCipher's pages)."""
    try:
        return db.stat().st_size > 0 and not memdb.is_plaintext(db)
    except FileNotFoundError:
        return False


def _convert(db: Path, src_key: bytes | None, dst_key: bytes | None) -> None:
    memdb.convert_file(db, convert_path(db), src_key, dst_key, what="audit log", fault=FAULT_BEFORE_RENAME)


def ensure_encrypted(paths: Paths, key: bytes) -> bool:
    """Convert a plaintext ``audit.db`` to SQLCipher under ``key``; True when it converted."""
    db = paths.audit_db
    with journal.locked(paths):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(convert_path(db))
        if not memdb.is_plaintext(db):
            return False
        _convert(db, None, key)
    return True


def ensure_plaintext(paths: Paths, key: bytes) -> bool:
    """Convert an encrypted ``audit.db`` back to a plain SQLite file; True when it converted."""
    db = paths.audit_db
    with journal.locked(paths):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(convert_path(db))
        if not is_encrypted(db):
            return False
        _convert(db, key, None)
    _checked.discard(str(db.resolve()))
    return True


def key_for(path: Path) -> memdb.DbKey | None:
    """The key to open the audit log ``path`` with: None in a plain home (or outside a home); in a
    sealed one, its key, after converting a plaintext file left from before the seal (once per
    process and file)."""
    paths = home_of(path)
    if paths is None or not vault.is_sealed_home(paths):
        return None
    key = audit_key(paths)
    name = str(paths.audit_db.resolve())
    with _lock:
        if name not in _checked:
            if paths.audit_db.exists():
                ensure_encrypted(paths, key)
            _checked.add(name)
    return key


def refusal(path: Path, exc: BaseException) -> UompError:
    """AUDIT_LOG_DAMAGED for a SQLCipher file its home's key does not open (``exc``), with the reason."""
    return UompError(
        ErrorCode.AUDIT_LOG_DAMAGED,
        f"{path.name} does not open with this home's audit key ({type(exc).__name__}: {exc}): a file from "
        "another home, or damaged; put back this home's audit.db from a backup (docs/audit.md)",
        details={"reason": "key_mismatch"},
    )


def check_opens(conn: Any, path: Path, target: str, key: bytes) -> None:
    """Read the schema of a keyed connection once: a key that does not open the file (SQLite's
    "not a database") is the named refusal here: KEY_ERROR (``profile_mismatch``) when the file is
    of another format than the home's slot names, else AUDIT_LOG_DAMAGED. Any other failure (a
    truncated file) is left to the reader, which names the first bad event, as for a plain file."""
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqldriver.DATABASE as exc:
        if not memdb.is_not_a_database(exc):
            return
        conn.close()
        raise memdb.profile_mismatch(target, key, exc, "audit log") or refusal(path, exc) from exc


def connect(
    path: Path,
    *,
    readonly: bool = False,
    timeout: float = 5.0,
    isolation_level: str | None = None,
    check_same_thread: bool = True,
    rows: bool = False,
) -> Any:
    """A connection to the audit log ``path`` (SQLCipher in a sealed home, else the standard
    library's SQLite), checked to open. ``readonly``: ``mode=ro``. ``rows``: rows by column name.
    SECRETS_LOCKED when the home is sealed and not unlocked; AUDIT_LOG_DAMAGED when the file does
    not open with its key."""
    key = key_for(path)
    target = Path(os.path.abspath(path)).as_uri() + ("?mode=ro" if readonly else "")
    kwargs: dict[str, Any] = {
        "uri": True,
        "timeout": timeout,
        "isolation_level": isolation_level,
        "check_same_thread": check_same_thread,
    }
    if key is None:
        conn: Any = sqlite3.connect(target, **kwargs)
        if rows:
            conn.row_factory = sqlite3.Row
    else:
        conn = memdb.connect(target, key, **kwargs)
        if rows:
            conn.row_factory = sqldriver.cipher().Row
        check_opens(conn, path, target, key)
    return conn
