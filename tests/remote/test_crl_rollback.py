"""An older but validly signed CRL (a pre-revocation backup put back) is refused on
reload and at start; the gateway keeps the last good one, and a restart remembers the highest CRL
Number and thisUpdate seen (``$UOMP_HOME/gateway/crl-state.json``).

Real gateway, real TLS 1.3 on 127.0.0.1, real guard on a Unix socket. The gateway reads its CRL from
a copy outside ``$UOMP_HOME/ca`` (config ``agent_crl``) so that the CA's own re-signing tick cannot
repair the rollback behind the test's back: what is tested is the reload alone.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from gatewaykit import Agent, agent_call, agent_session, appliance

from gateway import ca_store
from gateway.config import GatewayConfig, Paths
from gateway.core import ca
from gateway.errors import UompError
from gateway.fsutil import atomic_write
from gateway.remote.server import GatewayRunner

pytestmark = pytest.mark.timeout(90)


def _put(crl_copy: Path, data: bytes) -> None:
    atomic_write(crl_copy, data, mode=0o644)


async def _reads(agent: Agent, paths: Paths, base: str, grant: dict[str, Any]) -> int | None:
    """The status of one read, or None when the TLS handshake is refused."""
    try:
        async with agent_session(agent, paths) as s:
            status, _, _ = await agent_call(
                s, base, "/v1/memory/preference.theme", token=grant["token"], agent_id=agent.agent_id
            )
            return status
    except aiohttp.ClientError:
        return None


def _older_crl(paths: Paths, *, number: int, this_update: dt.datetime) -> bytes:
    """A validly signed CRL listing nobody, with the given number and thisUpdate (a forged 'backup')."""
    key, cert = ca_store.load_ca(paths)
    return ca.crl_pem(ca.build_crl(key, cert, [], this_update + ca.CLOCK_SKEW, number=number))


def _current(crl_copy: Path) -> tuple[int, dt.datetime]:
    crl = x509.load_pem_x509_crl(crl_copy.read_bytes())
    return ca.crl_number(crl), crl.last_update_utc


@pytest.mark.parametrize("rollback", ["pre_revocation_backup", "lower_number", "older_this_update"])
async def test_older_crl_is_refused_and_the_revoked_agent_stays_out(
    home: Paths, tmp_path: Path, rollback: str, caplog: pytest.LogCaptureFixture
) -> None:
    ca_store.init_all(home)
    crl_copy = tmp_path / "agents.crl.pem"
    shutil.copyfile(ca_store.crl_path(home), crl_copy)
    backup = crl_copy.read_bytes()  # before any revocation
    async with appliance(home, agent_crl=str(crl_copy)) as app:
        reloader = app.gateway.reloader
        assert reloader is not None
        bad, good = app.agent("bad_agent"), app.agent("good_agent")
        g_bad, g_good = await app.grant(bad), await app.grant(good)
        assert await _reads(bad, home, app.base, g_bad) == 200

        ca_store.revoke(home, "bad_agent")
        _put(crl_copy, ca_store.crl_path(home).read_bytes())
        gen = reloader.generation
        reloader.reload()  # what SIGHUP or the watcher does
        assert reloader.generation == gen + 1
        assert await _reads(bad, home, app.base, g_bad) == 401  # revoked: refused by name at its first request
        number, this_update = _current(crl_copy)

        if rollback == "pre_revocation_backup":
            old = backup
        elif rollback == "lower_number":  # signed later, but numbered below the one accepted
            old = _older_crl(home, number=number - 1, this_update=this_update + dt.timedelta(seconds=5))
        else:  # numbered above, but issued before the one accepted
            old = _older_crl(home, number=number + 1, this_update=this_update - dt.timedelta(seconds=5))
        _put(crl_copy, old)
        caplog.set_level(logging.WARNING)
        with pytest.raises(UompError) as exc:
            reloader.reload()
        assert exc.value.code == "CONFIG_ERROR" and "older" in exc.value.message
        assert reloader.generation == gen + 1  # the last good CRL is still the one in use
        assert await _reads(bad, home, app.base, g_bad) == 401
        assert await _reads(good, home, app.base, g_good) == 200  # everyone else keeps working
        assert reloader.revoked  # the revoked serial is still known to the application layer

        # the watcher path logs it and keeps going (a refused file is not retried on every tick)
        _put(crl_copy, old + b"\n")  # a new stamp: the watcher looks again
        reloader.reload_logged()
        assert any("older" in r.getMessage() for r in caplog.records)
        assert await _reads(bad, home, app.base, g_bad) == 401

    # a restart remembers the highest CRL seen: the old file is refused at start, clearly
    state = json.loads((home.gateway_dir / "crl-state.json").read_text())
    assert state["crl_number"] == number
    gw = GatewayRunner(home, GatewayConfig(listen_port=0, agent_crl=str(crl_copy)))
    with pytest.raises(UompError) as exc:
        await gw.start()
    assert exc.value.code == "CONFIG_ERROR" and "older" in exc.value.message

    # a newer CRL is accepted as usual, at start and on reload
    ca_store.refresh_crl(home, min_remaining=dt.timedelta(days=365))
    _put(crl_copy, ca_store.crl_path(home).read_bytes())
    gw = GatewayRunner(home, GatewayConfig(listen_port=0, agent_crl=str(crl_copy)))
    await gw.start()
    try:
        assert gw.reloader is not None and not gw.reloader.changed()
    finally:
        await gw.stop()
    assert json.loads((home.gateway_dir / "crl-state.json").read_text())["crl_number"] > number
