"""Test helpers: a real guard on a real Unix socket (and loopback TCP), seeded store, admin calls."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from gateway import keys
from gateway.config import GuardConfig, Paths
from gateway.guard.items import MemoryItem
from gateway.guard.server import GuardRunner
from gateway.guard.store import MemoryStore

NOW = "2026-07-12T10:00:00Z"

ITEMS = [
    MemoryItem("preference.theme", "dark", ("preference", "ui"), "low", "user", NOW, NOW, "UI theme"),
    MemoryItem("preference.lang", "en", ("preference",), "low", "user", NOW, NOW),
    MemoryItem("preference.secret_hobby", "lockpicking", ("preference", "private"), "low", "user", NOW, NOW),
    MemoryItem("user.display_name", "Alice", ("identity:public",), "medium", "user", NOW, NOW),
    MemoryItem("user.passport", "X1234567", ("identity", "preference"), "high", "user", NOW, NOW),
    MemoryItem("user.password", "hunter2", ("identity",), "high", "user", NOW, NOW),
    MemoryItem(
        "h.aapl", {"symbol": "AAPL", "market_value": 12000}, ("portfolio:holdings",), "medium", "user", NOW, NOW
    ),
    MemoryItem(
        "h.msft", {"symbol": "MSFT", "market_value": 20000}, ("portfolio:holdings",), "medium", "user", NOW, NOW
    ),
    MemoryItem("h.nvda", {"symbol": "NVDA", "market_value": 7000}, ("portfolio:holdings",), "medium", "user", NOW, NOW),
    MemoryItem("h.tiny", {"symbol": "TINY", "market_value": 5}, ("portfolio:tiny",), "medium", "user", NOW, NOW),
]


def seed(paths: Paths, items: list[MemoryItem] | None = None) -> None:
    store = MemoryStore(paths.memory_db)
    try:
        store.put_many(items if items is not None else ITEMS, replace=True)
    finally:
        store.close()


def guard_config(**overrides: Any) -> GuardConfig:
    # no background full verify of the audit log at each start (a process per guard start across the
    # suite): tests/ledger/test_audit_integrity.py runs it on real guard processes
    base = GuardConfig(tcp_port=0, audit_full_verify_at_start=False)
    return dataclasses.replace(base, **overrides)


@contextlib.asynccontextmanager
async def running_guard(
    paths: Paths, cfg: GuardConfig | None = None, *, serve_tcp: bool = True
) -> AsyncIterator[GuardRunner]:
    runner = GuardRunner(paths, cfg or guard_config(), serve_tcp=serve_tcp)
    await runner.start()
    try:
        yield runner
    finally:
        await runner.stop()


def unix_session(paths: Paths) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(paths.guard_sock)))


def admin_headers(paths: Paths) -> dict[str, str]:
    return {"Authorization": f"Bearer {keys.load_admin(paths)}"}


async def call(
    session: aiohttp.ClientSession,
    method: str,
    path: str,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    json_body: Any = None,
    base: str = "http://guard",
) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    async with session.request(method, base + path, headers=hdrs, json=json_body) as resp:
        text = await resp.text()
        try:
            body = await resp.json(content_type=None)
        except ValueError:
            body = text
        return resp.status, body, resp.headers


async def grant(
    session: aiohttp.ClientSession,
    paths: Paths,
    *,
    read: dict[str, Any],
    agent_id: str = "calendar_agent",
    requested: dict[str, Any] | None = None,
    duration_minutes: float = 30,
    create_extra: dict[str, Any] | None = None,
    **grant_extra: Any,
) -> dict[str, Any]:
    """Create + grant a session through the real management API; returns the grant answer."""
    body = {
        "agent_id": agent_id,
        "agent_name": "Test agent",
        "requested_scopes": requested or {"read": read},
        "duration_minutes": duration_minutes,
        **(create_extra or {}),
    }
    status, created, _ = await call(session, "POST", "/v1/sessions", headers=admin_headers(paths), json_body=body)
    assert status == 201, created
    status, granted, _ = await call(
        session,
        "POST",
        f"/v1/sessions/{created['session_id']}/grant",
        headers=admin_headers(paths),
        json_body={"granted_scopes": {"read": read}, **grant_extra},
    )
    assert status == 200, granted
    return dict(granted)


LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
conn.close()
"""


@contextlib.contextmanager
def held_lock(db: Path) -> Iterator[None]:
    """Another process holds ``BEGIN IMMEDIATE`` on ``db`` until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield
    finally:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write("\n")
            proc.stdin.close()
        proc.wait(30)
