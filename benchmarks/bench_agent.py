"""Agent onboarding costs, one run: refresh round trips through the gateway, and what a DPoP request on the
tunnel-origin listener costs the server compared with the same request on the mTLS listener.

    .venv/bin/python benchmarks/bench_agent.py [--refreshes N] [--chains C] [--requests N] [--clients C]

The appliance (guard + gateway, plus the loopback tunnel-origin listener with public name
``https://tunnel.example``) runs in a child process; the client runs in this process. What is
compared is the **server's CPU time per request** (utime+stime of the appliance process from /proc,
divided by the requests it answered), because the client's own proof signing would otherwise be
part of a throughput figure; req/s and latency are printed as well.

1. refresh: ``--chains`` sessions refreshed concurrently, each a chain of ``--refreshes`` rotations
   over mTLS (each answer's refresh token is the next request's): round trips/s, p50, p99, server
   CPU per refresh (a refresh is a token check at the gateway plus, in the Auth Service, a check,
   two signatures and three durable writes);
2. GET by key, ``--clients`` keep-alive clients, ``--requests`` each, over (a) mTLS with a
   certificate-bound token, (b) the tunnel origin with a fresh DPoP proof per request (ES256, the
   agent certificate's key); alternated twice, merged. The ratio (b)/(a) of server CPU per request
   is the DPoP verification cost relative to the mTLS path (whose TLS record layer is included).

Certificate issuance per second is measured by ``bench_ca.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as c

TUNNEL = "https://tunnel.example"


async def _serve(home: str) -> None:
    import signal

    from gateway.config import GatewayConfig, GuardConfig, Paths
    from gateway.guard.server import GuardRunner
    from gateway.remote.server import GatewayRunner

    paths = Paths(Path(home))
    guard = GuardRunner(paths, GuardConfig(serve_tcp=False), serve_tcp=False)
    await guard.start()
    gw = GatewayRunner(
        paths,
        GatewayConfig(
            listen_port=0,
            tunnel_origin_port=0,
            endpoints=["https://localhost:1"],
            tunnel_endpoints=[TUNNEL],
            # one key sends ~700 proofs/s here, past the product's per-key pace (50/s): this measures
            # the cost of a proof, not that limit
            dpop_max_proofs_per_second_per_key=2000.0,
        ),
    )
    await gw.start()
    assert gw.state is not None
    gw.state.add_endpoint(f"https://localhost:{gw.port}")
    print(json.dumps({"pid": os.getpid(), "port": gw.port, "tunnel_port": gw.tunnel_port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    deadline = time.monotonic() + 1800  # bounded life
    while not stop.is_set() and os.getppid() == parent and time.monotonic() < deadline:
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass
    await gw.stop()
    await guard.stop()


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


async def _refresh_phase(
    info: dict[str, Any], agent: dict[str, str], grants: list[dict[str, Any]], n: int
) -> dict[str, Any]:
    import aiohttp

    from gateway.client.tls import build_client_context

    ctx = build_client_context(agent["ca"], agent["cert"], agent["key"])
    base = f"https://localhost:{info['port']}"
    lat: list[float] = []
    bad = 0

    async def chain(g: dict[str, Any]) -> None:
        nonlocal bad
        rt = g["refresh_token"]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=1)) as s:
            for _ in range(n):
                t0 = time.perf_counter()
                async with s.post(
                    f"{base}/v1/sessions/{g['session_id']}/refresh",
                    headers={"Authorization": f"Bearer {rt}", "X-UOMP-Agent-Id": agent["agent_id"]},
                ) as resp:
                    body = await resp.json()
                lat.append(time.perf_counter() - t0)
                if resp.status != 200:
                    bad += 1
                    return
                rt = body["refresh_token"]

    cpu0 = c.proc_cpu_seconds(info["pid"])
    t0 = time.perf_counter()
    await asyncio.gather(*(chain(g) for g in grants))
    elapsed = time.perf_counter() - t0
    cpu = c.proc_cpu_seconds(info["pid"]) - cpu0
    return {
        "count": len(lat),
        "bad": bad,
        "rps": len(lat) / elapsed,
        "p50": _pct(lat, 50) * 1e3,
        "p99": _pct(lat, 99) * 1e3,
        "cpu_us": cpu / max(1, len(lat)) * 1e6,
        "refusals": {},
    }


async def _get_phase(
    info: dict[str, Any], agent: dict[str, str], token: str, keys: list[str], *, mode: str, clients: int, requests: int
) -> dict[str, Any]:
    import aiohttp
    from cryptography.hazmat.primitives import serialization

    from gateway.client.tls import build_client_context
    from gateway.core import dpop

    lat: list[float] = []
    bad = 0
    refusals: dict[str, int] = {}
    key = serialization.load_pem_private_key(Path(agent["key"]).read_bytes(), password=None)

    async def worker(w: int) -> None:
        nonlocal bad
        if mode == "mtls":
            conn = aiohttp.TCPConnector(ssl=build_client_context(agent["ca"], agent["cert"], agent["key"]), limit=1)
            base = f"https://localhost:{info['port']}"
        else:
            conn = aiohttp.TCPConnector(limit=1)
            base = f"http://127.0.0.1:{info['tunnel_port']}"
        async with aiohttp.ClientSession(connector=conn) as s:
            for i in range(requests):
                k = keys[(w * requests + i) % len(keys)]
                headers = {"X-UOMP-Agent-Id": agent["agent_id"]}
                if mode == "mtls":
                    headers["Authorization"] = f"Bearer {token}"
                else:
                    headers["Authorization"] = f"DPoP {token}"
                    headers["Host"] = "tunnel.example"
                    headers["DPoP"] = dpop.make_dpop_proof(
                        key,
                        method="GET",
                        url=f"{TUNNEL}/v1/memory/{k}",  # type: ignore[arg-type]
                        access_token=token,
                        now=time.time(),
                    )
                t0 = time.perf_counter()
                async with s.get(f"{base}/v1/memory/{k}", headers=headers) as resp:
                    raw = await resp.read()
                lat.append(time.perf_counter() - t0)
                if resp.status != 200:
                    bad += 1
                    try:
                        code = json.loads(raw)["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        code = "?"
                    refusals[f"{resp.status} {code}"] = refusals.get(f"{resp.status} {code}", 0) + 1

    cpu0 = c.proc_cpu_seconds(info["pid"])
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    elapsed = time.perf_counter() - t0
    cpu = c.proc_cpu_seconds(info["pid"]) - cpu0
    return {
        "count": len(lat),
        "bad": bad,
        "rps": len(lat) / elapsed,
        "p50": _pct(lat, 50) * 1e3,
        "p99": _pct(lat, 99) * 1e3,
        "cpu_us": cpu / max(1, len(lat)) * 1e6,
        "refusals": refusals,
    }


def _row(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name:<34} {r['count']:>7} {r['bad']:>5} {r['rps']:>9.0f} {r['p50']:>8.2f} {r['p99']:>8.2f} "
        f"{r['cpu_us']:>10.0f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refreshes", type=int, default=200, help="rotations per chain")
    ap.add_argument("--chains", type=int, default=4, help="concurrent sessions refreshing")
    ap.add_argument("--requests", type=int, default=400, help="GETs per client per round")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return
    print(c.machine_line())
    with c.bench_home() as paths:
        keys = c.seed_store(paths)
        agent = c.issue_agent(paths)
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(paths.home)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            info = json.loads(proc.stdout.readline())
            cnf = {"x5t#S256": agent["x5t"], "jkt": agent["jkt"]}
            common = {"profile": "remote", "cnf": cnf}
            grants = [
                c.grant(paths, audience=f"https://localhost:{info['port']}", refresh=True, **common)
                for _ in range(args.chains)
            ]
            mtls = c.grant(paths, audience=f"https://localhost:{info['port']}", **common)
            tunnel = c.grant(paths, audience=TUNNEL, **common)

            print(
                f"{'phase':<34} {'count':>7} {'non2xx':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'server µs':>10}"
            )
            ref = asyncio.run(_refresh_phase(info, agent, grants, args.refreshes))
            print(_row(f"refresh, {args.chains} chains (mTLS)", ref))
            results: dict[str, list[dict[str, Any]]] = {"mtls": [], "dpop": []}
            for _ in range(2):
                for mode, tok in (("mtls", mtls["token"]), ("dpop", tunnel["token"])):
                    r = asyncio.run(
                        _get_phase(info, agent, tok, keys, mode=mode, clients=args.clients, requests=args.requests)
                    )
                    results[mode].append(r)
                    print(_row(f"GET by key, {mode}, {args.clients} clients", r))
                    if r["refusals"]:
                        print(f"    refused: {r['refusals']}")
        finally:
            proc.terminate()
            proc.wait(30)
    bad = ref["bad"] + sum(r["bad"] for rs in results.values() for r in rs)
    if bad:
        raise SystemExit(f"{bad} requests were not answered 200: the figures above mean nothing")
    m = statistics.mean(r["cpu_us"] for r in results["mtls"])
    d = statistics.mean(r["cpu_us"] for r in results["dpop"])
    print(
        f"refresh round trips/s: {ref['rps']:.0f} (server {ref['cpu_us']:.0f} µs CPU each); "
        f"DPoP/mTLS server CPU per GET: {d / m:.2f} ({d:.0f} vs {m:.0f} µs; +{d - m:.0f} µs per request)"
    )


if __name__ == "__main__":
    main()
