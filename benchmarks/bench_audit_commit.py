"""What one audit commit costs the guard as the log grows: random event ids vs time-ordered ones (issue 13),
or a plain audit.db vs a sealed home's encrypted one (``--compare at-rest``), or a sealed home's log in
the old database format vs the current one (``--compare formats``).

    .venv/bin/python benchmarks/bench_audit_commit.py [--sizes 0,200000,1000000] [--batches 15,22] [--commits 300]
    .venv/bin/python benchmarks/bench_audit_commit.py --compare at-rest --sizes 0,50000 --commits 100
    .venv/bin/python benchmarks/bench_audit_commit.py --compare formats --sizes 20000 --commits 150 --rounds 6

Two audit.db files side by side (``AuditLog``, the product's writer path: the Merkle event log,
canonical JSON, leaf hash, tree nodes and the three indexes, ``synchronous=FULL``), one per id
scheme:

* ``random``: ``log_`` + 16 random hex digits, the scheme before this change (each id lands on its
  own page of the log's ``id`` index);
* ``ordered``: the product's ids (``gateway.guard.audit._EventIds``: the event's millisecond, then 64
  random bits), which land side by side at the end of the index.

With ``--compare at-rest``: both logs use the product's ids; ``plain`` is a plain home's audit.db,
``encrypted`` a sealed home's (SQLCipher under ``HKDF(master, "audit-db")``, gateway/atrest/auditdb.py).
With ``--compare formats``: two sealed homes, ``sha512`` sealed in the old format (SQLCipher's
defaults, HMAC-SHA512 page HMACs) and ``sha256`` in the current one (gateway/atrest/memdb.py).

Both logs are grown in step to each size of ``--sizes`` (commits of 500 events of the same shape
as a forwarded read's), then ``--commits`` commits of each batch size of ``--batches`` are timed,
alternating the two logs in rounds. CPU is this process's (``time.process_time``: SQLite's page work
and the writer's Python; the disk's wait is not CPU). The batch sizes are those the guard's writer
commits under 50 clients: ~14-16 events through the gateway, ~22 direct (benchmarks/README.md,
"Issue 13, session 7").
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from gateway.atrest import memdb, migrate, vault
from gateway.config import Paths
from gateway.guard.audit import AuditLog, Row, make_row
from gateway.keys import init_home

PREFILL_BATCH = 500


def row(random_id: bool, now: float | None = None) -> Row:
    """An event of a forwarded read's shape (the gateway's audit fields included)."""
    return make_row(
        session_id="sess_bench",
        agent_id="portfolio_agent",
        action="read",
        allowed=True,
        reason="scope matched",
        key="preference.theme",
        tags=["preference"],
        request_size=0,
        response_size=120,
        query_count_remaining=9000,
        via="gateway:mtls:bench",
        now=now,
        event_id=("log_" + secrets.token_hex(8)) if random_id else None,
        extra={
            "listener": "mtls",
            "client": "127.0.0.1:40001",
            "cert_serial": "5f3a9c" * 6,
            "cert_fp": "q1w2e3r4t5y6u7i8o9p0" * 2,
            "request_id": "req_" + secrets.token_hex(8),
        },
    )


def grow(log: AuditLog, random_id: bool, have: int, want: int) -> None:
    t0 = time.time() - 86_400
    while have < want:
        n = min(PREFILL_BATCH, want - have)
        log.write_now([row(random_id, t0 + (have + i) * 0.05) for i in range(n)])
        have += n


def timed(log: AuditLog, random_id: bool, batch: int, commits: int) -> tuple[float, float]:
    """(CPU µs per event, wall ms per commit) over ``commits`` commits of ``batch`` fresh events."""
    batches = [[row(random_id) for _ in range(batch)] for _ in range(commits)]
    c0, w0 = time.process_time(), time.perf_counter()
    for b in batches:
        log.write_now(b)
    c1, w1 = time.process_time(), time.perf_counter()
    return (c1 - c0) / (commits * batch) * 1e6, (w1 - w0) / commits * 1e3


def open_logs(d: Path, compare: str) -> dict[str, AuditLog]:
    """The two logs side by side: two id schemes, or a plain home's and a sealed home's."""
    if compare == "ids":
        return {"random": AuditLog(d / "random.db"), "ordered": AuditLog(d / "ordered.db")}

    def sealed_log(name: str, profile: memdb.Profile) -> AuditLog:
        sealed = Paths(d / name)
        init_home(sealed)
        fast = {"alg": "argon2id", "iterations": 1, "lanes": 1, "memory_kib": 8 * 1024}  # unlocked once, here
        migrate.seal(sealed, passphrase="bench-audit-at-rest", kdf=fast, profile=profile)
        assert vault.unlocked(sealed) is not None
        return AuditLog(sealed.audit_db)

    if compare == "formats":
        return {"sha512": sealed_log("sha512", memdb.LEGACY), "sha256": sealed_log("sha256", memdb.CURRENT)}
    return {"plain": AuditLog(d / "plain.db"), "encrypted": sealed_log("sealed", memdb.CURRENT)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0,200000,1000000", help="log sizes (events) to measure at")
    ap.add_argument("--batches", default="15,22", help="events per commit")
    ap.add_argument("--commits", type=int, default=300, help="timed commits per batch size, log and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--compare", choices=["ids", "at-rest", "formats"], default="ids", help="what the two logs differ in"
    )
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    if not (
        sizes
        and sizes[-1] <= 20_000_000
        and all(1 <= b <= 1000 for b in batches)
        and 1 <= args.commits <= 10_000
        and 1 <= args.rounds <= 10
    ):
        raise SystemExit("--sizes up to 20,000,000, --batches 1..1000, --commits 1..10,000, --rounds 1..10")
    print(
        f"bench_audit_commit: {time.strftime('%Y-%m-%d %H:%M:%S')}; batches {batches}, {args.commits} commits "
        f"each, {args.rounds} rounds"
    )
    a, b = {"ids": ("random", "ordered"), "at-rest": ("plain", "encrypted"), "formats": ("sha512", "sha256")}[
        args.compare
    ]
    print(
        f"{'log size':>10} {'batch':>6} {a + ' µs/event':>16} {b + ' µs/event':>17} {b + '/' + a:>15} "
        f"{'commit ms ' + a:>17} {b:>8}"
    )
    with tempfile.TemporaryDirectory(prefix="uomp-bac-") as d:
        logs = open_logs(Path(d), args.compare)
        have = {a: 0, b: 0}
        try:
            for size in sizes:
                for scheme, log in logs.items():
                    grow(log, scheme == "random", have[scheme], size)
                    have[scheme] = size
                for batch in batches:
                    got: dict[str, list[tuple[float, float]]] = {a: [], b: []}
                    for _ in range(args.rounds):
                        for scheme, log in logs.items():
                            got[scheme].append(timed(log, scheme == "random", batch, args.commits))
                            have[scheme] += batch * args.commits
                    r = statistics.median(x[0] for x in got[a])
                    o = statistics.median(x[0] for x in got[b])
                    rw = statistics.median(x[1] for x in got[a])
                    ow = statistics.median(x[1] for x in got[b])
                    print(
                        f"{size:>10,} {batch:>6} {r:>16.1f} {o:>17.1f} {o / r:>15.2f} {rw:>17.2f} {ow:>8.2f}",
                        flush=True,
                    )
        finally:
            for log in logs.values():
                log.close()


if __name__ == "__main__":
    main()
