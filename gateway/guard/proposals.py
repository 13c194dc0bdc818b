"""Agents' staged writes: proposals kept in the Memory Store's file, applied only by the user.

A proposal is one change of one item (``put``: create or replace; ``delete``) that an agent asked
for under its write scope (:mod:`gateway.core.writes`). It names the item version it is based on:
the item's ``version``, or for a key without an item the version its history reached (0 for a key
never used), so any change of the key in between is seen. Lifecycle::

    pending --approve--> approved   (the item changed in the same transaction)
            --reject---> rejected
            --withdraw-> withdrawn  (the agent, its own session's only)
            --time-----> expired    (write_proposal_lifetime_seconds)
            --approve, base changed--> stale (VERSION_CONFLICT; the agent may propose again)

Every transition is one ``UPDATE ... WHERE status = 'pending'`` inside one ``BEGIN IMMEDIATE``
transaction of ``memory.db``, so two approvals racing apply once (the second finds it decided) and
an approval that applies the item change commits both or neither (a crash, SIGKILL included,
leaves the proposal pending and the item as it was). The item's earlier state goes to its history
through the store's triggers, like every other write.

Budgets (:class:`WriteBudgets`, from ``[guard] write_*``) are checked in the same transaction as the
insert, so concurrent proposals cannot overshoot them; each refusal is BUDGET_EXCEEDED with
``details`` ``{"budget", "used", "limit", "needed"}``. Values are validated as imports are
(:mod:`gateway.guard.items`) and never truncated.

No value is logged; the audit events (written by the callers) carry keys and proposal ids only.

A little over ~500 lines: the proposal's whole lifecycle (propose, list, approve, reject, withdraw,
expire) in one class over one transaction discipline.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway import jsonio
from gateway.atrest import itemseal
from gateway.core import writes
from gateway.core.capability import Scope
from gateway.core.tokens import iso
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.guard.items import MemoryItem, encode_value, key_problem, utc_now
from gateway.guard.proposal_rules import (
    WriteBudgets,
    WriteRefused,
    base_version_of,
    budget_exceeded,
    check_budgets,
    item_and_version,
    new_proposal_id,
    parse_put_body,
)
from gateway.guard.storage import MemoryStorage

STATUSES = ("pending", "approved", "rejected", "withdrawn", "expired", "stale")
MAX_LIST = 1000
_SQL_COLS = (
    "proposal_id, session_id, agent_id, op, key, value, tags, sensitivity, description, base_version, size, "
    "status, created_at, expires_at, decided_at, decided_by, applied_version, via"
)
_SQL_UPSERT = (
    "INSERT INTO items (key, value, tags, sensitivity, source, created_at, updated_at, description) "
    "VALUES (?, ?, ?, ?, 'agent', ?, ?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value, "
    "tags = excluded.tags, sensitivity = excluded.sensitivity, source = excluded.source, "
    "updated_at = excluded.updated_at, description = excluded.description"
)


@dataclass(frozen=True)
class Proposal:
    """One proposal as stored: the change, its base version, its status and decision."""

    proposal_id: str
    session_id: str
    agent_id: str
    op: str
    key: str
    value: Any
    tags: tuple[str, ...] | None
    sensitivity: str | None
    description: str | None
    base_version: int
    size: int
    status: str
    created_at: float
    expires_at: float
    decided_at: float | None
    decided_by: str | None
    applied_version: int | None
    via: str | None

    def new_view(self) -> dict[str, Any] | None:
        if self.op == "delete":
            return None
        return {
            "value": self.value,
            "tags": list(self.tags or ()),
            "sensitivity": self.sensitivity,
            "description": self.description,
        }

    def summary(self) -> dict[str, Any]:
        """What the agent may see of its own proposal (its outcome), and the first line of the user's."""
        return {
            "proposal_id": self.proposal_id,
            "op": self.op,
            "key": self.key,
            "status": self.status,
            "base_version": self.base_version,
            "applied_version": self.applied_version,
            "created_at": iso(self.created_at),
            "expires_at": iso(self.expires_at),
            "decided_at": iso(self.decided_at) if self.decided_at is not None else None,
        }


def _proposal_of(row: tuple[Any, ...]) -> Proposal:
    (
        pid,
        sid,
        aid,
        op,
        key,
        value,
        tags,
        sens,
        desc,
        base,
        size,
        status,
        created,
        expires,
        decided,
        by,
        applied,
        via,
    ) = row
    return Proposal(
        proposal_id=pid,
        session_id=sid,
        agent_id=aid,
        op=op,
        key=key,
        value=jsonio.loads(value) if value is not None else None,
        tags=tuple(jsonio.loads(tags)) if tags is not None else None,
        sensitivity=sens,
        description=desc,
        base_version=int(base),
        size=int(size),
        status=status,
        created_at=float(created),
        expires_at=float(expires),
        decided_at=float(decided) if decided is not None else None,
        decided_by=by,
        applied_version=int(applied) if applied is not None else None,
        via=via,
    )


class ProposalBook:
    """Proposals in ``memory.db`` (table ``proposals``), over one memory store."""

    def __init__(self, store: MemoryStorage, budgets: WriteBudgets | None = None, *, clock: Any = time.time) -> None:
        self.store = store
        self.budgets = budgets or WriteBudgets()
        self.clock = clock

    # ------------------------------------------------------------------ the agent's side

    def propose(
        self,
        *,
        scope: Scope,
        session_id: str,
        agent_id: str,
        op: str,
        key: str,
        body: Mapping[str, Any] | None,
        if_match: str | None,
        via: str,
        max_per_session: int | None = None,
    ) -> tuple[Proposal, str]:
        """Stage one change (see the module docstring); the proposal and the decision's detail.
        ACCESS_DENIED / WRITE_NOT_AVAILABLE outside the scope, VERSION_CONFLICT when the named base is
        not the key's version, BUDGET_EXCEEDED, INVALID_REQUEST; nothing is stored on any refusal."""
        if op not in writes.OPS:
            raise ValueError("op")
        problem = key_problem(key)
        if problem:
            raise UompError(ErrorCode.INVALID_REQUEST, problem, session_id=session_id)
        if scope.is_empty():
            raise UompError(
                ErrorCode.WRITE_NOT_AVAILABLE,
                writes.NO_WRITE_SCOPE + "; ask the user for a write grant",
                session_id=session_id,
            )
        claimed = base_version_of(body, if_match)
        b = self.budgets
        now = self.clock()
        with self.store.writing() as conn:
            old, version = item_and_version(conn, key)
            value_text = tags_text = sensitivity = description = None
            size = 0
            if op == "put":
                value, tags, sensitivity, description = parse_put_body(body or {}, old)
                d = writes.write_decision(
                    scope,
                    op=op,
                    key=key,
                    old_tags=old.tags if old else None,
                    old_sensitivity=old.sensitivity if old else None,
                    new_tags=tags,
                    new_sensitivity=sensitivity,
                )
            else:
                if body:
                    unknown = set(body) - {"base_version"}
                    if unknown:
                        raise UompError(
                            ErrorCode.INVALID_REQUEST, "a delete body may hold base_version only", session_id=session_id
                        )
                d = writes.write_decision(
                    scope,
                    op=op,
                    key=key,
                    old_tags=old.tags if old else None,
                    old_sensitivity=old.sensitivity if old else None,
                )
            if not d.allowed:
                raise WriteRefused(d.reason, session_id=session_id, audit_detail=d.detail)
            if op == "put":
                value_text = encode_value(value)
                if itemseal.is_sealed_text(value_text):  # it would read as a sealed blob once applied
                    raise UompError(
                        ErrorCode.INVALID_REQUEST,
                        f"the value starts with {itemseal.MARKER!r}, which marks sealed values; propose it differently",
                        session_id=session_id,
                    )
                size = len(value_text.encode("utf-8"))
                if size > b.max_value_bytes:
                    raise budget_exceeded(
                        "value_bytes", 0, b.max_value_bytes, size, "the proposed value is too large", session_id
                    )
                tags_text = json.dumps(list(tags), ensure_ascii=False, separators=(",", ":"))
            if claimed is not None and claimed != version:
                raise UompError(
                    ErrorCode.VERSION_CONFLICT,
                    f"the item is at version {version}, not {claimed}; read it again and propose on that",
                    session_id=session_id,
                    details={"current_version": version, "base_version": claimed},
                )
            check_budgets(conn, b, session_id=session_id, agent_id=agent_id, now=now, max_per_session=max_per_session)
            pid = new_proposal_id()
            conn.execute(
                f"INSERT INTO proposals ({_SQL_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,'pending',?,?,NULL,NULL,NULL,?)",
                (
                    pid,
                    session_id,
                    agent_id,
                    op,
                    key,
                    value_text,
                    tags_text,
                    sensitivity,
                    description,
                    version,
                    size,
                    now,
                    now + b.lifetime_seconds,
                    via,
                ),
            )
            row = conn.execute(f"SELECT {_SQL_COLS} FROM proposals WHERE proposal_id = ?", (pid,)).fetchone()
        return _proposal_of(row), d.detail

    def for_session(self, session_id: str, *, limit: int = 100) -> builtins.list[Proposal]:
        """This session's proposals, newest first; a pending one past its lifetime is shown
        ``expired`` (the user's side records the expiry, with its audit event)."""
        now = self.clock()
        with self.store.reading() as conn:
            rows = conn.execute(
                f"SELECT {_SQL_COLS} FROM proposals WHERE session_id = ? ORDER BY created_at DESC, proposal_id LIMIT ?",
                (session_id, max(1, min(limit, MAX_LIST))),
            ).fetchall()
        out = [_proposal_of(r) for r in rows]
        return [dataclasses.replace(p, status="expired") if p.status == "pending" and p.expires_at <= now else p
                for p in out]  # fmt: skip

    def withdraw(self, proposal_id: str, session_id: str) -> Proposal:
        """The agent takes back its own pending proposal. Another session's (or an unknown id) is
        NOT_FOUND, the same answer; a decided or expired one INVALID_STATE."""
        with self.store.writing() as conn:
            p = self._get(conn, proposal_id)
            if p is None or p.session_id != session_id:
                raise UompError(ErrorCode.NOT_FOUND, "no such proposal in this session", session_id=session_id)
            if p.status == "pending" and p.expires_at <= self.clock():
                raise UompError(ErrorCode.INVALID_STATE, "the proposal has expired", session_id=session_id,
                                details={"status": "expired"})  # fmt: skip
            if p.status != "pending":
                raise UompError(
                    ErrorCode.INVALID_STATE,
                    f"the proposal is {p.status}, not pending",
                    session_id=session_id,
                    details={"status": p.status},
                )
            conn.execute(
                "UPDATE proposals SET status = 'withdrawn', decided_at = ?, decided_by = 'agent' "
                "WHERE proposal_id = ? AND status = 'pending'",
                (self.clock(), proposal_id),
            )
            out = self._get(conn, proposal_id)
        assert out is not None
        return out

    # ------------------------------------------------------------------ the user's side

    @staticmethod
    def _get(conn: sqlite3.Connection, proposal_id: str) -> Proposal | None:
        row = conn.execute(f"SELECT {_SQL_COLS} FROM proposals WHERE proposal_id = ?", (proposal_id,)).fetchone()
        return _proposal_of(row) if row is not None else None

    def get(self, proposal_id: str) -> Proposal:
        with self.store.reading() as conn:
            p = self._get(conn, proposal_id)
        if p is None:
            raise UompError(ErrorCode.NOT_FOUND, "no such proposal; 'uomp proposals list' shows them")
        return p

    def list(self, *, status: str | None = "pending", limit: int = 100) -> builtins.list[Proposal]:
        if status is not None and status not in STATUSES:
            raise UompError(ErrorCode.INVALID_REQUEST, "status must be one of " + ", ".join(STATUSES))
        with self.store.reading() as conn:
            if status is None:
                rows = conn.execute(
                    f"SELECT {_SQL_COLS} FROM proposals ORDER BY created_at, proposal_id LIMIT ?",
                    (max(1, min(limit, MAX_LIST)),),
                ).fetchall()
            else:
                rows = conn.execute(
                    f"SELECT {_SQL_COLS} FROM proposals WHERE status = ? ORDER BY created_at, proposal_id LIMIT ?",
                    (status, max(1, min(limit, MAX_LIST))),
                ).fetchall()
        return [_proposal_of(r) for r in rows]

    def expire_due(self) -> builtins.list[Proposal]:
        """Pending proposals past their lifetime become ``expired``; the ones that did, for the audit."""
        now = self.clock()
        with self.store.writing() as conn:
            rows = conn.execute(
                f"SELECT {_SQL_COLS} FROM proposals WHERE status = 'pending' AND expires_at <= ?", (now,)
            ).fetchall()
            if rows:
                conn.execute(
                    "UPDATE proposals SET status = 'expired', decided_at = ?, decided_by = 'time' "
                    "WHERE status = 'pending' AND expires_at <= ?",
                    (now, now),
                )
        return [_proposal_of(r) for r in rows]

    def show(self, proposal_id: str) -> dict[str, Any]:
        """The change as the user is shown it: the item as it is now (``old``) and as proposed
        (``new``), whether the base still holds, and the hash an approval must send back."""
        with self.store.reading() as conn:
            p = self._get(conn, proposal_id)
            if p is None:
                raise UompError(ErrorCode.NOT_FOUND, "no such proposal; 'uomp proposals list' shows them")
            old, version = item_and_version(conn, p.key)
        return self._view(p, old, version)

    @staticmethod
    def _view(p: Proposal, old: MemoryItem | None, version: int) -> dict[str, Any]:
        old_view = writes.item_view(old.to_dict()) if old is not None else None
        new_view = p.new_view()
        return {
            **p.summary(),
            "agent_id": p.agent_id,
            "session_id": p.session_id,
            "via": p.via,
            "current_version": version,
            "stale": version != p.base_version,
            "old": old_view,
            "new": new_view,
            "change_hash": writes.change_hash(
                proposal_id=p.proposal_id,
                agent_id=p.agent_id,
                session_id=p.session_id,
                op=p.op,
                key=p.key,
                base_version=p.base_version,
                old=old_view if version == p.base_version else None,
                new=new_view,
            )
            if version == p.base_version
            else None,
        }

    def approve(self, proposal_id: str, shown_hash: str, *, by: str = "user") -> dict[str, Any]:
        """Apply exactly the change shown (its ``change_hash``), in one transaction with the
        proposal's decision. Refused with nothing changed: NOT_FOUND, INVALID_STATE (not pending:
        withdrawn, decided, expired), APPROVAL_MISMATCH (another change than the one shown),
        VERSION_CONFLICT (the item changed since the proposal; it becomes ``stale``)."""
        now = self.clock()
        conflict: UompError | None = None
        with self.store.writing() as conn:
            p = self._get(conn, proposal_id)
            if p is None:
                raise UompError(ErrorCode.NOT_FOUND, "no such proposal; 'uomp proposals list' shows them")
            if p.status == "pending" and p.expires_at <= now:
                conn.execute(
                    "UPDATE proposals SET status = 'expired', decided_at = ?, decided_by = 'time' "
                    "WHERE proposal_id = ? AND status = 'pending'",
                    (now, proposal_id),
                )
                conflict = UompError(
                    ErrorCode.INVALID_STATE,
                    "the proposal has expired; the agent may propose again",
                    details={"status": "expired"},
                )
            elif p.status != "pending":
                raise UompError(
                    ErrorCode.INVALID_STATE, f"the proposal is {p.status}, not pending", details={"status": p.status}
                )
            else:
                old, version = item_and_version(conn, p.key)
                if version != p.base_version:
                    conn.execute(
                        "UPDATE proposals SET status = 'stale', decided_at = ?, decided_by = ? "
                        "WHERE proposal_id = ? AND status = 'pending'",
                        (now, by, proposal_id),
                    )
                    conflict = UompError(
                        ErrorCode.VERSION_CONFLICT,
                        f"the item changed since the proposal (version {p.base_version} -> {version}); "
                        "nothing was applied, the agent may propose again",
                        details={"current_version": version, "base_version": p.base_version},
                    )
                else:
                    view = self._view(p, old, version)
                    if not isinstance(shown_hash, str) or view["change_hash"] != shown_hash:
                        raise UompError(
                            ErrorCode.APPROVAL_MISMATCH,
                            "the change approved is not the one this proposal makes now; show it again "
                            "('uomp proposals show ID') and approve what it shows",
                        )
                    applied = self._apply(conn, p, old)
                    fault_point("proposal_apply")  # crash tests: the item changed, the decision not yet
                    conn.execute(
                        "UPDATE proposals SET status = 'approved', decided_at = ?, decided_by = ?, "
                        "applied_version = ? WHERE proposal_id = ? AND status = 'pending'",
                        (now, by, applied, proposal_id),
                    )
                    done = self._get(conn, proposal_id)
                    assert done is not None
                    return {**done.summary(), "agent_id": done.agent_id, "change_hash": shown_hash}
        assert conflict is not None
        raise conflict

    @staticmethod
    def _apply(conn: sqlite3.Connection, p: Proposal, old: MemoryItem | None) -> int:
        """The item change of an approved proposal; the item's new version (for a delete: the
        tombstone's)."""
        if p.op == "delete":
            conn.execute("DELETE FROM item_tags WHERE item_key = ?", (p.key,))
            conn.execute("DELETE FROM items WHERE key = ?", (p.key,))
            return item_and_version(conn, p.key)[1]
        now = utc_now()
        created = old.created_at if old is not None else now
        value_text = itemseal.refuse_marker(p.key, encode_value(p.value))  # agents never write high items
        tags = list(p.tags or ())
        conn.execute("DELETE FROM item_tags WHERE item_key = ?", (p.key,))
        conn.execute(
            _SQL_UPSERT,
            (
                p.key,
                value_text,
                json.dumps(tags, ensure_ascii=False, separators=(",", ":")),
                p.sensitivity,
                created,
                now,
                p.description,
            ),
        )
        conn.executemany("INSERT INTO item_tags (tag, item_key) VALUES (?, ?)", [(t, p.key) for t in tags])
        return item_and_version(conn, p.key)[1]

    def reject(self, proposal_id: str, *, by: str = "user") -> dict[str, Any]:
        now = self.clock()
        with self.store.writing() as conn:
            p = self._get(conn, proposal_id)
            if p is None:
                raise UompError(ErrorCode.NOT_FOUND, "no such proposal; 'uomp proposals list' shows them")
            if p.status != "pending":
                raise UompError(
                    ErrorCode.INVALID_STATE, f"the proposal is {p.status}, not pending", details={"status": p.status}
                )
            conn.execute(
                "UPDATE proposals SET status = 'rejected', decided_at = ?, decided_by = ? "
                "WHERE proposal_id = ? AND status = 'pending'",
                (now, by, proposal_id),
            )
            done = self._get(conn, proposal_id)
        assert done is not None
        return {**done.summary(), "agent_id": done.agent_id}
