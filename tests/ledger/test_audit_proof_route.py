"""`GET /v1/audit/{event_id}/proof`: an agent gets the proof bundle of its own session's events,
through the real gateway (TLS 1.3, mutual TLS, certificates made here) and on the guard's Local
Profile listener without the gateway's assertion; the bundle verifies offline with
gateway/ledger/verify.py. Another session's event and an unknown id get the same refusal (no
existence leak, spec §21); no token is refused; a refused event's proof stays the user's."""

from __future__ import annotations

import sqlite3
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance
from guardkit import call, grant, guard_config, running_guard, seed, unix_session

from gateway.client import UompClient
from gateway.client.errors import UompClientError
from gateway.config import Paths
from gateway.ledger import auditkey
from gateway.ledger.log import EventLog
from gateway.ledger.verify import ProofBundleError, verify_bundle

READ = {"tags": ["preference"], "keys": []}
CFG = {"audit_checkpoint_events": 1}  # every batch is signed at once: a proof is ready right after the read


def verifier(home: Paths) -> str:
    key = auditkey.load(home)
    return EventLog(sqlite3.connect(":memory:"), origin=auditkey.origin_for(key.public_key()), key=key).verifier_key()


def own_events(logs: list[dict[str, Any]], action: str, allowed: bool) -> str:
    return str(next(e["id"] for e in logs if e["action"] == action and e["allowed"] is allowed))


async def _gw(s: aiohttp.ClientSession, app: Appliance, agent: Agent, token: str | None, path: str) -> tuple[int, Any]:
    status, body, _ = await agent_call(s, app.base, path, token=token, agent_id=agent.agent_id)
    return status, body


async def test_through_the_gateway_own_events_only(home: Paths) -> None:
    async with appliance(home, guard_cfg=guard_config(**CFG)) as app:
        a, b = app.agent("agent_a"), app.agent("agent_b")
        ga, gb = await app.grant(a, read=READ), await app.grant(b, read=READ)
        async with agent_session(a, home) as sa, agent_session(b, home) as sb:
            assert (await _gw(sa, app, a, ga["token"], "/v1/memory/preference.theme"))[0] == 200
            assert (await _gw(sa, app, a, ga["token"], "/v1/memory/user.password"))[0] == 403
            assert (await _gw(sb, app, b, gb["token"], "/v1/memory/preference.lang"))[0] == 200
            status, body = await _gw(sa, app, a, ga["token"], "/v1/audit")
            assert status == 200
            mine, refused = own_events(body["logs"], "read", True), own_events(body["logs"], "read", False)
            theirs = own_events((await _gw(sb, app, b, gb["token"], "/v1/audit"))[1]["logs"], "read", True)

            # own allowed event: the bundle verifies offline against the appliance's verifier key
            status, bundle = await _gw(sa, app, a, ga["token"], f"/v1/audit/{mine}/proof")
            assert status == 200, bundle
            proof = verify_bundle(bundle, trusted_key=verifier(home))
            assert proof.event["id"] == mine and proof.event["session_id"] == ga["session_id"]
            assert proof.event["key"] == "preference.theme" and proof.event["allowed"] is True
            forged = {**bundle, "event": {**bundle["event"], "key": "user.password"}}
            with pytest.raises(ProofBundleError):
                verify_bundle(forged, trusted_key=verifier(home))

            # another session's event and an unknown id: one and the same answer
            other = await _gw(sa, app, a, ga["token"], f"/v1/audit/{theirs}/proof")
            unknown = await _gw(sa, app, a, ga["token"], "/v1/audit/log_00000000deadbeef/proof")
            assert other == unknown and other[0] == 404 and other[1]["error"]["code"] == "NOT_FOUND"
            assert "log_" not in other[1]["error"]["message"]
            # ... and b gets its own one, not a's
            assert (await _gw(sb, app, b, gb["token"], f"/v1/audit/{theirs}/proof"))[0] == 200
            assert (await _gw(sb, app, b, gb["token"], f"/v1/audit/{mine}/proof")) == (
                404,
                {
                    "error": {
                        "code": "NOT_FOUND",
                        "message": other[1]["error"]["message"],
                        "session_id": gb["session_id"],
                    }
                },
            )

            # own refused event: its body holds the user's detail, so its proof is the user's
            status, body = await _gw(sa, app, a, ga["token"], f"/v1/audit/{refused}/proof")
            assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"

            # no token; another agent's token on a's certificate
            status, body = await _gw(sa, app, a, None, f"/v1/audit/{mine}/proof")
            assert status == 401 and body["error"]["code"] == "INVALID_TOKEN"
            status, body, _ = await agent_call(
                sa, app.base, f"/v1/audit/{mine}/proof", token=gb["token"], agent_id=b.agent_id
            )
            assert status in (401, 403) and body["error"]["code"] != "NOT_FOUND"

            # the requests are audited, and a proof is not a read: the quota is untouched
            status, body = await _gw(sa, app, a, ga["token"], "/v1/audit")
            proofs = [e for e in body["logs"] if e["action"] == "audit_proof"]
            verdicts = [e["allowed"] for e in proofs]  # newest first: refused, unknown, other's, ok
            assert verdicts[:4] == [False, False, False, True] and proofs[3]["key"] == mine
            status, _, hdrs = await agent_call(
                sa, app.base, "/v1/memory/preference.lang", token=ga["token"], agent_id=a.agent_id
            )
            assert status == 200 and hdrs["X-UOMP-Quota-Remaining"] == "97"  # three reads, whatever the proofs

        # the SDK's audit_proof(), over mTLS
        key = serialization.load_pem_private_key(a.files.key_file.read_bytes(), password=None)
        async with UompClient(
            agent_id=a.agent_id,
            session_id=ga["session_id"],
            access_token=ga["token"],
            base_url=app.base,
            mode="mtls",
            ca_cert=a.files.ca_file.read_text(),
            agent_cert=a.files.cert_file.read_text(),
            agent_key=key,
        ) as client:  # type: ignore[arg-type]
            assert verify_bundle(await client.audit_proof(mine), trusted_key=verifier(home)).event["id"] == mine
            with pytest.raises(UompClientError) as exc:
                await client.audit_proof(theirs)
            assert exc.value.code == "NOT_FOUND" and exc.value.status == 404


async def test_on_the_local_profile_listener_without_the_gateway(home: Paths) -> None:
    seed(home)
    cfg = guard_config(**CFG)
    async with running_guard(home, cfg) as g, unix_session(home) as s, aiohttp.ClientSession() as tcp:
        base = f"http://127.0.0.1:{g.tcp_port}"
        a = await grant(s, home, read=READ, audience=base)
        b = await grant(s, home, read=READ, audience=base, agent_id="other")
        remote = await grant(s, home, read=READ, profile="remote", audience="https://localhost:9443")
        assert (await call(tcp, "GET", "/v1/memory/preference.theme", token=a["token"], base=base))[0] == 200
        assert (await call(tcp, "GET", "/v1/memory/preference.lang", token=b["token"], base=base))[0] == 200
        logs_a = (await call(tcp, "GET", "/v1/audit", token=a["token"], base=base))[1]["logs"]
        logs_b = (await call(tcp, "GET", "/v1/audit", token=b["token"], base=base))[1]["logs"]
        mine, theirs = own_events(logs_a, "read", True), own_events(logs_b, "read", True)
        grant_event = own_events(logs_a, "session_granted", True)

        for eid in (mine, grant_event):
            status, bundle, _ = await call(tcp, "GET", f"/v1/audit/{eid}/proof", token=a["token"], base=base)
            assert status == 200, bundle
            assert verify_bundle(bundle, trusted_key=verifier(home)).event["id"] == eid
        other = await call(tcp, "GET", f"/v1/audit/{theirs}/proof", token=a["token"], base=base)
        unknown = await call(tcp, "GET", "/v1/audit/nope/proof", token=a["token"], base=base)
        assert (other[0], other[1]) == (unknown[0], unknown[1]) == (404, other[1])
        assert other[1]["error"]["code"] == "NOT_FOUND"
        status, body, _ = await call(tcp, "GET", f"/v1/audit/{mine}/proof", base=base)
        assert status == 401 and body["error"]["code"] == "INVALID_TOKEN"
        # a remote-profile token is refused here, as on every route of this listener
        status, body, _ = await call(tcp, "GET", f"/v1/audit/{mine}/proof", token=remote["token"], base=base)
        assert status in (401, 403) and body["error"]["code"] != "NOT_FOUND"
        # the Unix socket without the gateway's assertion: the same rules
        status, bundle, _ = await call(s, "GET", f"/v1/audit/{mine}/proof", token=a["token"])
        assert status == 200 and bundle["event"]["id"] == mine
        assert (await call(s, "GET", f"/v1/audit/{theirs}/proof", token=a["token"]))[:2] == (404, other[1])
