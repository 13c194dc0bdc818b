"""The appliance as a user runs it: ``uomp`` in a subprocess, real files, real sockets, signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from gatewaykit import ledger_events
from shortdir import short_dir

from gateway.bundle import load_bundle
from gateway.client.tls import build_client_context
from gateway.config import Paths

UOMP = [sys.executable, "-m", "gateway.cli.main"]

pytestmark = pytest.mark.timeout(90)


def run(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=60, check=check)


@pytest.fixture
def fresh_home(tmp_path: Path) -> Path:

    return short_dir("uomp-e2e-") / "home"


def test_help_tells_the_truth() -> None:
    out = subprocess.run([*UOMP, "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in (
        "init",
        "keys",
        "memory",
        "import",
        "guard",
        "sessions",
        "audit",
        "authorize",
        "ca",
        "agent",
        "gateway",
    ):
        assert re.search(rf"^\s+{cmd}\s", out, re.M), cmd
    gw = subprocess.run([*UOMP, "gateway", "start", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--listen" in gw and "--force-non-loopback" in gw


def test_init_is_private_and_idempotent(fresh_home: Path) -> None:
    first = run(fresh_home, "init").stdout
    assert "created" in first
    assert (fresh_home.stat().st_mode & 0o777) == 0o700
    for f in (".secrets/ed25519-private.jwk", ".secrets/admin-token", "ca/ca.key", "ca/gateway.key"):
        assert ((fresh_home / f).stat().st_mode & 0o777) == 0o600, f
    key_before = (fresh_home / ".secrets/ed25519-private.jwk").read_bytes()
    run(fresh_home, "init")
    assert (fresh_home / ".secrets/ed25519-private.jwk").read_bytes() == key_before
    # an unreadable key file is an error, never a silent new key
    (fresh_home / ".secrets/ed25519-private.jwk").write_text("{garbage")
    res = run(fresh_home, "init", check=False)
    assert res.returncode == 1 and "KEY_ERROR" in res.stderr
    assert (fresh_home / ".secrets/ed25519-private.jwk").read_text() == "{garbage"


async def test_appliance_end_to_end(fresh_home: Path, tmp_path: Path) -> None:
    run(fresh_home, "init")
    run(
        fresh_home,
        "memory",
        "add",
        "preference.theme",
        "--value",
        '"dark"',
        "--tag",
        "preference",
        "--sensitivity",
        "low",
    )
    proc = subprocess.Popen(
        [*UOMP, "--home", str(fresh_home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("gateway: "):
                break
        m = re.search(r"https://127\.0\.0\.1:(\d+)", line)
        assert m, line
        port = int(m.group(1))
        assert ((fresh_home / "guard.sock").stat().st_mode & 0o777) == 0o600
        agent_dir = tmp_path / "agent"
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
        bundle_path = tmp_path / "bundle.json"
        run(
            fresh_home,
            "authorize",
            str(agent_dir),
            "--yes",
            "--remote",
            "--gateway-url",
            f"https://localhost:{port}",
            "--out",
            str(tmp_path / "agentfiles"),
            "--bundle",
            str(bundle_path),
        )
        b = load_bundle(bundle_path)
        files = tmp_path / "agentfiles"
        ctx = build_client_context(files / "ca.crt", files / "agent.crt", files / "agent.key")
        headers = {"Authorization": f"Bearer {b.access_token}", "X-UOMP-Agent-Id": "calendar_agent"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
            async with s.get(f"https://localhost:{port}/v1/memory/preference.theme", headers=headers) as resp:
                assert resp.status == 200 and (await resp.json())["value"] == "dark"
            proc.send_signal(signal.SIGHUP)  # reload certificates, CRL and keys: still serving
            time.sleep(0.3)
            async with s.get(f"https://localhost:{port}/v1/memory/preference.theme", headers=headers) as resp:
                assert resp.status == 200
            # the user revokes from another terminal; the next request is refused
            run(fresh_home, "sessions", "revoke", b.session_id)
            async with s.get(f"https://localhost:{port}/v1/memory/preference.theme", headers=headers) as resp:
                assert resp.status == 401 and (await resp.json())["error"]["code"] == "SESSION_REVOKED"
        audit = run(fresh_home, "audit", "--session", b.session_id).stdout
        assert "ALLOW" in audit and "session_revoked" in audit
        assert b.access_token not in audit
        # the refusal after the revocation: one event in the one log, written by the guard (it checks
        # the session on every forwarded request), with the gateway's listener
        events = ledger_events(Paths(fresh_home), code="SESSION_REVOKED")
        assert len(events) == 1 and events[-1]["allowed"] is False and events[-1]["listener"] == "mtls"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not (fresh_home / "guard.sock").exists()
    assert b.access_token not in out + err


def test_public_bind_refused_without_force(fresh_home: Path) -> None:
    run(fresh_home, "init")
    res = run(fresh_home, "gateway", "start", "--listen", "0.0.0.0:0", "--no-local-port", check=False)
    assert res.returncode == 1 and "not loopback" in res.stderr
    assert not os.path.exists(fresh_home / "guard.sock")
