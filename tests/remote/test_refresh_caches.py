"""The per-token caches of both processes hold the tokens a session uses now, not every access token
minted in the last token lifetime: an agent that refreshes every few seconds keeps at most
``PER_SESSION`` entries per cache, whatever its refresh rate. A token dropped from a cache is checked
again in full (still accepted while valid, refused once its session is revoked). The real appliance
on 127.0.0.1 (mTLS, the guard on its Unix socket), spoken on the wire."""

from __future__ import annotations

from gatewaykit import agent_session, appliance
from guardkit import admin_headers, call
from test_agent_routes import read_theme, refresh

from gateway.config import Paths
from gateway.core.tokencache import PER_SESSION

ROTATIONS = 30  # all within the access token's 10 minutes: none expires during the test


async def test_refreshes_keep_per_session_entries_not_every_live_token(home: Paths) -> None:
    async with appliance(home) as app:
        assert app.guard is not None
        auth = app.guard.services.auth
        a, b = app.agent("agent_a"), app.agent("agent_b")
        ga, gb = await app.grant(a, refresh=True), await app.grant(b, refresh=True)
        sid, rt, at = ga["session_id"], ga["refresh_token"], ga["token"]
        async with agent_session(a, home) as sa, agent_session(b, home) as sb:
            assert (await read_theme(sb, app, b, gb["token"]))[0] == 200  # b's token, cached first
            superseded: list[str] = []
            for _ in range(ROTATIONS):
                assert (await read_theme(sa, app, a, at))[0] == 200
                status, body = await refresh(sa, app, a, sid, rt)
                assert status == 200, body
                superseded.append(at)
                rt, at = body["refresh_token"], body["access_token"]
            assert (await read_theme(sa, app, a, at))[0] == 200
            # a's newest tokens and b's one: ROTATIONS + 2 entries in each cache before
            assert app.gateway.state.verified_cached == PER_SESSION + 1
            assert auth.cache_sizes() == {k: PER_SESSION + 1 for k in ("verified", "used", "not_blacklisted")}
            # b's entry was not pushed out by a's rotations, and b still reads
            assert (await read_theme(sb, app, b, gb["token"]))[0] == 200
            assert app.gateway.state.verified_cached == PER_SESSION + 1
            # a token dropped from the caches is still a valid token: verified again, accepted
            status, body = await read_theme(sa, app, a, superseded[0])
            assert status == 200, body
            assert app.gateway.state.verified_cached == PER_SESSION + 1
            # ... and refused, like the cached ones, once its session is revoked
            st, _, _ = await call(app.admin, "POST", f"/v1/sessions/{sid}/revoke", headers=admin_headers(home))
            assert st == 200
            for token in (superseded[0], superseded[-1], at):
                status, body = await read_theme(sa, app, a, token)
                assert (status, body["error"]["code"]) == (401, "SESSION_REVOKED"), body
            assert (await read_theme(sb, app, b, gb["token"]))[0] == 200
