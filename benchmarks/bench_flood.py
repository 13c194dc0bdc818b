"""Connection floods against the running appliance, one run: what the attacker holds, what the gateway
costs, and how a well-behaved agent fares during each flood compared with no flood.

    .venv/bin/python benchmarks/bench_flood.py [--conns N] [--duration S] [--rate R] [--kinds K ...]

The appliance (gateway + guard as its child, like ``uomp gateway start``; default configuration plus
the loopback tunnel-origin listener for ``https://tunnel.example``) runs in a child process. The
attacker runs in **another child process** (``--attack``): it keeps up to ``--conns`` hostile
connections of one kind, re-opening each one the gateway closes, at most ``--rate`` new connections
per second in all, and reports every second how many it holds (connected, not yet closed by the
gateway). The well-behaved agent runs in this process: sequential GETs with its valid certificate
and certificate-bound token (mTLS listener) or DPoP-bound token and a fresh proof (tunnel origin),
both on a new connection per request (handshake included: the hard case) and on one keep-alive
connection. Kinds:

* ``tls-nocert``: TLS 1.3 handshakes without a client certificate, then silence (the handshake
  completes because the certificate is optional, to allow a JSON 401);
* ``tcp-silent``: TCP connections to the mTLS port that never send a ClientHello;
* ``tunnel-silent``: plain connections to the tunnel-origin port that send nothing;
* ``tunnel-slowloris``: plain connections to the tunnel-origin port sending a request's headers
  one byte every 2 s.

Printed per kind: connections the attacker held over the flood (max, mean, and a per-second
timeline), connections it opened, the gateway process's RSS (max during the flood vs before any
flood), and the agent's p50/p99 latency and failures during the flood vs the no-flood baseline
measured in the same run (ratios). Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import resource
import ssl
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _common as c

TUNNEL = "https://tunnel.example"
KINDS = ("tls-nocert", "tcp-silent", "tunnel-silent", "tunnel-slowloris")
PATH = "/v1/memory/preference.item0001"


# ------------------------------------------------------------------------------ attacker child


async def _attack(spec: dict[str, Any]) -> None:
    kind, n, rate, duration = spec["kind"], spec["conns"], spec["rate"], spec["duration"]
    port = spec["tunnel_port"] if kind.startswith("tunnel") else spec["port"]
    ctx: ssl.SSLContext | None = None
    if kind == "tls-nocert":
        from gateway.client.tls import build_client_context

        ctx = build_client_context(spec["ca"])
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + duration
    state = {"held": 0, "opened": 0, "failed": 0, "next": start}

    async def take() -> None:  # at most `rate` new connections per second, all slots together
        slot_at = max(loop.time(), state["next"])
        state["next"] = slot_at + 1.0 / rate
        await asyncio.sleep(max(0.0, slot_at - loop.time()))

    async def slot() -> None:
        while loop.time() < end:
            await take()
            try:
                if ctx is not None:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(c.LOOPBACK, port, ssl=ctx, server_hostname=c.SNI), 15
                    )
                else:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(c.LOOPBACK, port), 15)
            except (OSError, TimeoutError, ssl.SSLError):
                state["failed"] += 1
                await asyncio.sleep(0.05)
                continue
            state["held"] += 1
            state["opened"] += 1
            try:
                if kind == "tunnel-slowloris":
                    head = b"GET /v1/health HTTP/1.1\r\nHost: tunnel.example\r\nX-Pad: " + b"a" * 4000
                    closed = asyncio.ensure_future(reader.read())  # done when the gateway closes
                    for byte in head:
                        if closed.done() or loop.time() >= end:
                            break
                        writer.write(bytes([byte]))
                        await asyncio.wait({closed}, timeout=2.0)
                    closed.cancel()
                else:
                    while await asyncio.wait_for(reader.read(4096), max(0.1, end - loop.time())):
                        pass
            except (OSError, TimeoutError, ssl.SSLError, asyncio.IncompleteReadError):
                pass
            finally:
                state["held"] -= 1
                writer.transport.abort()

    async def report() -> None:
        while loop.time() < end:
            await asyncio.sleep(1.0)
            print(
                json.dumps(
                    {
                        "t": round(loop.time() - start, 1),
                        "held": state["held"],
                        "opened": state["opened"],
                        "failed": state["failed"],
                    }
                ),
                flush=True,
            )

    tasks = [asyncio.create_task(slot()) for _ in range(n)]
    rep = asyncio.create_task(report())
    await asyncio.wait(tasks, timeout=duration + 20)
    rep.cancel()
    for t in tasks:
        t.cancel()
    print(json.dumps({"done": True, "opened": state["opened"], "failed": state["failed"]}), flush=True)


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ------------------------------------------------------------------------------ the agent


class Agent:
    def __init__(self, info: dict[str, Any], agent: dict[str, str], mtls_token: str, tunnel_token: str) -> None:
        from cryptography.hazmat.primitives import serialization

        from gateway.client.tls import build_client_context

        self.info = info
        self.agent = agent
        self.ctx = build_client_context(agent["ca"], agent["cert"], agent["key"])
        self.mtls_token = mtls_token
        self.tunnel_token = tunnel_token
        self.key = serialization.load_pem_private_key(Path(agent["key"]).read_bytes(), password=None)

    def request(self, listener: str, *, close: bool) -> bytes:
        from gateway.core import dpop

        if listener == "mtls":
            hdrs = {"Authorization": f"Bearer {self.mtls_token}", "X-UOMP-Agent-Id": self.agent["agent_id"]}
            return c.http_get(PATH, headers=hdrs, close=close)
        proof = dpop.make_dpop_proof(
            self.key,
            method="GET",
            url=TUNNEL + PATH,  # type: ignore[arg-type]
            access_token=self.tunnel_token,
            now=time.time(),
        )
        hdrs = {"Authorization": f"DPoP {self.tunnel_token}", "X-UOMP-Agent-Id": self.agent["agent_id"], "DPoP": proof}
        return c.http_get(PATH, host="tunnel.example", headers=hdrs, close=close)

    async def open(self, listener: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if listener == "mtls":
            return await asyncio.open_connection(
                c.LOOPBACK, self.info["gateway_port"], ssl=self.ctx, server_hostname=c.SNI
            )
        return await asyncio.open_connection(c.LOOPBACK, self.info["tunnel_port"])

    async def probe(self, listener: str, *, keepalive: bool, duration: float) -> dict[str, Any]:
        """Sequential GETs for ``duration`` s; latency of each (connect included when not keep-alive)."""
        lat: list[float] = []
        fails = 0
        reasons: collections.Counter[str] = collections.Counter()
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        end = time.monotonic() + duration
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = await asyncio.wait_for(self.open(listener), 30)
                reader, writer = conn
                writer.write(self.request(listener, close=not keepalive))
                status, _body, closing = await asyncio.wait_for(c.read_response(reader), 30)
                if status != 200:
                    raise ConnectionError(f"status {status}")
                lat.append(time.perf_counter() - t0)
                if closing or not keepalive:
                    writer.transport.abort()
                    conn = None
            except (
                OSError,
                TimeoutError,
                ssl.SSLError,
                asyncio.IncompleteReadError,
                ConnectionError,
                ValueError,
            ) as exc:
                fails += 1
                reasons[f"{type(exc).__name__}: {exc}"[:80]] += 1
                if conn is not None:
                    conn[1].transport.abort()
                conn = None
            await asyncio.sleep(0.02)
        if conn is not None:
            conn[1].transport.abort()
        return {"n": len(lat), "fails": fails, "p50": _pct(lat, 50), "p99": _pct(lat, 99), "reasons": dict(reasons)}

    async def probes(self, listener: str, duration: float) -> dict[str, dict[str, Any]]:
        new, keep = await asyncio.gather(
            self.probe(listener, keepalive=False, duration=duration),
            self.probe(listener, keepalive=True, duration=duration),
        )
        return {"new connection": new, "keep-alive": keep}


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))] * 1e3


class RssSampler:
    """The gateway's RSS (/proc) and its open client connections (its own Prometheus gauge, which
    counts every accepted connection on the mTLS and tunnel-origin listeners), every 0.25 s."""

    def __init__(self, pid: int, metrics_port: int | None) -> None:
        self.pid = pid
        self.metrics_port = metrics_port
        self.samples: list[int] = []
        self.open_conns: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import urllib.request

        while not self._stop.is_set():
            with contextlib.suppress(OSError, KeyError):
                self.samples.append(c.proc_status_kib(self.pid))
            if self.metrics_port:
                with (
                    contextlib.suppress(OSError, ValueError),
                    urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp,
                ):
                    for line in resp.read().decode().splitlines():
                        if line.startswith("uomp_gateway_open_connections "):
                            self.open_conns.append(int(float(line.split()[1])))
            self._stop.wait(0.25)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _run_flood(kind: str, args: argparse.Namespace, info: dict[str, Any], agent: Agent, ca: str) -> dict[str, Any]:
    spec = {
        "kind": kind,
        "conns": args.conns,
        "rate": args.rate,
        "duration": args.duration + args.ramp,
        "port": info["gateway_port"],
        "tunnel_port": info["tunnel_port"],
        "ca": ca,
    }
    proc = subprocess.Popen(
        [sys.executable, __file__, "--attack", json.dumps(spec)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    timeline: list[dict[str, Any]] = []
    done: dict[str, Any] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if doc.get("done"):
                    done.update(doc)
                else:
                    timeline.append(doc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    listener = "tunnel" if kind.startswith("tunnel") else "mtls"
    try:
        with RssSampler(info["pid"], info.get("metrics_port")) as rss:
            time.sleep(args.ramp)
            cpu0, t0 = c.proc_cpu_seconds(info["pid"]), time.perf_counter()
            probes = asyncio.run(agent.probes(listener, args.duration))
            cpu_share = (c.proc_cpu_seconds(info["pid"]) - cpu0) / (time.perf_counter() - t0)
        proc.wait(args.duration + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    reader.join(5)
    held = [int(t["held"]) for t in timeline]
    return {
        "kind": kind,
        "listener": listener,
        "probes": probes,
        "held_max": max(held, default=0),
        "held_mean": statistics.fmean(held) if held else 0.0,
        "timeline": held,
        "opened": done.get("opened", timeline[-1]["opened"] if timeline else 0),
        "rss_max_kib": max(rss.samples, default=0),
        "cpu": cpu_share,
        "gw_open_max": max(rss.open_conns, default=-1),
        "gw_open_mean": statistics.fmean(rss.open_conns) if rss.open_conns else -1.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conns", type=int, default=2000, help="hostile connections kept open (default 2000)")
    p.add_argument("--rate", type=float, default=1000.0, help="attacker's new connections per second (default 1000)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of agent probing per phase (default 15)")
    p.add_argument("--ramp", type=float, default=3.0, help="seconds of flooding before the agent starts (default 3)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--attack", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.attack:
        _raise_nofile()
        asyncio.run(_attack(json.loads(args.attack)))
        return
    _raise_nofile()
    print(c.machine_line())
    with c.bench_home(prefix="uomp-flood-") as paths:
        c.seed_store(paths, n_keys=20, n_other=10)
        ag = c.issue_agent(paths)
        with c.start_server(
            paths,
            gateway=True,
            gateway_config={"tunnel_origin_port": 0, "metrics_port": 0, "tunnel_endpoints": [TUNNEL]},
            what="appliance",
        ) as srv:
            info = srv.info
            from gateway.config import GatewayConfig

            d = GatewayConfig()

            def cfg(name: str) -> Any:  # getattr: the script also runs against older code, for comparison
                return getattr(d, name, "-")

            print(
                f"appliance: gateway pid {info['pid']} (fd limit {info.get('fd_limit')}), mTLS 127.0.0.1:"
                f"{info['gateway_port']}, tunnel origin 127.0.0.1:{info['tunnel_port']}; budgets (defaults): mTLS "
                f"{cfg('max_connections')} verified / {cfg('max_unverified_connections')} unverified "
                f"({cfg('max_unverified_connections_per_ip')} per address), tunnel {cfg('tunnel_max_connections')}"
                f" / {cfg('tunnel_max_unverified_connections')}; first byte {cfg('first_byte_timeout_seconds')} s,"
                f" headers {cfg('client_timeout_seconds')} s from accept"
            )
            print(
                f"attacker: up to {args.conns} connections, at most {args.rate:g} new/s; agent probes "
                f"{args.duration:g} s per phase after a {args.ramp:g} s ramp"
            )
            cnf = {"x5t#S256": ag["x5t"], "jkt": ag["jkt"]}
            mt = c.grant(
                paths,
                agent_id=ag["agent_id"],
                audience=f"https://localhost:{info['gateway_port']}",
                profile="remote",
                cnf=cnf,
            )
            tt = c.grant(paths, agent_id=ag["agent_id"], audience=TUNNEL, profile="remote", cnf=cnf)
            agent = Agent(info, ag, mt["token"], tt["token"])
            rss0 = max(srv.rss_kib(), 1)
            base: dict[str, dict[str, dict[str, Any]]] = {}
            cpu0, t0 = c.proc_cpu_seconds(info["pid"]), time.perf_counter()
            for listener in ("mtls", "tunnel"):
                base[listener] = asyncio.run(agent.probes(listener, args.duration))
            base_cpu = (c.proc_cpu_seconds(info["pid"]) - cpu0) / (time.perf_counter() - t0)
            rss_base = srv.rss_kib()
            results = []
            for kind in args.kinds:
                r = _run_flood(kind, args, info, agent, ag["ca"])
                results.append(r)
                time.sleep(3)  # let the last flood connections go
            print()
            print(
                f"gateway RSS before any flood: {rss0 / 1024:.1f} MiB; after the baseline: "
                f"{rss_base / 1024:.1f} MiB; gateway CPU during the baseline: {base_cpu * 100:.0f}% of a core"
            )
            print(
                "held: connections the attacker saw open (max/mean of its per-second counts); gw open: the "
                "gateway's open_connections gauge (max/mean, every 0.25 s, agent included)"
            )
            print(
                f"{'flood':<17} {'held':>9} {'gw open':>9} {'opened':>7} {'RSS max':>8} {'gw CPU':>6}  {'agent':<15} "
                f"{'p50 ms base→flood':>19} {'x':>5} {'p99 ms base→flood':>19} {'x':>5} {'fails':>7}"
            )
            for r in results:
                for mode, got in r["probes"].items():
                    b = base[r["listener"]][mode]
                    print(
                        f"{r['kind']:<17} {r['held_max']:>4}/{r['held_mean']:<4.0f} "
                        f"{r['gw_open_max']:>4}/{r['gw_open_mean']:<4.0f} {r['opened']:>7} "
                        f"{r['rss_max_kib'] / 1024:>6.1f}Mi {r['cpu'] * 100:>5.0f}%  {mode:<15} "
                        f"{b['p50']:>8.1f} → {got['p50']:>8.1f} {got['p50'] / b['p50']:>5.2f} "
                        f"{b['p99']:>8.1f} → {got['p99']:>8.1f} {got['p99'] / b['p99']:>5.2f} "
                        f"{got['fails']:>3}/{got['n'] + got['fails']:<4}"
                    )
            print()
            for r in results:
                print(f"held per second, {r['kind']}: {r['timeline']}")
                for mode, got in r["probes"].items():
                    if got["reasons"]:
                        print(f"  agent failures, {mode}: {got['reasons']}")
            for listener, probes in base.items():
                for mode, b in probes.items():
                    print(f"baseline {listener} {mode}: {b['n']} requests, {b['fails']} failed")


if __name__ == "__main__":
    main()
