"""The rules a proposed write is held to before it is stored (docs/writes.md): the write budgets and
their checks, the body of a put, the version it is based on, the item state it is compared with,
and the grant-time refusal of a write scope naming a high-sensitivity item. The proposals
themselves (their table, lifecycle and the user's decisions) are :mod:`gateway.guard.proposals`.

Each budget refusal is BUDGET_EXCEEDED with ``details`` ``{"budget", "used", "limit", "needed"}``;
values are validated as imports are (:mod:`gateway.guard.items`) and never truncated.
"""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway import jsonio
from gateway.config import GuardConfig
from gateway.errors import ErrorCode, UompError
from gateway.guard.items import MemoryItem, description_problem, tags_problem
from gateway.guard.storage import MemoryStorage

_ID_CHARS = 22

_SQL_ITEM = (
    "SELECT key, value, tags, sensitivity, source, created_at, updated_at, description, version "
    "FROM items WHERE key = ?"
)


@dataclass(frozen=True)
class WriteBudgets:
    """The write budgets (``[guard] write_*``): pending and made per session, per agent and hour,
    pending in all, bytes per value, and how long a proposal waits for a decision."""

    max_pending_per_session: int = 20
    max_per_session: int = 100
    max_per_agent_hour: int = 60
    max_pending_total: int = 1000
    max_value_bytes: int = 16 * 1024
    lifetime_seconds: int = 7 * 24 * 3600

    @classmethod
    def from_config(cls, cfg: GuardConfig) -> WriteBudgets:
        """The budgets the guard's settings name."""
        return cls(
            max_pending_per_session=cfg.write_max_pending_per_session,
            max_per_session=cfg.write_max_per_session,
            max_per_agent_hour=cfg.write_max_per_agent_hour,
            max_pending_total=cfg.write_max_pending_total,
            max_value_bytes=cfg.write_max_value_bytes,
            lifetime_seconds=cfg.write_proposal_lifetime_seconds,
        )


def item_and_version(conn: sqlite3.Connection, key: str) -> tuple[MemoryItem | None, int]:
    """The item (None if absent) and the version of the key's state: the item's ``version``, or for
    an absent key the highest version its history reached (0: never used)."""
    row = conn.execute(_SQL_ITEM, (key,)).fetchone()
    if row is not None:
        k, value, tags, sens, source, created, updated, desc, version = row
        item = MemoryItem(k, jsonio.loads(value), tuple(jsonio.loads(tags)), sens, source, created, updated, desc)
        return item, int(version)
    top = conn.execute("SELECT max(version) FROM item_versions WHERE key = ?", (key,)).fetchone()[0]
    return None, int(top or 0)


class WriteRefused(UompError):
    """ACCESS_DENIED for a change outside the write scope; ``audit_detail`` (which rule) is for the
    user's audit view only, never the agent's answer (spec §21)."""

    def __init__(self, message: str, *, session_id: str | None, audit_detail: str) -> None:
        super().__init__(ErrorCode.ACCESS_DENIED, message, session_id=session_id)
        self.audit_detail = audit_detail


def budget_exceeded(name: str, used: int, limit: int, needed: int, message: str, session_id: str | None) -> UompError:
    """BUDGET_EXCEEDED for budget ``name``, with the numbers in the message and in ``details``."""
    return UompError(
        ErrorCode.BUDGET_EXCEEDED,
        f"{message} ({used} used of {limit}, {needed} more needed); wait for the user to decide or withdraw some",
        session_id=session_id,
        details={"budget": name, "used": used, "limit": limit, "needed": needed},
    )


def new_proposal_id() -> str:
    """A fresh, unguessable proposal id (``prop_`` + 22 URL-safe characters)."""
    return "prop_" + secrets.token_urlsafe(16)[:_ID_CHARS]


def parse_put_body(body: Mapping[str, Any], old: MemoryItem | None) -> tuple[Any, tuple[str, ...], str, str | None]:
    """(value, tags, sensitivity, description) of a proposed put; missing members keep the item's
    (a new item: no tags, ``medium``, no description). INVALID_REQUEST names the bad member."""
    unknown = set(body) - {"value", "tags", "sensitivity", "description", "base_version"}
    if unknown:
        raise UompError(ErrorCode.INVALID_REQUEST, f"unknown member {sorted(unknown)[0][:40]!r} in the write body")
    if "value" not in body:
        raise UompError(ErrorCode.INVALID_REQUEST, "the write body needs a value (any JSON value)")
    tags = body.get("tags", list(old.tags) if old else [])
    problem = tags_problem(tags)
    if problem:
        raise UompError(ErrorCode.INVALID_REQUEST, problem)
    sensitivity = body.get("sensitivity", old.sensitivity if old else "medium")
    if sensitivity not in ("low", "medium", "high"):
        raise UompError(ErrorCode.INVALID_REQUEST, "sensitivity must be low or medium")
    description = body.get("description", old.description if old else None)
    problem = description_problem(description)
    if problem:
        raise UompError(ErrorCode.INVALID_REQUEST, problem)
    return body["value"], tuple(tags), str(sensitivity), description


def base_version_of(body: Mapping[str, Any] | None, if_match: str | None) -> int | None:
    """The version the agent says it based the change on: ``If-Match: "N"`` or ``base_version``;
    both must agree. None: not named (the version at the time of the proposal is taken)."""
    named: list[int] = []
    if if_match is not None:
        text = if_match.strip()
        if text.startswith("W/"):
            raise UompError(ErrorCode.INVALID_REQUEST, 'If-Match must be a strong version tag such as "3"')
        text = text.strip('"')
        if not (text.isascii() and text.isdigit()) or len(text) > 15:
            raise UompError(ErrorCode.INVALID_REQUEST, 'If-Match must be an item version such as "3"')
        named.append(int(text))
    if body is not None and "base_version" in body:
        v = body["base_version"]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**53:
            raise UompError(ErrorCode.INVALID_REQUEST, "base_version must be a non-negative integer")
        named.append(v)
    if len(set(named)) > 1:
        raise UompError(ErrorCode.INVALID_REQUEST, "If-Match and base_version name different versions")
    return named[0] if named else None


def write_grant_problem(store: MemoryStorage, body: Mapping[str, Any]) -> str | None:
    """A grant whose write scope names a high-sensitivity item by key is refused (§11.3, §20.4):
    agents never write those, so the grant would promise what the guard refuses."""
    scopes = body.get("granted_scopes")
    write = scopes.get("write") if isinstance(scopes, dict) else None
    keys = write.get("keys") if isinstance(write, dict) else None
    if not isinstance(keys, list):
        return None
    for key in keys[:1024]:
        if isinstance(key, str):
            meta = store.get_meta(key)
            if meta is not None and meta.sensitivity == "high":
                return "a write scope cannot name a high-sensitivity item: agents never write those"
    return None


def check_budgets(
    conn: sqlite3.Connection,
    b: WriteBudgets,
    *,
    session_id: str,
    agent_id: str,
    now: float,
    max_per_session: int | None,
) -> None:
    """BUDGET_EXCEEDED unless one more proposal fits every count budget; run inside the transaction
    that inserts it, so concurrent proposals cannot overshoot (``max_per_session``: the grant's own,
    never above the configured one)."""
    pending = conn.execute(
        "SELECT count(*) FROM proposals WHERE session_id = ? AND status = 'pending'", (session_id,)
    ).fetchone()[0]
    if pending + 1 > b.max_pending_per_session:
        raise budget_exceeded(
            "pending_per_session",
            pending,
            b.max_pending_per_session,
            1,
            "this session has too many proposals waiting",
            session_id,
        )
    limit = b.max_per_session if max_per_session is None else min(b.max_per_session, max_per_session)
    made = conn.execute("SELECT count(*) FROM proposals WHERE session_id = ?", (session_id,)).fetchone()[0]
    if made + 1 > limit:
        raise budget_exceeded(
            "per_session", made, limit, 1, "this session has made all the proposals it may", session_id
        )
    hour = conn.execute(
        "SELECT count(*) FROM proposals WHERE agent_id = ? AND created_at > ?", (agent_id, now - 3600)
    ).fetchone()[0]
    if hour + 1 > b.max_per_agent_hour:
        raise budget_exceeded(
            "per_agent_hour",
            hour,
            b.max_per_agent_hour,
            1,
            "this agent has made too many proposals in the last hour",
            session_id,
        )
    total = conn.execute("SELECT count(*) FROM proposals WHERE status = 'pending'").fetchone()[0]
    if total + 1 > b.max_pending_total:
        raise budget_exceeded(
            "pending_total",
            total,
            b.max_pending_total,
            1,
            "too many proposals are waiting for the user",
            session_id,
        )
