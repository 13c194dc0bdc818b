"""Another process holding a write lock on one of the guard's SQLite files.

A real second process (``python -c`` with the stdlib sqlite3) runs ``BEGIN IMMEDIATE`` on
``audit.db``, ``auth.db`` or ``memory.db`` and holds it, while agents go through the real gateway
(TLS 1.3 on 127.0.0.1) to the real guard (Unix socket); gateway and guard share this test's event
loop, so a wait for the lock on that loop would stall everything here too. Checked per database:

* the event loop stays responsive: while a request is stuck behind the lock, ``GET /v1/health`` on
  the guard is answered first (an ordering, not a timing);
* the codes: 503 STORE_BUSY where the locked database must be written (never a 500, never a 502),
  200 where it need not be (memory reads are unaffected by a lock on auth.db or memory.db; a lock
  on audit.db refuses them because each read's audit row cannot be made durable);
* everything recovers when the lock is released, and a refresh refused during the lock can be
  retried with the same refresh token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance
from guardkit import admin_headers, call, guard_config, held_lock

from gateway.config import Paths
from gateway.errors import UompError

pytestmark = pytest.mark.timeout(120)


async def read(app: Appliance, agent: Agent, token: str) -> tuple[int, Any]:
    async with agent_session(agent, app.paths) as s:
        status, body, _ = await agent_call(
            s, app.base, "/v1/memory/preference.theme", token=token, agent_id=agent.agent_id
        )
        return status, body


async def refresh(app: Appliance, agent: Agent, sid: str, rt: str) -> tuple[int, Any]:
    async with agent_session(agent, app.paths) as s:
        status, body, _ = await agent_call(
            s, app.base, f"/v1/sessions/{sid}/refresh", token=rt, agent_id=agent.agent_id, method="POST"
        )
        return status, body


async def create_session(app: Appliance) -> tuple[int, Any]:
    status, body, _ = await call(
        app.admin,
        "POST",
        "/v1/sessions",
        headers=admin_headers(app.paths),
        json_body={"agent_id": "another_agent", "requested_scopes": {"read": {"tags": ["preference"], "keys": []}}},
    )
    return status, body


def code(result: tuple[int, Any]) -> str | int:
    status, body = result
    if status < 400:
        return status
    assert isinstance(body, dict) and "error" in body, body  # the §8.4 shape, never a bare 500 page
    return f"{status} {body['error']['code']}"


BUSY = "503 STORE_BUSY"

# database locked -> (a memory read, a refresh, a write of the management API) while it is held
CASES = {
    "audit": (BUSY, BUSY, BUSY),  # every decision needs its durable audit row
    "auth": (200, BUSY, BUSY),  # reads within the quota block reserved before the lock need no write
    "memory": (200, 200, 201),  # the guard never writes memory.db; WAL readers do not wait for writers
}


@pytest.mark.parametrize("db", list(CASES))
async def test_a_database_locked_by_another_process(home: Paths, db: str) -> None:
    want_read, want_refresh, want_write = CASES[db]
    cfg = guard_config(db_busy_timeout_seconds=1.5, db_queue_timeout_seconds=4.0)
    async with appliance(home, guard_cfg=cfg) as app:
        agent = app.agent("calendar_agent")
        g = await app.grant(agent, refresh=True)
        sid, token, rt = g["session_id"], g["token"], g["refresh_token"]
        assert code(await read(app, agent, token)) == 200  # reserves a block of the read quota

        with held_lock(home.home / f"{db}.db"):
            # A request that has to wait for the lock (or, for memory.db, need not) ...
            slow = asyncio.ensure_future(create_session(app))
            await asyncio.sleep(0.05)
            # ... does not hold up the event loop: the guard answers its health check meanwhile.
            status, body, _ = await call(app.admin, "GET", "/v1/health")
            assert status == 200 and body == {"status": "ok"}
            if db != "memory":
                assert not slow.done(), "the health check waited for the locked database"

            reads = await asyncio.gather(*(read(app, agent, token) for _ in range(4)))
            assert [code(r) for r in reads] == [want_read] * 4
            refreshed = await refresh(app, agent, sid, rt)
            assert code(refreshed) == want_refresh
            assert code(await slow) == want_write

        # Released: everything works again, the refresh refused during the lock included.
        assert code(await read(app, agent, token)) == 200
        if want_refresh != 200:
            refreshed = await refresh(app, agent, sid, rt)
            assert code(refreshed) == 200, refreshed
        new_access = refreshed[1]["access_token"]
        assert code(await read(app, agent, new_access)) == 200
        assert code(await create_session(app)) == 201
        # the agent's audit read goes through the gateway (the guard's socket serves a remote token
        # only with the gateway's assertion)
        async with agent_session(agent, app.paths) as s:
            status, logs, _ = await agent_call(
                s, app.base, f"/v1/audit?session_id={sid}", token=new_access, agent_id=agent.agent_id
            )
        assert status == 200 and any(r["action"] == "read" and r["allowed"] for r in logs["logs"])


async def test_the_one_quota_counter_locked_through_the_gateway(home: Paths) -> None:
    """One quota counter: the guard's, in auth.db; the gateway keeps none. A read whose
    quota reservation meets a locked auth.db waits off both event loops (the gateway's /v1/health
    answers meanwhile), then gets 503 STORE_BUSY through the gateway; the next read recovers."""
    async with appliance(home) as app:
        agent = app.agent("calendar_agent")
        g = await app.grant(agent)
        with held_lock(home.auth_db):
            slow = asyncio.ensure_future(read(app, agent, g["token"]))  # the first read reserves a block
            await asyncio.sleep(0.05)
            async with agent_session(agent, app.paths) as s:
                status, body, _ = await agent_call(s, app.base, "/v1/health", token=None, agent_id=None)
            assert status == 200 and body == {"status": "ok"}
            assert not slow.done(), "the gateway's health check waited for the locked quota database"
            # the guard's first write of the read meets the lock (the token's first use is recorded
            # before the quota block; that write says STORE_UNAVAILABLE): a 503 either way, no hang
            assert code(await slow) in (BUSY, "503 STORE_UNAVAILABLE")
        assert code(await read(app, agent, g["token"])) == 200
        assert not (home.gateway_dir / "quota.db").exists()


async def test_a_call_queued_too_long_is_refused_without_running(tmp_path: Path) -> None:
    """The queue bound: while one call waits for a lock, calls queued past db_queue_timeout_seconds are
    refused (STORE_BUSY, reason QUEUE_TIMEOUT) and never touch the database; later calls run."""
    import sqlite3

    from gateway.db import DbWorker, connect, transaction
    from gateway.errors import UompError

    db = tmp_path / "x.db"
    conn = connect(db, schema="CREATE TABLE IF NOT EXISTS t (v INTEGER);", busy_timeout=1.0)
    worker = DbWorker("test", what="test database", queue_timeout=0.3)
    ran: list[str] = []

    def write(tag: str) -> None:
        ran.append(tag)
        with transaction(conn, what="test database"):
            conn.execute("INSERT INTO t VALUES (1)")

    try:
        with held_lock(db):
            first = asyncio.ensure_future(worker.run(write, "first"))  # waits the busy timeout, then fails
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(worker.run(write, "second"))  # queued behind it for > 0.3 s
            results = await asyncio.gather(first, second, return_exceptions=True)
        assert all(isinstance(r, UompError) and r.code == "STORE_BUSY" for r in results), results
        assert [r.details for r in results if isinstance(r, UompError)] == [
            {"reason": "SQLITE_BUSY"},
            {"reason": "QUEUE_TIMEOUT"},
        ]
        assert ran == ["first"]  # the second never ran
        await worker.run(write, "third")  # released: works again
        assert ran == ["first", "third"]
        with pytest.raises(UompError) as exc:  # any other SQLite failure is STORE_UNAVAILABLE, never a 500
            await worker.run(conn.execute, "SELECT * FROM no_such_table")
        assert exc.value.code == "STORE_UNAVAILABLE"
        assert isinstance(exc.value.__cause__, sqlite3.Error)
    finally:
        worker.close()
        conn.close()


async def test_token_validation_that_cannot_decide_is_not_a_verdict(home: Paths) -> None:
    """``POST /v1/tokens/validate`` for a superseded access token must revoke its session (a chain used
    by two holders), which needs a write. With auth.db locked by another process that write times out:
    the answer is 503 STORE_BUSY, never ``{"valid": false, "code": "STORE_BUSY"}``, which the gateway's
    status cache would keep, and pass on, as SESSION_REVOKED. The gateway passes the 503 on and caches
    nothing. Released: the verdict (REFRESH_REUSED), which revokes the session."""
    import time

    from gateway.core import tokens

    cfg = guard_config(db_busy_timeout_seconds=0.5, db_queue_timeout_seconds=4.0)
    async with appliance(home, guard_cfg=cfg) as app:
        agent = app.agent("calendar_agent")
        g = await app.grant(agent, refresh=True)
        sid, rt = g["session_id"], g["refresh_token"]
        first = await refresh(app, agent, sid, rt)  # its pair is never used ...
        again = await refresh(app, agent, sid, rt)  # ... so the retry supersedes it
        assert code(first) == code(again) == 200
        superseded = first[1]["access_token"]

        async def validate(token: str) -> tuple[int, Any]:
            status, body, _ = await call(app.admin, "POST", "/v1/tokens/validate", json_body={"token": token})
            return status, body

        state = app.gateway.state
        assert state is not None
        cap = tokens.verify_token(superseded, state.public_keys, now=time.time())
        with held_lock(home.auth_db):
            assert code(await validate(superseded)) == BUSY
            with pytest.raises(UompError) as exc:
                await state.status.check(superseded, cap)
            assert exc.value.code == "STORE_BUSY"
        assert state.status._cache == {}  # type: ignore[attr-defined]  # nothing was kept as an answer
        status, body = await validate(superseded)
        assert status == 200 and body["valid"] is False and body["code"] == "REFRESH_REUSED"
        with pytest.raises(UompError) as exc:  # that verdict revoked the session: refused from now on
            await state.status.check(superseded, cap)
        assert exc.value.code == "SESSION_REVOKED"
