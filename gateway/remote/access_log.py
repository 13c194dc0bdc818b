"""The gateway's access log: durable, append-only, hash-chained JSON Lines (spec §15.4, §18).

A little over ~500 lines: one class, the append/rotate/read paths of one file set, which share
its lock and its segment index.

Every request the gateway answers becomes one event of type ``gateway_access``. A later stage
batches events into RFC 9162 Merkle trees and anchors the roots on a chain (§18.4.2), so the log
is built to be read back by sequence number and to make tampering evident on its own.

File format (files created 0600 in a 0700 directory; the format helpers, the segment index and
:func:`verify_chain` live in :mod:`gateway.remote.access_chain`, re-exported here):

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

Durability without an fsync per request: the shared group-commit writer
(:mod:`gateway.durable`). :meth:`AccessLog.append` is synchronous and cheap (it checks and
encodes the event and returns a *ticket*); ``await`` :meth:`AccessLog.flush` with that ticket
returns once the event is written and fsynced. ``seq`` and ``prev`` are assigned by the writer
thread when the batch is written, so file order is seq order and a failed batch leaves no gap.

Fail-closed, and true to what clients got: when a batch cannot be written (disk full, I/O
error) it is cut back (truncate to the durable size), its waiters get ``STORE_UNAVAILABLE`` (503)
and its events are *counted*, not kept: they become part of one ``access_log_gap`` event
(``status`` 503, how many, by action, why) written at the head of the first batch that fits.
While the log is failing (:attr:`AccessLog.failing`) the gateway refuses requests before doing
anything (:meth:`AccessLog.ready` tries one small write first, so recovery is as soon as that
fits) and each refusal is counted the same way. Nothing queues up while full.

Unauthenticated traffic does not fill the disk: an event without a verified session, appended
with a ``source``, passes a per-source token bucket (``unauth_events_per_second``, ``unauth_burst``);
the excess is counted per (source, code) and written as one ``access_log_suppressed`` event at
most every ``summary_interval_seconds``.

Rotation and retention: when the active file (``access.jsonl``) would pass ``segment_bytes``,
it is closed into ``access-<first seq>.jsonl`` and a new active file continues the chain (its first
``prev`` is the hash of the closed segment's last line). Each closed segment gets one line in
``access.index.jsonl`` (first/last seq, first ``prev``, last line hash, size, close time).
Segments are deleted oldest first beyond ``max_total_bytes`` or ``retention_days``; their index
lines stay (plus a ``pruned`` line), so :func:`verify_chain` checks every kept segment and the
links between them, starting from the oldest kept one, and a segment missing without a ``pruned``
line is reported as tampering. Rotation is crash-safe: the index line is durable before the
rename, and a rename cut short is finished on open.

Crash recovery on open: a crash mid-write can leave a torn last line (no ``\\n``); no flush ever
reported it durable, so it is truncated away, and seq and prev continue from the last complete
line. An exclusive ``flock`` on ``access.lock`` keeps a second writer out.

Bounded: at most ``max_pending`` events / ``max_pending_bytes`` bytes wait for the writer
(beyond that, ``append`` raises ``STORE_UNAVAILABLE`` instead of growing), one line is at most
:data:`MAX_EVENT_BYTES`, a read returns at most :data:`MAX_READ` events.

Events must never hold a token, key material or a memory value. Keeping them out is the
caller's job; as a guard, :meth:`AccessLog.append` refuses (``ValueError``) an event with a field,
at any depth, named like one (:data:`FORBIDDEN_FIELDS`, or ending in ``_token``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from gateway.config import GatewayConfig
from gateway.durable import GroupCommitWriter, RefusalTally, describe_failure
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import ensure_private_dir, fsync_dir
from gateway.remote.access_chain import EVENT_TYPE as EVENT_TYPE
from gateway.remote.access_chain import FORBIDDEN_FIELDS as FORBIDDEN_FIELDS
from gateway.remote.access_chain import GENESIS_PREV as GENESIS_PREV
from gateway.remote.access_chain import MAX_EVENT_BYTES as MAX_EVENT_BYTES
from gateway.remote.access_chain import ChainError as ChainError
from gateway.remote.access_chain import (
    append_index,
    finish_rotation,
    first_of,
    iso_ms,
    load_index,
    locate,
    parse_line,
    prepare,
    rfind_newline,
)
from gateway.remote.access_chain import encode_record as encode_record
from gateway.remote.access_chain import line_hash as line_hash
from gateway.remote.access_chain import verify_chain as verify_chain

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 100_000  # events appended but not yet handed to the writer
MAX_PENDING_BYTES = 64 * 1024 * 1024  # bytes of those events
MAX_READ = 1000  # events per read


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


# The defaults are the configuration's ([gateway] access_log_*), written once in gateway/config.py.
_DEFAULTS = GatewayConfig()
SEGMENT_BYTES = _DEFAULTS.access_log_segment_bytes  # the active file is closed into a segment beyond this
MAX_TOTAL_BYTES = _DEFAULTS.access_log_max_total_bytes  # kept segments + active file; oldest segments go first
RETENTION_DAYS = _DEFAULTS.access_log_retention_days  # closed segments older than this go
UNAUTH_EVENTS_PER_SECOND = _DEFAULTS.access_log_unauth_events_per_second  # events without a session, per source
UNAUTH_BURST = _DEFAULTS.access_log_unauth_burst
SUMMARY_INTERVAL_SECONDS = _DEFAULTS.access_log_summary_interval_seconds  # one summary event at most this often
MAX_SOURCES = 4096  # token buckets kept; beyond, sources share one
LINE_OVERHEAD = 128  # bytes seq + prev add to an event's line
GAP_TYPE = "access_log_gap"
SUPPRESSED_TYPE = "access_log_suppressed"


class SourceBuckets:
    """Per-source token buckets (bounded map)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._b: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, source: str, now: float) -> bool:
        with self._lock:
            if source not in self._b and len(self._b) >= MAX_SOURCES:
                self._b = {k: v for k, v in self._b.items() if v[0] + (now - v[1]) * self.rate < self.burst}
                if len(self._b) >= MAX_SOURCES:
                    source = "other"
            tokens, last = self._b.get(source, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
            ok = tokens >= 1.0
            self._b[source] = (tokens - 1.0 if ok else tokens, now)
            return ok


class AccessLog:
    """Append-only, hash-chained, group-committed, rotated access log. See the module docstring."""

    def __init__(
        self,
        path: Path,
        *,
        max_pending: int = MAX_PENDING_EVENTS,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        clock: Callable[[], float] = time.time,
        segment_bytes: int = SEGMENT_BYTES,
        max_total_bytes: int = MAX_TOTAL_BYTES,
        retention_days: float = RETENTION_DAYS,
        unauth_events_per_second: float = UNAUTH_EVENTS_PER_SECOND,
        unauth_burst: float = UNAUTH_BURST,
        summary_interval_seconds: float = SUMMARY_INTERVAL_SECONDS,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self.segment_bytes = max(4096, int(segment_bytes))
        self.max_total_bytes = int(max_total_bytes)
        self.retention_seconds = float(retention_days) * 86400
        self.summary_interval = float(summary_interval_seconds)
        self.index_path = self.path.with_name(self.path.stem + ".index.jsonl")
        ensure_private_dir(self.path.parent)
        lock_fd = os.open(self.path.with_name(self.path.stem + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UompError(ErrorCode.STORE_UNAVAILABLE, "access log is in use by another writer") from None
            self._index = load_index(self.index_path)
            finish_rotation(self.path, self._index)
            existed = self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                size, last_seq, prev, torn = self._recover(fd)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            os.close(lock_fd)
            raise
        if not existed:
            fsync_dir(self.path.parent)
        if size == 0 and self._index.segments:
            last = self._index.segments[-1]
            last_seq, prev = int(last["last_seq"]), str(last["last_hash"])
        self._lock_fd = lock_fd
        self._fd = fd
        self.recovered_bytes = torn  # bytes of a torn last line cut off on open
        self._lock = threading.Lock()
        self._size = size  # durable bytes of the active file
        self._last_seq = last_seq  # written and fsynced
        self._prev = prev  # hash of the last written line
        self._active_first: tuple[int, str] | None = first_of(fd, size)
        self._closed = False
        self._broken = False  # a failed write could not be cut back: refuse everything
        self.lost = RefusalTally()  # events clients got 503 for, not yet summarised
        self.suppressed = RefusalTally(max_buckets=MAX_SOURCES)  # rate-limited unauthenticated events
        self._buckets = SourceBuckets(unauth_events_per_second, unauth_burst)
        self._last_summary = self._clock()
        self.events_counted = 0  # events counted instead of written (lost + suppressed), for metrics
        self.writer: GroupCommitWriter[dict[str, Any]] = GroupCommitWriter(
            "access log",
            self._write_batch,
            max_pending=max_pending,
            max_pending_bytes=max_pending_bytes,
            size=lambda rec: int(rec.pop("_size", 0)),
            on_failed=self._count_failed,
            first_ticket=last_seq,
        )

    @staticmethod
    def _recover(fd: int) -> tuple[int, int, str, int]:
        """(size, last seq, prev hash, torn bytes cut) from the file's tail."""
        size = os.fstat(fd).st_size
        end = rfind_newline(fd, size) + 1  # just past the last newline; 0 when there is none
        torn = size - end
        if torn:
            os.ftruncate(fd, end)
            os.fsync(fd)
            log.warning("access log: cut %d bytes of a torn last line", torn)
        if end == 0:
            return 0, 0, GENESIS_PREV, torn
        start = rfind_newline(fd, end - 1) + 1
        line = os.pread(fd, end - 1 - start, start)
        rec = parse_line(line, seq=None)
        return end, int(rec["seq"]), line_hash(line), torn

    # ----------------------------------------------------------------------------- writing

    def append(self, event: Mapping[str, Any], *, source: str | None = None) -> int:
        """Check and queue one event; return its ticket for :meth:`flush` (0: counted, nothing to wait for).

        ``source`` marks an event without a verified session: it is rate-limited per source.
        Raises ``STORE_UNAVAILABLE`` while the log cannot be written (the event is counted as a 503)."""
        record = prepare(event)
        now = self._clock()
        record["timestamp"] = iso_ms(now)
        try:
            size = len(encode_record(record)) + LINE_OVERHEAD
        except (UnicodeEncodeError, TypeError, ValueError):
            raise ValueError("access log event cannot be encoded as UTF-8 JSON") from None
        if size > MAX_EVENT_BYTES:
            raise ValueError(f"access log event larger than {MAX_EVENT_BYTES} bytes")
        if self._closed or self._broken:
            raise UompError(ErrorCode.STORE_UNAVAILABLE, "access log is closed")
        failing = self.writer.failing
        if failing is not None:
            self._count_lost(record, failing)
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE,
                f"the access log cannot be written ({failing}); requests are refused until it can",
            )
        if source is not None and not self._buckets.take(source, now):
            self.suppressed.add(f"{source} {record.get('code') or record.get('action') or '-'}", now=now)
            self.events_counted += 1
            if now - self._last_summary >= self.summary_interval:
                self.writer.kick()
            return 0
        record["_size"] = size
        return self.writer.submit(record)

    def _count_lost(self, record: Mapping[str, Any], reason: str) -> None:
        self.lost.add(str(record.get("action") or record.get("type") or "unknown"), reason=reason)
        self.events_counted += 1

    def _count_failed(self, batch: list[dict[str, Any]], exc: BaseException) -> None:
        reason = describe_failure(exc)
        for rec in batch:
            self._count_lost(rec, reason)

    @property
    def failing(self) -> str | None:
        """Why the last write failed, while the log is in fail-closed mode; else None."""
        return "unusable after a failed write" if self._broken else self.writer.failing

    @property
    def writable(self) -> bool:
        """True while the log takes writes (:meth:`ready` would return at once): a check without a coroutine."""
        return self.writer.failing is None and not self._broken

    async def ready(self) -> None:
        """Raise ``STORE_UNAVAILABLE`` if the log cannot be written; while failing, try one small
        write (the pending summary) first, so the gateway recovers as soon as it fits."""
        if self.writer.failing is None and not self._broken:
            return
        if not self._broken:
            with contextlib.suppress(UompError):
                await self.writer.probe()
        if self.failing is not None:
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE,
                f"the access log cannot be written ({self.failing}); requests are refused until it can",
            )

    def _summaries(self, now: float, *, force: bool) -> tuple[list[dict[str, Any]], list[tuple[RefusalTally, Any]]]:
        out: list[dict[str, Any]] = []
        taken: list[tuple[RefusalTally, Any]] = []
        snap = self.lost.take()
        if snap is not None:
            out.append(
                {
                    "type": GAP_TYPE,
                    "allowed": False,
                    "status": 503,
                    "code": "STORE_UNAVAILABLE",
                    "count": sum(snap["counts"].values()),
                    "by_action": snap["counts"],
                    "reason": f"the access log could not be written ({snap['reason'] or 'failed'}); "
                    "these requests were refused with 503",
                    "first": iso_ms(snap["first"]),
                    "last": iso_ms(snap["last"]),
                    "timestamp": iso_ms(now),
                }
            )
            taken.append((self.lost, snap))
        if force or now - self._last_summary >= self.summary_interval:
            snap = self.suppressed.take()
            if snap is not None:
                out.append(
                    {
                        "type": SUPPRESSED_TYPE,
                        "allowed": False,
                        "count": sum(snap["counts"].values()),
                        "by_source_code": snap["counts"],
                        "reason": "unauthenticated requests beyond the per-source logging rate, counted",
                        "first": iso_ms(snap["first"]),
                        "last": iso_ms(snap["last"]),
                        "timestamp": iso_ms(now),
                    }
                )
                taken.append((self.suppressed, snap))
        return out, taken

    def _write_batch(self, batch: list[dict[str, Any]], *, force_summary: bool = False) -> None:
        """Write and fsync one batch (with any due summary first). Runs on the writer thread only."""
        if self._broken:
            raise UompError(ErrorCode.STORE_UNAVAILABLE, "access log is unusable after a failed write")
        now = self._clock()
        summaries, taken = self._summaries(now, force=force_summary or self._closed)
        records = summaries + batch
        if not records:
            return
        seq, prev = self._last_seq, self._prev
        first: tuple[int, str] | None = None
        lines = []
        for rec in records:
            seq += 1
            rec.pop("_size", None)
            full = dict(rec, seq=seq, prev=prev)
            line = encode_record(full)
            if first is None:
                first = (seq, prev)
            prev = line_hash(line)
            lines.append(line + b"\n")
        data = b"".join(lines)
        if self._size > 0 and self._size + len(data) > self.segment_bytes:
            self._rotate(now)
        offset = self._size
        try:
            _pwrite_all(self._fd, data, offset)
            os.fsync(self._fd)
        except OSError:
            try:
                os.ftruncate(self._fd, offset)
            except OSError:
                self._broken = True
            raise
        with self._lock:
            self._size = offset + len(data)
            self._last_seq, self._prev = seq, prev
            if self._active_first is None:
                self._active_first = first
        for tally, snap in taken:
            tally.done(snap)
        if any(t is self.suppressed for t, _ in taken):
            self._last_summary = now
        if summaries and summaries[0]["type"] == GAP_TYPE:
            log.warning(
                "access log: writing again; %d refused request(s) recorded in one %s event",
                summaries[0]["count"],
                GAP_TYPE,
            )

    def _rotate(self, now: float) -> None:
        """Close the active file into a segment (index line durable first), start a new one."""
        assert self._active_first is not None
        first_seq, first_prev = self._active_first
        name = f"{self.path.stem}-{first_seq:012d}{self.path.suffix}"
        entry = {
            "file": name,
            "first_seq": first_seq,
            "last_seq": self._last_seq,
            "first_prev": first_prev,
            "last_hash": self._prev,
            "bytes": self._size,
            "closed": now,
        }
        append_index(self.index_path, entry)
        self._index.segments.append(entry)
        os.rename(self.path, self.path.with_name(name))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fsync_dir(self.path.parent)
        old, self._fd = self._fd, fd
        os.close(old)
        with self._lock:
            self._size = 0
            self._active_first = None
        self._apply_retention(now)

    def _apply_retention(self, now: float) -> None:
        kept = [e for e in self._index.segments if e["file"] not in self._index.pruned]
        total = sum(int(e["bytes"]) for e in kept) + self._size
        for e in kept:
            if total <= self.max_total_bytes and now - float(e["closed"]) <= self.retention_seconds:
                break
            append_index(self.index_path, {"pruned": e["file"], "at": now})
            self._index.pruned.add(e["file"])
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path.with_name(e["file"]))
            total -= int(e["bytes"])
            log.info("access log: pruned segment %s (seq %s-%s)", e["file"], e["first_seq"], e["last_seq"])

    async def flush(self, ticket: int | None = None) -> None:
        """Return once ``ticket`` (default: every event appended before this call) is written and fsynced."""
        if ticket == 0:
            return
        await self.writer.flush(ticket)

    def flush_sync(self, ticket: int | None = None) -> None:
        """Blocking :meth:`flush` (shutdown paths, threads, tests)."""
        if ticket == 0:
            return
        self.writer.flush_sync(ticket)

    # ----------------------------------------------------------------------------- reading

    @property
    def last_seq(self) -> int:
        """The seq of the last written event; 0 for an empty log."""
        return self._last_seq

    @property
    def durable_seq(self) -> int:
        """Every event up to this seq is on disk."""
        return self._last_seq

    @property
    def batches_written(self) -> int:
        return self.writer.batches_written

    @property
    def pending(self) -> int:
        return self.writer.pending

    def _files(self) -> list[tuple[Path, int, int]]:
        """(path, first seq, byte size to read) of every kept segment and the active file, in order."""
        with self._lock:
            size = self._size
            first = self._active_first
            segs = [e for e in self._index.segments if e["file"] not in self._index.pruned]
        out = [(self.path.with_name(e["file"]), int(e["first_seq"]), int(e["bytes"])) for e in segs]
        if first is not None:
            out.append((self.path, first[0], size))
        return out

    def read_raw(self, *, after_seq: int = 0, limit: int = MAX_READ) -> list[bytes]:
        """The exact bytes (no newline) of durable events with seq > ``after_seq``, in order.

        These bytes are what a Merkle leaf is computed over. ``limit`` is clamped to 1..MAX_READ.
        Events in pruned segments are gone: reading starts at the oldest kept one."""
        limit = max(1, min(int(limit), MAX_READ))
        after_seq = max(0, int(after_seq))
        if after_seq >= self._last_seq:
            return []
        files = self._files()
        out: list[bytes] = []
        for i, (path, first_seq, size) in enumerate(files):
            nxt = files[i + 1][1] if i + 1 < len(files) else None
            if nxt is not None and nxt <= after_seq + 1:
                continue  # everything wanted is later
            with open(path, "rb") as f:
                f.seek(locate(f, size, after_seq) if first_seq <= after_seq else 0)
                while len(out) < limit and f.tell() < size:
                    raw = f.readline()
                    if not raw.endswith(b"\n"):
                        break
                    line = raw[:-1]
                    if out or parse_line(line, seq=None)["seq"] > after_seq:
                        out.append(line)
            if len(out) >= limit:
                break
        return out

    def read(self, *, after_seq: int = 0, limit: int = MAX_READ) -> list[dict[str, Any]]:
        """Durable events with seq > ``after_seq``, oldest first, at most ``limit`` (<= MAX_READ)."""
        return [json.loads(line) for line in self.read_raw(after_seq=after_seq, limit=limit)]

    # ----------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Flush what is pending (and any summary), stop the writer thread, release the files."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.lost.total or self.suppressed.total:
                with contextlib.suppress(UompError):
                    self.writer.probe_sync()
        finally:
            self.writer.close()
            os.close(self._fd)
            os.close(self._lock_fd)

    def __enter__(self) -> AccessLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
