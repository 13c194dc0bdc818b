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

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.core.capability import Scope

NOT_IN_SCOPE = "key is not within granted scope"
TAG_NOT_IN_SCOPE = "tag is not within granted scope"
AGGREGATION_ONLY = "token only permits aggregation queries"
OPS = ("sum", "avg", "count", "min", "max")
# §19.2: without allowed_fields, a high-sensitivity item is returned without these metadata.
HIGH_SENSITIVITY_HIDDEN = ("sensitivity", "source")


@dataclass(frozen=True)
class Decision:
    """An access decision: allowed or not, the reason the agent may see, and the detail for the user."""

    allowed: bool
    reason: str  # what the agent may see (audit ``reason``)
    detail: str  # what the user sees in their own audit view


def key_decision(scope: Scope, key: str, item_tags: Sequence[str] | None, sensitivity: str | None) -> Decision:
    """May ``key`` be read? ``item_tags``/``sensitivity`` are None when the item does not exist.

    §10.4 as the guard applies it, step by step, and where each step lives:
      1-4. token signature, expiry, session status, profile, audience, binding, agent agreement:
           ``gateway/core/checks.py`` (one ordered list, the gateway and the Auth Service alike);
      5.   the read quota: counted by the Auth Service in the same trip to ``auth.db`` as step 4
           (the one counter; a refusal is QUOTA_EXCEEDED);
      5b.  an ``aggregation_only`` token reads nothing by key or tag (``guard/routes/reads.py``, before any
           item is looked at);
      6-8. this function, in this order (below);
      9.   ``allowed_fields`` shapes what is returned: :func:`filter_fields`.
    """
    # 6. an explicit deny of the key beats every allow
    if key in scope.deny_keys:
        return Decision(False, "key explicitly denied", "key in deny_keys")
    if item_tags is None:
        if key in scope.keys:
            # Granted by name; absent. The agent learns nothing it was not granted.
            return Decision(False, NOT_IN_SCOPE, "granted key does not exist")
        return Decision(False, NOT_IN_SCOPE, "key does not exist")
    # 6. a denied tag on the item beats every allow
    denied = [t for t in item_tags if t in scope.deny_tags]
    if denied:
        return Decision(False, NOT_IN_SCOPE, f"item tag {denied[0]} in deny_tags")
    # 7. an explicit key grant allows (high sensitivity included: the user named this key)
    if key in scope.keys:
        return Decision(True, "key explicitly granted", "key in keys")
    # 8. high sensitivity is readable only through an explicit key grant, never through a tag
    if sensitivity == "high":
        return Decision(False, NOT_IN_SCOPE, "high sensitivity item needs an explicit key grant")
    # 7. a granted tag on the item allows
    for t in item_tags:
        if t in scope.tags:
            return Decision(True, "tag granted", f"item tag {t} in tags")
    return Decision(False, NOT_IN_SCOPE, "no granted key or tag matches")


def tag_decision(scope: Scope, tag: str) -> Decision:
    """Whether ``scope`` grants reading by ``tag``: a denied tag wins, then the granted tags."""
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
    out = {k: v for k, v in item.items() if k in allowed_fields}
    for path in allowed_fields:
        top, _, rest = path.partition(".")
        if rest and top not in allowed_fields:  # `value.shares`: that part of the value, as aggregates read it
            _copy_path(item.get(top), rest.split("."), out, top)
    return out


def _copy_path(src: Any, parts: list[str], dst: dict[str, Any], name: str) -> None:
    """Copy ``src[parts[0]]...[parts[-1]]`` into ``dst[name]`` (nested objects made as needed);
    nothing when the path does not exist in ``src`` (a value that is not an object has no parts)."""
    walk = src
    for part in parts:
        if not isinstance(walk, Mapping) or part not in walk:
            return
        walk = walk[part]
    node = src
    target = dst
    key = name
    for part in parts:
        if not isinstance(target.get(key), dict):
            target[key] = {}
        target = target[key]
        node = node[part]
        key = part
    target[key] = copy.deepcopy(node)  # never an alias of the item's own objects (later paths add to it)


# ------------------------------------------------------------------------------ aggregates
# The threat model and the reasons for each rule: docs/aggregates.md.

MIN_MAX_NOT_GRANTED = "min and max reveal a single item's value; the user has not granted them"
FIELD_NOT_ALLOWED = "field is not within the token's allowed_fields"


@dataclass(frozen=True)
class AggregateGrant:
    """What the user granted about aggregates for a session (``uomp authorize --aggregate-*``).

    ``min_max``: min/max may be answered (each is one item's value). ``exact``: the per-session
    differencing check is off (the user accepts that comparing aggregates may isolate values)."""

    min_max: bool = False
    exact: bool = False

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> AggregateGrant:
        return cls(min_max=options.get("aggregate_min_max") is True, exact=options.get("aggregate_exact") is True)


def aggregate_field_allowed(field_path: str, allowed_fields: Sequence[str] | None) -> bool:
    """§19.2 ``allowed_fields`` bounds what can be aggregated: ``value`` allows every path in the
    value; ``value.a`` allows ``value.a`` and below; anything else (``key``, ``tags``...) allows no
    numeric aggregate. None (no restriction) allows all; an empty list allows none."""
    if allowed_fields is None:
        return True
    for allowed in allowed_fields:
        if allowed == "value" or field_path == allowed or field_path.startswith(allowed + "."):
            if allowed == "value" or allowed.startswith("value."):
                return True
    return False


def aggregate_refusal(
    op: str, field_path: str | None, allowed_fields: Sequence[str] | None, grant: AggregateGrant
) -> Decision | None:
    """Refusals that depend only on the request and the grant (no data read): min/max without the
    explicit grant, a field outside ``allowed_fields``. None when the query may go on."""
    if op in ("min", "max") and not grant.min_max:
        return Decision(False, MIN_MAX_NOT_GRANTED, f"{op} needs the user's min/max grant")
    if field_path is not None and not aggregate_field_allowed(field_path, allowed_fields):
        return Decision(False, FIELD_NOT_ALLOWED, "field outside allowed_fields")
    return None


def _number(x: Any) -> int | float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return x if math.isfinite(float(x)) else None


@dataclass(frozen=True)
class AggregateResult:
    """An aggregate's answer (or refusal) and how many items contributed to it."""

    ok: bool
    body: dict[str, Any]
    contributing: int
    detail: str


def aggregate_result(
    *,
    op: str,
    field_path: str | None,
    tag: str,
    count: int,
    total: Any = None,
    minimum: Any = None,
    maximum: Any = None,
    min_items: int,
) -> AggregateResult:
    """The §10.5 answer from what the store computed over every authorized item (``count``
    contributing items and their ``total``/``minimum``/``maximum``). Refused (``ok=False``) when
    fewer than ``min_items`` items contribute."""
    if count < min_items:
        what = "items" if op == "count" else "numeric values"
        return AggregateResult(False, {}, count, f"{count} {what} < {min_items}")
    if op == "count":
        return AggregateResult(True, {"op": "count", "tag": tag, "result": count}, count, "ok")
    picked = {"sum": total, "min": minimum, "max": maximum, "avg": total}[op]
    value = _number(picked)
    if value is None:
        return AggregateResult(False, {}, count, "no finite numeric result")
    result: int | float = value / count if op == "avg" else value
    if isinstance(result, float) and result.is_integer() and abs(result) < 2**53:
        result = int(result)
    return AggregateResult(True, {"op": op, "field": field_path, "result": result}, count, "ok")


@dataclass(frozen=True)
class Fingerprint:
    """A recorded aggregate's item set: how many items, and keyed sums over their ids and values."""

    count: int
    h1: int
    h2: int


@dataclass(frozen=True)
class AtomCheck:
    """Whether an aggregate may be answered without isolating one item, and each tag's set as it is now."""

    ok: bool
    detail: str
    fingerprints: dict[str, Fingerprint]  # each tag's set as it is now


def check_atoms(
    recorded: Mapping[str, Fingerprint],
    tags: Sequence[str],
    atoms: Iterable[tuple[int, int, int, int]],
    *,
    min_group: int,
) -> AtomCheck:
    """May one more aggregate over ``tags[-1]`` be answered, given the sets already aggregated in
    this session over the same field (``recorded``, by tag; ``tags`` lists them, bit j = tags[j])?

    ``atoms`` partition every item those tags reach by the exact subset of tags carrying it
    (pattern, count, h1, h2). Any linear combination of the answers (sums, averages with their
    counts) is constant on each atom, so if every non-empty atom holds at least ``min_group`` items,
    no combination of this session's aggregates can isolate fewer than ``min_group`` items:
    differences of overlapping tags, three-way or longer combinations alike. Refused also when a
    recorded set has changed since it was answered (an item added, removed or its value updated):
    comparing then and now would isolate the change.
    """
    now: dict[str, list[int]] = {t: [0, 0, 0] for t in tags}
    small: int | None = None
    for pattern, count, h1, h2 in atoms:
        if 0 < count < min_group:
            small = count if small is None else min(small, count)
        for j, tag in enumerate(tags):
            if pattern >> j & 1:
                acc = now[tag]
                acc[0] += count
                acc[1] += h1
                acc[2] += h2
    fingerprints = {t: Fingerprint(v[0], v[1], v[2]) for t, v in now.items()}
    for tag, then in recorded.items():
        if fingerprints.get(tag) != then:
            return AtomCheck(False, "an earlier aggregated set has changed since", fingerprints)
    if small is not None:
        return AtomCheck(False, f"would isolate a group of {small} item(s) (< {min_group})", fingerprints)
    return AtomCheck(True, "ok", fingerprints)
