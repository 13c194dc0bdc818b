"""The supervisor's health check of its guard child (gateway/supervisor.py) backs off while it
passes, comes back at once when asked (a request to the guard failed), and a child that exits is
restarted at once, not at the next (backed-off) check. A real guard child (``uomp guard serve``)
on a real socket; the waits between checks are read from what the supervisor reports after each
one (on_health), never from the clock."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from shortdir import short_dir

from gateway.config import Paths
from gateway.supervisor import GuardProcess, guard_command

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def paths() -> Iterator[Paths]:
    import shutil

    top = short_dir("uomp-bo-")  # short: Unix socket names
    subprocess.run([sys.executable, "-m", "gateway.cli.main", "--home", str(top / "home"), "init"], check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    yield Paths(top / "home")
    shutil.rmtree(top, ignore_errors=True)


async def _until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def supervised(
    paths: Paths, *, interval: float, max_interval: float
) -> tuple[GuardProcess, list[tuple[str | None, float]]]:
    checks: list[tuple[str | None, float]] = []
    guard = GuardProcess(
        paths,
        guard_command(paths, serve_tcp=False),
        health_interval=interval,
        health_max_interval=max_interval,
        health_timeout=5.0,
        output=lambda line: None,
    )
    guard.on_health = lambda why, next_in: checks.append((why, next_in))
    return guard, checks


async def test_checks_back_off_while_they_pass_and_come_back_when_asked(paths: Paths) -> None:
    guard, checks = supervised(paths, interval=0.05, max_interval=0.4)
    await guard.start()
    guard.supervise()
    try:
        await _until(lambda: len(checks) >= 6, "six health checks")
        assert all(why is None for why, _ in checks)
        # each pass doubles the wait before the next, up to the maximum, and stays there
        assert [n for _, n in checks[:5]] == [0.1, 0.2, 0.4, 0.4, 0.4]
        # asked (a request to the guard failed): a check at once, the waits from the first again
        base = len(checks)
        guard.check_soon()
        await _until(lambda: len(checks) > base, "the check asked for")
        assert checks[base] == (None, 0.1)
        # and a failing check keeps the first interval (the socket file removed: 3 in a row restart it)
        base = len(checks)
        paths.guard_sock.unlink()
        await _until(lambda: len(checks) >= base + 2, "checks of the lost socket")
        assert [n for why, n in checks[base : base + 2] if why is not None] == [0.05, 0.05]
        await _until(lambda: guard.restarts == 1, "the restart after 3 failed checks")
    finally:
        await guard.stop()


async def test_an_exited_child_is_restarted_at_once_not_at_the_next_check(paths: Paths) -> None:
    guard, checks = supervised(paths, interval=600.0, max_interval=600.0)  # no check within this test
    restarted: list[str] = []
    guard.on_restart = restarted.append
    await guard.start()
    guard.supervise()
    try:
        first = guard.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await _until(lambda: bool(restarted), "the restart of the killed child")
        assert guard.pid != first and guard.running and "killed by SIGKILL" in restarted[0]
        assert checks == []  # noticed by its exit, not by a health check
        # and asked for a check, the new child is checked at once though the interval is 600 s
        guard.check_soon()
        await _until(lambda: bool(checks), "the check asked for")
        assert checks[0][0] is None
    finally:
        await guard.stop()
