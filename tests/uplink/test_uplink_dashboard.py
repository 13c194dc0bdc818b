"""The uplink on the dashboard's appliance page (server-rendered HTML): the home side's target,
since when it is connected, its last error, reconnects and when the CRL went to the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
from typing import Any

import aiohttp
import pytest
from uplinkkit import split

from gateway.config import DashboardConfig, Paths
from gateway.dashboard import security
from gateway.dashboard.server import Dashboard
from gateway.uplink.home import STATUS_FILE

pytestmark = pytest.mark.timeout(60)


async def _page(d: Dashboard, http: aiohttp.ClientSession, cookie: str) -> str:
    async with http.get(d.base_url + "/appliance", headers={"Cookie": f"{security.COOKIE_NAME}={cookie}"}) as r:
        assert r.status == 200
        return await r.text()


async def _login(d: Dashboard, http: aiohttp.ClientSession) -> str:
    async with http.get(d.login_link(), allow_redirects=False) as r:
        assert r.status == 303
        m = re.match(rf"{security.COOKIE_NAME}=([^;]+);", r.headers["Set-Cookie"])
        assert m
        return m.group(1)


def _uplink_row(html: str) -> str:
    m = re.search(r"<dt>Uplink</dt><dd>(.*?)</dd>", html, re.S)
    assert m, html
    return m.group(1)


async def _wait(pred: Any, what: str) -> None:
    for _ in range(500):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(what)


async def test_appliance_page_shows_the_uplink(home: Paths) -> None:
    status_file = home.uplink_dir / STATUS_FILE
    async with split(home, home_side=False) as s:
        d = Dashboard(home, DashboardConfig(port=0))
        await d.start()
        try:
            async with aiohttp.ClientSession() as http:
                cookie = await _login(d, http)
                row = _uplink_row(await _page(d, http, cookie))
                assert row.startswith("none") and "uomp guard uplink URL" in row  # never ran here
                side = s.home_side()
                task = asyncio.get_running_loop().create_task(side.run())
                try:
                    await s.wait_connected()
                    await _wait(lambda: side.trust is not None and side.trust.acked_at is not None, "CRL acked")
                    row = _uplink_row(await _page(d, http, cookie))
                    assert s.uplink_url in row and "connected since 20" in row and "0 reconnect(s)" in row
                    assert "CRL and keys pushed at 20" in row and "the gateway holds it" in row
                    assert "not connected" not in row and "not running" not in row
                    # the gateway goes away: not connected, dialling again, with the last error
                    hub = s.gateway.uplink
                    assert hub is not None and hub.link is not None
                    hub.link.goaway("the gateway is stopping <b>now</b>")
                    await _wait(lambda: side.failures > 0 or side.connects > 1, "the link dropped")
                    await _wait(lambda: json.loads(status_file.read_text()).get("last_error"), "status written")
                    row = _uplink_row(await _page(d, http, cookie))
                    assert "last error:" in row and "<b>" not in row  # escaped, never markup
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                row = _uplink_row(await _page(d, http, cookie))
                assert "home side not running" in row and s.uplink_url in row
                # a status left by a killed home side (its process is gone) reads as not running
                dead = subprocess.Popen(["true"])
                dead.wait()
                doc = json.loads(status_file.read_text())
                doc.update(running=True, connected=True, pid=dead.pid)
                status_file.write_text(json.dumps(doc))
                row = _uplink_row(await _page(d, http, cookie))
                assert "home side not running" in row and "connected since" not in row
                # an unreadable status file: no row content from it, the page still renders
                status_file.write_text("{not json")
                row = _uplink_row(await _page(d, http, cookie))
                assert row.startswith("none")
        finally:
            await d.stop()
