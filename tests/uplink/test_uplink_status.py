"""``uomp status`` at home shows the home side of the uplink (``uplink/home-status.json``), as the
dashboard does: the VPS dialled, connected since when, reconnects, failed dials, the last error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys

import pytest
from uplinkkit import ROOT, split

from gateway.config import Paths
from gateway.uplink.home import STATUS_FILE

pytestmark = pytest.mark.timeout(60)


def _status(home: Paths) -> tuple[str, dict]:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UOMP_")}
    env.update(UOMP_HOME=str(home.home), PYTHONPATH=str(ROOT))
    out = []
    for extra in ([], ["--json"]):
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.cli.main", "status", *extra],
            env=env,
            cwd=str(ROOT),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode in (0, 1, 3), proc.stderr
        out.append(proc.stdout)
    return out[0], json.loads(out[1])


def _line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("uplink to ")]
    assert len(lines) == 1, text
    return lines[0]


async def test_status_at_home_shows_the_uplink(home: Paths) -> None:
    status_file = home.uplink_dir / STATUS_FILE
    async with split(home, home_side=False) as s:
        text, doc = await asyncio.to_thread(_status, home)
        assert doc["home_uplink"] is None and "uplink to " not in text  # this home never ran one
        side = s.home_side()
        task = asyncio.get_running_loop().create_task(side.run())
        try:
            await s.wait_connected()
            text, doc = await asyncio.to_thread(_status, home)
            line = _line(text)
            assert line.startswith(f"uplink to {s.uplink_url}: connected since 20"), line
            assert "0 reconnect(s), 0 failed dial(s)" in line and "last error" not in line
            assert doc["home_uplink"]["connected"] is True and doc["home_uplink"]["target"] == s.uplink_url
            # the gateway sends it away: it redials; the reconnect and the last error show
            hub = s.gateway.uplink
            assert hub is not None and hub.link is not None
            hub.link.goaway("the gateway is stopping for a test")
            for _ in range(500):
                if side.connects > 1 and side.link is not None:
                    break
                await asyncio.sleep(0.02)
            side.write_status()
            line = _line((await asyncio.to_thread(_status, home))[0])
            assert "1 reconnect(s)" in line and "last error: the peer ended the connection" in line, line
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # stopped: not running, with the command that starts it
        line = _line((await asyncio.to_thread(_status, home))[0])
        assert "home side NOT RUNNING" in line and f"uomp guard uplink {s.uplink_url}" in line, line
        # a status left by a killed home side (its process is gone) reads as not running, not connected
        dead = subprocess.Popen(["true"])
        dead.wait()
        doc = json.loads(status_file.read_text())
        doc.update(running=True, connected=True, pid=dead.pid)
        status_file.write_text(json.dumps(doc))
        line = _line((await asyncio.to_thread(_status, home))[0])
        assert "NOT RUNNING" in line and "connected since" not in line
