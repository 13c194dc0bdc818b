"""A fault the guard's handlers did not foresee: the client gets a §8.4 ``INTERNAL`` body (never a
stack trace or the exception's text), and the one log line names the endpoint, never a memory key
or an id from the request's path. Real guard on its real Unix socket; the fault is injected into
the read path's decision."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import cast

import pytest
from guardkit import call, grant, running_guard, seed, unix_session

from gateway import httpd
from gateway.config import Paths
from gateway.guard import http as guard_http
from gateway.guard.routes import reads

pytestmark = pytest.mark.timeout(60)

SECRET_KEY = "preference.secret_hobby"
SECRET_TEXT = "a detail only the code knows"


def _boom(*_: object) -> None:
    raise RuntimeError(SECRET_TEXT)


async def test_an_unhandled_fault_answers_internal_and_logs_the_endpoint_not_the_key(
    home: Paths, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    seed(home)
    async with running_guard(home), unix_session(home) as s:
        tok = (await grant(s, home, read={"tags": ["preference"], "keys": []}))["token"]
        status, body, _ = await call(s, "GET", f"/v1/memory/{SECRET_KEY}", token=tok)
        assert status == 200 and body["key"] == SECRET_KEY  # the partner: the same read, unfaulted

        monkeypatch.setattr(reads, "_key_verdict", _boom)
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


async def _never(request: httpd.Request) -> httpd.Response:
    raise AssertionError("not called")


class _Req:
    """What :func:`endpoint` reads of a request: its raw path, the route it matched, the routes."""

    def __init__(self, path: str, route: str | None, router: httpd.Router) -> None:
        self.path, self.route = path, route
        self.app = SimpleNamespace(router=router)


def test_endpoint_shows_routes_never_what_a_path_carries() -> None:
    router = httpd.Router()
    router.add_route("GET", "/v1/health", _never)
    router.add_route("GET", "/v1/memory/{key}", _never)
    router.add_route("GET", "/v1/payload/{payload_id}/audit/{event}", _never)

    def shown(path: str) -> str:
        route: str | None
        try:
            _, _, route = router.match("GET", path)
        except httpd.HTTPError:
            route = None
        return guard_http.endpoint(cast(httpd.Request, _Req(path, route, router)))

    assert shown("/v1/health") == "/v1/health"
    assert shown("/v1/memory/diagnosis.hiv") == "/v1/memory/{key}"
    assert shown("/v1/memory/a%2Fb%20c") == "/v1/memory/{key}"
    assert shown("/v1/memory/memory") == "/v1/memory/{key}"  # a value equal to a literal segment
    assert shown("/v1/payload/pay_1/audit/ev_2") == "/v1/payload/{payload_id}/audit/{event}"
    # not routed (the fault came first) or no route: nothing of the path
    assert shown("/v1/nothing/diagnosis.hiv") == "(a path of no literal route)"
    assert shown("/v1/memory") == "(a path of no literal route)"
