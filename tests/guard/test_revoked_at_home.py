"""The guard holds the gateway's assertion to the certificates revoked at home (guard/revocation.py):
a gateway whose CRL is stale (a VPS, docs/vps.md) cannot let a revoked certificate's requests in, even
when the user kept the agent's sessions."""

from __future__ import annotations

import asyncio

import pytest
from gatewaykit import Agent, appliance
from guardkit import call, unix_session

from gateway import ca_store, contract
from gateway.config import Paths

pytestmark = pytest.mark.timeout(60)


def asserted(agent: Agent, token: str, *, serial: str | None, x5t: str | None) -> dict[str, str]:
    """What a gateway that checked nothing against a CRL would send for this agent's request."""
    return contract.assertion_headers(
        token=token,
        agent_id=agent.agent_id,
        listener="mtls",
        via=f"gateway:mtls:{serial}",
        serial=serial,
        x5t=x5t,
        jkt=agent.jkt,
    )


async def read(paths: Paths, headers: dict[str, str]) -> tuple[int, dict]:  # type: ignore[type-arg]
    async with unix_session(paths) as s:
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", headers=headers)
    return status, body


async def test_a_certificate_revoked_at_home_is_refused_by_the_guard_whatever_the_gateway_says(home: Paths) -> None:
    async with appliance(home) as app:
        a, b = app.agent("agent_a"), app.agent("agent_b")
        ga, gb = await app.grant(a), await app.grant(b)
        a_full = asserted(a, ga["token"], serial=a.files.serial, x5t=a.x5t)
        b_full = asserted(b, gb["token"], serial=b.files.serial, x5t=b.x5t)
        assert (await read(home, a_full))[0] == 200
        assert (await read(home, b_full))[0] == 200

        # revoke A's certificate only (the sessions are kept, as `uomp agent revoke --keep-sessions`)
        ca_store.revoke_target(home, f"serial:{a.files.serial}")
        refused = None
        for _ in range(100):  # the guard looks at the registry at most once a second
            status, body = await read(home, a_full)
            if status != 200:
                refused = (status, body)
                break
            await asyncio.sleep(0.05)
        assert refused is not None, "the revoked certificate's requests were still answered"
        status, body = refused
        assert status == 401 and body["error"]["code"] == "CERT_REQUIRED" and "revoked" in body["error"]["message"]
        # the same refusal the gateway gives when it catches the revocation itself: reason and certificate named
        serial = a.files.serial.lower()
        assert body["error"]["reason"] == "revoked"
        assert body["error"]["details"] == {"agent_id": "agent_a", "serial": serial}
        assert f"(agent agent_a, serial 0x{serial}) was revoked on " in body["error"]["message"]
        # named by either: the thumbprint alone, the serial alone (upper-case as openssl prints it)
        assert (await read(home, asserted(a, ga["token"], serial=None, x5t=a.x5t)))[0] == 401
        assert (await read(home, asserted(a, ga["token"], serial=a.files.serial.upper(), x5t=None)))[0] == 401
        # denied partners: B's certificate is not revoked and its requests go on
        assert (await read(home, b_full))[0] == 200
        # and the refusal comes before any read: the value is not in the answer
        assert "dark" not in str(refused)
