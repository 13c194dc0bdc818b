"""Memory Guard access policy (spec §10.4, §19.2, §21), pure.

Order of the checks the guard applies after the token checks:
  5b. ``aggregation_only`` tokens may only aggregate;
  6./7. scope match with deny before allow (``deny_keys``/``deny_tags`` beat every allow);
  8. ``sensitivity=high`` only through an explicit key grant, never through a tag.

No existence leak (§21): every decision that depends on the item (missing, high sensitivity, its
tags) gives the agent the same public reason, :data:`NOT_IN_SCOPE`. The specific ``detail`` is kept
for the user's own audit view only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.core.tokens import Scope

NOT_IN_SCOPE = "key is not within granted scope"
TAG_NOT_IN_SCOPE = "tag is not within granted scope"
AGGREGATION_ONLY = "token only permits aggregation queries"
OPS = ("sum", "avg", "count", "min", "max")
# §19.2: without allowed_fields, a high-sensitivity item is returned without these metadata.
HIGH_SENSITIVITY_HIDDEN = ("sensitivity", "source")


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str  # what the agent may see (audit ``reason``)
    detail: str  # what the user sees in their own audit view


def key_decision(scope: Scope, key: str, item_tags: Sequence[str] | None, sensitivity: str | None) -> Decision:
    """May ``key`` be read? ``item_tags``/``sensitivity`` are None when the item does not exist."""
    if key in scope.deny_keys:
        return Decision(False, "key explicitly denied", "key in deny_keys")
    if item_tags is None:
        if key in scope.keys:
            # Granted by name; absent. The agent learns nothing it was not granted.
            return Decision(False, NOT_IN_SCOPE, "granted key does not exist")
        return Decision(False, NOT_IN_SCOPE, "key does not exist")
    denied = [t for t in item_tags if t in scope.deny_tags]
    if denied:
        return Decision(False, NOT_IN_SCOPE, f"item tag {denied[0]} in deny_tags")
    if key in scope.keys:
        return Decision(True, "key explicitly granted", "key in keys")
    if sensitivity == "high":
        return Decision(False, NOT_IN_SCOPE, "high sensitivity item needs an explicit key grant")
    for t in item_tags:
        if t in scope.tags:
            return Decision(True, "tag granted", f"item tag {t} in tags")
    return Decision(False, NOT_IN_SCOPE, "no granted key or tag matches")


def tag_decision(scope: Scope, tag: str) -> Decision:
    if tag in scope.deny_tags:
        return Decision(False, "tag explicitly denied", "tag in deny_tags")
    if tag in scope.tags:
        return Decision(True, "tag granted", "tag in tags")
    return Decision(False, TAG_NOT_IN_SCOPE, "tag not in tags")


def filter_fields(item: Mapping[str, Any], allowed_fields: Sequence[str] | None) -> dict[str, Any]:
    """Apply ``allowed_fields`` (§7.2, §19.2). Fail closed: an empty list returns an empty object."""
    if allowed_fields is None:
        out = dict(item)
        if item.get("sensitivity") == "high":
            for name in HIGH_SENSITIVITY_HIDDEN:
                out.pop(name, None)
        return out
    return {k: v for k, v in item.items() if k in allowed_fields}


def value_at(value: Any, field_path: str) -> Any:
    """Resolve ``value.a.b`` (or ``a.b``, relative to the value) in an item's value; None if absent."""
    parts = field_path.split(".")
    if parts and parts[0] == "value":
        parts = parts[1:]
    cur = value
    for part in parts:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return None
    return cur


def _number(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int | float):
        return float(x) if math.isfinite(float(x)) else None
    return None


@dataclass(frozen=True)
class AggregateResult:
    ok: bool
    body: dict[str, Any]
    contributing: int
    detail: str


def aggregate(values: Iterable[Any], *, op: str, field_path: str | None, tag: str, min_items: int) -> AggregateResult:
    """Aggregate the item values already filtered by key rules.

    Refused (``ok=False``) when fewer than ``min_items`` items contribute, so min/max/sum cannot
    single out one value. Only JSON numbers contribute (strings are not guessed at).
    """
    vals = list(values)
    if op == "count":
        n = len(vals)
        if n < min_items:
            return AggregateResult(False, {}, n, f"count over {n} < {min_items} items")
        return AggregateResult(True, {"op": "count", "tag": tag, "result": n}, n, "ok")
    assert field_path is not None
    nums = [n for n in (_number(value_at(v, field_path)) for v in vals) if n is not None]
    if len(nums) < min_items:
        return AggregateResult(False, {}, len(nums), f"{len(nums)} numeric values < {min_items}")
    if op == "sum":
        result: float = math.fsum(nums)
    elif op == "avg":
        result = math.fsum(nums) / len(nums)
    elif op == "min":
        result = min(nums)
    else:
        result = max(nums)
    out: int | float = int(result) if result.is_integer() and abs(result) < 2**53 else result
    return AggregateResult(True, {"op": op, "field": field_path, "result": out}, len(nums), "ok")


def is_subset(granted: Scope, requested: Scope) -> bool:
    """Grant may narrow (fewer tags/keys, more denies) but not widen the request."""
    return set(granted.tags) <= set(requested.tags) and set(granted.keys) <= set(requested.keys)
