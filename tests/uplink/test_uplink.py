"""The gateway on a VPS, the guard at home, over the outbound mTLS HTTP/2 uplink (docs/vps.md)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from gatewaykit import agent_call, agent_session
from guardkit import ITEMS, NOW, admin_headers, call, seed
from uplinkkit import split

from gateway.config import Paths
from gateway.guard.store import MemoryItem

# a value no certificate or key file can hold by chance ("_" and "-" are not in PEM's base64)
MOTTO = MemoryItem("preference.motto", "zq_motto-7731_x", ("preference",), "low", "user", NOW, NOW)

pytestmark = pytest.mark.timeout(60)


async def test_agent_reads_through_the_uplink_and_revocation_holds(home: Paths) -> None:
    async with split(home) as s:
        app = s.app
        a = app.agent("calendar_agent")
        g = await app.grant(a, read={"tags": ["preference"], "keys": []})
        async with agent_session(a, app.paths) as sess:
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and body["value"] == "dark", body
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory?tag=preference", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and {i["key"] for i in body["items"]} >= {"preference.theme", "preference.lang"}
            # denied partner: a key outside the grant is refused by the guard at home, relayed as is
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory/user.password", token=g["token"], agent_id=a.agent_id
            )
            assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
            # the VPS has no CA key: renewal is refused with the fix, not a missing-file error
            status, body, _ = await agent_call(
                sess, app.base, "/v1/certificates/renew", token=None, agent_id=a.agent_id, method="POST"
            )
            assert (
                status == 501 and body["error"]["code"] == "NOT_IMPLEMENTED" and "at home" in body["error"]["message"]
            )
            # nor enrollment: its codes and requests live in the home's enroll.db, never seen from the VPS
            for method, path in (("GET", "/v1/enroll/ca"), ("POST", "/v1/enroll"), ("POST", "/v1/enroll/r1/status")):
                status, body, _ = await agent_call(sess, app.base, path, token=None, agent_id=a.agent_id, method=method)
                assert status == 501 and body["error"]["code"] == "NOT_IMPLEMENTED", (path, status, body)
                assert "at home" in body["error"]["message"]
            await call(app.admin, "POST", f"/v1/sessions/{g['session_id']}/revoke", headers=admin_headers(home))
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 401 and body["error"]["code"] == "SESSION_REVOKED", body


def _vps_bytes(vps: Paths) -> bytes:
    """Every byte of every file in the VPS's data directory."""
    out = []
    for p in sorted(vps.home.rglob("*")):
        if p.is_file() and not p.is_socket():
            out.append(p.read_bytes())
    return b"\n".join(out)


async def _wait(pred, what: str, seconds: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(seconds / 0.05)):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached: {what}")


async def test_uplink_down_is_503_with_retry_after_and_the_spool_is_replayed(
    home: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gatewaykit import ledger_events

    async with split(home, home_side=False) as s:
        app = s.app
        seed(home, [*ITEMS, MOTTO])
        a = app.agent("calendar_agent")
        g = await app.grant(a, read={"tags": ["preference"], "keys": []})
        async with agent_session(a, app.paths) as sess:
            # no home side: the guard is unreachable, a stable code, a retry hint, and the event spooled
            status, body, hdrs = await agent_call(
                sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 503 and body["error"]["code"] == "STORE_UNAVAILABLE", body
            assert "uplink" in body["error"]["message"] and hdrs["Retry-After"].isdigit()
            status, body, hdrs = await agent_call(sess, app.base, "/v1/health", token=None, agent_id=None)
            assert status == 503 and hdrs["Retry-After"].isdigit()
            assert s.gateway.state is not None and s.gateway.state.events.backlog >= 1
            before = len(ledger_events(home, code="STORE_UNAVAILABLE"))
            # the home side dials in: served again, and the spool reaches the guard's one log
            task = asyncio.get_running_loop().create_task(s.home_side().run())
            try:
                await s.wait_connected()
                status, body, hdrs = await agent_call(
                    sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
                )
                assert status == 200 and body["value"] == "dark" and "Retry-After" not in hdrs
                status, body, _ = await agent_call(
                    sess, app.base, "/v1/memory/preference.motto", token=g["token"], agent_id=a.agent_id
                )
                assert status == 200 and body["value"] == MOTTO.value
                events = s.gateway.state.events
                await _wait(lambda: events.backlog == 0, "the whole spool replayed")
                assert len(ledger_events(home, code="STORE_UNAVAILABLE")) > before
            finally:
                task.cancel()
            # the home side leaves: 503 again, at once (no wait for a time-out)
            await s.wait_connected(False)
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 503 and body["error"]["code"] == "STORE_UNAVAILABLE"
        # what the gateway wrote holds no memory value and no token
        blob = _vps_bytes(s.vps)
        assert MOTTO.value.encode() not in blob and g["token"].encode() not in blob
        assert not s.vps.memory_db.exists() and not s.vps.private_jwk.exists() and not s.vps.ca_key.exists()
        assert not s.vps.audit_key.exists() and not s.vps.uplink_ca_key.exists()
        # `uomp doctor` on the VPS: its own checks, no "restore the signing key" advice; a home key here is flagged
        from portkit import free_port

        from gateway.cli.doctor import run_checks

        monkeypatch.setenv("UOMP_GATEWAY_LISTEN_PORT", str(free_port()))  # not a port someone else uses

        report = run_checks(s.vps)
        assert report.problems == 0, report.lines
        assert any("VPS gateway" in line for line in report.lines)
        s.vps.ca_key.write_bytes(home.ca_key.read_bytes())
        report = run_checks(s.vps)
        assert report.problems == 1 and any("agent CA key is on this VPS" in line for line in report.lines)


async def test_wrong_certificates_refused_on_either_side(home: Paths, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import ssl

    from gateway.core import ca
    from gateway.uplink import certs

    async with split(home, home_side=False) as s:
        app = s.app
        hub = s.gateway.uplink
        assert hub is not None
        loop = asyncio.get_running_loop()

        async def dial_refused(side, what: str) -> str:  # type: ignore[no-untyped-def]
            task = loop.create_task(side.run())
            try:
                await _wait(lambda: side.failures + side.connects >= 3, f"{what}: three dials")
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            assert not hub.connected and hub.connects == 0, what
            return str(side.last_error)

        # an agent certificate (the agent CA) on the uplink listener: no handshake
        agent = app.agent("calendar_agent")
        await dial_refused(
            s.home_side(cert_file=agent.files.cert_file, key_file=agent.files.key_file), "agent cert on the uplink"
        )
        # a second home identity from the same uplink CA, not the pinned one: refused by the gateway
        ca_key = ca.load_private_key(home.uplink_ca_key.read_bytes())
        ca_cert = ca.load_cert(home.uplink_ca_cert.read_bytes())
        other_key = ca.new_key()
        other = certs._issue_home(ca_key, ca_cert, other_key.public_key())
        (tmp_path / "other.crt").write_bytes(ca.cert_pem(other))
        (tmp_path / "other.key").write_bytes(ca.key_pem(other_key))
        await dial_refused(
            s.home_side(cert_file=tmp_path / "other.crt", key_file=tmp_path / "other.key"), "unpinned home cert"
        )
        assert hub.refused >= 1 and "pinned" in str(hub.last_error)
        # the home side pins another gateway: this one is refused by the home side
        (tmp_path / "pins.json").write_text(json.dumps({"pins": [certs.spki_pin(other)]}))
        why = await dial_refused(s.home_side(pins_file=tmp_path / "pins.json"), "gateway not pinned")
        assert "pinned" in why
        # a gateway certificate from another CA (the home trusts the uplink CA only): no handshake
        why = await dial_refused(s.home_side(ca_file=ca_store_cert(home)), "foreign CA")
        # the uplink home certificate on the agent listener: refused (chain to the agent CA only)
        ctx = ssl.create_default_context(cafile=str(ca_store_cert(home)))
        ctx.load_cert_chain(home.uplink_home_cert, home.uplink_home_key)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as sess:
                async with sess.get(app.base + "/v1/memory/preference.theme") as resp:
                    assert resp.status == 401 and (await resp.json())["error"]["code"] == "CERT_REQUIRED"
        except aiohttp.ClientError:
            pass  # refused at the handshake
        # the allowed partner: the pinned home side connects and serves
        task = loop.create_task(s.home_side().run())
        try:
            await s.wait_connected()
            assert hub.connects == 1
        finally:
            task.cancel()


def ca_store_cert(home: Paths):  # type: ignore[no-untyped-def]
    return home.ca_cert


async def test_a_second_home_side_is_sent_away_and_the_first_keeps_serving(home: Paths) -> None:
    async with split(home) as s:
        app = s.app
        hub = s.gateway.uplink
        assert hub is not None and hub.connects == 1
        second = s.home_side()
        task = asyncio.get_running_loop().create_task(second.run())
        try:
            await _wait(lambda: second.connects + second.failures >= 2, "the second side dialled twice")
            assert "another home side" in str(second.last_error)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert hub.connects == 1 and hub.refused >= 2 and hub.connected
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        async with agent_session(a, app.paths) as sess:
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and body["value"] == "dark"


async def test_home_side_killed_mid_response_then_restarted(home: Paths, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gatewaykit import ledger_events
    from uplinkkit import home_process

    # probes only when woken (a connect, a failed request): the armed kill point meets the agent's request
    async with split(home, home_side=False, upstream_health_interval_seconds=600.0) as s:
        app = s.app
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        arm = tmp_path / "arm"
        proc = home_process(home, s.uplink_url, fault="uplink.home.after-head", arm=arm)
        try:
            await s.wait_connected()
            arm.write_text("")
            async with agent_session(a, app.paths) as sess:
                status, body, _ = await agent_call(
                    sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
                )
                # the answer's head had crossed, its body had not: cut short, a stable code, no hang
                assert status == 502 and body["error"]["code"] == "UPSTREAM_ERROR", body
                assert proc.wait(timeout=10) == -9 and not arm.exists()
                await s.wait_connected(False)
                status, body, hdrs = await agent_call(
                    sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
                )
                assert status == 503 and body["error"]["code"] == "STORE_UNAVAILABLE" and "Retry-After" in hdrs
                proc = home_process(home, s.uplink_url)
                await s.wait_connected()
                status, body, _ = await agent_call(
                    sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
                )
                assert status == 200 and body["value"] == "dark"
            # the gateway's own events of the outage reached the guard's log once it was back
            await _wait(lambda: ledger_events(home, code="UPSTREAM_ERROR"), "the cut request's event replayed")
            await _wait(lambda: ledger_events(home, code="STORE_UNAVAILABLE"), "the refused request's event replayed")
        finally:
            proc.kill()
            proc.wait()


async def test_tunnel_listener_of_a_vps_gateway_reads_through_the_uplink(home: Paths) -> None:
    """cloudflared (or any tunnel) in front of the VPS gateway: DPoP there, the uplink behind."""
    import time

    from cryptography.hazmat.primitives import serialization

    from gateway.core import dpop

    tunnel = "https://tunnel.example"
    async with split(home, tunnel_origin_port=0, tunnel_endpoints=[tunnel]) as s:
        app = s.app
        a = app.agent("calendar_agent")
        g = await app.grant(a, audience=tunnel)
        key = serialization.load_pem_private_key(a.files.key_file.read_bytes(), password=None)
        url = tunnel + "/v1/memory/preference.theme"

        async def read(proof: str) -> tuple[int, dict]:  # type: ignore[type-arg]
            hdrs = {"Host": "tunnel.example", "X-UOMP-Agent-Id": a.agent_id, "Authorization": f"DPoP {g['token']}"}
            hdrs["DPoP"] = proof
            async with (
                aiohttp.ClientSession() as sess,
                sess.get(f"http://127.0.0.1:{s.gateway.tunnel_port}/v1/memory/preference.theme", headers=hdrs) as r,
            ):
                return r.status, await r.json(content_type=None)

        proof = dpop.make_dpop_proof(key, method="GET", url=url, access_token=g["token"], now=time.time())  # type: ignore[arg-type]
        status, body = await read(proof)
        assert status == 200 and body["value"] == "dark", body
        status, body = await read(proof)  # denied partner: the same proof again
        assert status == 401 and body["error"]["code"] == "DPOP_INVALID"


async def test_answers_and_bodies_larger_than_the_default_frame_cross_the_uplink(home: Paths) -> None:
    """Both ends enforce the frame size they advertise (64 KiB), not h2's 16 KiB default: an answer
    of a few hundred KiB comes back whole, and the link stays up."""
    big = MemoryItem("preference.essay", "zq_" + "e" * 200_000, ("preference",), "low", "user", NOW, NOW)
    async with split(home) as s:
        seed(home, [*ITEMS, big])
        app = s.app
        a = app.agent("calendar_agent")
        g = await app.grant(a, read={"tags": ["preference"], "keys": []})
        hub = s.gateway.uplink
        assert hub is not None
        link = hub.link
        async with agent_session(a, app.paths) as sess:
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory/preference.essay", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and body["value"] == big.value, (status, str(body)[:300])
            status, body, _ = await agent_call(
                sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and body["value"] == "dark"
        assert hub.link is link and link is not None and not link.closed  # the same connection throughout
