"""The gateway on a VPS, the guard at home, over the outbound mTLS HTTP/2 uplink (docs/vps.md)."""

from __future__ import annotations

import asyncio

import pytest
from gatewaykit import agent_call, agent_session
from guardkit import admin_headers, call
from uplinkkit import split

from gateway.config import Paths

pytestmark = pytest.mark.timeout(60)


async def test_agent_reads_through_the_uplink_and_revocation_holds(home: Paths) -> None:
    async with split(home) as s:
        app = s.app
        a = app.agent("calendar_agent")
        g = await app.grant(a, read={"tags": ["preference"], "keys": []})
        async with agent_session(a, app.paths) as sess:
            status, body, hdrs = await agent_call(
                sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and body["value"] == "dark", body
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory?tag=preference", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and {i["key"] for i in body["items"]} >= {"preference.theme", "preference.lang"}
            # denied partner: a key outside the grant is refused by the guard at home, relayed as is
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory/user.password", token=g["token"], agent_id=a.agent_id
            )
            assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
            await call(app.admin, "POST", f"/v1/sessions/{g['session_id']}/revoke", headers=admin_headers(home))
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 401 and body["error"]["code"] == "SESSION_REVOKED", body
