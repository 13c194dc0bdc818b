"""A session that reaches its expiry gets exactly one ``session_expired`` event, whoever sees the
expiry first (a read, the sweep, a list, another Auth Service on the same files) and across a guard
restart; ``deletion_proof_missing`` as before (once, for a session that owed a proof). Real SQLite
files and a real guard; the Auth Service's clock is moved instead of waiting out a session."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import time
from typing import Any

from guardkit import admin_headers, call, grant, guard_config, running_guard, seed, unix_session

from gateway.config import GuardConfig, Paths
from gateway.errors import UompError
from gateway.guard.audit import open_audit
from gateway.guard.auth import AuthService

READ = {"tags": ["preference"], "keys": []}


def events(home: Paths, action: str) -> list[dict[str, Any]]:
    conn = sqlite3.connect(f"file:{home.audit_db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT body FROM ledger_events WHERE action = ? ORDER BY seq", (action,)).fetchall()
    finally:
        conn.close()
    return [json.loads(r[0]) for r in rows]


def signed_size(home: Paths) -> int:
    conn = sqlite3.connect(f"file:{home.audit_db}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT MAX(size) FROM ledger_checkpoints").fetchone()[0] or 0)
    finally:
        conn.close()


def test_every_observer_and_a_second_service_write_one_event(home: Paths) -> None:
    clock = [time.time()]
    cfg = GuardConfig()
    audit = open_audit(home, cfg)
    auth = AuthService(home, cfg, audit, clock=lambda: clock[0])
    other_audit = open_audit(home, cfg)  # another process on the same files (the CLI's `uomp sessions list`)
    other = AuthService(home, cfg, other_audit, clock=lambda: clock[0])
    try:
        sid = auth.create_session(
            {
                "agent_id": "a1",
                "requested_scopes": {"read": READ},
                "duration_minutes": 1,
                "data_retention_policy": {
                    "proof_required": True,
                    "max_retention_seconds": 0,
                    "deletion_method": "process_termination",
                },
            }
        )["session_id"]
        auth.grant(sid, {"granted_scopes": {"read": READ}})
        live = auth.create_session({"agent_id": "a2", "requested_scopes": {"read": READ}, "duration_minutes": 30})[
            "session_id"
        ]
        auth.grant(live, {"granted_scopes": {"read": READ}})
        assert auth.session(sid).status == "active" and events(home, "session_expired") == []
        clock[0] += 61
        for _ in range(5):
            assert auth.session(sid).status == "expired"
            assert other.session(sid).status == "expired"
            auth.expire_due()
            other.expire_due()
            auth.list_sessions()
        assert auth.session(live).status == "active"
    finally:
        auth.close_db()
        other.close_db()
        audit.close()
        other_audit.close()
    # a restart: the services open again (the outbox is replayed) and sweep
    audit = open_audit(home, cfg)
    auth = AuthService(home, cfg, audit, clock=lambda: clock[0])
    try:
        auth.expire_due()
        assert auth.session(sid).status == "expired"
    finally:
        auth.close_db()
        audit.close()
    expired = events(home, "session_expired")
    assert [(e["session_id"], e["agent_id"], e["allowed"]) for e in expired] == [(sid, "a1", True)]
    assert [e["session_id"] for e in events(home, "deletion_proof_missing")] == [sid]
    # urgent: in a signed checkpoint at once
    assert signed_size(home) >= expired[0]["seq"]


async def test_a_running_guard_reads_sweeps_and_restarts(home: Paths) -> None:
    seed(home)
    cfg = guard_config(sweep_interval_seconds=0.05)
    async with running_guard(home, cfg) as g, unix_session(home) as s:
        a = await grant(s, home, read=READ, duration_minutes=1)
        assert (await call(s, "GET", "/v1/memory/preference.theme", token=a["token"]))[0] == 200
        svc = g.services
        assert svc is not None
        svc.auth.clock = lambda: time.time() + 120  # past the session's end (1 minute)
        svc.auth.rows.forget(a["session_id"])
        for _ in range(10):
            status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=a["token"])
            assert status == 401, body
        await svc.authdb(svc.auth.expire_due)
    async with running_guard(home, cfg) as g2, unix_session(home) as s:
        assert g2.services is not None
        await g2.services.authdb(g2.services.auth.expire_due)
        status, body, _ = await call(s, "GET", f"/v1/sessions/{a['session_id']}", headers=admin_headers(home))
        assert status == 200 and body["status"] == "expired"
    expired = events(home, "session_expired")
    assert [e["session_id"] for e in expired] == [a["session_id"]], expired
    assert signed_size(home) >= expired[0]["seq"]


def stored_status(home: Paths, session_id: str) -> str:
    """The session's row as auth.db holds it (reading it through the guard would expire it)."""
    conn = sqlite3.connect(f"file:{home.auth_db}?mode=ro", uri=True)
    try:
        return str(conn.execute("SELECT status FROM sessions WHERE session_id = ?", (session_id,)).fetchone()[0])
    finally:
        conn.close()


async def test_the_sweeper_closes_a_session_at_its_expiry_not_at_its_next_tick(home: Paths) -> None:
    """With the sweeper looking every 5 s, a session that ends 0.8 s after one look is closed at its
    end, by the sweeper alone (no request touches it), and not before. A sweeper that only ticks
    would close it at the next tick, ~5 s late."""
    seed(home)
    cfg = guard_config(sweep_interval_seconds=5.0)
    async with running_guard(home, cfg) as g, unix_session(home) as s:
        started = time.monotonic()  # the sweeper's first look is now: the next one 5 s on
        a = await grant(s, home, read=READ, duration_minutes=1)
        svc = g.services
        assert svc is not None
        sid = a["session_id"]
        end_in = 5.8 - (time.monotonic() - started)
        expires_at = (await svc.authdb(svc.auth.session, sid)).expires_at
        shift = expires_at - (time.time() + end_in)
        svc.auth.clock = lambda: time.time() + shift  # the session now ends 5.8 s after the first look
        svc.auth.rows.forget(sid)
        while time.monotonic() - started < 5.6:
            assert stored_status(home, sid) == "active"  # not before its end
            await asyncio.sleep(0.1)
        while stored_status(home, sid) == "active" and time.monotonic() - started < 7.5:
            await asyncio.sleep(0.05)
        assert stored_status(home, sid) == "expired", time.monotonic() - started
    assert [e["session_id"] for e in events(home, "session_expired")] == [sid]


def test_a_failed_transition_writes_nothing(home: Paths) -> None:
    """A session closed before its expiry is not expired later (and writes no session_expired)."""
    clock = [time.time()]
    cfg = dataclasses.replace(GuardConfig())
    audit = open_audit(home, cfg)
    auth = AuthService(home, cfg, audit, clock=lambda: clock[0])
    try:
        sid = auth.create_session({"agent_id": "a1", "requested_scopes": {"read": READ}, "duration_minutes": 1})[
            "session_id"
        ]
        auth.grant(sid, {"granted_scopes": {"read": READ}})
        auth.close(sid)
        clock[0] += 120
        auth.expire_due()
        assert auth.session(sid).status == "closed"
        try:
            auth.close(sid)
        except UompError:
            pass
    finally:
        auth.close_db()
        audit.close()
    assert events(home, "session_expired") == []
    assert len(events(home, "session_closed")) == 1
