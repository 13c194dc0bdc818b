"""Latency of the audit reader (gateway/ledger/query.py) on a large event log (issue 10).

    .venv/bin/python benchmarks/bench_audit_query.py [--events 300000]

Writes ``--events`` events through the real audit writer (1000 sessions, 50 agents, two actions,
a third refused), prunes the older half as retention would, then times typical queries: the
newest page with and without filters, a time range, and one ``--follow`` poll.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from gateway.guard.audit import AuditLog
from gateway.ledger.query import AuditFilter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=300_000)
    n = ap.parse_args().events
    audit = AuditLog(Path(tempfile.mkdtemp(prefix="uomp-bench-")) / "audit.db")
    now = time.time()
    t0 = time.perf_counter()
    for start in range(0, n, 10_000):
        for i in range(start, min(n, start + 10_000)):
            audit.record(
                session_id=f"s{i % 1000}",
                agent_id=f"a{i % 50}",
                action="read" if i % 7 else "aggregate",
                key=f"k{i % 500}",
                allowed=bool(i % 3),
                reason="r",
                now=now - (n - i),
            )
        audit.flush_sync()
    out: dict[str, object] = {"events": n, "write_seconds": round(time.perf_counter() - t0, 2)}
    out["pruned"] = audit.purge(now=now + 90 * 86400 - n / 2)
    cases = {
        "newest_100": AuditFilter(),
        "newest_100_session": AuditFilter(session_id="s7"),
        "newest_100_agent_refused": AuditFilter(agent_id="a3", allowed=False),
        "newest_100_action": AuditFilter(action=("aggregate",)),
        "since_1h": AuditFilter(since=now - 3600),
        "follow_poll": AuditFilter(after_seq=n),
        "newest_1000": AuditFilter(limit=1000),
    }
    for name, flt in cases.items():
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            audit.query(flt)
            best = min(best, time.perf_counter() - t)
        out[f"{name}_ms"] = round(best * 1000, 2)
    audit.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
