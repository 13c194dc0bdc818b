"""MCP tool-call latency through the gateway vs a direct SDK call, same run.

    .venv/bin/python benchmarks/bench_mcp.py [--calls 150] [--rounds 2]

The appliance (guard on its Unix socket + gateway with TLS 1.3 mTLS on loopback) runs in this
process. One agent bundle (a real remote grant, certificate-bound tokens) is read two ways, one
call at a time, alternating ``--rounds`` times:

* direct: ``UompClient.get(key)`` in this process (mTLS keep-alive to the gateway);
* MCP: ``ClientSession.call_tool("memory_read", {"key": ...})`` of the official ``mcp`` SDK over stdio
  to a ``uomp mcp serve --bundle`` child process, whose own UompClient makes the same read;
* ping: ``ClientSession.send_ping()`` on the same session (the MCP round trip alone, no tool).

Printed: p50/p99/mean of each, and the ratios MCP/direct (and the difference of the medians: what
the MCP hop adds: JSON-RPC over pipes, schema check, one more process). Bounded: at most
``--calls`` x ``--rounds`` calls per path; everything on loopback; the home is a throwaway under /tmp.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common as c

MAX_CALLS = 5000


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def _row(name: str, lat: list[float]) -> str:
    return (
        f"{name:<8} n={len(lat):<5} p50={_pct(lat, 50) * 1000:7.2f} ms  p99={_pct(lat, 99) * 1000:7.2f} ms"
        f"  mean={statistics.fmean(lat) * 1000:7.2f} ms"
    )


async def _bundle(paths: Any, base: str, agent: dict[str, str]) -> Path:
    from gateway import ca_store
    from gateway.bundle import AgentBundle, write_bundle

    read = {"tags": ["preference"], "keys": []}
    body = {"agent_id": agent["agent_id"], "requested_scopes": {"read": read}, "duration_minutes": 60}
    status, created = await c._admin_call(paths, "POST", "/v1/sessions", body)
    assert status == 201, created
    gbody = {
        "granted_scopes": {"read": read},
        "profile": "remote",
        "audience": base,
        "cnf": {"x5t#S256": agent["x5t"], "jkt": agent["jkt"]},
        "refresh": True,
        "limits": {"max_read_queries": 10_000_000},
    }
    status, g = await c._admin_call(paths, "POST", f"/v1/sessions/{created['session_id']}/grant", gbody)
    assert status == 200, g
    path = paths.home / "bench-bundle.json"
    write_bundle(
        path,
        AgentBundle(
            agent_id=agent["agent_id"],
            session_id=g["session_id"],
            gateway_url=base,
            access_token=g["token"],
            access_expires_at=g["expires_at"],
            refresh_token=g["refresh_token"],
            refresh_expires_at=g["refresh_expires_at"],
            ca_cert=ca_store.ca_cert_path(paths).read_text(),
            agent_cert=Path(agent["cert"]).read_text(),
            agent_key=Path(agent["key"]).read_text(),
        ),
    )
    return path


async def run(args: argparse.Namespace) -> None:
    from mcp import ClientSession, StdioServerParameters, stdio_client

    from gateway.client import UompClient
    from gateway.config import GatewayConfig, GuardConfig
    from gateway.guard.server import GuardRunner
    from gateway.remote.server import GatewayRunner

    calls = max(1, min(args.calls, MAX_CALLS))
    with c.bench_home(prefix="uomp-mcp-") as paths:
        keys = c.seed_store(paths, n_keys=50, n_other=50)
        agent = c.issue_agent(paths)
        guard = GuardRunner(
            paths, dataclasses.replace(GuardConfig(), audit_full_verify_at_start=False), serve_tcp=False
        )
        await guard.start()
        gw = GatewayRunner(paths, GatewayConfig(listen_port=0))
        await gw.start()
        try:
            base = f"https://localhost:{gw.port}"
            bundle = await _bundle(paths, base, agent)
            uomp = str(Path(sys.executable).parent / "uomp")
            params = StdioServerParameters(command=uomp, args=["mcp", "serve", "--bundle", str(bundle)])
            direct: list[float] = []
            via_mcp: list[float] = []
            ping: list[float] = []
            with open("/dev/null", "w") as devnull:
                async with (
                    UompClient.from_bundle(bundle) as client,
                    stdio_client(params, errlog=devnull) as (read, write),
                    ClientSession(read, write) as session,
                ):
                    await session.initialize()
                    for _ in range(5):  # warm-up: connections, caches
                        await client.get(keys[0])
                        await session.call_tool("memory_read", {"key": keys[0]})
                    for _ in range(max(1, args.rounds)):
                        for i in range(calls):
                            t = time.perf_counter()
                            await client.get(keys[i % len(keys)])
                            direct.append(time.perf_counter() - t)
                        for i in range(calls):
                            t = time.perf_counter()
                            result: Any = await session.call_tool("memory_read", {"key": keys[i % len(keys)]})
                            via_mcp.append(time.perf_counter() - t)
                            if result.is_error:
                                raise SystemExit(f"MCP call refused: {result.content[0].text}")
                        for _ in range(calls):
                            t = time.perf_counter()
                            await session.send_ping()
                            ping.append(time.perf_counter() - t)
        finally:
            await gw.stop()
            await guard.stop()
    print(c.machine_line())
    print(_row("direct", direct))
    print(_row("mcp", via_mcp))
    print(_row("ping", ping) + "   (MCP ping over the same stdio: the protocol's round trip, no tool)")
    p50, p99 = _pct(via_mcp, 50) / _pct(direct, 50), _pct(via_mcp, 99) / _pct(direct, 99)
    added = (_pct(via_mcp, 50) - _pct(direct, 50)) * 1000
    print(f"ratio mcp/direct: p50 {p50:.2f}x  p99 {p99:.2f}x  (the MCP hop adds {added:.2f} ms at the median)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=150, help=f"sequential calls per path and round (max {MAX_CALLS})")
    p.add_argument("--rounds", type=int, default=2, help="direct/MCP alternations")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
