"""The dashboard in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
installed by scripts/setup-browser.sh, driven by Selenium; nothing is downloaded at run time).

One browser and one appliance for the module (the appliance of tests/gatewaykit.py: real guard on
its Unix socket, gateway with real TLS 1.3 and an mTLS agent, plus the dashboard on 127.0.0.1),
run on an event loop in a background thread so the synchronous WebDriver can drive the pages.

Without /usr/bin/chromium these tests FAIL under CI (CI=true runs scripts/setup-browser.sh first,
so a missing browser is a broken setup) and are skipped only on a developer machine without it.

Screenshots of every page land in the test's temporary output directory; with
UOMP_SCREENSHOTS=DIR they are also copied there (docs/screenshots/ holds a reviewed set).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance
from guardkit import guard_config
from shortdir import short_dir

from gateway.cli.main import main as uomp
from gateway.client import payloads as sdk_payloads
from gateway.config import DashboardConfig, Paths
from gateway.core import envelope, sealing
from gateway.dashboard.server import Dashboard
from gateway.keys import init_home
from gateway.payloads import userkey

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SECRET = b"MARKER-browser-plaintext-9e1d: the board minutes\n"
T = TypeVar("T")

pytestmark = pytest.mark.timeout(120)


def _need_browser() -> None:
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    why = f"{CHROMIUM} or {CHROMEDRIVER} is missing (bash scripts/setup-browser.sh installs them)"
    if os.environ.get("CI"):
        pytest.fail(why + "; CI runs setup-browser.sh, so this is a broken setup")
    pytest.skip(why + "; skipped only because CI is unset")


class World:
    """The appliance and the dashboard, on their own event loop in a thread."""

    def __init__(self) -> None:
        self.paths = Paths(short_dir("uomp-"))
        init_home(self.paths)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dashboard-world", daemon=True)
        self.thread.start()
        self._stack = contextlib.AsyncExitStack()
        self.app: Appliance = self.run(
            self._stack.enter_async_context(
                appliance(self.paths, guard_cfg=guard_config(audit_checkpoint_events=1), status_cache_seconds=0)
            )
        )
        self.dash = Dashboard(self.paths, DashboardConfig(port=0))
        self.run(self.dash.start())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def close(self) -> None:
        try:
            self.run(self.dash.stop())
            self.run(self._stack.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            shutil.rmtree(self.paths.home, ignore_errors=True)

    def grant(self, agent_id: str) -> tuple[Agent, dict[str, Any]]:
        agent = self.app.agent(agent_id)
        return agent, self.run(self.app.grant(agent, read={"tags": ["preference"], "keys": []}))

    def agent_get(self, agent: Agent, token: str, path: str) -> tuple[int, Any]:
        async def go() -> tuple[int, Any]:
            async with agent_session(agent, self.paths) as s:
                status, body, _ = await agent_call(s, self.app.base, path, token=token, agent_id=agent.agent_id)
                return status, body

        return self.run(go())

    def agent_post(self, agent: Agent, token: str, path: str, body: Any) -> tuple[int, Any]:
        async def go() -> tuple[int, Any]:
            async with agent_session(agent, self.paths) as s:
                status, answer, _ = await agent_call(
                    s, self.app.base, path, token=token, agent_id=agent.agent_id, method="POST", json_body=body
                )
                return status, answer

        return self.run(go())


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    _need_browser()
    w = World()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def driver(world: World, downloads: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="uomp-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ):
        opts.add_argument(flag)
    opts.add_experimental_option(
        "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
    )
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Selenium Manager must not look for (or download) a driver: the system one is given
    d = webdriver.Chrome(options=opts, service=Service(executable_path=str(CHROMEDRIVER)))
    d.set_page_load_timeout(30)
    d.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    try:
        yield d
    finally:
        d.quit()
        shutil.rmtree(profile, ignore_errors=True)


def shot(driver: Any, shots: Path, name: str) -> None:
    """A full-page screenshot (the window grown to the page's height)."""
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    width = int(driver.execute_script("return window.innerWidth")) or 1280
    driver.set_window_size(width, min(max(height + 120, 600), 1000))
    driver.save_screenshot(str(shots / f"{name}.png"))
    driver.set_window_size(1280, 900)
    out = os.environ.get("UOMP_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(shots / f"{name}.png", Path(out) / f"{name}.png")


def no_csp_violations(driver: Any) -> None:
    """The strict CSP never had to block anything on our own pages (no inline script or style)."""
    problems = [
        e["message"]
        for e in driver.get_log("browser")
        if "Content Security Policy" in e["message"]  # a blocked inline script/style, a foreign asset
        or (e.get("level") == "SEVERE" and "Failed to load resource" not in e["message"])
    ]  # a JS error
    assert not problems, problems


def wait_file(directory: Path, suffix: str, deadline_s: float = 20.0) -> Path:
    """The downloaded file once Chromium has finished writing it.

    Chromium may create the final name before the bytes are in it, so a file counts as done only when no
    partial download is left in the directory and its size held still across two polls.
    """
    end = time.monotonic() + deadline_s
    seen: dict[Path, int] = {}
    while time.monotonic() < end:
        names = list(directory.iterdir())
        partial = any(p.name.endswith((".crdownload", ".tmp")) for p in names)
        for p in names:
            if not p.name.endswith(suffix) or partial:
                continue
            size = p.stat().st_size
            if size > 0 and seen.get(p) == size:
                return p
            seen[p] = size
        time.sleep(0.1)
    raise AssertionError(
        f"no complete *{suffix} downloaded into {directory}: {sorted(p.name for p in directory.iterdir())}"
    )


@pytest.fixture(scope="module")
def signed_in(world: World, driver: Any, shots: Path) -> str:
    """Log in with a one-time link; return it (spent)."""
    driver.get(world.dash.base_url + "/")
    assert "Sign in" in driver.title and "uomp dashboard" in driver.page_source
    shot(driver, shots, "00-sign-in")
    link = world.dash.login_link()
    driver.get(link)
    assert driver.current_url == world.dash.base_url + "/"  # the 303 took the token out of the address bar
    assert "Overview" in driver.title
    return link


def test_login_link_works_once(world: World, driver: Any, signed_in: str, shots: Path) -> None:
    cookies = driver.get_cookies()
    assert len(cookies) == 1 and cookies[0]["httpOnly"] and cookies[0]["sameSite"] == "Strict"
    driver.get(signed_in)  # the same link again
    assert "This link does not work" in driver.page_source
    shot(driver, shots, "01-link-used-twice")
    driver.get(world.dash.base_url + "/sessions")  # the session it opened is unaffected
    assert "Sessions" in driver.title
    assert driver.execute_script("return document.cookie") == ""  # HttpOnly: no script sees it
    no_csp_violations(driver)


def test_revoke_from_the_page_and_the_agent_is_refused(world: World, driver: Any, signed_in: str, shots: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    agent, g = world.grant("calendar_agent")
    sid = g["session_id"]
    assert world.agent_get(agent, g["token"], "/v1/memory/preference.theme")[0] == 200
    driver.get(world.dash.base_url + "/sessions")
    row = driver.find_element(By.ID, f"s-{sid}")
    assert "may read memories tagged preference" in row.text and "active" in row.text
    shot(driver, shots, "02-sessions")
    button = row.find_element(By.CSS_SELECTOR, f'form[action="/sessions/{sid}/revoke"] button')
    button.click()
    alert = WebDriverWait(driver, 10).until(ec.alert_is_present())  # the JS confirmation
    assert sid in alert.text
    alert.dismiss()  # cancelled: nothing happens
    assert world.agent_get(agent, g["token"], "/v1/memory/preference.theme")[0] == 200
    driver.find_element(By.CSS_SELECTOR, f'#s-{sid} form[action="/sessions/{sid}/revoke"] button').click()
    WebDriverWait(driver, 10).until(ec.alert_is_present()).accept()
    WebDriverWait(driver, 10).until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, ".flash"), "revoked"))
    assert f"Session {sid} revoked." in driver.page_source
    status, body = world.agent_get(agent, g["token"], "/v1/memory/preference.theme")
    assert status == 401 and body["error"]["code"] == "SESSION_REVOKED"
    shot(driver, shots, "03-sessions-after-revoke")
    driver.get(world.dash.base_url + "/audit?agent=calendar_agent&verdict=refused")  # that refusal, explained
    assert "The session had been revoked or closed, so the agent may no longer read." in driver.page_source
    driver.set_window_size(390, 844)  # a phone
    driver.get(world.dash.base_url + "/sessions")
    driver.save_screenshot(str(shots / "04-sessions-phone.png"))
    overflow = driver.execute_script("return document.documentElement.scrollWidth > window.innerWidth + 1")
    driver.set_window_size(1280, 900)
    assert not overflow  # tables scroll inside their box; the page itself fits the phone
    if os.environ.get("UOMP_SCREENSHOTS"):
        shutil.copy(shots / "04-sessions-phone.png", Path(os.environ["UOMP_SCREENSHOTS"]) / "04-sessions-phone.png")
    no_csp_violations(driver)


def test_refusal_in_the_timeline_and_its_proof_verifies(
    world: World, driver: Any, signed_in: str, shots: Path, downloads: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    agent, g = world.grant("mail_agent")
    assert world.agent_get(agent, g["token"], "/v1/memory/preference.lang")[0] == 200
    assert world.agent_get(agent, g["token"], "/v1/memory/h.msft")[0] == 403
    driver.get(world.dash.base_url + "/audit")
    Select(driver.find_element(By.NAME, "agent")).select_by_value("mail_agent")  # JS applies it at once
    Select(driver.find_element(By.NAME, "verdict")).select_by_value("refused")
    assert "verdict=refused" in driver.current_url and "agent=mail_agent" in driver.current_url
    items = driver.find_elements(By.CSS_SELECTOR, "ol.timeline li")
    assert items and all("REFUSED" in i.text for i in items)
    first = items[0]
    assert "The agent asked for a memory outside what you granted." in first.text and "h.msft" in first.text
    assert "in a signed checkpoint" in first.text
    shot(driver, shots, "05-audit-refusals")
    driver.get(world.dash.base_url + "/audit")
    shot(driver, shots, "06-audit-timeline")
    driver.get(world.dash.base_url + "/audit?agent=mail_agent&verdict=refused")
    driver.find_element(By.CSS_SELECTOR, "ol.timeline li a.proof").click()
    proof = wait_file(downloads, ".json")
    bundle = json.loads(proof.read_text())
    assert bundle["event"]["agent_id"] == "mail_agent" and bundle["event"]["allowed"] is False
    capsys.readouterr()
    root = logging.getLogger()
    handlers = root.handlers[:]
    try:
        assert uomp(["--home", str(world.paths.home), "audit", "verify-proof", str(proof)]) == 0
    finally:
        root.handlers[:] = handlers
    assert "proof OK" in capsys.readouterr().out
    no_csp_violations(driver)


def test_pull_a_payload_and_see_agents_and_appliance(
    world: World, driver: Any, signed_in: str, shots: Path, downloads: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    agent, g = world.grant("report_agent")
    pub = envelope.parse_public_key(userkey.public_b64(world.paths))
    doc = sdk_payloads.seal_small(
        pub, sealing.Binding(sdk_payloads.new_payload_id(), g["session_id"], agent.agent_id, "text/plain"), SECRET
    )
    status, body = world.agent_post(agent, g["token"], "/v1/payload/upload", doc)
    assert status in (200, 201), body
    pid = doc["payload_id"]
    driver.get(world.dash.base_url + "/payloads")
    assert pid in driver.page_source and "report_agent" in driver.page_source
    shot(driver, shots, "07-payloads")
    driver.find_element(By.CSS_SELECTOR, f'form[action="/payloads/{pid}/open"] button').click()
    got = wait_file(downloads, f"{pid}.txt")
    assert got.read_bytes() == SECRET
    for p in world.paths.home.rglob("*"):  # nothing decrypted was stored by the appliance
        if p.is_file():
            assert SECRET not in p.read_bytes(), p
    driver.get(world.dash.base_url + "/agents")
    assert "report_agent" in driver.page_source and "active" in driver.page_source
    shot(driver, shots, "08-agents")
    driver.get(world.dash.base_url + "/appliance")
    assert "Anchoring" in driver.page_source and world.dash.base_url in driver.page_source
    shot(driver, shots, "09-appliance")
    driver.get(world.dash.base_url + "/")
    WebDriverWait(driver, 10).until(ec.presence_of_element_located((By.CSS_SELECTOR, "svg.chart")))
    assert "mail_agent" in driver.page_source
    shot(driver, shots, "10-overview")
    no_csp_violations(driver)


def test_approve_one_proposal_and_reject_another(world: World, driver: Any, signed_in: str, shots: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    scopes = {"read": {"tags": ["preference"], "keys": []}, "write": {"tags": ["preference"], "keys": []}}
    agent = world.app.agent("writer_agent")
    g = world.run(world.app.grant(agent, requested=scopes, granted_scopes=scopes))

    def put(key: str, value: Any) -> str:
        async def go() -> str:
            async with agent_session(agent, world.paths) as s:
                status, body, _ = await agent_call(
                    s, world.app.base, f"/v1/memory/{key}", token=g["token"], agent_id=agent.agent_id, method="PUT",
                    json_body={"value": value},
                )  # fmt: skip
                assert status == 202, body
                return str(body["proposal_id"])

        return world.run(go())

    keep, drop = put("preference.theme", "solarized"), put("preference.lang", "fr")
    driver.get(world.dash.base_url + "/proposals")
    card = driver.find_element(By.ID, f"p-{keep}")
    assert '"solarized"' in card.text and '"dark"' in card.text  # the change, now and proposed
    shot(driver, shots, "11-proposals")
    card.find_element(By.CSS_SELECTOR, f'form[action="/proposals/{keep}/approve"] button').click()
    WebDriverWait(driver, 10).until(ec.alert_is_present()).dismiss()  # cancelled: nothing applied
    assert world.agent_get(agent, g["token"], "/v1/memory/preference.theme")[1]["value"] == "dark"
    driver.find_element(By.CSS_SELECTOR, f'form[action="/proposals/{keep}/approve"] button').click()
    WebDriverWait(driver, 10).until(ec.alert_is_present()).accept()
    WebDriverWait(driver, 10).until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, ".flash"), "approved"))
    driver.find_element(By.CSS_SELECTOR, f'form[action="/proposals/{drop}/reject"] button').click()
    WebDriverWait(driver, 10).until(ec.alert_is_present()).accept()
    WebDriverWait(driver, 10).until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, ".flash"), "rejected"))
    shot(driver, shots, "12-proposals-decided")
    assert world.agent_get(agent, g["token"], "/v1/memory/preference.theme")[1]["value"] == "solarized"
    assert world.agent_get(agent, g["token"], "/v1/memory/preference.lang")[1]["value"] == "en"
    _, own = world.agent_get(agent, g["token"], "/v1/proposals")
    assert {p["proposal_id"]: p["status"] for p in own["proposals"]} == {keep: "approved", drop: "rejected"}
    no_csp_violations(driver)
