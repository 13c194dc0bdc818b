"""``field=NAME`` is shorthand for ``field=value.NAME`` in aggregates (the reference SDK's form), and
grants nothing the full path would not: ``allowed_fields`` bounds the expanded path, and the
shorthand never reaches an item's metadata."""

from __future__ import annotations

from typing import Any

import pytest
from guardkit import call, grant, running_guard, seed, unix_session

from gateway.config import Paths

HOLDINGS = {"tags": ["portfolio:holdings"], "keys": []}


async def _agg(home: Paths, field: str, **grant_extra: Any) -> tuple[int, Any]:
    async with running_guard(home) as g, unix_session(home) as s:
        assert g is not None
        ok = await grant(s, home, read=HOLDINGS, aggregate_exact=True, **grant_extra)
        status, body, _ = await call(
            s, "GET", f"/v1/memory/aggregate?tag=portfolio:holdings&op=sum&field={field}", token=ok["token"]
        )
        return status, body


@pytest.mark.parametrize("field", ["market_value", "value.market_value"])
async def test_shorthand_and_full_path_give_the_same_sum(home: Paths, field: str) -> None:
    seed(home)
    status, body = await _agg(home, field)
    assert status == 200, body
    assert (body["op"], body["field"], body["result"]) == ("sum", "value.market_value", 12000 + 20000 + 7000)


@pytest.mark.parametrize(
    ("field", "allowed"),
    [
        pytest.param("market_value", ["value.symbol"], id="shorthand-outside-allowed-fields"),
        pytest.param("market_value", ["key", "tags"], id="shorthand-with-metadata-only-grant"),
        pytest.param("key", ["key"], id="shorthand-never-reaches-metadata"),
    ],
)
async def test_shorthand_outside_allowed_fields_is_refused(home: Paths, field: str, allowed: list[str]) -> None:
    seed(home)
    status, body = await _agg(home, field, allowed_fields=allowed)
    assert (status, body["error"]["code"]) == (403, "ACCESS_DENIED"), body


async def test_shorthand_inside_allowed_fields_is_answered(home: Paths) -> None:
    seed(home)
    status, body = await _agg(home, "market_value", allowed_fields=["value.market_value"])
    assert (status, body["result"]) == (200, 39000), body


@pytest.mark.parametrize("field", ["market..value", "market_value.", "a$b", "value..x"])
async def test_malformed_shorthand_is_a_clear_refusal(home: Paths, field: str) -> None:
    seed(home)
    status, body = await _agg(home, field)
    assert (status, body["error"]["code"]) == (400, "INVALID_REQUEST"), body
    assert "short for value.<name>" in body["error"]["message"]
