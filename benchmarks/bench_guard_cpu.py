"""The guard's CPU per read, this tree beside an older one, in one run (issue 13: "CPU per request
of the guard halved versus today's").

    .venv/bin/python benchmarks/bench_guard_cpu.py [--baseline PATH] [--duration S] [--clients N] [--rounds R]
        [--log-events N] [--sealed]

``--sealed``: this tree also on a sealed home (memory.db and audit.db SQLCipher files) and on one
sealed in the databases' old format (HMAC-SHA512 page HMACs, gateway/atrest/memdb.py), rounds
alternated with the plain home's; prints sealed/plain ratios.

``--baseline PATH``: a checkout of an older commit (for issue 13, the commit the issue was measured
on: ``git worktree add /tmp/base13 8be383b``). Each phase runs in a child process started with
``PYTHONPATH=<tree>`` and that tree's own ``benchmarks/_common.py`` (its seeding, its guard, its load
generator), so each tree is measured as it was; trees are alternated (A B A B) so drift hits both.

What one phase does: a throwaway ``UOMP_HOME`` seeded with 1,200 items (and, with ``--log-events N``,
an audit log grown to N events by that tree's own code, so each tree keeps its own event ids), the
guard alone
(``_common.py serve``) with its Unix socket, a Local Profile grant, then ``--clients`` keep-alive
clients doing ``GET /v1/memory/<key>`` over 200 keys for ``--duration`` seconds (every read audited
and durable before it is answered), then one client (unloaded latency). CPU time is read per
**thread** of the guard process from ``/proc/<pid>/task/*/stat`` (user + system, so the fsync work
of a commit counts) before and after the timed load, and divided by the requests answered; thread
names come from ``py-spy dump`` when it is installed (it is in the dev extra), else the kernel's.

Prints per tree: req/s, p50, CPU µs per request in all and per thread, the system part of it and
the guard's context switches per request (voluntary + involuntary, all threads: one wake-up of the
event loop or a worker per job shows here first; issue 13's DbWorker hand-over took it from 3.5-6.7
to 1.2-1.5); then the ratio this/baseline. Nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu(pid: int) -> dict[str, tuple[int, int, int]]:
    """Per thread of ``pid``: (user ticks, system ticks, context switches so far)."""
    out: dict[str, tuple[int, int, int]] = {}
    for d in glob.glob(f"/proc/{pid}/task/*"):
        try:
            fields = Path(d, "stat").read_text().rsplit(")", 1)[1].split()
            switches = sum(
                int(line.split()[1]) for line in Path(d, "status").read_text().splitlines() if "ctxt_switches:" in line
            )
        except OSError:  # the thread ended meanwhile
            continue
        out[d.rsplit("/", 1)[1]] = (int(fields[11]), int(fields[12]), switches)
    return out


def _thread_names(pid: int) -> dict[str, str]:
    names = {}
    for d in glob.glob(f"/proc/{pid}/task/*"):
        try:
            names[d.rsplit("/", 1)[1]] = Path(d, "comm").read_text().strip()
        except OSError:
            continue
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if Path(spy).exists():
        dump = subprocess.run([spy, "dump", "-p", str(pid)], capture_output=True, text=True, timeout=30).stdout
        names.update({m.group(1): m.group(2) for m in re.finditer(r'Thread (\d+) \(\w+\): "([^"]+)"', dump)})
    return names


def _group(name: str) -> str:
    """Worker pools by their prefix (``uvloop_3`` -> ``uvloop_*``)."""
    return re.sub(r"[_-]\d+$", "_*", name)


PREFILL_BATCH = 500


def prefill_audit(paths: Any, events: int) -> None:
    """Grow the home's audit log to ``events`` events of a read's shape, over the last day, with the
    ``gateway`` this process imports (so each tree writes its own event ids): an appliance that has
    run a while, where the log's indexes no longer fit in a few pages."""
    if events <= 0:
        return
    import time

    from gateway.config import GuardConfig, load_section
    from gateway.guard.audit import make_row, open_audit

    log = open_audit(paths, load_section(GuardConfig, "guard", file=paths.config_file))
    try:
        t0 = time.time() - 86_400
        for start in range(0, events, PREFILL_BATCH):
            log.write_now(
                [
                    make_row(
                        session_id="sess_earlier",
                        agent_id="portfolio_agent",
                        action="read",
                        allowed=True,
                        reason="scope matched",
                        key="preference.theme",
                        tags=["preference"],
                        response_size=120,
                        query_count_remaining=9000,
                        via="gateway:mtls:bench",
                        now=t0 + (start + i) * 0.05,
                        extra={"listener": "mtls", "client": "127.0.0.1:40001"},
                    )
                    for i in range(min(PREFILL_BATCH, events - start))
                ]
            )
    finally:
        log.close()


def child(args: argparse.Namespace) -> None:
    """One phase on the tree this process imports (PYTHONPATH); one JSON line on stdout."""
    sys.path.insert(0, str(Path(args.tree) / "benchmarks"))
    import _common as c  # the tree's own

    with c.bench_home(False) as paths:
        keys = c.seed_store(paths)
        prefill_audit(paths, args.log_events)
        knobs: dict[str, Any] = {}
        if args.seal != "none":  # memory.db and audit.db SQLCipher files, in the current format or the old one
            knobs["env"] = {"UOMP_PASSPHRASE_FILE": c.seal_home(paths, old_format=args.seal == "old")}
        port = c.free_port()
        with c.start_server(paths, tcp_port=port, what="guard", **knobs) as srv:
            g = c.grant(paths, profile="local", audience=f"http://127.0.0.1:{port}")
            hdrs = {"Authorization": f"Bearer {g['token']}"}
            reqs = [c.http_get(f"/v1/memory/{k}", host=f"127.0.0.1:{port}", headers=hdrs) for k in keys]
            target = c.Target("unix", path=srv.info["guard_sock"])
            c.run_load(
                target, reqs, clients=args.clients, duration=1.0, warmup=0.0, max_requests=200_000, server_pid=srv.pid
            )  # warm caches and the WAL
            names = _thread_names(srv.pid)
            out: dict[str, Any] = {"tree": args.tree}
            for phase, clients in (("loaded", args.clients), ("unloaded", 1)):
                before = _thread_cpu(srv.pid)
                r = c.run_load(
                    target,
                    reqs,
                    clients=clients,
                    duration=args.duration,
                    warmup=0.0,
                    max_requests=2_000_000,
                    server_pid=srv.pid,
                )
                after = _thread_cpu(srv.pid)
                n = max(1, int(r["count"]))
                per: dict[str, float] = {}
                user = system = switches = 0
                for tid, (u, sy, sw) in after.items():
                    u0, sy0, sw0 = before.get(tid, (0, 0, 0))
                    user, system, switches = user + u - u0, system + sy - sy0, switches + sw - sw0
                    if u + sy - u0 - sy0:
                        key = _group(names.get(tid, "thread"))
                        per[key] = per.get(key, 0.0) + (u + sy - u0 - sy0) / TICK / n * 1e6
                out[phase] = {
                    "rps": r["rps"],
                    "p50_ms": r["p50_ms"],
                    "count": r["count"],
                    "non200": r.get("non200", 0),
                    "cpu_us": sum(per.values()),
                    "threads": per,
                    "sys_us": system / TICK / n * 1e6,
                    "switches": switches / n,
                }
    print(json.dumps(out), flush=True)


def run_phase(tree: Path, args: argparse.Namespace, seal: str = "none") -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--tree",
        str(tree),
        "--duration",
        str(args.duration),
        "--clients",
        str(args.clients),
        "--log-events",
        str(args.log_events),
        "--seal",
        seal,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"phase on {tree} failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="an older checkout to measure beside this one")
    ap.add_argument("--duration", type=float, default=5.0, help="timed seconds per phase (default 5)")
    ap.add_argument("--clients", type=int, default=50, help="keep-alive clients in the loaded phase (default 50)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per tree (default 2)")
    ap.add_argument(
        "--log-events",
        type=int,
        default=0,
        help="grow each home's audit log to this many events first (default 0: an empty log)",
    )
    ap.add_argument(
        "--sealed",
        action="store_true",
        help="this tree on a plain home, a sealed one and one sealed in the databases' old format (HMAC-SHA512)",
    )
    ap.add_argument("--seal", choices=["none", "current", "old"], default="none", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=str(ROOT), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not (
        1 <= args.clients <= 500
        and 0 < args.duration <= 120
        and 1 <= args.rounds <= 10
        and 0 <= args.log_events <= 5_000_000
    ):
        raise SystemExit("--clients 1..500, --duration 0..120 s, --rounds 1..10, --log-events 0..5,000,000")
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(HERE))
    import _common as c

    print(f"bench_guard_cpu: {c.machine_line()}")
    trees = {"this": ROOT}
    seals = {"this": "none"}
    if args.sealed:
        trees.update({"sealed": ROOT, "sealed-old": ROOT})
        seals.update({"sealed": "current", "sealed-old": "old"})
    if args.baseline is not None:
        if not (args.baseline / "gateway" / "__init__.py").exists():
            raise SystemExit(f"--baseline {args.baseline}: not a checkout of this project")
        trees["baseline"] = args.baseline.resolve()
    print(
        f"trees: {', '.join(f'{k} = {v}' for k, v in trees.items())}; {args.clients} clients, "
        f"{args.rounds} x {args.duration:.0f} s per tree, alternated; audit log grown to {args.log_events:,} "
        "events first"
    )
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            results[name].append(run_phase(tree, args, seals.get(name, "none")))
    summary: dict[str, dict[str, dict[str, float]]] = {}
    print(f"\n{'tree':9s} {'phase':9s} {'req/s':>7s} {'p50 ms':>7s} {'CPU us/req':>10s}  per thread (us/req)")
    for name, runs in results.items():
        summary[name] = {}
        for phase in ("loaded", "unloaded"):
            rows = [r[phase] for r in runs]
            cpu = statistics.median(r["cpu_us"] for r in rows)
            rps = statistics.median(r["rps"] for r in rows)
            p50 = statistics.median(r["p50_ms"] for r in rows)
            summary[name][phase] = {"cpu": cpu, "rps": rps, "p50": p50}
            threads: dict[str, list[float]] = {}
            for r in rows:
                for k, v in r["threads"].items():
                    threads.setdefault(k, []).append(v)
            med = {k: statistics.median(v) for k, v in threads.items()}
            parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(med.items(), key=lambda kv: -kv[1]) if v >= 1)
            print(f"{name:9s} {phase:9s} {rps:7.0f} {p50:7.2f} {cpu:10.0f}  {parts}")
            print(
                f"{'':19s} rounds: CPU us/req {[round(r['cpu_us']) for r in rows]}, "
                f"req/s {[round(r['rps']) for r in rows]}; of the CPU, system "
                f"{statistics.median(r['sys_us'] for r in rows):.0f} us/req; context switches "
                f"{statistics.median(r['switches'] for r in rows):.2f}/req"
            )
    for name in ("sealed", "sealed-old"):
        if name in summary:
            one, plain = summary[name], summary["this"]
            loaded = one["loaded"]["cpu"] / plain["loaded"]["cpu"]
            print(
                f"\nRATIOS {name}/plain: CPU per read (50 clients) x{loaded:.2f}, "
                f"(1 client) x{one['unloaded']['cpu'] / plain['unloaded']['cpu']:.2f}; req/s "
                f"x{one['loaded']['rps'] / plain['loaded']['rps']:.2f} (aim of issue 31: >= 0.9)"
            )
    if "baseline" in summary:
        this, base = summary["this"], summary["baseline"]
        print(
            "\nRATIOS this/baseline: CPU per read (50 clients) x{:.2f}, (1 client) x{:.2f}; req/s x{:.2f} / x{:.2f}; "
            "unloaded p50 {:.2f} vs {:.2f} ms".format(
                this["loaded"]["cpu"] / base["loaded"]["cpu"],
                this["unloaded"]["cpu"] / base["unloaded"]["cpu"],
                this["loaded"]["rps"] / base["loaded"]["rps"],
                this["unloaded"]["rps"] / base["unloaded"]["rps"],
                this["unloaded"]["p50"],
                base["unloaded"]["p50"],
            )
        )
        print(
            "AIM (issue 13): the guard's CPU per request halved (ratio <= 0.50): "
            + ("met" if this["loaded"]["cpu"] / base["loaded"]["cpu"] <= 0.5 else "NOT met")
        )


if __name__ == "__main__":
    main()
