"""The guard's only read in flight has its event written by the auth.db worker itself.

Under load a read's event joins the audit writer thread's group commit. A read that is alone (no
other read in flight, the writer idle) used to make four thread hand-overs for one commit:

- the worker hands the read over to the event loop;
- the loop hands the event to the writer;
- the writer commits and hands back to the loop;
- the loop answers.

Now the worker that did the read makes the answer, writes the event (the same batch and outcome as
the writer thread's, `GroupCommitWriter.write_here`) and hands over once it is durable.

Through the real gateway (TLS 1.3 mTLS on 127.0.0.1) to the real guard (Unix socket, SQLite files),
checked:

- a lone allowed read is answered only once its event is durable (a fresh read-only connection sees
  it), and the worker wrote it;
- its event is the same, field for field, as that of a read taken the other way (another read in
  flight);
- refusals (out of scope, missing key) take the event loop's way, as before, and are recorded;
- audit.db locked by another process: the lone read gets 503 STORE_BUSY without the value, and no
  event says it was allowed or that it was refused. The log counts it (audit_gap) once it can write
  again, as when the loop's flush fails.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from typing import Any

import pytest
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance, ledger_events, verify_ledger
from guardkit import guard_config, held_lock

from gateway.config import Paths
from gateway.guard.services import GuardServices

pytestmark = pytest.mark.timeout(120)

# what differs between two reads of the same key by the same session: their identity and time (ts,
# and timestamp, which may be the next second), the quota left, the request's own id and client port
PER_REQUEST = {"id", "ts", "timestamp", "seq", "query_count_remaining", "request_id", "client"}


# no background batch (a checkpoint probe, a sweep) may make the writer busy when a test wants a lone read
QUIET = {"audit_checkpoint_seconds": 3600.0, "sweep_interval_seconds": 3600.0}


def services(app: Appliance) -> GuardServices:
    assert app.guard is not None and app.guard.services is not None
    return app.guard.services


async def read(app: Appliance, agent: Agent, token: str, key: str) -> tuple[int, Any]:
    async with agent_session(agent, app.paths) as s:
        status, body, _ = await agent_call(s, app.base, f"/v1/memory/{key}", token=token, agent_id=agent.agent_id)
        return status, body


def durable_events(app: Appliance, sid: str) -> list[dict[str, Any]]:
    """The session's events as a separate read-only connection sees them: committed ones only."""
    conn = sqlite3.connect(f"file:{app.paths.audit_db}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT body FROM ledger_events WHERE session_id = ? AND body IS NOT NULL ORDER BY seq", (sid,)
        ).fetchall()
    finally:
        conn.close()
    return [json.loads(r[0]) for r in rows]


async def test_a_lone_read_is_written_by_the_worker_and_is_the_same_event(home: Paths) -> None:
    async with appliance(home, guard_cfg=guard_config(**QUIET)) as app:
        svc = services(app)
        writer = svc.audit.writer
        agent = app.agent("calendar_agent")
        g = await app.grant(agent)
        sid, token = g["session_id"], g["token"]

        here = writer.batches_here
        status, body = await read(app, agent, token, "preference.theme")
        assert status == 200 and body["value"] == "dark"
        assert writer.batches_here == here + 1  # written on the worker, not the writer thread
        lone = [e for e in durable_events(app, sid) if e["action"] == "read"]
        assert len(lone) == 1 and lone[0]["allowed"] is True  # durable when the answer arrived

        # the other way: another read is in flight (as under load), so the writer thread writes it
        svc.reads_in_flight += 1
        try:
            status, body = await read(app, agent, token, "preference.theme")
        finally:
            svc.reads_in_flight -= 1
        assert status == 200 and body["value"] == "dark"
        assert writer.batches_here == here + 1
        both = [e for e in durable_events(app, sid) if e["action"] == "read"]
        assert len(both) == 2
        first, second = ({k: v for k, v in e.items() if k not in PER_REQUEST} for e in both)
        assert first == second
        assert first["listener"] == "mtls" and first["key"] == "preference.theme"
        assert first["tags"] == ["preference", "ui"] and first["reason"] == "tag granted"
        assert both[0]["query_count_remaining"] == both[1]["query_count_remaining"] + 1

        # refusals go the event loop's way, recorded and durable, never with the value
        for key in ("user.password", "no.such.key"):
            status, body = await read(app, agent, token, key)
            assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
            assert "hunter2" not in json.dumps(body)
        assert writer.batches_here == here + 1
        denied = [e for e in durable_events(app, sid) if e["action"] == "read" and not e["allowed"]]
        assert [e["key"] for e in denied] == ["user.password", "no.such.key"]


async def test_a_lone_read_whose_event_cannot_be_written_is_refused_and_counted(home: Paths) -> None:
    cfg = guard_config(db_busy_timeout_seconds=0.5, db_queue_timeout_seconds=4.0, **QUIET)
    async with appliance(home, guard_cfg=cfg) as app:
        svc = services(app)
        agent = app.agent("calendar_agent")
        g = await app.grant(agent)
        sid, token = g["session_id"], g["token"]
        assert (await read(app, agent, token, "preference.lang"))[0] == 200

        here = svc.audit.writer.batches_here
        with held_lock(home.audit_db):
            status, body = await read(app, agent, token, "preference.theme")
            assert status == 503 and body["error"]["code"] == "STORE_BUSY", body
            assert "dark" not in json.dumps(body)
        assert svc.audit.writer.batches_here == here + 1  # the worker tried it

        # writing again: the next read works, and the refused one is counted, not recorded as a decision
        status, body = await read(app, agent, token, "preference.theme")
        assert status == 200 and body["value"] == "dark"
        events = durable_events(app, sid)
        reads = [(e["key"], e["allowed"]) for e in events if e["action"] == "read"]
        assert reads == [("preference.lang", True), ("preference.theme", True)]
        gaps = [e for e in events if e["action"] == "audit_gap"]
        assert len(gaps) == 1 and "1 request(s)" in gaps[0]["reason"], events
        assert ledger_events(app.paths, action="read", key="preference.theme", allowed=True)


async def test_mixed_load_every_answer_has_exactly_one_event(home: Paths) -> None:
    """Lone reads (written by the worker) interleaved with bursts (the writer thread's group commit)
    and refusals, on one agent connection pool: every 200 has exactly one allowed event, every 403
    one refusal, no event twice, and the log verifies end to end."""
    async with appliance(home, guard_cfg=guard_config(**QUIET)) as app:
        svc = services(app)
        writer = svc.audit.writer
        agent = app.agent("calendar_agent")
        g = await app.grant(agent, limits={"max_read_queries": 10_000})
        sid, token = g["session_id"], g["token"]
        keys = ["preference.theme", "preference.lang", "user.password"]  # the last is out of scope
        statuses: list[tuple[str, int]] = []
        async with agent_session(agent, app.paths) as s:

            async def one(key: str) -> None:
                status, _body, _ = await agent_call(
                    s, app.base, f"/v1/memory/{key}", token=token, agent_id=agent.agent_id
                )
                statuses.append((key, status))

            here, written = writer.batches_here, writer.batches_written
            for round_ in range(12):
                for i in range(3):  # lone, one after another
                    await one(keys[(round_ + i) % 3])
                await asyncio.gather(*(one(keys[i % 3]) for i in range(9 + round_)))  # a burst
        by_worker = writer.batches_here - here
        by_thread = writer.batches_written - written - by_worker
        assert by_worker > 0 and by_thread > 0, (by_worker, by_thread)  # both ways were taken
        events = [e for e in durable_events(app, sid) if e["action"] == "read"]
        for key in keys:
            ok = sum(1 for k, st in statuses if k == key and st == 200)
            refused = sum(1 for k, st in statuses if k == key and st == 403)
            assert ok + refused == sum(1 for k, _ in statuses if k == key)  # nothing else answered
            assert sum(1 for e in events if e["key"] == key and e["allowed"]) == ok, key
            assert sum(1 for e in events if e["key"] == key and not e["allowed"]) == refused, key
        assert sum(1 for _k, st in statuses if st == 403) == sum(1 for k, _ in statuses if k == "user.password")
        assert len({e["id"] for e in events}) == len(events) == len(statuses)
        report = verify_ledger(app.paths)
        assert report.ok, report
