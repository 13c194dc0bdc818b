"""The spool replayer waits on an empty spool instead of polling it (an idle gateway has no timer
there), and still replays, with its retry timer, as soon as events were spooled: the guard is real
(on its real Unix socket), started only after the events had to go to the spool."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from gatewaykit import ledger_events
from guardkit import running_guard

from gateway.config import Paths
from gateway.remote.event_sink import EventSink, new_event_id
from tests.remote.test_spool_batches import sink_for

INTERVAL = 0.02  # the replayer's timer in this test


def count_looks(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Each time anyone reads EventSink.backlog (what the replayer looks at), counted."""
    seen: list[float] = []
    real = EventSink.backlog

    def counting(self: EventSink) -> int:
        seen.append(time.monotonic())
        return real.fget(self)  # type: ignore[misc]

    monkeypatch.setattr(EventSink, "backlog", property(counting))
    return seen


async def _until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_an_empty_spool_is_waited_on_and_spooled_events_are_replayed(
    home: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = home
    sink, spool, fwd = sink_for(paths)
    looks = count_looks(monkeypatch)
    task = asyncio.create_task(sink.run_replayer(interval=INTERVAL, backoff_max=INTERVAL * 4))
    try:
        await asyncio.sleep(INTERVAL * 5)
        base = len(looks)
        await asyncio.sleep(INTERVAL * 25)  # ~25 timer periods with nothing spooled
        assert len(looks) - base == 0, f"the idle replayer looked at the spool {len(looks) - base} times"

        # no guard yet: the event goes to the spool, and the replayer's timer runs (and backs off)
        ev = {"id": new_event_id(), "action": "read", "allowed": False, "code": "CERT_REQUIRED", "status": 401}
        fut = sink.append(ev)
        assert fut is not None
        await fut  # durable in the spool
        assert sink.backlog == 1
        base = len(looks)
        await _until(lambda: len(looks) - base >= 3, "the replayer retrying while the guard is away")

        # the guard comes: replayed by the timer alone (nothing else is appended), then quiet again
        async with running_guard(paths, serve_tcp=False):
            await _until(lambda: sink.backlog == 0, "the spooled event replayed")
            assert sink.events_replayed == 1
            assert ledger_events(paths, origin="gateway")
            await asyncio.sleep(INTERVAL * 5)
            base = len(looks)
            await asyncio.sleep(INTERVAL * 25)
            assert len(looks) - base == 0, "the replayer kept polling an empty spool"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fwd.close()
        spool.close()
