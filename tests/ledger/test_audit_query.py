"""The one audit reader (gateway/ledger/query.py) over the real event log in a real SQLite file:
filters and their refusals, newest last, the after-seq cursor, the agent's view, retention (pruned
events shown honestly; an old proof still verifies), and the migration of an older version's
``audit_logs`` table (nothing lost, nothing doubled)."""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from typing import Any

import pytest

from gateway.config import GuardConfig, Paths
from gateway.errors import UompError
from gateway.guard.audit import AuditLog, make_row, open_audit
from gateway.ledger import auditkey
from gateway.ledger.log import EventLog
from gateway.ledger.query import (
    AGENT_FIELDS,
    AuditFilter,
    agent_view,
    hourly_counts,
    known_agents,
    known_sessions,
    parse_time,
    query_events,
    quota_remaining,
)
from gateway.ledger.verify import verify_bundle, verify_log

DAY = 86400.0


def _cfg(**kw: Any) -> GuardConfig:
    return dataclasses.replace(GuardConfig(tcp_port=0), **kw)


def _verifier(home: Paths) -> str:
    key = auditkey.load(home)
    return EventLog(sqlite3.connect(":memory:"), origin=auditkey.origin_for(key.public_key()), key=key).verifier_key()


def _fill(audit: AuditLog, now: float) -> None:
    """Eight events over three days: two sessions, two agents, several actions, both verdicts."""
    rows = [
        ("s1", "a1", "session_granted", True, now - 3 * DAY),
        ("s1", "a1", "read", True, now - 2 * DAY),
        ("s1", "a1", "read", False, now - 2 * DAY + 60),
        ("s2", "a2", "read", True, now - DAY),
        ("s2", "a2", "aggregate", False, now - 3600),
        ("s1", "a1", "audit", True, now - 1800),
        ("unknown", "unknown", "gateway_refused", False, now - 600),  # any action, whoever wrote it
        ("s1", "a1", "read", True, now - 60),
    ]
    for sid, agent, action, allowed, ts in rows:
        audit.record(
            session_id=sid,
            agent_id=agent,
            action=action,
            allowed=allowed,
            reason=f"{action} {allowed}",
            detail="user only",
            via="local",
            key="k",
            now=ts,
        )
    audit.flush_sync()


def _actions(events: list[dict[str, Any]]) -> list[str]:
    return [f"{e['session_id']}:{e['action']}:{e['allowed']}" for e in events]


def test_filters_newest_last_and_their_partners(home: Paths) -> None:
    now = time.time()
    audit = open_audit(home, _cfg())
    try:
        _fill(audit, now)
        q = audit.query
        every = q(AuditFilter()).events
        assert len(every) == 8 and [e["seq"] for e in every] == sorted(e["seq"] for e in every)  # newest last
        assert every[-1]["ts"] == pytest.approx(now - 60) and every[0]["action"] == "session_granted"
        # session: s1 only, s2 only; a session nobody used matches nothing
        assert {e["session_id"] for e in q(AuditFilter(session_id="s1")).events} == {"s1"}
        assert len(q(AuditFilter(session_id="s1")).events) == 5
        assert len(q(AuditFilter(session_id="s2")).events) == 2
        assert q(AuditFilter(session_id="s3")).events == []
        assert audit.session_known("s1") and not audit.session_known("s3")
        # agent
        assert {e["agent_id"] for e in q(AuditFilter(agent_id="a2")).events} == {"a2"}
        assert q(AuditFilter(agent_id="nobody")).events == []
        # action: one, several, one nobody wrote
        assert _actions(q(AuditFilter(action=("aggregate",))).events) == ["s2:aggregate:False"]
        assert len(q(AuditFilter(action=("read", "gateway_refused"))).events) == 5
        assert q(AuditFilter(action=("write",))).events == []
        # allowed / refused partition the log
        allowed = q(AuditFilter(allowed=True)).events
        refused = q(AuditFilter(allowed=False)).events
        assert all(e["allowed"] for e in allowed) and not any(e["allowed"] for e in refused)
        assert len(allowed) + len(refused) == 8 and len(refused) == 3
        # time range: since is inclusive, until exclusive; relative and ISO forms
        recent = q(AuditFilter(since=parse_time("2h", now=now))).events
        assert _actions(recent) == [
            "s2:aggregate:False",
            "s1:audit:True",
            "unknown:gateway_refused:False",
            "s1:read:True",
        ]
        older = q(AuditFilter(until=parse_time("2d", now=now))).events
        assert _actions(older) == ["s1:session_granted:True"]
        window = q(AuditFilter(since=now - 2 * DAY, until=now - DAY + 1)).events
        assert _actions(window) == ["s1:read:True", "s1:read:False", "s2:read:True"]
        # combined (AND)
        both = q(AuditFilter(session_id="s1", action=("read",), allowed=False)).events
        assert _actions(both) == ["s1:read:False"]
        # limit: the newest N, still newest last
        last2 = q(AuditFilter(limit=2)).events
        assert [e["seq"] for e in last2] == [every[-2]["seq"], every[-1]["seq"]]
    finally:
        audit.close()


def test_after_seq_cursor_pages_forward_and_skips_what_did_not_match(home: Paths) -> None:
    now = time.time()
    audit = open_audit(home, _cfg())
    try:
        _fill(audit, now)
        first = audit.query(AuditFilter(session_id="s1", after_seq=0, limit=2))
        assert [e["seq"] for e in first.events] == [1, 2] and first.cursor == 2  # a full page: cursor at its end
        second = audit.query(AuditFilter(session_id="s1", after_seq=first.cursor, limit=2))
        assert [e["seq"] for e in second.events] == [3, 6] and second.cursor == 6
        rest = audit.query(AuditFilter(session_id="s1", after_seq=second.cursor, limit=2))
        assert [e["seq"] for e in rest.events] == [8] and rest.cursor == 8
        tail = audit.query(AuditFilter(session_id="s1", after_seq=rest.cursor))
        assert tail.events == [] and tail.cursor == 8
        # events of other sessions move the cursor on, so a poll never reads them twice
        audit.record(session_id="s2", agent_id="a2", action="read", allowed=True, reason="r")
        audit.flush_sync()
        moved = audit.query(AuditFilter(session_id="s1", after_seq=tail.cursor))
        assert moved.events == [] and moved.cursor == 9
        audit.record(session_id="s1", agent_id="a1", action="read", allowed=True, reason="r")
        audit.flush_sync()
        assert [e["seq"] for e in audit.query(AuditFilter(session_id="s1", after_seq=moved.cursor)).events] == [10]
    finally:
        audit.close()


@pytest.mark.parametrize(
    "flt",
    [
        AuditFilter(limit=0),
        AuditFilter(limit=1001),
        AuditFilter(after_seq=-1),
        AuditFilter(session_id=""),
        AuditFilter(agent_id="x" * 300),
        AuditFilter(action=("",)),
        AuditFilter(since=10.0, until=10.0),
        AuditFilter(since=20.0, until=10.0),
    ],
)
def test_bad_filters_are_refused(home: Paths, flt: AuditFilter) -> None:
    audit = AuditLog(home.audit_db)
    try:
        with pytest.raises(UompError) as exc:
            audit.query(flt)
        assert exc.value.code == "INVALID_REQUEST"
    finally:
        audit.close()


def test_parse_time() -> None:
    now = 1_800_000_000.0
    assert parse_time("90s", now=now) == now - 90
    assert parse_time("15m", now=now) == now - 900
    assert parse_time("1h", now=now) == now - 3600
    assert parse_time("2d", now=now) == now - 2 * DAY
    assert parse_time("1w", now=now) == now - 7 * DAY
    assert parse_time("2026-12-01T08:00:00Z") == parse_time("2026-12-01T09:00:00+01:00") == 1796112000.0
    assert parse_time("2026-12-01T08:00:00") == 1796112000.0  # no zone: UTC
    assert parse_time("2026-12-01") == 1796083200.0
    for junk in ("", "yesterday", "1y", "-1h", "2026-13-01", "1h ago", "12"):
        with pytest.raises(UompError) as exc:
            parse_time(junk, now=now)
        assert exc.value.code == "INVALID_REQUEST"


def test_agent_view_is_an_allow_list(home: Paths) -> None:
    event = {
        "id": "log_1",
        "seq": 7,
        "ts": 1.0,
        "timestamp": "t",
        "session_id": "s",
        "agent_id": "a",
        "action": "read",
        "allowed": False,
        "reason": "key is not within granted scope",
        "detail": "key does not exist",
        "via": "gateway:mtls:01",
        "listener": "mtls",
        "cert_serial": "01",
    }
    seen = agent_view(event)
    assert set(seen) <= set(AGENT_FIELDS)
    assert "detail" not in seen and "via" not in seen and "seq" not in seen and "listener" not in seen
    assert seen["reason"] == event["reason"]
    audit = AuditLog(home.audit_db)
    try:
        audit.record(
            session_id="s", agent_id="a", action="read", allowed=False, reason="r", detail="secret why", via="local"
        )
        audit.flush_sync()
        [mine] = audit.for_session("s")
        assert "detail" not in mine and "via" not in mine and mine["reason"] == "r"
        [full] = audit.for_session("s", agent_view=False)
        assert full["detail"] == "secret why" and full["via"] == "local"
    finally:
        audit.close()


def test_retention_prunes_bodies_shows_them_honestly_and_old_proofs_verify(home: Paths) -> None:
    now = time.time()
    audit = open_audit(home, _cfg(audit_checkpoint_events=1, audit_retention_days=90))
    try:
        audit.record(
            session_id="s1", agent_id="a1", action="read", allowed=True, reason="old", key="k", now=now - 91 * DAY
        )
        audit.flush_sync()
        old_id = audit.query(AuditFilter()).events[-1]["id"]
        bundle = audit.proof_for_session(old_id, "s1")  # issued while the body was kept
        audit.record(session_id="s1", agent_id="a1", action="read", allowed=False, reason="new", now=now - DAY)
        audit.flush_sync()
        assert audit.purge(now=now) == 1
        assert audit.purge(now=now) == 0  # idempotent

        page = audit.query(AuditFilter(session_id="s1"))
        assert [e["reason"] for e in page.events] == ["new"] and page.pruned == 1  # hidden, and counted
        assert audit.query(AuditFilter(session_id="s1", allowed=False)).pruned == 0  # the count follows the filter
        stubbed = audit.query(AuditFilter(session_id="s1"), include_pruned=True).events
        assert stubbed[0]["pruned"] is True and stubbed[0]["id"] == old_id and stubbed[0]["action"] == "read"
        assert "reason" not in stubbed[0] and "key" not in stubbed[0]  # nothing the body held
        assert "pruned" not in stubbed[1]
        assert [e["reason"] for e in audit.for_session("s1")] == ["new"]
        assert audit.session_known("s1")

        # the proof issued before still verifies; the whole log too; a new proof of it is refused
        proof = verify_bundle(bundle, trusted_key=_verifier(home))
        assert proof.seq == 1 and proof.event["reason"] == "old"
        conn = sqlite3.connect(home.audit_db)
        try:
            key = auditkey.load(home)
            report = verify_log(conn, origin=auditkey.origin_for(key.public_key()), public_key=key.public_key())
        finally:
            conn.close()
        assert report.ok and report.pruned == 1 and report.events == 2
        with pytest.raises(UompError) as exc:
            audit.proof_for_session(old_id, "s1")
        assert exc.value.code == "NOT_FOUND"
    finally:
        audit.close()


# The table as versions before the Merkle event log created it (copied, so that it stays the old one).
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit_logs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, ts REAL NOT NULL, timestamp TEXT NOT NULL,
  session_id TEXT NOT NULL, agent_id TEXT NOT NULL, action TEXT NOT NULL, key TEXT, tags TEXT,
  allowed INTEGER NOT NULL, reason TEXT NOT NULL, detail TEXT, request_size INTEGER, response_size INTEGER,
  query_count_remaining INTEGER, via TEXT
);
CREATE INDEX IF NOT EXISTS idx_audit_session ON audit_logs(session_id, seq);
CREATE INDEX IF NOT EXISTS idx_audit_ts ON audit_logs(ts);
"""
COLS = (
    "id",
    "ts",
    "timestamp",
    "session_id",
    "agent_id",
    "action",
    "key",
    "tags",
    "allowed",
    "reason",
    "detail",
    "request_size",
    "response_size",
    "query_count_remaining",
    "via",
)


def _old_rows(db: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
    db.executescript(OLD_SCHEMA)
    db.executemany(f"INSERT INTO audit_logs ({', '.join(COLS)}) VALUES ({', '.join('?' * len(COLS))})", rows)
    db.commit()


def _tables(path: Any) -> set[str]:
    db = sqlite3.connect(path)
    try:
        return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        db.close()


def test_migrates_a_db_of_the_old_schema(home: Paths) -> None:
    now = time.time()
    rows = [
        make_row(
            session_id="s1",
            agent_id="a1",
            action="read",
            allowed=i % 2 == 0,
            reason=f"r{i}",
            key=f"k{i}",
            tags=["t"] if i == 1 else None,
            detail="why",
            via="local",
            query_count_remaining=9 - i,
            now=now - (5 - i) * 3600,
        )
        for i in range(5)
    ]
    db = sqlite3.connect(home.audit_db)
    _old_rows(db, rows)  # an audit.db made by the old version: no event log at all
    db.close()
    assert "ledger_events" not in _tables(home.audit_db)

    audit = open_audit(home, _cfg())
    try:
        events = audit.query(AuditFilter(session_id="s1")).events
        assert [e["id"] for e in events] == [r[0] for r in rows]  # every row, in the old order
        assert [e["seq"] for e in events] == [1, 2, 3, 4, 5]
        for e, r in zip(events, rows, strict=True):
            assert e["migrated"] is True and e["ts"] == r[1] and e["timestamp"] == r[2] and e["reason"] == r[9]
            assert e["allowed"] is bool(r[8]) and e["detail"] == "why" and e["query_count_remaining"] == r[13]
        assert events[1]["tags"] == ["t"] and "tags" not in events[0]
        assert audit.query(AuditFilter(allowed=False)).events[0]["reason"] == "r1"
        # new events follow them; a proof of a migrated event verifies
        audit.record(session_id="s1", agent_id="a1", action="read", allowed=True, reason="after")
        audit.flush_sync()
        assert [e["seq"] for e in audit.query(AuditFilter(session_id="s1")).events][-1] == 6
    finally:
        audit.close()
    assert "audit_logs" not in _tables(home.audit_db)  # dropped once moved
    again = open_audit(home, _cfg(audit_checkpoint_events=1))
    try:
        assert len(again.query(AuditFilter()).events) == 6  # opening again moves nothing twice
        assert verify_bundle(again.proof_for_session(rows[0][0], "s1"), trusted_key=_verifier(home)).seq == 1
    finally:
        again.close()
    conn = sqlite3.connect(home.audit_db)
    try:
        key = auditkey.load(home)
        assert verify_log(conn, origin=auditkey.origin_for(key.public_key()), public_key=key.public_key()).ok
    finally:
        conn.close()


def test_migration_keeps_what_only_the_old_table_has_and_doubles_nothing(home: Paths) -> None:
    """A db both versions wrote: rows in both places are not copied; rows only in audit_logs are."""
    now = time.time()
    audit = open_audit(home, _cfg())
    try:
        for i in range(3):
            audit.record(session_id="s1", agent_id="a1", action="read", allowed=True, reason=f"both{i}", now=now - i)
        audit.flush_sync()
        both = audit.query(AuditFilter()).events
    finally:
        audit.close()
    only_old = make_row(
        session_id="s9", agent_id="a9", action="read", allowed=False, reason="only old", now=now - 30 * DAY
    )
    dual = [tuple(e.get(c) if c != "allowed" else int(e[c]) for c in COLS) for e in both]
    db = sqlite3.connect(home.audit_db)
    _old_rows(db, [*dual[:2], only_old, dual[2]])
    db.close()

    audit = open_audit(home, _cfg())
    try:
        events = audit.query(AuditFilter()).events
        assert len(events) == 4 and [e["id"] for e in events[:3]] == [e["id"] for e in both]
        assert events[3]["id"] == only_old[0] and events[3]["migrated"] is True and events[3]["reason"] == "only old"
        assert audit.session_known("s9")
        assert audit.query(AuditFilter(until=now - DAY)).events[0]["id"] == only_old[0]  # its own time
    finally:
        audit.close()
    assert "audit_logs" not in _tables(home.audit_db)


def test_the_writer_no_longer_fills_audit_logs(home: Paths) -> None:
    audit = open_audit(home, _cfg())
    try:
        audit.record(session_id="s1", agent_id="a1", action="read", allowed=True, reason="r")
        audit.flush_sync()
        assert len(audit.query(AuditFilter()).events) == 1
    finally:
        audit.close()
    assert "audit_logs" not in _tables(home.audit_db)
    db = sqlite3.connect(home.audit_db)
    try:
        page = query_events(db, AuditFilter())  # any plain connection reads it (the dashboard, tests)
    finally:
        db.close()
    assert len(page.events) == 1 and page.log_size == 1 and page.cursor == 1


def test_proof_for_session_rules(home: Paths) -> None:
    audit = open_audit(home, _cfg(audit_checkpoint_seconds=3600))
    try:
        audit.record(session_id="s1", agent_id="a1", action="read", allowed=True, reason="mine")
        audit.record(session_id="s1", agent_id="a1", action="read", allowed=False, reason="refused", detail="why")
        audit.record(session_id="s2", agent_id="a2", action="read", allowed=True, reason="theirs")
        audit.flush_sync()  # the first batch is checkpointed at once (no checkpoint yet)
        mine, refused, theirs = (e["id"] for e in audit.query(AuditFilter()).events)
        bundle = audit.proof_for_session(mine, "s1")
        assert verify_bundle(bundle, trusted_key=_verifier(home)).event["reason"] == "mine"
        answers = []
        for eid in (theirs, "log_0000000000000000", "x" * 500, ""):
            with pytest.raises(UompError) as exc:
                audit.proof_for_session(eid, "s1")
            answers.append(exc.value.body())
        assert all(a == answers[0] for a in answers) and answers[0]["error"]["code"] == "NOT_FOUND"
        assert exc.value.status == 404
        with pytest.raises(UompError) as exc:
            audit.proof_for_session(refused, "s1")  # its body holds the user's detail
        assert exc.value.code == "ACCESS_DENIED"
        audit.record(session_id="s1", agent_id="a1", action="read", allowed=True, reason="later")
        audit.flush_sync()  # within the checkpoint interval: not signed yet
        later = audit.query(AuditFilter()).events[-1]["id"]
        with pytest.raises(UompError) as exc:
            audit.proof_for_session(later, "s1")
        assert exc.value.code == "STORE_BUSY" and exc.value.details == {"reason": "PROOF_PENDING"}
    finally:
        audit.close()


def test_summaries_for_the_dashboard(home: Paths) -> None:
    now = time.time()
    audit = open_audit(home, _cfg())
    try:
        _fill(audit, now)
        audit.record(
            session_id="s2",
            agent_id="a2",
            action="read",
            allowed=True,
            reason="r",
            query_count_remaining=41,
            now=now - 30,
        )
        audit.record(
            session_id="s1",
            agent_id="a1",
            action="read",
            allowed=True,
            reason="r",
            query_count_remaining=7,
            now=now - 20,
        )
        audit.record(session_id="s1", agent_id="a1", action="session_revoked", allowed=True, reason="r", now=now - 10)
        audit.flush_sync()
        conn = sqlite3.connect(home.audit_db)
        try:
            assert known_agents(conn) == ["a1", "a2", "unknown"]
            assert known_sessions(conn) == ["s1", "s2", "unknown"]  # the most recently active first
            assert known_sessions(conn, limit=1) == ["s1"]
            assert quota_remaining(conn, ["s1", "s2", "s3"]) == {"s1": 7, "s2": 41}  # the newest; none for s3
            counts = hourly_counts(conn, since=now - 2 * 3600, exclude_actions=("session_revoked",))
            assert sorted(counts) == [
                ("a1", True, 1, 3),
                ("a2", False, 1, 1),
                ("a2", True, 1, 1),
                ("unknown", False, 1, 1),
            ]
        finally:
            conn.close()
    finally:
        audit.close()
