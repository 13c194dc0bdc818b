"""Gateway.db.DbWorker hands results back to the event loop in batches.

Under load, one ``call_soon_threadsafe`` per finished job woke the event loop for every job, and the
loop then fought the worker for the GIL on each SQLite call of the next one: about a third of the
guard's CPU per read. The results of jobs that were already queued now reach the loop together.
What must not change: every caller gets its own result or exception, in job order; a lone job is
answered at once; a batch is bounded (``HANDOVER_JOBS``); a cancelled caller harms nobody else.

The loop's ``call_soon_threadsafe`` is wrapped to count the wake-ups the worker asks for; nothing
else is replaced (a real thread, a real SQLite file).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway import db as dbmod
from gateway.db import DbWorker, connect
from gateway.errors import ErrorCode, UompError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def worker() -> Iterator[DbWorker]:
    w = DbWorker("test", what="test database")
    yield w
    w.close()


class _Wakes:
    """Counts the callbacks other threads schedule on the running loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.count = 0
        self._real = loop.call_soon_threadsafe

        def counting(cb: Any, *args: Any, **kw: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                self.count += 1
            return self._real(cb, *args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        self._loop = loop

    def restore(self) -> None:
        self._loop.call_soon_threadsafe = self._real  # type: ignore[method-assign]


async def _held(worker: DbWorker) -> tuple[threading.Event, asyncio.Future[Any]]:
    """The worker inside a job that waits for the returned gate (and that job's future)."""
    gate = threading.Event()
    first = asyncio.ensure_future(worker.run(gate.wait, 10))
    await asyncio.sleep(0.05)
    return gate, first


async def _queued_behind_a_gate(worker: DbWorker, n: int, job: Any) -> list[Any]:
    """``n`` calls of ``job(i)``, all queued while the worker is held on a gate, then released."""
    gate, first = await _held(worker)
    rest = [asyncio.ensure_future(worker.run(job, i)) for i in range(n)]
    await asyncio.sleep(0)  # every job is queued
    gate.set()
    return await asyncio.gather(first, *rest, return_exceptions=True)


@pytest.fixture
async def wakes() -> AsyncIterator[_Wakes]:
    w = _Wakes(asyncio.get_running_loop())
    yield w
    w.restore()


async def test_queued_results_reach_the_loop_in_one_wake_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker: DbWorker, wakes: _Wakes
) -> None:
    monkeypatch.setattr(dbmod, "HANDOVER_SECONDS", 60.0)  # a busy CI machine may pause the worker
    conn = connect(tmp_path / "x.db", schema="CREATE TABLE IF NOT EXISTS t (v INTEGER);")
    conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(40)])
    n = 20  # below HANDOVER_JOBS
    results = await _queued_behind_a_gate(
        worker, n, lambda i: conn.execute("SELECT v FROM t WHERE v = ?", (i,)).fetchone()[0]
    )
    conn.close()
    assert results == [True, *range(n)]  # each caller its own answer, in order
    # before: one wake-up per job (21); now the gate's job and the 20 behind it share one
    assert wakes.count == 1, wakes.count


async def test_a_lone_job_is_answered_at_once(worker: DbWorker, wakes: _Wakes) -> None:
    for i in range(5):  # nothing queued behind any of them: each is handed over by itself
        assert await asyncio.wait_for(worker.run(lambda v: v * 2, i), timeout=1.0) == i * 2
    assert wakes.count == 5


async def test_a_batch_is_bounded_and_keeps_each_outcome(
    monkeypatch: pytest.MonkeyPatch, worker: DbWorker, wakes: _Wakes
) -> None:
    monkeypatch.setattr(dbmod, "HANDOVER_SECONDS", 60.0)  # the job bound alone, whatever the machine

    def job(i: int) -> int:
        if i % 7 == 3:
            raise UompError(ErrorCode.STORE_UNAVAILABLE, f"job {i} failed")
        return i

    results = await _queued_behind_a_gate(worker, 3 * dbmod.HANDOVER_JOBS, job)
    assert results[0] is True
    for i, r in enumerate(results[1:]):
        if i % 7 == 3:
            assert isinstance(r, UompError) and r.message == f"job {i} failed"
        else:
            assert r == i
    # at most HANDOVER_JOBS results wait for a wake-up: 97 results, 32 + 32 + 32 + 1
    assert wakes.count == 4, wakes.count


async def test_a_slow_job_does_not_hold_back_results_for_long(worker: DbWorker) -> None:
    """Results wait at most HANDOVER_SECONDS for later jobs, checked between jobs."""
    gate, held = await _held(worker)
    quick = [asyncio.ensure_future(worker.run(lambda v: v, i)) for i in range(3)]
    # then a stretch of jobs that take longer than HANDOVER_SECONDS in all, then one that waits for us
    busy = [asyncio.ensure_future(worker.run(threading.Event().wait, dbmod.HANDOVER_SECONDS)) for _ in range(3)]
    release_slow = threading.Event()
    slow = asyncio.ensure_future(worker.run(release_slow.wait, 10))
    await asyncio.sleep(0)
    gate.set()
    # the quick results are handed over while the slow job still runs
    assert await asyncio.wait_for(asyncio.gather(*quick), timeout=5.0) == [0, 1, 2]
    assert await held is True
    assert not slow.done()
    release_slow.set()
    assert await slow is True
    await asyncio.gather(*busy)


async def test_a_cancelled_caller_does_not_lose_the_others(worker: DbWorker) -> None:
    gate, first = await _held(worker)
    futs = [asyncio.ensure_future(worker.run(lambda v: v, i)) for i in range(6)]
    await asyncio.sleep(0)
    futs[2].cancel()
    gate.set()
    results = await asyncio.gather(first, *futs, return_exceptions=True)
    assert isinstance(results[3], asyncio.CancelledError)
    assert [r for j, r in enumerate(results[1:]) if j != 2] == [0, 1, 3, 4, 5]


# ------------------------------------------------------------------ Durable results


async def test_a_durable_result_is_handed_over_after_its_hook() -> None:
    """A job returning ``Durable(ticket, value)``: the worker runs its ``durable`` hook for the
    ticket on its own thread before the caller gets ``value``; a failing hook is the caller's error;
    plain results are not touched. Job order is kept."""
    calls: list[tuple[int, str]] = []
    fail = {7}

    def hook(ticket: int) -> bool:
        calls.append((ticket, threading.current_thread().name))
        if ticket in fail:
            raise UompError(ErrorCode.STORE_UNAVAILABLE, "the log could not be written (disk full)")
        return ticket % 2 == 0

    w = DbWorker("durable", what="test database", durable=hook)
    try:
        assert await w.run(lambda: dbmod.Durable(4, "four")) == "four"
        assert calls == [(4, "db-durable")]
        assert await w.run(lambda: "plain") == "plain"  # no hook for a plain result
        assert len(calls) == 1
        assert await w.run(lambda: dbmod.Durable(5, "five")) == "five"  # the hook did not write: same answer
        with pytest.raises(UompError) as exc:
            await w.run(lambda: dbmod.Durable(7, "seven"))
        assert exc.value.code == ErrorCode.STORE_UNAVAILABLE
        # queued together: each hook runs before the batch is handed over, in job order
        calls.clear()
        got = await _queued_behind_a_gate(w, 4, lambda i: dbmod.Durable(10 + i, i))
        assert got[1:] == [0, 1, 2, 3]
        assert [t for t, _ in calls] == [10, 11, 12, 13]
    finally:
        w.close()
