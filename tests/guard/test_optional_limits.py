"""§7.2 marks the ``limits`` claim OPTIONAL: a token without it is accepted (the reference's own
token package mints such tokens), and the read quota is the session's grant at the guard whatever
the token carries (none, or a larger number than the user granted). ``version``, ``issued_at`` and
``expires_at`` stay required."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
from gatewaykit import agent_call, agent_session, appliance
from guardkit import call, grant, running_guard, seed, unix_session

from gateway import keys
from gateway.config import Paths
from gateway.core import jose, tokens

READ = {"tags": ["preference"], "keys": []}


def _minted(paths: Paths, session_id: str, agent_id: str, audience: str, **change: Any) -> str:
    """A token signed with the user's key, in our claim shape, with ``change`` applied (None drops a claim)."""
    now = int(time.time())
    claims = tokens.capability_claims(
        session_id=session_id,
        agent_id=agent_id,
        now=now,
        expires=now + 600,
        read=tokens.Scope(tags=("preference",)),
        max_read_queries=100,
        audience=audience,
    )
    for k, v in change.items():
        if v is None:
            claims.pop(k, None)
        else:
            claims[k] = v
    signing = keys.load_signing_key(paths)
    return tokens.sign_token(claims, signing.key, signing.kid)


async def _reads(session: aiohttp.ClientSession, base: str, token: str, n: int) -> list[tuple[int, str | None]]:
    out = []
    for _ in range(n):
        status, body, _ = await call(session, "GET", "/v1/memory/preference.theme", token=token, base=base)
        out.append((status, body["error"]["code"] if status >= 400 else None))
    return out


async def test_token_without_limits_is_accepted_and_the_granted_quota_applies(home: Paths) -> None:
    seed(home)
    async with running_guard(home) as g, unix_session(home) as s, aiohttp.ClientSession() as tcp:
        audience = f"http://127.0.0.1:{g.tcp_port}"
        for session, base in ((s, "http://guard"), (tcp, audience)):
            ok = await grant(s, home, read=READ, audience=audience, limits={"max_read_queries": 2})
            tok = _minted(home, ok["session_id"], "calendar_agent", audience, limits=None)
            assert "limits" not in jose.parse_compact(tok).payload
            # two reads granted: the third is refused, though the token names no limit at all
            assert await _reads(session, base, tok, 3) == [(200, None), (200, None), (429, "QUOTA_EXCEEDED")]


async def test_token_limits_cannot_raise_the_granted_quota(home: Paths) -> None:
    seed(home)
    async with running_guard(home) as g, unix_session(home) as s:
        audience = f"http://127.0.0.1:{g.tcp_port}"
        ok = await grant(s, home, read=READ, audience=audience, limits={"max_read_queries": 1})
        tok = _minted(home, ok["session_id"], "calendar_agent", audience, limits={"max_read_queries": 1000})
        assert await _reads(s, "http://guard", tok, 2) == [(200, None), (429, "QUOTA_EXCEEDED")]


async def test_token_without_expires_at_is_still_refused(home: Paths) -> None:
    seed(home)
    async with running_guard(home) as g, unix_session(home) as s:
        audience = f"http://127.0.0.1:{g.tcp_port}"
        ok = await grant(s, home, read=READ, audience=audience)
        for drop in ("expires_at", "issued_at", "version"):
            tok = _minted(home, ok["session_id"], "calendar_agent", audience, limits=None, **{drop: None})
            status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
            assert (status, body["error"]["code"]) == (401, "INVALID_TOKEN"), drop


async def test_gateway_accepts_a_token_without_limits(home: Paths) -> None:
    async with appliance(home) as app:
        agent = app.agent("agent_a")
        ok = await app.grant(agent, limits={"max_read_queries": 1})
        claims = {"profile": "remote", "cnf": {"x5t#S256": agent.x5t}, "limits": None}
        tok = _minted(home, ok["session_id"], "agent_a", app.base, **claims)
        async with agent_session(agent, home) as s:
            first = await agent_call(s, app.base, "/v1/memory/preference.theme", token=tok, agent_id="agent_a")
            second = await agent_call(s, app.base, "/v1/memory/preference.theme", token=tok, agent_id="agent_a")
        assert first[0] == 200, first[1]
        assert (second[0], second[1]["error"]["code"]) == (429, "QUOTA_EXCEEDED")
