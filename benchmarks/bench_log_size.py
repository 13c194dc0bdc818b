"""Disk use per million events of the gateway access log and the guard audit log (issue 9 #6).

    .venv/bin/python benchmarks/bench_log_size.py [--events 100000]

Writes ``--events`` typical events (a granted read through the gateway: its ``gateway_access``
line and the guard's audit row) into fresh files, in batches, and prints bytes per event and the
extrapolation to one million, plus the size after rotation kept only the newest segments.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from gateway.guard.audit import AuditLog
from gateway.remote.access_log import AccessLog, verify_chain

BATCH = 5000


def access_event(i: int) -> dict[str, object]:
    return {
        "type": "gateway_access",
        "session_id": "sess_Qm9vYmFyQmF6UXV4",
        "agent_id": "calendar_agent",
        "action": "read_key",
        "key": f"preference.item{i % 500}",
        "tag": None,
        "allowed": True,
        "reason": "forwarded",
        "code": None,
        "method": "GET",
        "path": f"/v1/memory/preference.item{i % 500}",
        "status": 200,
        "cert_serial": "3f9a1c0de55b2a7781e4c0a9d2b6f4e1a0c3d5e7",
        "listener": "mtls",
        "query_count_remaining": 9000 - i % 9000,
    }


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=100_000)
    args = ap.parse_args()
    n = args.events
    work = Path(tempfile.mkdtemp(prefix="uomp-logsize-", dir="/tmp"))
    out: dict[str, object] = {"events": n}

    gw = work / "gateway"
    t = time.perf_counter()
    seg = 4 * 1024 * 1024
    with AccessLog(gw / "access.jsonl", segment_bytes=seg, max_total_bytes=1 << 40) as log:
        for start in range(0, n, BATCH):
            for i in range(start, min(n, start + BATCH)):
                log.append(access_event(i))
            log.flush_sync()
    assert verify_chain(gw / "access.jsonl") == n
    size = dir_bytes(gw)
    out["access_log_bytes_per_event"] = round(size / n, 1)
    out["access_log_mib_per_million"] = round(size / n * 1e6 / 2**20, 1)
    out["access_log_seconds"] = round(time.perf_counter() - t, 2)
    # the same history with a cap of 4 segments: what stays on disk
    gw2 = work / "gateway-capped"
    with AccessLog(gw2 / "access.jsonl", segment_bytes=seg, max_total_bytes=4 * seg) as log:
        for start in range(0, n, BATCH):
            for i in range(start, min(n, start + BATCH)):
                log.append(access_event(i))
            log.flush_sync()
    verify_chain(gw2 / "access.jsonl")
    index = gw2 / "access.index.jsonl"
    out["capped_total_bytes"] = dir_bytes(gw2)
    out["capped_index_bytes"] = index.stat().st_size if index.exists() else 0

    t = time.perf_counter()
    audit = AuditLog(work / "audit.db")
    for start in range(0, n, BATCH):
        for i in range(start, min(n, start + BATCH)):
            audit.record(
                session_id="sess_Qm9vYmFyQmF6UXV4",
                agent_id="calendar_agent",
                action="read",
                key=f"preference.item{i % 500}",
                allowed=True,
                reason="scope matched",
                request_size=0,
                response_size=180,
                query_count_remaining=9000 - i % 9000,
                via="gateway:mtls:3f9a1c0de55b2a7781e4c0a9d2b6f4e1a0c3d5e7",
            )
        audit.flush_sync()
    audit.close()
    size = sum(os.path.getsize(p) for p in work.glob("audit.db*"))
    out["audit_db_bytes_per_event"] = round(size / n, 1)
    out["audit_db_mib_per_million"] = round(size / n * 1e6 / 2**20, 1)
    out["audit_seconds"] = round(time.perf_counter() - t, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
