"""A full disk fails closed with a clear error, nothing queues
up one by one while full, writing resumes as soon as the next small batch fits, and every event says
what the client actually got. First with an injected write hook (ENOSPC), then, as root, with a real
small tmpfs filling up."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance, ledger_events, verify_ledger
from shortdir import short_dir

from gateway.config import Paths
from gateway.remote import access_log as al

pytestmark = pytest.mark.timeout(120)


def events(paths: Paths) -> list[dict[str, Any]]:
    """The one log: the guard's ledger."""
    return ledger_events(paths)


async def read(s: aiohttp.ClientSession, app: Appliance, a: Agent, token: str | None) -> tuple[int, Any]:
    st, body, _ = await agent_call(s, app.base, "/v1/memory/preference.theme", token=token, agent_id=a.agent_id)
    return st, body


def audit_reads(paths: Paths, sid: str) -> list[tuple[int, str]]:
    import sqlite3

    from gateway.ledger.query import MAX_LIMIT, AuditFilter, query_events

    db = sqlite3.connect(paths.audit_db)
    try:
        page = query_events(db, AuditFilter(session_id=sid, action=("read",), limit=MAX_LIMIT))
        return [(int(e["allowed"]), e["action"]) for e in page.events]
    finally:
        db.close()


async def test_enospc_on_the_spool_is_off_the_request_path(home: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    full = {"on": False, "attempts": 0}
    real = al._pwrite_all

    def hook(fd: int, data: bytes, offset: int) -> None:
        if full["on"]:
            full["attempts"] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(al, "_pwrite_all", hook)
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        access = app.gateway.state.access
        async with agent_session(a, home) as s:
            assert (await read(s, app, a, g["token"]))[0] == 200
            ok_before = len(events(home))
            full["on"] = True
            # One log: access.jsonl is only the spool for a guard outage. With the guard
            # up, a full gateway disk is not on any request's path: answers and events as usual.
            for i in range(10):
                st, body = await read(s, app, a, g["token"] if i % 2 == 0 else "not-a-token")
                assert st == (200 if i % 2 == 0 else 401), body
            assert full["attempts"] == 0 and access.pending == 0 and access.lost.total == 0
            full["on"] = False
        evs = events(home)[ok_before:]
        assert [e.get("code") for e in evs] == [None, "INVALID_TOKEN"] * 5
        assert all(e["listener"] == "mtls" for e in evs)
        assert verify_ledger(home).ok


async def test_unauthenticated_refusals_are_rate_limited_and_summarised(home: Paths) -> None:
    async with appliance(
        home,
        access_log_unauth_burst=5,
        access_log_unauth_events_per_second=0.001,
        access_log_summary_interval_seconds=0.0,
    ) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        async with agent_session(a, home) as s:
            for _ in range(50):
                st, body = await read(s, app, a, "garbage")
                assert st == 401 and body["error"]["code"] == "INVALID_TOKEN"  # the client gets its answer
            assert (await read(s, app, a, g["token"]))[0] == 200  # authenticated: always logged
        await app.gateway.state.events.close()  # delivers the pending summary
        evs = events(home)
        refusals = [e for e in evs if e.get("code") == "INVALID_TOKEN"]
        summaries = [e for e in evs if e["action"] == "gateway_events_suppressed"]
        assert len(refusals) == 5
        assert sum(e["count"] for e in summaries) == 45
        assert all(k.endswith(" INVALID_TOKEN") for e in summaries for k in e["by"])
        assert any(e["action"] == "read" and e.get("session_id") == g["session_id"] for e in evs)
        assert verify_ledger(home).ok


# ---------------------------------------------------------------------- a real small filesystem


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], capture_output=True, check=False
    )
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(where: Path) -> Path:
    """Fill the filesystem to the last byte."""
    filler = where / "filler"
    for chunk in (65536, 4096, 1):
        try:
            with open(filler, "ab") as fh:
                while True:
                    fh.write(b"\0" * chunk)
                    fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


async def test_real_full_filesystem_under_the_access_log(home: Paths) -> None:
    with tmpfs(home.gateway_dir, "4m") as gw_dir:
        async with appliance(home) as app:
            a = app.agent("agent_a")
            g = await app.grant(a)
            async with agent_session(a, home) as s:
                assert (await read(s, app, a, g["token"]))[0] == 200
                filler = fill(gw_dir)
                # One log: with the guard up, the gateway writes nothing of its own on a
                # request's path (access.jsonl is the outage spool): a full gateway disk refuses nothing.
                answers = [await read(s, app, a, g["token"]) for _ in range(20)]
                assert {st for st, _ in answers} == {200}, answers
                assert app.gateway.state.access.pending == 0
                filler.unlink()
                st, body = await read(s, app, a, g["token"])
                assert st == 200, body
        evs = events(home)
        assert sum(1 for e in evs if e["action"] == "read" and e["allowed"]) == 2 + len(answers)
        assert verify_ledger(home).ok


async def test_real_full_filesystem_under_the_guard_databases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit.db (and auth.db) on a full filesystem: the agent gets 503 STORE_UNAVAILABLE, not 500,
    and reads work again once space returns."""
    import shutil

    from gateway.keys import init_home

    base = short_dir("uomp-fs-")  # short: Unix socket path limit
    with tmpfs(base / "h", "24m") as root:
        home = Paths(root)
        init_home(home)
        monkeypatch.setenv("UOMP_HOME", str(root))
        async with appliance(home) as app:
            a = app.agent("agent_a")
            g = await app.grant(a)
            async with agent_session(a, home) as s:
                assert (await read(s, app, a, g["token"]))[0] == 200
                filler = fill(root)
                for _ in range(5):
                    st, body = await read(s, app, a, g["token"])
                    assert st == 503 and body["error"]["code"] == "STORE_UNAVAILABLE", body
                filler.unlink()
                st, body = await read(s, app, a, g["token"])
                assert st == 200, body
                st, body, _ = await agent_call(
                    s, app.base, f"/v1/audit?session_id={g['session_id']}", token=g["token"], agent_id=a.agent_id
                )
                assert st == 200
                gaps = [r for r in body["logs"] if r["action"] == "audit_gap"]
                assert gaps and "503" in gaps[0]["reason"], body["logs"]
    shutil.rmtree(base, ignore_errors=True)
