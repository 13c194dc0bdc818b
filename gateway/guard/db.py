"""Opening the guard's SQLite files: WAL, a busy timeout, 0600, errors mapped to stable codes."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from gateway.errors import UompError

BUSY_TIMEOUT_MS = 5000


def connect(path: Path, *, schema: str, synchronous: str = "FULL", code: str = "STORE_UNAVAILABLE",
            what: str = "database") -> sqlite3.Connection:
    """Open (creating 0600 if absent) and apply ``schema``. Any sqlite failure is ``code``."""
    try:
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False,
                               isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError("cannot enable WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.executescript(schema)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(str(path) + suffix, 0o600)
        return conn
    except sqlite3.Error as exc:
        raise UompError(code, f"the {what} is unavailable ({type(exc).__name__})") from exc
    except OSError as exc:
        raise UompError(code, f"the {what} is unavailable ({exc.strerror})") from exc


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection, *, code: str = "STORE_UNAVAILABLE", what: str = "database"
                ) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, ROLLBACK on any error; sqlite errors become ``code``."""
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        raise UompError(code, f"the {what} is unavailable ({type(exc).__name__})") from exc
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException as exc:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise UompError(code, f"the {what} is unavailable ({type(exc).__name__})") from exc
        raise
