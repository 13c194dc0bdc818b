"""Two gateway processes' worth of state (two GatewayRunners, each its own data directory) in front of
one guard, sharing the DPoP replay cache and rate in a real redis-server, behind a real haproxy
(TCP mode). Session status, revocation and quotas come from the one guard."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from gatewaykit import Agent, Appliance, agent_call, agent_session
from guardkit import admin_headers, call, running_guard, seed, unix_session
from replicakit import Redis, haproxy, redis_server
from shortdir import short_dir

from gateway import ca_store
from gateway.config import GatewayConfig, Paths
from gateway.core import dpop
from gateway.remote.server import GatewayRunner
from gateway.uplink import certs

pytestmark = pytest.mark.timeout(90)

TUNNEL = "https://tunnel.example"


def key_of(agent: Agent) -> Any:
    return serialization.load_pem_private_key(agent.files.key_file.read_bytes(), password=None)


@dataclasses.dataclass
class Replicas:
    app: Appliance  # grants and agents at home; app.gateway = replica 0
    gateways: list[GatewayRunner]


@contextlib.asynccontextmanager
async def replicas(home: Paths, redis_url: str, **overrides: Any) -> AsyncIterator[Replicas]:
    ca_store.init_all(home)
    seed(home)
    async with running_guard(home, None, serve_tcp=False) as guard, unix_session(home) as admin:
        gws: list[GatewayRunner] = []
        try:
            for i in range(2):
                r = Paths(short_dir(f"uomp-r{i}-"))
                certs.export_gateway_files(home, r)  # public material + the gateway's TLS identity only
                base = GatewayConfig(
                    listen_port=0,
                    tunnel_origin_port=0,
                    tunnel_endpoints=[TUNNEL],
                    upstream=f"unix:{home.guard_sock}",
                    shared_redis_url=redis_url,
                    status_cache_seconds=0.2,
                )
                gw = GatewayRunner(r, dataclasses.replace(base, **overrides))
                await gw.start()
                gws.append(gw)
            yield Replicas(Appliance(home, gws[0], admin, guard), gws)
        finally:
            for gw in gws:
                await gw.stop()


async def tunnel_call(port: int, path: str, *, token: str, agent: str, proof: str | None) -> tuple[int, Any, Any]:
    """One request on a new connection (so haproxy's round robin moves on)."""
    hdrs = {"Host": "tunnel.example", "X-UOMP-Agent-Id": agent, "Authorization": f"DPoP {token}"}
    if proof:
        hdrs["DPoP"] = proof
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{port}{path}", headers=hdrs) as resp,
    ):
        return resp.status, await resp.json(content_type=None), resp.headers


def proof_for(key: Any, token: str, path: str = "/v1/memory/preference.theme", now: float | None = None) -> str:
    return dpop.make_dpop_proof(key, method="GET", url=TUNNEL + path, access_token=token, now=now or time.time())


async def test_dpop_proof_replayed_on_the_other_replica_is_refused(home: Paths, tmp_path: Path) -> None:
    with redis_server(tmp_path) as redis:
        async with replicas(home, redis.url) as rs:
            a = rs.app.agent("agent_a")
            g = await rs.app.grant(a, audience=TUNNEL)
            key = key_of(a)
            p0, p1 = (gw.tunnel_port for gw in rs.gateways)
            assert p0 is not None and p1 is not None
            proof = proof_for(key, g["token"])
            status, body, _ = await tunnel_call(
                p0, "/v1/memory/preference.theme", token=g["token"], agent="agent_a", proof=proof
            )
            assert status == 200 and body["value"] == "dark"
            for port in (p1, p0):  # the other replica, and the same one again
                status, body, _ = await tunnel_call(
                    port, "/v1/memory/preference.theme", token=g["token"], agent="agent_a", proof=proof
                )
                assert status == 401 and body["error"]["code"] == "DPOP_INVALID", body
                assert "already used" in body["error"]["message"]
            # allowed partners: fresh proofs on either replica and through haproxy, round robin
            with haproxy(tmp_path, [p0, p1]) as lb:
                for port in (p1, lb, lb, lb):
                    status, body, _ = await tunnel_call(
                        port,
                        "/v1/memory/preference.theme",
                        token=g["token"],
                        agent="agent_a",
                        proof=proof_for(key, g["token"]),
                    )
                    assert status == 200, body


async def test_dpop_rate_limit_holds_across_replicas(home: Paths, tmp_path: Path) -> None:
    # 3 proofs per key in two windows (ceil(0.025 * 2 * 60)): counted once for both replicas
    with redis_server(tmp_path) as redis:
        async with replicas(home, redis.url, dpop_max_proofs_per_second_per_key=0.025) as rs:
            a, b = rs.app.agent("agent_a"), rs.app.agent("agent_b")
            ga, gb = await rs.app.grant(a, audience=TUNNEL), await rs.app.grant(b, audience=TUNNEL)
            ka, kb = key_of(a), key_of(b)
            with haproxy(tmp_path, [gw.tunnel_port for gw in rs.gateways]) as lb:  # type: ignore[misc]
                for _ in range(3):
                    status, body, _ = await tunnel_call(
                        lb,
                        "/v1/memory/preference.theme",
                        token=ga["token"],
                        agent="agent_a",
                        proof=proof_for(ka, ga["token"]),
                    )
                    assert status == 200, body
                for gw in rs.gateways:  # the fourth is refused by each replica, whichever served the three
                    status, body, _ = await tunnel_call(
                        gw.tunnel_port,  # type: ignore[arg-type]
                        "/v1/memory/preference.theme",
                        token=ga["token"],
                        agent="agent_a",
                        proof=proof_for(ka, ga["token"]),
                    )
                    assert status == 401 and "too many" in body["error"]["message"], body
                # another key is not slowed by agent_a's
                status, body, _ = await tunnel_call(
                    lb,
                    "/v1/memory/preference.theme",
                    token=gb["token"],
                    agent="agent_b",
                    proof=proof_for(kb, gb["token"]),
                )
                assert status == 200, body


async def test_revoked_session_is_refused_by_both_replicas(home: Paths, tmp_path: Path) -> None:
    with redis_server(tmp_path) as redis:
        async with replicas(home, redis.url) as rs:
            a = rs.app.agent("agent_a")
            g = await rs.app.grant(a, audience=TUNNEL)
            key = key_of(a)
            for gw in rs.gateways:
                status, _, _ = await tunnel_call(
                    gw.tunnel_port,
                    "/v1/memory/preference.theme",
                    token=g["token"],
                    agent="agent_a",
                    proof=proof_for(key, g["token"]),  # type: ignore[arg-type]
                )
                assert status == 200
            await call(rs.app.admin, "POST", f"/v1/sessions/{g['session_id']}/revoke", headers=admin_headers(home))
            await asyncio.sleep(rs.gateways[0].cfg.status_cache_seconds)  # the longest a replica remembers a status
            for gw in rs.gateways:
                status, body, _ = await tunnel_call(
                    gw.tunnel_port,
                    "/v1/memory/preference.theme",
                    token=g["token"],
                    agent="agent_a",
                    proof=proof_for(key, g["token"]),  # type: ignore[arg-type]
                )
                assert status == 401 and body["error"]["code"] == "SESSION_REVOKED", body


async def test_redis_down_fails_closed_for_dpop_only_and_a_restart_does_not_reopen_replays(
    home: Paths, tmp_path: Path
) -> None:
    redis = Redis(tmp_path)
    redis.start()
    try:
        async with replicas(home, redis.url) as rs:
            app = rs.app
            a = app.agent("agent_a")
            g = await app.grant(a, audience=TUNNEL)
            m = app.agent("agent_m", sub="m")
            gm = await app.grant(m)  # mTLS, bound to m's certificate, audience replica 0
            key = key_of(a)
            p0 = rs.gateways[0].tunnel_port
            assert p0 is not None
            used = proof_for(key, g["token"], now=time.time() - 2)  # a second before Redis goes
            status, _, _ = await tunnel_call(
                p0, "/v1/memory/preference.theme", token=g["token"], agent="agent_a", proof=used
            )
            assert status == 200
            redis.kill()
            status, body, hdrs = await tunnel_call(
                p0, "/v1/memory/preference.theme", token=g["token"], agent="agent_a", proof=proof_for(key, g["token"])
            )
            assert status == 503 and body["error"]["code"] == "SHARED_STATE_UNAVAILABLE" and "Retry-After" in hdrs
            async with agent_session(m, app.paths) as sess:  # mTLS needs no shared state: it goes on
                status, body, _ = await agent_call(
                    sess, app.base, "/v1/memory/preference.theme", token=gm["token"], agent_id=m.agent_id
                )
                assert status == 200 and body["value"] == "dark"
            # Redis back, empty: the proof used before is not forgotten into a replay
            redis.start()
            status, body, _ = await tunnel_call(
                p0, "/v1/memory/preference.theme", token=g["token"], agent="agent_a", proof=used
            )
            assert status == 401 and body["error"]["code"] == "DPOP_INVALID", body
            assert "older than the shared replay cache" in body["error"]["message"]
            fresh = proof_for(key, g["token"])  # a proof from after the restart
            status, body, _ = await tunnel_call(
                p0, "/v1/memory/preference.theme", token=g["token"], agent="agent_a", proof=fresh
            )
            assert status == 200, body
    finally:
        redis.kill()
