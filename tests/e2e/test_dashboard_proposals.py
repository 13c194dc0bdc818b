"""The dashboard's proposals inbox (docs/writes.md) against the real appliance: the agent proposes
through mTLS, the page shows each change (escaped), approve applies the change shown and only it,
reject changes nothing; forged posts (no token, foreign origin, a hash of another change) are
refused with nothing changed; every decision is audited with origin dashboard."""

from __future__ import annotations

import asyncio
import re
import sqlite3
from typing import Any

import pytest
from gatewaykit import Appliance, agent_call, agent_session, ledger_events
from markupsafe import escape
from test_dashboard import app, browser, dashboard  # noqa: F401  (the fixture and the helpers)

pytestmark = pytest.mark.timeout(90)

SCOPES = {"read": {"tags": ["preference"], "keys": []}, "write": {"tags": ["preference"], "keys": []}}


def item(appl: Appliance, key: str) -> Any:
    conn = sqlite3.connect(f"file:{appl.paths.memory_db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT value, source, version FROM items WHERE key = ?", (key,)).fetchone()
    finally:
        conn.close()


async def test_inbox_approve_one_reject_another(app: Appliance) -> None:  # noqa: F811
    agent = app.agent("writer")
    g = await app.grant(agent, requested=SCOPES, granted_scopes=SCOPES)
    async with agent_session(agent, app.paths) as s:

        async def put(key: str, body: Any) -> str:
            status, answer, _ = await agent_call(
                s, app.base, f"/v1/memory/{key}", token=g["token"], agent_id="writer", method="PUT", json_body=body
            )
            assert status == 202, answer
            return str(answer["proposal_id"])

        one = await put("preference.theme", {"value": "light"})
        two = await put("preference.lang", {"value": "<script>alert(1)</script>\u202e"})
    async with dashboard(app.paths) as d, browser(d) as b:
        await b.login()
        status, page, _ = await b.get("/proposals")
        assert status == 200 and one in page and two in page
        assert "<script>alert" not in page and "\u202e" not in page  # escaped (JSON, then HTML)
        assert str(escape('"light"')) in page and str(escape('"dark"')) in page
        token = re.search(r'name="csrf" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
        hashes = dict(
            re.findall(r'action="/proposals/(prop_[^/]+)/approve".*?name="change_hash" value="([^"]+)"', page, re.S)
        )
        assert set(hashes) == {one, two}
        ok = {"Origin": f"http://127.0.0.1:{d.port}"}
        # forged: no token, a foreign origin, the hash of the other change, no hash
        for headers, form in (
            (ok, {"confirmed": "yes", "change_hash": hashes[one]}),
            ({"Origin": "http://evil.example"}, {"csrf": token, "confirmed": "yes", "change_hash": hashes[one]}),
            (ok, {"csrf": token, "confirmed": "yes", "change_hash": hashes[two]}),
            (ok, {"csrf": token, "confirmed": "yes"}),
        ):
            status, html, _ = await b.request("POST", f"/proposals/{one}/approve", headers=headers, data=form)
            assert status in (400, 403, 409), (status, form)
        assert item(app, "preference.theme") == ('"dark"', "user", 1)
        # our own form: a confirmation page first, then exactly the change shown
        status, html, _ = await b.request(
            "POST",
            f"/proposals/{one}/approve",
            headers=ok,
            data={"csrf": token, "confirmed": "no", "change_hash": hashes[one]},
        )
        assert status == 200 and f"Approve proposal {one}?" in html and hashes[one] in html
        assert item(app, "preference.theme") == ('"dark"', "user", 1)
        status, _, hdrs = await b.request(
            "POST",
            f"/proposals/{one}/approve",
            headers=ok,
            data={"csrf": token, "confirmed": "yes", "change_hash": hashes[one]},
        )
        assert status == 303 and hdrs["Location"] == "/proposals"
        assert item(app, "preference.theme") == ('"light"', "agent", 2)
        status, _, _ = await b.request(
            "POST", f"/proposals/{two}/reject", headers=ok, data={"csrf": token, "confirmed": "yes"}
        )
        assert status == 303
        assert item(app, "preference.lang") == ('"en"', "user", 1)
        status, page, _ = await b.get("/proposals")
        assert f"Proposal {two} rejected." in page and "No proposals waiting" in page
        # a decided proposal cannot be approved again
        status, html, _ = await b.request(
            "POST",
            f"/proposals/{one}/approve",
            headers=ok,
            data={"csrf": token, "confirmed": "yes", "change_hash": hashes[one]},
        )
        assert status == 409 and "INVALID_STATE" in html
    async with agent_session(agent, app.paths) as s:
        status, own, _ = await agent_call(s, app.base, "/v1/proposals", token=g["token"], agent_id="writer")
        assert {p["proposal_id"]: p["status"] for p in own["proposals"]} == {one: "approved", two: "rejected"}
    decided = await asyncio.to_thread(ledger_events, app.paths, origin="dashboard")
    assert [(e["action"], e["proposal_id"]) for e in decided] == [
        ("proposal_approved", one),
        ("proposal_rejected", two),
    ]


async def test_memory_pages_history_readers_rollback_delete(app: Appliance) -> None:  # noqa: F811
    from gateway.cli.main import main as uomp

    agent = app.agent("reader")
    g = await app.grant(agent)
    async with agent_session(agent, app.paths) as s:
        status, _, _ = await agent_call(s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id="reader")
        assert status == 200
    home = str(app.paths.home)
    args = ["--home", home, "memory", "add", "preference.theme", "--value", '"sepia"', "--tag", "preference",
            "--sensitivity", "low", "--replace"]  # fmt: skip
    assert await asyncio.to_thread(uomp, args) == 0
    async with dashboard(app.paths) as d, browser(d) as b:
        await b.login()
        status, page, _ = await b.get("/memory?q=preference.&tag=private")
        assert status == 200 and "preference.secret_hobby" in page and "preference.theme" not in page  # by tag
        status, page, _ = await b.get("/memory?q=h.")
        assert "h.aapl" in page and "preference.theme" not in page and "4 of 4 items" in page  # by key prefix
        status, page, _ = await b.get("/memory/item?key=preference.theme")
        assert status == 200 and "reader: 1 time" in page  # who read it, from the audit log
        assert 'id="v-2"' in page and 'id="v-1"' in page and str(escape('"dark"')) in page
        token = re.search(r'name="csrf" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
        ok = {"Origin": f"http://127.0.0.1:{d.port}"}
        for headers, form, want in (
            (ok, {"confirmed": "yes", "key": "preference.theme", "version": "1"}, 403),  # no token
            (
                {"Origin": "http://evil.example"},
                {"csrf": token, "confirmed": "yes", "key": "preference.theme", "version": "1"},
                403,
            ),
            (ok, {"csrf": token, "confirmed": "yes", "key": " bad", "version": "1"}, 400),
            (ok, {"csrf": token, "confirmed": "yes", "key": "preference.theme", "version": "x"}, 400),
            (ok, {"csrf": token, "confirmed": "yes", "key": "preference.theme", "version": "9"}, 400),
        ):
            status, _, _ = await b.request("POST", "/memory/rollback", headers=headers, data=form)
            assert status == want, form
        assert item(app, "preference.theme") == ('"sepia"', "user", 2)
        form = {"csrf": token, "confirmed": "yes", "key": "preference.theme", "version": "1"}
        status, _, _ = await b.request("POST", "/memory/rollback", headers=ok, data=form)
        assert status == 303
        assert item(app, "preference.theme") == ('"dark"', "user", 3)
        status, _, _ = await b.request(
            "POST", "/memory/delete", headers=ok, data={"csrf": token, "confirmed": "yes", "key": "preference.theme"}
        )
        assert status == 303 and item(app, "preference.theme") is None
        status, page, _ = await b.get("/memory/item?key=preference.theme")
        assert status == 200 and "Deleted; its history is kept." in page
    events = await asyncio.to_thread(ledger_events, app.paths, origin="dashboard")
    assert [e["action"] for e in events] == ["memory_rolled_back", "memory_deleted"]
