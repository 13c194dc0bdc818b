"""The mTLS listener's TLS runs in the event loop's own protocol: the
gateway accepts plain TCP (:class:`gateway.remote.transport.TLSAcceptProtocol`, counted at accept)
and hands the connection to the loop's TLS protocol unchanged: uvloop's native one on uvloop (the
product's loop; test_transport_native.py runs this again there), asyncio's on asyncio's loop
(``UOMP_UVLOOP=0``, and this suite). Certificates made here, real TLS on 127.0.0.1."""

from __future__ import annotations

import asyncio
from asyncio import sslproto

from gatewaykit import agent_call, agent_session, appliance

from gateway.config import Paths
from gateway.remote import transport


def _expected_tls_class() -> type:
    loop = asyncio.get_running_loop()
    if type(loop).__module__.startswith("uvloop"):
        import uvloop.loop

        return uvloop.loop.SSLProtocol  # type: ignore[attr-defined,no-any-return]
    return sslproto.SSLProtocol


async def test_tls_runs_in_the_loops_own_protocol(home: Paths) -> None:
    async with appliance(home) as app:
        a = app.agent("agent_a")
        g = await app.grant(a)
        reg = app.gateway.registry
        async with agent_session(a, home) as s:
            status, body, _ = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and body["value"] == "dark", body
            assert len(reg.verified) == 1
            conn = next(iter(reg.verified))
            assert conn.raw is not None
            tls = conn.raw.get_protocol()  # type: ignore[attr-defined]
            # the loop's class itself: not a subclass with Python hooks on every read
            assert type(tls) is _expected_tls_class()
            assert isinstance(conn.handler, transport.GuardedConnection) and conn.handler.transport is not None
            assert conn.handler.transport.get_extra_info("ssl_object") is not None
        # a certificate-less client completes its handshake but is not verified: its request is refused
        async with agent_session(None, home) as s:
            status, body, _ = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 401 and body["error"]["code"] == "CERT_REQUIRED", body
            assert len(reg.unverified) == 1 and len(reg.verified) == 0
        # every connection is accounted for once closed
        for _ in range(200):
            if reg.active == 0:
                break
            await asyncio.sleep(0.02)
        assert reg.active == 0 and reg.accepted == 2
