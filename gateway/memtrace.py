"""Opt-in memory tracing of the gateway and guard processes, for soak runs (off by default).

``UOMP_TRACEMALLOC=1`` starts :mod:`tracemalloc` (``UOMP_TRACEMALLOC_FRAMES`` frames per
allocation, default 1) when the process starts serving; a snapshot is written on ``SIGUSR2`` and,
with ``UOMP_TRACEMALLOC_INTERVAL=S``, every S seconds, into ``$UOMP_HOME/memtrace/`` (0700;
``UOMP_TRACEMALLOC_DIR`` elsewhere): ``<role>-<pid>-<n>.snap`` (a :meth:`tracemalloc.Snapshot.dump`,
file names, line numbers and sizes only, never a value) and one line per snapshot in
``<role>-<pid>.jsonl`` with the memory the Python heap does not show: VmRSS, the bytes
tracemalloc traces, SQLite's own allocator (``sqlite3_memory_used``) and glibc's ``mallinfo2``
(arena bytes in use and free). Compare two snapshots with
``python benchmarks/memtrace_diff.py DIR/guard-123-1.snap DIR/guard-123-9.snap``.

Tracing costs CPU and memory (about 2x allocation time); it is a diagnostic, never for service.
A process that does not trace loads neither :mod:`tracemalloc` nor :mod:`ctypes` for it: both are
imported where a tracer or a reading uses them, so the servers call :func:`start_if_enabled` always.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from gateway.config import Paths, env_seconds, env_switch

_started: list[Tracer] = []


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``struct mallinfo2``, as a ctypes structure."""
    import ctypes

    fields = (
        *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
        *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
    )
    return type("Mallinfo2", (ctypes.Structure,), {"_fields_": [(name, ctypes.c_size_t) for name in fields]})


def _libc() -> Any:
    import ctypes

    with contextlib.suppress(OSError):
        return ctypes.CDLL(None)
    return None


def _sqlite() -> Any:
    """The SQLite library the ``sqlite3`` module runs on (the same copy, so the same counters)."""
    import ctypes
    import ctypes.util
    import sqlite3  # noqa: F401  (loads the library into the process first)

    name = ctypes.util.find_library("sqlite3")
    for candidate in (name, "libsqlite3.so.0"):
        if candidate:
            with contextlib.suppress(OSError):
                return ctypes.CDLL(candidate)
    return None


def native_stats() -> dict[str, int]:
    """VmRSS and the allocators' own counts, in bytes (a field is absent when the platform has none)."""
    import ctypes
    import tracemalloc

    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "RssAnon:")):
                out[line.split(":")[0].lower()] = int(line.split()[1]) * 1024
    if tracemalloc.is_tracing():
        out["traced"], out["traced_peak"] = tracemalloc.get_traced_memory()
    lib = _sqlite()
    if lib is not None and hasattr(lib, "sqlite3_memory_used"):
        lib.sqlite3_memory_used.restype = ctypes.c_int64
        out["sqlite_memory_used"] = int(lib.sqlite3_memory_used())
    libc = _libc()
    if libc is not None and hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _mallinfo2()
        mi = libc.mallinfo2()
        out["malloc_arena"] = int(mi.arena)
        out["malloc_mmap"] = int(mi.hblkhd)
        out["malloc_in_use"] = int(mi.uordblks)
        out["malloc_free"] = int(mi.fordblks)
    return out


class Tracer:
    """Writes numbered snapshots of this process; one per process (:func:`start_if_enabled`)."""

    def __init__(self, directory: Path, role: str, *, interval: float, frames: int) -> None:
        self.directory = directory
        self.role = role
        self.interval = interval
        self.frames = frames
        self.count = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        import tracemalloc

        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        self.snapshot()  # the baseline
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, lambda _s, _f: self._wake.set())
        self._thread = threading.Thread(target=self._run, name="memtrace", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval if self.interval > 0 else None)
            if self._stop.is_set():
                return
            self._wake.clear()
            with contextlib.suppress(OSError):
                self.snapshot()

    def snapshot(self) -> Path:
        with self._lock:
            self.count += 1
            stem = f"{self.role}-{os.getpid()}"
            path = self.directory / f"{stem}-{self.count}.snap"
            import tracemalloc

            snap = tracemalloc.take_snapshot()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(fd)
            snap.dump(str(path))
            line = {"n": self.count, "time": round(time.time(), 1), **native_stats()}
            fd = os.open(self.directory / f"{stem}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as fh:
                fh.write(json.dumps(line) + "\n")
            return path

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()


def start_if_enabled(paths: Paths, role: str) -> Tracer | None:
    """Start tracing this process when ``UOMP_TRACEMALLOC`` is on; ``None`` (and nothing done) otherwise."""
    if not env_switch("UOMP_TRACEMALLOC", False):
        return None
    if _started:
        return _started[0]
    raw_dir = os.environ.get("UOMP_TRACEMALLOC_DIR", "").strip()
    tracer = Tracer(
        Path(raw_dir) if raw_dir else paths.memtrace_dir,
        role,
        interval=env_seconds("UOMP_TRACEMALLOC_INTERVAL", 0.0),
        frames=int(env_seconds("UOMP_TRACEMALLOC_FRAMES", 1, minimum=1, maximum=64)),
    )
    tracer.start()
    _started.append(tracer)
    return tracer


def diff(before: Path, after: Path, *, top: int = 25, key: str = "lineno") -> list[str]:
    """The lines that grew most from ``before`` to ``after`` (two snapshots of one process)."""
    import tracemalloc

    old = tracemalloc.Snapshot.load(str(before))
    new = tracemalloc.Snapshot.load(str(after))
    stats = new.compare_to(old, key)
    return [str(s) for s in stats[:top]]
