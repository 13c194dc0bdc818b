"""Aggregates of amounts in more than one currency are refused with AGGREGATE_MIXED_CURRENCY
(docs/aggregates.md "Currencies"): a sum of USD, CHF and EUR means nothing, and per-currency sums
would answer over groups the history check does not know (and could isolate a lone EUR item).
Amounts of one currency, fields without a currency beside them, and count are answered. Real
guard on a real Unix socket, real SQLite."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import pytest
from guardkit import NOW, call, grant, running_guard, seed, unix_session

from gateway.config import Paths
from gateway.guard.items import MemoryItem
from gateway.guard.storage import ReadFilter, currency_path, json_path

pytestmark = pytest.mark.timeout(60)

AGG = "/v1/memory/aggregate"


def item(key: str, value: Any, *tags: str) -> MemoryItem:
    return MemoryItem(key, value, tuple(tags), "medium", "user", NOW, NOW)


def items() -> list[MemoryItem]:
    return [
        # mixed: three currencies
        item("AAPL", {"cost": 4312.5, "shares": 25, "currency": "USD"}, "mixed"),
        item("MSFT", {"cost": 3050.4, "shares": 12, "currency": "USD"}, "mixed"),
        item("NESN", {"cost": 3402.0, "shares": 30, "currency": "CHF"}, "mixed"),
        item("ASML", {"cost": 2610.8, "shares": 4, "currency": "EUR"}, "mixed"),
        # one currency
        item("u1", {"cost": 10, "currency": "USD"}, "usd"),
        item("u2", {"cost": 20, "currency": "USD"}, "usd"),
        item("u3", {"cost": 30, "currency": "USD"}, "usd"),
        # some with a currency, some without
        item("p1", {"cost": 1, "currency": "USD"}, "partly"),
        item("p2", {"cost": 2}, "partly"),
        item("p3", {"cost": 3}, "partly"),
        # no currency at all; nested amounts with their own currency
        item("n1", {"cost": 5, "px": {"amount": 1, "currency": "USD"}}, "plain"),
        item("n2", {"cost": 6, "px": {"amount": 2, "currency": "EUR"}}, "plain"),
        item("n3", {"cost": 7, "px": {"amount": 3, "currency": "USD"}}, "plain"),
    ]


def q(tag: str, op: str, field: str | None = "value.cost") -> str:
    return f"{AGG}?tag={tag}&op={op}" + (f"&field={field}" if field else "")


TAGS = ["mixed", "usd", "partly", "plain"]

REFUSED = [
    pytest.param(q("mixed", "sum"), {}, id="sum-usd-chf-eur"),
    pytest.param(q("mixed", "avg"), {}, id="avg-usd-chf-eur"),
    pytest.param(q("mixed", "sum"), {"aggregate_exact": True}, id="sum-exact-grant"),
    pytest.param(q("mixed", "max"), {"aggregate_min_max": True}, id="max-granted"),
    pytest.param(q("partly", "sum"), {}, id="some-without-currency"),
    pytest.param(q("plain", "sum", "value.px.amount"), {}, id="nested-amounts"),
    pytest.param(q("mixed", "sum", "value.shares"), {}, id="any-number-beside-a-currency"),
]

ANSWERED = [
    pytest.param(q("usd", "sum"), 60, id="one-currency"),
    pytest.param(q("usd", "avg"), 20, id="one-currency-avg"),
    pytest.param(q("plain", "sum"), 18, id="no-currency-beside-the-field"),
    pytest.param(q("mixed", "count", None), 4, id="count-of-mixed"),
]


@pytest.mark.parametrize(("path", "options"), REFUSED)
async def test_amounts_in_several_currencies_are_refused(home: Paths, path: str, options: dict[str, Any]) -> None:
    seed(home, items())
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": TAGS, "keys": []}, aggregation_only=True, **options))["token"]
        status, body, _ = await call(s, "GET", path, token=tok)
        assert status == 400 and body["error"]["code"] == "AGGREGATE_MIXED_CURRENCY", body
        assert "result" not in body
        message = body["error"]["message"]
        assert "more than one currency" in message and "op=count" in message  # the fix
        for secret in ("CHF", "EUR", "4312", "3402"):  # no currency or amount named
            assert secret not in message
    from gateway.ledger.query import AuditFilter, query_events

    conn = sqlite3.connect(home.audit_db)
    try:
        events = query_events(conn, AuditFilter(action=("aggregate",), limit=10)).events
    finally:
        conn.close()
    assert len(events) == 1 and not events[0]["allowed"], events  # the refusal is audited
    assert "AGGREGATE_MIXED_CURRENCY" in json.dumps(events[0])


@pytest.mark.parametrize(("path", "want"), ANSWERED)
async def test_one_currency_no_currency_and_count_are_answered(home: Paths, path: str, want: float) -> None:
    seed(home, items())
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": TAGS, "keys": []}, aggregation_only=True))["token"]
        status, body, _ = await call(s, "GET", path, token=tok)
        assert status == 200 and body["result"] == pytest.approx(want), body


async def test_a_refused_sum_leaves_the_history_untouched(home: Paths) -> None:
    """The refusal comes before the history records anything: after it, a sum of another tag with
    the same field is judged as if the refused one never was."""
    seed(home, items())
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": TAGS, "keys": []}, aggregation_only=True))["token"]
        status, body, _ = await call(s, "GET", q("mixed", "sum"), token=tok)
        assert status == 400, body
        for path in (q("usd", "sum"), q("plain", "sum")):
            status, body, _ = await call(s, "GET", path, token=tok)
            assert status == 200, body


def test_currency_paths_and_the_store_count(home: Paths) -> None:
    assert currency_path('$."cost"') == '$."currency"'
    assert currency_path('$."px"."amount"') == '$."px"."currency"'
    assert currency_path("$") is None and currency_path('$."currency"') is None
    from gateway.guard.store import MemoryStore

    st = MemoryStore(home.memory_db)
    try:
        st.put_many(items())
        path = json_path("value.cost")
        assert path is not None
        assert st.currencies("mixed", ReadFilter(), path=path) == 3
        assert st.currencies("usd", ReadFilter(), path=path) == 1
        assert st.currencies("partly", ReadFilter(), path=path) == 2
        assert st.currencies("plain", ReadFilter(), path=path) == 0
        # the key rules apply: without the two non-USD items only one currency is left
        assert st.currencies("mixed", ReadFilter(deny_keys=("NESN", "ASML")), path=path) == 1
    finally:
        st.close()
