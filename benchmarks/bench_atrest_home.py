"""Backup, verify and restore of a whole home (gateway/atrest/backup.py) at two sizes in the same
run: N memory items and N audit events for each N of ``--sizes`` (default 100,000 and 1,000,000).
Each phase runs in its own process, so its peak RSS (``wait4``'s ``ru_maxrss``) is its own; the
backup is streamed in 64 KiB chunks, so the peak must not grow with the home. Prints seconds, MB/s
and peak RSS per phase and size; asserts nothing.

The fixture is built outside the guard: items with the store's ``bulk_writer``, audit events with
the ledger's own append API (``EventLog.append`` + ``checkpoint`` per 10,000, ``synchronous=OFF``
for the fixture only), with the home's audit key and origin; a million events through the guard
would take far longer and measure the guard, not the backup. The backup passphrase uses the
default Argon2id parameters (64 MiB: part of every phase's peak).

    .venv/bin/python benchmarks/bench_atrest_home.py [--sizes 100000,1000000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PASS = b"bench-atrest-home-passphrase"
TS = "2026-01-01T00:00:00Z"


def build(home: Path, n: int) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: F401

    from gateway import ca_store, keys
    from gateway.config import Paths
    from gateway.guard.store import MemoryItem, MemoryStore
    from gateway.ledger import auditkey
    from gateway.ledger.log import EventLog
    from gateway.payloads import userkey

    paths = Paths(home)
    keys.init_home(paths)
    ca_store.init_all(paths, ["localhost"])
    auditkey.ensure(paths)
    userkey.ensure(paths)
    with MemoryStore(paths.memory_db) as store, store.bulk_writer() as w:
        for i in range(n):
            w.add(MemoryItem(f"k{i:08}", {"shares": i % 100, "note": "x" * 48}, ("all",), "low", "user", TS, TS))
        w.commit()
    key = auditkey.load(paths)
    conn = sqlite3.connect(paths.audit_db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    log = EventLog(conn, origin=auditkey.origin_for(key.public_key()), key=key)
    step = 10_000
    for start in range(0, n, step):
        conn.execute("BEGIN IMMEDIATE")
        log.append(
            [
                {
                    "id": f"evt_{i:012x}",
                    "ts": 1_790_000_000.0 + i / 1000,
                    "action": "read",
                    "allowed": True,
                    "agent_id": "bench_agent",
                    "session_id": f"sess_{i % 50:04d}",
                    "key": f"k{i:08}",
                    "code": None,
                }
                for i in range(start, min(start + step, n))
            ]
        )
        log.checkpoint(now=time.time())
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def phase(name: str, home: Path, out: Path, target: Path) -> None:
    from gateway.atrest import backup
    from gateway.config import Paths

    if name == "create":
        backup.create(Paths(home), out, PASS)
    elif name == "verify":
        backup.verify(out, PASS)
    elif name == "restore":
        backup.restore(out, target, PASS)


def run(args: list[str]) -> tuple[float, float]:
    """Seconds and peak RSS (MB) of a child process running this file with ``args``."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, __file__, *args])
    _pid, status, usage = os.wait4(p.pid, 0)
    if status != 0:
        raise SystemExit(f"{args[0]} failed (status {status})")
    return time.perf_counter() - t0, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--child", nargs=4, metavar=("PHASE", "HOME", "OUT", "TARGET"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.child[0] == "build":
            build(Path(a.child[1]), int(a.child[2]))
        else:
            phase(a.child[0], Path(a.child[1]), Path(a.child[2]), Path(a.child[3]))
        return
    print(f"{'items+events':>14} {'phase':<8} {'seconds':>8} {'MB/s':>8} {'peak RSS MB':>12} {'home MB':>8}")
    for n in (int(x) for x in a.sizes.split(",")):
        root = Path(tempfile.mkdtemp(prefix="uomp-bench-home-", dir="/tmp"))
        try:
            home, out, target = root / "home", root / "home.uompbak", root / "restored"
            t_build, _ = run(["--child", "build", str(home), str(n), "-"])
            size = sum(f.stat().st_size for f in home.rglob("*") if f.is_file()) / 1e6
            print(f"{n:>14,} {'build':<8} {t_build:>8.1f} {'':>8} {'':>12} {size:>8.0f}  (fixture, not measured)")
            for name in ("create", "verify", "restore"):
                secs, rss = run(["--child", name, str(home), str(out), str(target)])
                print(f"{n:>14,} {name:<8} {secs:>8.1f} {size / secs:>8.0f} {rss:>12.0f} {size:>8.0f}", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
