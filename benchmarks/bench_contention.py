"""Why the gateway path runs below the direct guard on a small machine, in one run (issue 13).

    .venv/bin/python benchmarks/bench_contention.py [--duration S] [--rounds R] [--clients N]

One appliance laid out like ``uomp gateway start`` (``bench_gateway.Appliance``: the gateway process
and its guard child, a throwaway UOMP_HOME, 1,200 items). Each round runs four keep-alive phases of
GET by key, in this order:

(g) gateway: TLS 1.3 mTLS through the gateway, as ``bench_gateway.py`` (b); its gateway process's CPU
    share (of one core) is the burner's duty cycle for (c);
(d) direct: the guard's Unix socket, as ``bench_gateway.py`` (a);
(h) direct with the gateway's audit fields: (d)'s requests (which carry ``X-UOMP-Verified-Listener``)
    plus the other headers the gateway adds for the event (``-Client``, ``-Cert-Serial``,
    ``-Request-Id``), so the guard writes events of the gateway's size;
(c) direct beside a CPU burner: (d) while another process spins the gateway's share of every 2 ms,
    i.e. the CPU the gateway takes from the two cores, without any of its work for the guard.

Rows: req/s and the guard's CPU per read in each; then ``gateway / direct`` (issue 13's ratio),
``direct with audit fields / direct`` (what the gateway's extra event fields cost the guard),
``direct beside the burner / direct`` (what a competitor of the gateway's size costs the guard) and
``gateway / direct beside the burner`` (the gateway path against a direct guard facing the same
competition). Figures and reading: ``benchmarks/README.md``, "Issue 13, session 7".
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from typing import Any

import _common as c
import bench_gateway as bg

from gateway import contract

BURN_PERIOD_SECONDS = 0.002
BURNER = """
import sys, time
duty = float(sys.argv[1]); period = float(sys.argv[2]); deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    t = time.perf_counter()
    while time.perf_counter() - t < period * duty:
        pass
    time.sleep(period * (1 - duty))
"""


def with_audit_fields(requests: list[bytes], port: int) -> list[bytes]:
    """``requests`` with the event headers the gateway adds beyond the direct requests' listener
    (client address, certificate serial, request id; values of a realistic size)."""
    out = []
    for i, req in enumerate(requests):
        line, _, rest = req.partition(b"\r\n")
        extra = (
            f"{contract.VERIFIED_CLIENT_HEADER}: 127.0.0.1:{40000 + i}\r\n"
            f"{contract.VERIFIED_SERIAL_HEADER}: {'7f3a' * 10}\r\n"
            f"{contract.VERIFIED_REQUEST_ID_HEADER}: {i * 7919:032x}\r\n"
        ).encode()
        out.append(line + b"\r\n" + extra + rest)
    return out


def guard_us(r: dict[str, Any]) -> float:
    share = (r.get("server_cpu_parts") or {}).get("guard", 0.0)
    return share / r["rps"] * 1e6 if r["rps"] else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=4.0, help="timed seconds per phase and round (default 4)")
    ap.add_argument("--clients", type=int, default=50, help="concurrent keep-alive connections (default 50)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the four phases (default 2)")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--max-requests", type=int, default=2_000_000, help="cap per phase (default 2,000,000)")
    args = ap.parse_args()
    if not (1 <= args.clients <= 1000 and 0 < args.duration <= 120 and 1 <= args.rounds <= 10):
        raise SystemExit("--clients 1..1000, --duration 0..120, --rounds 1..10")
    print(f"bench_contention: {c.machine_line()}")
    runs: dict[str, list[dict[str, Any]]] = {"gateway": [], "direct": [], "fields": [], "burner": []}
    duties: list[float] = []
    app = bg.Appliance(label="appliance", max_connections=None)
    try:
        port = app.srv.info["gateway_port"]
        app.reqs["fields"] = with_audit_fields(app.reqs["direct"], port)
        app.targets["fields"] = app.targets["direct"]
        for _ in range(args.rounds):
            g = app.keepalive("gateway", args)
            runs["gateway"].append(g)
            duty = min(0.95, max(0.05, float((g.get("server_cpu_parts") or {}).get("gateway", 0.5))))
            duties.append(duty)
            runs["direct"].append(app.keepalive("direct", args))
            runs["fields"].append(app.keepalive("fields", args))
            burner = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    BURNER,
                    f"{duty:.3f}",
                    str(BURN_PERIOD_SECONDS),
                    str(args.warmup + args.duration + 30),
                ]
            )
            try:
                runs["burner"].append(app.keepalive("direct", args))
            finally:
                burner.kill()
                burner.wait()
    finally:
        app.stop()

    names = {
        "gateway": "(g) gateway: TLS 1.3 mTLS",
        "direct": "(d) direct: guard Unix socket",
        "fields": "(h) direct + the gateway's audit fields",
        "burner": "(c) direct beside the burner",
    }
    print(
        f"{args.clients} clients, {args.rounds} rounds x {args.duration:g} s per phase; burner duty "
        f"{', '.join(f'{d:.0%}' for d in duties)} of every {BURN_PERIOD_SECONDS * 1e3:g} ms (the gateway's "
        "share in that round)\n"
    )
    for kind, label in names.items():
        rs = runs[kind]
        print(
            f"{label:<42} req/s {[round(r['rps']) for r in rs]}  guard CPU/read {[round(guard_us(r)) for r in rs]} µs"
        )
    med = {k: statistics.median(r["rps"] for r in rs) for k, rs in runs.items()}
    print(
        f"\nRATIOS (medians of the rounds) gateway/direct {med['gateway'] / med['direct']:.2f}; "
        f"direct with audit fields/direct {med['fields'] / med['direct']:.2f}; "
        f"direct beside the burner/direct {med['burner'] / med['direct']:.2f}; "
        f"gateway/(direct beside the burner) {med['gateway'] / med['burner']:.2f}"
    )


if __name__ == "__main__":
    main()
