"""The event loop the guard and the gateway run on: uvloop when it imports, asyncio's otherwise.

``UOMP_UVLOOP=0`` (or ``false``/``no``/``off``) turns uvloop off. uvloop is libuv under asyncio's
API: the same code runs on both, and the suite runs on asyncio's loop (pytest-asyncio), so the
switch changes speed, not behaviour. ``uomp doctor`` says which loop the servers will use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from gateway.config import switch_on

T = TypeVar("T")


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
