"""The guard's socket lost (removed, replaced by a dead socket) or the guard hung,
while its process lives. Before: the gateway served from pooled connections until they idled out,
then answered 503 forever with no log line; the supervisor only reacted to the child exiting.

* the real appliance (``uomp gateway start`` in a subprocess: gateway + supervised guard child),
  each fault injected from outside, recovery measured from the fault to the first good read on a
  new connection after the supervisor restarted the guard; logs, metrics and the status file say
  what happened;
* the gateway alone in front of a guard that goes away: its ``/v1/health`` answers 503 while the
  guard is unreachable and 200 once it is back; the failure is logged once, not per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gatewaykit import agent_call, agent_session, appliance
from guardkit import running_guard
from shortdir import short_dir
from startkit import read_until, remote_calendar

from gateway.client.tls import build_client_context
from gateway.config import Paths

UOMP = [sys.executable, "-m", "gateway.cli.main"]
RECOVERY_BOUND_SECONDS = 20.0  # generous: detection (3 checks, 1 s apart, 2 s time-out) + restart


@pytest.fixture
def sv_home() -> Any:
    import shutil

    top = short_dir("uomp-sup-")
    yield top / "home"
    shutil.rmtree(top, ignore_errors=True)


def _uomp(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=60, check=True)


def remove_socket(sock: Path) -> None:
    sock.unlink()


def dead_socket(sock: Path) -> None:
    """Replace the socket file with one nobody listens on (bound, then closed: connections are refused)."""
    sock.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock))
    s.close()


FAULTS: list[tuple[str, Callable[[Path, int], None]]] = [
    ("socket_removed", lambda sock, pid: remove_socket(sock)),
    ("dead_socket", lambda sock, pid: dead_socket(sock)),
    ("guard_hung", lambda sock, pid: os.kill(pid, signal.SIGSTOP)),
]


async def _metrics(port: int) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as resp:
        return await resp.text()


@pytest.mark.timeout(240)
async def test_lost_socket_or_hung_guard_is_restarted(tmp_path: Path, sv_home: Path) -> None:
    home = sv_home
    _uomp(home, "init")
    _uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    proc = subprocess.Popen(
        [
            *UOMP,
            "--home",
            str(home),
            "gateway",
            "start",
            "--listen",
            "127.0.0.1:0",
            "--no-local-port",
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err_lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(
        target=lambda: err_lines.extend(iter(proc.stderr.readline, "")),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    guard_pids: list[int] = []
    measured: dict[str, float] = {}
    try:
        m = re.search(r"https://127\.0\.0\.1:(\d+)", read_until(proc, "gateway: "))
        assert m
        port = int(m.group(1))
        g = re.search(r"\(process (\d+)", read_until(proc, "guard: "))
        assert g
        guard_pids.append(int(g.group(1)))
        mp = re.search(r"127\.0\.0\.1:(\d+)/metrics", read_until(proc, "metrics: "))
        assert mp
        metrics_port = int(mp.group(1))
        ctx, headers = remote_calendar(_uomp, home, tmp_path, port)
        base = f"https://localhost:{port}"

        async def read() -> int:
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s,
                s.get(f"{base}/v1/memory/preference.theme", headers=headers) as resp,
            ):
                await resp.read()
                return resp.status

        async def health() -> int:
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s,
                s.get(f"{base}/v1/health") as resp,
            ):
                await resp.read()
                return resp.status

        assert await read() == 200 and await health() == 200
        for n, (name, inject) in enumerate(FAULTS, start=1):
            pid = guard_pids[-1]
            inject(home / "guard.sock", pid)
            started = time.monotonic()
            statuses: set[int] = set()
            while True:  # recovered = a new guard process serves reads again
                restarted = [int(x) for x in re.findall(r"guard process restarted \(pid (\d+)", "".join(err_lines))]
                if len(restarted) >= n:
                    status = await read()
                    if status == 200:
                        break
                else:
                    statuses.add(await health())
                elapsed = time.monotonic() - started
                assert elapsed < RECOVERY_BOUND_SECONDS * 3, f"{name}: the guard did not come back"
                await asyncio.sleep(0.1)
            measured[name] = time.monotonic() - started
            guard_pids.append(restarted[n - 1])
            assert guard_pids[-1] != pid
            assert statuses <= {200, 503}  # never anything but ok or a clear 503 meanwhile
            with contextlib.suppress(ProcessLookupError):  # the old child is gone (SIGTERM, SIGCONT)
                for _ in range(100):
                    os.kill(pid, 0)
                    await asyncio.sleep(0.05)
                raise AssertionError(f"{name}: the old guard process {pid} still runs")
            # /v1/health follows the gateway's own upstream check (every 2 s): it turns 200 by the next one.
            for _ in range(100):
                if await health() == 200:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"{name}: /v1/health stayed 503 after the guard came back")

        metrics = await _metrics(metrics_port)
        assert re.search(r"^uomp_gateway_guard_restarts_total 3$", metrics, re.M), metrics
        assert re.search(r"^uomp_gateway_upstream_up 1$", metrics, re.M)
        # status.json is rewritten by the gateway's upstream check (every 2 s): wait for the last restart in it.
        for _ in range(100):
            status = json.loads((home / "gateway" / "status.json").read_text())
            if status["guard"]["restarts"] == 3:
                break
            await asyncio.sleep(0.1)
        assert status["running"] is True and status["pid"] == proc.pid
        assert status["upstream"]["up"] is True
        assert status["guard"]["restarts"] == 3 and status["guard"]["pid"] == guard_pids[-1]
        assert "health checks" in status["guard"]["last_restart_reason"]
    finally:
        for pid in guard_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        reader.join(10)
    err = "".join(err_lines)
    print("recovery seconds:", {k: round(v, 1) for k, v in measured.items()})
    assert proc.returncode == 0, err
    for name, seconds in measured.items():
        assert seconds < RECOVERY_BOUND_SECONDS, f"{name}: recovery took {seconds:.1f} s"
    assert err.count("failed 3 health checks in a row") >= 3
    assert "guard_hung" not in err and headers["Authorization"][7:] not in err
    status = json.loads((home / "gateway" / "status.json").read_text())
    assert status["running"] is False  # a clean stop is recorded


async def test_gateway_health_follows_the_guard(home: Paths, caplog: pytest.LogCaptureFixture) -> None:
    """The gateway alone: /v1/health is 503 STORE_UNAVAILABLE while the guard is unreachable, 200 when it
    is back; agents get 503 meanwhile; the failure is logged once (going down, coming back), counted in
    the metrics and written to the status file."""
    caplog.set_level(logging.WARNING, logger="uomp.gateway")
    async with appliance(home, upstream_health_interval_seconds=0.2, upstream_failure_log_seconds=3600) as app:
        agent = app.agent("calendar_agent")
        g = await app.grant(agent)
        monitor = app.gateway.monitor
        assert monitor is not None and monitor.up is True

        async def get(path: str) -> tuple[int, Any]:
            async with agent_session(agent, app.paths) as s:
                status, body, _ = await agent_call(s, app.base, path, token=g["token"], agent_id=agent.agent_id)
                return status, body

        assert (await get("/v1/health"))[0] == 200
        sock = home.guard_sock
        moved = sock.with_name("moved.sock")
        os.rename(sock, moved)  # the guard lives on; its socket file is gone
        for _ in range(200):
            status, body = await get("/v1/health")
            if status == 503:
                break
            await asyncio.sleep(0.05)
        assert status == 503 and body["error"]["code"] == "STORE_UNAVAILABLE"
        for _ in range(5):  # every agent request now: a clear 503, logged once, counted each time
            status, body = await get("/v1/memory/preference.theme")
            assert status == 503 and body["error"]["code"] == "STORE_UNAVAILABLE"
        state = json.loads(home.gateway_status.read_text())
        assert state["upstream"]["up"] is False and state["upstream"]["last_error"] == "STORE_UNAVAILABLE"
        assert app.gateway.state is not None
        assert app.gateway.state.metrics.upstream_failures("STORE_UNAVAILABLE") >= 5
        assert app.gateway.state.metrics.upstream_up == 0

        os.rename(moved, sock)  # back
        for _ in range(200):
            status, _ = await get("/v1/health")
            if status == 200:
                break
            await asyncio.sleep(0.05)
        assert status == 200
        assert (await get("/v1/memory/preference.theme"))[0] == 200
        assert app.gateway.state.metrics.upstream_up == 1
    down = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    back = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(down) == 1 and len(back) == 1, [r.getMessage() for r in caplog.records]
    failed = [r for r in caplog.records if "request to the memory guard failed" in r.getMessage()]
    assert len(failed) <= 1  # rate-limited: not one line per request


async def test_gateway_started_without_its_guard_says_so(home: Paths) -> None:
    """Partner: the gateway starts (it fronts a guard that may come later) but its health is 503 until
    the guard answers."""
    from gateway import ca_store
    from gateway.config import GatewayConfig
    from gateway.remote.server import GatewayRunner

    ca_store.init_all(home)
    gw = GatewayRunner(home, GatewayConfig(listen_port=0, upstream_health_interval_seconds=0.2))
    await gw.start()
    try:
        ctx = build_client_context(ca_store.ca_cert_path(home))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
            async with s.get(f"https://localhost:{gw.port}/v1/health") as resp:
                assert resp.status == 503
            async with running_guard(home, serve_tcp=False):
                for _ in range(200):
                    async with s.get(f"https://localhost:{gw.port}/v1/health") as resp:
                        if resp.status == 200:
                            break
                    await asyncio.sleep(0.05)
                assert resp.status == 200
    finally:
        await gw.stop()
