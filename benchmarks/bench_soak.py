"""Soak: N agents read, refresh and check their audit for a long time; the appliance's RSS over time.

    .venv/bin/python benchmarks/bench_soak.py [--agents 30] [--duration 3600] [--sample 30] [--warmup 300]

The appliance runs as a user runs it (``uomp gateway start`` in a subprocess: the gateway and its
supervised guard child). Each agent is the real SDK (``UompClient.from_bundle``, mTLS, its own
keep-alive connection) looping: a read by key, every ``--refresh-every`` seconds a refresh (the
refresh token rotates, the bundle is rewritten), every tenth round its own audit, then a pause of
0.1-0.5 s (bounded load: about 5 requests per second per agent). Every ``--sample`` seconds the
gateway's and the guard's VmRSS (``/proc/<pid>/status``) are recorded.

Printed: the RSS of each process at start (agents connected), after the warm-up, half-way and at the end; the
slope of a least-squares line through the samples after the warm-up (KiB per hour) and the
end/after-warm-up ratio; requests and refreshes done, errors by code. A slope that keeps rising run
after run is a leak to find; a step during the warm-up is caches filling (TLS sessions, the status
cache, SQLite's page cache). ``--json FILE`` also writes every sample;
``--env NAME=VALUE`` sets the appliance's environment (a test with ``MALLOC_ARENA_MAX=2``, or
memory tracing with ``UOMP_TRACEMALLOC=1``: gateway/memtrace.py). Two runs side by side (one with
``PYTHONPATH`` at another checkout) compare two versions under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.client import ClientOptions, UompClient, UompClientError

UOMP = [sys.executable, "-m", "gateway.cli.main"]
MAX_DURATION = 4 * 3600  # bounded whatever the options say


def run(home: Path, *args: str) -> str:
    return subprocess.run(
        [*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=120, check=True
    ).stdout


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def start_appliance(home: Path, extra_env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [*UOMP, "--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "UOMP_DASHBOARD_PORT": "0", **extra_env},
    )  # never a running appliance's 9380
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"https://127\.0\.0\.1:(\d+)", line) if line.startswith("gateway: ") else None
        if m:
            return proc, int(m.group(1))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit("the appliance does not start")


def authorize(home: Path, port: int, work: Path, i: int) -> Path:
    d = work / f"agent{i}"
    d.mkdir()
    (d / "uom.json").write_text(
        json.dumps(
            {
                "uomp_version": "1.0",
                "agent": {"id": f"soak_agent_{i}", "name": f"Soak agent {i}", "version": "1.0.0"},
                "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
                "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
            }
        )
    )
    bundle = work / f"bundle{i}.json"
    run(
        home,
        "authorize",
        str(d),
        "--yes",
        "--remote",
        "--gateway-url",
        f"https://localhost:{port}",
        "--max-reads",
        "10000000",
        "--out",
        str(work / f"files{i}"),
        "--bundle",
        str(bundle),
    )
    return bundle


async def agent_loop(bundle: Path, stop: asyncio.Event, stats: dict[str, Any], refresh_every: float) -> None:
    async with UompClient.from_bundle(bundle, options=ClientOptions(timeout_seconds=15)) as c:
        next_refresh = time.monotonic() + random.uniform(0, refresh_every)
        n = 0
        while not stop.is_set():
            try:
                await c.get("preference.theme")
                stats["requests"] += 1
                if time.monotonic() >= next_refresh:
                    await c.refresh()
                    stats["refreshes"] += 1
                    next_refresh = time.monotonic() + refresh_every
                n += 1
                if n % 10 == 0:
                    await c.audit(limit=5)
                    stats["requests"] += 1
            except UompClientError as exc:
                stats["errors"][exc.code] = stats["errors"].get(exc.code, 0) + 1
                await asyncio.sleep(1.0)
            await asyncio.sleep(random.uniform(0.1, 0.5))


def slope_kib_per_hour(samples: list[tuple[float, int]]) -> float:
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    var = sum((t - mx) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return sum((t - mx) * (v - my) for t, v in samples) / var * 3600


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=30)
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds of load after the agents connect")
    ap.add_argument("--warmup", type=float, default=300.0, help="seconds counted as warm-up")
    ap.add_argument("--sample", type=float, default=30.0, help="seconds between RSS samples")
    ap.add_argument("--refresh-every", type=float, default=60.0, help="seconds between one agent's refreshes")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write every sample to this file")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="for the appliance only, e.g. MALLOC_ARENA_MAX=2, or UOMP_TRACEMALLOC=1 with "
        "UOMP_TRACEMALLOC_INTERVAL=60 (snapshots in <work>/home/memtrace, benchmarks/memtrace_diff.py; "
        "add --keep)",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the work directory (the home, its memtrace snapshots and the agents' bundles, which hold "
        "live tokens); removed at the end otherwise",
    )
    args = ap.parse_args()
    duration = min(args.duration, MAX_DURATION)
    random.seed(args.seed)
    work = Path(tempfile.mkdtemp(prefix="uomp-soak-", dir="/tmp"))
    home = work / "home"
    run(home, "init")
    run(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    extra_env = dict(e.split("=", 1) for e in args.env)
    proc, port = start_appliance(home, extra_env)
    try:
        bundles = [authorize(home, port, work, i) for i in range(args.agents)]
        stats: dict[str, Any] = {"requests": 0, "refreshes": 0, "errors": {}}
        stop = asyncio.Event()
        tasks = [asyncio.create_task(agent_loop(b, stop, stats, args.refresh_every)) for b in bundles]
        await asyncio.sleep(5)  # every agent connected
        guard = children(proc.pid)[0]
        samples: list[dict[str, float]] = []
        t0 = time.monotonic()
        while True:
            t = time.monotonic() - t0
            samples.append(
                {
                    "t": round(t, 1),
                    "gateway_kib": rss_kib(proc.pid),
                    "guard_kib": rss_kib(guard),
                    "requests": stats["requests"],
                }
            )
            if t >= duration:
                break
            await asyncio.sleep(min(args.sample, max(0.0, duration - t)))
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if not args.keep:  # the bundles hold live tokens: nothing of the run is left behind
            shutil.rmtree(work, ignore_errors=True)
    after = [s for s in samples if s["t"] >= min(args.warmup, duration / 2)] or samples
    report: dict[str, Any] = {
        "agents": args.agents,
        "seconds": round(samples[-1]["t"], 1),
        "requests": stats["requests"],
        "refreshes": stats["refreshes"],
        "errors": stats["errors"],
        "env": extra_env,
        "work": str(work) if args.keep else None,
    }
    half = min(samples, key=lambda s: abs(s["t"] - samples[-1]["t"] / 2))  # the sample nearest half-time
    for role in ("gateway", "guard"):
        k = f"{role}_kib"
        series = [(s["t"], int(s[k])) for s in after]
        report[role] = {
            "start_mib": round(samples[0][k] / 1024, 1),
            "after_warmup_mib": round(after[0][k] / 1024, 1),
            "half_way_mib": round(half[k] / 1024, 1),
            "end_mib": round(samples[-1][k] / 1024, 1),
            "end_over_warmup": round(samples[-1][k] / after[0][k], 3),
            "slope_mib_per_hour": round(slope_kib_per_hour(series) / 1024, 2),
        }
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(samples, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
