"""The CRL and the verification keys pushed from home to the VPS gateway over the uplink
(gateway/uplink/trust.py): a revocation at home is refused by the VPS itself within seconds, an
older CRL or a foreign one is refused, and nothing of it is reachable from an agent connection."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from gatewaykit import Agent, agent_call, agent_session
from uplinkkit import ROOT, home_process, split, stalling_guard

from gateway import ca_store, keys
from gateway.config import Paths
from gateway.core import ca
from gateway.fsutil import atomic_write

pytestmark = pytest.mark.timeout(90)


async def _wait(pred, what: str, seconds: float = 15.0) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if pred():
            return time.monotonic() - t0
        await asyncio.sleep(0.02)
    raise AssertionError(f"not reached: {what}")


def _listed(crl_file: Path) -> set[str]:
    crl = x509.load_pem_x509_crl(crl_file.read_bytes())
    return {ca.serial_hex(r.serial_number) for r in crl}


async def _refused_by_cert(a: Agent, paths: Paths, base: str, token: str) -> str:
    """A fresh connection with ``a``'s certificate: refused at the handshake or 401 CERT_REQUIRED
    naming the revocation, never answered. Returns which."""
    try:
        async with agent_session(a, paths) as sess:
            status, body, _ = await agent_call(
                sess, base, "/v1/memory/preference.theme", token=token, agent_id=a.agent_id
            )
    except (aiohttp.ClientError, OSError):
        return "handshake"
    assert status == 401 and body["error"]["code"] == "CERT_REQUIRED", (status, body)
    assert "revoked" in body["error"]["message"], body
    return "401"


async def test_revocation_at_home_is_refused_by_the_vps_itself(home: Paths) -> None:
    """A real `uomp guard uplink` at home, a real `uomp agent revoke`: the VPS's own CRL lists the
    serial within seconds and the VPS refuses the certificate, also once home is unreachable."""
    async with split(home, home_side=False) as s:
        app = s.app
        a, b = app.agent("calendar_agent"), app.agent("mail_agent")
        ga, gb = await app.grant(a), await app.grant(b)
        proc = home_process(home, s.uplink_url)
        try:
            await s.wait_connected()
            async with agent_session(a, app.paths) as kept:  # a keep-alive connection from before
                status, body, _ = await agent_call(
                    kept, app.base, "/v1/memory/preference.theme", token=ga["token"], agent_id=a.agent_id
                )
                assert status == 200 and body["value"] == "dark"
                assert a.files.serial not in _listed(s.vps.crl)
                env = {k: v for k, v in os.environ.items() if not k.startswith("UOMP_")}
                env.update(UOMP_HOME=str(home.home), PYTHONPATH=str(ROOT))
                t0 = time.monotonic()
                out = await asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-m", "gateway.cli.main", "agent", "revoke", a.agent_id, "--keep-sessions"],
                    env=env,
                    cwd=str(ROOT),
                    capture_output=True,
                    timeout=30,
                )
                assert out.returncode == 0, out.stderr
                assert a.files.serial in _listed(home.crl)
                await _wait(lambda: a.files.serial in _listed(s.vps.crl), "the VPS's CRL lists the serial")
                print(f"revoke at home -> the VPS's CRL lists it: {time.monotonic() - t0:.2f} s (CLI start included)")
                gw_reloader = s.gateway.reloader
                assert gw_reloader is not None
                # the file is written first, then the list in memory reloaded from it (install_crl)
                await _wait(lambda: a.files.serial in gw_reloader.revoked, "the VPS's gateway holds the new CRL")
                # the connection made before the revocation: refused at its next request, by the VPS
                status, body, _ = await agent_call(
                    kept, app.base, "/v1/memory/preference.theme", token=ga["token"], agent_id=a.agent_id
                )
                assert status == 401 and body["error"]["code"] == "CERT_REQUIRED", body
            # a new connection: refused (handshake or named 401)
            await _refused_by_cert(a, app.paths, app.base, ga["token"])
            # the other agent keeps working
            async with agent_session(b, app.paths) as sess:
                status, body, _ = await agent_call(
                    sess, app.base, "/v1/memory/preference.theme", token=gb["token"], agent_id=b.agent_id
                )
                assert status == 200 and body["value"] == "dark"
            # home gone (kill -9): the VPS still refuses the revoked certificate by itself, while the
            # other agent is told the guard is unreachable (so the refusal above was not the guard's)
            proc.kill()
            proc.wait()
            await s.wait_connected(False)
            await _refused_by_cert(a, app.paths, app.base, ga["token"])
            async with agent_session(b, app.paths) as sess:
                status, body, _ = await agent_call(
                    sess, app.base, "/v1/memory/preference.theme", token=gb["token"], agent_id=b.agent_id
                )
                assert status == 503 and body["error"]["code"] == "STORE_UNAVAILABLE", body
            # the status the home side wrote: target, connections, when the CRL went out
            st = json.loads((home.uplink_dir / "home-status.json").read_text())
            assert st["target"] == s.uplink_url and st["crl_pushed_at"] and st["connects"] >= 1
        finally:
            proc.kill()
            proc.wait()


async def test_older_or_foreign_crl_and_bad_keys_are_refused(home: Paths, caplog: pytest.LogCaptureFixture) -> None:
    async with split(home, home_side=False) as s:
        app = s.app
        hub, reloader = s.gateway.uplink, s.gateway.reloader
        assert hub is not None and hub.trust is not None and reloader is not None
        sink = hub.trust
        old_crl = home.crl.read_bytes()
        a = app.agent("calendar_agent")
        ga = await app.grant(a)
        task = asyncio.get_running_loop().create_task(s.home_side(keep_crl=False).run())
        try:
            await s.wait_connected()
            await _wait(lambda: sink.crl_pushed_at is not None, "the CRL pushed on connect")
            assert s.vps.crl.read_bytes() == home.crl.read_bytes()
            await asyncio.to_thread(ca_store.revoke, home, a.agent_id)
            took = await _wait(lambda: a.files.serial in reloader.revoked, "the revocation pushed")
            print(f"home CRL written -> the VPS refuses the serial: {took:.2f} s")
            assert a.files.serial in _listed(s.vps.crl)
            held = s.vps.crl.read_bytes()
            mark = reloader.crl_mark
            assert mark is not None
            # an older CRL put back at home (validly signed, from before the revocation): refused
            caplog.set_level(logging.WARNING, logger="uomp.uplink")
            refused = sink.refused
            atomic_write(home.crl, old_crl, mode=0o644)
            await _wait(lambda: sink.refused > refused, "the older CRL refused")
            assert "older CRL" in str(sink.last_refusal)
            assert any("refused the CRL" in r.getMessage() for r in caplog.records)
            assert s.vps.crl.read_bytes() == held and reloader.crl_mark == mark
            assert a.files.serial in reloader.revoked
            await _refused_by_cert(a, app.paths, app.base, ga["token"])
            # a CRL with a higher number signed by another CA: refused (the VPS checks the signature)
            other_key, other_cert = ca.create_ca()
            forged = ca.crl_pem(ca.build_crl(other_key, other_cert, [], ca.utcnow(), number=mark.number + 100))
            refused = sink.refused
            atomic_write(home.crl, forged, mode=0o644)
            await _wait(lambda: sink.refused > refused, "the foreign CRL refused")
            assert "not signed by the agent CA" in str(sink.last_refusal)
            assert s.vps.crl.read_bytes() == held and reloader.crl_mark == mark
            # the current CRL back, and a key rotation with the old key revoked: pushed; the VPS
            # verifies tokens with the new set (an old token refused by the VPS itself)
            atomic_write(home.crl, held, mode=0o644)
            b = app.agent("mail_agent")
            gb = await app.grant(b)
            keys.rotate(home, max_token_lifetime=3600, revoke_old=True)
            await _wait(lambda: s.vps.jwks.read_bytes() == home.jwks.read_bytes(), "the new jwks pushed")
            await _wait(lambda: s.vps.revoked_keys.exists(), "revoked-keys pushed")
            assert s.vps.revoked_keys.read_bytes() == home.revoked_keys.read_bytes()
            assert not s.vps.private_jwk.exists()
            gw_state = s.gateway.state
            assert gw_state is not None
            await _wait(lambda: set(gw_state.public_keys) == set(keys.load_public_keys(home)), "VPS keys reloaded")
            async with agent_session(b, app.paths) as sess:  # signed by the revoked key
                status, body, _ = await agent_call(
                    sess, app.base, "/v1/memory/preference.theme", token=gb["token"], agent_id=b.agent_id
                )
            assert status == 401 and body["error"]["code"] != "CERT_REQUIRED", body
            # a revoked-keys list that forgets a revoked key, a jwks with a private key: refused
            from gateway.uplink.trust import Bundle

            held_keys = s.vps.revoked_keys.read_bytes()
            held_jwks = s.vps.jwks.read_bytes()
            refused = sink.refused
            private = json.dumps({"keys": [json.loads(home.private_jwk.read_bytes())]}).encode()
            await asyncio.to_thread(sink.apply, Bundle(None, private, b'{"keys": []}'))
            assert sink.refused == refused + 2
            assert s.vps.revoked_keys.read_bytes() == held_keys and s.vps.jwks.read_bytes() == held_jwks
        finally:
            task.cancel()


async def test_no_trust_route_on_the_agent_listener(home: Paths) -> None:
    """An agent (valid certificate and token) cannot reach the push: the VPS has no such route (404),
    and its CRL and keys stay as they were."""
    async with split(home) as s:
        app = s.app
        hub = s.gateway.uplink
        assert hub is not None and hub.trust is not None
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        crl, jwks = s.vps.crl.read_bytes(), s.vps.jwks.read_bytes()
        other_key, other_cert = ca.create_ca()
        forged = ca.crl_pem(ca.build_crl(other_key, other_cert, [], ca.utcnow(), number=10**6)).decode()
        body = {"etag": "x", "crl": forged, "jwks": '{"keys": []}', "revoked_keys": None}
        async with agent_session(a, app.paths) as sess:
            for method in ("GET", "POST", "PUT"):
                for path in ("/uplink/v1/trust", "/uplink/v1/trust?have=", "/v1/uplink/trust"):
                    status, answer, _ = await agent_call(
                        sess, app.base, path, token=g["token"], agent_id=a.agent_id, method=method, json_body=body
                    )
                    assert status in (404, 405) and answer["error"]["code"] in ("NOT_FOUND", "METHOD_NOT_ALLOWED"), (
                        method,
                        path,
                        status,
                        answer,
                    )
            # the allowed partner on the same connection: a read still works
            status, answer, _ = await agent_call(
                sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200
        assert s.vps.crl.read_bytes() == crl and s.vps.jwks.read_bytes() == jwks and hub.trust.refused == 0


async def test_full_uplink_still_carries_the_trust_poll_and_agents_get_places(home: Paths) -> None:
    """The trust poll holds a stream of the home side's few: a full uplink still queues agent
    requests (never a failed stream open, 503 STORE_UNAVAILABLE) and still carries a revocation."""
    async with (
        stalling_guard() as stall,
        split(home, home_side=False, upstream_timeout_seconds=3.0, upstream_health_interval_seconds=600.0) as s,
    ):
        app = s.app
        hub = s.gateway.uplink
        assert hub is not None and hub.trust is not None
        sink = hub.trust
        a, b = app.agent("calendar_agent"), app.agent("mail_agent")
        g = await app.grant(a)
        # 5 streams: the trust poll, a payload offer, a health probe (hub.OWN_STREAMS), two agent requests
        task = asyncio.get_running_loop().create_task(s.home_side(guard=stall, max_streams=5, keep_crl=False).run())
        try:
            await s.wait_connected()
            await _wait(lambda: sink.crl_pushed_at is not None, "the CRL pushed on connect")
            async with agent_session(a, app.paths, limit=10) as sess:
                held = [
                    asyncio.ensure_future(
                        agent_call(sess, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id)
                    )
                    for _ in range(4)
                ]
                await _wait(lambda: hub._in_flight == 2 and len(hub._waiters) == 2, "two in flight, two queued")
                await asyncio.to_thread(ca_store.revoke, home, b.agent_id)  # while the uplink is full
                await _wait(lambda: b.files.serial in _listed(s.vps.crl), "the revocation pushed")
                for t in held:
                    status, body, _ = await asyncio.wait_for(t, 30)
                    assert status == 504 and body["error"]["code"] == "UPSTREAM_TIMEOUT", body
        finally:
            task.cancel()
