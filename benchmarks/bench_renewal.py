"""Certificate renewal under abuse, and the registry as it grows (issue 15 defect 4).

    .venv/bin/python benchmarks/bench_renewal.py [--requests 1000] [--concurrency 8] [--rows 2000]

Prints what it measured in this one run (never asserted anywhere):

* **flood**: one agent whose certificate is in its renewal window sends ``--requests`` renewal
  requests over mTLS, ``--concurrency`` at a time, against the appliance in this process (guard on
  its Unix socket, gateway on 127.0.0.1:0); meanwhile another client asks ``/v1/health`` in a loop.
  Reports how many renewals were granted / refused (by code), the wall time, and the health
  latency p50/p99 during the flood (the event loop's responsiveness) against the same without it;
* **registry**: milliseconds per ``ca_store.issue_from_csr`` (lock, registry write, fsync) as the
  registry grows to ``--rows`` rows, at a few sizes, and the registry file size.

Only APIs that existed before the change are used in the registry part, so the same script
measures an older tree (``PYTHONPATH=<old tree>``) for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime as dt
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from cryptography.hazmat.primitives import serialization

from gateway import ca_store, keys
from gateway.client.tls import build_client_context
from gateway.config import GatewayConfig, GuardConfig, Paths
from gateway.core import ca
from gateway.guard.server import GuardRunner
from gateway.remote.server import GatewayRunner


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def health_loop(base: str, ctx: object, stop: asyncio.Event, out: list[float]) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:  # type: ignore[arg-type]
        while not stop.is_set():
            t0 = time.perf_counter()
            async with s.get(base + "/v1/health") as resp:
                await resp.read()
            out.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(0.01)


async def flood(work: Path, requests: int, concurrency: int) -> None:
    paths = Paths(work / "home")
    keys.init_home(paths)
    ca_store.init_all(paths)
    guard = GuardRunner(paths, GuardConfig(tcp_port=0), serve_tcp=False)
    await guard.start()
    gw = GatewayRunner(paths, dataclasses.replace(GatewayConfig(listen_port=0)))
    await gw.start()
    try:
        base = f"https://localhost:{gw.port}"
        files = ca_store.issue_with_key(
            paths, "flooder", work / "flooder", dt.timedelta(hours=1), now=ca.utcnow() - dt.timedelta(minutes=50)
        )
        other = ca_store.issue_with_key(paths, "bystander", work / "bystander")
        ctx = build_client_context(files.ca_file, files.cert_file, files.key_file)
        octx = build_client_context(other.ca_file, other.cert_file, other.key_file)

        quiet: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(health_loop(base, octx, stop, quiet))
        await asyncio.sleep(3)
        stop.set()
        await task

        codes: collections.Counter[str] = collections.Counter()
        during: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(health_loop(base, octx, stop, during))
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=concurrency)) as s:

            async def one() -> None:
                async with sem, s.post(base + "/v1/certificates/renew", json={}) as resp:
                    body = await resp.json(content_type=None)
                    codes["granted" if resp.status == 200 else body.get("error", {}).get("code", str(resp.status))] += 1

            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(requests)))
            wall = time.perf_counter() - t0
        stop.set()
        await task
        print(
            f"flood: {requests} renewal requests, concurrency {concurrency}: {wall:.1f} s, "
            f"{requests / wall:.0f} req/s; outcomes {dict(codes)}"
        )
        print(
            f"  /v1/health latency without flood: p50 {statistics.median(quiet):.1f} ms, p99 {pct(quiet, 0.99):.1f} ms"
            f" ({len(quiet)} probes)"
        )
        print(
            f"  /v1/health latency during flood:  p50 {statistics.median(during):.1f} ms, "
            f"p99 {pct(during, 0.99):.1f} ms ({len(during)} probes); "
            f"p99 ratio {pct(during, 0.99) / pct(quiet, 0.99):.1f}"
        )
        registry = [p for p in paths.ca_dir.iterdir() if p.name.startswith("issued")]
        print(f"  registry after the flood: {', '.join(f'{p.name} {p.stat().st_size} B' for p in registry)}")
    finally:
        await gw.stop()
        await guard.stop()


def registry_growth(work: Path, rows: int) -> None:
    paths = Paths(work / "reg")
    ca_store.init_all(paths)
    key = ca.new_key()
    csr = ca.make_csr(key, "agent").public_bytes(serialization.Encoding.PEM)
    marks = sorted({1, rows // 4, rows // 2, rows})
    done = 0
    line = []
    for mark in marks:
        while done < mark - 20:
            ca_store.issue_from_csr(paths, f"a{done}", csr)
            done += 1
        t0 = time.perf_counter()
        for _ in range(20):
            ca_store.issue_from_csr(paths, f"a{done}", csr)
            done += 1
        line.append(f"{done} rows: {(time.perf_counter() - t0) / 20 * 1000:.1f} ms/issue")
    size = sum(p.stat().st_size for p in paths.ca_dir.iterdir() if p.name.startswith("issued"))
    print(f"registry: {'; '.join(line)}; on disk {size / 1024:.0f} KiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--skip-flood", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="uomp-bench-renew-", dir="/tmp"))
    try:
        if not args.skip_flood:
            asyncio.run(flood(work, args.requests, args.concurrency))
        registry_growth(work, args.rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
