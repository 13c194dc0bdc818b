"""High-sensitivity items through the real guard (Unix socket, real SQLite): the store the guard
opens seals the clear high values an older writer left, an authorized read by key opens them, and a
numeric aggregate whose grant reaches a high item is refused with AGGREGATE_HIGH_SENSITIVITY (audited),
while count, and the same sum under a grant without the high key, are answered."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from guardkit import NOW, call, grant, running_guard, seed, unix_session

from gateway.atrest import itemseal
from gateway.config import Paths
from gateway.guard.items import MemoryItem

pytestmark = pytest.mark.timeout(60)

MARK = "pin-marker-5d81ee"


def items() -> list[MemoryItem]:
    return [
        MemoryItem("bank.pin", {"pin": MARK, "amount": 100}, ("bank",), "high", "user", NOW, NOW),
        *(MemoryItem(f"bank.{k}", {"amount": n}, ("bank",), "medium", "user", NOW, NOW) for k, n in
          (("a", 1), ("b", 2), ("c", 3))),
    ]  # fmt: skip


def memory_bytes(home: Paths) -> bytes:
    return b"".join(
        Path(str(home.memory_db) + s).read_bytes() for s in ("", "-wal") if Path(str(home.memory_db) + s).exists()
    )


async def test_aggregate_refuses_high_items_by_key(home: Paths) -> None:
    seed(home, items())  # written without the item key: the high value is in clear, as in an old store
    assert MARK.encode() in memory_bytes(home)
    agg = "/v1/memory/aggregate?tag=bank&op={op}" + "&field=value.amount"
    async with running_guard(home), unix_session(home) as s:
        with_high = (await grant(s, home, read={"tags": ["bank"], "keys": ["bank.pin"]}, aggregate_exact=True))["token"]
        status, body, _ = await call(s, "GET", agg.format(op="sum"), token=with_high)
        assert status == 403 and body["error"]["code"] == "AGGREGATE_HIGH_SENSITIVITY", body
        assert "result" not in body and MARK not in json.dumps(body) and "100" not in body["error"]["message"]
        tracked = (await grant(s, home, read={"tags": ["bank"], "keys": ["bank.pin"]}))["token"]  # history check on
        status, body, _ = await call(s, "GET", agg.format(op="avg"), token=tracked)
        assert status == 403 and body["error"]["code"] == "AGGREGATE_HIGH_SENSITIVITY", body
        status, body, _ = await call(s, "GET", "/v1/memory/aggregate?tag=bank&op=count", token=with_high)
        assert status == 200 and body["result"] == 4, body
        status, body, _ = await call(s, "GET", "/v1/memory/bank.pin", token=with_high)
        assert status == 200 and body["value"] == {"pin": MARK, "amount": 100}, body
        without = (await grant(s, home, read={"tags": ["bank"], "keys": []}, aggregate_exact=True))["token"]
        status, body, _ = await call(s, "GET", agg.format(op="sum"), token=without)
        assert status == 200 and body["result"] == 6, body
    conn = sqlite3.connect(home.memory_db)
    try:
        (value,) = conn.execute("SELECT value FROM items WHERE key = 'bank.pin'").fetchone()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    assert itemseal.is_sealed_text(value)
    assert MARK.encode() not in memory_bytes(home)
    from gateway.ledger.query import AuditFilter, query_events

    conn = sqlite3.connect(home.audit_db)
    try:
        events = query_events(conn, AuditFilter(action=("aggregate",), limit=10)).events
    finally:
        conn.close()
    refused = [e for e in events if not e["allowed"]]
    assert len(refused) == 2 and all("AGGREGATE_HIGH_SENSITIVITY" in json.dumps(e) for e in refused), events
