"""Refresh (spec §15.5, RFC 9700 rotation), certificate renewal and the DPoP tunnel-origin listener,
spoken on the wire (no SDK), against the real appliance on 127.0.0.1."""

from __future__ import annotations

import datetime as dt
import sqlite3
import time
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance
from guardkit import admin_headers, call

from gateway import ca_store
from gateway.config import Paths
from gateway.core import ca, dpop

TUNNEL = "https://tunnel.example"


def agent_key(agent: Agent) -> Any:
    return serialization.load_pem_private_key(agent.files.key_file.read_bytes(), password=None)


async def refresh(s: aiohttp.ClientSession, app: Appliance, agent: Agent, sid: str, rt: str) -> tuple[int, Any]:
    status, body, _ = await agent_call(
        s, app.base, f"/v1/sessions/{sid}/refresh", token=rt, agent_id=agent.agent_id, method="POST"
    )
    return status, body


async def read_theme(s: aiohttp.ClientSession, app: Appliance, agent: Agent, token: str) -> tuple[int, Any]:
    st, body, _ = await agent_call(s, app.base, "/v1/memory/preference.theme", token=token, agent_id=agent.agent_id)
    return st, body


async def session_row(app: Appliance, sid: str) -> dict[str, Any]:
    status, body, _ = await call(app.admin, "GET", f"/v1/sessions/{sid}", headers=admin_headers(app.paths))
    assert status == 200, body
    return dict(body)


def age_spent_records(home: Paths, seconds: float) -> None:
    """Pretend the spend happened long ago (far beyond the old 10 s grace), in the real database."""
    db = sqlite3.connect(home.auth_db)
    db.execute("UPDATE refresh_tokens SET spent_at = spent_at - ? WHERE status='spent'", (seconds,))
    db.commit()
    db.close()


async def test_refresh_rotates_and_reuse_revokes_family(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, refresh=True)
        sid, rt = g["session_id"], g["refresh_token"]
        spent = []
        async with agent_session(a, home) as s:
            for _ in range(5):
                status, body = await refresh(s, app, a, sid, rt)
                assert status == 200, body
                spent.append(rt)
                rt = body["refresh_token"]
                assert body["access_token"] != g["token"] and body["session_id"] == sid
                st, item = await read_theme(s, app, a, body["access_token"])
                assert st == 200 and item["value"] == "dark"
            latest_access = body["access_token"]
            # a refresh token never reads memory
            st, err = await read_theme(s, app, a, rt)
            assert st == 401 and err["error"]["code"] == "INVALID_TOKEN"
            # an access token cannot refresh
            status, err = await refresh(s, app, a, sid, latest_access)
            assert status == 401 and err["error"]["code"] == "INVALID_TOKEN"
            # another agent's certificate with a's refresh token: refused (binding + agent)
            b = app.agent("agent_b")
            async with agent_session(b, home) as sb:
                status, err = await refresh(sb, app, b, sid, rt)
                assert status in (401, 403) and err["error"]["code"] in ("AGENT_MISMATCH", "TOKEN_BINDING_MISMATCH")
            # the fork: the successor of spent[-1] was used, so even right away (inside
            # the old 10 s grace) presenting spent[-1] again is reuse, not a second live chain
            status, err = await refresh(s, app, a, sid, spent[-1])
            assert status == 401 and err["error"]["code"] == "REFRESH_REUSED"
            assert "spent refresh token was presented again" in err["error"]["message"]
            for tok in (latest_access,):
                st, err = await read_theme(s, app, a, tok)
                assert st == 401 and err["error"]["code"] == "SESSION_REVOKED"
                assert "spent refresh token was presented again" in err["error"]["message"]
            status, err = await refresh(s, app, a, sid, rt)
            assert status == 401 and err["error"]["code"] == "SESSION_REVOKED"
        row = await session_row(app, sid)
        assert row["status"] == "revoked" and "spent refresh token" in row["status_reason"]


@pytest.mark.parametrize("presented", ["old refresh token", "successor access token", "successor refresh token"])
async def test_spent_token_after_successor_used_is_reuse(home: Paths, presented: str) -> None:
    """Once either token of the successor pair was presented, the spent token is reuse, at any delay."""
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, refresh=True)
        sid = g["session_id"]
        async with agent_session(a, home) as s:
            status, first = await refresh(s, app, a, sid, g["refresh_token"])
            assert status == 200
            if presented == "successor access token":
                assert (await read_theme(s, app, a, first["access_token"]))[0] == 200
            elif presented == "successor refresh token":
                status, _ = await refresh(s, app, a, sid, first["refresh_token"])
                assert status == 200
            else:  # the successor is unused: the old token may be retried (its answer was "lost")
                status, again = await refresh(s, app, a, sid, g["refresh_token"])
                assert status == 200
                assert (await read_theme(s, app, a, again["access_token"]))[0] == 200
            status, err = await refresh(s, app, a, sid, g["refresh_token"])
            assert status == 401 and err["error"]["code"] == "REFRESH_REUSED"
        assert (await session_row(app, sid))["status"] == "revoked"


async def test_retry_long_after_a_lost_answer_keeps_the_agent_working(home: Paths) -> None:
    """The answer to a refresh was lost; the agent retries an hour later (far past the
    old 10 s grace): it gets a fresh pair, the pair it never received is dead, and it keeps working."""
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, refresh=True)
        sid = g["session_id"]
        async with agent_session(a, home) as s:
            status, lost = await refresh(s, app, a, sid, g["refresh_token"])
            assert status == 200
            age_spent_records(home, 3600)
            status, again = await refresh(s, app, a, sid, g["refresh_token"])
            assert status == 200, again
            age_spent_records(home, 3600)
            status, third = await refresh(s, app, a, sid, g["refresh_token"])  # any number of retries
            assert status == 200, third
            assert len({lost["refresh_token"], again["refresh_token"], third["refresh_token"]}) == 3
            assert (await read_theme(s, app, a, third["access_token"]))[0] == 200
            status, nxt = await refresh(s, app, a, sid, third["refresh_token"])
            assert status == 200
            assert (await read_theme(s, app, a, nxt["access_token"]))[0] == 200
        assert (await session_row(app, sid))["status"] == "active"


async def test_copied_bundle_racing_the_agent_revokes_with_a_clear_reason(home: Paths) -> None:
    """A copy of the bundle presents the spent token before the agent used its successor: the copy
    gets a pair and the agent's pair is superseded. When the agent (or anyone) presents a superseded
    token, two holders of one chain exist: the session is revoked, the message and the session's
    status say so (never "active" while the agent is told SESSION_REVOKED), and the copy's pair dies."""
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, refresh=True)
        sid = g["session_id"]
        async with agent_session(a, home) as s:
            status, agents = await refresh(s, app, a, sid, g["refresh_token"])
            assert status == 200
            status, copys = await refresh(s, app, a, sid, g["refresh_token"])  # the copy, same key
            assert status == 200
            st, err = await read_theme(s, app, a, agents["access_token"])
            assert st == 401 and err["error"]["code"] == "REFRESH_REUSED"
            assert "possibly a copy of the bundle" in err["error"]["message"]
            row = await session_row(app, sid)
            assert row["status"] == "revoked" and "bundle" in row["status_reason"]
            st, err = await read_theme(s, app, a, copys["access_token"])
            assert st == 401 and err["error"]["code"] == "SESSION_REVOKED"
            assert "copy of the bundle" in err["error"]["message"]
            status, err = await refresh(s, app, a, sid, copys["refresh_token"])
            assert status == 401 and err["error"]["code"] == "SESSION_REVOKED"


async def test_revoked_session_kills_refresh(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, refresh=True)
        await call(app.admin, "POST", f"/v1/sessions/{g['session_id']}/revoke", headers=admin_headers(home))
        async with agent_session(a, home) as s:
            status, err = await refresh(s, app, a, g["session_id"], g["refresh_token"])
            assert status == 401 and err["error"]["code"] == "SESSION_REVOKED"


async def test_certificate_renewal_over_mtls(home: Paths) -> None:
    async with appliance(home) as app:
        # renewal opens in the last third of a certificate's life: one hour, 50 minutes old
        files = ca_store.issue_with_key(
            home,
            "agent_a",
            home.home / "agents-test" / "agent_a",
            dt.timedelta(hours=1),
            now=ca.utcnow() - dt.timedelta(minutes=50),
        )
        a = Agent("agent_a", files)
        async with agent_session(a, home) as s:
            status, body, _ = await agent_call(
                s, app.base, "/v1/certificates/renew", token=None, agent_id=None, method="POST", json_body={}
            )
        assert status == 200, body
        new = x509.load_pem_x509_certificate(body["certificate"].encode())
        old = x509.load_pem_x509_certificate(a.files.cert_file.read_bytes())
        assert ca.agent_id_from_cert(new) == "agent_a" and new.serial_number != old.serial_number
        spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        assert new.public_key().public_bytes(*spki) == old.public_key().public_bytes(*spki)  # same key
        # without a client certificate: refused
        async with agent_session(None, home) as s:
            status, body, _ = await agent_call(
                s, app.base, "/v1/certificates/renew", token=None, agent_id=None, method="POST", json_body={}
            )
        assert status == 401 and body["error"]["code"] == "CERT_REQUIRED"


async def _tunnel_call(
    app: Appliance,
    method: str,
    path: str,
    *,
    token: str | None,
    agent: str,
    proof: str | None,
    host: str = "tunnel.example",
) -> tuple[int, Any]:
    hdrs = {"Host": host, "X-UOMP-Agent-Id": agent}
    if token:
        hdrs["Authorization"] = f"DPoP {token}"
    if proof:
        hdrs["DPoP"] = proof
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, f"http://127.0.0.1:{app.gateway.tunnel_port}{path}", headers=hdrs) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


async def test_dpop_tunnel_listener(home: Paths) -> None:
    async with appliance(home, tunnel_origin_port=0, tunnel_endpoints=[TUNNEL]) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, audience=TUNNEL, refresh=True)
        key = agent_key(a)
        url = TUNNEL + "/v1/memory/preference.theme"
        now = time.time()
        proof = dpop.make_dpop_proof(key, method="GET", url=url, access_token=g["token"], now=now)
        status, body = await _tunnel_call(
            app, "GET", "/v1/memory/preference.theme", token=g["token"], agent="agent_a", proof=proof
        )
        assert status == 200 and body["value"] == "dark"
        other_key = agent_key(app.agent("agent_b"))
        rows = [
            ("replayed proof", proof, "DPOP_INVALID"),
            ("no proof", None, "DPOP_INVALID"),
            (
                "other url",
                dpop.make_dpop_proof(key, method="GET", url=TUNNEL + "/v1/audit", access_token=g["token"], now=now),
                "DPOP_INVALID",
            ),
            (
                "other method",
                dpop.make_dpop_proof(key, method="POST", url=url, access_token=g["token"], now=now),
                "DPOP_INVALID",
            ),
            (
                "other key",
                dpop.make_dpop_proof(other_key, method="GET", url=url, access_token=g["token"], now=now),
                "DPOP_INVALID",
            ),
        ]
        for name, p, code in rows:
            status, body = await _tunnel_call(
                app, "GET", "/v1/memory/preference.theme", token=g["token"], agent="agent_a", proof=p
            )
            assert (status, body["error"]["code"]) == (401, code), name
        # an unknown host on the tunnel listener
        p = dpop.make_dpop_proof(
            key, method="GET", url="https://evil.example/v1/memory/preference.theme", access_token=g["token"], now=now
        )
        status, body = await _tunnel_call(
            app, "GET", "/v1/memory/preference.theme", token=g["token"], agent="agent_a", proof=p, host="evil.example"
        )
        assert status == 401 and body["error"]["code"] == "DPOP_INVALID"
        # renewal is an mTLS-only route: it does not exist on the tunnel listener
        status, body = await _tunnel_call(
            app, "POST", "/v1/certificates/renew", token=None, agent="agent_a", proof=None
        )
        assert status == 404 and body["error"]["code"] == "NOT_FOUND"
        # refresh over the tunnel with DPoP
        rurl = f"{TUNNEL}/v1/sessions/{g['session_id']}/refresh"
        p = dpop.make_dpop_proof(key, method="POST", url=rurl, access_token=g["refresh_token"], now=time.time())
        status, body = await _tunnel_call(
            app, "POST", f"/v1/sessions/{g['session_id']}/refresh", token=g["refresh_token"], agent="agent_a", proof=p
        )
        assert status == 200 and body["refresh_token"] != g["refresh_token"]
        # a token not bound to a DPoP key is useless through the tunnel
        unbound = await app.grant(a, audience=TUNNEL, bind=False)
        p = dpop.make_dpop_proof(key, method="GET", url=url, access_token=unbound["token"], now=time.time())
        status, body = await _tunnel_call(
            app, "GET", "/v1/memory/preference.theme", token=unbound["token"], agent="agent_a", proof=p
        )
        assert status == 401 and body["error"]["code"] == "TOKEN_BINDING_MISMATCH"
