"""kill -9 of the gateway at every step of a payload upload: the payload and its one
``payload_uploaded`` event become visible together, and however the agent retries there is exactly
one event per payload.

Real processes: the guard serves in this test's event loop on its Unix socket; the gateway runs as
``uomp gateway serve`` in a subprocess with a test-only fault point armed (``UOMP_FAULT`` + an arm
file). A ``fault_hold`` point stops the gateway there and writes ``<arm>.held``; the test sees it and
sends SIGKILL. ``gateway_answer_payload_upload`` (gateway.durable.fault_point) kills itself after the
payload's event and row, before the answer leaves. The gateway is started again, the agent sends the
same upload again, and the store and the audit log must agree."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gatewaykit import Agent as KitAgent
from gatewaykit import agent_session
from guardkit import admin_headers, call, grant, guard_config, running_guard, seed, unix_session

from gateway import ca_store
from gateway.client import payloads as sdk_payloads
from gateway.config import Paths
from gateway.core import envelope, sealing
from gateway.payloads import userkey

pytestmark = pytest.mark.timeout(120)

UOMP = [sys.executable, "-m", "gateway.cli.main"]
BODY = 300_000  # sealed bytes: several write blocks, well under the default cap


def _events(paths: Paths, action: str) -> list[dict[str, Any]]:
    from gateway.ledger.query import MAX_LIMIT, AuditFilter, query_events

    conn = sqlite3.connect(paths.audit_db)
    try:
        return query_events(conn, AuditFilter(action=(action,), limit=MAX_LIMIT)).events
    finally:
        conn.close()


def _store(paths: Paths) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(index rows as (id, state), blob files, temporary files)."""
    root = paths.payload_dir
    conn = sqlite3.connect(root / "index.db")
    try:
        cols = {r[1] for r in conn.execute("PRAGMA table_info(payloads)")}
        state = "state" if "state" in cols else "'stored'"
        rows = sorted((r[0], r[1]) for r in conn.execute(f"SELECT payload_id, {state} FROM payloads"))
    finally:
        conn.close()
    return rows, sorted(p.name for p in (root / "blobs").iterdir()), sorted(p.name for p in (root / "tmp").iterdir())


async def _wait(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Gateway:
    """``uomp gateway serve`` in a subprocess, optionally with one fault point armed."""

    def __init__(self, paths: Paths, arm: Path) -> None:
        self.paths = paths
        self.arm = arm
        self.proc: asyncio.subprocess.Process | None = None
        with socket.socket() as s:  # one port for every start: the token's audience names it
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    async def start(self, fault: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("UOMP_FAULT", "UOMP_FAULT_ARM")}
        if fault:
            self.arm.write_text("armed")
            env.update(UOMP_FAULT=fault, UOMP_FAULT_ARM=str(self.arm))
        self.proc = await asyncio.create_subprocess_exec(
            *UOMP,
            "--home",
            str(self.paths.home),
            "gateway",
            "serve",
            "--listen",
            f"127.0.0.1:{self.port}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=env,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()
            if line.startswith("gateway: https://"):
                return
            if not line:
                break
        raise AssertionError("the gateway did not start")

    async def kill(self) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        assert self.proc.returncode == -signal.SIGKILL

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 30)
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()


@contextlib.asynccontextmanager
async def _setup(home: Paths, tmp_path: Path) -> AsyncIterator[tuple[Gateway, aiohttp.ClientSession, KitAgent]]:
    ca_store.init_all(home)
    seed(home)
    async with running_guard(home, guard_config(), serve_tcp=False), unix_session(home) as admin:
        gw = Gateway(home, tmp_path / "arm")
        try:
            yield (
                gw,
                admin,
                KitAgent("calendar_agent", ca_store.issue_with_key(home, "calendar_agent", home.home / "agent-files")),
            )
        finally:
            await gw.stop()


async def _grant(admin: aiohttp.ClientSession, home: Paths, agent: KitAgent, gw: Gateway) -> tuple[str, str]:
    g = await grant(
        admin,
        home,
        read={"tags": ["preference"], "keys": []},
        agent_id=agent.agent_id,
        profile="remote",
        audience=f"https://localhost:{gw.port}",
        cnf={"x5t#S256": agent.x5t, "jkt": agent.jkt},
    )
    return g["token"], g["session_id"]


def _sealed(home: Paths, sid: str, aid: str, pid: str | None = None) -> tuple[dict[str, Any], bytes]:
    """(the streaming header, the sealed bytes) of one payload."""
    pub = envelope.parse_public_key(userkey.public_b64(home))
    binding = sealing.Binding(pid or sdk_payloads.new_payload_id(), sid, aid, "application/octet-stream")
    doc = sdk_payloads.seal_small(pub, binding, os.urandom(BODY - 200))
    sealed = base64.b64decode(doc.pop("ciphertext"))
    return doc, sealed


async def _upload(
    gw: Gateway, agent: KitAgent, home: Paths, token: str, header: dict[str, Any], sealed: bytes
) -> tuple[int, Any]:
    hdrs = {
        "Authorization": f"Bearer {token}",
        "X-UOMP-Agent-Id": agent.agent_id,
        "Content-Type": "application/octet-stream",
        envelope.HEADER_NAME: base64.urlsafe_b64encode(json.dumps(header).encode()).rstrip(b"=").decode(),
    }
    async with (
        agent_session(agent, home) as session,
        session.post(f"https://localhost:{gw.port}/v1/payload/upload", data=sealed, headers=hdrs) as r,
    ):
        raw = await r.read()
        return r.status, json.loads(raw)


async def _listed(admin: aiohttp.ClientSession, home: Paths) -> list[str]:
    st, listed, _ = await call(admin, "GET", "/v1/payloads", headers=admin_headers(home))
    assert st == 200
    return [p["payload_id"] for p in listed["payloads"]]


# (fault point, held (a fault_hold point the test kills at) or self-kill, the payload kept after the
# crash, its removal recorded at start-up as a payload_refused)
POINTS = [
    pytest.param("payload_before_write", True, False, True, id="before-file-write"),
    pytest.param("payload_before_fsync", True, False, True, id="after-write-before-fsync-and-rename"),
    pytest.param("payload_after_rename", True, False, False, id="after-rename-before-row"),
    pytest.param("payload_pending", True, True, False, id="after-row-before-event"),
    pytest.param("payload_after_event", True, True, False, id="after-event-before-publish"),
    pytest.param("payload_before_answer", True, True, False, id="after-publish-before-answer"),
    pytest.param("gateway_answer_payload_upload", False, True, False, id="answer-ready-self-kill"),
]


@pytest.mark.parametrize(("point", "held", "kept", "refused"), POINTS)
async def test_kill_9_at_each_upload_step_gives_one_event_per_payload(
    home: Paths, tmp_path: Path, point: str, held: bool, kept: bool, refused: bool
) -> None:
    async with _setup(home, tmp_path) as (gw, admin, agent):
        token, sid = await _grant(admin, home, agent, gw)
        header, sealed = _sealed(home, sid, agent.agent_id)
        pid = header["payload_id"]
        await gw.start(point)
        task = asyncio.ensure_future(_upload(gw, agent, home, token, header, sealed))
        if held:
            marker = Path(str(gw.arm) + ".held")
            await _wait(marker.exists, f"the gateway to stop at {point}")
            assert gw.proc is not None and int(marker.read_text()) == gw.proc.pid
            await gw.kill()
            marker.unlink()
        else:
            await _wait(
                lambda: gw.proc is not None and gw.proc.returncode is not None, f"the gateway to die at {point}"
            )
            await gw.kill()
        with pytest.raises(aiohttp.ClientError):
            await task  # the agent got no answer
        # while the gateway is down: nothing visible without its event, no event without the payload
        visible = await _listed(admin, home)
        uploaded = [e["key"] for e in _events(home, "payload_uploaded")]
        assert visible in ([], [pid]) and len(uploaded) <= 1
        assert not visible or uploaded == [pid]  # visible only with its event

        await gw.start()  # start-up: leftovers removed, a pending payload settled
        if kept:
            await _wait(lambda: _store(home)[0] == [(pid, "stored")], "the pending payload to be settled")
        else:
            await _wait(lambda: _store(home) == ([], [], []), "the leftovers to be removed")
        assert (await _listed(admin, home)) == ([pid] if kept else [])
        assert [e["key"] for e in _events(home, "payload_uploaded")] == ([pid] if kept else [])
        # what the start-up removed is in the audit log: the upload, whose session and agent
        assert [(e["key"], e["session_id"], e["detail"]) for e in _events(home, "payload_refused")] == (
            [(pid, sid, "STORE_UNAVAILABLE")] if refused else []
        )

        # the agent sends the same upload again (twice): one payload, one payload_uploaded event
        for _ in range(2):
            st, answer = await _upload(gw, agent, home, token, header, sealed)
            assert st == 201, answer
            assert answer["payload_id"] == pid and answer["hash"] == "sha256:" + hashlib.sha256(sealed).hexdigest()
        assert await _listed(admin, home) == [pid]
        assert [e["key"] for e in _events(home, "payload_uploaded")] == [pid]
        rows, blobs, tmp = _store(home)
        assert rows == [(pid, "stored")] and blobs == [pid] and tmp == []
        # other bytes under the same id: refused with a stable code, and the stored payload unchanged
        other, other_sealed = _sealed(home, sid, agent.agent_id, pid)
        st, answer = await _upload(gw, agent, home, token, other, other_sealed)
        assert (st, answer["error"]["code"]) == (409, "PAYLOAD_EXISTS")
        assert (home.payload_dir / "blobs" / pid).read_bytes() == sealed
        assert [e["key"] for e in _events(home, "payload_uploaded")] == [pid]


async def _guard_process(home: Paths, env: dict[str, str]) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        *UOMP,
        "--home",
        str(home.home),
        "guard",
        "serve",
        "--no-tcp",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, aiohttp.ClientError):
            async with unix_session(home) as s:
                if (await call(s, "GET", "/v1/payloads", headers=admin_headers(home)))[0] == 200:
                    return proc
        assert proc.returncode is None, "the guard exited"
        await asyncio.sleep(0.1)
    raise AssertionError("the guard did not start")


async def test_guard_killed_after_the_event_before_its_answer(home: Paths, tmp_path: Path) -> None:
    """The guard dies with the payload's event durable and its answer unsent: the agent gets 503
    (not a refusal: no payload_refused), the gateway settles the pending payload once the guard is
    back, and the retry is the same payload with still one payload_uploaded."""
    ca_store.init_all(home)
    seed(home)
    arm = tmp_path / "guard-arm"
    arm.write_text("armed")
    base_env = {k: v for k, v in os.environ.items() if k not in ("UOMP_FAULT", "UOMP_FAULT_ARM")}
    guard = await _guard_process(
        home, {**base_env, "UOMP_FAULT": "payload_uploaded_recorded", "UOMP_FAULT_ARM": str(arm)}
    )
    gw = Gateway(home, tmp_path / "arm")
    try:
        await gw.start()
        agent = KitAgent("calendar_agent", ca_store.issue_with_key(home, "calendar_agent", home.home / "agent-files"))
        async with unix_session(home) as admin:
            token, sid = await _grant(admin, home, agent, gw)
        header, sealed = _sealed(home, sid, agent.agent_id)
        pid = header["payload_id"]
        task = asyncio.ensure_future(_upload(gw, agent, home, token, header, sealed))
        held = Path(str(arm) + ".held")
        await _wait(held.exists, "the guard to stop after recording the event")
        guard.send_signal(signal.SIGKILL)
        await guard.wait()
        st, answer = await task
        assert (st, answer["error"]["code"]) == (503, "STORE_UNAVAILABLE"), answer
        assert [e["key"] for e in _events(home, "payload_uploaded")] == [pid]
        assert _events(home, "payload_refused") == []
        assert _store(home)[0] == [(pid, "pending")]  # kept, invisible
        guard = await _guard_process(home, base_env)
        await _wait(lambda: _store(home)[0] == [(pid, "stored")], "the gateway to settle the payload")
        async with unix_session(home) as admin:
            assert await _listed(admin, home) == [pid]
        st, answer = await _upload(gw, agent, home, token, header, sealed)
        assert st == 201 and answer["payload_id"] == pid, answer
        assert [e["key"] for e in _events(home, "payload_uploaded")] == [pid]
        assert _events(home, "payload_refused") == []
    finally:
        await gw.stop()
        if guard.returncode is None:
            guard.terminate()
            await asyncio.wait_for(guard.wait(), 30)
