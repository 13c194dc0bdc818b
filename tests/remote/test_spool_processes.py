"""The gateway's spool, replayed into the guard's log across outages and crashes, with real
processes: `uomp guard serve` on its real Unix socket, `uomp gateway serve` with real TLS in front
of it, requests without a client certificate (refused by the gateway alone: its own events), the
guard down while they are spooled, and kill -9 of the gateway between the guard's acknowledgement
of a replayed batch and the spool's marker (fault point ``gateway_spool_acked``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from gatewaykit import ca_file, ledger_events, verify_ledger
from guardkit import seed

from gateway import ca_store
from gateway.client.tls import build_client_context
from gateway.config import Paths

UOMP = [sys.executable, "-m", "gateway.cli.main"]
KEY_PAD = "k" * 1900  # ~2 KB per event (paths are at most 2048): 500 of them are more than one internal request holds
REPLAY_BOUND = 30.0  # seconds from the guard's return to the whole spool in its log

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.port = free_port()
        self.guard: subprocess.Popen[bytes] | None = None
        self.gateway: subprocess.Popen[bytes] | None = None
        self.arm = paths.home / "fault.arm"
        self.env = dict(
            os.environ,
            UOMP_HOME=str(paths.home),
            # every refusal an event of its own (no per-source rate limit in this test)
            UOMP_GATEWAY_ACCESS_LOG_UNAUTH_BURST="1000000",
            UOMP_GATEWAY_ACCESS_LOG_UNAUTH_EVENTS_PER_SECOND="1000000",
            UOMP_GATEWAY_UPSTREAM_HEALTH_INTERVAL_SECONDS="0.5",
        )
        self.env.pop("UOMP_FAULT", None)

    def start_guard(self) -> None:
        self.guard = subprocess.Popen(
            [*UOMP, "--home", str(self.paths.home), "guard", "serve", "--no-tcp"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait(lambda: _connects_unix(self.paths.guard_sock), "the guard did not start")

    def start_gateway(self, fault: str | None = None) -> None:
        env = dict(self.env)
        if fault:
            self.arm.write_text("armed")
            env.update(UOMP_FAULT=fault, UOMP_FAULT_ARM=str(self.arm))
        self.gateway = subprocess.Popen(
            [*UOMP, "--home", str(self.paths.home), "gateway", "serve", "--listen", f"127.0.0.1:{self.port}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait(lambda: _connects_tcp(self.port), "the gateway did not start")

    @staticmethod
    def stop(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        self.stop(self.gateway)
        self.stop(self.guard)


def _connects_unix(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def _connects_tcp(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _wait(ok: object, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ok():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(what)


@pytest.fixture
def procs(home: Paths) -> Iterator[Procs]:
    ca_store.init_all(home)
    seed(home)
    p = Procs(home)
    try:
        yield p
    finally:
        p.close()


async def refusals(paths: Paths, port: int, n: int) -> None:
    """``n`` requests without a client certificate, 16 at a time: each answered 401 once its event is durable."""
    ctx = build_client_context(ca_file(paths))
    sem = asyncio.Semaphore(16)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=16)) as s:

        async def one(i: int) -> int:
            async with (
                sem,
                s.get(f"https://localhost:{port}/v1/memory/{KEY_PAD}{i}", headers={"Authorization": "Bearer x"}) as r,
            ):
                await r.read()
                return r.status

        statuses = await asyncio.gather(*[one(i) for i in range(n)])
    assert set(statuses) == {401}, set(statuses)


def spooled_ids(paths: Paths) -> list[str]:
    out = []
    for line in (paths.gateway_dir / "access.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("code") == "CERT_REQUIRED":
            out.append(rec["id"])
    return out


def logged_ids(paths: Paths) -> list[str]:
    return [e["id"] for e in ledger_events(paths, origin="gateway") if e.get("code") == "CERT_REQUIRED"]


def marker(paths: Paths) -> int:
    try:
        return int((paths.gateway_dir / "access.replayed").read_text())
    except FileNotFoundError:
        return 0


def wait_logged(paths: Paths, want: set[str], timeout: float) -> float:
    """Seconds until every id of ``want`` is in the guard's log (AssertionError past ``timeout``)."""
    start = time.monotonic()
    got: set[str] = set()
    while time.monotonic() - start < timeout:
        got = set(logged_ids(paths)) if paths.audit_db.exists() else set()
        if want <= got:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"{len(want - got)} of {len(want)} spooled events not in the log after {timeout:g} s")


async def test_refusals_spooled_while_the_guard_is_down_all_reach_its_log(procs: Procs) -> None:
    paths = procs.paths
    procs.start_gateway()  # no guard yet
    await refusals(paths, procs.port, 400)
    spooled = spooled_ids(paths)
    assert len(spooled) == 400 == len(set(spooled))
    assert marker(paths) == 0
    procs.start_guard()
    took = wait_logged(paths, set(spooled), REPLAY_BOUND)
    print(f"400 spooled refusals in the guard's log {took:.2f} s after it returned")
    logged = logged_ids(paths)
    assert sorted(logged) == sorted(spooled)  # each once: none lost, none twice
    assert verify_ledger(paths).ok
    # what comes after goes straight on
    await refusals(paths, procs.port, 5)
    wait_logged(paths, set(spooled_ids(paths)), REPLAY_BOUND)
    assert len(logged_ids(paths)) == 405 == len(set(logged_ids(paths)))


async def test_kill_between_the_guards_ack_and_the_marker_replays_each_event_once(procs: Procs) -> None:
    paths = procs.paths
    procs.start_gateway(fault="gateway_spool_acked")
    await refusals(paths, procs.port, 500)
    spooled = spooled_ids(paths)
    assert len(spooled) == 500
    procs.start_guard()
    assert procs.gateway is not None
    rc = procs.gateway.wait(timeout=60)  # killed by the fault point after the guard acknowledged a batch
    assert rc == -signal.SIGKILL, rc
    assert not procs.arm.exists()
    first = set(logged_ids(paths))
    assert 0 < len(first) < 500, len(first)  # the guard has the first batch ...
    assert marker(paths) == 0  # ... the marker does not say so
    procs.start_gateway()  # the same spool again, no fault
    wait_logged(paths, set(spooled), REPLAY_BOUND)
    logged = logged_ids(paths)
    assert sorted(logged) == sorted(spooled), "an event is missing or twice in the log"
    assert verify_ledger(paths).ok
    # the spool is done with: the marker is at its end
    _wait(
        lambda: (
            marker(paths)
            >= max(json.loads(line)["seq"] for line in (paths.gateway_dir / "access.jsonl").read_text().splitlines())
        ),
        "the marker did not reach the spool's end",
        10,
    )
