"""The gateway's one route table (issue 7): every route name has exactly one row, every row's name is
a known name (a typo is a mypy error: ``RouteName`` is a ``Literal``), metrics labels come from the
table, and a new route is one row plus one handler."""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

from gatewaykit import agent_call, agent_session, appliance

from gateway import httpd
from gateway.config import Paths
from gateway.remote import agent_routes, enroll_routes, payload_routes, request, routes
from gateway.remote.metrics import DEFAULT_ROUTES, OTHER, Metrics
from gateway.remote.routenames import ROUTE_NAMES, RouteName

ALL_ROWS = [
    *routes.ROUTES,
    *(r for r, _ in agent_routes.ROUTES),
    *(r for r, _ in payload_routes.ROUTES),
    *(r for r, _ in enroll_routes.ROUTES),
]


def test_every_name_has_exactly_one_row_and_every_row_a_known_name() -> None:
    names = [r.name for r in ALL_ROWS]
    assert sorted(names) == sorted(ROUTE_NAMES)
    assert len({(r.method, r.pattern.pattern) for r in ALL_ROWS}) == len(ALL_ROWS)


def test_metrics_labels_come_from_the_table() -> None:
    m = Metrics()
    assert set(DEFAULT_ROUTES) == {*ROUTE_NAMES, "unknown"}
    for name in ROUTE_NAMES:
        assert m.route_label(name) == name
    assert m.route_label("not_a_route") == OTHER  # the denied partner: an unknown name is not a label


async def test_a_new_route_is_one_row_and_one_handler(home: Paths, tmp_path: Path) -> None:
    async with appliance(home) as appl:
        state = appl.gateway.state
        assert state is not None

        async def echo(call: request.Call) -> httpd.AnyResponse:
            assert call.cap is not None  # the row's checks ran before the handler
            return httpd.json_response({"agent": call.cap.agent_id, "n": call.params["n"]})

        # the exercise: one row (a name the table lacks is cast here; in the product it is one line
        # of RouteName) and one handler
        state.routes.append(
            request.Route(
                "GET", re.compile(r"/v1/echo/(?P<n>[0-9]+)"), cast(RouteName, "echo"), status_check=False, handler=echo
            )
        )
        a = appl.agent("calendar_agent")
        g = await appl.grant(a)
        async with agent_session(a, home) as s:
            status, body, _ = await agent_call(s, appl.base, "/v1/echo/7", token=g["token"], agent_id=a.agent_id)
            assert (status, body) == (200, {"agent": "calendar_agent", "n": "7"})
            # denied partners: the row's checks apply to the new route as to every other one
            status, body, _ = await agent_call(s, appl.base, "/v1/echo/7", token=None, agent_id=a.agent_id)
            assert status == 401
            status, body, _ = await agent_call(s, appl.base, "/v1/echo/7", token=g["token"], agent_id="mail_agent")
            assert (status, body["error"]["code"]) == (403, "AGENT_MISMATCH")
            status, body, _ = await agent_call(s, appl.base, "/v1/echo/x", token=g["token"], agent_id=a.agent_id)
            assert (status, body["error"]["code"]) == (404, "NOT_FOUND")
            status, body, _ = await agent_call(
                s, appl.base, "/v1/echo/7", token=g["token"], agent_id=a.agent_id, method="POST"
            )
            assert (status, body["error"]["code"]) == (405, "METHOD_NOT_ALLOWED")


def test_the_guards_table_is_what_each_listener_serves(home: Paths) -> None:
    # One table per side: the guard's apps serve exactly their rows, and the internal rows (token
    # validation, the gateway's events, refresh, the payload inbox) exist on the Unix socket only.
    from gateway.guard import app as guard_app
    from gateway.guard import services as guard_services
    from gateway.guard.routes import payloads as guard_payloads
    from gateway.guard.routes import writes as guard_writes

    rows = (*guard_app.ROUTES, *guard_payloads.ROUTES, *guard_writes.ROUTES)
    services = cast(
        guard_services.GuardServices, type("S", (), {"cfg": type("C", (), {"max_body_bytes": 1024})(), "paths": home})()
    )
    for listener in ("unix", "tcp"):
        served = guard_app.create_app(services, listener=listener).router.table()
        assert served == {(row.method, row.path) for row in rows if listener in row.listeners}
    tcp = {row.path for row in rows if "tcp" in row.listeners}
    # token validation is on both, but unauthenticated (the gateway's status check) on the socket only:
    # tests/client/test_agent_self.py
    assert not tcp & {"/v1/internal/events", "/v1/sessions/{sid}/refresh", "/v1/payloads"}
