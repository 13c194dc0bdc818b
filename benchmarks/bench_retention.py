"""Audit retention on a grown log: one UPDATE (before) vs the sliced, resumable purge, in one run.

    .venv/bin/python benchmarks/bench_retention.py [--pruned 300000] [--due 200000]

Two audit.db files of the same shape (``AuditLog``, events of a forwarded read's shape): ``--pruned``
events whose bodies retention already dropped, then ``--due`` events that come due now (an hour of
a busy appliance), then a few recent ones. On each, while a thread commits one read's event every
5 ms through the group-commit writer (what every read waits for), retention runs:

* ``one UPDATE``: ``EventLog.prune_bodies`` under the write connection's lock, the way
  ``AuditLog.purge`` ran before: every body due in one statement;
* ``slices``: ``AuditLog.purge`` (2,000 events per transaction, the connection let go between
  them, each run starting where the last one stopped).

Printed: the purge's time, the concurrent commits' p50 / p99 / max, the WAL's size afterwards, and
the time of the next hourly run when nothing came due (before: a walk over every pruned event).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench_audit_commit import row as read_event

from gateway.guard.audit import AuditLog

DAY = 86_400.0


def fill(log: AuditLog, n: int, start: float, step: float) -> None:
    for b in range(0, n, 1000):
        log.write_now([read_event(False, start + (b + i) * step) for i in range(min(1000, n - b))])


def one_update(log: AuditLog, now: float) -> int:
    """The purge before: one statement for every body due, holding the write connection."""
    assert log.ledger is not None
    with log._maint:
        return log.ledger.prune_bodies(now - log.retention_days * DAY)


def sliced(log: AuditLog, now: float) -> int:
    return log.purge(now=now)


def measure(path: Path, purge: Callable[[AuditLog, float], int], pruned: int, due: int) -> dict[str, float]:
    now = time.time()
    log = AuditLog(path, retention_days=90)
    try:
        fill(log, pruned, now - 200 * DAY, 0.01)
        fill(log, due, now - 90 * DAY - 3600, 3600 / max(1, due))  # the hour that just came due
        fill(log, 100, now - DAY, 1.0)
        purge(log, now - 3600)  # the previous hourly run: the older events lose their bodies
        lat: list[float] = []
        stop = threading.Event()

        def reads() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                log.flush_sync(log.submit(read_event(False)))
                lat.append(time.perf_counter() - t)
                time.sleep(0.005)

        th = threading.Thread(target=reads)
        th.start()
        time.sleep(0.3)
        t0 = time.perf_counter()
        n = purge(log, now)
        took = time.perf_counter() - t0
        time.sleep(0.3)
        stop.set()
        th.join()
        wal = os.path.getsize(str(path) + "-wal")
        t1 = time.perf_counter()
        purge(log, now + 60)  # the next run, nothing due
        idle = time.perf_counter() - t1
    finally:
        log.close()
    lat.sort()
    return {
        "n": n,
        "took": took,
        "p50": statistics.median(lat) * 1e3,
        "p99": lat[int(len(lat) * 0.99)] * 1e3,
        "max": lat[-1] * 1e3,
        "wal": wal / 2**20,
        "idle": idle * 1e3,
        "commits": len(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pruned", type=int, default=300_000, help="events pruned before (default 300,000)")
    ap.add_argument("--due", type=int, default=200_000, help="events that come due now (default 200,000)")
    args = ap.parse_args()
    if not (0 <= args.pruned <= 10_000_000 and 1 <= args.due <= 10_000_000):
        raise SystemExit("--pruned 0..10,000,000, --due 1..10,000,000")
    print(
        f"bench_retention: {time.strftime('%Y-%m-%d %H:%M:%S')}; {args.pruned:,} events pruned before, "
        f"{args.due:,} due now; a read's event committed every 5 ms meanwhile"
    )
    print(
        f"{'purge':<12} {'events':>8} {'took s':>7} {'commit p50 ms':>14} {'p99':>6} {'max':>7} {'WAL MiB':>8} "
        f"{'next run ms':>12}"
    )
    with tempfile.TemporaryDirectory(prefix="uomp-ret-") as d:
        for name, fn in (("one UPDATE", one_update), ("slices", sliced)):
            r = measure(Path(d) / f"{name.replace(' ', '_')}.db", fn, args.pruned, args.due)
            print(
                f"{name:<12} {r['n']:>8,} {r['took']:>7.2f} {r['p50']:>14.1f} {r['p99']:>6.1f} {r['max']:>7.0f} "
                f"{r['wal']:>8.1f} {r['idle']:>12.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
