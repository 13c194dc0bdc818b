"""The memory store encrypted at rest: ``memory.db`` as a SQLCipher 4 database in a sealed home.

Why SQLCipher (``sqlcipher3``, binary wheels with their own SQLite for Linux x86-64 and aarch64 and
macOS) rather than encrypting each value in the application: every page is encrypted (AES-256,
an HMAC per page), so keys, tags and metadata are covered as well as values, the ``-wal``
frames too; and the guard's SQL (covering index for metadata, tag pages, ``json_extract``
aggregates, the keyed sums of aggregate histories) runs unchanged, in SQLite, in constant memory.
Per-value AES-GCM would leave tags and keys in clear, and every aggregate would have to decrypt
each row through a Python callback.

The key is ``HKDF(master, "memory-db")`` (:class:`gateway.atrest.sealing.MasterKey`), given to
SQLCipher as a raw 256-bit key (no per-open PBKDF2); it exists only in the memory of a process
that unlocked the home. A plain home's ``memory.db`` stays a plain SQLite file.

The file format (:data:`PROFILES`), one per sealed home, named by the ``db`` field of its master
key slot (:func:`gateway.atrest.sealing.parse_slot`) and applied to memory.db and audit.db alike:

* ``sqlcipher4-sha256`` (:data:`CURRENT`, every home sealed now): SQLCipher 4's settings with the
  page HMAC taken as HMAC-SHA256 instead of HMAC-SHA512 (``PRAGMA cipher_hmac_algorithm``), 4 KiB
  pages. Each page a commit writes is encrypted and HMACed: the audit log writes ~14.5 pages per
  15-event commit, and SHA-256 (SHA-NI on x86-64 and ARMv8 crypto) hashes a page in about half
  SHA-512's time. Integrity stays a full 256-bit HMAC per page. Smaller pages were measured and
  are slower: an append then touches more pages of deeper trees (benchmarks/README.md, "At rest");
* ``sqlcipher4`` (:data:`LEGACY`): SQLCipher 4's defaults (HMAC-SHA512, 4 KiB pages), the format of
  a home sealed before profiles were recorded, whose slot has no ``db`` field. It keeps opening
  and working; ``uomp secrets unseal`` then ``seal`` moves a home to the current profile.

A key travels with its file's profile (:class:`DbKey`), so a connection, a conversion and a backup
copy always use the settings of the file they open. The profile is not secret: a wrong one cannot
open a file (the page HMAC under the key fails on page 1), and :func:`other_profile` names it in the
refusal.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway import sqldriver
from gateway.atrest import vault
from gateway.config import Paths
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import fsync_dir

SQLITE_HEADER = b"SQLite format 3\x00"


@dataclass(frozen=True)
class Profile:
    """A SQLCipher file format: the statements that follow the key (empty: SQLCipher 4's defaults)."""

    name: str
    settings: tuple[tuple[str, str], ...]

    def pragmas(self, schema: str = "") -> list[str]:
        """The ``PRAGMA`` statements that select this format, for ``schema`` (an attached database)."""
        prefix = f"{schema}." if schema else ""
        return [f"PRAGMA {prefix}{name} = {value}" for name, value in self.settings]


LEGACY = Profile("sqlcipher4", ())
CURRENT = Profile("sqlcipher4-sha256", (("cipher_hmac_algorithm", "HMAC_SHA256"), ("cipher_page_size", "4096")))
PROFILES: dict[str, Profile] = {p.name: p for p in (LEGACY, CURRENT)}


class DbKey(bytes):
    """A 256-bit SQLCipher key and the :class:`Profile` of the files it opens. ``repr`` never shows
    the key. Plain ``bytes`` given as a key are for files of the :data:`CURRENT` profile."""

    profile: Profile

    def __new__(cls, key: bytes, profile: Profile) -> DbKey:
        out = super().__new__(cls, key)
        out.profile = profile
        return out

    def __repr__(self) -> str:
        return f"DbKey(profile={self.profile.name!r})"


def profile_of(key: bytes) -> Profile:
    """The file format ``key`` is for (:class:`DbKey`), :data:`CURRENT` for plain bytes."""
    return key.profile if isinstance(key, DbKey) else CURRENT


def _key_pragma(key: bytes) -> str:
    if len(key) != 32:
        raise ValueError("a 256-bit key")
    return f"PRAGMA key = \"x'{key.hex()}'\""


def connect(target: str, key: bytes, **kwargs: Any) -> Any:
    """A SQLCipher connection to ``target`` with ``key`` (the first statement, as SQLCipher requires)
    and its profile's settings. Temporary tables and sort spills stay in memory."""
    conn = sqldriver.cipher().connect(target, **kwargs)
    try:
        conn.execute(_key_pragma(key))
        for pragma in profile_of(key).pragmas():
            conn.execute(pragma)
        conn.execute("PRAGMA temp_store = MEMORY")
    except BaseException:
        conn.close()
        raise
    return conn


def other_profile(target: str, key: bytes) -> Profile | None:
    """The profile, other than ``key``'s, that opens ``target`` under ``key``; None when none does.
    Only for naming a refusal: run after ``key`` failed to open the file, never on the way in."""
    for profile in PROFILES.values():
        if profile == profile_of(key):
            continue
        try:
            conn = connect(target, DbKey(key, profile), uri=target.startswith("file:"))
        except sqldriver.ERRORS:
            continue
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
            return profile
        except sqldriver.ERRORS:
            continue
        finally:
            conn.close()
    return None


def is_not_a_database(exc: BaseException) -> bool:
    """True for SQLite's "file is not a database" (a key or profile that does not open the file)."""
    if not isinstance(exc, sqldriver.DATABASE) or isinstance(exc, sqldriver.OPERATIONAL):
        return False
    return str(getattr(exc, "sqlite_errorname", "") or "") == "SQLITE_NOTADB" or "not a database" in str(exc)


def profile_mismatch(target: str, key: bytes, exc: BaseException, what: str) -> UompError | None:
    """KEY_ERROR (reason ``profile_mismatch``) when ``key`` did not open ``target`` (``exc``) because
    the file is of another profile than the one its home's slot names; None otherwise."""
    if not is_not_a_database(exc):
        return None
    found = other_profile(target, key)
    if found is None:
        return None
    return UompError(
        ErrorCode.KEY_ERROR,
        f"the {what} is a SQLCipher file of format {found.name}, but this home's master key slot names "
        f"{profile_of(key).name}: the slot's 'db' record is missing or wrong; put back this home's master.json "
        "from the backup the file came with (nothing was changed)",
        details={"reason": "profile_mismatch", "profile": found.name, "slot_profile": profile_of(key).name},
    )


def is_plaintext(path: Path) -> bool:
    """True for a plain SQLite file (its fixed header); False for SQLCipher, empty or missing."""
    try:
        with open(path, "rb") as fh:
            return fh.read(16) == SQLITE_HEADER
    except FileNotFoundError:
        return False


def home_profile(paths: Paths) -> Profile:
    """The file format of the sealed home's databases: the ``db`` field of its slot (see above; none:
    :data:`LEGACY`). A name this version does not know is KEY_ERROR (reason ``unknown_profile``)."""
    name = vault.read_slot(paths).get("db", LEGACY.name)
    profile = PROFILES.get(name) if isinstance(name, str) else None
    if profile is None:
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{paths.master_slot} names a database format this version does not know ({str(name)[:40]!r}); "
            "upgrade, or put back the master.json the home's databases were sealed with",
            details={"reason": "unknown_profile"},
        )
    return profile


def memory_key(paths: Paths) -> DbKey:
    """The memory store's SQLCipher key, derived from the unlocked master key, with the home's profile."""
    return DbKey(vault.master(paths).subkey("memory-db"), home_profile(paths))


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


def key_for(paths: Paths) -> DbKey | None:
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
    conn = (
        connect(uri, src_key, uri=True, isolation_level=None) if src_key else sqldriver.cipher().connect(uri, uri=True)
    )
    try:
        conn.isolation_level = None
        conn.execute("PRAGMA busy_timeout = 5000")
        if conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()[0][0] != 0:
            raise UompError(ErrorCode.STORE_BUSY, f"the {what} is in use by another process; stop it and try again")
        version = int(conn.execute("PRAGMA user_version").fetchall()[0][0])
        rows = int(conn.execute("SELECT count(*) FROM sqlite_master").fetchall()[0][0])
        dst = f"\"x'{dst_key.hex()}'\"" if dst_key else "''"
        conn.execute(f"ATTACH DATABASE ? AS conv KEY {dst}", (str(tmp),))
        for pragma in profile_of(dst_key).pragmas("conv") if dst_key else []:
            conn.execute(pragma).fetchall()
        conn.execute("SELECT sqlcipher_export('conv')").fetchall()
        conn.execute(f"PRAGMA conv.user_version = {version}").fetchall()
        conn.execute("DETACH DATABASE conv").fetchall()
    finally:
        conn.close()
    check_uri = tmp.resolve().as_uri() + "?mode=rw"
    check = connect(check_uri, dst_key, uri=True) if dst_key else sqldriver.cipher().connect(check_uri, uri=True)
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
