"""One log: every decision of the gateway lands once in the guard's ledger, a forwarded read
costs one durable write (the guard's), one quota counter (the guard's), refused TLS handshakes are
events, and the gateway's spool carries its events over a guard outage, replayed exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
from gatewaykit import Appliance, agent_call, agent_session, appliance, ledger_events, verify_ledger
from guardkit import running_guard, seed, unix_session
from test_handshake_log import _client, _handshake

from gateway import ca_store
from gateway.config import GatewayConfig, Paths
from gateway.remote.server import GatewayRunner


def _ids(events: list[dict[str, Any]]) -> list[str]:
    return [e["id"] for e in events]


async def test_gateway_refusals_land_once_in_the_guards_ledger(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("calendar_agent")
        other = app.agent("other_agent")
        g = await app.grant(a)
        async with agent_session(None, home) as anon:  # no client certificate
            status, body, _ = await agent_call(anon, app.base, "/v1/memory/x", token=g["token"], agent_id=a.agent_id)
            assert (status, body["error"]["code"]) == (401, "CERT_REQUIRED")
        async with agent_session(a, home) as s:
            cases = [
                ("/v1/memory/x", "GET", "not-a-token", a.agent_id, None, "INVALID_TOKEN"),
                ("/v1/nope", "GET", g["token"], a.agent_id, None, "NOT_FOUND"),
                ("/v1/memory/aggregate", "POST", g["token"], a.agent_id, None, "METHOD_NOT_ALLOWED"),
                ("/v1/memory/x", "GET", g["token"], "someone_else", None, "AGENT_MISMATCH"),
                (
                    "/v1/memory/x",
                    "GET",
                    g["token"],
                    a.agent_id,
                    {"X-UOMP-Verified-Listener": "tunnel"},
                    "INVALID_REQUEST",
                ),
            ]
            for path, method, token, agent_id, headers, code in cases:
                status, body, _ = await agent_call(
                    s, app.base, path, method=method, token=token, agent_id=agent_id, headers=headers
                )
                assert body["error"]["code"] == code, (path, body)
        async with agent_session(other, home) as s2:  # another agent's certificate with this token
            status, body, _ = await agent_call(s2, app.base, "/v1/memory/x", token=g["token"], agent_id=a.agent_id)
            assert body["error"]["code"] == "AGENT_MISMATCH"
        await app.gateway.state.events.close()  # type: ignore[union-attr]
        for code in ("CERT_REQUIRED", "INVALID_TOKEN", "NOT_FOUND", "METHOD_NOT_ALLOWED", "INVALID_REQUEST"):
            evs = ledger_events(home, code=code)
            assert len(evs) == 1, (code, evs)
            ev = evs[0]
            assert ev["listener"] == "mtls" and ev["via"].startswith("gateway:") and ev["allowed"] is False
            assert ev["origin"] == "gateway" and ev["client"] == "127.0.0.1" and ev["request_id"].startswith("req_")
            assert ev["id"].startswith("gw_") and "reason" in ev and "agent_id" in ev and "session_id" in ev
        assert len(ledger_events(home, code="AGENT_MISMATCH")) == 2
        assert ledger_events(home, code="CERT_REQUIRED")[0].get("cert_serial") is None
        assert ledger_events(home, code="INVALID_TOKEN")[0]["cert_serial"]  # the mTLS identity was known
        # nothing went to the spool: the guard took every event
        assert not (home.gateway_dir / "access.jsonl").read_bytes()
        assert verify_ledger(home).ok


async def test_forwarded_read_is_one_event_with_the_gateways_fields(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        before = len(ledger_events(home))
        async with agent_session(a, home) as s:
            status, body, hdrs = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and body["value"] == "dark"
            assert "X-UOMP-Event-Id" not in hdrs  # the guard's answer to the gateway stays inside
            status, body, _ = await agent_call(
                s, app.base, "/v1/memory/secret.key", token=g["token"], agent_id=a.agent_id
            )
            assert (status, body["error"]["code"]) == (403, "ACCESS_DENIED")
        after = ledger_events(home)[before:]
        assert [e["action"] for e in after] == ["read", "read"]  # one event each, not two
        ok, denied = after
        assert ok["allowed"] is True and ok["key"] == "preference.theme" and ok["listener"] == "mtls"
        assert ok["client"] == "127.0.0.1" and ok["request_id"].startswith("req_") and ok["cert_fp"] == a.x5t
        assert ok["via"] == f"gateway:mtls:{ok['cert_serial']}" and ok["query_count_remaining"] == 99
        assert denied["allowed"] is False and denied["code"] == "ACCESS_DENIED" and denied["listener"] == "mtls"
        assert ok["request_id"] != denied["request_id"]
        assert not (home.gateway_dir / "access.jsonl").read_bytes()


async def test_client_cannot_forge_the_gateways_audit_headers(home: Paths) -> None:
    forged = {
        "X-UOMP-Verified-Listener": "tunnel",
        "X-UOMP-Verified-Client": "10.9.9.9",
        "X-UOMP-Verified-Cert-Serial": "ff",
        "X-UOMP-Verified-Request-Id": "req_forged",
    }
    async with appliance(home) as app:
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        async with agent_session(a, home) as s:
            for name, value in forged.items():
                status, body, _ = await agent_call(
                    s,
                    app.base,
                    "/v1/memory/preference.theme",
                    token=g["token"],
                    agent_id=a.agent_id,
                    headers={name: value},
                )
                assert (status, body["error"]["code"]) == (400, "INVALID_REQUEST"), name
            # and the internal route is not reachable through the gateway
            status, body, _ = await agent_call(
                s,
                app.base,
                "/v1/internal/events",
                method="POST",
                token=g["token"],
                agent_id=a.agent_id,
                json_body={"events": []},
            )
            assert body["error"]["code"] == "NOT_FOUND"
        assert not ledger_events(home, request_id="req_forged") and not ledger_events(home, client="10.9.9.9")
    # The guard's Local Profile TCP listener: refused, and no internal route there.
    async with running_guard(home) as guard, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{guard.tcp_port}"
        for name, value in forged.items():
            async with http.get(base + "/v1/memory/x", headers={name: value, "Authorization": "Bearer x"}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "INVALID_REQUEST"
        async with http.post(base + "/v1/internal/events", json={"events": []}) as r:
            assert r.status in (404, 405)
    assert not ledger_events(home, request_id="req_forged")


async def test_one_quota_counter_the_guards(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("calendar_agent")
        g = await app.grant(a, limits={"max_read_queries": 2})
        async with agent_session(a, home) as s:
            seen = []
            for _ in range(3):
                status, body, hdrs = await agent_call(
                    s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
                )
                seen.append((status, hdrs.get("X-UOMP-Quota-Remaining")))
            assert seen == [(200, "1"), (200, "0"), (429, "0")]
            assert body["error"]["code"] == "QUOTA_EXCEEDED"
        reads = ledger_events(home, action="read")
        assert [e.get("query_count_remaining") for e in reads] == [1, 0, 0]  # the same numbers the agent saw
        assert reads[-1]["code"] == "QUOTA_EXCEEDED" and reads[-1]["listener"] == "mtls"
        assert not (home.gateway_dir / "quota.db").exists()  # no second counter


async def test_rejected_tls_handshakes_are_events(home: Paths, tmp_path: Path) -> None:
    async with appliance(home) as app:
        port = app.gateway.port
        assert port is not None
        await _handshake(port, _client(home, tmp_path, "foreign"))
        await _handshake(port, _client(home, tmp_path, "tls12"))
        for _ in range(100):
            if len(ledger_events(home, action="tls_handshake")) >= 2:
                break
            await asyncio.sleep(0.05)
        evs = ledger_events(home, action="tls_handshake")
        assert sorted(e["detail"] for e in evs) == ["tls_version", "unknown_ca"]
        for e in evs:
            assert e["allowed"] is False and e["code"] == "TLS_HANDSHAKE_REFUSED" and e["listener"] == "mtls"
            assert e["client"] == "127.0.0.1" and "cert_serial" not in e  # Python's ssl cannot show it
        # no certificate at all is not a handshake failure here: it is refused (and logged) per request
        async with agent_session(None, home) as anon:
            _, body, _ = await agent_call(anon, app.base, "/v1/memory/x", token="t", agent_id="a")
            assert body["error"]["code"] == "CERT_REQUIRED"
        await app.gateway.state.events.close()  # type: ignore[union-attr]
        assert len(ledger_events(home, code="CERT_REQUIRED")) == 1


async def test_guard_down_refusals_spooled_then_replayed_exactly_once(home: Paths) -> None:
    ca_store.init_all(home)
    seed(home)
    cfg = dataclasses.replace(GatewayConfig(listen_port=0), access_log_unauth_burst=1000)
    guard_cm = running_guard(home, serve_tcp=False)
    await guard_cm.__aenter__()
    gw = GatewayRunner(home, cfg)
    await gw.start()
    try:
        state = gw.state
        assert state is not None
        async with unix_session(home) as admin:
            app = Appliance(home, gw, admin)
            a = app.agent("calendar_agent")
            g = await app.grant(a)
        base = app.base
        await guard_cm.__aexit__(None, None, None)  # the guard goes away
        async with agent_session(a, home) as s:
            status, body, _ = await agent_call(
                s, base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert (status, body["error"]["code"]) == (503, "STORE_UNAVAILABLE")
            for _ in range(3):
                status, body, _ = await agent_call(s, base, "/v1/nope", token=g["token"], agent_id=a.agent_id)
                assert body["error"]["code"] == "NOT_FOUND"  # answered at once: the event is in the spool
        assert state.events.events_spooled == 4 and state.events.backlog == 4
        guard_cm = running_guard(home, serve_tcp=False)
        await guard_cm.__aenter__()  # the guard is back
        assert await state.events.replay() == 4
        assert await state.events.replay() == 0
        assert len(ledger_events(home, code="NOT_FOUND", listener="mtls")) == 3
        assert len(ledger_events(home, code="STORE_UNAVAILABLE", listener="mtls")) == 1
        # replayed again from scratch (a crash before the marker was written): still once each
        state.events.replayed_seq = 0
        assert await state.events.replay() == 4
        assert len(ledger_events(home, code="NOT_FOUND", listener="mtls")) == 3
        assert verify_ledger(home).ok
    finally:
        await gw.stop()
        with contextlib.suppress(Exception):
            await guard_cm.__aexit__(None, None, None)


async def test_a_flood_of_refusals_is_batched(home: Paths) -> None:
    async with appliance(home, access_log_unauth_burst=1000) as app:
        a = app.agent("calendar_agent")
        state = app.gateway.state
        assert state is not None
        n = 200
        async with agent_session(a, home, limit=10) as s:
            sent = state.events.requests_sent
            answers = await asyncio.gather(
                *[agent_call(s, app.base, "/v1/memory/x", token="garbage", agent_id=a.agent_id) for _ in range(n)]
            )
        assert all(body["error"]["code"] == "INVALID_TOKEN" for _, body, _ in answers)
        internal = state.events.requests_sent - sent
        assert len(ledger_events(home, code="INVALID_TOKEN")) == n
        assert internal <= n // 4, internal  # many refusals per internal request (and group commit)


async def test_unauthenticated_events_beyond_the_rate_are_counted(home: Paths) -> None:
    async with appliance(home, access_log_unauth_burst=5, access_log_unauth_events_per_second=0.001) as app:
        async with agent_session(None, home) as anon:
            for _ in range(12):
                _, body, _ = await agent_call(anon, app.base, "/v1/memory/x", token="t", agent_id="a")
                assert body["error"]["code"] == "CERT_REQUIRED"
        await app.gateway.state.events.close()  # type: ignore[union-attr]
    assert len(ledger_events(home, code="CERT_REQUIRED")) == 5
    summary = ledger_events(home, action="gateway_events_suppressed")
    assert len(summary) == 1 and summary[0]["count"] == 7 and summary[0]["by"] == {"127.0.0.1 CERT_REQUIRED": 7}


async def test_a_revoked_sessions_refused_read_names_the_agent_and_session(home: Paths) -> None:
    # The guard refuses a forwarded read of a revoked session before it has a capability; the
    # event still names the agent the gateway verified (not "unknown"), so the user's timeline and
    # `uomp audit --agent` show it. A direct request without the gateway's assertion stays "unknown".
    from guardkit import admin_headers, call

    async with appliance(home) as app:
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        await call(app.admin, "POST", f"/v1/sessions/{g['session_id']}/revoke", headers=admin_headers(home))
        before = len(ledger_events(home))
        async with agent_session(a, home) as s:
            status, body, _ = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
        assert (status, body["error"]["code"]) == (401, "SESSION_REVOKED")
        status, _, _ = await call(app.admin, "GET", "/v1/memory/preference.theme", token=g["token"])
        assert status == 401
        after = [e for e in ledger_events(home)[before:] if e["action"] == "read"]
        assert len(after) == 2 and all(e["allowed"] is False for e in after)
        forwarded, direct = after
        assert forwarded["agent_id"] == "calendar_agent" and forwarded["session_id"] == g["session_id"]
        assert forwarded["code"] == "SESSION_REVOKED" and forwarded["listener"] == "mtls"
        assert direct["agent_id"] == "unknown"
