"""Memory Guard + Auth Service over a real Unix socket and loopback TCP, real SQLite files."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import time
from typing import Any

import aiohttp
import pytest
from guardkit import admin_headers, call, grant, guard_config, running_guard, seed, unix_session

from gateway import keys
from gateway.config import Paths
from gateway.core import capability, tokens

READ_PREFS = {
    "tags": ["preference"],
    "keys": ["user.passport"],
    "deny_keys": ["preference.lang"],
    "deny_tags": ["private"],
}


@pytest.fixture
def seeded(home: Paths) -> Paths:
    seed(home)
    return home


async def test_socket_is_private_and_health_needs_nothing(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        assert stat.S_IMODE(os.stat(seeded.guard_sock).st_mode) == 0o600
        status, body, _ = await call(s, "GET", "/v1/health")
        assert (status, body) == (200, {"status": "ok"})


async def test_read_rules_deny_before_allow_and_sensitivity(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        tok = (await grant(s, seeded, read=READ_PREFS))["token"]
        # allowed by tag
        status, body, hdrs = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
        assert status == 200 and body["value"] == "dark" and body["tags"] == ["preference", "ui"]
        assert hdrs["X-UOMP-Quota-Remaining"] == "99"
        # high sensitivity: only by explicit key (passport is granted by key, password is not)
        status, body, _ = await call(s, "GET", "/v1/memory/user.passport", token=tok)
        assert status == 200 and body["value"] == "X1234567"
        assert "sensitivity" not in body and "source" not in body  # §19.2 default for high items
        denied = {}
        for key in (
            "user.password",
            "preference.lang",
            "preference.secret_hobby",
            "user.display_name",
            "does.not.exist",
        ):
            status, body, _ = await call(s, "GET", f"/v1/memory/{key}", token=tok)
            assert status == 403 and body["error"]["code"] == "ACCESS_DENIED", key
            denied[key] = body
        # no existence leak: a missing key answers exactly like an existing, denied one
        assert denied["does.not.exist"] == denied["user.password"] == denied["preference.secret_hobby"]
        assert denied["preference.lang"]["error"]["message"] == "key explicitly denied"
        # tag read re-filters every item by key rules
        status, body, _ = await call(s, "GET", "/v1/memory?tag=preference", token=tok)
        assert status == 200
        assert sorted(i["key"] for i in body["items"]) == ["preference.theme", "user.passport"]
        status, body, _ = await call(s, "GET", "/v1/memory?tag=identity", token=tok)
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
        status, body, _ = await call(s, "GET", "/v1/memory?tag=private", token=tok)
        assert status == 403 and body["error"]["message"] == "tag explicitly denied"


async def test_allowed_fields_filter_every_item(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        tok = (await grant(s, seeded, read={"tags": ["preference"], "keys": []}, allowed_fields=["key", "value"]))[
            "token"
        ]
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
        assert (status, body) == (200, {"key": "preference.theme", "value": "dark"})
        status, body, _ = await call(s, "GET", "/v1/memory?tag=preference", token=tok)
        assert all(set(i) == {"key", "value"} for i in body["items"])


async def test_aggregate_and_aggregation_only(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        # min/max single out one value: they need the user's explicit grant (docs/aggregates.md)
        tok = (
            await grant(
                s,
                seeded,
                read={"tags": ["portfolio:holdings", "portfolio:tiny"], "keys": []},
                aggregation_only=True,
                aggregate_min_max=True,
            )
        )["token"]
        q = "/v1/memory/aggregate?tag=portfolio:holdings&field=value.market_value&op="
        expected = {"sum": 39000, "avg": 13000, "min": 7000, "max": 20000}
        for op, result in expected.items():
            status, body, _ = await call(s, "GET", q + op, token=tok)
            assert status == 200 and body == {"op": op, "field": "value.market_value", "result": result}
        status, body, _ = await call(s, "GET", "/v1/memory/aggregate?tag=portfolio:holdings&op=count", token=tok)
        assert body == {"op": "count", "tag": "portfolio:holdings", "result": 3}
        # fewer than 3 items: refused so min/max cannot single out a value
        status, body, _ = await call(
            s, "GET", "/v1/memory/aggregate?tag=portfolio:tiny&op=max&field=value.market_value", token=tok
        )
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
        # aggregation_only: raw reads refused
        for path in ("/v1/memory/h.aapl", "/v1/memory?tag=portfolio:holdings"):
            status, body, _ = await call(s, "GET", path, token=tok)
            assert status == 403 and body["error"]["message"] == "token only permits aggregation queries"
        # a tag outside the grant cannot be aggregated
        status, body, _ = await call(s, "GET", "/v1/memory/aggregate?tag=preference&op=count", token=tok)
        assert status == 403


async def test_quota_enforced_and_survives_restart(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        tok = (await grant(s, seeded, read={"tags": ["preference"], "keys": []}, limits={"max_read_queries": 3}))[
            "token"
        ]
        results = await asyncio.gather(*[call(s, "GET", "/v1/memory/preference.theme", token=tok) for _ in range(2)])
        assert [r[0] for r in results] == [200, 200]
    async with running_guard(seeded), unix_session(seeded) as s:
        # a clean restart keeps the exact count: one left
        status, _, hdrs = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
        assert status == 200 and hdrs["X-UOMP-Quota-Remaining"] == "0"
        status, body, hdrs = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
        assert status == 429 and body["error"]["code"] == "QUOTA_EXCEEDED"
        assert hdrs["X-UOMP-Quota-Remaining"] == "0"


async def test_quota_atomic_under_concurrency(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        tok = (await grant(s, seeded, read={"tags": ["preference"], "keys": []}, limits={"max_read_queries": 10}))[
            "token"
        ]
        results = await asyncio.gather(*[call(s, "GET", "/v1/memory/preference.theme", token=tok) for _ in range(40)])
        assert sorted(r[0] for r in results) == [200] * 10 + [429] * 30


async def test_revoke_close_and_expiry(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        g = await grant(s, seeded, read={"tags": ["preference"], "keys": []})
        tok, sid = g["token"], g["session_id"]
        assert (await call(s, "GET", "/v1/memory/preference.theme", token=tok))[0] == 200
        status, body, _ = await call(s, "POST", f"/v1/sessions/{sid}/revoke", headers=admin_headers(seeded))
        assert (status, body["status"]) == (200, "revoked")
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
        assert status == 401 and body["error"]["code"] == "SESSION_REVOKED"
        # persisted in the blacklist (§13.4)
        db = sqlite3.connect(seeded.auth_db)
        assert db.execute("SELECT count(*) FROM token_blacklist WHERE session_id=?", (sid,)).fetchone()[0] == 1
        db.close()
        # close
        g2 = await grant(s, seeded, read={"tags": ["preference"], "keys": []})
        await call(s, "POST", f"/v1/sessions/{g2['session_id']}/close", headers=admin_headers(seeded))
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=g2["token"])
        assert status == 401 and body["error"]["code"] == "SESSION_REVOKED"
        # grant on a closed session is refused
        status, body, _ = await call(
            s,
            "POST",
            f"/v1/sessions/{g2['session_id']}/grant",
            headers=admin_headers(seeded),
            json_body={"granted_scopes": {}},
        )
        assert status == 409 and body["error"]["code"] == "INVALID_STATE"


async def test_expired_token_and_session(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        g = await grant(s, seeded, read={"tags": ["preference"], "keys": []}, token_lifetime_seconds=10)
        signing = keys.load_signing_key(seeded)
        # same claims, already expired, validly signed: TOKEN_EXPIRED
        now = time.time()
        claims = tokens.capability_claims(
            session_id=g["session_id"],
            agent_id="calendar_agent",
            now=now - 100,
            expires=now - 1,
            read=capability.Scope(tags=("preference",)),
        )
        expired = tokens.sign_token(claims, signing.key, signing.kid)
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=expired)
        assert status == 401 and body["error"]["code"] == "TOKEN_EXPIRED"


async def test_management_needs_admin_credential(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        g = await grant(s, seeded, read={"tags": ["preference"], "keys": []})
        for method, path in (
            ("POST", "/v1/sessions"),
            ("GET", "/v1/sessions"),
            ("POST", f"/v1/sessions/{g['session_id']}/revoke"),
            ("POST", f"/v1/sessions/{g['session_id']}/close"),
            ("POST", f"/v1/sessions/{g['session_id']}/grant"),
            ("GET", f"/v1/sessions/{g['session_id']}"),
        ):
            for hdrs in ({}, {"Authorization": f"Bearer {g['token']}"}, {"Authorization": "Bearer uadm_wrong"}):
                if path.startswith(f"/v1/sessions/{g['session_id']}") and path.endswith(("close", g["session_id"])):
                    if "Authorization" in hdrs and "uadm" not in hdrs["Authorization"]:
                        continue  # its own session's close and status: tests/client/test_agent_self.py
                status, body, _ = await call(s, method, path, headers=hdrs, json_body={})
                assert status == 401 and body["error"]["code"] == "UNAUTHORIZED", (method, path, hdrs)
        status, body, _ = await call(s, "GET", "/v1/sessions", headers=admin_headers(seeded))
        assert status == 200 and body["sessions"][0]["session_id"] == g["session_id"]
        assert "token" not in str(body["sessions"][0]).lower().replace("token_", "")


async def test_grant_must_not_exceed_request(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        body = {"agent_id": "a1", "requested_scopes": {"read": {"tags": ["preference"], "keys": []}}}
        _, created, _ = await call(s, "POST", "/v1/sessions", headers=admin_headers(seeded), json_body=body)
        sid = created["session_id"]
        wider = {"granted_scopes": {"read": {"tags": ["preference", "identity"], "keys": []}}}
        status, err, _ = await call(
            s, "POST", f"/v1/sessions/{sid}/grant", headers=admin_headers(seeded), json_body=wider
        )
        assert status == 400 and err["error"]["code"] == "INVALID_REQUEST"
        status, ok, _ = await call(
            s, "POST", f"/v1/sessions/{sid}/grant", headers=admin_headers(seeded), json_body={**wider, "widen": True}
        )
        assert status == 200 and ok["token_type"] == "Bearer"
        # write scopes are never granted (§20.4)
        _, created, _ = await call(s, "POST", "/v1/sessions", headers=admin_headers(seeded), json_body=body)
        status, err, _ = await call(
            s,
            "POST",
            f"/v1/sessions/{created['session_id']}/grant",
            headers=admin_headers(seeded),
            json_body={"granted_scopes": {"write": {"tags": ["x"], "keys": []}}, "widen": True},
        )
        assert status == 403 and err["error"]["code"] == "WRITE_NOT_AVAILABLE"


async def test_writes_and_query_refused_and_audit_own_session(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        a = await grant(s, seeded, read={"tags": ["preference"], "keys": []})
        b = await grant(s, seeded, read={"tags": ["preference"], "keys": []}, agent_id="other")
        for method in ("PUT", "DELETE"):
            status, body, _ = await call(s, method, "/v1/memory/preference.theme", token=a["token"], json_body={})
            assert status == 403 and body["error"]["code"] == "WRITE_NOT_AVAILABLE"
        status, body, _ = await call(s, "POST", "/v1/memory/query", token=a["token"], json_body={"q": "x"})
        assert status == 501 and body["error"]["code"] == "NOT_IMPLEMENTED"
        await call(s, "GET", "/v1/memory/preference.theme", token=a["token"])
        await call(s, "GET", "/v1/memory/user.password", token=a["token"])
        status, body, _ = await call(s, "GET", "/v1/audit", token=a["token"])
        assert status == 200
        logs = body["logs"]
        assert {entry["session_id"] for entry in logs} == {a["session_id"]}
        reads = [e for e in logs if e["action"] == "read"]
        assert [e["allowed"] for e in reads] == [False, True]  # newest first
        assert reads[1]["query_count_remaining"] == 99 and reads[0]["key"] == "user.password"
        assert all("detail" not in e for e in logs)
        for field in ("timestamp", "session_id", "agent_id", "action", "allowed", "reason"):
            assert field in reads[0]
        status, body, _ = await call(s, "GET", f"/v1/audit?session_id={b['session_id']}", token=a["token"])
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"


async def test_tcp_listener_takes_local_tokens_only(seeded: Paths) -> None:
    cfg = guard_config()
    async with running_guard(seeded, cfg) as g, unix_session(seeded) as s, aiohttp.ClientSession() as tcp:
        base = f"http://127.0.0.1:{g.tcp_port}"
        local = await grant(
            s, seeded, read={"tags": ["preference"], "keys": []}, audience=f"http://127.0.0.1:{cfg.tcp_port}"
        )
        # the audience names the configured port (9374 by default); the test binds port 0, so check
        # acceptance with a token minted for that same configured port
        status, body, _ = await call(tcp, "GET", "/v1/memory/preference.theme", token=local["token"], base=base)
        assert status == 200, body
        bound = await grant(s, seeded, read={"tags": ["preference"], "keys": []}, audience=base)
        status, body, _ = await call(tcp, "GET", "/v1/memory/preference.theme", token=bound["token"], base=base)
        assert status == 200, body  # the port actually bound is an audience too
        remote = await grant(
            s, seeded, read={"tags": ["preference"], "keys": []}, profile="remote", audience="https://gw.example:9443"
        )
        status, body, _ = await call(tcp, "GET", "/v1/memory/preference.theme", token=remote["token"], base=base)
        assert status == 401 and body["error"]["code"] == "INVALID_TOKEN"
        wrong_aud = await grant(s, seeded, read={"tags": ["preference"], "keys": []}, audience="http://10.0.0.9:9374")
        status, body, _ = await call(tcp, "GET", "/v1/memory/preference.theme", token=wrong_aud["token"], base=base)
        assert status == 401 and body["error"]["code"] == "INVALID_TOKEN"
        # the internal refresh route does not exist on TCP
        status, body, _ = await call(
            tcp, "POST", f"/v1/sessions/{remote['session_id']}/refresh", token=remote["token"], base=base
        )
        assert status == 404 and body["error"]["code"] == "NOT_FOUND"


async def test_validate_endpoint(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        g = await grant(s, seeded, read={"tags": ["preference"], "keys": []})
        status, body, _ = await call(s, "POST", "/v1/tokens/validate", json_body={"token": g["token"]})
        assert status == 200 and body["valid"] is True and body["session_id"] == g["session_id"]
        await call(s, "POST", f"/v1/sessions/{g['session_id']}/revoke", headers=admin_headers(seeded))
        status, body, _ = await call(s, "POST", "/v1/tokens/validate", json_body={"token": g["token"]})
        assert body == {
            "valid": False,
            "code": "SESSION_REVOKED",
            "session_id": g["session_id"],
            "message": "session is revoked: revoked by the user",
        }
        status, body, _ = await call(s, "POST", "/v1/tokens/validate", json_body={"token": "x.y.z"})
        assert body["valid"] is False and body["code"] == "INVALID_TOKEN"


BAD_INPUTS: list[tuple[str, str, str, Any, str, int]] = [
    # name, method, path, body (bytes = raw), expected code, expected status
    ("malformed json", "POST", "/v1/sessions", b"{not json", "INVALID_REQUEST", 400),
    ("json array", "POST", "/v1/sessions", b"[1,2]", "INVALID_REQUEST", 400),
    ("agent_id number", "POST", "/v1/sessions", {"agent_id": 5}, "INVALID_REQUEST", 400),
    ("agent_id empty", "POST", "/v1/sessions", {"agent_id": ""}, "INVALID_REQUEST", 400),
    ("scopes not object", "POST", "/v1/sessions", {"agent_id": "a", "requested_scopes": "all"}, "INVALID_REQUEST", 400),
    (
        "scope tags not list",
        "POST",
        "/v1/sessions",
        {"agent_id": "a", "requested_scopes": {"read": {"tags": "x"}}},
        "INVALID_REQUEST",
        400,
    ),
    (
        "unknown scope action",
        "POST",
        "/v1/sessions",
        {"agent_id": "a", "requested_scopes": {"admin": {}}},
        "INVALID_REQUEST",
        400,
    ),
    ("duration huge", "POST", "/v1/sessions", {"agent_id": "a", "duration_minutes": 10**9}, "INVALID_REQUEST", 400),
    ("duration bool", "POST", "/v1/sessions", {"agent_id": "a", "duration_minutes": True}, "INVALID_REQUEST", 400),
    (
        "identity jwk junk",
        "POST",
        "/v1/sessions",
        {"agent_id": "a", "identity_public_jwk": {"kty": "RSA"}},
        "INVALID_REQUEST",
        400,
    ),
    ("oversized body", "POST", "/v1/sessions", b"{" + b" " * 70000 + b"}", "PAYLOAD_TOO_LARGE", 413),
    ("grant unknown session", "POST", "/v1/sessions/sess_nope/grant", {"granted_scopes": {}}, "SESSION_NOT_FOUND", 404),
    ("unknown route", "GET", "/v1/nothing", None, "NOT_FOUND", 404),
    ("wrong method", "PATCH", "/v1/sessions", None, "METHOD_NOT_ALLOWED", 405),
    ("validate token number", "POST", "/v1/tokens/validate", {"token": 5}, "INVALID_REQUEST", 400),
]


@pytest.mark.parametrize(
    ("name", "method", "path", "body", "code", "status"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
async def test_bad_management_inputs(
    seeded: Paths, name: str, method: str, path: str, body: Any, code: str, status: int
) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        kwargs: dict[str, Any] = {"headers": {**admin_headers(seeded), "Content-Type": "application/json"}}
        if isinstance(body, bytes):
            kwargs["data"] = body
        elif body is not None:
            kwargs["json"] = body
        async with s.request(method, "http://guard" + path, **kwargs) as resp:
            got = await resp.json(content_type=None)
            assert resp.status == status, got
            assert got["error"]["code"] == code


BAD_AGENT_INPUTS = [
    ("no auth header", "/v1/memory/preference.theme", None, "INVALID_TOKEN", 401),
    ("basic auth", "/v1/memory/preference.theme", "Basic abc", "INVALID_TOKEN", 401),
    ("garbage token", "/v1/memory/preference.theme", "Bearer abc", "INVALID_TOKEN", 401),
    ("tag missing", "/v1/memory", "TOKEN", "INVALID_REQUEST", 400),
    ("tag twice", "/v1/memory?tag=a&tag=b", "TOKEN", "INVALID_REQUEST", 400),
    ("tag too long", "/v1/memory?tag=" + "x" * 300, "TOKEN", "INVALID_REQUEST", 400),
    ("aggregate bad op", "/v1/memory/aggregate?tag=preference&op=median&field=value", "TOKEN", "INVALID_REQUEST", 400),
    ("aggregate no field", "/v1/memory/aggregate?tag=preference&op=sum", "TOKEN", "INVALID_REQUEST", 400),
    # a bare name is short for value.NAME (field=key is value.key, never the item's key:
    # tests/guard/test_aggregate_field.py); what is no path at all is refused
    (
        "aggregate field no path",
        "/v1/memory/aggregate?tag=preference&op=sum&field=key%24",
        "TOKEN",
        "INVALID_REQUEST",
        400,
    ),
    ("audit limit junk", "/v1/audit?limit=lots", "TOKEN", "INVALID_REQUEST", 400),
    ("audit limit huge", "/v1/audit?limit=100000", "TOKEN", "INVALID_REQUEST", 400),
    # what int() accepts but a limit is not: underscores, a sign, spaces, non-ASCII digits, zero
    ("audit limit underscore", "/v1/audit?limit=1_0", "TOKEN", "INVALID_REQUEST", 400),
    ("audit limit plus", "/v1/audit?limit=%2B5", "TOKEN", "INVALID_REQUEST", 400),
    ("audit limit spaced", "/v1/audit?limit=%205", "TOKEN", "INVALID_REQUEST", 400),
    ("audit limit arabic digit", "/v1/audit?limit=%D9%A5", "TOKEN", "INVALID_REQUEST", 400),
    ("audit limit zero", "/v1/audit?limit=0", "TOKEN", "INVALID_REQUEST", 400),
    ("audit limit empty", "/v1/audit?limit=", "TOKEN", None, 200),  # absent: the default
    ("audit limit plain", "/v1/audit?limit=5", "TOKEN", None, 200),
    ("audit limit largest", "/v1/audit?limit=1000", "TOKEN", None, 200),
]


@pytest.mark.parametrize(
    ("name", "path", "auth", "code", "status"), BAD_AGENT_INPUTS, ids=[b[0] for b in BAD_AGENT_INPUTS]
)
async def test_bad_agent_inputs(
    seeded: Paths, name: str, path: str, auth: str | None, code: str | None, status: int
) -> None:
    async with running_guard(seeded), unix_session(seeded) as s:
        tok = (await grant(s, seeded, read={"tags": ["preference"], "keys": []}))["token"]
        hdrs = (
            {}
            if auth is None
            else {"Authorization": auth.replace("TOKEN", f"Bearer {tok}") if auth == "TOKEN" else auth}
        )
        status_got, body, _ = await call(s, "GET", path, headers=hdrs)
        if code is None:  # the allowed partners
            assert status_got == status and isinstance(body["logs"], list), body
        else:
            assert (status_got, body["error"]["code"]) == (status, code)


async def test_store_unavailable_is_503_not_crash(seeded: Paths) -> None:
    async with running_guard(seeded) as g, unix_session(seeded) as s:
        tok = (await grant(s, seeded, read={"tags": ["preference"], "keys": []}))["token"]
        assert g.services is not None
        # an exclusive lock held by another connection past the busy timeout
        g.services.store.close()
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
        assert status == 503 and body["error"]["code"] == "STORE_UNAVAILABLE"
        status, _, _ = await call(s, "GET", "/v1/health")
        assert status == 200


async def test_key_rotation_keeps_live_tokens(seeded: Paths) -> None:
    async with running_guard(seeded) as g, unix_session(seeded) as s:
        old = (await grant(s, seeded, read={"tags": ["preference"], "keys": []}))["token"]
        keys.rotate(seeded, max_token_lifetime=3600)
        g.reload_keys()
        new = (await grant(s, seeded, read={"tags": ["preference"], "keys": []}))["token"]
        assert tokens.jose.parse_compact(old).header["kid"] != tokens.jose.parse_compact(new).header["kid"]
        for tok in (old, new):
            assert (await call(s, "GET", "/v1/memory/preference.theme", token=tok))[0] == 200


async def test_typescript_shaped_token_is_accepted_and_enforced(seeded: Paths) -> None:
    """Claims as the public TypeScript reference writes them: camelCase inside scopes/limits, no jti."""
    async with running_guard(seeded), unix_session(seeded) as s:
        g = await grant(s, seeded, read={"tags": ["preference"], "keys": []})
        signing = keys.load_signing_key(seeded)
        now = int(time.time())
        claims = {
            "version": "1.0",
            "session_id": g["session_id"],
            "agent_id": "calendar_agent",
            "issued_at": tokens.iso(now),
            "expires_at": tokens.iso(now + 600),
            "scopes": {
                "read": {"tags": ["preference"], "keys": [], "denyTags": ["ui"], "denyKeys": []},
                "write": {"tags": [], "keys": [], "denyTags": [], "denyKeys": []},
            },
            "limits": {"maxReadQueries": 100, "maxWriteQueries": 0},
            "profile": "local",
            "audience": "http://127.0.0.1:9374",
            "aggregation_only": False,
            "task_bound": False,
            "iat": now,
            "exp": now + 600,
        }
        tok = tokens.jose.sign_compact({"alg": "EdDSA", "kid": signing.kid}, claims, signing.key)
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
        assert status == 403  # denyTags ["ui"] honoured
        status, body, _ = await call(s, "GET", "/v1/memory/preference.secret_hobby", token=tok)
        assert status == 200 and body["value"] == "lockpicking"


async def test_non_loopback_bind_refused_unless_forced(seeded: Paths) -> None:
    from gateway.errors import UompError
    from gateway.guard.server import GuardRunner

    runner = GuardRunner(seeded, guard_config(tcp_host="0.0.0.0"))
    with pytest.raises(UompError) as exc:
        await runner.start()
    assert exc.value.code == "CONFIG_ERROR" and "not loopback" in exc.value.message
    assert not seeded.guard_sock.exists()


async def test_second_guard_on_same_socket_refused(seeded: Paths) -> None:
    from gateway.errors import UompError
    from gateway.guard.server import GuardRunner

    async with running_guard(seeded, serve_tcp=False), unix_session(seeded) as s:
        with pytest.raises(UompError) as exc:
            await GuardRunner(seeded, guard_config(), serve_tcp=False).start()
        assert "already listening" in exc.value.message
        assert (await call(s, "GET", "/v1/health"))[0] == 200  # the first one is untouched


def test_audit_retention_purges_old_rows(home: Paths) -> None:
    from gateway.guard.audit import AuditLog

    log = AuditLog(home.audit_db, retention_days=90)
    now = time.time()
    log.record(session_id="s1", agent_id="a", action="read", allowed=True, reason="r", now=now - 91 * 86400)
    log.record(session_id="s1", agent_id="a", action="read", allowed=False, reason="r", now=now - 89 * 86400)
    log.flush_sync()
    assert log.purge(now=now) == 1
    rows = log.for_session("s1")
    assert len(rows) == 1 and rows[0]["allowed"] is False
    log.close()
