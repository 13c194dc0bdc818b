"""A fault the guard's handlers did not foresee: the client gets a §8.4 ``INTERNAL`` body (never a
stack trace or the exception's text), and the one log line names the endpoint, never a memory key
or an id from the request's path. Real guard on its real Unix socket; the fault is injected into
the read path's store."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import aiohttp
import pytest
import yarl
from guardkit import call, grant, running_guard, seed, unix_session

from gateway import httpd
from gateway.config import Paths
from gateway.guard import http as guard_http

pytestmark = pytest.mark.timeout(60)

SECRET_KEY = "preference.secret_hobby"
SECRET_TEXT = "a detail only the code knows"


def _boom(*_: object) -> None:
    raise RuntimeError(SECRET_TEXT)


async def test_an_unhandled_fault_answers_internal_and_logs_the_endpoint_not_the_key(
    home: Paths, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    seed(home)
    async with running_guard(home) as guard, unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["preference"], "keys": []}))["token"]
        status, body, _ = await call(s, "GET", f"/v1/memory/{SECRET_KEY}", token=tok)
        assert status == 200 and body["key"] == SECRET_KEY  # the partner: the same read, unfaulted

        assert guard.services is not None
        # (the store is a Python object: a patch of it reaches the compiled read path too)
        monkeypatch.setattr(guard.services.store, "get_if", _boom)
        with caplog.at_level(logging.ERROR, logger=guard_http.log.name):
            for path in (f"/v1/memory/{SECRET_KEY}", "/v1/memory/preference%2Esecret_hobby"):  # raw and escaped
                status, body, _ = await call(s, "GET", path, token=tok)
                assert status == 500
                assert body["error"]["code"] == "INTERNAL" and body["error"]["message"] == "internal error"
                assert SECRET_TEXT not in str(body)
        lines = [r.getMessage() for r in caplog.records if r.name == guard_http.log.name]
        assert lines == ["unhandled RuntimeError on GET /v1/memory/{key}"] * 2
        text = caplog.text
        assert "secret_hobby" not in text and SECRET_TEXT not in text


async def _routed(request: httpd.Request) -> httpd.Response:
    return httpd.Response(b"")


async def _show_endpoint(request: httpd.Request, handler: httpd.Handler) -> httpd.Response:
    """Answers what :func:`endpoint` shows of the request; ``X-Unrouted`` as if a fault came before
    the routing (no route set)."""
    with contextlib.suppress(httpd.HTTPError):
        await handler(request)
    if "x-unrouted" in request.headers:
        request.route = None
    return httpd.Response(guard_http.endpoint(request).encode())


async def test_endpoint_shows_routes_never_what_a_path_carries(tmp_path: Path) -> None:
    app = httpd.App(middleware=_show_endpoint, refusal=lambda status: httpd.Response(b"", status))
    for pattern in ("/v1/health", "/v1/memory/{key}", "/v1/payload/{payload_id}/audit/{event}"):
        app.router.add_route("GET", pattern, _routed)
    server = httpd.Server(app, keepalive_seconds=5)
    sock = tmp_path / "e.sock"
    await server.serve_unix(str(sock), backlog=4)
    shown_by: dict[tuple[str, bool], str] = {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
            for path in (
                "/v1/health",
                "/v1/memory/diagnosis.hiv",
                "/v1/memory/a%2Fb%20c",
                "/v1/memory/memory",
                "/v1/payload/pay_1/audit/ev_2",
                "/v1/nothing/diagnosis.hiv",
                "/v1/memory",
            ):
                for unrouted in (False, True):
                    headers = {"X-Unrouted": "1"} if unrouted else {}
                    async with s.get(yarl.URL(f"http://guard{path}", encoded=True), headers=headers) as r:
                        shown_by[path, unrouted] = await r.text()
    finally:
        await server.close(1.0)

    def shown(path: str, unrouted: bool = False) -> str:
        return shown_by[path, unrouted]

    assert shown("/v1/health") == "/v1/health"
    assert shown("/v1/memory/diagnosis.hiv") == "/v1/memory/{key}"
    assert shown("/v1/memory/a%2Fb%20c") == "/v1/memory/{key}"
    assert shown("/v1/memory/memory") == "/v1/memory/{key}"  # a value equal to a literal segment
    assert shown("/v1/payload/pay_1/audit/ev_2") == "/v1/payload/{payload_id}/audit/{event}"
    # not routed (the fault came first) or no route: nothing of the path
    assert shown("/v1/nothing/diagnosis.hiv") == "(a path of no literal route)"
    assert shown("/v1/memory") == "(a path of no literal route)"
    assert shown("/v1/memory/diagnosis.hiv", unrouted=True) == "(a path of no literal route)"
    assert shown("/v1/payload/pay_1/audit/ev_2", unrouted=True) == "(a path of no literal route)"
    assert shown("/v1/health", unrouted=True) == "/v1/health"  # a literal route shows without its match
