"""The guard's stop ends even when a background task lost its cancellation (Python 3.11's
``asyncio.wait_for`` swallows one that arrives as its inner wait completes: the anchorer's poll is
such a wait_for): the stop cancels again, bounded (gateway/eventloop.py ``cancel_all``), and still
does the rest of its work (the socket removed, the databases closed). A stop that awaited the task
once would wait for ever."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from guardkit import call, guard_config, unix_session

from gateway.anchor.none import NoneBackend
from gateway.config import Paths
from gateway.guard.server import GuardRunner
from gateway.ledger.anchorer import Anchorer, AnchorPolicy

HANG = 30  # a stop still running after this long is the defect (it would never end)


async def ends(stop: Coroutine[Any, Any, None]) -> bool:
    """Whether ``stop`` ends by itself within :data:`HANG` s. Waited on without cancelling it: a
    cancellation from outside (``wait_for``'s time-out) would itself end the stuck task."""
    task = asyncio.get_running_loop().create_task(stop)
    done, _ = await asyncio.wait({task}, timeout=HANG)
    if not done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return bool(done)


class LosesOneCancel(GuardRunner):
    """A guard whose checkpoint loop loses the first cancellation, as a wait_for inside it can."""

    lost = 0

    async def _checkpointer(self) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.lost += 1  # swallowed; the loop goes on
        await super()._checkpointer()


async def test_the_guard_stops_when_a_background_task_loses_a_cancellation(home: Paths) -> None:
    paths = home
    runner = LosesOneCancel(paths, guard_config(), serve_tcp=False)
    await runner.start()
    async with unix_session(paths) as s:
        status, _body, _h = await call(s, "GET", "/v1/health")
        assert status == 200  # serving, its background tasks running
    assert await ends(runner.stop())
    assert runner.lost == 1  # the first cancellation was lost, and the stop went on
    assert not paths.guard_sock.exists() and runner.services is None


class AnchorerLosesOneCancel(Anchorer):
    """An anchoring worker whose round loses the first cancellation."""

    lost = 0

    async def step(self) -> None:
        if self.lost:
            return
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.lost += 1


async def test_the_anchorer_stops_when_its_round_loses_a_cancellation(tmp_path: Path) -> None:
    anchorer = AnchorerLosesOneCancel(tmp_path / "audit.db", NoneBackend(), policy=AnchorPolicy(poll_seconds=0.01))
    anchorer.start()
    await asyncio.sleep(0.05)
    assert await ends(anchorer.stop())
    assert anchorer.lost == 1
    # the partner: a worker that loses nothing stops as before
    plain = Anchorer(tmp_path / "audit.db", NoneBackend(), policy=AnchorPolicy(poll_seconds=0.01))
    plain.start()
    await asyncio.sleep(0.05)
    assert await ends(plain.stop())
