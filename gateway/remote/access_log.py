"""The gateway's access log: durable, append-only, hash-chained JSON Lines (spec §15.4, §18).

Every request the gateway answers becomes one event of type ``gateway_access``. A later stage
batches events into RFC 9162 Merkle trees and anchors the roots on a chain (§18.4.2), so the log
is built to be read back by sequence number and to make tampering evident on its own.

File format (one file, created 0600 in a 0700 directory):

* one event per line, UTF-8 JSON in canonical form: keys sorted, no whitespace
  (``separators=(",", ":")``), non-ASCII kept as UTF-8, no NaN/Infinity; each line ends in ``\\n``;
* the log adds three fields to every event: ``seq`` (1, 2, 3, ... continuing across restarts),
  ``timestamp`` (ISO 8601 UTC, millisecond resolution, ``Z`` suffix) and ``prev``: the hex
  SHA-256 of the previous line's bytes *without* its ``\\n`` (``"0" * 64`` for the first line);
  ``type`` defaults to ``gateway_access``.

:func:`verify_chain` walks a file and checks seq contiguity, every ``prev`` link and the
canonical form; it raises :class:`ChainError` naming the first bad seq. What the chain alone
cannot show is a cut-off tail (drop the last lines and the rest still verifies) or a rewritten
last line: the anchored Merkle roots cover that.

Durability without an fsync per request (group commit, as :mod:`gateway.guard.audit` does):
:meth:`AccessLog.append` is synchronous and cheap (it assigns seq, timestamp and prev and
buffers the encoded line); ``await`` :meth:`AccessLog.flush` returns once every event appended
before the call is written and fsynced. One writer thread takes *everything* pending, writes it
with ``pwrite`` at the end of the durable part and fsyncs once, so under load one fsync covers
many requests (``batches_written`` counts them). Batches are taken on the writer thread itself,
so file order is seq order whoever triggers the write. A failed write is rolled back (truncate
to the durable size) and kept for the next attempt; waiters get ``STORE_UNAVAILABLE``.

Crash recovery on open: a crash mid-write can leave a torn last line (no ``\\n``); no flush ever
reported it durable, so it is truncated away, and seq and prev continue from the last complete
line. An exclusive ``flock`` keeps a second writer (another process or another instance) out.

Bounded: at most ``max_pending`` events / ``max_pending_bytes`` bytes wait for the writer
(beyond that, ``append`` raises ``STORE_UNAVAILABLE`` instead of growing), one line is at most
:data:`MAX_EVENT_BYTES`, a read returns at most :data:`MAX_READ` events.

Events must never hold a token, key material or a memory value. Keeping them out is the
caller's job; as a guard, :meth:`AccessLog.append` refuses (``ValueError``) an event with a field,
at any depth, named like one (:data:`FORBIDDEN_FIELDS`, or ending in ``_token``).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from gateway.errors import UompError
from gateway.fsutil import ensure_private_dir, fsync_dir

log = logging.getLogger(__name__)

GENESIS_PREV = "0" * 64
EVENT_TYPE = "gateway_access"
MAX_EVENT_BYTES = 64 * 1024  # one encoded line, without its newline
MAX_PENDING_EVENTS = 100_000  # events appended but not yet handed to the writer
MAX_PENDING_BYTES = 64 * 1024 * 1024  # bytes of those events
MAX_READ = 1000  # events per read
MAX_DEPTH = 8  # nesting of dicts/lists inside one event
MAX_TYPE_LENGTH = 64

RESERVED_FIELDS = frozenset({"seq", "timestamp", "prev"})
FORBIDDEN_FIELDS = frozenset({
    "token", "access_token", "refresh_token", "id_token", "bearer", "authorization",
    "proxy_authorization", "cookie", "set_cookie", "dpop", "value", "values", "ciphertext",
    "plaintext", "password", "passphrase", "secret", "private_key", "key_material",
})

_SCAN_WINDOW = 64 * 1024  # below this many bytes, read() stops bisecting and scans lines
_TAIL_CHUNK = 64 * 1024


class ChainError(UompError, ValueError):
    """The access log file is damaged or was altered.

    A :class:`UompError` (code ``INTERNAL``) so the CLI reports it like any other failure, and a
    ``ValueError`` for callers that treat it as bad data. ``seq`` is the first sequence number
    that does not verify (``None`` when it cannot be known).
    """

    def __init__(self, reason: str, *, seq: int | None = None) -> None:
        where = f"at seq {seq}" if seq is not None else "at its last line"
        super().__init__("INTERNAL", f"access log chain broken {where}: {reason}",
                         details={"seq": seq} if seq is not None else None)
        self.seq = seq
        self.reason = reason


# ------------------------------------------------------------------------------------ format


def line_hash(line: bytes) -> str:
    """Hex SHA-256 of one line's bytes, without its trailing newline (the next line's ``prev``)."""
    return hashlib.sha256(line).hexdigest()


def encode_record(record: Mapping[str, Any]) -> bytes:
    """The canonical bytes of one line (no newline)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _iso_ms(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _check_value(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError("access log event nested too deeply")
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("access log event holds a non-finite number")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError("access log event field names must be strings")
            norm = k.lower().replace("-", "_")
            if norm in FORBIDDEN_FIELDS or norm.endswith("_token"):
                raise ValueError(f"access log event must not carry a field named {k!r} "
                                 "(no tokens, key material or memory values)")
            _check_value(v, depth + 1)
        return
    if isinstance(value, list | tuple):
        for v in value:
            _check_value(v, depth + 1)
        return
    raise ValueError(f"access log event holds a value of type {type(value).__name__}")


def _prepare(event: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(event, Mapping):
        raise ValueError("access log event must be a mapping")
    reserved = RESERVED_FIELDS.intersection(event)
    if reserved:
        raise ValueError(f"access log event must not set {sorted(reserved)}: the log assigns them")
    _check_value(event, 0)
    record = dict(event)
    kind = record.setdefault("type", EVENT_TYPE)
    if not isinstance(kind, str) or not kind or len(kind) > MAX_TYPE_LENGTH:
        raise ValueError("access log event type must be a short non-empty string")
    return record


# ---------------------------------------------------------------------------- file helpers


def _rfind_newline(fd: int, end: int) -> int:
    """Offset of the last ``\\n`` before ``end``, or -1."""
    pos = end
    while pos > 0:
        start = max(0, pos - _TAIL_CHUNK)
        chunk = os.pread(fd, pos - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i
        pos = start
    return -1


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _parse_line(line: bytes, *, seq: int | None) -> dict[str, Any]:
    try:
        rec = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ChainError("line is not UTF-8 JSON", seq=seq) from None
    if not isinstance(rec, dict):
        raise ChainError("line is not a JSON object", seq=seq)
    found = rec.get("seq")
    if type(found) is not int or found < 1:
        raise ChainError("line has no valid seq", seq=seq)
    return rec


def _locate(f: IO[bytes], size: int, after_seq: int) -> int:
    """A line start at or before the first line whose seq > ``after_seq`` (lines are in seq order).

    Bisects on byte offsets (O(log n) reads) until the window is small, then the caller scans.
    Invariant: ``lo`` is a line start and every line before it has seq <= after_seq; ``hi`` is a
    line start (or ``size``) at which seq > after_seq.
    """
    lo, hi = 0, size
    while hi - lo > _SCAN_WINDOW:
        mid = (lo + hi) // 2
        f.seek(mid)
        f.readline()  # skip to the next line start
        start = f.tell()
        if start >= hi:
            break
        line = f.readline()
        if _parse_line(line.rstrip(b"\n"), seq=None)["seq"] <= after_seq:
            lo = start + len(line)
        else:
            hi = start
    return lo


def _consume_exception(task: asyncio.Task[None]) -> None:
    # Every waiter sees the writer's error; this only keeps asyncio from warning when none is left.
    if not task.cancelled():
        task.exception()


# ---------------------------------------------------------------------------------- the log


class AccessLog:
    """Append-only, hash-chained, group-committed access log. See the module docstring."""

    def __init__(self, path: Path, *, max_pending: int = MAX_PENDING_EVENTS,
                 max_pending_bytes: int = MAX_PENDING_BYTES,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._clock = clock
        ensure_private_dir(self.path.parent)
        existed = self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UompError("STORE_UNAVAILABLE", "access log is in use by another writer") from None
            os.fchmod(fd, 0o600)
            size, last_seq, prev, torn = self._recover(fd)
        except BaseException:
            os.close(fd)
            raise
        if not existed:
            fsync_dir(self.path.parent)
        self._fd = fd
        self.recovered_bytes = torn  # bytes of a torn last line cut off on open
        self.batches_written = 0  # write + fsync rounds (one per group commit)
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="access-log-writer")
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._last_seq = last_seq  # appended (assigned)
        self._prev = prev  # hash of the last appended line
        self._durable_seq = last_seq  # written and fsynced
        self._durable_size = size
        self._writer: asyncio.Task[None] | None = None
        self._closed = False
        self._broken = False  # a failed write could not be rolled back: refuse everything

    @staticmethod
    def _recover(fd: int) -> tuple[int, int, str, int]:
        """(size, last seq, prev hash, torn bytes cut) from the file's tail."""
        size = os.fstat(fd).st_size
        end = _rfind_newline(fd, size) + 1  # just past the last newline; 0 when there is none
        torn = size - end
        if torn:
            os.ftruncate(fd, end)
            os.fsync(fd)
            log.warning("access log: cut %d bytes of a torn last line", torn)
        if end == 0:
            return 0, 0, GENESIS_PREV, torn
        start = _rfind_newline(fd, end - 1) + 1
        line = os.pread(fd, end - 1 - start, start)
        rec = _parse_line(line, seq=None)
        return end, int(rec["seq"]), line_hash(line), torn

    # ----------------------------------------------------------------------------- writing

    def append(self, event: Mapping[str, Any]) -> int:
        """Buffer one event; return its seq. Durable only once a later :meth:`flush` returns."""
        record = _prepare(event)
        with self._lock:
            if self._closed or self._broken:
                raise UompError("STORE_UNAVAILABLE", "access log is closed")
            if len(self._pending) >= self._max_pending or self._pending_bytes >= self._max_pending_bytes:
                raise UompError("STORE_UNAVAILABLE", "access log writer is behind: too many pending events")
            seq = self._last_seq + 1
            record["seq"] = seq
            record["timestamp"] = _iso_ms(self._clock())
            record["prev"] = self._prev
            try:
                line = encode_record(record)
            except (UnicodeEncodeError, TypeError, ValueError):
                raise ValueError("access log event cannot be encoded as UTF-8 JSON") from None
            if len(line) > MAX_EVENT_BYTES:
                raise ValueError(f"access log event larger than {MAX_EVENT_BYTES} bytes")
            self._pending.append(line + b"\n")
            self._pending_bytes += len(line) + 1
            self._last_seq = seq
            self._prev = line_hash(line)
            return seq

    def _commit(self) -> None:
        """Write and fsync everything pending: one batch. Runs on the writer thread only."""
        with self._lock:
            if self._broken:
                raise UompError("STORE_UNAVAILABLE", "access log is unusable after a failed write")
            if not self._pending:
                return
            batch, self._pending = self._pending, []
            nbytes, self._pending_bytes = self._pending_bytes, 0
            upto = self._last_seq
            offset = self._durable_size
        data = b"".join(batch)
        try:
            _pwrite_all(self._fd, data, offset)
            os.fsync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, offset)
            except OSError:
                self._broken = True
            with self._lock:
                self._pending[:0] = batch  # keep them, in order, for the next attempt
                self._pending_bytes += nbytes
            log.error("access log: write failed (%s)", type(exc).__name__)
            raise UompError("STORE_UNAVAILABLE", "access log write failed") from exc
        with self._lock:
            self._durable_size = offset + len(data)
            self._durable_seq = upto
            self.batches_written += 1

    async def flush(self) -> None:
        """Return once every event appended before this call is written and fsynced."""
        target = self._last_seq
        while self._durable_seq < target:
            writer = self._writer
            loop = asyncio.get_running_loop()
            if writer is None or writer.done() or writer.get_loop() is not loop:
                writer = self._writer = loop.create_task(self._drain())
                writer.add_done_callback(_consume_exception)
            try:
                await asyncio.shield(writer)
            except UompError:
                if self._durable_seq >= target:  # ours made it; a later batch failed
                    return
                raise

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            await loop.run_in_executor(self._executor, self._commit)

    def flush_sync(self) -> None:
        """Blocking :meth:`flush` (shutdown paths, threads, tests)."""
        target = self._last_seq
        if self._durable_seq < target:
            self._executor.submit(self._commit).result()

    # ----------------------------------------------------------------------------- reading

    @property
    def last_seq(self) -> int:
        """The seq of the last appended event (durable or not); 0 for an empty log."""
        return self._last_seq

    @property
    def durable_seq(self) -> int:
        """Every event up to this seq is on disk."""
        return self._durable_seq

    @property
    def pending(self) -> int:
        return len(self._pending)

    def read_raw(self, *, after_seq: int = 0, limit: int = MAX_READ) -> list[bytes]:
        """The exact bytes (no newline) of durable events with seq > ``after_seq``, in order.

        These bytes are what a Merkle leaf is computed over. ``limit`` is clamped to 1..MAX_READ.
        """
        limit = max(1, min(int(limit), MAX_READ))
        after_seq = max(0, int(after_seq))
        with self._lock:
            size, durable = self._durable_size, self._durable_seq
        if after_seq >= durable:
            return []
        out: list[bytes] = []
        with open(self.path, "rb") as f:
            f.seek(_locate(f, size, after_seq))
            while len(out) < limit and f.tell() < size:
                raw = f.readline()
                if not raw.endswith(b"\n"):
                    break
                line = raw[:-1]
                if out or _parse_line(line, seq=None)["seq"] > after_seq:
                    out.append(line)
        return out

    def read(self, *, after_seq: int = 0, limit: int = MAX_READ) -> list[dict[str, Any]]:
        """Durable events with seq > ``after_seq``, oldest first, at most ``limit`` (<= MAX_READ)."""
        return [json.loads(line) for line in self.read_raw(after_seq=after_seq, limit=limit)]

    # ----------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Flush what is pending, stop the writer thread, release the file (and its lock)."""
        if self._closed:
            return
        try:
            self.flush_sync()
        finally:
            with self._lock:
                self._closed = True
            self._executor.shutdown(wait=True)
            os.close(self._fd)

    def __enter__(self) -> AccessLog:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# ------------------------------------------------------------------------------ verification


def verify_chain(path: Path) -> int:
    """Check a whole access log file; return the number of events.

    Raises :class:`ChainError` at the first line whose seq is not the next one, whose ``prev`` is
    not the hash of the line before, that is not canonical JSON, or that has no newline.
    """
    prev = GENESIS_PREV
    expected = 1
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                raise ChainError("last line is torn (no newline)", seq=expected)
            line = raw[:-1]
            rec = _parse_line(line, seq=expected)
            if rec["seq"] != expected:
                raise ChainError(f"seq is {rec['seq']}, expected {expected}", seq=expected)
            if rec.get("prev") != prev:
                raise ChainError("prev does not match the hash of the previous line", seq=expected)
            if not isinstance(rec.get("timestamp"), str):
                raise ChainError("timestamp missing", seq=expected)
            if encode_record(rec) != line:
                raise ChainError("line is not in canonical form", seq=expected)
            prev = line_hash(line)
            expected += 1
    return expected - 1
