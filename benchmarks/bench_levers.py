"""Issue 13's levers, each measured in one run: the keep-alive read path with each lever off and on.

    .venv/bin/python benchmarks/bench_levers.py [--duration S] [--clients N] [--rounds R]
        [--only base,uvloop,...] [--workers]

Appliances laid out like ``uomp gateway start`` (``_common.start_server``: gateway process + guard
child), identical but for the switches in their environment (product switches, read at start):

* ``base``: every lever off: ``UOMP_UVLOOP=0`` (asyncio's loop), ``UOMP_ORJSON=0`` (the standard
  library's json), ``UOMP_SESSION_CACHE=0`` (the session row read and decoded per request): the
  appliance as it was before this work;
* ``uvloop``, ``orjson``, ``session cache``: that lever alone on;
* ``all``: all on (the product's default);
* ``2 workers`` (``--workers``): all on, and a second gateway process sharing the mTLS port
  (``GatewayConfig.listen_reuse_port``, SO_REUSEPORT; its own copy of the home, the first
  appliance's guard as upstream): does a second worker pay on this machine?

Each is loaded like ``bench_gateway.py`` does (50 keep-alive clients cycling ``GET /v1/memory/<key>``
over 200 granted keys, every request audited): (a) direct to the guard's Unix socket, (b) through
TLS 1.3 mTLS; rounds alternate over all appliances, so drift hits all alike. The table gives req/s,
latency, and the CPU per request of each process (gateway, guard); the RATIOS line each lever's
gain over ``base``.
"""

from __future__ import annotations

import argparse
from typing import Any

import _common as c

from gateway import contract

OFF = {"UOMP_UVLOOP": "0", "UOMP_ORJSON": "0", "UOMP_SESSION_CACHE": "0"}
LEVERS: dict[str, dict[str, str]] = {
    "base": dict(OFF),
    "uvloop": {**OFF, "UOMP_UVLOOP": "1"},
    "orjson": {**OFF, "UOMP_ORJSON": "1"},
    "session cache": {**OFF, "UOMP_SESSION_CACHE": "1"},
    "all": {"UOMP_UVLOOP": "1", "UOMP_ORJSON": "1", "UOMP_SESSION_CACHE": "1"},
}


class App:
    def __init__(self, label: str, env: dict[str, str], *, workers: int = 1) -> None:
        self.label = label
        self.paths = paths = c.make_home()
        self.worker: Any = None
        self.worker_home: Any = None
        try:
            keys = c.seed_store(paths)
            self.agent = agent = c.issue_agent(paths)
            gw_cfg = None
            if workers > 1:
                gw_cfg = {"listen_port": c.free_port(), "listen_reuse_port": True}
            self.srv = c.start_server(paths, gateway=True, what=label, env=env, gateway_config=gw_cfg)
            if workers > 1:
                self._second_worker(env, gw_cfg or {})
        except BaseException:
            if self.worker is not None:
                self.worker.stop()
            c.remove_home(paths)
            raise
        try:
            port = self.srv.info["gateway_port"]
            g = c.grant(
                paths,
                profile="remote",
                audience=f"https://localhost:{port}",
                cnf={"x5t#S256": agent["x5t"], "jkt": agent["jkt"]},
            )
        except BaseException:
            self.stop()
            raise
        hdrs = {"Authorization": f"Bearer {g['token']}", "X-UOMP-Agent-Id": agent["agent_id"]}
        asserted = contract.assertion_headers(
            token=g["token"],
            agent_id=agent["agent_id"],
            listener="mtls",
            via="gateway:mtls:bench",
            x5t=agent["x5t"],
            jkt=agent["jkt"],
        )
        self.reqs = {
            "gateway": [c.http_get(f"/v1/memory/{k}", host=f"localhost:{port}", headers=hdrs) for k in keys],
            "direct": [c.http_get(f"/v1/memory/{k}", host="localhost", headers=asserted) for k in keys],
        }
        self.targets = {
            "gateway": c.Target("tls", port=port, ca=agent["ca"], cert=agent["cert"], key=agent["key"]),
            "direct": c.Target("unix", path=self.srv.info["guard_sock"]),
        }
        self.runs: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": []}

    def _second_worker(self, env: dict[str, str], gw_cfg: dict[str, Any]) -> None:
        """A second gateway process on the same port (SO_REUSEPORT), forwarding to the first one's guard.
        Its own copy of the home (CA files, keys; its own access log), started after the first."""
        import shutil

        from gateway.config import Paths

        home2 = Paths(c.Path(str(self.paths.home) + "-w2"))
        shutil.copytree(self.paths.home, home2.home, ignore=shutil.ignore_patterns("*.sock", "gateway"))
        self.worker_home = home2
        self.worker = c.start_server(
            home2,
            gateway=True,
            layout="gateway-only",
            what=f"{self.label} worker 2",
            env=env,
            gateway_config={**gw_cfg, "upstream": f"unix:{self.paths.guard_sock}"},
        )

    @property
    def pids(self) -> dict[str, int]:
        pids = dict(self.srv.pids)
        if self.worker is not None:
            pids["gateway 2"] = self.worker.pid
        return pids

    def load(self, kind: str, args: argparse.Namespace) -> None:
        r = c.run_load(
            self.targets[kind],
            self.reqs[kind],
            clients=args.clients,
            duration=args.duration,
            warmup=1.0,
            max_requests=2_000_000,
            server_pid=self.pids,
        )
        c.check_ok(f"{self.label}: {kind}", r)
        self.runs[kind].append(r)

    def stop(self) -> None:
        try:
            if self.worker is not None:
                self.worker.stop()
            self.srv.stop()
        finally:
            c.remove_home(self.paths)
            if self.worker_home is not None:
                c.remove_home(self.worker_home)


def _cpu_us(r: dict[str, Any], role: str) -> float:
    parts = r.get("server_cpu_parts") or {}
    share = sum(v for k, v in parts.items() if k.startswith(role))  # "gateway" counts both workers
    return float(share) / r["rps"] * 1e6 if r.get("rps") else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(LEVERS), help="comma-separated subset of: " + ", ".join(LEVERS))
    ap.add_argument(
        "--workers",
        action="store_true",
        help="also an appliance (all levers on) with a second gateway process on the same port",
    )
    args = ap.parse_args()
    wanted = [x.strip() for x in args.only.split(",") if x.strip()]
    if "base" not in wanted or any(w not in LEVERS for w in wanted):
        raise SystemExit(f"--only must include base; known: {', '.join(LEVERS)}")
    if not (1 <= args.clients <= 1000 and 0 < args.duration <= 600 and 1 <= args.rounds <= 10):
        raise SystemExit("--clients 1..1000, --duration 0..600, --rounds 1..10")
    print(f"bench_levers: {c.machine_line()}")
    print(
        f"{args.clients} clients, {args.rounds} rounds x {args.duration:g} s per path and appliance, rounds "
        f"alternated over: {', '.join(wanted)}"
    )
    apps: dict[str, App] = {}
    try:
        for name in wanted:
            apps[name] = App(name, LEVERS[name])
        if args.workers:
            apps["2 workers"] = App("2 workers", LEVERS["all"], workers=2)
            wanted.append("2 workers")
        for _ in range(args.rounds):
            for app in apps.values():
                for kind in ("direct", "gateway"):
                    app.load(kind, args)
    finally:
        for a in apps.values():
            a.stop()
    res = {k: {kind: c.merge_results(runs) for kind, runs in a.runs.items()} for k, a in apps.items()}
    print()
    rows = []
    for k in wanted:
        rows += [(f"{k}: (a) direct, guard socket", res[k]["direct"]), (f"{k}: (b) gateway, mTLS", res[k]["gateway"])]
    c.print_table(rows)
    b = res["base"]
    print(
        f"\n{'lever':<16} {'direct x':>9} {'gateway x':>10} {'gw/direct':>10} {'guard µs/req (a)':>17} "
        f"{'guard µs/req (b)':>17} {'gateway µs/req (b)':>19}"
    )
    for k in wanted:
        d, g = res[k]["direct"], res[k]["gateway"]
        print(
            f"{k:<16} {d['rps'] / b['direct']['rps']:>9.2f} {g['rps'] / b['gateway']['rps']:>10.2f} "
            f"{g['rps'] / d['rps']:>10.2f} {_cpu_us(d, 'guard'):>17.0f} {_cpu_us(g, 'guard'):>17.0f} "
            f"{_cpu_us(g, 'gateway'):>19.0f}"
        )
    line = "RATIOS (each / base, same run):"
    for k in wanted[1:]:
        line += (
            f" {k}: direct x{res[k]['direct']['rps'] / b['direct']['rps']:.2f}, gateway "
            f"x{res[k]['gateway']['rps'] / b['gateway']['rps']:.2f}, guard CPU/req (a) "
            f"x{_cpu_us(res[k]['direct'], 'guard') / max(1e-9, _cpu_us(b['direct'], 'guard')):.2f};"
        )
    print(line)


if __name__ == "__main__":
    main()
