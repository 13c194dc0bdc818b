"""Our SQLite files (the guard's databases and the gateway's): opening them (WAL, a busy timeout, 0600),
mapping their errors to stable codes, and keeping every wait for a lock off the event loop.

A neutral module: both ``gateway.guard`` and ``gateway.remote`` import it; it imports neither.

Another process may hold a write lock on a database at any time (a user's ``sqlite3`` shell with
``BEGIN IMMEDIATE``, a backup tool). SQLite then makes a writer wait (its busy handler) up to the
busy timeout. That wait must never run on the guard's event loop, or every agent stalls behind it.
So each database the request path writes is owned by one :class:`DbWorker`: a single thread that
runs every call on that database in order (which also keeps in-memory state such as the quota
ledger single-threaded), while the event loop goes on serving other requests.

Bounded waits, each a config field (``[guard]``):

* ``db_busy_timeout_seconds``: how long one statement waits for another process's lock;
* ``db_queue_timeout_seconds``: how long a call may wait for its turn on the worker; a call still
  queued after that is refused without touching the database, so a long lock cannot build an
  ever longer queue.

A database that stays locked is ``STORE_BUSY`` (503, retry later); any other SQLite failure is
``STORE_UNAVAILABLE`` (503). A call that has started always runs to its end (a transaction that
committed is never reported as failed because its caller gave up waiting).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gateway import sqldriver
from gateway.errors import ErrorCode, UompError, caused_by

DEFAULT_BUSY_TIMEOUT_SECONDS = 2.0
DEFAULT_QUEUE_TIMEOUT_SECONDS = 5.0

T = TypeVar("T")

# (loop, future, deadline, function, arguments): one call queued for a DbWorker
if TYPE_CHECKING:  # (asyncio is imported by the async callers only: a one-shot command that reads needs none of it)
    import asyncio

    _Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", float, Callable[..., Any], tuple[Any, ...]]

_BUSY_NAMES = ("SQLITE_BUSY", "SQLITE_LOCKED")


def is_busy(exc: BaseException) -> bool:
    """True when ``exc`` is SQLite saying another connection holds a lock (busy / locked)."""
    if not isinstance(exc, sqldriver.OPERATIONAL):
        return False
    name = str(getattr(exc, "sqlite_errorname", "") or "")
    if name:
        return name.startswith(_BUSY_NAMES)
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def db_error(exc: BaseException, *, code: ErrorCode = ErrorCode.STORE_UNAVAILABLE, what: str = "database") -> UompError:
    """The stable error for a SQLite (or OS) failure: STORE_BUSY for a lock held too long, else ``code``.
    The message names the database and the SQLite error name only (never a statement or a value)."""
    if is_busy(exc):
        return UompError(
            ErrorCode.STORE_BUSY,
            f"the {what} is locked by another process; try again shortly",
            details={"reason": str(getattr(exc, "sqlite_errorname", "") or "SQLITE_BUSY")},
        )
    if isinstance(exc, OSError):
        return UompError(code, f"the {what} is unavailable ({exc.strerror})")
    return UompError(code, f"the {what} is unavailable ({type(exc).__name__})")


WAL_TRUNCATE_AT_OPEN_BYTES = 4 * 1024 * 1024  # a -wal larger than this at open is checkpointed away
WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024  # journal_size_limit: what a -wal is cut back to after a checkpoint


def trim_wal(conn: sqlite3.Connection, path: Path) -> None:
    """Bound the -wal file: a large one left by a killed writer (an import) is checkpointed and
    truncated at open, and later checkpoints cut it back to ``WAL_SIZE_LIMIT_BYTES``."""
    conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
    try:
        size = os.stat(str(path) + "-wal").st_size
    except FileNotFoundError:
        return
    if size > WAL_TRUNCATE_AT_OPEN_BYTES:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def connect(
    path: Path,
    *,
    schema: str,
    synchronous: str = "FULL",
    code: ErrorCode = ErrorCode.STORE_UNAVAILABLE,
    what: str = "database",
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT_SECONDS,
    opener: Callable[[Path], Any] | None = None,
) -> sqlite3.Connection:
    """Open (creating 0600 if absent) and apply ``schema``. Any sqlite failure is ``code`` (or STORE_BUSY).
    ``opener(path)``: the connection instead of the standard library's (rows by column name,
    autocommit, usable from any thread), e.g. :func:`gateway.atrest.auditdb.connect`."""
    try:
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
        if opener is None:
            conn = sqlite3.connect(path, timeout=busy_timeout, check_same_thread=False, isolation_level=None)
            conn.row_factory = sqlite3.Row
        else:
            conn = opener(path)
        conn.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError("cannot enable WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")
        trim_wal(conn, path)
        conn.executescript(schema)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(str(path) + suffix, 0o600)
        return conn
    except sqldriver.errors(OSError) as exc:
        raise caused_by(db_error(exc, code=code, what=what), exc)


@contextlib.contextmanager
def transaction(
    conn: sqlite3.Connection, *, code: ErrorCode = ErrorCode.STORE_UNAVAILABLE, what: str = "database"
) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, ROLLBACK on any error; sqlite errors become ``code`` (or STORE_BUSY)."""
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqldriver.ERRORS as exc:
        raise caused_by(db_error(exc, code=code, what=what), exc)
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException as exc:
        with contextlib.suppress(*sqldriver.ERRORS):
            conn.execute("ROLLBACK")
        if isinstance(exc, sqldriver.ERRORS):
            raise caused_by(db_error(exc, code=code, what=what), exc)
        raise


def _deliver(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.cancelled():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


# A worker hands finished results over once this many are waiting, or the oldest has waited this
# long, even when more jobs are queued (see DbWorker._main).
HANDOVER_JOBS = 32
HANDOVER_SECONDS = 0.002


def _deliver_all(results: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for fut, ok, value in results:
        _deliver(fut, ok, value)


def _hand_over(done: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], bool, Any]]) -> None:
    """One callback per event loop for the results ``done`` holds (in job order)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
    for loop, fut, ok, value in done:
        by_loop.setdefault(loop, []).append((fut, ok, value))
    for loop, results in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(_deliver_all, results)


@dataclass(frozen=True)
class Durable:
    """A job's result to hand over once the log record ``ticket`` is durable (:class:`DbWorker`'s
    ``durable`` hook; the caller still awaits the ticket, which then returns at once)."""

    ticket: int
    value: Any


class DbWorker:
    """One thread that runs every call on one database, in order (see the module docstring).

    ``await worker.run(fn, *args)`` from the event loop. A ``sqlite3.Error`` escaping ``fn`` becomes
    STORE_BUSY / STORE_UNAVAILABLE; a call still queued after ``queue_timeout`` seconds is refused
    with STORE_BUSY without running.

    A plain thread fed by a ``queue.SimpleQueue`` rather than a ``ThreadPoolExecutor``: each request
    makes a trip here, and this costs about a third of ``run_in_executor``'s (25 vs 70 us measured).

    ``durable(ticket)``: a job may return :class:`Durable`; before its result is handed over the
    worker calls ``durable`` (the guard: the audit writer's :meth:`~gateway.durable.GroupCommitWriter.
    write_here_if_idle`), which writes the record on this thread when the log's writer is idle, and
    the job's caller gets the log's error instead if that write fails. When the writer is busy it
    returns False and the caller waits for the writer's batch as usual.
    """

    def __init__(
        self,
        name: str,
        *,
        what: str,
        queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_SECONDS,
        durable: Callable[[int], bool] | None = None,
    ) -> None:
        self.what = what
        self.durable = durable
        self.queue_timeout = float(queue_timeout)
        self.refused = 0  # calls refused because they waited in the queue too long (diagnostics)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._main, name=f"db-{name}", daemon=True)
        self._worker.start()
        self._closed = False

    def _main(self) -> None:
        """Run the queued jobs in order; hand their results over in batches (:data:`HANDOVER_JOBS`).

        The results of jobs found already queued are kept until the queue is empty, or
        :data:`HANDOVER_JOBS` of them are done, or the oldest has waited :data:`HANDOVER_SECONDS`
        (checked between jobs), and then reach each loop in one callback. One hand-over per job
        cost the guard about a third of its CPU per read under load: each woke the event loop, which
        then fought this thread for the GIL on every SQLite call of the next job (3.5-6.7 context
        switches per request, against about 1.3 in batches; ``benchmarks/bench_guard_cpu.py``).
        A lone job (no load) is handed over at once."""
        q = self._queue
        done: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], bool, Any]] = []
        oldest = 0.0
        while True:
            if done and (q.empty() or len(done) >= HANDOVER_JOBS or time.monotonic() - oldest >= HANDOVER_SECONDS):
                _hand_over(self._made_durable(done))
                done = []
            job = q.get()
            if job is None:
                _hand_over(self._made_durable(done))
                return
            loop, fut, deadline, fn, args = job
            try:
                result: tuple[bool, Any] = (True, self._job(deadline, fn, args))
            except BaseException as exc:  # handed to the caller, whatever it is
                result = (False, exc)
            if not done:
                oldest = time.monotonic()
            done.append((loop, fut, *result))

    def _made_durable(
        self, done: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], bool, Any]]
    ) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], bool, Any]]:
        """``done`` with each :class:`Durable` result replaced by its value once ``self.durable`` has
        run for it (the first call writes the whole pending batch; later ones find their record
        written and return at once), or by the write's error."""
        out = []
        for loop, fut, ok, value in done:
            if ok and isinstance(value, Durable):
                try:
                    assert self.durable is not None
                    self.durable(value.ticket)
                except BaseException as exc:  # handed to the caller, whatever it is
                    ok, value = False, exc
                else:
                    value = value.value
            out.append((loop, fut, ok, value))
        return out

    def _job(self, deadline: float, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        if time.monotonic() > deadline:
            self.refused += 1
            raise UompError(
                ErrorCode.STORE_BUSY,
                f"the {self.what} is busy (another process holds a lock); try again shortly",
                details={"reason": "QUEUE_TIMEOUT"},
            )
        try:
            return fn(*args)
        except sqldriver.ERRORS as exc:
            raise caused_by(db_error(exc, what=self.what), exc)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the worker thread; the event loop is free meanwhile. A call that has started
        runs to its end even if the caller stops waiting."""
        if self._closed:
            raise UompError(ErrorCode.STORE_UNAVAILABLE, f"the {self.what} is closed")
        import asyncio

        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, fut, time.monotonic() + self.queue_timeout, fn, args))
        return await fut

    def close(self) -> None:
        """Finish queued calls, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._worker.join()
