"""Staged agent writes on the guard (docs/writes.md): a write scope lets an agent *propose* a change,
through the Local Profile listener (TCP) and the Unix socket; nothing changes in the store until the
user approves; everything outside the grant, over a budget or malformed is refused with a stable
code, audited, and leaves the store and the proposals exactly as they were."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import aiohttp
import pytest
from gatewaykit import ledger_events
from guardkit import admin_headers, call, guard_config, running_guard, seed, unix_session

from gateway.config import Paths
from gateway.core import tokens

WRITE = {"tags": ["preference"], "keys": ["note.todo"], "deny_keys": ["preference.lang"], "deny_tags": ["private"]}
READ = {"tags": ["preference"], "keys": []}


async def write_grant(
    s: aiohttp.ClientSession,
    paths: Paths,
    *,
    write: dict[str, Any] | None = None,
    agent_id: str = "writer",
    **extra: Any,
) -> dict[str, Any]:
    write = WRITE if write is None else write
    scopes = {"read": READ, "write": write}
    body = {"agent_id": agent_id, "requested_scopes": scopes, "duration_minutes": 30}
    status, created, _ = await call(s, "POST", "/v1/sessions", headers=admin_headers(paths), json_body=body)
    assert status == 201, created
    status, granted, _ = await call(
        s,
        "POST",
        f"/v1/sessions/{created['session_id']}/grant",
        headers=admin_headers(paths),
        json_body={"granted_scopes": scopes, **extra},
    )
    return {"status": status, **granted}


def db_state(paths: Paths) -> tuple[list[Any], list[Any], list[Any]]:
    """Items, their history and the proposals, as they are on disk."""
    conn = sqlite3.connect(f"file:{paths.memory_db}?mode=ro", uri=True)
    try:
        return (
            conn.execute("SELECT key, value, tags, sensitivity, source, version FROM items ORDER BY key").fetchall(),
            conn.execute("SELECT * FROM item_versions ORDER BY key, version").fetchall(),
            conn.execute("SELECT proposal_id, status FROM proposals ORDER BY proposal_id").fetchall(),
        )
    finally:
        conn.close()


@pytest.fixture
def seeded(home: Paths) -> Paths:
    seed(home)
    return home


def token_claims(token: str) -> dict[str, Any]:
    import base64

    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


@pytest.mark.parametrize("listener", ["tcp", "unix"])
async def test_proposal_is_stored_not_applied(seeded: Paths, listener: str) -> None:
    async with running_guard(seeded) as guard, unix_session(seeded) as admin:
        g = await write_grant(admin, seeded)
        assert g["status"] == 200, g
        claims = token_claims(g["token"])
        assert claims["scopes"]["write"]["tags"] == ["preference"]  # the §7.1 claim, as the reference writes it
        assert claims["limits"]["max_write_queries"] == guard_config().write_max_per_session
        before = db_state(seeded)
        base = f"http://127.0.0.1:{guard.tcp_port}" if listener == "tcp" else "http://guard"
        async with aiohttp.ClientSession() if listener == "tcp" else unix_session(seeded) as s:
            status, body, headers = await call(
                s,
                "PUT",
                "/v1/memory/preference.theme",
                token=g["token"],
                json_body={"value": "light"},
                base=base,
            )
            assert status == 202, body
            assert body["status"] == "pending" and body["op"] == "put" and body["base_version"] == 1
            assert headers["Location"] == f"/v1/proposals/{body['proposal_id']}"
            # the store did not change: the agent still reads the old value
            status, item, _ = await call(s, "GET", "/v1/memory/preference.theme", token=g["token"], base=base)
            assert status == 200 and item["value"] == "dark"
            status, dele, _ = await call(
                s, "DELETE", "/v1/memory/preference.theme", token=g["token"], base=base, headers={"If-Match": '"1"'}
            )
            assert status == 202 and dele["op"] == "delete"
            status, new, _ = await call(
                s, "PUT", "/v1/memory/note.todo", token=g["token"], json_body={"value": {"x": 1}}, base=base
            )
            assert status == 202 and new["base_version"] == 0
            status, own, _ = await call(s, "GET", "/v1/proposals", token=g["token"], base=base)
            assert status == 200
            assert {p["proposal_id"] for p in own["proposals"]} == {
                body["proposal_id"],
                dele["proposal_id"],
                new["proposal_id"],
            }
            assert all(p["status"] == "pending" for p in own["proposals"])
            assert "value" not in json.dumps(own)  # the outcome, not the values
        items, history, proposals = db_state(seeded)
        assert items == before[0] and history == before[1] == []
        assert len(proposals) == 3 and {p[1] for p in proposals} == {"pending"}
        events = ledger_events(seeded, action="write", allowed=True)
        assert {e["proposal_id"] for e in events} == {body["proposal_id"], new["proposal_id"]}
        assert "light" not in seeded.audit_db.read_bytes().decode("latin-1")  # never a value in the log


REFUSALS = [
    pytest.param("PUT", "user.display_name", {"value": "x"}, None, 403, "ACCESS_DENIED", id="key-outside-write-tags"),
    pytest.param("PUT", "user.passport", {"value": "x"}, None, 403, "ACCESS_DENIED", id="high-sensitivity-item"),
    pytest.param("DELETE", "user.passport", None, None, 403, "ACCESS_DENIED", id="delete-high-sensitivity"),
    pytest.param(
        "PUT",
        "preference.new",
        {"value": 1, "tags": ["preference"], "sensitivity": "high"},
        None,
        403,
        "ACCESS_DENIED",
        id="propose-high-sensitivity",
    ),
    pytest.param(
        "PUT",
        "preference.new",
        {"value": 1, "tags": ["preference", "financial"]},
        None,
        403,
        "ACCESS_DENIED",
        id="tag-outside-grant",
    ),
    pytest.param("PUT", "preference.new", {"value": 1, "tags": []}, None, 403, "ACCESS_DENIED", id="new-key-no-tag"),
    pytest.param("PUT", "preference.lang", {"value": "de"}, None, 403, "ACCESS_DENIED", id="deny-keys"),
    pytest.param("PUT", "preference.secret_hobby", {"value": "x"}, None, 403, "ACCESS_DENIED", id="deny-tags"),
    pytest.param(
        "PUT",
        "preference.new",
        {"value": 1, "tags": ["preference", "private"]},
        None,
        403,
        "ACCESS_DENIED",
        id="deny-tag-proposed",
    ),
    pytest.param("DELETE", "preference.missing", None, None, 403, "ACCESS_DENIED", id="delete-missing"),
    pytest.param("PUT", "preference.theme", b"{not json", None, 400, "INVALID_REQUEST", id="malformed-json"),
    pytest.param("PUT", "preference.theme", b"[1]", None, 400, "INVALID_REQUEST", id="not-an-object"),
    pytest.param("PUT", "preference.theme", {"tags": ["preference"]}, None, 400, "INVALID_REQUEST", id="no-value"),
    pytest.param("PUT", "preference.theme", {"value": 1, "junk": 2}, None, 400, "INVALID_REQUEST", id="unknown-member"),
    pytest.param(
        "PUT", "preference.theme", {"value": 1, "tags": "preference"}, None, 400, "INVALID_REQUEST", id="bad-tags"
    ),
    pytest.param(
        "PUT", "preference.theme", {"value": "x" * 20_000}, None, 429, "BUDGET_EXCEEDED", id="value-over-budget"
    ),
    pytest.param("PUT", "preference.theme", b'{"value": NaN}', None, 400, "INVALID_REQUEST", id="nan-value"),
    pytest.param(
        "PUT",
        "preference.theme",
        {"value": "uomp-sealed-item/1:AAAA"},
        None,
        400,
        "INVALID_REQUEST",
        id="value-carrying-the-sealed-marker",
    ),
    pytest.param("PUT", "preference.theme", {"value": 1}, '"7"', 409, "VERSION_CONFLICT", id="if-match-stale"),
    pytest.param(
        "PUT", "preference.theme", {"value": 1, "base_version": 3}, None, 409, "VERSION_CONFLICT", id="base-stale"
    ),
    pytest.param("PUT", "preference.theme", {"value": 1}, 'W/"1"', 400, "INVALID_REQUEST", id="weak-if-match"),
    pytest.param(
        "PUT",
        "preference.theme",
        {"value": 1, "base_version": 2},
        '"1"',
        400,
        "INVALID_REQUEST",
        id="if-match-disagrees",
    ),
    pytest.param("DELETE", "preference.theme", {"value": 1}, None, 400, "INVALID_REQUEST", id="delete-with-value"),
]


@pytest.mark.parametrize(("method", "key", "body", "if_match", "status", "code"), REFUSALS)
async def test_refusals_change_nothing(
    seeded: Paths, method: str, key: str, body: Any, if_match: str | None, status: int, code: str
) -> None:
    async with running_guard(seeded) as guard, unix_session(seeded) as admin:
        g = await write_grant(admin, seeded)
        before = db_state(seeded)
        headers = {"If-Match": if_match} if if_match else {}
        async with aiohttp.ClientSession() as s:
            hdrs = {"Authorization": f"Bearer {g['token']}", **headers}
            kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
            if isinstance(body, bytes):
                hdrs["Content-Type"] = "application/json"
            async with s.request(
                method, f"http://127.0.0.1:{guard.tcp_port}/v1/memory/{key}", headers=hdrs, **kwargs
            ) as resp:
                got = await resp.json(content_type=None)
                assert resp.status == status and got["error"]["code"] == code, got
        assert got["error"]["session_id"] == g["session_id"]
        if code == "BUDGET_EXCEEDED":
            assert got["error"]["details"]["budget"] == "value_bytes"
            assert got["error"]["details"]["limit"] == guard_config().write_max_value_bytes
            assert got["error"]["details"]["needed"] > got["error"]["details"]["limit"]
        if code == "ACCESS_DENIED":
            assert "details" not in got["error"]  # which rule refused is the user's to see, not the agent's
        assert db_state(seeded) == before
        refused = ledger_events(seeded, action="write" if method == "PUT" else "delete", allowed=False)
        assert len(refused) == 1 and refused[0]["key"] == key and refused[0]["code"] == code


async def test_no_write_scope_and_revoked_session(seeded: Paths) -> None:
    async with running_guard(seeded) as guard, unix_session(seeded) as admin:
        reader = await write_grant(admin, seeded, write={"tags": [], "keys": []}, agent_id="reader")
        writer = await write_grant(admin, seeded)
        base = f"http://127.0.0.1:{guard.tcp_port}"
        async with aiohttp.ClientSession() as s:
            for method in ("PUT", "DELETE"):
                status, body, _ = await call(
                    s, method, "/v1/memory/preference.theme", token=reader["token"], json_body={"value": 1}, base=base
                )
                assert status == 403 and body["error"]["code"] == "WRITE_NOT_AVAILABLE"
            status, body, _ = await call(
                admin, "POST", f"/v1/sessions/{writer['session_id']}/revoke", headers=admin_headers(seeded)
            )
            assert status == 200
            status, body, _ = await call(
                s, "PUT", "/v1/memory/preference.theme", token=writer["token"], json_body={"value": 1}, base=base
            )
            assert status == 401 and body["error"]["code"] == "SESSION_REVOKED"
        assert db_state(seeded)[2] == []


async def test_budgets_refuse_with_numbers(seeded: Paths) -> None:
    cfg = guard_config(write_max_pending_per_session=2, write_max_per_agent_hour=3)
    async with running_guard(seeded, cfg) as guard, unix_session(seeded) as admin:
        g = await write_grant(admin, seeded)
        base = f"http://127.0.0.1:{guard.tcp_port}"
        async with aiohttp.ClientSession() as s:

            async def put(token: str, n: int) -> tuple[int, Any]:
                st, b, _ = await call(
                    s, "PUT", "/v1/memory/preference.theme", token=token, json_body={"value": n}, base=base
                )
                return st, b

            assert (await put(g["token"], 1))[0] == 202
            assert (await put(g["token"], 2))[0] == 202
            status, body = await put(g["token"], 3)
            assert status == 429 and body["error"]["code"] == "BUDGET_EXCEEDED"
            assert body["error"]["details"] == {"budget": "pending_per_session", "used": 2, "limit": 2, "needed": 1}
            # withdrawing one frees the pending budget; the agent's hourly budget still counts it
            own = (await call(s, "GET", "/v1/proposals", token=g["token"], base=base))[1]["proposals"]
            pid = own[0]["proposal_id"]
            status, body, _ = await call(s, "POST", f"/v1/proposals/{pid}/withdraw", token=g["token"], base=base)
            assert status == 200 and body["status"] == "withdrawn"
            assert (await put(g["token"], 3))[0] == 202
            g2 = await write_grant(admin, seeded)  # the same agent, another session
            status, body = await put(g2["token"], 4)
            assert status == 429 and body["error"]["details"]["budget"] == "per_agent_hour"
            assert body["error"]["details"]["used"] == 3 and body["error"]["details"]["limit"] == 3
        assert len(db_state(seeded)[2]) == 3


async def test_withdraw_only_own_pending(seeded: Paths) -> None:
    async with running_guard(seeded) as guard, unix_session(seeded) as admin:
        a = await write_grant(admin, seeded, agent_id="a")
        b = await write_grant(admin, seeded, agent_id="b")
        base = f"http://127.0.0.1:{guard.tcp_port}"
        async with aiohttp.ClientSession() as s:
            _, p, _ = await call(
                s, "PUT", "/v1/memory/preference.theme", token=a["token"], json_body={"value": 1}, base=base
            )
            pid = p["proposal_id"]
            # another session: the same 404 as an unknown id, and it cannot see it in its list
            for who, target in ((b, pid), (a, "prop_nosuchproposal000000"), (a, "x" * 300)):
                status, body, _ = await call(
                    s, "POST", f"/v1/proposals/{target}/withdraw", token=who["token"], base=base
                )
                assert status == 404 and body["error"]["code"] == "NOT_FOUND", body
            status, body, _ = await call(s, "GET", "/v1/proposals", token=b["token"], base=base)
            assert status == 200 and body["proposals"] == []
            status, body, _ = await call(s, "POST", f"/v1/proposals/{pid}/withdraw", token=a["token"], base=base)
            assert status == 200 and body["status"] == "withdrawn"
            status, body, _ = await call(s, "POST", f"/v1/proposals/{pid}/withdraw", token=a["token"], base=base)
            assert status == 409 and body["error"]["code"] == "INVALID_STATE"
            assert body["error"]["details"] == {"status": "withdrawn"}
        assert db_state(seeded)[2] == [(pid, "withdrawn")]
        assert [e["allowed"] for e in ledger_events(seeded, action="proposal_withdraw")] == [False] * 3 + [True, False]


async def test_grant_time_refusals(seeded: Paths) -> None:
    async with running_guard(seeded), unix_session(seeded) as admin:
        # a write scope naming a high-sensitivity item is refused at grant time
        g = await write_grant(admin, seeded, write={"tags": [], "keys": ["user.passport"]})
        assert g["status"] == 403 and g["error"]["code"] == "ACCESS_DENIED"
        # wider than requested: refused without widen, as reads are
        body = {"agent_id": "w", "requested_scopes": {"read": READ, "write": {"tags": ["preference"], "keys": []}}}
        _, created, _ = await call(admin, "POST", "/v1/sessions", headers=admin_headers(seeded), json_body=body)
        status, err, _ = await call(
            admin,
            "POST",
            f"/v1/sessions/{created['session_id']}/grant",
            headers=admin_headers(seeded),
            json_body={"granted_scopes": {"read": READ, "write": {"tags": ["preference", "identity"], "keys": []}}},
        )
        assert status == 400 and "write" in err["error"]["message"]
        # a grant's max_write_queries is capped by the config and carried in the token
        g = await write_grant(admin, seeded, limits={"max_write_queries": 5})
        assert g["status"] == 200 and token_claims(g["token"])["limits"]["max_write_queries"] == 5
        g = await write_grant(admin, seeded, limits={"max_write_queries": 10**6})
        assert token_claims(g["token"])["limits"]["max_write_queries"] == guard_config().write_max_per_session
        assert tokens.TOKEN_VERSION == token_claims(g["token"])["version"]
