"""The audit log's integrity checks at size: the full verify and the guard's bounded start-up check.

    .venv/bin/python benchmarks/bench_verify.py [--events 1000000] [--checkpoint-every 1000]

Builds the log in-process (the guard's own event bodies and ``EventLog``, fsync off for the
fixture only), with a signed checkpoint every ``--checkpoint-every`` events and the witness record
at the newest, then times on a fresh read-only connection (cold statement cache, warm page cache):

* ``verify_log`` over the whole log, with the witness record as a trusted checkpoint (what
  ``uomp audit verify`` and the guard's background verify run), events per second;
* the start-up check (``integrity.check_log``: row count, tree leaves, newest checkpoint, witness
  consistency proof, the last 1,024 events before the newest checkpoint and every one after it)
  and its parts; the ratio to the full verify is the point;
* the witness check alone (``witness_problem``: what runs before every signing).
"""

from __future__ import annotations

import argparse
import resource
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway.guard.audit import make_row, row_event
from gateway.ledger import integrity
from gateway.ledger.log import EventLog
from gateway.ledger.verify import verify_log

ORIGIN = "uomp-audit/bench000000000000"


def _row(i: int) -> dict[str, object]:
    return row_event(
        make_row(
            session_id=f"sess_{i % 50:04d}",
            agent_id="portfolio_agent",
            action="read",
            allowed=i % 7 != 0,
            reason="scope matched",
            key="preference.theme",
            response_size=12,
            query_count_remaining=9000 - i % 9000,
            via="gateway:mtls:bench",
            now=1_790_000_000.0 + i / 1000,
            extra={
                "listener": "mtls",
                "client": "127.0.0.1:40001",
                "request_id": f"req_{i:016x}",
                "code": None if i % 7 else "ACCESS_DENIED",
            },
        )
    )


def _timed(fn, repeat: int = 1):  # type: ignore[no-untyped-def]
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    args = ap.parse_args()
    key = Ed25519PrivateKey.generate()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "audit.db"
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=OFF")  # building the fixture only
        log = EventLog(conn, origin=ORIGIN, key=key)
        t0 = time.perf_counter()
        note = None
        step = args.checkpoint_every
        for start in range(0, args.events, step):
            conn.execute("BEGIN IMMEDIATE")
            log.append([_row(i) for i in range(start, min(start + step, args.events))])
            note = log.checkpoint(now=1_790_000_000.0 + start / 1000)
            conn.execute("COMMIT")
        build = time.perf_counter() - t0
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        assert note is not None
        witness_path = Path(d) / "witness.json"
        integrity.write_witness(witness_path, note)
        pub = key.public_key()
        witness = integrity.read_witness(witness_path, origin=ORIGIN, public_key=pub)
        assert witness is not None
        print(
            f"built {args.events:,} events, a checkpoint every {step:,}, in {build:.0f} s (fixture, no fsync); "
            f"audit.db {path.stat().st_size / 2**20:.0f} MiB"
        )

        def ro() -> sqlite3.Connection:
            return sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)

        def startup() -> integrity.Checked:
            c = ro()
            try:
                c.execute("BEGIN")
                return integrity.check_log(c, origin=ORIGIN, public_key=pub, witness=witness)
            finally:
                c.close()

        checked, t_start = _timed(startup, repeat=5)
        assert checked.error is None, checked.error

        def count() -> int:
            c = ro()
            try:
                return int(c.execute("SELECT COUNT(*) FROM ledger_events").fetchone()[0])
            finally:
                c.close()

        _, t_count = _timed(count, repeat=5)

        def wcheck() -> object:
            c = ro()
            try:
                return integrity.witness_problem(c, args.events, witness)
            finally:
                c.close()

        problem, t_witness = _timed(wcheck, repeat=20)
        assert problem is None
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        def full() -> object:
            c = ro()
            try:
                c.execute("BEGIN")
                return verify_log(c, origin=ORIGIN, public_key=pub, trusted=[witness.trusted()])
            finally:
                c.close()

        report, t_full = _timed(full)
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert report.ok, report.problems  # type: ignore[attr-defined]
        print(
            f"full verify (uomp audit verify, the guard's background verify): {t_full:.1f} s "
            f"({args.events / t_full:,.0f} events/s), peak RSS +{(rss1 - rss0) / 1024:.0f} MiB"
        )
        print(
            f"start-up check: {t_start * 1000:.0f} ms (events {checked.checked_from + 1:,}-{checked.events:,} in "
            f"full), of which the row count {t_count * 1000:.0f} ms; {t_full / t_start:,.0f}x less than the full "
            "verify"
        )
        print(f"witness check before each signing: {t_witness * 1000:.2f} ms")


if __name__ == "__main__":
    main()
