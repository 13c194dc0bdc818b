"""The uplink hop against the Unix socket, in one run: agent reads by key through the gateway's
mTLS listener with ``--clients`` concurrent keep-alive connections, for ``--duration`` seconds each,
(a) the guard on the gateway's Unix socket, (b) the guard behind the outbound uplink (HTTP/2 over
mTLS, the home side in the same process). Prints req/s, p50/p99 and the ratios. Everything (guard,
gateway, home side, clients) shares one process and one event loop, so the ratio is the hop's cost
on the same CPU; loopback only; bounded by time and by ``--max-requests``.

    .venv/bin/python benchmarks/bench_uplink.py [--duration 8] [--clients 50] [--max-requests 200000]

``--payload-mib N``: instead, one sealed payload of N MiB in each topology, the same run: the agent
streams it to ``POST /v1/payload/upload`` (mTLS; the guard authorizes it and records its event,
over the socket or the uplink), then the user pulls its ciphertext from the guard
(``GET /v1/payloads/ID/ciphertext`` on ``guard.sock``, as ``uomp payload pull`` does). Prints MiB/s
of each and the upload ratio. On the VPS the relay keeps the ciphertext in the gateway's own
``payloads/``: the bytes do not cross the uplink, and the pull at home answers what the guard says.
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


async def payload_round(app: Any, mib: int) -> tuple[float, float | None, str]:
    """(upload MiB/s, pull MiB/s or None, what the pull answered) for one payload of ``mib`` MiB."""
    import base64
    import json
    import os

    import aiohttp

    from gateway.client import payloads as sdk_payloads
    from gateway.core import envelope, sealing
    from gateway.payloads import userkey

    a = app.agent("bench_agent")
    g = await app.grant(a, read={"tags": ["preference"], "keys": []})
    pub = envelope.parse_public_key(userkey.public_b64(app.paths))
    binding = sealing.Binding(sdk_payloads.new_payload_id(), g["session_id"], a.agent_id, "application/octet-stream")
    src = Path(tempfile.mkdtemp(prefix="uomp-bp-", dir="/tmp")) / "src"
    with open(src, "wb") as fh:
        for _ in range(mib):
            fh.write(os.urandom(1 << 20))
    sealed = await asyncio.to_thread(sdk_payloads.seal_to_file, pub, binding, src, directory=str(src.parent))
    header = base64.urlsafe_b64encode(json.dumps(sealed.envelope.header()).encode()).rstrip(b"=").decode()
    hdrs = {
        "Authorization": f"Bearer {g['token']}",
        "X-UOMP-Agent-Id": a.agent_id,
        "Content-Type": "application/octet-stream",
        "Content-Length": str(sealed.envelope.size),
        envelope.HEADER_NAME: header,
    }

    async def body() -> Any:
        with open(sealed.path, "rb") as fh:
            while block := fh.read(1 << 20):
                yield block

    size = sealed.envelope.size / (1 << 20)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=a.ssl())) as s:
            t0 = time.perf_counter()
            async with s.post(app.base + "/v1/payload/upload", data=body(), headers=hdrs) as r:
                answer = await r.read()
                assert r.status in (200, 201), (r.status, answer[:300])
            up = size / (time.perf_counter() - t0)
        from guardkit import admin_headers

        t0 = time.perf_counter()
        got = 0
        async with app.admin.get(
            f"http://guard/v1/payloads/{binding.payload_id}/ciphertext", headers=admin_headers(app.paths)
        ) as r:
            async for chunk in r.content.iter_chunked(1 << 20):
                got += len(chunk)
            status = r.status
        took = time.perf_counter() - t0
        if status == 200 and got == sealed.envelope.size:
            return up, size / took, "pulled whole"
        return up, None, f"HTTP {status} (the ciphertext is not at home)"
    finally:
        sealed.remove()
        src.unlink()


async def payload_main(args: argparse.Namespace) -> None:
    big = (args.payload_mib + 16) << 20
    lim = {"payload_max_bytes": big, "payload_max_bytes_per_session": big * 2, "upstream_timeout_seconds": 120.0}
    async with appliance(fresh_home(), **lim) as app:
        sock = await payload_round(app, args.payload_mib)
    async with split(fresh_home(), **lim) as s:
        up = await payload_round(s.app, args.payload_mib)
    for name, (u, p, what) in (("unix socket", sock), ("uplink", up)):
        pull = f"{p:7.1f} MiB/s" if p is not None else "      -"
        print(f"{name:12} {args.payload_mib} MiB: upload {u:7.1f} MiB/s   pull at home {pull}   ({what})")
    print(f"uplink / socket: upload x{up[0] / sock[0]:.2f}")


async def main(args: argparse.Namespace) -> None:
    if args.payload_mib:
        await payload_main(args)
        return
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
    ap.add_argument("--payload-mib", type=int, default=0, help="one payload of N MiB up and back instead")
    asyncio.run(main(ap.parse_args()))
