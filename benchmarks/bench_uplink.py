"""The uplink hop against the Unix socket, in one run: agent reads by key through the gateway's
mTLS listener with ``--clients`` concurrent keep-alive connections, for ``--duration`` seconds each,
(a) the guard on the gateway's Unix socket, (b) the guard behind the outbound uplink (HTTP/2 over
mTLS, the home side in the same process). Prints req/s, p50/p99 and the ratios. Everything (guard,
gateway, home side, clients) shares one process and one event loop, so the ratio is the hop's cost
on the same CPU; loopback only; bounded by time and by ``--max-requests``.

    .venv/bin/python benchmarks/bench_uplink.py [--duration 8] [--clients 50] [--max-requests 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gatewaykit import appliance  # noqa: E402
from uplinkkit import split  # noqa: E402

from gateway.config import Paths  # noqa: E402
from gateway.keys import init_home  # noqa: E402


async def load(app: Any, seconds: float, clients: int, cap: int) -> tuple[float, float, float, int]:
    import aiohttp

    a = app.agent("bench_agent")
    g = await app.grant(a, read={"tags": ["preference"], "keys": []}, limits={"max_read_queries": 10**7})
    lat: list[float] = []
    errors = 0
    url = app.base + "/v1/memory/preference.theme"
    hdrs = {"Authorization": f"Bearer {g['token']}", "X-UOMP-Agent-Id": a.agent_id}
    connector = aiohttp.TCPConnector(ssl=a.ssl(), limit=clients)
    async with aiohttp.ClientSession(connector=connector) as s:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < end and len(lat) + errors < cap:
                t0 = time.perf_counter()
                async with s.get(url, headers=hdrs) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        continue
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        took = time.perf_counter() - t0
    lat.sort()
    return len(lat) / took, statistics.median(lat) * 1000, lat[int(len(lat) * 0.99)] * 1000, errors


def fresh_home() -> Paths:
    p = Paths(Path(tempfile.mkdtemp(prefix="uomp-bu-", dir="/tmp")))
    init_home(p)
    return p


async def main(args: argparse.Namespace) -> None:
    lim = {"max_unverified_connections_per_ip": 256, "max_unverified_connections": 256}
    async with appliance(fresh_home(), **lim) as app:
        sock = await load(app, args.duration, args.clients, args.max_requests)
    async with split(fresh_home(), **lim) as s:
        up = await load(s.app, args.duration, args.clients, args.max_requests)
    for name, (rps, p50, p99, err) in (("unix socket", sock), ("uplink", up)):
        print(f"{name:12} {rps:8.0f} req/s   p50 {p50:6.2f} ms   p99 {p99:6.2f} ms   errors {err}")
    print(f"uplink / socket: req/s x{up[0] / sock[0]:.2f}, p50 x{up[1] / sock[1]:.2f}, p99 x{up[2] / sock[2]:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--max-requests", type=int, default=200_000)
    asyncio.run(main(ap.parse_args()))
