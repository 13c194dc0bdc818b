"""One durable group-commit writer for every append-only log (guard audit, gateway access log, and
the Merkle event log that will replace both).

The writer knows nothing about the records: a log gives it a ``write(batch)`` function that makes
a whole batch durable (one SQLite transaction with synchronous=FULL, or one ``pwrite`` + ``fsync``)
or raises having made none of it durable (rolled back). Around that it provides:

* **group commit**: :meth:`GroupCommitWriter.submit` is synchronous and cheap and returns a
  *ticket*; ``await`` :meth:`GroupCommitWriter.flush` (or :meth:`flush_sync` from a thread) returns
  once the ticket's batch is durable. One writer thread takes *everything* pending in one batch,
  so under load one fsync covers many requests. A batch starts only when someone waits for it.
* **one outcome per batch**: a failed batch raises its error (``STORE_UNAVAILABLE``) in every
  waiter of that batch, once; a later flush with nothing pending returns at once, and the next
  batch is tried afresh, so the writer stays usable (a failed batch never wedges it).
  The log's ``on_failed(batch, exc)`` runs on the writer thread *before* the waiters are woken,
  so the log can count the lost records as the refusals their clients are about to get.
* **a bound**: at most ``max_pending`` records / ``max_pending_bytes`` bytes wait; beyond that
  ``submit`` raises ``STORE_UNAVAILABLE`` instead of growing.
* **caller-runs**: :meth:`GroupCommitWriter.write_here` writes the pending batch on the calling
  thread when no batch is being written (the same batch, outcome and bookkeeping as the writer
  thread's; the two never write at once). A thread that has a record to make durable and nothing
  else to do (a database worker answering the guard's only read) saves the hand-over to the writer
  thread and back; under load the writer thread's batches overlap the caller's work instead
  (:meth:`write_here_if_idle`).
* **failing state**: :attr:`GroupCommitWriter.failing` is the reason of the last batch when it
  failed (``None`` once a batch succeeds). :meth:`GroupCommitWriter.probe` runs a batch even with
  nothing pending, so a log in fail-closed mode finds out as soon as its next write fits.

:class:`RefusalTally` is the shared way to *count* rather than queue: records lost while a log
cannot write, or refusals logged too often, become one summary record when writing resumes.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from gateway.errors import ErrorCode, UompError

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger("uomp.durable")

T = TypeVar("T")

FAILED_RANGES_KEPT = 1024  # failed (lo, hi) ticket ranges remembered for flush(ticket)
FAILURE_LOG_INTERVAL_SECONDS = 30.0  # a persisting write failure is logged at most this often


def describe_failure(exc: BaseException) -> str:
    """A short, secret-free reason for a failed write ("disk full", "I/O error", "database is locked")."""
    while exc.__cause__ is not None and isinstance(exc, UompError):
        exc = exc.__cause__
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "disk full"
        return (exc.strerror or errno.errorcode.get(exc.errno, "I/O error")).lower()
    text = str(exc).lower()
    if "full" in text:
        return "disk full"
    if "locked" in text or "busy" in text:
        return "database is locked"
    if "readonly" in text or "read-only" in text:
        return "read-only file system"
    return type(exc).__name__


def _retrieve(fut: asyncio.Future[None]) -> None:
    # Every waiter sees the batch's error; this only keeps asyncio from warning when none is left.
    if not fut.cancelled():
        fut.exception()


class GroupCommitWriter(Generic[T]):
    """See the module docstring."""

    def __init__(
        self,
        name: str,
        write: Callable[[list[T]], None],
        *,
        max_pending: int,
        max_pending_bytes: int = 1 << 62,
        size: Callable[[T], int] = lambda _item: 0,
        on_failed: Callable[[list[T], BaseException], None] | None = None,
        on_written: Callable[[int], None] | None = None,
        first_ticket: int = 0,
    ) -> None:
        self.name = name
        self._write = write
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._size = size
        self._on_failed = on_failed
        self._on_written = on_written
        self._cond = threading.Condition()
        self._pending: list[T] = []
        self._pending_bytes = 0
        self._issued = first_ticket  # last ticket handed out
        self._settled = first_ticket  # every ticket <= this has its outcome
        self._open: Future[None] = Future()  # the outcome of the pending batch
        self._inflight_hi = 0  # highest ticket of the batch being written (0: none)
        self._inflight: Future[None] | None = None
        self._failed: collections.deque[tuple[int, int]] = collections.deque(maxlen=FAILED_RANGES_KEPT)
        self._requested = False
        self._closing = False
        self.failing: str | None = None  # reason of the last batch if it failed
        self.batches_written = 0
        self.batches_failed = 0
        self.batches_here = 0  # batches (either outcome) written by write_here's caller, not the thread
        self._logged_at = 0.0
        self._wrapped: dict[tuple[int, int], tuple[Future[None], asyncio.Future[None]]] = {}
        self._thread = threading.Thread(target=self._run, name=f"{name}-writer", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------------- submitting

    def submit(self, item: T) -> int:
        """Queue one record; return its ticket (for :meth:`flush`). Raises when the bound is hit."""
        n = self._size(item)
        with self._cond:
            if self._closing:
                raise UompError(ErrorCode.STORE_UNAVAILABLE, f"the {self.name} is closed")
            if len(self._pending) >= self._max_pending or self._pending_bytes + n > self._max_pending_bytes:
                raise UompError(
                    ErrorCode.STORE_UNAVAILABLE, f"the {self.name} writer is behind: too many pending records"
                )
            self._pending.append(item)
            self._pending_bytes += n
            self._issued += 1
            return self._issued

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def issued(self) -> int:
        return self._issued

    @property
    def idle(self) -> bool:
        """Nothing pending and no batch being written (a hint for callers: read without the lock)."""
        return not self._pending and self._inflight is None

    # ----------------------------------------------------------------------------- waiting

    def _future_for(
        self, ticket: int | None, *, force: bool = False, defer: bool = False
    ) -> tuple[Future[None] | None, bool]:
        """(future to wait on or None, already known failed). Called with the lock held.

        ``defer``: the caller asks for the batch itself, a little later (see :meth:`flush`)."""
        t = self._issued if ticket is None else ticket
        if t <= self._settled and not force:
            failed = ticket is not None and any(lo <= t <= hi for lo, hi in self._failed)
            return None, failed
        if self._inflight is not None and t <= self._inflight_hi and not force:
            return self._inflight, False
        if not defer:
            self._request_locked()
        return self._open, False

    def _request_locked(self) -> None:
        if not self._requested:
            self._requested = True
            self._cond.notify()

    def _request(self) -> None:
        """A flush's deferred request. Nothing pending: a ``write_here`` took the open batch meanwhile
        (the flush waits on that batch), and an empty one would be a transaction for nothing."""
        with self._cond:
            if self._pending:
                self._request_locked()

    def _failed_error(self) -> UompError:
        return UompError(
            ErrorCode.STORE_UNAVAILABLE, f"the {self.name} could not be written ({self.failing or 'failed'})"
        )

    async def flush(self, ticket: int | None = None) -> None:
        """Return once ``ticket`` (default: every record submitted before this call) is durable.

        Raises ``STORE_UNAVAILABLE`` if its batch failed. With no ticket and nothing unsettled this
        returns at once, even after a failure (each failure is reported to its own waiters once)."""
        import asyncio  # (only async callers need it: the one-shot commands that write sync load none of it)

        with self._cond:
            fut, failed = self._future_for(ticket, defer=True)
            deferred = fut is not None and fut is self._open
        if failed:
            raise self._failed_error()
        if fut is not None:
            if deferred:
                # Ask for the batch once the callbacks already queued on this loop have run: the
                # other waiters woken by the last batch append their records first, so they join
                # this batch instead of each starting a small one (group commit under load).
                asyncio.get_running_loop().call_soon(self._request)
            await asyncio.shield(self._async_of(fut))

    def _async_of(self, fut: Future[None]) -> asyncio.Future[None]:
        """One asyncio future per batch and loop, shared by all its waiters: the writer thread wakes
        them with one call, so they all resume in the same loop iteration (and batch together next)."""
        import asyncio

        loop = asyncio.get_running_loop()
        key = (id(fut), id(loop))
        with self._cond:
            hit = self._wrapped.get(key)
            if hit is None or hit[0] is not fut:
                self._wrapped = {k: v for k, v in self._wrapped.items() if not v[0].done()}
                afut = asyncio.wrap_future(fut, loop=loop)
                afut.add_done_callback(_retrieve)
                hit = self._wrapped[key] = (fut, afut)
            return hit[1]

    def flush_sync(self, ticket: int | None = None) -> None:
        """Blocking :meth:`flush` (threads, shutdown, synchronous services)."""
        with self._cond:
            fut, failed = self._future_for(ticket)
        if failed:
            raise self._failed_error()
        if fut is not None:
            fut.result()

    def kick(self) -> None:
        """Ask for a batch soon (a due summary), without waiting for it."""
        with self._cond:
            self._future_for(None, force=True)

    async def probe(self) -> None:
        """Run one batch now, even an empty one (a log writes its pending summary in it)."""
        import asyncio

        with self._cond:
            fut, _ = self._future_for(None, force=True)
        assert fut is not None
        await asyncio.shield(self._async_of(fut))

    def probe_sync(self) -> None:
        with self._cond:
            fut, _ = self._future_for(None, force=True)
        assert fut is not None
        fut.result()

    # ----------------------------------------------------------------------------- the thread

    def _take_locked(self) -> tuple[list[T], int, int, Future[None]]:
        """Take the pending batch to write it (lock held, no batch in flight)."""
        batch, self._pending = self._pending, []
        self._pending_bytes = 0
        lo, hi = self._settled + 1, self._issued
        fut, self._open = self._open, Future()
        fut.set_running_or_notify_cancel()
        self._inflight, self._inflight_hi = fut, hi
        self._requested = False  # whoever asked for the open batch gets it now
        return batch, lo, hi, fut

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._requested or self._inflight is not None) and not self._closing:
                    self._cond.wait()
                if self._inflight is not None:  # closing while a caller writes: wait for it
                    self._cond.wait()
                    continue
                if self._closing and not self._requested and not self._pending:
                    return
                batch, lo, hi, fut = self._take_locked()
            self._write_settle(batch, lo, hi, fut)

    def write_here_if_idle(self, ticket: int) -> bool:
        """:meth:`write_here` when no batch is being written (True), else nothing (False): under load
        the writer thread's batches overlap the caller's other work, and a caller that waited here would
        only serialize them. (A batch the writer thread starts between this look and the write is
        waited for once, as :meth:`write_here` does.)"""
        with self._cond:
            if self._inflight is not None or self._closing:
                return False
        self.write_here(ticket)
        return True

    def write_here(self, ticket: int) -> None:
        """Make ``ticket`` durable on the calling thread: when no batch is being written, this thread
        writes everything pending (its own records and anyone else's) as one batch, with the same
        outcome for every waiter as a batch of the writer thread; else it waits for that batch and
        looks again. Raises like :meth:`flush` when the ticket's batch failed."""
        while True:
            with self._cond:
                fut, failed = self._future_for(ticket, defer=True)
                if failed:
                    raise self._failed_error()
                if fut is None:
                    return
                if self._inflight is None and not self._closing:
                    batch, lo, hi, fut = self._take_locked()
                    break
                busy = self._inflight
                if busy is None:  # closing: the writer thread finishes what is pending
                    self._request_locked()
                    busy = self._open
            busy.exception()  # wait for that batch (its outcome is looked at again above)
        self.batches_here += 1
        self._write_settle(batch, lo, hi, fut)
        exc = fut.exception()
        if exc is not None:
            raise exc

    def _write_settle(self, batch: list[T], lo: int, hi: int, fut: Future[None]) -> None:
        try:
            self._write(batch)
        except BaseException as exc:
            reason = describe_failure(exc)
            now = time.monotonic()
            if self.failing != reason or now - self._logged_at >= FAILURE_LOG_INTERVAL_SECONDS:
                self._logged_at = now  # said once when it starts, then at most every interval
                log.error(
                    "%s: write failed (%s); refusing with STORE_UNAVAILABLE until a write fits "
                    "(%d failed batch(es) so far)",
                    self.name,
                    reason,
                    self.batches_failed + 1,
                )
            if self._on_failed is not None:
                try:
                    self._on_failed(batch, exc)
                except Exception:
                    log.exception("%s: on_failed hook failed", self.name)
            with self._cond:
                self.failing = reason
                self.batches_failed += 1
                if hi >= lo:
                    self._failed.append((lo, hi))
                self._settled = max(self._settled, hi)
                self._inflight = None
                self._cond.notify_all()
            busy = isinstance(exc, UompError) and exc.code == ErrorCode.STORE_BUSY
            code = ErrorCode.STORE_BUSY if busy else ErrorCode.STORE_UNAVAILABLE
            err = UompError(code, f"the {self.name} could not be written ({reason})")
            err.__cause__ = exc
            fut.set_exception(err)
        else:
            if self.failing is not None:
                log.warning("%s: writing again after %d failed batch(es)", self.name, self.batches_failed)
            with self._cond:
                self.failing = None
                self.batches_written += 1
                self._settled = max(self._settled, hi)
                self._inflight = None
                self._cond.notify_all()
            if self._on_written is not None:
                self._on_written(len(batch))
            fut.set_result(None)

    def close(self) -> None:
        """Write what is pending (errors logged, not raised), stop the thread."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            if self._pending:
                self._requested = True
            fut = self._open if self._pending else None
            self._cond.notify()
        self._thread.join()
        if fut is not None and fut.done() and fut.exception() is not None:
            log.error("%s: records pending at close could not be written", self.name)


# ------------------------------------------------------------------------------- counting


@dataclass
class RefusalTally:
    """Records counted instead of queued, folded into one summary record when writing resumes.

    ``add`` takes a bucket key (say, the session, or the refusal code and source); at most
    ``max_buckets`` distinct keys are kept, the rest go to the ``"other"`` bucket. ``take`` hands
    out a snapshot for the writer to put in its batch; ``done(snapshot)`` subtracts it once that
    batch is durable (if the batch fails, the counts simply stay).
    """

    max_buckets: int = 1000
    counts: dict[str, int] = field(default_factory=dict)
    first: float = 0.0
    last: float = 0.0
    reason: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, key: str, n: int = 1, *, reason: str = "", now: float | None = None) -> None:
        ts = time.time() if now is None else now
        with self._lock:
            if key not in self.counts and len(self.counts) >= self.max_buckets:
                key = "other"
            self.counts[key] = self.counts.get(key, 0) + n
            if not self.first:
                self.first = ts
            self.last = max(self.last, ts)
            if reason:
                self.reason = reason

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def take(self) -> dict[str, Any] | None:
        with self._lock:
            if not self.counts:
                return None
            return {"counts": dict(self.counts), "first": self.first, "last": self.last, "reason": self.reason}

    def done(self, snap: dict[str, Any]) -> None:
        with self._lock:
            for k, n in snap["counts"].items():
                left = self.counts.get(k, 0) - n
                if left > 0:
                    self.counts[k] = left
                else:
                    self.counts.pop(k, None)
            if not self.counts:
                self.first = self.last = 0.0
                self.reason = ""
            else:
                self.first = max(self.first, snap["last"])


# --------------------------------------------------------------------------- fault injection

FAULT_ENV = "UOMP_FAULT"  # name of the point where the process kills itself (tests only)
FAULT_ARM_ENV = "UOMP_FAULT_ARM"  # a file that must exist for the fault to fire; removed when it does


def fault_point(name: str) -> None:
    """Crash-test hook: ``kill -9`` this process at point ``name`` when the environment asks for it.

    Fires only when ``UOMP_FAULT`` names this point *and* the file named by ``UOMP_FAULT_ARM``
    exists (it is removed first, so one arming is one crash, and a restarted process with the same
    environment runs on). Without both variables this is one dictionary lookup."""
    if os.environ.get(FAULT_ENV) != name:
        return
    arm = os.environ.get(FAULT_ARM_ENV)
    if not arm:
        return
    try:
        os.unlink(arm)
    except FileNotFoundError:
        return
    log.warning("fault injection: killing the process at %s", name)
    os.kill(os.getpid(), signal.SIGKILL)
