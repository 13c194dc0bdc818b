"""What a keep-alive mTLS connection remembers between its requests (``app.ConnMemo``): the parsed
certificate and the token checks it passed. Nothing whose answer can change is remembered: each
case runs its requests on one connection (a connector of one), the first ones allowed, then the
change that must refuse the next request on that same connection. The guard checks a forwarded
token again, so each refusal is asserted to be the *gateway's* (its event has ``origin: gateway``
in the one log), not only the guard's."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gatewaykit import Appliance, agent_call, agent_session, appliance, ledger_events

from gateway import ca_store, keys
from gateway.client.tls import build_client_context
from gateway.config import GuardConfig, Paths
from gateway.core import ca

pytestmark = pytest.mark.timeout(60)

KEY = "/v1/memory/preference.theme"


@pytest.fixture
async def app(home: Paths) -> Any:
    async with appliance(home) as a:
        yield a


def refused_by_gateway(app: Appliance, code: str) -> bool:
    ev = ledger_events(app.paths)[-1]
    return ev.get("origin") == "gateway" and ev["code"] == code and ev["allowed"] is False


def _state(app: Appliance) -> Any:
    assert app.gateway.state is not None
    return app.gateway.state


async def test_revocation_refuses_the_next_request_on_the_same_connection(app: Appliance) -> None:
    a = app.agent("calendar_agent")
    g = await app.grant(a)
    async with agent_session(a, app.paths, limit=1) as s:
        for _ in range(3):  # the connection's certificate is remembered after the first request
            assert (await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id))[0] == 200
        ca_store.revoke(app.paths, "calendar_agent")
        assert app.gateway.reloader is not None
        app.gateway.reloader.reload_if_changed()
        status, body, _ = await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id)
        assert status == 401 and body["error"]["code"] == "CERT_REQUIRED"
        assert "revoked" in body["error"]["message"] and refused_by_gateway(app, "CERT_REQUIRED")


async def test_a_new_token_or_agent_header_on_the_connection_is_checked_again(app: Appliance) -> None:
    a = app.agent("calendar_agent")
    other = app.agent("travel_agent")
    g = await app.grant(a)
    foreign = await app.grant(other)  # bound to another certificate and naming another agent
    unbound_wrong_audience = await app.grant(a, bind=False, audience="https://elsewhere.example:9443")
    async with agent_session(a, app.paths, limit=1) as s:
        assert (await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id))[0] == 200
        status, body, _ = await agent_call(s, app.base, KEY, token=foreign["token"], agent_id=other.agent_id)
        assert status in (401, 403) and refused_by_gateway(app, "AGENT_MISMATCH")
        status, body, _ = await agent_call(s, app.base, KEY, token=unbound_wrong_audience["token"], agent_id=a.agent_id)
        assert status == 401 and refused_by_gateway(app, "INVALID_TOKEN")
        # the token that passed, with another agent header: not the combination that passed
        status, body, _ = await agent_call(s, app.base, KEY, token=g["token"], agent_id=other.agent_id)
        assert body["error"]["code"] == "AGENT_MISMATCH" and refused_by_gateway(app, "AGENT_MISMATCH")
        status, body, _ = await agent_call(s, app.base, KEY, token=g["token"], agent_id=None)
        assert status == 400 and refused_by_gateway(app, "INVALID_REQUEST")
        # another token string (its signature broken): verified again, not taken for the one that passed
        # (two other canonical base64url characters: a fixed "AA" was the same token 1 run in 4,096)
        tok = g["token"]
        broken = tok[:-2] + ("AA" if tok[-2:] != "AA" else "BA")
        assert broken != tok
        status, body, _ = await agent_call(s, app.base, KEY, token=broken, agent_id=a.agent_id)
        assert status == 401 and refused_by_gateway(app, "INVALID_TOKEN")
        assert (await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id))[0] == 200


async def test_an_endpoint_dropped_from_the_listener_refuses_a_remembered_token(app: Appliance) -> None:
    a = app.agent("calendar_agent")
    g = await app.grant(a)
    state = _state(app)
    async with agent_session(a, app.paths, limit=1) as s:
        for _ in range(2):
            assert (await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id))[0] == 200
        state.discard_endpoint(app.base)
        status, _, _ = await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id)
        assert status == 401 and refused_by_gateway(app, "INVALID_TOKEN")
        state.add_endpoint(app.base)
        assert (await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id))[0] == 200
        state.reload_keys()  # trusted keys read again: the remembered verification is dropped, redone
        assert (await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id))[0] == 200
        # the token's signing key revoked: once the gateway reloads its keys, the token is refused there
        keys.rotate(app.paths, max_token_lifetime=3600, revoke_old=True)
        state.reload_keys()
        status, _, _ = await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id)
        assert status == 401 and refused_by_gateway(app, "INVALID_TOKEN")


async def test_a_remembered_token_still_expires_on_time(home: Paths) -> None:
    guard_cfg = dataclasses.replace(GuardConfig(), remote_token_lifetime_seconds=2)
    async with appliance(home, guard_cfg=guard_cfg) as app:
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        async with agent_session(a, app.paths, limit=1) as s:
            for _ in range(2):
                assert (await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id))[0] == 200
            await asyncio.sleep(2.2)
            status, _, _ = await agent_call(s, app.base, KEY, token=g["token"], agent_id=a.agent_id)
            assert status == 401 and refused_by_gateway(app, "TOKEN_EXPIRED")


async def test_a_certificate_that_expires_on_an_open_connection_is_refused_at_its_next_request(
    home: Paths, tmp_path: Path
) -> None:
    # The connection's certificate is read and parsed once (its memo); its validity period is still
    # judged on every request: the same connection, good a moment ago, is refused once it expired.
    async with appliance(home) as app:
        life = ca.AGENT_CERT_MIN_LIFETIME
        key = ca.new_key()
        ca_key, ca_cert = ca_store.load_ca(home)
        cert = ca.issue_agent_cert(
            ca_key, ca_cert, key.public_key(), "bot", life, now=ca.utcnow() - life + dt.timedelta(seconds=4)
        )
        not_after = cert.not_valid_after_utc
        crt, kf = tmp_path / "short.crt", tmp_path / "short.key"
        crt.write_bytes(ca.cert_pem(cert))
        kf.write_bytes(ca.key_pem(key))
        ctx = build_client_context(ca_store.ca_cert_path(home), crt, kf)
        good = app.agent("calendar_agent")  # a certificate that stays valid, on its own connection
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=1)) as s,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=good.ssl(), limit=1)) as g,
        ):
            for _ in range(3):
                assert (await agent_call(s, app.base, "/v1/health", token=None, agent_id=None))[0] == 200
                assert (await agent_call(g, app.base, "/v1/health", token=None, agent_id=None))[0] == 200
            await asyncio.sleep(max(0.0, (not_after - ca.utcnow()).total_seconds()) + 1.2)
            status, body, headers = await agent_call(s, app.base, "/v1/health", token=None, agent_id=None)
            assert (status, body["error"]["code"], body["error"]["reason"]) == (401, "CERT_REQUIRED", "expired")
            assert headers["Connection"] == "close"
            assert (await agent_call(g, app.base, "/v1/health", token=None, agent_id=None))[0] == 200
