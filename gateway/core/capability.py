"""What a verified token grants (spec §7.3), as values: :class:`Scope` and :class:`Capability`.

Made by :func:`gateway.core.tokens.verify_token` (and the Auth Service's grants); read by the
checks (:mod:`gateway.core.checks`), the §10.4 policy and both servers. Pure data, no parsing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Scope:
    """A read or write scope (§7.3): granted tags and keys, denied ones, and the fields a read may return."""

    tags: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    deny_tags: tuple[str, ...] = ()
    deny_keys: tuple[str, ...] = ()
    allowed_fields: tuple[str, ...] | None = None

    def to_claim(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tags": list(self.tags),
            "keys": list(self.keys),
            "deny_tags": list(self.deny_tags),
            "deny_keys": list(self.deny_keys),
        }
        if self.allowed_fields is not None:
            out["allowed_fields"] = list(self.allowed_fields)
        return out

    def is_empty(self) -> bool:
        return not self.tags and not self.keys


EMPTY_SCOPE = Scope()


@dataclass(frozen=True)
class Capability:
    """A verified token's claims, normalised."""

    session_id: str
    agent_id: str
    issued_at: float
    expires_at: float
    read: Scope
    write: Scope
    max_read_queries: int | None
    max_write_queries: int | None
    profile: str
    audience: str | None
    allowed_endpoints: tuple[str, ...] | None
    allowed_fields: tuple[str, ...] | None
    aggregation_only: bool
    task_bound: bool
    jti: str | None
    kid: str
    token_use: str  # "access" or "refresh"
    cnf_x5t: str | None = None
    cnf_jkt: str | None = None
    family_id: str | None = None
    claims: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_refresh(self) -> bool:
        return self.token_use == "refresh"
