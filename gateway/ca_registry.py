"""The registry of the certificates the user's CA issued: ``$UOMP_HOME/ca/issued.db`` (0600, SQLite WAL).

One row per certificate (serial hex, agent id, validity, status ``active``/``revoked``,
``revoked_at``, the serial it was renewed from and its lineage, the key and certificate
thumbprints tokens are bound to) and the last CRL number; writers hold the CA directory's
``fcntl`` lock (:func:`locked`) and one IMMEDIATE transaction (:func:`registry`). A version-1
``issued.json`` is migrated into it once. Everything that issues, renews, revokes or lists
certificates is :mod:`gateway.ca_store`, which owns the rules; this module only keeps the rows.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import Paths
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import ensure_private_dir

# Registry rows are dropped this long after their certificate expired (they can no longer be used
# or renewed, and an expired certificate needs no CRL entry).
REGISTRY_RETENTION = dt.timedelta(days=30)
# A revoked certificate stays on the CRL until this long after its notAfter (clock skew margin).
CRL_KEEP_AFTER_EXPIRY = dt.timedelta(days=1)
# How long a registry operation waits for another process's write transaction.
REGISTRY_BUSY_TIMEOUT_SECONDS = 10.0


def registry_path(paths: Paths) -> Path:
    """The certificate registry: every certificate the CA issued, and which are revoked."""
    return paths.ca_registry


def legacy_registry_path(paths: Paths) -> Path:
    """The JSON registry of earlier versions: migrated into :func:`registry_path` when first seen."""
    return paths.ca_registry_legacy


@contextlib.contextmanager
def locked(paths: Paths) -> Iterator[None]:
    """The CA lock for one change of CA state at a time (migrating a legacy registry first)."""
    ensure_private_dir(paths.ca_dir, "CA directory")
    fd = os.open(paths.ca_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if legacy_registry_path(paths).exists():
            _migrate_json(paths)
        yield
    finally:
        os.close(fd)  # closing releases the flock


_REGISTRY_SCHEMA = """
CREATE TABLE IF NOT EXISTS certs (
    serial       TEXT PRIMARY KEY,       -- lower-case hex (ca.serial_hex)
    agent_id     TEXT NOT NULL,
    not_before   INTEGER NOT NULL,       -- epoch seconds
    not_after    INTEGER NOT NULL,
    issued_at    INTEGER NOT NULL,
    status       TEXT NOT NULL CHECK (status IN ('active', 'revoked')),
    revoked_at   INTEGER,
    renewed_from TEXT,                   -- the serial this certificate was renewed from
    lineage      TEXT NOT NULL,          -- serial of the first certificate of its renewal chain
    jkt          TEXT,                   -- RFC 7638 thumbprint of its key (tokens bound to it: cnf.jkt)
    x5t          TEXT                    -- RFC 8705 certificate thumbprint (cnf.x5t#S256)
);
CREATE INDEX IF NOT EXISTS certs_agent ON certs (agent_id, issued_at);
CREATE INDEX IF NOT EXISTS certs_parent ON certs (renewed_from);
CREATE INDEX IF NOT EXISTS certs_lineage ON certs (lineage, not_after);
CREATE INDEX IF NOT EXISTS certs_revoked ON certs (status, not_after);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


def ts(value: dt.datetime) -> str:
    """``value`` as an ISO 8601 UTC timestamp."""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_ts(value: Any) -> dt.datetime:
    """An ISO 8601 timestamp with a time zone; ValueError for anything else."""
    if not isinstance(value, str):
        raise ValueError("timestamp is not a string")
    parsed = dt.datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValueError("timestamp has no time zone")
    return parsed


def epoch(value: dt.datetime) -> int:
    """``value`` in whole seconds since the epoch."""
    return int(value.timestamp())


def from_epoch(value: int) -> dt.datetime:
    """Seconds since the epoch as an aware UTC datetime."""
    return dt.datetime.fromtimestamp(value, dt.UTC)


@dataclass
class Entry:
    """One issued certificate in the registry: serial, agent, validity and revocation."""

    serial: str
    agent_id: str
    not_before: int
    not_after: int
    issued_at: int
    status: str  # "active" | "revoked"
    revoked_at: int | None = None
    renewed_from: str | None = None
    lineage: str = ""
    jkt: str | None = None
    x5t: str | None = None


_COLUMNS = (
    "serial",
    "agent_id",
    "not_before",
    "not_after",
    "issued_at",
    "status",
    "revoked_at",
    "renewed_from",
    "lineage",
    "jkt",
    "x5t",
)
_SELECT = "SELECT " + ", ".join(_COLUMNS) + " FROM certs"


class Registry:
    """The issued-certificate registry: one SQLite file (WAL, synchronous=FULL), indexed by serial,
    agent, parent and lineage, so an issuance writes one row instead of rewriting every row."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self.db = db
        self.path = path

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[Entry]:
        try:
            return [Entry(*r) for r in self.db.execute(sql, tuple(args)).fetchall()]
        except sqlite3.Error as exc:
            raise _corrupt(self.path) from exc

    @property
    def crl_number(self) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE name = 'crl_number'").fetchone()
        return int(row[0]) if row else 0

    @crl_number.setter
    def crl_number(self, value: int) -> None:
        self.db.execute(
            "INSERT INTO meta (name, value) VALUES ('crl_number', ?) "
            "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            (value,),
        )

    def by_serial(self, serial: str) -> Entry | None:
        rows = self._rows(_SELECT + " WHERE serial = ?", (serial,))
        return rows[0] if rows else None

    def add(self, e: Entry) -> None:
        self.db.execute(
            "INSERT INTO certs (" + ", ".join(_COLUMNS) + ") VALUES (" + ", ".join("?" * len(_COLUMNS)) + ")",
            tuple(getattr(e, c) for c in _COLUMNS),
        )

    def all(self) -> list[Entry]:
        return self._rows(_SELECT)

    def of_agent(self, agent_id: str) -> list[Entry]:
        return self._rows(_SELECT + " WHERE agent_id = ?", (agent_id,))

    def descendants(self, serial: str) -> list[Entry]:
        """``serial`` and every certificate renewed from it, transitively."""
        return self._rows(
            "WITH RECURSIVE sub(s) AS (SELECT ? UNION SELECT c.serial FROM certs c JOIN sub ON c.renewed_from = sub.s) "
            + _SELECT
            + " WHERE serial IN (SELECT s FROM sub)",
            (serial,),
        )

    def renewals_since(self, agent_id: str, since: int) -> int:
        row = self.db.execute(
            "SELECT COUNT(*) FROM certs WHERE agent_id = ? AND issued_at >= ? AND renewed_from IS NOT NULL",
            (agent_id, since),
        ).fetchone()
        return int(row[0])

    def revoke(self, serials: Iterable[str], at: int) -> None:
        self.db.executemany(
            "UPDATE certs SET status = 'revoked', revoked_at = ? WHERE serial = ? AND status = 'active'",
            [(at, s) for s in serials],
        )

    def revoked_for_crl(self, now: dt.datetime) -> list[tuple[int, dt.datetime]]:
        keep_from = epoch(now - CRL_KEEP_AFTER_EXPIRY)
        rows = self._rows(_SELECT + " WHERE status = 'revoked' AND not_after >= ?", (keep_from,))
        from gateway.core import ca  # (cryptography.x509: the CA's writers need it, the guard's revocation check not)

        return [(ca.parse_serial(e.serial), from_epoch(e.revoked_at or e.issued_at)) for e in rows]

    def prune(self, now: dt.datetime) -> int:
        """Drop whole renewal chains whose every certificate expired more than REGISTRY_RETENTION ago.

        A chain with one live certificate keeps all its ancestors, so revoking a leaked ancestor
        by serial still reaches every certificate renewed from it.
        """
        cutoff = epoch(now - REGISTRY_RETENTION)
        cur = self.db.execute(
            "DELETE FROM certs WHERE lineage IN (SELECT lineage FROM certs GROUP BY lineage HAVING MAX(not_after) < ?)",
            (cutoff,),
        )
        return cur.rowcount


def _corrupt(path: Path) -> UompError:
    return UompError(ErrorCode.CA_ERROR, f"{path} is not a valid certificate registry; fix or restore it")


def _connect(path: Path) -> sqlite3.Connection:
    if not path.exists():
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        db = sqlite3.connect(path, isolation_level=None, timeout=REGISTRY_BUSY_TIMEOUT_SECONDS)
    except sqlite3.Error as exc:
        raise _corrupt(path) from exc
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_REGISTRY_SCHEMA)
    except sqlite3.Error as exc:
        db.close()
        raise _corrupt(path) from exc
    return db


def missing_registry(path: Path) -> UompError:
    """CA_ERROR for a lost registry: restore it, never replace it (a new one would un-revoke every certificate)."""
    return UompError(
        ErrorCode.CA_ERROR,
        f"the certificate registry {path} (every certificate your CA issued and "
        "revoked) is missing; restore it from your backup: a new one would forget every revocation",
    )


@contextlib.contextmanager
def registry(paths: Paths, *, write: bool = False, create: bool = False) -> Iterator[Registry]:
    """The registry; with ``write``, one IMMEDIATE transaction committed when the block ends.

    Writers hold :func:`locked` too (the CRL is written from the same transaction's data). Only
    ``create`` (the making of a new CA) makes a missing registry: anywhere else a missing one is
    CA_ERROR, since an empty registry would un-revoke every revoked certificate at the next CRL."""
    if legacy_registry_path(paths).exists():
        with locked(paths):
            pass  # taking the lock migrates it
    path = registry_path(paths)
    if not create and not path.exists():
        raise missing_registry(path)
    db = _connect(path)
    try:
        if write:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield Registry(db, path)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        else:
            yield Registry(db, path)
    except sqlite3.Error as exc:
        raise _corrupt(path) from exc
    finally:
        db.close()


def _migrate_json(paths: Paths) -> None:
    """Move the rows of a version-1 ``issued.json`` into the SQLite registry (called under the lock)."""
    from gateway.core import ca

    legacy = legacy_registry_path(paths)
    try:
        raw = legacy.read_bytes()
    except FileNotFoundError:
        return  # another process migrated it first
    except OSError as exc:
        raise UompError(ErrorCode.CA_ERROR, f"cannot read {legacy}: {exc.strerror}") from exc
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("version") != 1:
            raise ValueError("unknown registry version")
        number = doc.get("crl_number", 0)
        certs = doc.get("certs", [])
        if not isinstance(number, int) or not isinstance(certs, list):
            raise ValueError("bad registry shape")
        entries: list[Entry] = []
        for row in certs:
            if not isinstance(row, dict) or row.get("status") not in ("active", "revoked"):
                raise ValueError("bad registry row")
            revoked_at = row.get("revoked_at")
            entries.append(
                Entry(
                    serial=ca.serial_hex(ca.parse_serial(str(row["serial"]))),
                    agent_id=str(row["agent_id"]),
                    not_before=epoch(parse_ts(row["not_before"])),
                    not_after=epoch(parse_ts(row["not_after"])),
                    issued_at=epoch(parse_ts(row["issued_at"])),
                    status=row["status"],
                    revoked_at=epoch(parse_ts(revoked_at)) if revoked_at else None,
                    renewed_from=row.get("renewed_from"),
                )
            )
    except (ValueError, TypeError, KeyError, UompError) as exc:
        raise UompError(ErrorCode.CA_ERROR, f"{legacy} is not a valid certificate registry; fix or restore it") from exc
    by_serial = {e.serial: e for e in entries}
    for e in entries:
        root, seen = e, {e.serial}
        while root.renewed_from in by_serial and root.renewed_from not in seen:
            root = by_serial[root.renewed_from]
            seen.add(root.serial)
        e.lineage = root.serial
    db = _connect(registry_path(paths))
    try:
        db.execute("BEGIN IMMEDIATE")
        reg = Registry(db, registry_path(paths))
        for e in entries:
            if reg.by_serial(e.serial) is None:
                reg.add(e)
        reg.crl_number = max(reg.crl_number, number)
        db.execute("COMMIT")
    except sqlite3.Error as exc:
        raise _corrupt(registry_path(paths)) from exc
    finally:
        db.close()
    os.replace(legacy, legacy.with_name(legacy.name + ".migrated"))
