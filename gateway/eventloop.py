"""The event loop the guard and the gateway run on: uvloop when it imports, asyncio's otherwise;
and how their stops end background tasks (:func:`cancel_all`).

``UOMP_UVLOOP=0`` (or ``false``/``no``/``off``) turns uvloop off. uvloop is libuv under asyncio's
API: the same code runs on both, and the suite runs on asyncio's loop (pytest-asyncio), so the
switch changes speed, not behaviour. ``uomp doctor`` says which loop the servers will use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from gateway.config import switch_on

T = TypeVar("T")

log = logging.getLogger("uomp.eventloop")

# How long a stop keeps cancelling a background task that has not ended (then it goes on without it).
CANCEL_SECONDS = 10.0
RECANCEL_SECONDS = 0.2


async def cancel_all(tasks: Sequence[asyncio.Task[Any]], *, seconds: float = CANCEL_SECONDS) -> None:
    """Cancel ``tasks`` and wait for them to end, cancelling again those still running every 0.2 s:
    a cancellation can be lost (Python 3.11's ``asyncio.wait_for`` swallows one that arrives as its
    inner wait completes), and a stop must not wait on it for ever. Bounded by ``seconds``; a task
    that ended with an error, or did not end, is logged (by name), never raised."""
    for t in tasks:
        t.cancel()
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while pending and loop.time() < deadline:
        _done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_SECONDS, seconds))
        for t in pending:
            t.cancel()
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.warning("background task %s ended with %r", t.get_name(), t.exception())
    if pending:
        log.warning("%d background task(s) did not end within %.0f s of the stop", len(pending), seconds)


def uvloop_wanted() -> bool:
    """``UOMP_UVLOOP`` is not switched off (:func:`gateway.config.switch_on`)."""
    return switch_on("UOMP_UVLOOP")


def describe() -> str:
    """``uvloop 0.x`` or ``asyncio (...)``: the loop :func:`run` will use, and why."""
    if not uvloop_wanted():
        return "asyncio (UOMP_UVLOOP=0)"
    try:
        import uvloop
    except ImportError:
        return "asyncio (uvloop is not installed)"
    return f"uvloop {getattr(uvloop, '__version__', '?')}"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop's loop when wanted and installed."""
    if uvloop_wanted():
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)


def release_free_heap() -> None:
    """Once a server is up: hand the C heap's free pages back to the system (glibc ``malloc_trim``).

    Start-up (parsing the config, reading and checking keys and certificates, opening and checking
    the databases) leaves freed memory inside the heap that glibc keeps for later; a server that
    then idles never reuses most of it. Nothing is freed that is in use: the pages come back on
    demand. Elsewhere than glibc (musl, macOS) a no-op."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
