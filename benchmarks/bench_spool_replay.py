"""Replay throughput of the gateway's spool into the guard's log.

    .venv/bin/python benchmarks/bench_spool_replay.py [--events 10000] [--pad 300]

A throwaway ``UOMP_HOME``; ``--events`` gateway refusals of ~``--pad`` + 250 bytes each (the shape
of a certificate-less request's event) are spooled while no guard runs (``EventSink`` with the
guard's socket absent: each batch fsynced into ``access.jsonl``); then ``uomp guard serve`` starts
in a child process on its Unix socket and ``EventSink.replay`` sends the spool, batches packed under
``gateway.contract.MAX_INTERNAL_EVENTS_BYTES``. Printed: events, internal requests, the replay's
time and events/s, and the spooling's for comparison. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway import ca_store
from gateway.config import Paths
from gateway.keys import init_home
from gateway.remote.access_log import AccessLog
from gateway.remote.event_sink import EventSink, new_event_id, spool_path
from gateway.remote.guard_client import Forwarder, Upstream


def sink_for(paths: Paths) -> tuple[EventSink, AccessLog, Forwarder]:
    paths.gateway_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    spool = AccessLog(spool_path(paths.gateway_dir))
    fwd = Forwarder(Upstream.parse(f"unix:{paths.guard_sock}"), timeout_seconds=30)
    return EventSink(fwd, spool, unauth_burst=1e9, unauth_events_per_second=1e9), spool, fwd


async def spool_events(paths: Paths, n: int, pad: int) -> float:
    sink, spool, fwd = sink_for(paths)
    start = time.perf_counter()
    try:
        for base in range(0, n, 1000):  # 1,000 refusals at a time, as a flood arrives
            futs = [
                sink.append(
                    {
                        "id": new_event_id(),
                        "action": "read",
                        "allowed": False,
                        "code": "CERT_REQUIRED",
                        "status": 401,
                        "reason": "a client certificate issued by the user's agent CA is required",
                        "method": "GET",
                        "path": f"/v1/memory/{'k' * pad}{i}",
                        "listener": "mtls",
                        "via": "gateway:mtls",
                        "client": "127.0.0.1",
                    }
                )
                for i in range(base, min(n, base + 1000))
            ]
            await asyncio.gather(*[f for f in futs if f is not None])
        assert sink.backlog == n, sink.backlog
        return time.perf_counter() - start
    finally:
        await fwd.close()
        spool.close()


async def replay(paths: Paths) -> tuple[int, int, float]:
    sink, spool, fwd = sink_for(paths)
    try:
        start = time.perf_counter()
        done = await sink.replay()
        return done, sink.requests_sent, time.perf_counter() - start
    finally:
        await fwd.close()
        spool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--pad", type=int, default=300, help="characters of padding in each event's path")
    args = ap.parse_args()
    paths = Paths(Path(tempfile.mkdtemp(prefix="uomp-spool-", dir="/tmp")))
    guard: subprocess.Popen[bytes] | None = None
    try:
        init_home(paths)
        ca_store.init_all(paths)
        spool_s = asyncio.run(spool_events(paths, args.events, args.pad))
        size = (paths.gateway_dir / "access.jsonl").stat().st_size
        guard = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli.main", "--home", str(paths.home), "guard", "serve", "--no-tcp"],
            env=dict(os.environ, UOMP_HOME=str(paths.home)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + 60
        while time.monotonic() < end:
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(str(paths.guard_sock))
                    break
                except OSError:
                    time.sleep(0.05)
        done, requests, replay_s = asyncio.run(replay(paths))
        print(
            f"spooled {args.events} events ({size / 1e6:.1f} MB of spool) in {spool_s:.2f} s "
            f"({args.events / spool_s:,.0f} events/s)"
        )
        print(
            f"replayed {done} events in {requests} internal requests in {replay_s:.2f} s: "
            f"{done / replay_s:,.0f} events/s ({size / replay_s / 1e6:.1f} MB/s of spool)"
        )
    finally:
        if guard is not None:
            guard.terminate()
            guard.wait(timeout=30)
        shutil.rmtree(paths.home, ignore_errors=True)


if __name__ == "__main__":
    main()
