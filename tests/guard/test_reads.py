"""Reads of the Memory Guard past 1,000 items, aggregates that leak nothing individual, and reads
that decide on metadata before any value is loaded. Real guard on a real Unix socket, real SQLite.
No silent cut at max_tag_results, no inference through aggregates, no existence through timing."""

from __future__ import annotations

import base64
import random
from typing import Any

import pytest
from guardkit import NOW, admin_headers, call, grant, guard_config, running_guard, seed, unix_session

from gateway.client import UompClient
from gateway.config import Paths
from gateway.core import policy
from gateway.core.capability import Scope
from gateway.guard.items import MemoryItem
from gateway.guard.store import MemoryStore

pytestmark = pytest.mark.timeout(120)

AGG = "/v1/memory/aggregate"


def item(key: str, value: Any, *tags: str, sensitivity: str = "medium") -> MemoryItem:
    return MemoryItem(key, value, tuple(tags), sensitivity, "user", NOW, NOW)


def bulk(n: int, tag: str = "bulk") -> list[MemoryItem]:
    return [item(f"b{i:05d}", {"mv": i, "qty": 2}, tag) for i in range(n)]


# ------------------------------------------------------------------ no silent cut


async def test_aggregates_count_and_sum_every_item_past_the_page_limit(home: Paths) -> None:
    seed(home, bulk(1500))
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["bulk"], "keys": []}, aggregation_only=True))["token"]
        status, body, _ = await call(s, "GET", f"{AGG}?tag=bulk&op=count", token=tok)
        assert (status, body) == (200, {"op": "count", "tag": "bulk", "result": 1500})
        status, body, _ = await call(s, "GET", f"{AGG}?tag=bulk&op=sum&field=value.mv", token=tok)
        assert (status, body) == (200, {"op": "sum", "field": "value.mv", "result": sum(range(1500))})
        status, body, _ = await call(s, "GET", f"{AGG}?tag=bulk&op=avg&field=value.mv", token=tok)
        assert (status, body) == (200, {"op": "avg", "field": "value.mv", "result": sum(range(1500)) / 1500})


async def read_all(s: Any, tok: str, tag: str, limit: int | None = None) -> tuple[list[dict[str, Any]], int]:
    keys: list[dict[str, Any]] = []
    pages = 0
    cursor: str | None = None
    while True:
        q = f"/v1/memory?tag={tag}" + (f"&limit={limit}" if limit else "") + (f"&cursor={cursor}" if cursor else "")
        status, body, _ = await call(s, "GET", q, token=tok)
        assert status == 200, body
        assert set(body) == {"items", "next"}
        pages += 1
        keys.extend(body["items"])
        cursor = body["next"]
        if cursor is None:
            return keys, pages
        assert body["items"], "a page with a next cursor is never empty"


async def test_tag_read_pages_through_every_item_with_a_next_cursor(home: Paths) -> None:
    seed(home, bulk(1500))
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["bulk"], "keys": []}, limits={"max_read_queries": 1000}))["token"]
        status, body, _ = await call(s, "GET", "/v1/memory?tag=bulk", token=tok)
        # the first page keeps the §10.3 shape, says more follow
        assert status == 200 and len(body["items"]) == 1000 and isinstance(body["next"], str)
        items, pages = await read_all(s, tok, "bulk")
        assert pages == 2 and [i["key"] for i in items] == [f"b{i:05d}" for i in range(1500)]
        items, pages = await read_all(s, tok, "bulk", limit=128)
        assert pages == 12 and len({i["key"] for i in items}) == 1500


async def test_pages_apply_every_key_rule_in_the_database(home: Paths) -> None:
    rows = bulk(300)
    rows[10] = item(rows[10].key, 1, "bulk", "private")  # deny_tags
    rows[20] = item(rows[20].key, 1, "bulk", sensitivity="high")  # high, not granted by key
    rows[30] = item(rows[30].key, 1, "bulk", sensitivity="high")  # high, granted by key
    seed(home, rows)
    denied = {rows[10].key, rows[20].key, rows[40].key}
    async with running_guard(home), unix_session(home) as s:
        tok = (
            await grant(
                s,
                home,
                read={"tags": ["bulk"], "keys": [rows[30].key], "deny_tags": ["private"], "deny_keys": [rows[40].key]},
                limits={"max_read_queries": 1000},
            )
        )["token"]
        items, _ = await read_all(s, tok, "bulk", limit=7)
        assert {i["key"] for i in items} == {r.key for r in rows} - denied


async def test_page_ends_early_at_the_byte_budget(home: Paths) -> None:
    seed(home, [item(f"k{i}", "x" * 3000, "big") for i in range(10)])
    async with running_guard(home, guard_config(tag_page_max_bytes=7000)), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["big"], "keys": []}))["token"]
        items, pages = await read_all(s, tok, "big")
        assert len(items) == 10 and pages == 5


async def test_cursor_is_opaque_when_keys_are_hidden(home: Paths) -> None:
    seed(home, bulk(20))
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["bulk"], "keys": []}, allowed_fields=["value"]))["token"]
        status, body, _ = await call(s, "GET", "/v1/memory?tag=bulk&limit=5", token=tok)
        assert status == 200 and all(set(i) == {"value"} for i in body["items"])
        raw = base64.urlsafe_b64decode(body["next"] + "=" * (-len(body["next"]) % 4))
        assert b"b00004" not in raw and "b00004" not in body["next"]


def _flip(cursor: str) -> str:
    i = len(cursor) // 2
    return cursor[:i] + ("A" if cursor[i] != "A" else "B") + cursor[i + 1 :]


CURSOR_ATTACKS = [
    ("tampered", "flip"),
    ("other session", "session"),
    ("other tag", "tag"),
    ("garbage", "garbage"),
    ("truncated", "truncated"),
    ("too long", "long"),
    ("empty-ish padding", "pad"),
]


@pytest.mark.parametrize(("case", "how"), CURSOR_ATTACKS, ids=[c[0] for c in CURSOR_ATTACKS])
async def test_cursor_attacks_are_refused(home: Paths, case: str, how: str) -> None:
    seed(home, bulk(30) + [item(f"o{i}", 1, "other") for i in range(30)])
    async with running_guard(home), unix_session(home) as s:
        read = {"tags": ["bulk", "other"], "keys": []}
        tok = (await grant(s, home, read=read))["token"]
        tok2 = (await grant(s, home, read=read))["token"]
        status, body, _ = await call(s, "GET", "/v1/memory?tag=bulk&limit=10", token=tok)
        cursor = body["next"]
        tag, who = "bulk", tok
        if how == "flip":
            cursor = _flip(cursor)
        elif how == "session":
            who = tok2
        elif how == "tag":
            tag = "other"
        elif how == "garbage":
            cursor = "not-a-cursor"
        elif how == "truncated":
            cursor = cursor[:20]
        elif how == "long":
            cursor = "A" * 5000
        elif how == "pad":
            cursor = "===="
        status, body, _ = await call(s, "GET", f"/v1/memory?tag={tag}&cursor={cursor}", token=who)
        assert status == 400 and body["error"]["code"] == "INVALID_REQUEST", body
        # the allowed partner: the real cursor, same session and tag, gives the next page
        status, body, _ = await call(s, "GET", "/v1/memory?tag=bulk&limit=10", token=tok)
        status, body, _ = await call(s, "GET", f"/v1/memory?tag=bulk&cursor={body['next']}", token=tok)
        assert status == 200 and body["items"][0]["key"] == "b00010"


async def test_cursor_expires(home: Paths) -> None:
    seed(home, bulk(30))
    async with running_guard(home, guard_config(tag_cursor_lifetime_seconds=0)), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["bulk"], "keys": []}))["token"]
        status, body, _ = await call(s, "GET", "/v1/memory?tag=bulk&limit=10", token=tok)
        status, body, _ = await call(s, "GET", f"/v1/memory?tag=bulk&cursor={body['next']}", token=tok)
        assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"


@pytest.mark.parametrize(
    "limit", ["0", "-1", "1001", "x", "1.5"], ids=["zero", "negative", "over-max", "word", "fraction"]
)
async def test_bad_page_limits_are_refused(home: Paths, limit: str) -> None:
    seed(home, bulk(5))
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["bulk"], "keys": []}))["token"]
        status, body, _ = await call(s, "GET", f"/v1/memory?tag=bulk&limit={limit}", token=tok)
        assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
        status, body, _ = await call(s, "GET", "/v1/memory?tag=bulk&limit=1000", token=tok)
        assert status == 200 and len(body["items"]) == 5 and body["next"] is None


async def test_cursor_survives_a_guard_restart(home: Paths) -> None:
    seed(home, bulk(30))
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["bulk"], "keys": []}))["token"]
        status, body, _ = await call(s, "GET", "/v1/memory?tag=bulk&limit=10", token=tok)
    async with running_guard(home), unix_session(home) as s:
        status, body, _ = await call(s, "GET", f"/v1/memory?tag=bulk&cursor={body['next']}", token=tok)
        assert status == 200 and [i["key"] for i in body["items"]] == [f"b{i:05d}" for i in range(10, 20)]


async def test_sdk_by_tag_follows_every_page(home: Paths) -> None:
    seed(home, bulk(1500))
    async with running_guard(home) as guard, unix_session(home) as s:
        g = await grant(s, home, read={"tags": ["bulk"], "keys": []}, limits={"max_read_queries": 100})
        env = {"UOM_TOKEN": g["token"], "UOMP_BASE_URL": f"http://127.0.0.1:{guard.tcp_port}"}
        async with UompClient.from_env(env) as c:
            assert [i["key"] for i in await c.by_tag("bulk")] == [f"b{i:05d}" for i in range(1500)]
            seen = [i["key"] async for i in c.iter_by_tag("bulk", limit=400)]
            assert len(seen) == 1500
            page, nxt = await c.by_tag_page("bulk", limit=600)
            assert len(page) == 600 and nxt is not None
            page, nxt = await c.by_tag_page("bulk", cursor=nxt)
            assert page[0]["key"] == "b00600" and len(page) == 600 and nxt is not None


def test_sql_key_rules_agree_with_the_policy(home: Paths) -> None:
    """ReadFilter (SQL) against policy.key_decision (Python) on random items and grants."""
    from gateway.guard.storage import ReadFilter

    rng = random.Random(7)
    tags = ["t", "a", "b", "c"]
    rows = []
    for i in range(300):
        extra = rng.sample(tags[1:], rng.randint(0, 2))
        rows.append(item(f"k{i:03d}", i, "t", *extra, sensitivity=rng.choice(["low", "medium", "high"])))
    store = MemoryStore(home.memory_db)
    try:
        store.put_many(rows)
        for _ in range(40):
            keys = tuple(r.key for r in rng.sample(rows, 30))
            scope = Scope(
                tags=("t",),
                keys=keys,
                deny_tags=tuple(rng.sample(tags[1:], rng.randint(0, 2))),
                deny_keys=tuple(r.key for r in rng.sample(rows, rng.randint(0, 20))),
            )
            expected = [r.key for r in rows if policy.key_decision(scope, r.key, list(r.tags), r.sensitivity).allowed]
            flt = ReadFilter(keys=scope.keys, deny_keys=scope.deny_keys, deny_tags=scope.deny_tags)
            got, more = store.tag_page("t", flt, after=None, limit=1000, max_bytes=1 << 20)
            assert [r.key for r in got] == expected and not more
            assert store.aggregate("t", flt, path=None).count == len(expected)
    finally:
        store.close()


# ------------------------------------------------------------- aggregate inference


def holdings() -> list[MemoryItem]:
    out = []
    for i in range(1, 7):  # all = a1..a6, all_but_one = a1..a5
        out.append(item(f"a{i}", {"mv": 100 * i, "qty": i}, "all", *(("all_but_one",) if i < 6 else ())))
    for i in range(1, 4):  # three = b1..b3
        out.append(item(f"b{i}", {"mv": 1000 * i}, "three"))
    for i in range(1, 8):  # whole = c1..c7, part1 = c1..c3, part2 = c4..c6: whole - part1 - part2 = c7
        part = ("part1",) if i <= 3 else ("part2",) if i <= 6 else ()
        out.append(item(f"c{i}", {"mv": 10 * i}, "whole", *part))
    for i in range(1, 7):  # big = d1..d6, big_half = d1..d3: every group keeps 3 items
        out.append(item(f"d{i}", {"mv": i}, "big", *(("big_half",) if i <= 3 else ())))
    for i in range(1, 5):
        out.append(item(f"g{i}", {"mv": i}, "grow"))
    return out


AGG_TAGS = ["all", "all_but_one", "three", "whole", "part1", "part2", "big", "big_half", "grow"]


def q(tag: str, op: str, field: str | None = "value.mv") -> str:
    return f"{AGG}?tag={tag}&op={op}" + (f"&field={field}" if field and op != "count" else "")


# (id, grant options, queries that must be answered, the query that must be refused)
INFERENCE_ATTACKS: list[tuple[str, dict[str, Any], list[str], str]] = [
    ("min-by-default", {}, [], q("all", "min")),
    ("max-by-default", {}, [], q("all", "max")),
    ("sum-min-max-of-three", {}, [q("three", "sum")], q("three", "min")),
    ("difference-of-overlapping-tags", {}, [q("all_but_one", "sum")], q("all", "sum")),
    ("difference-reversed-order", {}, [q("all", "sum")], q("all_but_one", "sum")),
    ("difference-through-avg", {}, [q("all_but_one", "avg")], q("all", "avg")),
    ("difference-sum-then-avg", {}, [q("all", "sum")], q("all_but_one", "avg")),
    ("three-way-combination", {}, [q("whole", "sum"), q("part1", "sum")], q("part2", "sum")),
    ("three-way-any-order", {}, [q("part1", "sum"), q("part2", "sum")], q("whole", "sum")),
    ("field-outside-allowed-fields", {"allowed_fields": ["key", "tags"]}, [], q("all", "sum")),
    ("sibling-of-allowed-subfield", {"allowed_fields": ["value.qty"]}, [q("all", "sum", "value.qty")], q("all", "sum")),
    ("min-max-grant-is-not-exact", {"aggregate_min_max": True}, [q("all_but_one", "sum")], q("all", "sum")),
    ("exact-grant-is-not-min-max", {"aggregate_exact": True}, [], q("all", "max")),
]

# (id, grant options, queries that must all be answered)
ALLOWED_PARTNERS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("sum-avg-count-same-set", {}, [q("all", "sum"), q("all", "avg"), q("all", "count"), q("all", "sum")]),
    ("counts-of-overlapping-tags", {}, [q("all", "count"), q("all_but_one", "count")]),
    ("groups-of-three-or-more", {}, [q("big", "sum"), q("big_half", "sum"), q("big", "avg")]),
    ("other-field-is-its-own-history", {}, [q("all_but_one", "sum"), q("all", "sum", "value.qty")]),
    ("min-max-granted", {"aggregate_min_max": True}, [q("all", "min"), q("all", "max")]),
    ("exact-granted-difference", {"aggregate_exact": True}, [q("all_but_one", "sum"), q("all", "sum")]),
    ("exact-granted-three-way", {"aggregate_exact": True}, [q("whole", "sum"), q("part1", "sum"), q("part2", "sum")]),
    ("allowed-fields-value", {"allowed_fields": ["key", "value"]}, [q("all", "sum")]),
    ("allowed-fields-subfield", {"allowed_fields": ["value.mv"]}, [q("all", "sum")]),
    ("count-without-value-field", {"allowed_fields": ["key"]}, [q("all", "count")]),
]


@pytest.mark.parametrize(
    ("case", "options", "before", "attack"), INFERENCE_ATTACKS, ids=[a[0] for a in INFERENCE_ATTACKS]
)
async def test_aggregate_inference_is_refused(
    home: Paths, case: str, options: dict[str, Any], before: list[str], attack: str
) -> None:
    seed(home, holdings())
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": AGG_TAGS, "keys": []}, aggregation_only=True, **options))["token"]
        for path in before:
            status, body, _ = await call(s, "GET", path, token=tok)
            assert status == 200, (path, body)
        status, body, _ = await call(s, "GET", attack, token=tok)
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED", body
        assert "result" not in body


@pytest.mark.parametrize(("case", "options", "queries"), ALLOWED_PARTNERS, ids=[a[0] for a in ALLOWED_PARTNERS])
async def test_aggregate_allowed_partners(home: Paths, case: str, options: dict[str, Any], queries: list[str]) -> None:
    seed(home, holdings())
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": AGG_TAGS, "keys": []}, aggregation_only=True, **options))["token"]
        for path in queries:
            status, body, _ = await call(s, "GET", path, token=tok)
            assert status == 200 and "result" in body, (path, body)


CHANGES = [
    ("item-added", lambda st: st.put(item("g9", {"mv": 7}, "grow"))),
    ("item-removed", lambda st: st.delete("g1")),
    ("value-updated", lambda st: st.put(item("g1", {"mv": 55}, "grow"), replace=True)),
]


@pytest.mark.parametrize(("case", "change"), CHANGES, ids=[c[0] for c in CHANGES])
async def test_aggregate_differencing_over_time_is_refused(home: Paths, case: str, change: Any) -> None:
    seed(home, holdings())
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": AGG_TAGS, "keys": []}, aggregation_only=True))["token"]
        assert (await call(s, "GET", q("grow", "sum"), token=tok))[0] == 200
        assert (await call(s, "GET", q("grow", "sum"), token=tok))[0] == 200  # unchanged: the same answer again
        store = MemoryStore(home.memory_db)
        try:
            change(store)
        finally:
            store.close()
        status, body, _ = await call(s, "GET", q("grow", "sum"), token=tok)
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
        # a fresh session granted by the user starts a new history
        tok2 = (await grant(s, home, read={"tags": AGG_TAGS, "keys": []}, aggregation_only=True))["token"]
        assert (await call(s, "GET", q("grow", "sum"), token=tok2))[0] == 200


async def test_aggregate_history_survives_a_restart(home: Paths) -> None:
    seed(home, holdings())
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": AGG_TAGS, "keys": []}, aggregation_only=True))["token"]
        assert (await call(s, "GET", q("all_but_one", "sum"), token=tok))[0] == 200
    async with running_guard(home), unix_session(home) as s:
        status, body, _ = await call(s, "GET", q("all", "sum"), token=tok)
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"


async def test_aggregate_history_is_bounded_per_session(home: Paths) -> None:
    seed(home, holdings())
    cfg = guard_config(aggregate_max_sets_per_session=2)
    async with running_guard(home, cfg), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": AGG_TAGS, "keys": []}, aggregation_only=True))["token"]
        assert (await call(s, "GET", q("big", "sum"), token=tok))[0] == 200
        assert (await call(s, "GET", q("three", "sum"), token=tok))[0] == 200
        status, body, _ = await call(s, "GET", q("all", "sum"), token=tok)
        assert status == 403 and "new session" in body["error"]["message"]
        assert (await call(s, "GET", q("big", "avg"), token=tok))[0] == 200  # a recorded set stays answerable


async def test_the_user_sees_the_aggregate_grant(home: Paths) -> None:
    seed(home, holdings())
    async with running_guard(home), unix_session(home) as s:
        g = await grant(s, home, read={"tags": AGG_TAGS, "keys": []}, aggregate_min_max=True)
        status, body, _ = await call(s, "GET", f"/v1/sessions/{g['session_id']}", headers=admin_headers(home))
        assert body["aggregates"] == {"min_max": True, "exact": False}
        status, body, _ = await call(
            s,
            "POST",
            "/v1/sessions",
            headers=admin_headers(home),
            json_body={"agent_id": "x", "requested_scopes": {"read": {"tags": ["all"]}}},
        )
        status, body, _ = await call(
            s,
            "POST",
            f"/v1/sessions/{body['session_id']}/grant",
            headers=admin_headers(home),
            json_body={"granted_scopes": {"read": {"tags": ["all"]}}, "aggregate_exact": "yes"},
        )
        assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"


# ------------------------------------------------------------- existence and timing

TIMING_ITEMS = [
    item("big.denied", {"blob": "x" * 900_000}, "vault"),
    item("big.high", {"blob": "y" * 900_000}, "open", sensitivity="high"),
    item("big.denytag", {"blob": "z" * 900_000}, "open", "private"),
    item("small.ok", 1, "open"),
]


@pytest.mark.parametrize(
    "key",
    ["big.denied", "big.high", "big.denytag", "no.such.key"],
    ids=["not-granted", "high-by-tag", "deny-tag", "missing"],
)
async def test_a_refused_read_never_loads_the_value(home: Paths, key: str) -> None:
    seed(home, TIMING_ITEMS)
    async with running_guard(home) as guard, unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["open"], "keys": [], "deny_tags": ["private"]}))["token"]
        assert guard.services is not None
        store = guard.services.store
        before = store.value_loads
        status, body, _ = await call(s, "GET", f"/v1/memory/{key}", token=tok)
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
        assert store.value_loads == before
        # the allowed partner loads exactly one value
        assert (await call(s, "GET", "/v1/memory/small.ok", token=tok))[0] == 200
        assert store.value_loads == before + 1


async def test_denied_and_missing_answer_alike(home: Paths) -> None:
    seed(home, TIMING_ITEMS)
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["open"], "keys": []}))["token"]
        answers = [await call(s, "GET", f"/v1/memory/{k}", token=tok) for k in ("big.denied", "no.such.key")]
        assert answers[0][1] == answers[1][1] and answers[0][0] == answers[1][0] == 403


def test_metadata_reads_use_only_the_covering_index(home: Paths) -> None:
    from gateway.guard import store as store_mod

    st = MemoryStore(home.memory_db)
    try:
        with st._guard() as conn:
            plan = " ".join(str(r[-1]) for r in conn.execute("EXPLAIN QUERY PLAN " + store_mod._SQL_META, ("k",)))
        assert "COVERING INDEX items_meta" in plan
    finally:
        st.close()


def test_a_version_1_store_gains_the_metadata_index(home: Paths) -> None:
    import sqlite3

    st = MemoryStore(home.memory_db)
    st.put(item("a", 1, "t"))
    st.close()
    conn = sqlite3.connect(home.memory_db)
    conn.execute("DROP INDEX items_meta")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    st = MemoryStore(home.memory_db, create=False)
    try:
        meta = st.get_meta("a")
        assert meta is not None and meta.tags == ("t",)
        assert st.get("a") is not None
    finally:
        st.close()


def test_cursor_unit_cases() -> None:
    """Sealing and opening, pure: bound to session, agent and tag; a long non-ASCII key fits."""
    from gateway.core import paging
    from gateway.errors import UompError

    key = paging.new_key()
    long_key = "ключ" * 64  # 256 characters, 512 bytes of UTF-8
    c = paging.seal(key, session_id="s1", agent_id="a1", tag="t", after=long_key, limit=10, expires_at=2000)
    assert len(c) <= paging.MAX_CURSOR_CHARS
    assert paging.open_cursor(key, c, session_id="s1", agent_id="a1", tag="t", now=1000) == paging.CursorState(
        long_key, 10
    )
    for kwargs in ({"session_id": "s2"}, {"agent_id": "a2"}, {"tag": "u"}):
        args = {"session_id": "s1", "agent_id": "a1", "tag": "t", **kwargs}
        with pytest.raises(UompError) as err:
            paging.open_cursor(key, c, now=1000, **args)
        assert err.value.code == "INVALID_REQUEST" and long_key not in err.value.message
    with pytest.raises(UompError):
        paging.open_cursor(paging.new_key(), c, session_id="s1", agent_id="a1", tag="t", now=1000)
    with pytest.raises(UompError):
        paging.open_cursor(key, c + "!", session_id="s1", agent_id="a1", tag="t", now=1000)
    with pytest.raises(UompError) as err:
        paging.open_cursor(key, c, session_id="s1", agent_id="a1", tag="t", now=2000)
    assert "expired" in err.value.message


async def test_paging_through_the_gateway_over_mtls(home: Paths) -> None:
    """The whole path: TLS 1.3 + client certificate, the gateway forwards cursor and limit."""
    from gatewaykit import agent_call, agent_session, appliance

    async with appliance(home) as app:
        seed(home, bulk(1500))
        alice, bob = app.agent("alice_agent"), app.agent("bob_agent")
        read = {"tags": ["bulk"], "keys": []}
        tok_a = (await app.grant(alice, read=read))["token"]
        tok_b = (await app.grant(bob, read=read))["token"]
        async with agent_session(alice, home) as sa, agent_session(bob, home) as sb:
            keys: list[str] = []
            cursor = None
            while True:
                path = "/v1/memory?tag=bulk&limit=600" + (f"&cursor={cursor}" if cursor else "")
                status, body, _ = await agent_call(sa, app.base, path, token=tok_a, agent_id="alice_agent")
                assert status == 200, body
                keys += [i["key"] for i in body["items"]]
                if body["next"] is None:
                    break
                cursor = body["next"]
                # another agent replaying alice's cursor through the gateway is refused
                status, body, _ = await agent_call(
                    sb, app.base, f"/v1/memory?tag=bulk&cursor={cursor}", token=tok_b, agent_id="bob_agent"
                )
                assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
            assert keys == [f"b{i:05d}" for i in range(1500)]


@pytest.mark.parametrize(
    ("flags", "max_status", "shown"),
    [
        ((), 403, "no min/max"),
        (("--aggregate-min-max",), 200, "MIN/MAX GRANTED"),
        (("--aggregate-exact",), 403, "EXACT AGGREGATES GRANTED"),
    ],
    ids=["default", "min-max", "exact-only"],
)
async def test_uomp_authorize_grants_and_shows_aggregate_flags(
    home: Paths, tmp_path: Any, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], max_status: int, shown: str
) -> None:
    import json

    from gateway.cli.main import main

    seed(home, holdings())
    doc = {
        "uomp_version": "1.0",
        "agent": {"id": "calc_agent", "name": "Calc", "version": "1.0.0"},
        "requested_scopes": {"read": {"tags": ["all"], "keys": []}},
    }
    (tmp_path / "uom.json").write_text(json.dumps(doc))
    assert main(["--home", str(home.home), "authorize", str(tmp_path), "--yes", "--print", *flags]) == 0
    out = capsys.readouterr().out
    assert shown in out
    token = next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("export UOM_TOKEN="))
    async with running_guard(home), unix_session(home) as s:
        status, body, _ = await call(s, "GET", q("all", "max"), token=token)
        assert status == max_status, body


# ----------------------------------------------------------------- the rules, pure


@pytest.mark.parametrize(
    ("field", "allowed", "ok"),
    [
        ("value.mv", None, True),
        ("value.mv", ["value"], True),
        ("value.mv", ["key", "value"], True),
        ("value.mv", ["value.mv"], True),
        ("value.mv.x", ["value.mv"], True),
        ("value.mvx", ["value.mv"], False),
        ("value", ["value.mv"], False),
        ("value.qty", ["value.mv"], False),
        ("value.mv", ["key", "tags", "sensitivity"], False),
        ("value.mv", [], False),
        ("value.mv", ["mv"], False),
    ],
    ids=lambda x: str(x),
)
def test_allowed_fields_bound_aggregated_fields(field: str, allowed: list[str] | None, ok: bool) -> None:
    assert policy.aggregate_field_allowed(field, allowed) is ok


def _rank(rows: list[list[int]]) -> int:
    from fractions import Fraction

    m = [[Fraction(x) for x in r] for r in rows]
    rank, cols = 0, len(m[0]) if m else 0
    for col in range(cols):
        pivot = next((r for r in range(rank, len(m)) if m[r][col] != 0), None)
        if pivot is None:
            continue
        m[rank], m[pivot] = m[pivot], m[rank]
        for r in range(len(m)):
            if r != rank and m[r][col] != 0:
                f = m[r][col] / m[rank][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[rank], strict=True)]
        rank += 1
    return rank


def test_history_rule_never_lets_a_combination_isolate_a_small_group() -> None:
    """The theorem behind check_atoms, checked by brute force: over random tags on 10 items, after
    every accepted sequence of sums, no vector in the span of the answered sets is supported on fewer
    than k items (so no linear combination of answers says anything about 1 or 2 items alone)."""
    import itertools

    rng = random.Random(11)
    n, k = 10, 3
    for _ in range(150):
        tags = {f"t{j}": {i for i in range(n) if rng.random() < 0.55} for j in range(6)}
        recorded: dict[str, policy.Fingerprint] = {}
        answered: list[set[int]] = []
        for _ in range(6):
            tag = rng.choice(sorted(tags))
            order = [t for t in recorded if t != tag] + [tag]
            groups: dict[int, list[int]] = {}
            for i in range(n):
                pattern = sum(1 << j for j, t in enumerate(order) if i in tags[t])
                if pattern:
                    groups.setdefault(pattern, []).append(i)
            atoms = [(p, len(m), sum(m), 0) for p, m in groups.items()]
            if len(tags[tag]) < k:
                continue  # aggregate_min_items refuses it first
            check = policy.check_atoms(recorded, order, atoms, min_group=k)
            if not check.ok:
                continue
            recorded[tag] = check.fingerprints[tag]
            answered.append(tags[tag])
        if not answered:
            continue
        rows = [[1 if i in s else 0 for i in range(n)] for s in answered]
        base = _rank(rows)
        for size in range(1, k):
            for support in itertools.combinations(range(n), size):
                unit = [[1 if i == s else 0 for i in range(n)] for s in support]
                assert _rank(rows + unit) == base + size, (answered, support)


def test_a_changed_set_is_seen_by_its_fingerprint() -> None:
    then = policy.check_atoms({}, ["t"], [(1, 4, 100, 7)], min_group=3)
    assert then.ok
    recorded = {"t": then.fingerprints["t"]}
    assert policy.check_atoms(recorded, ["t"], [(1, 4, 100, 7)], min_group=3).ok
    for changed in [(1, 5, 130, 9), (1, 4, 101, 7), (1, 4, 100, 8)]:
        assert not policy.check_atoms(recorded, ["t"], [changed], min_group=3).ok


def test_a_long_scan_does_not_hold_up_reads_by_key(home: Paths) -> None:
    """Scans run on their own connection: while one holds a read snapshot, key reads and writes from
    another thread go through (they would wait for the scan if both shared the store's lock)."""
    import concurrent.futures

    from gateway.guard.storage import ReadFilter

    st = MemoryStore(home.memory_db)
    try:
        st.put_many(bulk(50))
        with concurrent.futures.ThreadPoolExecutor(1) as pool, st.read_snapshot():
            assert st.aggregate("bulk", ReadFilter(), path=None).count == 50
            got = pool.submit(lambda: (st.get_meta("b00001"), st.get("b00002"), st.put(item("new", 1, "bulk"))))
            meta, value, _ = got.result(timeout=30)
            assert meta is not None and value is not None
            assert st.aggregate("bulk", ReadFilter(), path=None).count == 50  # the snapshot holds
        assert st.aggregate("bulk", ReadFilter(), path=None).count == 51
    finally:
        st.close()


async def test_nested_allowed_fields_select_that_part_of_item_reads_as_of_aggregates(home: Paths) -> None:
    """`--allowed-field value.shares` returns the shares of each item (it emptied item reads while aggregates
    used it); nothing else of the value, and the other fields' aggregates stay refused."""
    seed(
        home,
        [
            item("AAPL", {"shares": 3, "cost_basis": 450.0, "note": "private"}, "portfolio"),
            item("MSFT", {"shares": 5, "cost_basis": 1200.0}, "portfolio"),
            item("NVDA", {"shares": 2, "cost_basis": 900.0}, "portfolio"),
            item("CASH", 1000, "portfolio"),
        ],
    )
    async with running_guard(home), unix_session(home) as s:
        read = {"tags": ["portfolio"], "keys": []}
        tok = (await grant(s, home, read=read, allowed_fields=["key", "value.shares"]))["token"]
        status, body, _ = await call(s, "GET", "/v1/memory/AAPL", token=tok)
        assert (status, body) == (200, {"key": "AAPL", "value": {"shares": 3}})
        status, body, _ = await call(s, "GET", "/v1/memory/CASH", token=tok)  # a value with no parts
        assert (status, body) == (200, {"key": "CASH"})
        status, body, _ = await call(s, "GET", "/v1/memory?tag=portfolio", token=tok)
        assert status == 200 and sorted(body["items"], key=lambda x: x["key"]) == [
            {"key": "AAPL", "value": {"shares": 3}},
            {"key": "CASH"},
            {"key": "MSFT", "value": {"shares": 5}},
            {"key": "NVDA", "value": {"shares": 2}},
        ]
        status, body, _ = await call(s, "GET", f"{AGG}?tag=portfolio&op=sum&field=value.shares", token=tok)
        assert status == 200 and body["result"] == 10, body
        status, body, _ = await call(s, "GET", f"{AGG}?tag=portfolio&op=sum&field=value.cost_basis", token=tok)
        assert status == 403 and "result" not in body
        assert "private" not in str(body) and "450" not in str(body)
