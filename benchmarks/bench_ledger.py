"""The verifiable event log's costs, in one run (issue 10's performance aims).

    .venv/bin/python benchmarks/bench_ledger.py [--events 1000000] [--seconds 3]

Rows:

* durable appends per second with group commit: one writer commits every pending event in one
  transaction (WAL, synchronous=FULL, so one fsync per batch), for batch sizes 1..1024; each event
  is a realistic access event (canonical JSON, leaf hash, tree nodes, all in the transaction);
* checkpoint time: sign + consistency check with the previous checkpoint, per batch;
* at --events (default 1,000,000) events: inclusion-proof generation from the stored tree and its
  verification, mean over 2,000 random leaves; consistency proofs likewise; and `verify_log` over
  the whole log (events per second, peak RSS).
"""

from __future__ import annotations

import argparse
import random
import resource
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway.core import merkle
from gateway.ledger.log import EventLog
from gateway.ledger.verify import verify_log

ORIGIN = "bench.local/audit"


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


def event(i: int) -> dict[str, object]:
    return {
        "id": f"evt_{i:012x}",
        "ts": 1_790_000_000.0 + i / 1000,
        "timestamp": "2026-09-21T12:00:00.000Z",
        "action": "read",
        "session_id": f"sess_{i % 50:04d}",
        "agent_id": "portfolio_agent",
        "allowed": True,
        "reason": "granted",
        "code": None,
        "key": "preference.theme",
        "listener": "mtls",
        "via": "gateway",
        "cert_serial": "5f3a9c",
        "query_count_remaining": 9000 - i % 9000,
    }


def appends_per_second(batch: int, seconds: float) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        log = EventLog(connect(Path(d) / "e.db"), origin=ORIGIN, key=Ed25519PrivateKey.generate())
        n = 0
        lat = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t1 = time.perf_counter()
            log.conn.execute("BEGIN IMMEDIATE")
            log.append([event(n + j) for j in range(batch)])
            log.conn.execute("COMMIT")
            lat.append(time.perf_counter() - t1)
            n += batch
        return n / (time.perf_counter() - t0), statistics.median(lat) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()

    print("durable appends with group commit (WAL, synchronous=FULL: one fsync per batch)")
    print(f"{'batch':>6} {'events/s':>10} {'commit p50 ms':>14}")
    for batch in (1, 16, 64, 256, 1024):
        rate, p50 = appends_per_second(batch, args.seconds)
        print(f"{batch:>6} {rate:>10,.0f} {p50:>14.2f}")

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "big.db"
        key = Ed25519PrivateKey.generate()
        log = EventLog(connect(path), origin=ORIGIN, key=key)
        log.conn.execute("PRAGMA synchronous=OFF")  # building the fixture only
        t0 = time.perf_counter()
        cp_times = []
        step = 10_000
        for start in range(0, args.events, step):
            log.conn.execute("BEGIN IMMEDIATE")
            log.append([event(i) for i in range(start, min(start + step, args.events))])
            t1 = time.perf_counter()
            log.checkpoint(now=time.time())
            cp_times.append(time.perf_counter() - t1)
            log.conn.execute("COMMIT")
        build = time.perf_counter() - t0
        print(f"\nbuilt {args.events:,} events in {build:.1f} s ({args.events / build:,.0f}/s, fixture, no fsync)")
        print(
            f"checkpoint (root + consistency proof + Ed25519 sign), per batch: "
            f"p50 {statistics.median(cp_times) * 1000:.2f} ms, max {max(cp_times) * 1000:.2f} ms"
        )

        size = log.size
        root = log.tree.root()
        rng = random.Random(7)
        idx = [rng.randrange(size) for _ in range(2000)]
        leaves = {i: log.tree.node(0, i) for i in idx}
        t0 = time.perf_counter()
        proofs = [log.tree.inclusion_proof(i, size) for i in idx]
        gen = (time.perf_counter() - t0) / len(idx)
        t0 = time.perf_counter()
        for i, p in zip(idx, proofs, strict=True):
            merkle.verify_inclusion(i, size, leaves[i], p, root)
        ver = (time.perf_counter() - t0) / len(idx)
        print(
            f"inclusion proof at {size:,} events: generate {gen * 1e3:.3f} ms, verify {ver * 1e3:.3f} ms "
            f"(path length {len(proofs[0])})"
        )
        olds = [rng.randrange(1, size) for _ in range(500)]
        t0 = time.perf_counter()
        cps = [(o, log.tree.consistency_proof(o, size)) for o in olds]
        cgen = (time.perf_counter() - t0) / len(olds)
        roots = {o: log.tree.root(o) for o in olds}
        t0 = time.perf_counter()
        for o, p in cps:
            merkle.verify_consistency(o, size, roots[o], root, p)
        cver = (time.perf_counter() - t0) / len(olds)
        print(f"consistency proof at {size:,} events: generate {cgen * 1e3:.3f} ms, verify {cver * 1e3:.3f} ms")

        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        report = verify_log(log.conn, origin=ORIGIN, public_key=key.public_key())
        took = time.perf_counter() - t0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(
            f"verify_log over {report.events:,} events and {report.checkpoints} checkpoints: ok={report.ok} "
            f"{took:.1f} s ({report.events / took:,.0f} events/s), peak RSS {rss1 / 1024:.0f} MiB "
            f"(+{(rss1 - rss0) / 1024:.0f} MiB during the check)"
        )


if __name__ == "__main__":
    main()
