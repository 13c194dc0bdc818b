"""Conformance cases: read decisions (§10.4, §10.5) and existence hiding (§21)."""

from __future__ import annotations

import json

from gateway.conformance.harness import (
    Fail,
    Runner,
    case,
    check_error_shape,
    comparable,
    expect_error,
    expect_ok,
    item_keys,
)

# ---------------------------------------------------------------------- §10.4 / §10.5


@case("POL-01", "§10.4", "deny_tags wins over an allowed tag, by key and in tag reads")
async def _deny_tag(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": [], "deny_tags": ["conf.private"]})
    token = str(g["token"])
    expect_error(await r.read_key(token, "conf.pref.private"), (403,), ("ACCESS_DENIED",))
    keys = item_keys(expect_ok(await r.read_tag(token, "conf.pref")))
    if "conf.pref.private" in keys:
        raise Fail("tag read returned an item carrying a denied tag")
    if "conf.pref.theme" not in keys:
        raise Fail("tag read lost an allowed item")


@case("POL-02", "§10.4", "deny_keys wins over an allowed key and tag; tag reads re-filter per key")
async def _deny_key(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": ["conf.pref.lang"], "deny_keys": ["conf.pref.lang"]})
    token = str(g["token"])
    expect_error(await r.read_key(token, "conf.pref.lang"), (403,), ("ACCESS_DENIED",))
    if "conf.pref.lang" in item_keys(expect_ok(await r.read_tag(token, "conf.pref"))):
        raise Fail("tag read returned a denied key")


@case("POL-03", "§10.4", "a high-sensitivity item is not readable through a tag grant, by key or by tag")
async def _high_tag(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []})
    token = str(g["token"])
    expect_error(await r.read_key(token, "conf.pref.passport"), (403,), ("ACCESS_DENIED",))
    if "conf.pref.passport" in item_keys(expect_ok(await r.read_tag(token, "conf.pref"))):
        raise Fail("tag read returned a high-sensitivity item")


@case("POL-04", "§10.4", "a high-sensitivity item is readable when its key is granted explicitly")
async def _high_key(r: Runner) -> None:
    g = await r.grant({"tags": [], "keys": ["conf.pref.passport"]})
    body = expect_ok(await r.read_key(str(g["token"]), "conf.pref.passport"))
    if body.get("value") != "X1234567":
        raise Fail("explicit key grant did not return the item")


@case("POL-05", "§10.4", "a tag or key outside the grant is refused 403")
async def _outside(r: Runner) -> None:
    token = await r.pref_token()
    expect_error(await r.read_key(token, "conf.h.a"), (403,), ("ACCESS_DENIED",))
    expect_error(await r.read_tag(token, "conf.holdings"), (403,), ("ACCESS_DENIED",))


@case("POL-06", "§10.4 §19.2", "allowed_fields: every returned item holds only the granted item fields")
async def _fields(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.profile"], "keys": [], "allowed_fields": ["key", "value"]})
    token = str(g["token"])
    body = expect_ok(await r.read_key(token, "conf.profile"))
    if not isinstance(body, dict) or set(body) != {"key", "value"}:
        raise Fail(f"item fields returned: {sorted(body) if isinstance(body, dict) else type(body).__name__}")
    items = expect_ok(await r.read_tag(token, "conf.profile")).get("items", [])
    if not items or any(not isinstance(i, dict) or set(i) - {"key", "value"} for i in items):
        raise Fail("tag read returned fields outside allowed_fields")


@case("POL-07", "§10.4 §19.2", "aggregation_only: key and tag reads refused, aggregates answered")
async def _agg_only(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.holdings"], "keys": []}, aggregation_only=True)
    token = str(g["token"])
    expect_error(await r.read_key(token, "conf.h.a"), (403,), ("ACCESS_DENIED",))
    expect_error(await r.read_tag(token, "conf.holdings"), (403,), ("ACCESS_DENIED",))
    body = expect_ok(await r.aggregate(token, "conf.holdings", "count"))
    if "4242" in json.dumps(body) or "symbol" in json.dumps(body):
        raise Fail("aggregate answer carries item values")


@case("AGG-01", "§10.5", "an aggregate over a single item does not disclose its value")
async def _agg_single(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.single"], "keys": []}, aggregation_only=True)
    token = str(g["token"])
    for op in ("sum", "avg"):
        a = await r.aggregate(token, "conf.single", op, "value.market_value")
        if "4242" in json.dumps(a.body):
            raise Fail(f"{op} over one item returned its value")


@case("AGG-02", "§10.5", "a sum over enough items is answered and matches the items")
async def _agg_sum(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.holdings"], "keys": []}, aggregation_only=True)
    body = expect_ok(await r.aggregate(str(g["token"]), "conf.holdings", "sum", "value.market_value"))
    if "600" not in json.dumps(body):
        raise Fail(f"sum over 100+200+300 answered {json.dumps(body)[:120]}")


# ---------------------------------------------------------------------- §21


@case("EXI-01", "§21", "a missing key and an existing but denied key get the same refusal")
async def _exist_key(r: Runner) -> None:
    token = await r.pref_token()
    await r.check_fixture(token)
    missing = await r.read_key(token, "conf.no.such.key")
    denied = await r.read_key(token, "conf.h.a")
    if comparable(missing) != comparable(denied):
        raise Fail(f"missing {comparable(missing)} vs denied {comparable(denied)}")
    if missing.status != 403:
        raise Fail(f"a missing key answered {missing.status}, not 403")
    check_error_shape(missing)
    check_error_shape(denied)
    m = missing.body["error"].get("message")
    d = denied.body["error"].get("message")
    if m != d:
        raise Fail("the messages differ between a missing and a denied key")


@case("EXI-02", "§21", "a high item reached by tag grant and a missing key refuse alike")
async def _exist_high(r: Runner) -> None:
    token = await r.pref_token()
    missing = await r.read_key(token, "conf.pref.nothing")
    high = await r.read_key(token, "conf.pref.passport")
    check_error_shape(missing)
    check_error_shape(high)
    if comparable(missing) != comparable(high) or missing.body["error"].get("message") != high.body["error"].get(
        "message"
    ):
        raise Fail("a high item's refusal differs from a missing key's")


@case("EXI-03", "§21", "a tag with no items and an ungranted tag refuse alike")
async def _exist_tag(r: Runner) -> None:
    token = await r.pref_token()
    empty = await r.read_tag(token, "conf.no.such.tag")
    denied = await r.read_tag(token, "conf.holdings")
    if comparable(empty) != comparable(denied):
        raise Fail(f"empty tag {comparable(empty)} vs denied tag {comparable(denied)}")
