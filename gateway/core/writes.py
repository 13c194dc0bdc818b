"""Agent write proposals (spec §11.3, §20.4, §22 "agent write staging"), pure.

An agent never writes: with a write scope in its token it *proposes* a change of one item, the
guard stores the proposal, and only the user's approval applies it. This module decides what may be
proposed and names the change the user approves.

What may be proposed, under the token's ``scopes.write`` (the §6.4 Scope Object, as for reads):

1. an empty write scope: nothing (``WRITE_NOT_AVAILABLE``, as before writes existed);
2. ``deny_keys`` beats every allow; a ``deny_tags`` tag on the item as it is, or as proposed, too;
3. ``sensitivity=high`` is never writable by an agent (§11.3, §20.4), not even through an explicit
   key grant: neither an existing high item (update or delete) nor a proposal that sets it;
4. the item as it is must be reached by the scope (key in ``keys``, or one of its tags in
   ``tags``); a new key: its key in ``keys`` or one proposed tag in ``tags``;
5. every proposed tag is a granted write tag or one the item already carries: an agent cannot
   label an item into a tag it was not granted (which other agents may read).

Refusals that depend on the item say the same public reason (:data:`NOT_WRITABLE`) whether the key
exists or not; the specific ``detail`` is for the user's audit view. A create of a key that exists
outside the scope is refused too, so a write scope over tags tells its agent which key names are
taken outside it (the reason is the same, the fact that the create is refused is not hidden).

The change the user approves is named by :func:`change_hash`: SHA-256 over the canonical JSON
(RFC 8785) of the proposal's id, agent, session, operation, key, the version it is based on, the item
as it is at that version (``old``) and the item as proposed (``new``). The dashboard and the CLI show
exactly ``old`` and ``new`` and send the hash back; the guard applies the change only if the hash it
computes from the current item and the stored proposal is the same, so what is applied is what was
shown, and a base that changed since is a different hash (and a version conflict).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.core.canonical import canonical_json
from gateway.core.capability import Scope
from gateway.core.policy import Decision

NOT_WRITABLE = "key is not within the granted write scope"
HIGH_NOT_WRITABLE = "agents may not write high-sensitivity items"
NO_WRITE_SCOPE = "this session has no write scope"
OPS = ("put", "delete")
AGENT_SENSITIVITIES = ("low", "medium")
HASH_PREFIX = "sha256:"


def write_decision(
    scope: Scope,
    *,
    op: str,
    key: str,
    old_tags: Sequence[str] | None,
    old_sensitivity: str | None,
    new_tags: Sequence[str] | None = None,
    new_sensitivity: str | None = None,
) -> Decision:
    """May the change be proposed? ``old_*`` are None when the key does not exist; ``new_*`` are
    the proposed item's (None for a delete). See the module docstring for the rules, in order."""
    if scope.is_empty():
        return Decision(False, NO_WRITE_SCOPE, "empty write scope")
    if key in scope.deny_keys:
        return Decision(False, NOT_WRITABLE, "key in write deny_keys")
    if old_tags is None and op == "delete":
        return Decision(False, NOT_WRITABLE, "key does not exist")
    tags_now = list(old_tags or ())
    tags_new = list(new_tags or ()) if op == "put" else []
    for t in (*tags_now, *tags_new):
        if t in scope.deny_tags:
            return Decision(False, NOT_WRITABLE, f"tag {t} in write deny_tags")
    if old_sensitivity == "high":
        return Decision(False, HIGH_NOT_WRITABLE, "existing item is high sensitivity")
    if op == "put" and new_sensitivity not in AGENT_SENSITIVITIES:
        return Decision(False, HIGH_NOT_WRITABLE, "proposed sensitivity is not low or medium")
    by_key = key in scope.keys
    if old_tags is not None and not by_key and not any(t in scope.tags for t in tags_now):
        return Decision(False, NOT_WRITABLE, "no granted write key or tag matches the item")
    if op == "put":
        if old_tags is None and not by_key and not any(t in scope.tags for t in tags_new):
            return Decision(False, NOT_WRITABLE, "no granted write key or tag matches the new item")
        extra = [t for t in tags_new if t not in scope.tags and t not in tags_now]
        if extra:
            return Decision(False, NOT_WRITABLE, f"proposed tag {extra[0]} is not a granted write tag")
    return Decision(True, "within the write scope", "key in write keys" if by_key else "write tag granted")


def item_view(item: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What the user is shown of one side of a change: value, tags, sensitivity, description."""
    if item is None:
        return None
    return {
        "value": item.get("value"),
        "tags": list(item.get("tags") or ()),
        "sensitivity": item.get("sensitivity"),
        "description": item.get("description"),
    }


def change_hash(
    *,
    proposal_id: str,
    agent_id: str,
    session_id: str,
    op: str,
    key: str,
    base_version: int,
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any] | None,
) -> str:
    """``sha256:<hex>`` naming exactly the change shown (see the module docstring)."""
    doc = {
        "proposal_id": proposal_id,
        "agent_id": agent_id,
        "session_id": session_id,
        "op": op,
        "key": key,
        "base_version": base_version,
        "old": item_view(old),
        "new": item_view(new),
    }
    return HASH_PREFIX + hashlib.sha256(canonical_json(doc)).hexdigest()
