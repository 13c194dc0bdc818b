"""Two versions of the gateway side by side in one run: the gateway's CPU per forwarded read.

    git -C /work/main archive main gateway | tar -x -C /tmp/uomp-base      # the "before" tree
    .venv/bin/python benchmarks/bench_gateway_ab.py --base /tmp/uomp-base [--rounds 6] [--duration 5]
        [--clients 50]
    .venv/bin/python benchmarks/bench_gateway_ab.py --base plain     # plain Python vs compiled

Two appliances, each laid out as in ``bench_gateway.py`` (gateway process + guard child, throwaway
UOMP_HOME, one agent, 200 keys): "base" runs the ``gateway`` package found in ``--base`` (put first
on its ``PYTHONPATH``), "this" the package of this checkout. ``--base plain``: "base" is this checkout
with ``UOMP_NATIVE=0`` (plain Python), "this" its compiled request path (gateway/native.py). Their
keep-alive mTLS phases (GET by key, ``--clients`` connections) alternate, base first in even rounds
and second in odd ones, so the drift of a shared machine hits both alike. Printed per phase and as
medians: req/s, the gateway process's CPU per request (µs, utime + stime of the process and its
threads over the phase / answers) and the guard's. On a machine shared with other work the req/s move a lot; the CPU per
request moves much less, and the paired rounds say which side is cheaper. PAIRED ROUNDS: per
measure, the median of the rounds' own this/base ratios, in how many rounds this side was ahead, and
a sign test's p (``_common.sign_test``): a split of 9 of 12 has p = 0.15, which a change that does
nothing gives one run in seven, so it is printed as "inside this run's spread".
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import _common as c
import bench_gateway as bg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--base",
        required=True,
        help="a directory holding the 'before' gateway package, or 'plain': this checkout as plain Python "
        "(UOMP_NATIVE=0) against itself compiled",
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=50)
    args = ap.parse_args()
    if args.base == "plain":
        base_env = {"UOMP_NATIVE": "0"}
    else:
        base = Path(args.base).resolve()
        if not (base / "gateway" / "__init__.py").is_file():
            raise SystemExit(f"{base} holds no gateway package")
        base_env = {"PYTHONPATH": str(base)}
    print(f"bench_gateway_ab: {c.machine_line()}")
    apps = {"base": bg.Appliance(label="base", max_connections=None, env=base_env)}
    try:
        apps["this"] = bg.Appliance(label="this", max_connections=None)
    except BaseException:
        apps["base"].stop()
        raise
    rows: dict[str, list[tuple[float, float, float]]] = {k: [] for k in apps}
    load = argparse.Namespace(clients=args.clients, duration=args.duration, warmup=1.0, max_requests=2_000_000)
    try:
        for i in range(args.rounds):
            for name in ("base", "this") if i % 2 == 0 else ("this", "base"):
                r: dict[str, Any] = apps[name].keepalive("gateway", load)
                parts = r["server_cpu_parts"]
                row = (r["rps"], parts["gateway"] * 1e6 / r["rps"], parts["guard"] * 1e6 / r["rps"])
                rows[name].append(row)
                print(
                    f"round {i} {name:4}  {row[0]:6.0f} req/s  gateway {row[1]:5.0f} µs/request  "
                    f"guard {row[2]:5.0f} µs/request",
                    flush=True,
                )
        for name, got in rows.items():
            print(
                f"{name:4} median {statistics.median(x[0] for x in got):6.0f} req/s  gateway "
                f"{statistics.median(x[1] for x in got):5.0f} µs/request {[round(x[1]) for x in got]}  guard "
                f"{statistics.median(x[2] for x in got):5.0f} µs/request"
            )
        b = statistics.median(x[1] for x in rows["base"])
        t = statistics.median(x[1] for x in rows["this"])
        print(f"gateway CPU per request this/base: {t / b:.2f} ({t - b:+.0f} µs)")
        gb = statistics.median(x[2] for x in rows["base"])
        gt = statistics.median(x[2] for x in rows["this"])
        print(f"guard CPU per request this/base: {gt / gb:.2f} ({gt - gb:+.0f} µs)")
        pairs = list(zip(rows["this"], rows["base"], strict=True))  # the two phases of one round
        print("PAIRED ROUNDS (each round's this/base; a lever under ~10 % needs many pairs on a shared VM):")
        for i, what, ahead in (
            (0, "req/s", "this faster"),
            (1, "gateway CPU per request", "this cheaper"),
            (2, "guard CPU per request", "this cheaper"),
        ):
            ratios = [mine[i] / theirs[i] for mine, theirs in pairs]
            print("  " + c.paired_line(what, ratios, ahead, ahead_below_one=i > 0))
    finally:
        for a in apps.values():
            a.stop()


if __name__ == "__main__":
    main()
