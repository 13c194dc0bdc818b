"""Reading the audit event log: the one reader behind ``uomp audit``, ``GET /v1/audit``, the agent's
proof route and the dashboard.

Events come from ``ledger_events`` (:mod:`gateway.ledger.log`), the one log every decision lands
in; any ``action`` is shown, whoever wrote it (the guard, the gateway, the CLI). :func:`query_events`
takes an :class:`AuditFilter` (session, agent, action, allowed/refused, time range, after-seq
cursor, limit) and answers an :class:`AuditPage` whose events are **newest last**:

* without ``after_seq``: the newest ``limit`` matching events (a tail);
* with ``after_seq``: the first ``limit`` matching events after that sequence number (paging
  forward, and ``uomp audit --follow``); ``page.cursor`` is what to pass next time: it moves past
  events that did not match, so a poll never reads the same rows twice.

Retention (``audit_retention_days``) removes old event *bodies* and keeps their leaves (proofs stay
valid). A pruned event is not shown as if it were whole: by default it is left out and counted
(``page.pruned``); with ``include_pruned`` it appears as a stub with ``"pruned": true`` and only the
columns the log keeps (seq, id, time, action, session, agent, verdict, code).

Views: ``"user"`` is the event as recorded (every field); ``"agent"`` keeps only
:data:`AGENT_FIELDS` (no ``detail``, ``via``, ``seq``: what the guard answered the agent and no more,
spec §21). The functions take a connection and never write; the caller owns threads (the guard
runs them on the audit log's reader thread).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.core.tokens import iso
from gateway.errors import ErrorCode, UompError
from gateway.ledger.log import index_values

MAX_LIMIT = 1000
DEFAULT_LIMIT = 100

# What an agent may see of its own session's events (GET /v1/audit): an allow-list, so a field a
# later writer adds (listener, certificate serial, ...) stays the user's until it is listed here.
AGENT_FIELDS = (
    "id",
    "timestamp",
    "session_id",
    "agent_id",
    "action",
    "key",
    "tags",
    "allowed",
    "reason",
    "code",
    "request_size",
    "response_size",
    "query_count_remaining",
)

_RELATIVE = re.compile(r"^(\d{1,9})\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_MAX_TEXT = 256  # filter values longer than this match nothing anyone wrote: refused


def parse_time(text: str, *, now: float | None = None) -> float:
    """Unix time of ``text``: ISO 8601 (``2026-12-01``, ``2026-12-01T08:00:00Z``, with an offset; no
    zone means UTC) or a duration before now (``90s``, ``15m``, ``1h``, ``2d``, ``1w``)."""
    raw = text.strip()
    m = _RELATIVE.match(raw.lower())
    if m:
        return (time.time() if now is None else now) - int(m.group(1)) * _UNITS[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(raw.replace("z", "Z"))
    except ValueError:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"{text[:40]!r} is not a time: use ISO 8601 (2026-12-01T08:00:00Z) "
            "or a duration before now (90s, 15m, 1h, 2d, 1w)",
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


@dataclass(frozen=True)
class AuditFilter:
    """Which events. Every field is optional; ``allowed`` True/False selects allowed/refused."""

    session_id: str | None = None
    agent_id: str | None = None
    action: tuple[str, ...] = ()  # any of these actions (empty: all)
    allowed: bool | None = None
    since: float | None = None  # ts >= since
    until: float | None = None  # ts < until
    after_seq: int | None = None
    limit: int = DEFAULT_LIMIT

    def checked(self) -> AuditFilter:
        for name, value in (
            ("session", self.session_id),
            ("agent", self.agent_id),
            *(("action", a) for a in self.action),
        ):
            if value is not None and (not value or len(value) > _MAX_TEXT):
                raise UompError(ErrorCode.INVALID_REQUEST, f"{name} must be 1 to {_MAX_TEXT} characters")
        if not 1 <= self.limit <= MAX_LIMIT:
            raise UompError(ErrorCode.INVALID_REQUEST, f"limit must be from 1 to {MAX_LIMIT}")
        if self.after_seq is not None and self.after_seq < 0:
            raise UompError(ErrorCode.INVALID_REQUEST, "the cursor (after seq) must not be negative")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise UompError(ErrorCode.INVALID_REQUEST, "since must be before until")
        return self


@dataclass
class AuditPage:
    """One page of audit events matching a filter, with the cursor for the next page."""

    events: list[dict[str, Any]]  # newest last
    pruned: int  # matching events whose bodies are past retention and are not in ``events``
    cursor: int  # pass as ``after_seq`` to get what comes next
    log_size: int = 0  # events in the whole log when this page was read
    filter: AuditFilter = field(default_factory=AuditFilter)
    # matching rows left out because the body does not hash to its leaf or an index column does not
    # hold what the body says (an edited row: ``uomp audit verify`` names it)
    damaged: int = 0


def _where(flt: AuditFilter) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    args: list[Any] = []
    if flt.session_id is not None:
        clauses.append("session_id = ?")
        args.append(flt.session_id)
    if flt.agent_id is not None:
        clauses.append("agent_id = ?")
        args.append(flt.agent_id)
    if flt.action:
        clauses.append(f"action IN ({', '.join('?' * len(flt.action))})")
        args.extend(flt.action)
    if flt.allowed is not None:
        clauses.append("allowed = ?")
        args.append(int(flt.allowed))
    if flt.since is not None:
        clauses.append("ts >= ?")
        args.append(flt.since)
    if flt.until is not None:
        clauses.append("ts < ?")
        args.append(flt.until)
    if flt.after_seq is not None:
        clauses.append("seq > ?")
        args.append(flt.after_seq)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


def _stub(row: sqlite3.Row | tuple[Any, ...]) -> dict[str, Any]:
    seq, eid, ts, action, sid, agent, allowed, code = row[:8]
    out: dict[str, Any] = {
        "seq": seq,
        "id": eid,
        "ts": ts,
        "timestamp": iso(float(ts)),
        "action": action,
        "session_id": sid,
        "agent_id": agent,
        "allowed": None if allowed is None else bool(allowed),
        "code": code,
        "pruned": True,
    }
    return {k: v for k, v in out.items() if v is not None}


def agent_view(event: dict[str, Any]) -> dict[str, Any]:
    """The fields of an event an agent may see of its own session's events."""
    return {k: event[k] for k in AGENT_FIELDS if k in event}


def query_events(
    conn: sqlite3.Connection, flt: AuditFilter, *, view: str = "user", include_pruned: bool = False
) -> AuditPage:
    """The events ``flt`` selects, newest last (see the module docstring). Read in one snapshot."""
    flt.checked()
    if view not in ("user", "agent"):
        raise ValueError("view is 'user' or 'agent'")
    where, args = _where(flt)
    kept = where + (" AND " if where else " WHERE ") + "body IS NOT NULL"
    cols = "seq, id, ts, action, session_id, agent_id, allowed, code, body, leaf"
    own = not conn.in_transaction
    if own:
        conn.execute("BEGIN")  # one snapshot: the page, its count and the cursor agree
    try:
        size = int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM ledger_events").fetchone()[0])
        scope = where if include_pruned else kept
        if flt.after_seq is None:
            rows = conn.execute(
                f"SELECT {cols} FROM ledger_events{scope} ORDER BY seq DESC LIMIT ?", (*args, flt.limit)
            ).fetchall()
            rows.reverse()
        else:
            rows = conn.execute(
                f"SELECT {cols} FROM ledger_events{scope} ORDER BY seq LIMIT ?", (*args, flt.limit)
            ).fetchall()
        pruned = 0
        if not include_pruned:
            pruned_where = where + (" AND " if where else " WHERE ") + "body IS NULL"
            pruned = int(conn.execute(f"SELECT COUNT(*) FROM ledger_events{pruned_where}", args).fetchone()[0])
    finally:
        if own:
            conn.execute("COMMIT")
    events: list[dict[str, Any]] = []
    damaged = 0
    for r in rows:
        if r[8] is None:
            events.append(_stub(r))
            continue
        body = checked_body(r)
        if body is None:
            damaged += 1
        else:
            events.append(body)
    if view == "agent":
        events = [agent_view(e) for e in events]
    if flt.after_seq is not None and len(rows) == flt.limit:
        cursor = int(rows[-1][0])  # a full page: more may follow right after it
    else:
        cursor = max(size, flt.after_seq or 0)
    return AuditPage(events, pruned, cursor, size, flt, damaged)


def checked_body(row: sqlite3.Row | tuple[Any, ...]) -> dict[str, Any] | None:
    """The body of a row ``(seq, id, ts, action, session_id, agent_id, allowed, code, body, leaf)``
    when it hashes to its leaf, names its own ``seq`` and every index column holds what it says (so
    a filter on those columns selected what the body says); None otherwise."""
    raw = str(row[8])
    if hashlib.sha256(b"\x00" + raw.encode()).digest() != bytes(row[9]):
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("seq") != row[0]:
        return None
    try:
        want = index_values(body)
    except (KeyError, TypeError, ValueError):
        return None
    if any(have != should or type(have) is not type(should) for have, should in zip(row[1:8], want, strict=True)):
        return None
    return body


def session_known(conn: sqlite3.Connection, session_id: str) -> bool:
    """True when the log holds any event of this session (pruned ones count)."""
    row = conn.execute("SELECT 1 FROM ledger_events WHERE session_id = ? LIMIT 1", (session_id,)).fetchone()
    return row is not None


def require_session(conn: sqlite3.Connection, session_id: str) -> None:
    """SESSION_NOT_FOUND unless the audit log knows ``session_id``."""
    if not session_known(conn, session_id):
        raise UompError(
            ErrorCode.SESSION_NOT_FOUND,
            f"no session {session_id[:80]} in the audit log; see 'uomp sessions list'",
            session_id=session_id[:80],
        )


def event_owner(conn: sqlite3.Connection, event_id: str) -> tuple[str | None, bool | None] | None:
    """(session_id, allowed) of one event, or None when the log has no such id."""
    row = conn.execute("SELECT session_id, allowed FROM ledger_events WHERE id = ?", (event_id,)).fetchone()
    if row is None:
        return None
    return row[0], None if row[1] is None else bool(row[1])


# ------------------------------------------------------------------------- summaries (the dashboard)


def known_agents(conn: sqlite3.Connection, *, limit: int = 200) -> list[str]:
    """Agent ids in the log, sorted."""
    return [
        str(r[0])
        for r in conn.execute(
            "SELECT DISTINCT agent_id FROM ledger_events WHERE agent_id IS NOT NULL ORDER BY agent_id LIMIT ?", (limit,)
        )
    ]


def known_sessions(conn: sqlite3.Connection, *, limit: int = 200) -> list[str]:
    """Session ids in the log, the most recently active first."""
    return [
        str(r[0])
        for r in conn.execute(
            "SELECT session_id FROM ledger_events WHERE session_id IS NOT NULL"
            " GROUP BY session_id ORDER BY MAX(seq) DESC LIMIT ?",
            (limit,),
        )
    ]


def quota_remaining(conn: sqlite3.Connection, session_ids: list[str]) -> dict[str, int]:
    """The newest ``query_count_remaining`` recorded per session (sessions without one are left out)."""
    out: dict[str, int] = {}
    for sid in session_ids:
        row = conn.execute(
            "SELECT json_extract(body, '$.query_count_remaining') AS q FROM ledger_events"
            " WHERE session_id = ? AND q IS NOT NULL ORDER BY seq DESC LIMIT 1",
            (sid,),
        ).fetchone()
        if row is not None:
            out[sid] = int(row[0])
    return out


def hourly_counts(
    conn: sqlite3.Connection, *, since: float, exclude_actions: tuple[str, ...] = ()
) -> list[tuple[str, bool, int, int]]:
    """(agent, allowed, hour since ``since``, events) for every event at or after ``since``."""
    not_in = f" AND action NOT IN ({', '.join('?' * len(exclude_actions))})" if exclude_actions else ""
    rows = conn.execute(
        "SELECT agent_id, allowed, CAST((ts - ?) / 3600 AS INTEGER), COUNT(*) FROM ledger_events"
        f" WHERE ts >= ?{not_in} GROUP BY 1, 2, 3",
        (since, since, *exclude_actions),
    ).fetchall()
    return [(str(a), bool(ok), int(b), int(n)) for a, ok, b, n in rows]
