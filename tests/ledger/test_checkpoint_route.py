"""`GET /v1/audit/checkpoint?since=SIZE`: the newest signed checkpoint and the RFC 9162 consistency
proof from SIZE, through the real gateway (mutual TLS) and on the guard's Local Profile listener;
the same authentication as the other audit routes; ``since`` bounded (beyond the newest checkpoint:
400 AUDIT_SIZE_UNKNOWN; not digits: 400 INVALID_REQUEST). The proof route takes ``since`` too."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import pytest
from gatewaykit import agent_call, agent_session, appliance
from guardkit import call, grant, guard_config, running_guard, seed, unix_session

from gateway.config import Paths
from gateway.core import merkle
from gateway.core.checkpoint import Checkpoint, parse_verifier_key
from gateway.ledger import auditkey
from gateway.ledger.log import EventLog

READ = {"tags": ["preference"], "keys": []}
CFG = {"audit_checkpoint_events": 1}  # every batch signed at once


def verifier(home: Paths) -> str:
    import sqlite3

    key = auditkey.load(home)
    return EventLog(sqlite3.connect(":memory:"), origin=auditkey.origin_for(key.public_key()), key=key).verifier_key()


def opened(home: Paths, answer: dict[str, Any]) -> Checkpoint:
    name, pub = parse_verifier_key(verifier(home))
    assert answer["verifier_key"] == verifier(home)
    cp = Checkpoint.open(answer["checkpoint"], name, pub)
    assert cp.size == answer["tree_size"]
    return cp


def consistent(old: Checkpoint, new: Checkpoint, consistency: dict[str, Any]) -> None:
    assert (consistency["old_size"], consistency["new_size"]) == (old.size, new.size)
    merkle.verify_consistency(
        old.size, new.size, old.root, new.root, [base64.b64decode(h) for h in consistency["path"]]
    )


async def test_through_the_gateway(home: Paths) -> None:
    async with appliance(home, guard_cfg=guard_config(**CFG)) as app:
        a = app.agent("agent_a")
        ga = await app.grant(a, read=READ)
        async with agent_session(a, home) as sa:

            async def get(path: str, token: str | None = ga["token"]) -> tuple[int, Any]:
                status, body, _ = await agent_call(sa, app.base, path, token=token, agent_id=a.agent_id)
                return status, body

            status, first = await get("/v1/audit/checkpoint")
            assert status == 200, first
            cp1 = opened(home, first)
            assert "consistency" not in first
            for _ in range(3):
                assert (await get("/v1/memory/preference.theme"))[0] == 200
            status, second = await get(f"/v1/audit/checkpoint?since={cp1.size}")
            assert status == 200, second
            cp2 = opened(home, second)
            assert cp2.size > cp1.size
            consistent(cp1, cp2, second["consistency"])
            # a tampered proof does not hold (the check above is not vacuous)
            bad = [base64.b64encode(bytes(32)).decode(), *second["consistency"]["path"][1:]]
            with pytest.raises(merkle.ProofError):
                consistent(cp1, cp2, {**second["consistency"], "path": bad})

            # since at the newest size: an empty proof; 0: from the empty tree
            status, same = await get(f"/v1/audit/checkpoint?since={cp2.size}")
            assert status == 200  # (every request is an event: the log grew by this one's predecessor)
            consistent(cp2, opened(home, same), same["consistency"])
            assert (await get("/v1/audit/checkpoint?since=0"))[1]["consistency"]["old_size"] == 0

            # refusals: beyond the log, not digits, repeated, no token
            newest = (await get("/v1/audit/checkpoint"))[1]["tree_size"]
            status, body = await get(f"/v1/audit/checkpoint?since={newest + 1000}")
            assert status == 400 and body["error"]["code"] == "AUDIT_SIZE_UNKNOWN", body
            assert body["error"]["details"]["tree_size"] >= newest
            status, body = await get(f"/v1/audit/checkpoint?since={10**30}")
            assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
            for bad_since in ("-1", "1e3", "%20 1", "0x10"):
                status, body = await get(f"/v1/audit/checkpoint?since={bad_since}")
                assert status == 400 and body["error"]["code"] == "INVALID_REQUEST", (bad_since, body)
            status, body = await get("/v1/audit/checkpoint?since=1&since=2")
            assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
            status, body = await get("/v1/audit/checkpoint", token=None)
            assert status == 401 and body["error"]["code"] == "INVALID_TOKEN"

            # the proof route with since: a consistency proof between its checkpoint and that size
            logs = (await get("/v1/audit"))[1]["logs"]
            read = next(e["id"] for e in logs if e["action"] == "read" and e["allowed"])
            status, bundle = await get(f"/v1/audit/{read}/proof?since={cp1.size}")
            assert status == 200, bundle
            name, pub = parse_verifier_key(verifier(home))
            bcp = Checkpoint.open(bundle["checkpoint"], name, pub)
            older, newer = sorted((cp1, bcp), key=lambda c: c.size)
            consistent(older, newer, bundle["consistency"])
            status, body = await get(f"/v1/audit/{read}/proof?since={newest + 1000}")
            assert status == 400 and body["error"]["code"] == "AUDIT_SIZE_UNKNOWN"

            # each request is an audit_checkpoint event of the session, refusals included
            logs = (await get("/v1/audit?limit=1000"))[1]["logs"]
            verdicts = [e["allowed"] for e in logs if e["action"] == "audit_checkpoint"]
            assert verdicts.count(True) >= 4 and verdicts.count(False) >= 6


async def test_on_the_local_profile_listener(home: Paths) -> None:
    seed(home)
    async with running_guard(home, guard_config(**CFG)) as g, unix_session(home) as s, aiohttp.ClientSession() as tcp:
        base = f"http://127.0.0.1:{g.tcp_port}"
        a = await grant(s, home, read=READ, audience=base)
        remote = await grant(s, home, read=READ, profile="remote", audience="https://localhost:9443")
        status, first, _ = await call(tcp, "GET", "/v1/audit/checkpoint", token=a["token"], base=base)
        assert status == 200, first
        cp1 = opened(home, first)
        assert (await call(tcp, "GET", "/v1/memory/preference.lang", token=a["token"], base=base))[0] == 200
        status, second, _ = await call(
            tcp, "GET", f"/v1/audit/checkpoint?since={cp1.size}", token=a["token"], base=base
        )
        assert status == 200
        consistent(cp1, opened(home, second), second["consistency"])
        status, body, _ = await call(
            tcp, "GET", f"/v1/audit/checkpoint?since={second['tree_size'] + 5}", token=a["token"], base=base
        )
        assert status == 400 and body["error"]["code"] == "AUDIT_SIZE_UNKNOWN"
        status, body, _ = await call(tcp, "GET", "/v1/audit/checkpoint", base=base)
        assert status == 401
        # a remote-profile token is refused here, as on every route of this listener
        status, body, _ = await call(tcp, "GET", "/v1/audit/checkpoint", token=remote["token"], base=base)
        assert status in (401, 403)
