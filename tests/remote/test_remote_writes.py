"""Staged agent writes through the real gateway (docs/writes.md): mTLS and the DPoP tunnel-origin
listener forward PUT/DELETE/proposals/withdraw to the guard, which stages the proposal; refusals are
the guard's, with one audit event per request in the one log, and nothing in the store changes."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import aiohttp
import pytest
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance, ledger_events, verify_ledger
from guardkit import guard_config
from test_agent_routes import TUNNEL, agent_key

from gateway.config import Paths
from gateway.core import dpop

SCOPES = {"read": {"tags": ["preference"], "keys": []}, "write": {"tags": ["preference"], "keys": []}}


async def write_grant(app: Appliance, agent: Agent, scopes: dict[str, Any] = SCOPES, **extra: Any) -> dict[str, Any]:
    return await app.grant(agent, requested=scopes, granted_scopes=scopes, **extra)


def items(paths: Paths) -> list[Any]:
    conn = sqlite3.connect(f"file:{paths.memory_db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT key, value, version FROM items ORDER BY key").fetchall()
    finally:
        conn.close()


def proposals(paths: Paths) -> list[Any]:
    conn = sqlite3.connect(f"file:{paths.memory_db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT agent_id, op, key, status, via FROM proposals ORDER BY created_at").fetchall()
    finally:
        conn.close()


async def test_proposals_over_mtls(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("writer")
        g = await write_grant(app, a)
        r = app.agent("reader")
        gr = await app.grant(r)  # read only
        before = items(home)
        async with agent_session(a, home) as s:
            status, body, _ = await agent_call(
                s,
                app.base,
                "/v1/memory/preference.theme",
                token=g["token"],
                agent_id="writer",
                method="PUT",
                json_body={"value": "light", "base_version": 1},
            )
            assert status == 202 and body["status"] == "pending", body
            pid = body["proposal_id"]
            status, own, _ = await agent_call(s, app.base, "/v1/proposals", token=g["token"], agent_id="writer")
            assert status == 200 and [p["proposal_id"] for p in own["proposals"]] == [pid]
            # denied partners, each answered by the guard
            status, err, _ = await agent_call(
                s, app.base, "/v1/memory/user.display_name", token=g["token"], agent_id="writer", method="DELETE"
            )
            assert status == 403 and err["error"]["code"] == "ACCESS_DENIED"
            status, err, _ = await agent_call(
                s,
                app.base,
                "/v1/memory/preference.theme",
                token=g["token"],
                agent_id="writer",
                method="PUT",
                data=b"{broken",
                headers={"Content-Type": "application/json"},
            )
            assert status == 400 and err["error"]["code"] == "INVALID_REQUEST"
            status, err, _ = await agent_call(
                s,
                app.base,
                "/v1/memory/preference.theme",
                token=g["token"],
                agent_id="writer",
                method="PUT",
                json_body={"value": "x" * 70_000},
            )
            assert status == 413 and err["error"]["code"] == "PAYLOAD_TOO_LARGE"  # the guard's body limit
        async with agent_session(r, home) as s:
            status, err, _ = await agent_call(
                s,
                app.base,
                "/v1/memory/preference.theme",
                token=gr["token"],
                agent_id="reader",
                method="PUT",
                json_body={"value": "light"},
            )
            assert status == 403 and err["error"]["code"] == "WRITE_NOT_AVAILABLE"
            # another session's proposal cannot be withdrawn: the same 404 as an unknown one
            status, err, _ = await agent_call(
                s, app.base, f"/v1/proposals/{pid}/withdraw", token=gr["token"], agent_id="reader", method="POST"
            )
            assert status == 404 and err["error"]["code"] == "NOT_FOUND"
        async with agent_session(a, home) as s:
            status, done, _ = await agent_call(
                s, app.base, f"/v1/proposals/{pid}/withdraw", token=g["token"], agent_id="writer", method="POST"
            )
            assert status == 200 and done["status"] == "withdrawn"
        assert items(home) == before
        assert [p[:4] for p in proposals(home)] == [("writer", "put", "preference.theme", "withdrawn")]
        assert proposals(home)[0][4].startswith("gateway:mtls:")  # the listener and the certificate
        writes = ledger_events(home, action="write")
        # one event per request (the guard's; the gateway adds none of its own), the proposal id on the allowed one
        assert [(e["allowed"], e.get("proposal_id") == pid) for e in writes] == [
            (True, True),
            (False, False),
            (False, False),
            (False, False),
        ]
        assert all(e["listener"] == "mtls" for e in writes)
        assert verify_ledger(home).ok  # the proposals' events are in the one verifiable log like every other


async def test_proposal_over_the_dpop_tunnel(home: Paths) -> None:
    async with appliance(home, tunnel_origin_port=0, tunnel_endpoints=[TUNNEL]) as app:
        a = app.agent("writer")
        g = await write_grant(app, a, audience=TUNNEL)
        key = agent_key(a)

        async def tunnel(method: str, path: str, body: bytes | None, proof_method: str | None = None) -> Any:
            proof = dpop.make_dpop_proof(
                key, method=proof_method or method, url=TUNNEL + path, access_token=g["token"], now=time.time()
            )
            hdrs = {
                "Host": "tunnel.example",
                "X-UOMP-Agent-Id": "writer",
                "Authorization": f"DPoP {g['token']}",
                "DPoP": proof,
                "Content-Type": "application/json",
            }
            async with (
                aiohttp.ClientSession() as s,
                s.request(method, f"http://127.0.0.1:{app.gateway.tunnel_port}{path}", headers=hdrs, data=body) as resp,
            ):
                return resp.status, await resp.json(content_type=None)

        status, body = await tunnel("PUT", "/v1/memory/preference.lang", b'{"value": "fr"}')
        assert status == 202 and body["status"] == "pending", body
        status, body = await tunnel("DELETE", "/v1/memory/preference.theme", None)
        assert status == 202 and body["op"] == "delete"
        # a proof made for another method is refused by the gateway before the guard sees it
        status, err = await tunnel("PUT", "/v1/memory/preference.lang", b'{"value": "de"}', proof_method="GET")
        assert status == 401 and err["error"]["code"] == "DPOP_INVALID"
        status, own = await tunnel("GET", "/v1/proposals", None)
        assert status == 200 and len(own["proposals"]) == 2
        assert [p[4].split(":")[:2] for p in proposals(home)] == [["gateway", "tunnel"]] * 2
        got = {k: (v, n) for k, v, n in items(home)}
        assert got["preference.lang"] == ('"en"', 1) and got["preference.theme"] == ('"dark"', 1)


async def test_sdk_proposes_lists_and_withdraws(home: Paths) -> None:
    from gateway.client import UompClient
    from gateway.client.errors import AccessDenied, InvalidRequest, QuotaExceeded
    from gateway.core import ca

    async with appliance(home, guard_cfg=guard_config(write_max_pending_per_session=2)) as app:
        a = app.agent("writer")
        g = await write_grant(app, a)
        c = UompClient(
            agent_id="writer",
            session_id=g["session_id"],
            access_token=g["token"],
            base_url=app.base,
            mode="mtls",
            ca_cert=a.files.ca_file.read_text(),
            agent_cert=a.files.cert_file.read_text(),
            agent_key=ca.load_private_key(a.files.key_file.read_bytes()),
        )
        async with c:
            p = await c.propose("preference.theme", "light", base_version=1)
            assert p["status"] == "pending" and p["base_version"] == 1
            d = await c.propose_delete("preference.lang")
            assert d["op"] == "delete"
            with pytest.raises(QuotaExceeded) as budget:
                await c.propose("preference.theme", "blue")
            assert budget.value.code == "BUDGET_EXCEEDED"
            assert (await c.withdraw(d["proposal_id"]))["status"] == "withdrawn"
            with pytest.raises(InvalidRequest) as stale:
                await c.propose("preference.theme", "blue", base_version=5)
            assert stale.value.code == "VERSION_CONFLICT"
            with pytest.raises(AccessDenied):
                await c.propose("user.passport", "x")
            assert [x["status"] for x in await c.proposals()] == ["withdrawn", "pending"]
        assert dict((k, v) for k, v, _ in items(home))["preference.theme"] == '"dark"'
