"""The VPS topology through the CLI, every part a real process: at home `uomp guard serve` and
`uomp guard uplink URL`, on the "VPS" (its own data directory from `uomp uplink init`)
`uomp gateway start --uplink-listen`; an agent reads over mTLS, the home side is killed and comes back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gatewaykit import Agent, agent_call, agent_session
from guardkit import grant, seed, unix_session
from portkit import free_port
from shortdir import short_dir
from uplinkkit import ROOT

from gateway import ca_store
from gateway.config import Paths

pytestmark = pytest.mark.timeout(90)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UOMP_")}
    env.update(UOMP_HOME=str(home), PYTHONPATH=str(ROOT), UOMP_GUARD_TCP_PORT=str(free_port()))
    env["UOMP_DASHBOARD_PORT"] = str(free_port())
    return env


def uomp(home: Path, *args: str, **kw: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli.main", *args],
        env=_env(home),
        cwd=str(ROOT),
        stdout=kw.pop("stdout", subprocess.DEVNULL),
        stderr=kw.pop("stderr", subprocess.DEVNULL),
        **kw,
    )


def run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli.main", *args],
        env=_env(home),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )


async def until_status(vps: Path, pred: Any, what: str) -> dict[str, Any]:
    """Poll the gateway's own status file (what `uomp status` reads) until ``pred`` holds."""
    f = Paths(vps).gateway_status
    for _ in range(1200):
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            s = None
        if s is not None and pred(s):
            return dict(s)
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached: {what}")


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def test_vps_gateway_and_home_guard_as_processes(home: Paths) -> None:
    ca_store.init_all(home)
    seed(home)
    vps = short_dir("uomp-vps-") / "home"
    made = run(home.home, "uplink", "init", "--vps-host", "localhost", "--out", str(vps))
    assert made.returncode == 0, made.stderr
    assert "home pin" in made.stdout
    # what the VPS holds: its TLS identities and public material, nothing else
    held = sorted(str(p.relative_to(vps)) for p in vps.rglob("*") if p.is_file())
    assert held == [
        ".secrets/jwks.json",
        "ca/ca.crt",
        "ca/crl.pem",
        "ca/gateway.crt",
        "ca/gateway.key",
        "uplink/pins.json",
        "uplink/server.crt",
        "uplink/server.key",
        "uplink/uplink-ca.crt",
    ], held
    for secret in ("ca/gateway.key", "uplink/server.key", "uplink/pins.json"):
        assert (vps / secret).stat().st_mode & 0o077 == 0
    # denied partner: the VPS directory cannot go inside the home it was made from
    from gateway.cli.main import main

    assert (
        main(["--home", str(home.home), "uplink", "init", "--vps-host", "localhost", "--out", str(home.home / "v")])
        == 1
    )
    assert not (home.home / "v").exists()

    port, uplink_port = free_port(), free_port()
    guard = uomp(home.home, "guard", "serve", "--no-tcp")
    gw = uomp(vps, "gateway", "start", "--listen", f"127.0.0.1:{port}", "--uplink-listen", f"127.0.0.1:{uplink_port}")
    side = None
    try:
        await until_status(vps, lambda s: s["running"] and s["upstream"]["up"] is False, "the VPS gateway runs")
        for _ in range(200):
            if home.guard_sock.exists():
                break
            await asyncio.sleep(0.05)
        side = uomp(home.home, "guard", "uplink", f"https://localhost:{uplink_port}")
        await until_status(vps, lambda s: s["upstream"]["up"] and s["uplink"]["connected"], "uplink up")
        s = json.loads(run(vps, "status", "--json").stdout)
        assert s["listeners"]["uplink"] == f"https://127.0.0.1:{uplink_port}" and "guard_socket" not in s["listeners"]
        assert s["uplink"]["connects"] == 1 and s["healthy"] and s["guard"]["reachable"]

        agent = Agent("calendar_agent", ca_store.issue_with_key(home, "calendar_agent", home.home / "agent"))
        base = f"https://localhost:{port}"
        async with unix_session(home) as admin:
            g = await grant(
                admin,
                home,
                read={"tags": ["preference"], "keys": []},
                profile="remote",
                audience=base,
                cnf={"x5t#S256": agent.x5t, "jkt": agent.jkt},
            )
        async with agent_session(agent, home) as sess:
            status, body, _ = await agent_call(
                sess, base, "/v1/memory/preference.theme", token=g["token"], agent_id=agent.agent_id
            )
            assert status == 200 and body["value"] == "dark"
            side.send_signal(signal.SIGKILL)
            side.wait(10)
            await until_status(vps, lambda s: not s["uplink"]["connected"], "uplink down")
            status, body, hdrs = await agent_call(
                sess, base, "/v1/memory/preference.theme", token=g["token"], agent_id=agent.agent_id
            )
            assert status == 503 and body["error"]["code"] == "STORE_UNAVAILABLE" and "Retry-After" in hdrs
            side = uomp(home.home, "guard", "uplink", f"https://localhost:{uplink_port}")
            await until_status(vps, lambda s: s["upstream"]["up"] and s["uplink"]["connected"], "uplink back")
            status, body, _ = await agent_call(
                sess, base, "/v1/memory/preference.theme", token=g["token"], agent_id=agent.agent_id
            )
            assert status == 200 and body["value"] == "dark"
        human = run(vps, "status")
        assert "uplink: home side connected" in human.stdout and "VPS gateway data directory" in human.stdout
    finally:
        for p in (side, gw, guard):
            if p is not None:
                stop(p)
    # the VPS never held a memory value, a signing key or a CA key, at rest
    assert not (vps / "memory.db").exists() and not (vps / ".secrets/ed25519-private.jwk").exists()
    assert not (vps / "ca/ca.key").exists()
