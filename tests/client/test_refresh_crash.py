"""A crash during a refresh must not revoke a working agent.

The appliance runs as the user runs it (``uomp gateway start`` in a subprocess: the gateway and
its supervised guard child); a fault hook (``UOMP_FAULT`` + an arm file, gateway.durable.fault_point)
kills the gateway or the guard with SIGKILL right after the rotation committed and before the
answer reached the agent. The agent retries long after (the spent record is aged far past the old
10 s grace) and keeps working; the rotation's audit row is not lost."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from shortdir import short_dir

from gateway.client import ClientOptions, Unavailable, UompClient
from gateway.ledger.query import MAX_LIMIT, AuditFilter, query_events

UOMP = [sys.executable, "-m", "gateway.cli.main"]

pytestmark = pytest.mark.timeout(180)


def run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=90, check=True)


@dataclass
class Appliance:
    home: Path
    arm: Path
    port: int = 0
    proc: subprocess.Popen[str] | None = None

    def start(self, fault: str | None = None) -> None:
        env = dict(os.environ)
        env.pop("UOMP_FAULT", None)
        if fault:
            env["UOMP_FAULT"] = fault
            env["UOMP_FAULT_ARM"] = str(self.arm)
        self.proc = subprocess.Popen(
            [
                *UOMP,
                "--home",
                str(self.home),
                "gateway",
                "start",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--no-local-port",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            m = re.search(r"https://127\.0\.0\.1:(\d+)", line) if line.startswith("gateway: ") else None
            if m:
                self.port = int(m.group(1))
                return
            if not line and self.proc.poll() is not None:
                break
        raise AssertionError("the appliance did not start")

    def wait_dead(self) -> None:
        assert self.proc is not None
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def appliance(tmp_path: Path) -> Iterator[Appliance]:
    home = short_dir("uomp-crash-") / "home"
    run(home, "init")
    run(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    app = Appliance(home, tmp_path / "fault.arm")
    try:
        yield app
    finally:
        app.stop()


def authorize(app: Appliance, tmp: Path) -> Path:
    agent_dir = tmp / "agent"
    agent_dir.mkdir()
    (agent_dir / "uom.json").write_text(
        json.dumps(
            {
                "uomp_version": "1.0",
                "agent": {"id": "calendar_agent", "name": "Calendar", "version": "1.0.0"},
                "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
                "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
            }
        )
    )
    bundle = tmp / "bundle.json"
    run(
        app.home,
        "authorize",
        str(agent_dir),
        "--yes",
        "--remote",
        "--gateway-url",
        f"https://localhost:{app.port}",
        "--out",
        str(tmp / "agentfiles"),
        "--bundle",
        str(bundle),
    )
    return bundle


def age_spends(home: Path) -> int:
    """The retry comes an hour after the spend: far past the old 10 s reuse grace."""
    db = sqlite3.connect(home / "auth.db")
    try:
        n = db.execute("UPDATE refresh_tokens SET spent_at = spent_at - 3600 WHERE status='spent'").rowcount
        db.commit()
        return n
    finally:
        db.close()


def audit_refresh_rows(home: Path, sid: str) -> list[str]:
    db = sqlite3.connect(home / "audit.db")
    try:
        page = query_events(db, AuditFilter(session_id=sid, action=("refresh",), allowed=True, limit=MAX_LIMIT))
        return [e["reason"] for e in page.events]
    finally:
        db.close()


def session_status(app: Appliance, sid: str) -> str:
    out = run(app.home, "sessions", "list", "--json").stdout
    return str(next(r["status"] for r in json.loads(out) if r["session_id"] == sid))


ONE_TRY = ClientOptions(refresh_retry_attempts=1)


async def test_gateway_killed_after_the_rotation_committed(appliance: Appliance, tmp_path: Path) -> None:
    appliance.start(fault="gateway_answer_refresh")
    bundle = authorize(appliance, tmp_path)
    async with UompClient.from_bundle(bundle, options=ONE_TRY) as c:
        assert (await c.get("preference.theme"))["value"] == "dark"
        sid = c.session_id
        appliance.arm.touch()
        with pytest.raises(Unavailable) as exc:
            await c.refresh()  # the gateway dies between the guard's commit and its answer
        # what happened, not a certificate refusal
        assert exc.value.code == "CONNECTION_CLOSED", exc.value
        assert exc.value.code != "TLS_HANDSHAKE_FAILED"
    appliance.wait_dead()
    assert not appliance.arm.exists()  # the fault fired
    assert age_spends(appliance.home) == 1  # the rotation had committed: the token is spent
    appliance.start()  # the user (or systemd) starts it again, on the same port
    async with UompClient.from_bundle(bundle, options=ONE_TRY) as c:
        await c.refresh()  # the spent token, retried long after: its successor was never used
        assert c.refresh_count == 1
        assert (await c.get("preference.theme"))["value"] == "dark"
        await c.refresh()  # and the chain goes on
        assert (await c.get("preference.theme"))["value"] == "dark"
    assert session_status(appliance, sid) == "active"
    assert len(audit_refresh_rows(appliance.home, sid)) == 3  # the killed rotation's row too


async def test_guard_killed_after_the_rotation_committed(appliance: Appliance, tmp_path: Path) -> None:
    appliance.start(fault="refresh_committed")
    bundle = authorize(appliance, tmp_path)
    async with UompClient.from_bundle(bundle, options=ONE_TRY) as c:
        assert (await c.get("preference.theme"))["value"] == "dark"
        sid = c.session_id
        appliance.arm.touch()
        with pytest.raises(Unavailable) as exc:
            await c.refresh()  # the guard dies right after committing, before its audit row and answer
        assert exc.value.status in (502, 503, 504), exc.value
    assert not appliance.arm.exists()
    assert age_spends(appliance.home) == 1
    # the supervisor restarts the guard; the agent, with the SDK's default retries, keeps working
    async with UompClient.from_bundle(bundle) as c:
        await c.refresh()
        assert (await c.get("preference.theme"))["value"] == "dark"
    assert session_status(appliance, sid) == "active"
    rows = audit_refresh_rows(appliance.home, sid)
    assert rows[0] == "refresh token rotated"  # replayed from auth.db's outbox after the crash
    assert len(rows) == 2


async def test_fork_after_a_crash_is_still_reuse(appliance: Appliance, tmp_path: Path) -> None:
    """The crash-retry rule does not reopen the fork: once the agent used its new pair, the old
    refresh token (say, from a copy of the bundle taken before) revokes the session, and the
    messages say why."""
    appliance.start()
    bundle = authorize(appliance, tmp_path)
    copy = tmp_path / "copy.json"
    copy.write_bytes(bundle.read_bytes())
    copy.chmod(0o600)
    async with UompClient.from_bundle(bundle, options=ONE_TRY) as c:
        await c.refresh()
        assert (await c.get("preference.theme"))["value"] == "dark"
        sid = c.session_id
    async with UompClient.from_bundle(copy, options=ONE_TRY) as thief:
        with pytest.raises(Exception) as exc:
            await thief.refresh()
    assert getattr(exc.value, "code", None) == "REFRESH_REUSED"
    assert "spent refresh token was presented again" in str(exc.value)
    assert session_status(appliance, sid) == "revoked"
    out = json.loads(run(appliance.home, "sessions", "show", sid).stdout)
    assert "possibly a copy of the bundle" in out["status_reason"]
    table = run(appliance.home, "sessions", "list").stdout
    line = next(x for x in table.splitlines() if x.startswith(sid))
    assert " revoked " in line and "spent refresh token was presented again" in line
