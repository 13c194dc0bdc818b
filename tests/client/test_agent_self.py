"""An agent closes its OWN session, reads its status and validates its OWN token (spec §9.3, §9.5;
the reference SDK's ``session.close``, ``session.isActive``, ``auth.validate``: same paths, methods
and bodies), through the gateway on both profiles (mTLS, DPoP through the tunnel origin) and on the
Local Profile, with no management access. Real appliance, real TLS, real SQLite."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from agentkit import TUNNEL, agent_appliance, make_bundle
from gatewaykit import Appliance, ledger_events
from guardkit import admin_headers, call, grant

from gateway.client import AccessDenied, AuthError, InvalidRequest, UompClient
from gateway.config import Paths

pytestmark = pytest.mark.timeout(60)

CREATE = {"agent_id": "calendar_agent", "requested_scopes": {"read": {"tags": ["preference"], "keys": []}}}
GRANT = {"granted_scopes": {"read": {"tags": ["preference"], "keys": []}}}


@pytest.fixture
async def app(home: Paths) -> AsyncIterator[Appliance]:
    async with agent_appliance(home) as a:
        yield a


@contextlib.asynccontextmanager
async def remote_client(app: Appliance, tmp: Path, mode: str, name: str) -> AsyncIterator[UompClient]:
    path, _ = await make_bundle(app, tmp / f"{name}.json", url=TUNNEL if mode == "dpop" else None)
    if mode == "dpop":
        c = UompClient.from_bundle(path, mode="dpop", base_url=f"http://127.0.0.1:{app.gateway.tunnel_port}")
    else:
        c = UompClient.from_bundle(path)
    async with c:
        yield c


async def admin_get(app: Appliance, path: str) -> Any:
    status, body, _ = await call(app.admin, "GET", path, headers=admin_headers(app.paths))
    assert status == 200, body
    return body


async def check_own_session_only(c: UompClient, other: UompClient, *, management_code: str) -> None:
    """Everything an agent may do with its own session, and the refusals around it."""
    v = await c.validate_token()
    assert v["valid"] is True and v["session_id"] == c.session_id and v["agent_id"] == c.agent_id
    assert v["status"] == "active" and v["expires_at"].endswith("Z")
    s = await c.session()
    assert s["session_id"] == c.session_id and s["status"] == "active"
    assert s["granted_scopes"]["read"]["tags"] == ["preference"]
    assert await c.is_active()

    # another session's id, with this session's token: refused, the other session untouched
    for method, path in (
        ("POST", f"/v1/sessions/{other.session_id}/close"),
        ("GET", f"/v1/sessions/{other.session_id}"),
    ):
        with pytest.raises(AccessDenied) as denied:
            await c._call(method, path)
        assert denied.value.code == "ACCESS_DENIED" and "own session" in denied.value.message
    with pytest.raises(AccessDenied) as denied:  # another session's token in the body
        await c._call("POST", "/v1/tokens/validate", body={"token": other._tokens.access_token})
    assert denied.value.code == "ACCESS_DENIED"
    with pytest.raises(InvalidRequest):
        await c._call("POST", "/v1/tokens/validate", body={"token": 7})

    # management calls with an agent token: none of them
    for method, path, body in (
        ("POST", f"/v1/sessions/{c.session_id}/revoke", None),
        ("POST", f"/v1/sessions/{other.session_id}/revoke", None),
        ("GET", "/v1/sessions", None),
        ("POST", "/v1/sessions", CREATE),
        ("POST", f"/v1/sessions/{c.session_id}/grant", GRANT),
    ):
        with pytest.raises((AuthError, InvalidRequest)) as refused:
            await c._call(method, path, body=body)
        assert refused.value.code == management_code, (method, path, refused.value)
    assert await other.is_active() and await c.is_active()

    assert await c.close_session() == {"session_id": c.session_id, "status": "closed"}
    assert not await c.is_active()
    for ended in (c.validate_token, c.session, c.close_session, lambda: c.get("preference.theme")):
        with pytest.raises(AuthError) as gone:
            await ended()
        assert gone.value.code == "SESSION_REVOKED"
    assert await other.is_active()
    assert (await other.get("preference.theme"))["value"] == "dark"


@pytest.mark.parametrize("mode", ["mtls", "dpop"])
async def test_remote_agent_closes_reads_and_validates_its_own_session_only(
    app: Appliance, tmp_path: Path, mode: str
) -> None:
    async with remote_client(app, tmp_path, mode, "a") as c, remote_client(app, tmp_path, mode, "b") as other:
        # the gateway has no route for the management API: 404, whatever the token
        await check_own_session_only(c, other, management_code="NOT_FOUND")
        sid = c.session_id
    row = await admin_get(app, f"/v1/sessions/{sid}")
    assert row["status"] == "closed" and "agent" in row["status_reason"]
    listener = "tunnel" if mode == "dpop" else "mtls"
    for action in ("session_close", "session_status", "token_validate"):
        events = ledger_events(app.paths, action=action, session_id=sid)
        assert any(e["allowed"] for e in events), action
        assert all(e.get("listener") == listener for e in events)
    refused = ledger_events(app.paths, action="session_close", session_id=sid, allowed=False)
    assert {e.get("detail") or e.get("code") for e in refused} == {"ACCESS_DENIED", "SESSION_REVOKED"}, refused
    assert ledger_events(app.paths, action="session_closed", session_id=sid)


async def test_revoked_session_is_refused_and_inactive(app: Appliance, tmp_path: Path) -> None:
    async with remote_client(app, tmp_path, "mtls", "a") as c:
        assert await c.is_active()
        status, body, _ = await call(
            app.admin, "POST", f"/v1/sessions/{c.session_id}/revoke", headers=admin_headers(app.paths)
        )
        assert status == 200, body
        assert not await c.is_active()
        for ended in (c.validate_token, c.session, c.close_session):
            with pytest.raises(AuthError) as gone:
                await ended()
            assert gone.value.code == "SESSION_REVOKED"
        assert (await admin_get(app, f"/v1/sessions/{c.session_id}"))["status"] == "revoked"  # not "closed"


async def test_local_profile_agent_own_session_only(app: Appliance) -> None:
    assert app.guard is not None
    base = f"http://127.0.0.1:{app.guard.tcp_port}"
    tokens = [(await grant(app.admin, app.paths, read={"tags": ["preference"], "keys": []}))["token"] for _ in range(2)]
    c = UompClient.from_env({"UOM_TOKEN": tokens[0], "UOMP_BASE_URL": base})
    other = UompClient.from_env({"UOM_TOKEN": tokens[1], "UOMP_BASE_URL": base})
    async with c, other:
        # the Local Profile serves the management API, to the admin credential only
        await check_own_session_only(c, other, management_code="UNAUTHORIZED")


async def test_unauthenticated_validation_only_on_the_socket(app: Appliance, tmp_path: Path) -> None:
    """The gateway's own status check (no Authorization, Unix socket) still answers for any token;
    the same call on the Local Profile port is refused."""
    import aiohttp

    assert app.guard is not None
    _, g = await make_bundle(app, tmp_path / "a.json")
    status, body, _ = await call(app.admin, "POST", "/v1/tokens/validate", json_body={"token": g["token"]})
    assert status == 200 and body["valid"] is True and body["session_id"] == g["session_id"]
    async with aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{app.guard.tcp_port}"
        for hdrs in ({}, {"Authorization": "Bearer uadm_wrong"}):
            status, body, _ = await call(
                s, "POST", "/v1/tokens/validate", headers=hdrs, json_body={"token": g["token"]}, base=base
            )
            assert (status, body["error"]["code"]) == (401, "UNAUTHORIZED")
    status, body, _ = await call(
        app.admin, "POST", "/v1/tokens/validate", headers={"Authorization": "Bearer uadm_wrong"}, json_body={}
    )
    assert (status, body["error"]["code"]) == (401, "UNAUTHORIZED")  # a credential on the socket: the user's
    async with aiohttp.ClientSession() as s:
        # a remote token presented on the Local Profile port is not a local agent
        status, body, _ = await call(
            s, "POST", "/v1/tokens/validate", token=g["token"], json_body={"token": g["token"]}, base=base
        )
        assert status in (401, 403) and body["error"]["code"] != "OK"
        status, body, _ = await call(s, "GET", f"/v1/sessions/{g['session_id']}", token=g["token"], base=base)
        assert status in (401, 403)
