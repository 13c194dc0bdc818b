"""What a grant must keep of what the agent asked to be limited to (spec §6.3, §6.4, §7.2), pure.

A manifest limits itself in these places, and each one reaches the token:

=========================================  ===============================================
manifest                                   grant / token
=========================================  ===============================================
``requested_scopes.read.tags`` / ``keys``  ``scopes.read.tags`` / ``keys``: the request, or
                                           the user's narrower list (wider needs ``widen``)
``requested_scopes.read.deny_tags`` /      ``scopes.read.deny_tags`` / ``deny_keys``: the
``deny_keys``                              request's, plus any the user adds (never fewer)
``requested_scopes.read.allowed_fields``   ``scopes.read.allowed_fields`` and the top-level
                                           ``allowed_fields`` claim: the request's, or a
                                           subset the user picks (more needs ``widen``)
``required_capabilities`` /                ``aggregation_only: true`` when the agent names
``optional_capabilities``                  ``memory.aggregate`` and neither ``memory.read``
                                           nor ``memory.query`` (it asked for sums, not items)
``requires_remote: true``                  refused on the Local Profile unless the user
                                           overrides (the CLI's ``--allow-local``)
``requested_scopes.write``                 never granted (§20.4: agent writes not available)
``data_retention_policy.proof_required``   kept on the session (§19.4)
=========================================  ===============================================

:func:`plan_read_grant` computes the grant the CLI sends; :func:`widenings` is the check the Auth
Service repeats on every grant against the session's requested scopes (tags, keys, deny lists,
fields), so that a grant made through the management API cannot drop those limits either. The
capability-derived ``aggregation_only`` and ``requires_remote`` are not stored with the session:
the CLI applies them. Both functions answer in plain words what would widen, so the user sees
what ``--widen`` means.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.core.capability import Scope

# Capability names this gateway knows (spec §6.3 names memory.read and memory.query; aggregate
# and write follow the same pattern). Any other name is shown as unknown, never dropped silently.
CAPABILITIES: dict[str, str] = {
    "memory.read": "read single items by key",
    "memory.query": "read items by tag",
    "memory.aggregate": "sum/avg/count/min/max over a tag, never items",
    "memory.write": "write items (NOT available in this version)",
}
ITEM_CAPABILITIES = frozenset({"memory.read", "memory.query"})
AGGREGATE_CAPABILITY = "memory.aggregate"


def asks_aggregation_only(capabilities: Iterable[str]) -> bool:
    """True when the declared capabilities name aggregation and no item-returning capability."""
    caps = set(capabilities)
    return AGGREGATE_CAPABILITY in caps and not (caps & ITEM_CAPABILITIES)


@dataclass(frozen=True)
class ReadGrant:
    """The read part of a grant as the user approved it, with what it widens beyond the request."""

    scope: Scope  # allowed_fields inside the scope equals ``allowed_fields`` below
    allowed_fields: tuple[str, ...] | None
    aggregation_only: bool
    widened: tuple[str, ...]  # what goes beyond the request, in words (empty: nothing)


def _missing(wanted: Sequence[str], have: Iterable[str]) -> list[str]:
    have_set = set(have)
    return [x for x in wanted if x not in have_set]


def _dedup(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(values))


def effective_fields(scope_fields: Sequence[str] | None, claim_fields: Sequence[str] | None) -> tuple[str, ...] | None:
    """The fields a token returns when both the scope and the top-level claim may name some:
    the narrower of the two (their intersection), None only when neither limits."""
    if scope_fields is None:
        return None if claim_fields is None else _dedup(claim_fields)
    if claim_fields is None:
        return _dedup(scope_fields)
    allowed = set(scope_fields)
    return _dedup(f for f in claim_fields if f in allowed)


def widenings(
    granted: Scope,
    requested: Scope,
    *,
    granted_fields: Sequence[str] | None = None,
    granted_aggregation_only: bool | None = None,
    requested_aggregation_only: bool = False,
) -> list[str]:
    """Every way ``granted`` goes beyond ``requested`` (empty: the grant only narrows).

    ``granted_fields`` are the fields the token will return (see :func:`effective_fields`); when
    not given, the granted scope's own ``allowed_fields``.
    """
    out: list[str] = []
    extra_tags = _missing(granted.tags, requested.tags)
    if extra_tags:
        out.append("tags not requested: " + ", ".join(extra_tags))
    extra_keys = _missing(granted.keys, requested.keys)
    if extra_keys:
        out.append("keys not requested: " + ", ".join(extra_keys))
    dropped_tags = _missing(requested.deny_tags, granted.deny_tags)
    if dropped_tags:
        out.append("denied tags the agent asked to be kept from: " + ", ".join(dropped_tags))
    dropped_keys = _missing(requested.deny_keys, granted.deny_keys)
    if dropped_keys:
        out.append("denied keys the agent asked to be kept from: " + ", ".join(dropped_keys))
    fields = granted.allowed_fields if granted_fields is None else granted_fields
    if requested.allowed_fields is not None:
        if fields is None:
            out.append("whole items although the agent asked only for fields: " + ", ".join(requested.allowed_fields))
        else:
            extra_fields = _missing(fields, requested.allowed_fields)
            if extra_fields:
                out.append("fields not requested: " + ", ".join(extra_fields))
    if requested_aggregation_only and granted_aggregation_only is False:
        out.append("item reads although the agent asked only for aggregates")
    return out


def plan_read_grant(
    requested: Scope,
    *,
    capabilities: Iterable[str] = (),
    tags: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    deny_tags: Sequence[str] = (),
    deny_keys: Sequence[str] = (),
    allowed_fields: Sequence[str] | None = None,
    aggregation_only: bool = False,
) -> ReadGrant:
    """The read grant for a request and the user's adjustments (None/empty: as requested).

    The result keeps every limit of the request; ``widened`` lists what the adjustments add beyond
    it (the caller refuses a non-empty list unless the user said ``--widen``).
    """
    fields: tuple[str, ...] | None
    if allowed_fields is None:
        fields = requested.allowed_fields
    else:
        fields = _dedup(allowed_fields)
    scope = Scope(
        tags=_dedup(tags) if tags else requested.tags,
        keys=_dedup(keys) if keys else requested.keys,
        deny_tags=_dedup([*requested.deny_tags, *deny_tags]),
        deny_keys=_dedup([*requested.deny_keys, *deny_keys]),
        allowed_fields=fields,
    )
    agg = aggregation_only or asks_aggregation_only(capabilities)
    widened = widenings(
        scope,
        requested,
        granted_fields=fields,
        granted_aggregation_only=agg,
        requested_aggregation_only=asks_aggregation_only(capabilities),
    )
    return ReadGrant(scope=scope, allowed_fields=fields, aggregation_only=agg, widened=tuple(widened))
