"""The README's walkthrough runs as written.

The ```` ```sh walkthrough ```` blocks of README.md are joined, in order, and run by bash with
``-euo pipefail`` in a temporary directory (``examples`` linked from this checkout), with only
these changes: the ports 9443 and 9374 become free ones (in the commands, and for the appliance
through ``UOMP_GATEWAY_LISTEN_PORT`` / ``UOMP_GUARD_TCP_PORT``; the README says so), ``.venv/bin`` is on
PATH as ``source .venv/bin/activate`` would put it, and ``tests/fake_cloudflared.py`` is where a checkout
has it (no ``cloudflared`` on PATH: the README's own fallback picks the stand-in). Any failing command
fails the test, with the script's output."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from shortdir import short_dir

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

pytestmark = pytest.mark.timeout(300)


def walkthrough_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh walkthrough\n(.*?)^```$", text, re.M | re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readme_has_a_walkthrough() -> None:
    blocks = walkthrough_blocks(README.read_text())
    script = "\n".join(blocks)
    assert len(blocks) >= 6
    for needed in (
        "uomp init",
        "uomp import examples/holdings.csv --map ticker=key",
        "uomp gateway start",
        "uomp authorize",
        "curl",
        "remote_agent.py",
        "c.refresh()",
        "uomp sessions revoke",
        "uomp audit",
        "?tag=",
        "aggregate",
        "--tunnel quick",
        "--dpop",
        "uomp gateway stop",
    ):
        assert needed in script, needed
    assert (ROOT / "examples" / "holdings.csv").is_file()


def test_walkthrough_runs_as_written() -> None:
    script = "\n".join(walkthrough_blocks(README.read_text()))
    gw, local = free_port(), free_port()
    script = script.replace("9443", str(gw)).replace("9374", str(local))
    work = short_dir("uomp-rd-")
    (work / "examples").symlink_to(ROOT / "examples")
    venv = work / ".venv"
    venv.mkdir()
    (venv / "bin").symlink_to(Path(sys.executable).parent)  # `source .venv/bin/activate` works as written
    if not (venv / "bin" / "activate").exists():
        pytest.skip("no virtualenv activate script next to this python")
    (work / "tests").mkdir()
    (work / "tests" / "fake_cloudflared.py").symlink_to(ROOT / "tests" / "fake_cloudflared.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UOMP_", "VIRTUAL_ENV"))}
    if shutil.which("cloudflared", path=env.get("PATH")):
        pytest.skip("a real cloudflared is on PATH: the walkthrough would try to reach Cloudflare")
    env["PYTHONPATH"] = str(ROOT)  # the SDK examples import gateway from this checkout
    env["UOMP_GATEWAY_LISTEN_PORT"] = str(gw)  # the same free ports for the commands that do not name them
    env["UOMP_GUARD_TCP_PORT"] = str(local)
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError("the walkthrough did not finish:\n" + out) from None
    finally:
        # never leave an appliance behind, whatever happened
        subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli.main",
                "--home",
                str(work / "demo-home"),
                "gateway",
                "stop",
                "--timeout",
                "30",
            ],
            capture_output=True,
            env=env,
            timeout=60,
        )
    log = (work / "gateway.log").read_text() if (work / "gateway.log").exists() else ""
    assert proc.returncode == 0, f"walkthrough failed ({proc.returncode}):\n{out}\n--- gateway.log:\n{log}"
    # what the walkthrough says happens, happened
    assert '"value": "dark"' in out or '"value":"dark"' in out  # curl read the key
    assert '{"key": "preference.theme", "value": "dark"}' in out  # the SDK example read it
    assert "AAPL" in out and '"op":"count"' in out.replace(" ", "")  # ?tag= and the aggregate
    assert "AGGREGATE_MIXED_CURRENCY" in out  # the sum over USD, CHF and EUR amounts is refused
    assert "SESSION_REVOKED" in out  # the revoked session was refused
    # the tunnel part read through the stand-in's origin (DPoP), after the mTLS reads
    assert out.count('{"key": "preference.theme", "value": "dark"}') >= 2, out
    assert "Traceback" not in out and "Traceback" not in log
    assert not (work / "demo-home" / "guard.sock").exists()


def test_the_walkthrough_wait_stops_when_the_appliance_dies() -> None:
    """The port held by something else (an appliance from `scripts/run.sh`, say): `uomp gateway start`
    exits with PORT_IN_USE, and the first block's wait ends at once with the end of gateway.log,
    instead of asking `uomp status` until its bound (each try costs a process start)."""
    first = walkthrough_blocks(README.read_text())[0]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        gw = int(holder.getsockname()[1])
        script = first.replace("9443", str(gw)).replace("9374", str(free_port()))
        work = short_dir("uomp-rd-")
        (work / "examples").symlink_to(ROOT / "examples")
        (work / ".venv").mkdir()
        (work / ".venv" / "bin").symlink_to(Path(sys.executable).parent)
        if not (work / ".venv" / "bin" / "activate").exists():
            pytest.skip("no virtualenv activate script next to this python")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UOMP_", "VIRTUAL_ENV"))}
        env["PYTHONPATH"] = str(ROOT)
        env["UOMP_GATEWAY_LISTEN_PORT"] = str(gw)
        env["UOMP_DASHBOARD_ENABLED"] = "0"
        # bounded well below the 60 s the wait allows a live appliance plus a try per half second
        res = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
    assert res.returncode != 0
    assert "not ready; the end of gateway.log:" in res.stderr and "PORT_IN_USE" in res.stderr, res.stderr
