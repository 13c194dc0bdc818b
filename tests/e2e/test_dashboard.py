"""The local dashboard's security and behaviour, against a real server on 127.0.0.1.

The dashboard runs in-process on a real loopback socket next to the real appliance of
tests/gatewaykit.py (guard on its Unix socket, gateway with real TLS 1.3 and mTLS agents). Each
accepted case has refused partners: no cookie, a stale or made-up cookie, a spent or expired login
link, a forged Host, a cross-site POST (no token, wrong token, foreign Origin, Sec-Fetch-Site),
a non-loopback peer. Browser-driven tests are in test_dashboard_browser.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from anchorkit import ANVIL, ANVIL_MISSING, Anvil
from gatewaykit import Appliance, agent_call, agent_session, appliance
from guardkit import guard_config
from shortdir import short_dir

from gateway import appliance as appliance_state
from gateway import httpd, keys
from gateway.cli.main import main as uomp
from gateway.client import payloads as sdk_payloads
from gateway.config import DashboardConfig, Paths, load_section
from gateway.core import envelope, sealing
from gateway.dashboard import security
from gateway.dashboard.answers import HEADERS, MAX_FORM_BYTES
from gateway.dashboard.server import Dashboard
from gateway.errors import UompError
from gateway.payloads import userkey

pytestmark = pytest.mark.timeout(90)

SECRET = b"MARKER-dashboard-plaintext-51c2 quarterly numbers\n"


@pytest.fixture(autouse=True)
def _keep_root_logging() -> Any:
    """`uomp ...` run in-process installs its own stderr handler (the captured one): put back the root's."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


class Clock:
    def __init__(self) -> None:
        self.now = 1_900_000_000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def dashboard(paths: Paths, *, clock: Callable[[], float] | None = None, **cfg: Any) -> AsyncIterator[Dashboard]:
    d = Dashboard(paths, DashboardConfig(port=0, **cfg), **({"clock": clock} if clock else {}))
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


@pytest.fixture
async def app(home: Paths) -> AsyncIterator[Appliance]:
    # one signed checkpoint per event: every event's proof state is known without waiting
    async with appliance(home, guard_cfg=guard_config(audit_checkpoint_events=1), status_cache_seconds=0) as a:
        yield a


class Browser:
    """A minimal client: keeps the dashboard cookie itself (aiohttp's jar ignores IP hosts)."""

    def __init__(self, http: aiohttp.ClientSession, d: Dashboard) -> None:
        self.http = http
        self.d = d
        self.cookie: str | None = None

    async def get(self, path: str, **kw: Any) -> tuple[int, str, Any]:
        return await self.request("GET", path, **kw)

    async def request(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, data: Any = None
    ) -> tuple[int, str, Any]:
        hdrs = dict(headers or {})
        if self.cookie is not None:
            hdrs.setdefault("Cookie", f"{security.COOKIE_NAME}={self.cookie}")
        async with self.http.request(
            method, self.d.base_url + path, headers=hdrs, data=data, allow_redirects=False
        ) as r:
            return r.status, await r.text(errors="replace"), r.headers

    async def login(self) -> str:
        link = self.d.login_link()
        status, _, hdrs = await self.get(link.removeprefix(self.d.base_url))
        assert status == 303 and hdrs["Location"] == "/"
        m = re.match(rf"{security.COOKIE_NAME}=([^;]+);", hdrs["Set-Cookie"])
        assert m
        self.cookie = m.group(1)
        return link

    async def csrf(self, path: str = "/sessions") -> str:
        status, html, _ = await self.get(path)
        assert status == 200, html
        m = re.search(r'name="csrf" value="([^"]+)"', html)
        assert m
        return m.group(1)


@contextlib.asynccontextmanager
async def browser(d: Dashboard) -> AsyncIterator[Browser]:
    async with aiohttp.ClientSession() as http:
        yield Browser(http, d)


def raw_request(port: int, request: bytes, *, source: str | None = None, target: str = "127.0.0.1") -> bytes:
    with socket.create_connection((target, port), timeout=10, source_address=(source, 0) if source else None) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


# ----------------------------------------------------------------------------- the gate


async def test_login_link_once_then_cookie_then_refused_without_it(app: Appliance) -> None:
    async with dashboard(app.paths) as d, browser(d) as b:
        for path in ("/", "/sessions", "/audit", "/agents", "/payloads", "/appliance"):
            status, html, _ = await b.get(path)
            assert status == 401 and "uomp dashboard" in html, path  # no cookie: the sign-in page
        status, html, _ = await b.get("/login?t=" + "A" * 43)
        assert status == 403 and "works once" in html  # a made-up token
        link = await b.login()
        status, _, hdrs = await b.get(link.removeprefix(d.base_url))
        cookie_line = hdrs.get("Set-Cookie", "")
        assert status == 403 and not cookie_line  # the same link twice: refused, no cookie
        status, html, _ = await b.get("/")
        assert status == 200 and "Overview" in html
        # the cookie the link set: HttpOnly, SameSite=Strict, Path=/
        fresh = Browser(b.http, d)
        _, _, hdrs = await fresh.get(d.login_link().removeprefix(d.base_url))
        attrs = {a.strip().lower() for a in hdrs["Set-Cookie"].split(";")[1:]}
        assert {"httponly", "samesite=strict", "path=/"} <= attrs
        # signing out ends the server-side session
        token = await b.csrf()
        status, _, _ = await b.request("POST", "/logout", data={"csrf": token})
        assert status == 303
        status, _, _ = await b.get("/")
        assert status == 401


async def test_stale_or_made_up_cookie_and_expired_link_refused(app: Appliance) -> None:
    clock = Clock()
    async with (
        dashboard(app.paths, clock=clock, idle_timeout_seconds=60, max_session_seconds=600, login_ttl_seconds=30) as d,
        browser(d) as b,
    ):
        await b.login()
        assert (await b.get("/sessions"))[0] == 200
        clock.now += 59
        assert (await b.get("/sessions"))[0] == 200  # used within the idle timeout: still good
        clock.now += 61
        status, html, _ = await b.get("/sessions")
        assert status == 401 and "has ended" in html  # idle too long
        b.cookie = None
        await b.login()
        for _ in range(10):  # kept busy, it still ends at the absolute limit
            clock.now += 55
            assert (await b.get("/"))[0] == 200
        clock.now += 55
        assert (await b.get("/"))[0] == 401
        b.cookie = "not-a-session-" + "x" * 30
        assert (await b.get("/"))[0] == 401
        link = d.login_link()
        clock.now += 31
        b.cookie = None
        status, _, hdrs = await b.get(link.removeprefix(d.base_url))
        assert status == 403 and "Set-Cookie" not in hdrs  # expired link


async def test_forged_host_refused_before_anything(app: Appliance) -> None:
    async with dashboard(app.paths) as d, browser(d) as b:
        link = d.login_link()
        path = link.removeprefix(d.base_url)
        for host in (
            "evil.example",
            f"evil.example:{d.port}",
            f"127.0.0.1:{d.port + 1}",
            "127.0.0.1",
            f"attacker.test.127.0.0.1.nip.io:{d.port}",
        ):
            raw = await asyncio.to_thread(
                raw_request, d.port, f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            )
            assert raw.startswith(b"HTTP/1.1 421"), (host, raw[:80])
            assert b"Content-Security-Policy" in raw
        # a rebinding attempt did not spend the link: the real host name still works, once
        status, _, _ = await b.get(path, headers={"Host": f"localhost:{d.port}"})
        assert status == 303
        b.cookie = None
        await b.login()
        status, _, _ = await b.get("/", headers={"Host": f"evil.example:{d.port}"})
        assert status == 421  # with a good cookie too


async def test_cross_site_posts_refused_and_same_site_post_revokes(app: Appliance) -> None:
    agent = app.agent("calendar_agent")
    g = await app.grant(agent)
    sid = g["session_id"]
    async with dashboard(app.paths) as d, browser(d) as b:
        await b.login()
        token = await b.csrf()
        form = {"confirmed": "yes"}
        refused: list[tuple[dict[str, str], dict[str, str]]] = [
            ({}, form),  # no token
            ({}, {**form, "csrf": "wrong" + token[5:]}),  # a wrong token
            ({}, {**form, "csrf": ""}),
            ({"Origin": "http://evil.example"}, {**form, "csrf": token}),  # right token, foreign origin
            ({"Origin": "null"}, {**form, "csrf": token}),
            ({"Sec-Fetch-Site": "cross-site"}, {**form, "csrf": token}),
            ({"Sec-Fetch-Site": "same-site"}, {**form, "csrf": token}),
            ({"Sec-Fetch-Site": "none"}, {**form, "csrf": token}),
            ({"Sec-Fetch-Site": "same-origin", "Origin": "http://evil.example"}, {**form, "csrf": token}),
        ]
        for headers, data in refused:
            status, html, _ = await b.request("POST", f"/sessions/{sid}/revoke", headers=headers, data=data)
            assert status == 403 and "Refused" in html, (headers, data)
        status, html, _ = await b.get("/sessions")
        assert "active" in html
        rc = await asyncio.to_thread(_session_status, app.paths, sid)
        assert rc == "active"
        # without a cookie a POST with a good token is refused too (the token belongs to a session)
        anon = Browser(b.http, d)
        assert (await anon.request("POST", f"/sessions/{sid}/revoke", data={**form, "csrf": token}))[0] == 401
        # our own form: without confirmation a confirm page, then the revocation
        # (what Chromium sends from our page under Referrer-Policy: no-referrer: Origin null, same-origin)
        status, html, _ = await b.request(
            "POST",
            f"/sessions/{sid}/revoke",
            data={"csrf": token, "confirmed": "no"},
            headers={"Origin": "null", "Sec-Fetch-Site": "same-origin"},
        )
        assert status == 200 and f"Revoke session {sid}?" in html and 'value="yes"' in html
        assert await asyncio.to_thread(_session_status, app.paths, sid) == "active"
        status, _, hdrs = await b.request(
            "POST",
            f"/sessions/{sid}/revoke",
            data={"csrf": token, "confirmed": "yes"},
            headers={"Origin": f"http://127.0.0.1:{d.port}"},
        )
        assert status == 303 and hdrs["Location"] == "/sessions"
        assert await asyncio.to_thread(_session_status, app.paths, sid) == "revoked"
        status, html, _ = await b.get("/sessions")
        assert f"Session {sid} revoked." in html  # said once
        assert f"Session {sid} revoked." not in (await b.get("/sessions"))[1]
    # the agent's next request is refused
    async with agent_session(agent, app.paths) as s:
        status, body, _ = await agent_call(
            s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=agent.agent_id
        )
        assert status == 401 and body["error"]["code"] == "SESSION_REVOKED"


async def test_an_oversized_form_and_an_action_of_no_route_are_refused(app: Appliance) -> None:
    """Signed in, with the right form token: a form over MAX_FORM_BYTES is 413, an action the route
    does not name (``/sessions/{sid}/{how:revoke|close}``) is 404, a body that is not a form carries
    no form token (403); the session stays active through all of them. The partner: the same form,
    within its limit, revokes it."""
    g = await app.grant(app.agent("calendar_agent"))
    sid = g["session_id"]
    async with dashboard(app.paths) as d, browser(d) as b:
        await b.login()
        token = await b.csrf()
        form = {"csrf": token, "confirmed": "yes"}
        status, _, _ = await b.request("POST", f"/sessions/{sid}/revoke", data={**form, "pad": "x" * MAX_FORM_BYTES})
        assert status == 413
        for how in ("delete", "Revoke", "revoke2", ""):
            status, _, _ = await b.request("POST", f"/sessions/{sid}/{how}", data=form)
            assert status == 404, how
        status, html, _ = await b.request(
            "POST", f"/sessions/{sid}/revoke", data=json.dumps(form), headers={"Content-Type": "application/json"}
        )
        assert status == 403 and "Refused" in html
        assert await asyncio.to_thread(_session_status, app.paths, sid) == "active"
        status, _, hdrs = await b.request("POST", f"/sessions/{sid}/revoke", data=form)
        assert status == 303 and hdrs["Location"] == "/sessions"
        assert await asyncio.to_thread(_session_status, app.paths, sid) == "revoked"


def _session_status(paths: Paths, sid: str) -> str:
    from gateway.dashboard import data

    return next(r["status"] for r in data.list_sessions(paths) if r["session_id"] == sid)


def _non_loopback_ipv4() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else str(addr)


async def test_non_loopback_peer_refused(app: Appliance) -> None:
    assert security.peer_is_loopback(("127.0.0.1", 5)) and security.peer_is_loopback(("127.3.4.5", 5))
    assert security.peer_is_loopback(("::1", 5, 0, 0)) and security.peer_is_loopback(("::ffff:127.0.0.1", 5, 0, 0))
    for peer in (
        ("10.0.0.5", 5),
        ("192.168.1.2", 5),
        ("::ffff:10.0.0.5", 5, 0, 0),
        ("fe80::1%eth0", 5, 0, 0),
        ("2001:db8::1", 5, 0, 0),
        None,
        "127.0.0.1",
        ("not-an-ip", 5),
    ):
        assert not security.peer_is_loopback(peer), peer
    # configuration cannot bind the dashboard beyond loopback
    for host in ("0.0.0.0", "192.168.1.2", "localhost", "::"):
        with pytest.raises(UompError) as e:
            DashboardConfig(host=host)
        assert e.value.code == "CONFIG_ERROR"
    app.paths.config_file.write_text('[dashboard]\nhost = "0.0.0.0"\n')
    with pytest.raises(UompError):
        load_section(DashboardConfig, "dashboard", file=app.paths.config_file)
    app.paths.config_file.unlink()
    # a real peer from another loopback address passes; one from this host's LAN address does not
    d = Dashboard(app.paths, DashboardConfig(port=0))
    server = httpd.Server(d.create_app(), name="dashboard")
    try:
        d.port = await server.serve_tcp("0.0.0.0", 0)  # only here, to let a non-loopback peer in at all
        req = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{d.port}\r\nConnection: close\r\n\r\n".encode()
        ok = await asyncio.to_thread(raw_request, d.port, req, source="127.0.0.2")
        assert ok.startswith(b"HTTP/1.1 401")  # passes the peer check, then asks for a sign-in
        lan = _non_loopback_ipv4()
        if lan is None:
            pytest.skip("this machine has no non-loopback IPv4 address to connect from")
        bad = await asyncio.to_thread(raw_request, d.port, req, source=lan, target=lan)
        assert bad.startswith(b"HTTP/1.1 403") and b"loopback" in bad
    finally:
        await server.close(grace=1.0)


async def test_security_headers_on_every_response_and_no_secret_anywhere(
    app: Appliance, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    agent = app.agent("calendar_agent")
    g = await app.grant(agent)
    admin = keys.load_admin(app.paths)
    pages: list[str] = []
    async with dashboard(app.paths) as d, browser(d) as b:
        responses = [await b.get("/"), await b.get("/login?t=nope")]
        link = await b.login()
        token = link.split("t=", 1)[1]
        responses.append(await b.get(link.removeprefix(d.base_url)))  # spent
        async with agent_session(agent, app.paths) as s:
            await agent_call(s, app.base, "/v1/memory/user.password", token=g["token"], agent_id=agent.agent_id)
        for path in (
            "/",
            "/sessions",
            "/audit",
            "/audit?verdict=refused&period=day",
            "/agents",
            "/payloads",
            "/appliance",
            "/static/dashboard.css",
            "/static/dashboard.js",
            "/static/nothing.js",
            "/nowhere",
        ):
            responses.append(await b.get(path))
        event = re.search(r'href="/audit/([^/]+)/proof.json"', responses[-9][1])
        assert event
        responses.append(await b.get(f"/audit/{event.group(1)}/proof.json"))
        responses.append(await b.get("/", headers={"Host": "evil.example"}))
        responses.append(await b.request("POST", f"/sessions/{g['session_id']}/close", data={"csrf": "x"}))
        csrf = await b.csrf()
        responses.append(
            await b.request("POST", f"/sessions/{g['session_id']}/close", data={"csrf": csrf, "confirmed": "no"})
        )
        for status, body, hdrs in responses:
            for name, value in HEADERS.items():
                assert hdrs.get(name) == value, (status, name)
            pages.append(body)
        assert "frame-ancestors 'none'" in HEADERS["Content-Security-Policy"]
        assert "script-src 'self'" in HEADERS["Content-Security-Policy"]
        for body in pages:
            assert admin not in body and token not in body and b.cookie not in body
            assert "<script>" not in body and " style=" not in body and "onclick" not in body
    assert b.cookie is not None
    text = caplog.text + "".join(r.getMessage() for r in caplog.records)
    for secret in (admin, token, b.cookie, g["token"], csrf):
        assert secret not in text
    assert "login link was refused" in text and "signed in" in text  # the log does say what happened


# ----------------------------------------------------------------------------- what it shows


async def test_timeline_refusals_in_words_filters_and_a_proof_that_verifies(
    app: Appliance, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = app.agent("calendar_agent")
    g = await app.grant(agent, read={"tags": ["preference"], "keys": []})
    other = app.agent("mail_agent")
    await app.grant(other)
    async with agent_session(agent, app.paths) as s:
        assert (
            await agent_call(s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=agent.agent_id)
        )[0] == 200
        assert (await agent_call(s, app.base, "/v1/memory/h.aapl", token=g["token"], agent_id=agent.agent_id))[0] == 403
        # refused by the gateway itself: the header names another agent than the certificate and token
        status, body, _ = await agent_call(
            s, app.base, "/v1/memory/preference.lang", token=g["token"], agent_id="mail_agent"
        )
        assert status == 403 and body["error"]["code"] == "AGENT_MISMATCH"
    async with dashboard(app.paths) as d, browser(d) as b:
        await b.login()
        _, html, _ = await b.get("/audit")
        items = re.findall(r'<li class="(allowed|refused)" id="e-([^"]+)">(.*?)</li>\n', html, re.S)
        refused = [i for i in items if i[0] == "refused"]
        assert refused[0][1].startswith("gw_")  # newest first: the gateway's own refusal came last
        assert "The agent asked for a memory outside what you granted." in refused[1][2]
        assert "the agent was told ACCESS_DENIED: key is not within granted scope" in refused[1][2]
        assert "calendar_agent" in refused[1][2] and "h.aapl" in refused[1][2]
        assert any("in a signed checkpoint" in i[2] for i in items)
        gw = [i for i in refused if i[1].startswith("gw_")]  # the gateway's own refusal, in the one log
        assert len(gw) == 1 and "did not all name the same agent" in gw[0][2]
        # filters: refused only; one agent; one session; a period
        _, html, _ = await b.get("/audit?verdict=refused")
        assert 'class="allowed"' not in html and 'class="refused"' in html
        _, html, _ = await b.get("/audit?agent=mail_agent")
        assert "calendar_agent</strong>" not in html and "mail_agent</strong>" in html

        _, html, _ = await b.get(f"/audit?session={g['session_id']}&verdict=allowed")
        assert 'class="refused"' not in html and "read a memory" in html
        _, html, _ = await b.get(f"/audit?session={g['session_id']}&verdict=refused")
        assert html.count('class="refused"') == 2 and 'class="allowed"' not in html
        _, html, _ = await b.get("/audit?period=hour&verdict=bogus")  # an unknown value is no filter
        assert 'class="refused"' in html and 'class="allowed"' in html
        # the refusal's proof downloads and `uomp audit verify-proof` accepts it
        guard_refusal = next(i for i in refused if not i[1].startswith("gw_"))
        status, body, hdrs = await b.get(f"/audit/{guard_refusal[1]}/proof.json")
        assert status == 200 and "attachment" in hdrs["Content-Disposition"]
        f = tmp_path / "proof.json"
        f.write_text(body)
        capsys.readouterr()
        assert uomp(["--home", str(app.paths.home), "audit", "verify-proof", str(f)]) == 0
        assert "proof OK" in capsys.readouterr().out
        tampered = json.loads(body)
        tampered["event"]["allowed"] = True
        f.write_text(json.dumps(tampered))
        assert uomp(["--home", str(app.paths.home), "audit", "verify-proof", str(f)]) == 1
        assert (await b.get("/audit/evt_nope/proof.json"))[0] == 404
        assert (await b.get("/audit/..%2f..%2fetc/proof.json"))[0] in (400, 404)
        # the overview draws the agents' activity without any external asset
        _, html, _ = await b.get("/")
        # one log: the guard's refusal and the gateway's own (AGENT_MISMATCH on calendar_agent's certificate)
        assert "<svg" in html and "calendar_agent: 1 reads and 2 refusals" in html
        assert "http://" not in html.replace(f"http://127.0.0.1:{d.port}", "") and "https://" not in html


async def test_sessions_in_words_agents_revoke_and_appliance(app: Appliance) -> None:
    agent = app.agent("calendar_agent")
    g = await app.grant(
        agent, read={"tags": ["preference"], "keys": ["user.display_name"]}, limits={"max_read_queries": 5}
    )
    async with agent_session(agent, app.paths) as s:
        for _ in range(2):
            assert (
                await agent_call(s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=agent.agent_id)
            )[0] == 200
    async with dashboard(app.paths) as d, browser(d) as b:
        await b.login()
        _, html, _ = await b.get("/sessions")
        assert "may read memories tagged preference" in html and "may read the memories user.display_name" in html
        assert "2 of 5 reads used" in html
        _, html, _ = await b.get("/agents")
        serial = re.search(r'name="target" value="serial:([0-9a-f]+)"', html)
        assert serial and "calendar_agent" in html and "active" in html
        csrf = await b.csrf("/agents")
        status, html, _ = await b.request("POST", "/agents/revoke", data={"csrf": csrf, "target": "../x"})
        assert status == 400
        status, _, _ = await b.request(
            "POST", "/agents/revoke", data={"csrf": csrf, "confirmed": "yes", "target": f"serial:{serial.group(1)}"}
        )
        assert status == 303
        _, html, _ = await b.get("/agents")
        assert "1 session(s) bound to them revoked too" in html and "revoked" in html
        assert await asyncio.to_thread(_session_status, app.paths, g["session_id"]) == "revoked"
        _, html, _ = await b.get("/appliance")
        assert "not running" in html  # this in-process kit holds no appliance lock
        assert f"http://127.0.0.1:{d.port}" in html


def _upload_doc(paths: Paths, sid: str, aid: str, data: bytes) -> dict[str, Any]:
    pub = envelope.parse_public_key(userkey.public_b64(paths))
    return sdk_payloads.seal_small(pub, sealing.Binding(sdk_payloads.new_payload_id(), sid, aid, "text/plain"), data)


async def test_payload_decrypts_in_memory_as_a_download_and_deletes(app: Appliance) -> None:
    agent = app.agent("calendar_agent")
    g = await app.grant(agent)
    doc = _upload_doc(app.paths, g["session_id"], agent.agent_id, SECRET)
    async with agent_session(agent, app.paths) as s:
        status, body, _ = await agent_call(
            s, app.base, "/v1/payload/upload", token=g["token"], agent_id=agent.agent_id, method="POST", json_body=doc
        )
        assert status in (200, 201), body
    pid = doc["payload_id"]
    before = {p for p in app.paths.home.rglob("*") if p.is_file()}
    async with dashboard(app.paths) as d, browser(d) as b:
        await b.login()
        _, html, _ = await b.get("/payloads")
        assert pid in html and "text/plain" in html
        csrf = await b.csrf("/payloads")
        assert (await b.request("POST", f"/payloads/{pid}/open", data={}))[0] == 403  # no token
        status, body, hdrs = await b.request("POST", f"/payloads/{pid}/open", data={"csrf": csrf})
        assert status == 200 and body.encode() == SECRET
        assert hdrs["Content-Disposition"] == f'attachment; filename="{pid}.txt"'
        assert hdrs["Cache-Control"] == "no-store"
        # nothing decrypted was written anywhere in the data directory
        for p in app.paths.home.rglob("*"):
            if p.is_file():
                assert SECRET not in p.read_bytes(), p
        assert {p for p in app.paths.home.rglob("*") if p.is_file()} - before <= {
            p for p in app.paths.home.rglob("*") if p.suffix in (".db-wal", ".db-shm", ".db", "")
        }
        _, html, _ = await b.get("/payloads")
        assert re.search(rf"{pid}.*?<td>yes</td>", html, re.S)  # marked opened
        status, _, _ = await b.request("POST", f"/payloads/{pid}/delete", data={"csrf": csrf, "confirmed": "yes"})
        assert status == 303
        _, html, _ = await b.get("/payloads")
        assert pid not in html.replace(f"Payload {pid} deleted.", "")
        status, html, _ = await b.request("POST", f"/payloads/{pid}/open", data={"csrf": csrf})
        assert status == 404


async def test_uomp_dashboard_hands_a_link_to_the_running_appliance(
    app: Appliance, capsys: pytest.CaptureFixture[str]
) -> None:
    """`uomp dashboard` while the appliance serves the dashboard: a new link, usable once, via the
    hand-over file (hashes only, 0600)."""
    async with dashboard(app.paths) as d, browser(d) as b:
        lock = appliance_state.ApplianceLock(app.paths)
        lock.acquire()
        try:
            lock.write({"pid": 1, "listeners": {"dashboard": d.base_url}})
            capsys.readouterr()
            assert await asyncio.to_thread(uomp, ["--home", str(app.paths.home), "dashboard"]) == 0
            out = capsys.readouterr().out
        finally:
            lock.release()
        link = re.search(r"(http://127\.0\.0\.1:\d+/login\?t=[A-Za-z0-9_-]+)", out)
        assert link and link.group(1).startswith(d.base_url)
        token = link.group(1).split("t=")[1]
        stored = security.links_path(app.paths)
        assert token not in stored.read_text() and oct(stored.stat().st_mode & 0o777) == "0o600"
        path = link.group(1).removeprefix(d.base_url)
        assert (await b.get(path))[0] == 303
        assert (await b.get(path))[0] == 403
        assert stored.read_text() == ""


@pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)
async def test_anchored_events_show_their_transaction_and_prove_on_chain(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With [anchor] on a real local chain (anvil): the timeline says 'anchored' with the transaction,
    the appliance page the backlog, and the downloaded bundle verifies against the chain."""
    from eth_account import Account

    from gateway.anchor.evm import write_private_key

    node = Anvil(tmp_path)
    await asyncio.to_thread(node.start)
    try:
        owner = Account.create()
        await asyncio.to_thread(node.fund, owner.address)
        key_file = tmp_path / "owner.key"
        write_private_key(key_file, owner)
        capsys.readouterr()
        assert (
            await asyncio.to_thread(
                uomp, ["--home", str(home.home), "anchor", "deploy", "--rpc", node.url, "--key-file", str(key_file)]
            )
            == 0
        )
        contract = json.loads(capsys.readouterr().out)["contract"]
        home.config_file.write_text(
            f'[anchor]\nbackend = "evm"\nrpc_url = "{node.url}"\ncontract = "{contract}"\n'
            f'chain_id = 31337\nkey_file = "{key_file}"\nconfirmations = 1\n'
            "poll_seconds = 0.1\n"
        )
        async with appliance(home, guard_cfg=guard_config(audit_checkpoint_events=1)) as app:
            agent = app.agent("calendar_agent")
            g = await app.grant(agent)
            async with agent_session(agent, app.paths) as s:
                assert (await agent_call(s, app.base, "/v1/memory/h.nvda", token=g["token"], agent_id=agent.agent_id))[
                    0
                ] == 403
            for _ in range(600):  # bounded wait for the worker; the chain is mined as it goes
                b = await asyncio.to_thread(_backlog, home)
                if b["counts"]["confirmed"] and not (b["counts"]["queued"] + b["counts"]["submitted"]):
                    break
                await asyncio.to_thread(node.mine, 1)
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"the backlog was not anchored: {b}")
            async with dashboard(app.paths) as d, browser(d) as br:
                await br.login()
                _, html, _ = await br.get("/audit?verdict=refused")
                item = re.search(r'<li class="refused" id="e-(log_[^"]+)">(.*?)</li>\n', html, re.S)
                assert item and "badge anchored" in item.group(2)
                tx = re.search(r"tx <code>(0x[0-9a-f]{64})</code>", item.group(2))
                assert tx
                _, page, _ = await br.get("/appliance")
                assert "evm: " in page and " anchored" in page
                status, body, _ = await br.get(f"/audit/{item.group(1)}/proof.json")
                assert status == 200
        bundle = json.loads(body)
        assert bundle["anchor"]["tx"] == tx.group(1) and bundle["anchor"]["contract"] == contract
        f = tmp_path / "anchored.json"
        f.write_text(body)
        await asyncio.to_thread(node.mine, 3)
        capsys.readouterr()
        assert (
            await asyncio.to_thread(
                uomp, ["--home", str(home.home), "audit", "verify-proof", str(f), "--rpc", node.url]
            )
            == 0
        )
        assert "checked on chain" in capsys.readouterr().out
    finally:
        await asyncio.to_thread(node.stop)


def _backlog(paths: Paths) -> dict[str, Any]:
    import sqlite3

    from gateway.ledger.anchoring import backlog

    conn = sqlite3.connect(f"file:{paths.audit_db}?mode=ro", uri=True)
    try:
        return backlog(conn)
    finally:
        conn.close()


def test_gateway_start_serves_it_and_uomp_dashboard_hands_out_links(tmp_path: Path) -> None:
    """The real `uomp gateway start` (a subprocess, its stdout a pipe as under systemd or Docker)
    serves the dashboard on loopback and records the listener, but prints no login link: that output
    may be a log. It says to run `uomp dashboard`, which prints a one-time link that works once."""
    import os
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from test_appliance import Running

    home = short_dir("uomp-db-") / "home"
    env = {**os.environ, "UOMP_DASHBOARD_PORT": "0"}
    run = Running(home, env=env)
    try:
        m = run.wait_line(
            r"^dashboard: (http://127\.0\.0\.1:(\d+)) \(loopback only\); 'uomp dashboard' prints "
            r"a one-time login link \(none printed here: this output is not a terminal"
        )
        base = m.group(1)
        assert not any("login?t=" in line for line in run.out + run.err)

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *a: Any, **k: Any) -> None:
                return None

        opener = urllib.request.build_opener(NoRedirect)

        def status_of(url: str) -> int:
            try:
                with opener.open(url, timeout=10) as r:
                    return int(r.status)
            except urllib.error.HTTPError as e:
                return int(e.code)

        info = json.loads((home / "gateway" / "appliance.json").read_text())
        assert info["listeners"]["dashboard"] == base
        out = subprocess.run(
            [sys.executable, "-m", "gateway.cli.main", "--home", str(home), "dashboard"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        fresh = re.search(r"(http://127\.0\.0\.1:\d+/login\?t=\S+)", out.stdout)
        assert fresh and fresh.group(1).startswith(base)
        assert status_of(fresh.group(1)) == 303 and status_of(fresh.group(1)) == 403
        assert status_of(base + "/sessions") == 401
        token = fresh.group(1).split("t=", 1)[1]
        assert not any(token in line for line in run.out + run.err)  # the appliance's output never has it
    finally:
        assert run.stop() == 0


def test_gateway_start_prints_the_login_link_to_a_terminal(tmp_path: Path) -> None:
    """The partner: with stdout on a terminal (a pty here), `uomp gateway start` prints a one-time
    login link, and it works once."""
    import os
    import pty
    import signal
    import subprocess
    import sys
    import threading
    import time
    import urllib.error
    import urllib.request

    home = short_dir("uomp-tty-") / "home"
    env = {**os.environ, "UOMP_DASHBOARD_PORT": "0"}
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli.main",
            "--home",
            str(home),
            "gateway",
            "start",
            "--listen",
            "127.0.0.1:0",
            "--no-local-port",
        ],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(slave)
    seen: list[bytes] = []

    def pump() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the other side closed
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rx = re.compile(
            rb"dashboard: (http://127\.0\.0\.1:\d+) \(loopback only\); one-time login link, valid "
            rb"[0-9.]+ s: (\S+/login\?t=\S+)"
        )
        deadline = time.monotonic() + 60
        m = None
        while m is None and time.monotonic() < deadline and proc.poll() is None:
            m = rx.search(b"".join(seen))
            time.sleep(0.05)
        assert m is not None, b"".join(seen).decode(errors="replace")
        base, link = m.group(1).decode(), m.group(2).decode()
        assert link.startswith(base + "/login?t=")

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *a: Any, **k: Any) -> None:
                return None

        def status_of(url: str) -> int:
            try:
                with urllib.request.build_opener(NoRedirect).open(url, timeout=10) as r:
                    return int(r.status)
            except urllib.error.HTTPError as e:
                return int(e.code)

        assert status_of(link) == 303 and status_of(link) == 403
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        reader.join(5)
        os.close(master)


async def test_refused_posts_log_the_route_not_the_path(app: Appliance, caplog: pytest.LogCaptureFixture) -> None:
    """A refused POST is logged by the route it matched: a path's own text, decoded, could start a
    forged line (``%0A``) or carry what the page's address held."""
    caplog.set_level(logging.WARNING, logger="uomp.dashboard")
    async with dashboard(app.paths) as d, browser(d) as b:
        await b.login()
        token = await b.csrf()
        forged = "s_x%0A2026-12-07 INFO uomp.guard forged"
        for headers, data in (
            ({"Sec-Fetch-Site": "cross-site"}, {"csrf": token, "confirmed": "yes"}),  # foreign origin
            ({}, {"csrf": "wrong", "confirmed": "yes"}),  # no right form token
        ):
            status, html, _ = await b.request("POST", f"/sessions/{forged}/revoke", headers=headers, data=data)
            assert status == 403 and "Refused" in html
    lines = [r.getMessage() for r in caplog.records if r.name == "uomp.dashboard"]
    assert lines == [
        "dashboard: refused a cross-site POST to /sessions/{sid}/{how}",
        "dashboard: refused a POST to /sessions/{sid}/{how} without the right form token",
    ]
    assert "forged" not in caplog.text and "s_x" not in caplog.text
