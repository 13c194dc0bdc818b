"""One probe of guard.sock serves the supervisor and the gateway's upstream monitor: while the
supervisor's checks pass (GatewayRunner.guard_checked(None), as ``uomp gateway start`` wires it),
the monitor makes no probes of its own; a failed check there, a failed request, or the
supervisor's silence makes it probe again, and a guard that is gone is still reported down. The
gateway and the guard run for real (tests/gatewaykit.py); the monitor's probes are only counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.config import Paths
from gateway.errors import ErrorCode
from gateway.remote.upstream_health import UpstreamMonitor
from tests.gatewaykit import appliance

INTERVAL = 0.1


def count_probes(monitor: UpstreamMonitor) -> list[float]:
    seen: list[float] = []
    real = monitor.check

    async def counting() -> bool:
        seen.append(time.monotonic())
        return await real()

    monitor.check = counting  # type: ignore[method-assign]
    return seen


async def _until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_supervisor_checks_stand_for_the_monitors_probes(home: Paths) -> None:
    async with appliance(home, upstream_health_interval_seconds=INTERVAL) as app:
        gw = app.gateway
        monitor = gw.monitor
        assert monitor is not None
        probes = count_probes(monitor)

        # nobody vouches: the monitor probes every interval
        await _until(lambda: len(probes) >= 3, "the monitor's own probes")

        # the supervisor's checks pass more often than the interval: no probe of its own
        async def supervisor(stop: asyncio.Event) -> None:
            while not stop.is_set():
                gw.guard_checked(None)
                await asyncio.sleep(INTERVAL / 3)

        stop = asyncio.Event()
        task = asyncio.create_task(supervisor(stop))
        try:
            await asyncio.sleep(INTERVAL * 2)  # a probe already under way may finish
            base = len(probes)
            await asyncio.sleep(INTERVAL * 10)
            assert len(probes) - base <= 1, f"{len(probes) - base} probes while the supervisor's checks passed"
            assert monitor.up is True

            # a failed check at the supervisor: the monitor looks for itself at once
            base = len(probes)
            gw.guard_checked(ErrorCode.STORE_UNAVAILABLE)
            await _until(lambda: len(probes) > base, "a probe after the supervisor's failed check")

            # a failed request: the same
            base = len(probes)
            monitor.request_failed(ErrorCode.STORE_UNAVAILABLE)
            await _until(lambda: len(probes) > base, "a probe after a failed request")
        finally:
            stop.set()
            await task

        # the supervisor falls silent: the monitor's own probes come back, and see a lost socket
        base = len(probes)
        await _until(lambda: len(probes) >= base + 2, "the monitor probing again")
        home.guard_sock.unlink()
        await _until(lambda: monitor.up is False, "the lost guard socket reported")


async def test_one_timer_backs_off_for_both_and_a_failure_brings_it_back(home: Paths) -> None:
    async with appliance(home, upstream_health_interval_seconds=0.05) as app:
        gw = app.gateway
        monitor = gw.monitor
        assert monitor is not None
        monitor.max_interval = 0.4
        waits: list[float] = []
        real = monitor.check

        async def recording() -> bool:
            ok = await real()
            waits.append(monitor.next_check_in)
            return ok

        monitor.check = recording  # type: ignore[method-assign]
        monitor.wake()  # from the first interval, like after a restart
        # its own checks, passing: each doubles the wait before the next, up to the maximum
        await _until(lambda: len(waits) >= 5, "the monitor's own checks")
        assert waits[:5] == [0.1, 0.2, 0.4, 0.4, 0.4]

        # the supervisor's check passed and says its next one is 30 s away: no probe of our own
        # meanwhile (a vouch used to last the monitor's own interval only)
        gw.guard_checked(None, 30.0)
        await asyncio.sleep(0.1)  # a probe already under way may finish
        base = len(waits)
        await asyncio.sleep(1.5)  # more than three of the monitor's backed-off periods
        assert len(waits) == base, f"{len(waits) - base} probes while the supervisor vouched"

        # a failed request: a probe at once, and the guard gone is seen; the wait back to the first
        suspected: list[bool] = []
        monitor.on_suspect = lambda: suspected.append(True)
        home.guard_sock.rename(home.guard_sock.with_name("moved.sock"))
        base = len(waits)
        monitor.request_failed(ErrorCode.STORE_UNAVAILABLE)
        await _until(lambda: len(waits) > base and monitor.up is False, "the probe after a failed request")
        assert waits[base] == 0.05 and suspected  # and the supervisor was told to look too
        home.guard_sock.with_name("moved.sock").rename(home.guard_sock)
        await _until(lambda: monitor.up is True, "the guard back")
