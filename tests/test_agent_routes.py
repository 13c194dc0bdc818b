"""Refresh (spec §15.5, RFC 9700 rotation), certificate renewal and the DPoP tunnel-origin listener,
spoken on the wire (no SDK), against the real appliance on 127.0.0.1."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import aiohttp
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
    status, body, _ = await agent_call(s, app.base, f"/v1/sessions/{sid}/refresh", token=rt, agent_id=agent.agent_id,
                                       method="POST")
    return status, body


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
                st, item, _ = await agent_call(s, app.base, "/v1/memory/preference.theme", token=body["access_token"],
                                               agent_id=a.agent_id)
                assert st == 200 and item["value"] == "dark"
            latest_access = body["access_token"]
            # a refresh token never reads memory
            st, err, _ = await agent_call(s, app.base, "/v1/memory/preference.theme", token=rt, agent_id=a.agent_id)
            assert st == 401 and err["error"]["code"] == "INVALID_TOKEN"
            # an access token cannot refresh
            status, err = await refresh(s, app, a, sid, latest_access)
            assert status == 401 and err["error"]["code"] == "INVALID_TOKEN"
            # within the grace window the same key may retry (its answer was lost): it gets a fresh pair,
            # and the pair it never received is dead (no token is kept at rest to hand out twice)
            status, again = await refresh(s, app, a, sid, spent[-1])
            assert status == 200 and again["refresh_token"] != rt
            st, err, _ = await agent_call(s, app.base, "/v1/memory/preference.theme", token=latest_access,
                                          agent_id=a.agent_id)
            assert st == 401 and err["error"]["code"] == "SESSION_REVOKED"
            status, err = await refresh(s, app, a, sid, rt)
            assert status == 401 and err["error"]["code"] == "SESSION_REVOKED"
            rt = again["refresh_token"]
            st, item, _ = await agent_call(s, app.base, "/v1/memory/preference.theme", token=again["access_token"],
                                           agent_id=a.agent_id)
            assert st == 200
        # another agent's certificate with a's refresh token: refused (binding + agent)
        b = app.agent("agent_b")
        async with agent_session(b, home) as s:
            status, err = await refresh(s, app, b, sid, rt)
            assert status in (401, 403) and err["error"]["code"] in ("AGENT_MISMATCH", "TOKEN_BINDING_MISMATCH")


async def test_reuse_after_grace_revokes_session(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, refresh=True)
        sid = g["session_id"]
        async with agent_session(a, home) as s:
            status, first = await refresh(s, app, a, sid, g["refresh_token"])
            assert status == 200
        # let the reuse grace (10 s) pass: age the spent record in the real session database
        import sqlite3

        db = sqlite3.connect(home.auth_db)
        db.execute("UPDATE refresh_tokens SET spent_at = spent_at - 3600 WHERE status='spent'")
        db.commit()
        db.close()
        async with agent_session(a, home) as s:
            status, err = await refresh(s, app, a, sid, g["refresh_token"])
            assert status == 401 and err["error"]["code"] == "REFRESH_REUSED"
            # the whole family is dead, and so is the session
            status, err = await refresh(s, app, a, sid, first["refresh_token"])
            assert status == 401 and err["error"]["code"] == "SESSION_REVOKED"
            st, err, _ = await agent_call(s, app.base, "/v1/memory/preference.theme", token=first["access_token"],
                                          agent_id=a.agent_id)
            assert st == 401 and err["error"]["code"] == "SESSION_REVOKED"


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
        files = ca_store.issue_with_key(home, "agent_a", home.home / "agents-test" / "agent_a", dt.timedelta(hours=1),
                                        now=ca.utcnow() - dt.timedelta(minutes=50))
        a = Agent("agent_a", files)
        async with agent_session(a, home) as s:
            status, body, _ = await agent_call(s, app.base, "/v1/certificates/renew", token=None, agent_id=None,
                                               method="POST", json_body={})
        assert status == 200, body
        new = x509.load_pem_x509_certificate(body["certificate"].encode())
        old = x509.load_pem_x509_certificate(a.files.cert_file.read_bytes())
        assert ca.agent_id_from_cert(new) == "agent_a" and new.serial_number != old.serial_number
        spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        assert new.public_key().public_bytes(*spki) == old.public_key().public_bytes(*spki)  # same key
        # without a client certificate: refused
        async with agent_session(None, home) as s:
            status, body, _ = await agent_call(s, app.base, "/v1/certificates/renew", token=None, agent_id=None,
                                               method="POST", json_body={})
        assert status == 401 and body["error"]["code"] == "CERT_REQUIRED"


async def _tunnel_call(app: Appliance, method: str, path: str, *, token: str | None, agent: str,
                       proof: str | None, host: str = "tunnel.example") -> tuple[int, Any]:
    hdrs = {"Host": host, "X-UOMP-Agent-Id": agent}
    if token:
        hdrs["Authorization"] = f"DPoP {token}"
    if proof:
        hdrs["DPoP"] = proof
    async with aiohttp.ClientSession() as s, s.request(
            method, f"http://127.0.0.1:{app.gateway.tunnel_port}{path}", headers=hdrs) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_dpop_tunnel_listener(home: Paths) -> None:
    async with appliance(home, tunnel_origin_port=0, endpoints=[TUNNEL]) as app:
        a = app.agent("agent_a")
        g = await app.grant(a, audience=TUNNEL, refresh=True)
        key = agent_key(a)
        url = TUNNEL + "/v1/memory/preference.theme"
        now = time.time()
        proof = dpop.make_dpop_proof(key, method="GET", url=url, access_token=g["token"], now=now)
        status, body = await _tunnel_call(app, "GET", "/v1/memory/preference.theme", token=g["token"],
                                          agent="agent_a", proof=proof)
        assert status == 200 and body["value"] == "dark"
        other_key = agent_key(app.agent("agent_b"))
        rows = [
            ("replayed proof", proof, "DPOP_INVALID"),
            ("no proof", None, "DPOP_INVALID"),
            ("other url", dpop.make_dpop_proof(key, method="GET", url=TUNNEL + "/v1/audit", access_token=g["token"],
                                               now=now), "DPOP_INVALID"),
            ("other method", dpop.make_dpop_proof(key, method="POST", url=url, access_token=g["token"], now=now),
             "DPOP_INVALID"),
            ("other key", dpop.make_dpop_proof(other_key, method="GET", url=url, access_token=g["token"], now=now),
             "DPOP_INVALID"),
        ]
        for name, p, code in rows:
            status, body = await _tunnel_call(app, "GET", "/v1/memory/preference.theme", token=g["token"],
                                              agent="agent_a", proof=p)
            assert (status, body["error"]["code"]) == (401, code), name
        # an unknown host on the tunnel listener
        p = dpop.make_dpop_proof(key, method="GET", url="https://evil.example/v1/memory/preference.theme",
                                 access_token=g["token"], now=now)
        status, body = await _tunnel_call(app, "GET", "/v1/memory/preference.theme", token=g["token"],
                                          agent="agent_a", proof=p, host="evil.example")
        assert status == 401 and body["error"]["code"] == "DPOP_INVALID"
        # renewal is an mTLS-only route: it does not exist on the tunnel listener
        status, body = await _tunnel_call(app, "POST", "/v1/certificates/renew", token=None, agent="agent_a",
                                          proof=None)
        assert status == 404 and body["error"]["code"] == "NOT_FOUND"
        # refresh over the tunnel with DPoP
        rurl = f"{TUNNEL}/v1/sessions/{g['session_id']}/refresh"
        p = dpop.make_dpop_proof(key, method="POST", url=rurl, access_token=g["refresh_token"], now=time.time())
        status, body = await _tunnel_call(app, "POST", f"/v1/sessions/{g['session_id']}/refresh",
                                          token=g["refresh_token"], agent="agent_a", proof=p)
        assert status == 200 and body["refresh_token"] != g["refresh_token"]
        # a token not bound to a DPoP key is useless through the tunnel
        unbound = await app.grant(a, audience=TUNNEL, bind=False)
        p = dpop.make_dpop_proof(key, method="GET", url=url, access_token=unbound["token"], now=time.time())
        status, body = await _tunnel_call(app, "GET", "/v1/memory/preference.theme", token=unbound["token"],
                                          agent="agent_a", proof=p)
        assert status == 401 and body["error"]["code"] == "TOKEN_BINDING_MISMATCH"
