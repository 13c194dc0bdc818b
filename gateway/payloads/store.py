"""The payload relay's store: sealed payloads on disk, an index in SQLite, single-use upload URLs.

Only ciphertext ever reaches this module; it cannot decrypt (the user's private key is not here).

Layout under ``$UOMP_HOME/payloads/`` (0700): ``index.db`` (WAL), ``blobs/<payload_id>`` (0600, the
sealed bytes), ``tmp/`` (uploads in flight), ``arriving/`` (at home: payloads relayed from a VPS
gateway in flight, :class:`Arrival`).

Durability and crash safety, in the order an upload commits:

1. the body streams into ``tmp/<payload_id>~<session>~<agent>~<random>.part`` (O_EXCL, 0600; named
   so that an upload a crash cut short can be told at start-up) while its length and SHA-256 are
   counted and the size cap is enforced;
2. ``fsync`` the file, check the hash the agent declared, ``rename`` it to ``blobs/<payload_id>``,
   ``fsync`` the directory;
3. insert the index row in one transaction (re-checking the per-session caps there). With
   ``event_id`` the row is *pending*: durable, counted against the caps, holding its id, but
   invisible to every reader (:meth:`get`, :meth:`list`, the guard's routes) until
   :meth:`PayloadStore.publish` marks it *stored*, which the relay does only once the audit event
   with that id is durable. Without ``event_id`` the row is stored at once.

A crash before step 3 leaves a blob or a temporary file without a row: :meth:`PayloadStore.open`
removes those, so a killed upload never leaves a visible partial payload nor an index row without
its blob. A pending row is complete and checked; whoever settles it (the relay at start-up, on a
sweep, or when the agent sends the same upload again) writes its event again under the same id
(the audit log keeps one event per id) and publishes it. A full disk fails the upload with
``PAYLOAD_STORE_FULL`` and removes what it wrote.

Test-only fault points (:func:`fault_hold`): inert unless the environment names the point and an
arm file exists, which only the crash tests set up.

Longer than ~500 lines on purpose: the storage Protocol and its one engine, whose index rows and
ciphertext files are written and published by the same crash-safe steps.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from gateway.contract import token_digest
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import ensure_private_dir, fsync_dir

SCHEMA = """
CREATE TABLE IF NOT EXISTS payloads (
  payload_id TEXT PRIMARY KEY,
  session_id TEXT NOT NULL,
  agent_id TEXT NOT NULL,
  format TEXT NOT NULL,
  size INTEGER NOT NULL,
  hash TEXT NOT NULL,
  encryption TEXT NOT NULL,
  created_at REAL NOT NULL,
  expires_at REAL NOT NULL,
  opened_at REAL,
  state TEXT NOT NULL DEFAULT 'stored',
  event_id TEXT,
  origin TEXT
);
CREATE INDEX IF NOT EXISTS idx_payloads_session ON payloads(session_id);
CREATE INDEX IF NOT EXISTS idx_payloads_expiry ON payloads(expires_at);
CREATE TABLE IF NOT EXISTS upload_urls (
  token_hash TEXT PRIMARY KEY,
  session_id TEXT NOT NULL,
  agent_id TEXT NOT NULL,
  max_size INTEGER NOT NULL,
  expires_at REAL NOT NULL,
  used_at REAL
);
"""

PAYLOAD_ID = re.compile(r"pay_[A-Za-z0-9_-]{8,64}")
HASH = re.compile(r"sha256:[0-9a-f]{64}")
MAX_UPLOAD_URL_TTL = 600.0
PENDING = "pending"  # complete and durable, its audit event not yet confirmed: invisible
ARRIVING = "arriving"  # at home: relayed from a VPS gateway, checked and durable, its arrival event not yet confirmed
STORED = "stored"  # its audit event is durable: a payload
COLUMNS_ADDED = (("state", "TEXT NOT NULL DEFAULT 'stored'"), ("event_id", "TEXT"), ("origin", "TEXT"))

# ----------------------------------------------------------------------------- test-only fault points
FAULT_ENV = "UOMP_FAULT"  # the name of the point (the same variables as gateway.durable.fault_point)
FAULT_ARM_ENV = "UOMP_FAULT_ARM"  # a file that must exist; removed when the point is reached
FAULT_HOLD_SECONDS = 120.0


def fault_hold(name: str) -> None:
    """Crash-test hook: stop this process at point ``name`` so that a test can ``kill -9`` it there.

    Fires only when ``UOMP_FAULT`` names this point *and* the file named by ``UOMP_FAULT_ARM``
    exists (only the crash tests set both). It then removes the arm file, writes
    ``<arm>.held`` (this process's pid) and sleeps; after FAULT_HOLD_SECONDS without being killed it
    kills itself. Without both variables this is one dictionary lookup."""
    if os.environ.get(FAULT_ENV) != name:
        return
    arm = os.environ.get(FAULT_ARM_ENV)
    if not arm:
        return
    try:
        os.unlink(arm)
    except FileNotFoundError:
        return
    held = Path(arm + ".held")
    held.write_text(str(os.getpid()))
    deadline = time.monotonic() + FAULT_HOLD_SECONDS
    while time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), 9)


class PayloadError(UompError):
    """A refused or failed payload operation with a stable code (spec §8.4 names where they exist);
    a :class:`UompError`, so a route answers it as it is."""


@dataclass(frozen=True)
class Limits:
    """The relay's bounds: one payload's size, payloads and bytes per session, and how long they are kept."""

    max_bytes: int = 64 << 20  # one payload's ciphertext
    max_per_session: int = 100  # payloads kept per session
    max_bytes_per_session: int = 256 << 20
    ttl_seconds: float = 7 * 86400.0


@dataclass(frozen=True)
class PayloadMeta:
    """One stored payload's metadata (never its plaintext): ids, format, size, hashes, times."""

    payload_id: str
    session_id: str
    agent_id: str
    format: str
    size: int
    hash: str
    encryption: dict[str, Any]
    created_at: float
    expires_at: float
    opened_at: float | None
    state: str = STORED
    event_id: str | None = None
    origin: dict[str, str] | None = None  # the upload request's audit fields (for a settled event)

    def same_upload(self, *, session_id: str, agent_id: str, format: str, size: int, digest: str) -> bool:
        """True when an upload with these fields is this payload sent again (idempotent retry)."""
        return (self.session_id, self.agent_id, self.format, self.size) == (
            session_id,
            agent_id,
            format,
            size,
        ) and secrets.compare_digest(self.hash, digest)

    def public(self) -> dict[str, Any]:
        return {
            "payload_id": self.payload_id,
            "session_id": self.session_id,
            "agent_id": self.agent_id,
            "format": self.format,
            "size": self.size,
            "hash": self.hash,
            "encryption": self.encryption,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "opened": self.opened_at is not None,
        }


TMP_NAME = re.compile(r"(pay_[A-Za-z0-9_-]{8,64})~([A-Za-z0-9_-]{1,80})~([A-Za-z0-9._-]{1,128})~[0-9a-f]{24}\.part")


@dataclass(frozen=True)
class Interrupted:
    """An upload a crash cut short (its temporary file, named after it, found at start-up)."""

    path: Path
    payload_id: str
    session_id: str
    agent_id: str

    @property
    def event_id(self) -> str:
        """The id of the ``payload_refused`` event recording its removal: the same every time (kept once)."""
        return "gw_" + hashlib.sha256(self.path.name.encode()).hexdigest()[:32]


def tmp_name(payload_id: str, session_id: str, agent_id: str) -> str:
    """``<payload_id>~<session>~<agent>~<random>.part``: whom an interrupted upload was from can be
    told at start-up (a random name when the ids do not fit)."""
    name = f"{payload_id}~{session_id}~{agent_id}~{secrets.token_hex(12)}.part"
    return name if TMP_NAME.fullmatch(name) and len(name) <= 250 else f"{secrets.token_hex(12)}.part"


def new_payload_id() -> str:
    """A fresh random payload id."""
    return "pay_" + secrets.token_urlsafe(18)


def _full(exc: OSError) -> PayloadError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return PayloadError(ErrorCode.PAYLOAD_STORE_FULL, "the payload store's disk is full; nothing was kept")
    return PayloadError(ErrorCode.STORE_UNAVAILABLE, f"the payload store is unavailable ({exc.strerror})")


# ============================================================================ the seam
# What the gateway (uploads, upload URLs) and the guard (the user's listing, download, removal) need
# of a payload store. PayloadStore (files + SQLite index, below) is the one implementation;
# tests/guard/test_seams.py is the behaviour any other must show. Refusals are PayloadError with a code.


class PayloadUploading(Protocol):
    """One upload in flight. Nothing of it is visible to readers before :meth:`commit` returns."""

    size: int  # bytes received so far
    max_bytes: int  # the cap for this upload

    @property
    def hash(self) -> str:
        """``sha256:<hex>`` of the bytes received so far."""
        ...

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ciphertext; PAYLOAD_TOO_LARGE (and the upload aborted) past ``max_bytes``."""
        ...

    def abort(self) -> None:
        """Drop the upload; nothing of it remains."""
        ...

    def commit(
        self,
        *,
        declared_hash: str | None = None,
        declared_size: int | None = None,
        now: float | None = None,
        event_id: str | None = None,
        origin: Mapping[str, str] | None = None,
    ) -> PayloadMeta:
        """Make it a payload, durably, once the declared hash and size match (else
        PAYLOAD_HASH_MISMATCH / PAYLOAD_SIZE_MISMATCH, and nothing is kept); PAYLOAD_EXISTS for an id
        taken meanwhile; PAYLOAD_QUOTA_EXCEEDED when the session's caps would be passed. With
        ``event_id`` it is kept *pending* (invisible) until :meth:`PayloadStorage.publish`."""
        ...


class PayloadStorage(Protocol):
    """The payload store seam: sealed bytes by payload id, per-session caps, single-use upload URLs."""

    limits: Limits

    def begin(
        self,
        *,
        payload_id: str,
        session_id: str,
        agent_id: str,
        format: str,
        encryption: Mapping[str, Any],
        max_bytes: int | None = None,
    ) -> PayloadUploading: ...

    def check_caps(self, session_id: str, *, extra_bytes: int) -> None:
        """PAYLOAD_QUOTA_EXCEEDED if ``extra_bytes`` more for ``session_id`` would pass a cap."""
        ...

    def issue_upload_url(
        self, *, session_id: str, agent_id: str, max_size: int, ttl: float, now: float | None = None
    ) -> tuple[str, float]:
        """A one-time token (and its expiry) bound to the session, the agent and a size."""
        ...

    def consume_upload_url(self, token: str, *, now: float | None = None) -> tuple[str, str, int]:
        """Spend a token once: (session_id, agent_id, max_size); unknown, spent or late: UPLOAD_URL_INVALID."""
        ...

    def get(self, payload_id: str) -> PayloadMeta:
        """NOT_FOUND when there is no such (stored) payload."""
        ...

    def find(self, payload_id: str) -> PayloadMeta | None:
        """The row for this id, pending or stored (for retries and settling); None when there is none."""
        ...

    def pending(self) -> list[PayloadMeta]:
        """Rows whose audit event is not confirmed yet, oldest first."""
        ...

    def publish(self, payload_id: str) -> PayloadMeta:
        """Mark a pending row stored (idempotent); NOT_FOUND when there is no row."""
        ...

    def list(self, *, session_id: str | None = None) -> list[PayloadMeta]: ...

    def open_blob(self, payload_id: str) -> BinaryIO:
        """The sealed bytes, as a file the caller reads and closes; NOT_FOUND when absent."""
        ...

    def read(self, payload_id: str, *, block: int = 1 << 20) -> Iterator[bytes]: ...

    def mark_opened(self, payload_id: str, *, now: float | None = None) -> None: ...

    def delete(self, payload_id: str) -> bool:
        """False when there was no such payload."""
        ...

    def gc(self, *, now: float | None = None) -> int:
        """Remove payloads whose time is up; how many."""
        ...

    def close(self) -> None: ...


# ============================================================================ files + SQLite


class Upload(PayloadUploading):
    """One upload in flight: write ciphertext pieces, then :meth:`commit` or :meth:`abort`. Safe to
    call from several threads: a write still running in one finishes before an abort or a commit
    from another touches the file (the relay writes a block while it reads the next)."""

    def __init__(self, store: PayloadStore, meta: Mapping[str, Any], max_bytes: int, path: Path | None = None) -> None:
        self.store = store
        self.meta = dict(meta)
        self.max_bytes = max_bytes
        self.size = 0
        self._hash = hashlib.sha256()
        self._lock = threading.RLock()
        self.path = path or store.tmp / tmp_name(
            str(meta["payload_id"]), str(meta["session_id"]), str(meta["agent_id"])
        )
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise _full(exc) from exc
        self._fh: BinaryIO | None = os.fdopen(fd, "wb")

    def write(self, data: bytes | bytearray | memoryview) -> None:
        with self._lock:
            self._write(data)

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        if self._fh is None:
            raise PayloadError(ErrorCode.INVALID_REQUEST, "upload already finished")
        if self.size + len(data) > self.max_bytes:
            self.abort()
            raise PayloadError(ErrorCode.PAYLOAD_TOO_LARGE, f"payload exceeds {self.max_bytes} bytes")
        try:
            self._fh.write(data)
        except OSError as exc:
            self.abort()
            raise _full(exc) from exc
        self.size += len(data)
        self._hash.update(data)

    @property
    def hash(self) -> str:
        return "sha256:" + self._hash.hexdigest()

    def abort(self) -> None:
        with self._lock:
            if self._fh is not None:
                with contextlib.suppress(OSError):
                    self._fh.close()
                self._fh = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def commit(
        self,
        *,
        declared_hash: str | None = None,
        declared_size: int | None = None,
        now: float | None = None,
        event_id: str | None = None,
        origin: Mapping[str, str] | None = None,
    ) -> PayloadMeta:
        with self._lock:
            return self._commit(declared_hash, declared_size, now, event_id, origin)

    def _commit(
        self,
        declared_hash: str | None,
        declared_size: int | None,
        now: float | None,
        event_id: str | None,
        origin: Mapping[str, str] | None,
    ) -> PayloadMeta:
        if self._fh is None:
            raise PayloadError(ErrorCode.INVALID_REQUEST, "upload already finished")
        if declared_size is not None and declared_size != self.size:
            self.abort()
            raise PayloadError(ErrorCode.PAYLOAD_SIZE_MISMATCH, f"declared {declared_size} bytes, received {self.size}")
        if declared_hash is not None and not secrets.compare_digest(declared_hash, self.hash):
            self.abort()
            raise PayloadError(ErrorCode.PAYLOAD_HASH_MISMATCH, "the ciphertext does not match the declared hash")
        pid = str(self.meta["payload_id"])
        final = self.store.blobs / pid
        try:
            self._fh.flush()
            fault_hold("payload_before_fsync")
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
            if final.exists():
                raise PayloadError(ErrorCode.PAYLOAD_EXISTS, "a payload with this id already exists")
            os.rename(self.path, final)
            fsync_dir(self.store.blobs)
            fault_hold("payload_after_rename")
        except PayloadError:
            self.abort()
            raise
        except OSError as exc:
            self.abort()
            raise _full(exc) from exc
        try:
            return self.store._index(
                self.meta, size=self.size, digest=self.hash, now=now, event_id=event_id, origin=origin
            )
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final)
            raise


class Arrival(Upload):
    """At home: a payload relayed from a VPS gateway over the uplink (:mod:`gateway.uplink.relay`).

    Streams into ``arriving/<payload_id>~<random>.part`` under an exclusive ``flock`` held while it
    is written (so :meth:`PayloadStore.sweep_arrivals`, in this or another process, removes only the
    files of arrivals whose process died); never into ``tmp/``, which the gateway's start-up
    recovery owns. :meth:`commit` checks size and hash, makes the file durable, renames it into
    ``blobs/`` (over a leftover blob without a row, which only a crash leaves) and inserts the row
    *arriving*: invisible to every reader, and never settled by a gateway, until
    :meth:`PayloadStore.publish` once the arrival's audit event is durable."""

    def __init__(self, store: PayloadStore, meta: Mapping[str, Any], max_bytes: int) -> None:
        super().__init__(store, meta, max_bytes, store.arrivals / f"{meta['payload_id']}~{secrets.token_hex(12)}.part")
        assert self._fh is not None
        fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh O_EXCL file: never contended

    def _commit(
        self,
        declared_hash: str | None,
        declared_size: int | None,
        now: float | None,
        event_id: str | None,
        origin: Mapping[str, str] | None,
    ) -> PayloadMeta:
        if self._fh is None:
            raise PayloadError(ErrorCode.INVALID_REQUEST, "upload already finished")
        if declared_size is not None and declared_size != self.size:
            self.abort()
            raise PayloadError(ErrorCode.PAYLOAD_SIZE_MISMATCH, f"declared {declared_size} bytes, received {self.size}")
        if declared_hash is None or not secrets.compare_digest(declared_hash, self.hash):
            self.abort()
            raise PayloadError(
                ErrorCode.PAYLOAD_HASH_MISMATCH,
                "the relayed ciphertext does not match the hash recorded at upload (changed on the way); refused",
            )
        pid = str(self.meta["payload_id"])
        final = self.store.blobs / pid
        try:
            if self.store.find(pid) is not None:
                raise PayloadError(ErrorCode.PAYLOAD_EXISTS, "a payload with this id already exists")
            self._fh.flush()
            fault_hold("arrival_before_fsync")
            os.fsync(self._fh.fileno())
            os.replace(self.path, final)  # a blob without a row under this id is a crash's leftover
            fsync_dir(self.store.blobs)
            self._fh.close()  # the lock goes with it
            self._fh = None
            fault_hold("arrival_after_rename")
        except PayloadError:
            self.abort()
            raise
        except OSError as exc:
            self.abort()
            raise _full(exc) from exc
        try:
            meta = self.store._index(
                self.meta, size=self.size, digest=self.hash, now=now, event_id=event_id, origin=origin, state=ARRIVING
            )
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final)
            raise
        if not final.exists():  # removed meanwhile by a gateway's start-up recovery (a blob it saw without a row)
            self.store.conn.execute("DELETE FROM payloads WHERE payload_id = ? AND state = ?", (pid, ARRIVING))
            raise PayloadError(ErrorCode.STORE_UNAVAILABLE, "the arrived ciphertext was removed before its row; resend")
        return meta


class PayloadStore(PayloadStorage):
    """The payload relay's store: ciphertext files under ``blobs/`` and their index in ``index.db``."""

    def __init__(self, root: Path, *, limits: Limits | None = None) -> None:
        self.root = ensure_private_dir(root)
        self.blobs = ensure_private_dir(root / "blobs")
        self.tmp = ensure_private_dir(root / "tmp")
        self.arrivals = ensure_private_dir(root / "arriving")
        self.limits = limits or Limits()
        self.interrupted: list[Interrupted] = []  # found by recover(), not yet audited and removed
        db = root / "index.db"
        if not db.exists():
            os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o600))
        self.conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False, timeout=2.0)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(SCHEMA)
        have = {r[1] for r in self.conn.execute("PRAGMA table_info(payloads)")}
        for name, decl in COLUMNS_ADDED:  # an index from before pending rows
            if name not in have:
                with contextlib.suppress(sqlite3.OperationalError):  # added by another process meanwhile
                    self.conn.execute(f"ALTER TABLE payloads ADD COLUMN {name} {decl}")

    @classmethod
    def open(cls, root: Path, *, limits: Limits | None = None) -> PayloadStore:
        store = cls(root, limits=limits)
        store.recover()
        return store

    def close(self) -> None:
        self.conn.close()

    # ------------------------------------------------------------------ crash recovery and expiry

    def recover(self) -> int:
        """Remove uploads a crash left behind: blobs that never got a row and temporary files (an
        upload no event and no answer ever claimed). A temporary file named after its upload is
        listed in :attr:`interrupted` instead, for the relay to record its removal in the audit log
        before :meth:`forget_interrupted` removes it. Pending rows stay: they are complete, and the
        relay settles them (:meth:`pending`)."""
        removed = 0
        self.interrupted = []
        for p in self.tmp.iterdir():
            m = TMP_NAME.fullmatch(p.name)
            if m:  # kept until its removal is audited (forget_interrupted)
                self.interrupted.append(Interrupted(p, m.group(1), m.group(2), m.group(3)))
                continue
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed += 1
        known = {r[0] for r in self.conn.execute("SELECT payload_id FROM payloads")}
        for p in self.blobs.iterdir():
            if p.name not in known:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed += 1
        # Rows whose blob vanished (deleted by hand) are not payloads any more.
        for pid in known:
            if not (self.blobs / pid).exists():
                self.conn.execute("DELETE FROM payloads WHERE payload_id = ?", (pid,))
        return removed

    def sweep_arrivals(self) -> int:
        """Remove the part files of arrivals whose process is gone (their lock is free); how many."""
        removed = 0
        for p in self.arrivals.iterdir():
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # still being written
            finally:
                os.close(fd)  # releases the lock taken, if any
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed += 1
        return removed

    def begin_arrival(
        self, *, payload_id: str, session_id: str, agent_id: str, format: str, encryption: Mapping[str, Any], size: int
    ) -> Arrival:
        """A payload relayed home from a VPS gateway (:class:`Arrival`), at most ``size`` bytes."""
        if not PAYLOAD_ID.fullmatch(payload_id):
            raise PayloadError(
                ErrorCode.INVALID_REQUEST, "payload_id must be pay_ followed by 8-64 URL-safe characters"
            )
        if size > self.limits.max_bytes:
            raise PayloadError(ErrorCode.PAYLOAD_TOO_LARGE, f"payload exceeds {self.limits.max_bytes} bytes")
        self.check_caps(session_id, extra_bytes=size)
        meta = {
            "payload_id": payload_id,
            "session_id": session_id,
            "agent_id": agent_id,
            "format": format,
            "encryption": dict(encryption),
        }
        return Arrival(self, meta, size)

    def arriving(self) -> list[PayloadMeta]:
        """Rows relayed home whose arrival event is not confirmed yet, oldest first."""
        rows = self.conn.execute("SELECT * FROM payloads WHERE state = ? ORDER BY created_at", (ARRIVING,))
        return [self._meta(r) for r in rows]

    def forget_interrupted(self, item: Interrupted) -> None:
        """Remove an interrupted upload's temporary file (its removal is audited)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(item.path)
        with contextlib.suppress(ValueError):
            self.interrupted.remove(item)

    def gc(self, *, now: float | None = None) -> int:
        now = time.time() if now is None else now
        gone = [r[0] for r in self.conn.execute("SELECT payload_id FROM payloads WHERE expires_at <= ?", (now,))]
        for pid in gone:
            self.delete(pid)
        self.conn.execute("DELETE FROM upload_urls WHERE expires_at <= ?", (now - 86400,))
        return len(gone)

    # ------------------------------------------------------------------ writing

    def begin(
        self,
        *,
        payload_id: str,
        session_id: str,
        agent_id: str,
        format: str,
        encryption: Mapping[str, Any],
        max_bytes: int | None = None,
    ) -> Upload:
        if not PAYLOAD_ID.fullmatch(payload_id):
            raise PayloadError(
                ErrorCode.INVALID_REQUEST, "payload_id must be pay_ followed by 8-64 URL-safe characters"
            )
        self.check_caps(session_id, extra_bytes=0)
        cap = self.limits.max_bytes if max_bytes is None else min(max_bytes, self.limits.max_bytes)
        return Upload(
            self,
            {
                "payload_id": payload_id,
                "session_id": session_id,
                "agent_id": agent_id,
                "format": format,
                "encryption": dict(encryption),
            },
            cap,
        )

    def check_caps(self, session_id: str, *, extra_bytes: int) -> None:
        row = self.conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM payloads WHERE session_id = ?", (session_id,)
        ).fetchone()
        if row[0] >= self.limits.max_per_session:
            raise PayloadError(
                ErrorCode.PAYLOAD_QUOTA_EXCEEDED,
                f"this session already has {row[0]} payloads waiting (limit {self.limits.max_per_session})",
            )
        if row[1] + extra_bytes > self.limits.max_bytes_per_session:
            raise PayloadError(
                ErrorCode.PAYLOAD_QUOTA_EXCEEDED,
                f"this session's payloads would exceed {self.limits.max_bytes_per_session} bytes",
            )

    def _index(
        self,
        meta: Mapping[str, Any],
        *,
        size: int,
        digest: str,
        now: float | None,
        event_id: str | None = None,
        origin: Mapping[str, str] | None = None,
        state: str | None = None,
    ) -> PayloadMeta:
        now = time.time() if now is None else now
        state = state or (STORED if event_id is None else PENDING)
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            self.check_caps(str(meta["session_id"]), extra_bytes=size)
            self.conn.execute(
                "INSERT INTO payloads (payload_id, session_id, agent_id, format, size, hash, encryption, created_at,"
                " expires_at, state, event_id, origin) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    meta["payload_id"],
                    meta["session_id"],
                    meta["agent_id"],
                    meta["format"],
                    size,
                    digest,
                    json.dumps(meta["encryption"], sort_keys=True),
                    now,
                    now + self.limits.ttl_seconds,
                    state,
                    event_id,
                    None if origin is None else json.dumps(dict(origin), sort_keys=True),
                ),
            )
            self.conn.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.IntegrityError):
                raise PayloadError(ErrorCode.PAYLOAD_EXISTS, "a payload with this id already exists") from exc
            if isinstance(exc, sqlite3.Error):
                raise PayloadError(
                    ErrorCode.STORE_UNAVAILABLE, f"the payload index is unavailable ({type(exc).__name__})"
                ) from exc
            raise
        found = self.find(str(meta["payload_id"]))
        assert found is not None
        return found

    # ------------------------------------------------------------------ single-use upload URLs

    def issue_upload_url(
        self, *, session_id: str, agent_id: str, max_size: int, ttl: float, now: float | None = None
    ) -> tuple[str, float]:
        """A one-time upload token bound to the session, agent, a size and an expiry (<= 10 min)."""
        now = time.time() if now is None else now
        if not 0 < ttl <= MAX_UPLOAD_URL_TTL:
            raise PayloadError(ErrorCode.INVALID_REQUEST, "an upload URL lives at most 600 seconds")
        if not 0 < max_size <= self.limits.max_bytes:
            raise PayloadError(ErrorCode.PAYLOAD_TOO_LARGE, f"an upload is at most {self.limits.max_bytes} bytes")
        token = secrets.token_urlsafe(32)
        self.conn.execute(
            "INSERT INTO upload_urls (token_hash, session_id, agent_id, max_size, expires_at) VALUES (?, ?, ?, ?, ?)",
            (token_digest(token), session_id, agent_id, max_size, now + ttl),
        )
        return token, now + ttl

    def consume_upload_url(self, token: str, *, now: float | None = None) -> tuple[str, str, int]:
        """Spend a token once: (session_id, agent_id, max_size). Late, reused or unknown: refused alike."""
        now = time.time() if now is None else now
        th = token_digest(token)
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            cur = self.conn.execute(
                "UPDATE upload_urls SET used_at = ? WHERE token_hash = ? AND used_at IS NULL AND expires_at > ?",
                (now, th, now),
            )
            row = (
                self.conn.execute(
                    "SELECT session_id, agent_id, max_size FROM upload_urls WHERE token_hash = ?", (th,)
                ).fetchone()
                if cur.rowcount == 1
                else None
            )
            self.conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            raise
        if row is None:
            raise PayloadError(ErrorCode.UPLOAD_URL_INVALID, "this upload URL is unknown, used or expired")
        return str(row[0]), str(row[1]), int(row[2])

    # ------------------------------------------------------------------ reading

    def _meta(self, row: sqlite3.Row) -> PayloadMeta:
        return PayloadMeta(
            row["payload_id"],
            row["session_id"],
            row["agent_id"],
            row["format"],
            int(row["size"]),
            row["hash"],
            json.loads(row["encryption"]),
            float(row["created_at"]),
            float(row["expires_at"]),
            row["opened_at"],
            row["state"],
            row["event_id"],
            None if row["origin"] is None else json.loads(row["origin"]),
        )

    def get(self, payload_id: str) -> PayloadMeta:
        row = self.conn.execute(
            "SELECT * FROM payloads WHERE payload_id = ? AND state = ?", (payload_id, STORED)
        ).fetchone()
        if row is None:
            raise PayloadError(ErrorCode.NOT_FOUND, "no such payload")
        return self._meta(row)

    def find(self, payload_id: str) -> PayloadMeta | None:
        row = self.conn.execute("SELECT * FROM payloads WHERE payload_id = ?", (payload_id,)).fetchone()
        return None if row is None else self._meta(row)

    def pending(self) -> list[PayloadMeta]:
        rows = self.conn.execute("SELECT * FROM payloads WHERE state = ? ORDER BY created_at", (PENDING,))
        return [self._meta(r) for r in rows]

    def publish(self, payload_id: str) -> PayloadMeta:
        self.conn.execute(
            "UPDATE payloads SET state = ? WHERE payload_id = ? AND state IN (?, ?)",
            (STORED, payload_id, PENDING, ARRIVING),
        )
        return self.get(payload_id)

    def list(self, *, session_id: str | None = None) -> list[PayloadMeta]:
        if session_id:
            rows = self.conn.execute(
                "SELECT * FROM payloads WHERE session_id = ? AND state = ? ORDER BY created_at", (session_id, STORED)
            )
        else:
            rows = self.conn.execute("SELECT * FROM payloads WHERE state = ? ORDER BY created_at", (STORED,))
        return [self._meta(r) for r in rows]

    def open_blob(self, payload_id: str) -> BinaryIO:
        if not PAYLOAD_ID.fullmatch(payload_id):
            raise PayloadError(ErrorCode.NOT_FOUND, "no such payload")
        try:
            return open(self.blobs / payload_id, "rb")
        except FileNotFoundError:
            raise PayloadError(ErrorCode.NOT_FOUND, "no such payload") from None

    def read(self, payload_id: str, *, block: int = 1 << 20) -> Iterator[bytes]:
        """The sealed bytes, in blocks (constant memory)."""
        self.get(payload_id)
        fh = self.open_blob(payload_id)  # closed by the generator's `with`
        with fh:
            while chunk := fh.read(block):
                yield chunk

    def mark_opened(self, payload_id: str, *, now: float | None = None) -> None:
        self.conn.execute(
            "UPDATE payloads SET opened_at = ? WHERE payload_id = ? AND opened_at IS NULL AND state = ?",
            (time.time() if now is None else now, payload_id, STORED),
        )

    def delete(self, payload_id: str) -> bool:
        cur = self.conn.execute("DELETE FROM payloads WHERE payload_id = ?", (payload_id,))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.blobs / payload_id)
        return cur.rowcount == 1
