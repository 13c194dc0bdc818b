"""``uomp run AGENT_DIR [flags] -- COMMAND...``: a local agent started with its token in its
environment (UOM_TOKEN, UOMP_BASE_URL, UOMP_SESSION_ID), never on a command line; its session
closes when it exits. Real processes: a guard serving the Local Profile on TCP, ``uomp run`` as a
subprocess, the agent as its child (whose /proc/PID/cmdline the test reads)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from guardkit import running_guard, seed

from gateway.cli.main import main
from gateway.config import Paths

UOMP = [sys.executable, "-m", "gateway.cli.main"]
CALENDAR = Path(__file__).parents[2] / "examples" / "calendar_agent"

pytestmark = pytest.mark.timeout(120)

AGENT = textwrap.dedent(
    """
    import json, os, sys, urllib.request
    req = urllib.request.Request(
        os.environ["UOMP_BASE_URL"] + "/v1/memory/preference.theme",
        headers={"Authorization": "Bearer " + os.environ["UOM_TOKEN"]},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        print(json.dumps({"pid": os.getpid(), "value": json.load(r)["value"],
                          "session": os.environ["UOMP_SESSION_ID"]}), flush=True)
    sys.stdin.readline()
    sys.exit(7)
    """
)


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _read(base: str, token: str) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(base + "/v1/memory/preference.theme", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _config(home: Paths, port: int) -> None:
    (home.home / "config.toml").write_text(f"[guard]\ntcp_port = {port}\n")


async def test_run_puts_the_token_in_the_environment_only(home: Paths, tmp_path: Path) -> None:
    seed(home)
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    async with running_guard(home) as g:
        assert g.tcp_port is not None
        _config(home, g.tcp_port)
        # the guard answers on this event loop: the processes are driven from a thread
        await asyncio.to_thread(_drive, home, script, f"http://127.0.0.1:{g.tcp_port}")


def _drive(home: Paths, script: Path, base: str) -> None:
    run = subprocess.Popen(
        [*UOMP, "--home", str(home.home), "run", str(CALENDAR), "--yes", "--allow-local", "--",
         sys.executable, str(script), "--flag-for-the-agent"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert run.stdout is not None and run.stdin is not None
    line = ""
    for _ in range(60):  # the panel, then "Session ...", then the agent's own line
        line = run.stdout.readline()
        if line.startswith("{") or not line:
            break
    assert line.startswith("{"), run.communicate(timeout=30)
    seen = json.loads(line)
    assert seen["value"] == "dark"
    child = int(seen["pid"])
    environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
    [token] = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"UOM_TOKEN=")]
    assert token.count(b".") == 2
    # the token is in the agent's environment, on no command line: neither the agent's nor ours
    assert token not in _cmdline(child) and b"--flag-for-the-agent" in _cmdline(child)
    assert token not in _cmdline(run.pid) and b"run" in _cmdline(run.pid)
    run.stdin.write("\n")
    run.stdin.flush()
    out, err = run.communicate(timeout=60)
    assert run.returncode == 7, out + err  # the agent's exit status
    assert token.decode() not in out + err + line
    assert f"session {seen['session']} closed" in out
    # the session ended with the agent: its token stops working
    status, body = _read(base, token.decode())
    assert status == 401, body
    shown = subprocess.run(
        [*UOMP, "--home", str(home.home), "sessions", "show", seen["session"]], capture_output=True, text=True
    )
    assert json.loads(shown.stdout)["status"] == "closed"


async def _run(home: Paths, *args: str) -> subprocess.CompletedProcess[str]:
    """``uomp run`` refused: in this process (no agent is started), off the loop the guard answers on."""

    def call() -> subprocess.CompletedProcess[str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["--home", str(home.home), "run", *args])
        return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())

    return await asyncio.to_thread(call)


async def test_run_refusals_start_nothing(home: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seed(home)
    marker = tmp_path / "started"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    async with running_guard(home) as g:
        assert g.tcp_port is not None
        _config(home, g.tcp_port)
        no_cmd = await _run(home, str(CALENDAR), "--yes", "--allow-local")
        assert no_cmd.returncode == 1 and "after --" in no_cmd.stderr
        remote_only = await _run(home, str(CALENDAR), "--yes", "--", *cmd)
        assert remote_only.returncode == 1 and "requires_remote" in remote_only.stderr
        wider = await _run(home, str(CALENDAR), "--yes", "--allow-local", "--tag", "identity", "--", *cmd)
        assert wider.returncode == 1 and "add --widen" in wider.stderr
        monkeypatch.setenv("UOMP_TRUST_REQUIRE", "did:key")  # [trust] require: this publisher is unverified
        policy = await _run(home, str(CALENDAR), "--yes", "--allow-local", "--", *cmd)
        assert policy.returncode == 1 and "error ACCESS_DENIED" in policy.stderr and "no session" in policy.stderr
        monkeypatch.delenv("UOMP_TRUST_REQUIRE")
        assert not marker.exists()
        missing = await _run(home, str(CALENDAR), "--yes", "--allow-local", "--", str(tmp_path / "no-such-agent"))
        assert missing.returncode == 1 and "cannot start" in missing.stderr
    # the guard is gone: refused before any session is made, with what to do
    dead = await _run(home, str(CALENDAR), "--yes", "--allow-local", "--", *cmd)
    assert dead.returncode == 1 and "STORE_UNAVAILABLE" in dead.stderr and "uomp gateway start" in dead.stderr
    assert not marker.exists()


SCOPES = textwrap.dedent(
    """
    import base64, json, os, sys
    body = os.environ["UOM_TOKEN"].split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    open(sys.argv[1], "w").write(json.dumps(claims["scopes"].get("write") or {}))
    """
)


async def test_run_grants_the_write_scope_only_with_grant_writes(home: Paths, tmp_path: Path) -> None:
    seed(home)
    doc = json.loads((CALENDAR / "uom.json").read_text())
    doc["requested_scopes"]["write"] = {"tags": ["preference"], "keys": []}
    agent_dir = tmp_path / "writer"
    agent_dir.mkdir()
    (agent_dir / "uom.json").write_text(json.dumps(doc))
    script = tmp_path / "scopes.py"
    script.write_text(SCOPES)
    async with running_guard(home) as g:
        assert g.tcp_port is not None
        _config(home, g.tcp_port)
        seen = {}
        for flag in ((), ("--grant-writes",)):
            out = tmp_path / f"write{len(flag)}.json"
            cmd = [*UOMP, "--home", str(home.home), "run", str(agent_dir), "--yes", "--allow-local", *flag, "--",
                   sys.executable, str(script), str(out)]  # fmt: skip
            done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            seen[flag] = json.loads(out.read_text())
    assert not seen[()].get("tags") and not seen[()].get("keys")
    assert seen[("--grant-writes",)]["tags"] == ["preference"]
