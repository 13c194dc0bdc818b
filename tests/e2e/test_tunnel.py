"""The cloudflared supervisor against a stand-in binary (tests/fake_cloudflared.py): URL parsing,
restarts with backoff, URL changes, rate limiting, a missing binary, named tunnels' token kept
out of the command line, a user config that would break quick tunnels, and HTTP through the "edge"."""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from gateway.tunnel import QUICK_URL, TunnelConfig, TunnelSupervisor

FAKE = str(Path(__file__).parents[1] / "fake_cloudflared.py")


@pytest.fixture
async def origin() -> AsyncIterator[str]:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {"host": request.host, "path": request.path_qs, "proto": request.headers.get("X-Forwarded-Proto")}
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def cfg(origin: str, **kw: object) -> TunnelConfig:
    base: dict[str, object] = {
        "mode": "quick",
        "origin_url": origin,
        "cloudflared": FAKE,
        "backoff_initial_seconds": 0.05,
        "backoff_max_seconds": 0.2,
        "rate_limit_backoff_seconds": 0.3,
        "url_timeout_seconds": 20.0,
    }
    base.update(kw)
    return TunnelConfig(**base)  # type: ignore[arg-type]


async def _until(pred, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.05)):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_quick_tunnel_url_and_forwarding(origin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    edge_file = tmp_path / "edge"
    monkeypatch.setenv("FAKE_CF_EDGE_FILE", str(edge_file))
    seen: list[tuple[str, str | None]] = []
    sup = TunnelSupervisor(cfg(origin), on_url=lambda new, old: seen.append((new, old)))
    sup.start()
    try:
        url = await sup.wait_for_url(20)
        assert url and QUICK_URL.fullmatch(url)
        assert seen == [(url, None)]
        await _until(lambda: sup.state.status == "running")
        port, host = edge_file.read_text().split()
        assert f"https://{host}" == url

        def get() -> dict[str, str]:
            conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=10)
            conn.request("GET", "/v1/health?x=1")
            import json

            return json.loads(conn.getresponse().read())

        answer = await asyncio.to_thread(get)
        assert answer == {"host": host, "path": "/v1/health?x=1", "proto": "https"}
    finally:
        await sup.stop()
    assert sup.state.status == "stopped" and sup.state.pid is None


async def test_dead_tunnel_restarts_with_a_new_url(origin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CF_MODE", "die-after:0.5")
    seen: list[tuple[str, str | None]] = []
    sup = TunnelSupervisor(cfg(origin), on_url=lambda new, old: seen.append((new, old)))
    sup.start()
    try:
        await _until(lambda: len(seen) >= 2)
        assert seen[1][1] == seen[0][0] and seen[1][0] != seen[0][0]
        assert sup.state.restarts >= 1
    finally:
        await sup.stop()


@pytest.mark.parametrize(
    ("mode", "status", "error"),
    [
        ("exit", "restarting", "stand-in told to exit"),
        ("rate-limited", "rate-limited", "rate-limiting"),
        ("no-url", "restarting", "no public URL"),
    ],
    ids=["exits-at-once", "rate-limited", "no-url"],
)
async def test_failures_are_reported_and_retried(
    origin: str, monkeypatch: pytest.MonkeyPatch, mode: str, status: str, error: str
) -> None:
    monkeypatch.setenv("FAKE_CF_MODE", mode)
    states: list[tuple[str, str | None]] = []
    sup = TunnelSupervisor(
        cfg(origin, url_timeout_seconds=1.0), on_state=lambda s: states.append((s.status, s.last_error))
    )
    sup.start()
    try:
        await _until(lambda: sup.state.restarts >= 2)
        assert any(s == status and e and error in e for s, e in states), states
        assert sup.state.public_url is None
    finally:
        await sup.stop()


async def test_rate_limit_backs_off_longer(origin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CF_MODE", "rate-limited")
    sup = TunnelSupervisor(cfg(origin, rate_limit_backoff_seconds=30.0))
    sup.start()
    try:
        await _until(lambda: sup.state.status == "rate-limited")
        await asyncio.sleep(1.0)
        assert sup.state.restarts == 1  # still waiting out the long backoff
    finally:
        await sup.stop()


async def test_missing_binary_is_one_clear_message(
    origin: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sup = TunnelSupervisor(cfg(origin, cloudflared=str(tmp_path / "nope")))
    with caplog.at_level(logging.ERROR, logger="uomp.tunnel"):
        sup.start()
        await _until(lambda: sup.state.status == "missing")
    assert "cloudflared not found" in caplog.text and "install cloudflared" in caplog.text
    await sup.stop()


async def test_named_tunnel_token_stays_off_the_command_line(
    origin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CF_HOSTNAME", "gw.example.test")
    token = "eyJhIjoic2VjcmV0LXR1bm5lbC10b2tlbiJ9"
    sup = TunnelSupervisor(cfg(origin, mode="named", token=token, hostname="gw.example.test"))
    sup.start()
    try:
        assert await sup.wait_for_url(10) == "https://gw.example.test"
        await _until(lambda: sup.state.pid is not None)

        # one reading of the running stand-in, taken whole: /proc shows an empty command line while
        # `env` execs python, and under load a reading between two reads of /proc can mix two states
        seen: list[tuple[bytes, bytes]] = []

        def running() -> bool:
            pid = sup.state.pid
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                return False
            if b"fake_cloudflared" in cmd and b"TUNNEL_TOKEN=" in env:
                seen.append((cmd, env))
                return True
            return False

        await _until(running)
        cmdline, environ = seen[-1]
        assert token.encode() not in cmdline and b"run" in cmdline
        assert b"TUNNEL_TOKEN=" + token.encode() in environ
    finally:
        await sup.stop()
    with pytest.raises(ValueError):
        TunnelConfig(mode="named", hostname="x")
    with pytest.raises(ValueError):
        TunnelConfig(mode="quick", origin_url="http://0.0.0.0:1")


async def test_user_config_gets_a_private_home(
    origin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    (home / ".cloudflared").mkdir(parents=True)
    (home / ".cloudflared" / "config.yml").write_text("tunnel: 1234\ncredentials-file: x.json\n")
    monkeypatch.setenv("HOME", str(home))
    private = tmp_path / "uomp" / "tunnel-home"
    lines: list[str] = []
    sup = TunnelSupervisor(cfg(origin, private_home=private))
    with caplog.at_level(logging.WARNING, logger="uomp.tunnel"):
        sup.start()
        try:
            await sup.wait_for_url(20)
            await _until(lambda: sup.state.pid is not None)
            await _until(lambda: b"fake_cloudflared" in Path(f"/proc/{sup.state.pid}/cmdline").read_bytes())
            environ = Path(f"/proc/{sup.state.pid}/environ").read_bytes().split(b"\0")
            lines = [e.decode() for e in environ if e.startswith(b"HOME=")]
        finally:
            await sup.stop()
    assert lines == [f"HOME={private}"]
    assert "config.yml" in caplog.text and oct(private.stat().st_mode & 0o777) == "0o700"
    assert os.environ["HOME"] == str(home)
