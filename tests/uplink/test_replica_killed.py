"""Two gateway processes behind a real haproxy (TCP mode, mTLS end to end) sharing a real
redis-server, in front of one guard: one replica is killed (-9) in the middle of a run of agent
reads. No request is answered wrongly, the failures are clean and counted, the other replica keeps
serving, and a DPoP proof used on the dead replica stays used on the live one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from gatewaykit import agent_call, agent_session, ledger_events
from guardkit import running_guard, seed, unix_session
from portkit import free_port
from replicakit import haproxy, redis_server
from shortdir import short_dir
from uplinkkit import ROOT

from gateway import ca_store
from gateway.config import GatewayConfig, Paths
from gateway.core import dpop
from gateway.remote.server import GatewayRunner
from gateway.uplink import certs

pytestmark = pytest.mark.timeout(90)

TUNNEL = "https://tunnel.example"
REQUESTS = 240
WORKERS = 12
KILL_AFTER = 60

# One gateway as its own process: the data directory, then the config as JSON; prints its port.
RUNNER = """
import asyncio, json, sys
from pathlib import Path
from gateway.config import GatewayConfig, Paths
from gateway.remote.server import GatewayRunner

async def main() -> None:
    gw = GatewayRunner(Paths(Path(sys.argv[1])), GatewayConfig(**json.loads(sys.argv[2])))
    await gw.start()
    print(gw.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _replica(home: Paths, cfg: dict[str, Any]) -> subprocess.Popen[str]:
    r = Paths(short_dir("uomp-rk-"))
    certs.export_gateway_files(home, r)  # public material + the gateway's TLS identity only
    env = {k: v for k, v in os.environ.items() if not k.startswith("UOMP_")}
    env.update(UOMP_HOME=str(r.home), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(r.home), json.dumps(cfg)],
        env=env,
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=open(r.home / "stderr.log", "wb"),
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == str(cfg["listen_port"]), (r.home / "stderr.log").read_text()[-3000:]
    return proc


def _proof(key: Any, token: str, path: str = "/v1/memory/preference.theme") -> str:
    return dpop.make_dpop_proof(key, method="GET", url=TUNNEL + path, access_token=token, now=time.time())


async def _tunnel_read(port: int, token: str, agent: str, proof: str) -> tuple[int, Any]:
    hdrs = {"Host": "tunnel.example", "X-UOMP-Agent-Id": agent, "Authorization": f"DPoP {token}", "DPoP": proof}
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{port}/v1/memory/preference.theme", headers=hdrs) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


async def test_replica_killed_mid_load(home: Paths, tmp_path: Path) -> None:
    ca_store.init_all(home)
    seed(home)
    ports = [free_port(), free_port()]
    tunnels = [free_port(), free_port()]
    lb_port = free_port()
    with redis_server(tmp_path) as redis:
        async with running_guard(home, None, serve_tcp=False) as guard, unix_session(home) as admin:
            procs: list[subprocess.Popen[str]] = []
            try:
                for port, tport in zip(ports, tunnels, strict=True):
                    cfg = {
                        "listen_port": port,
                        "tunnel_origin_port": tport,
                        "tunnel_endpoints": [TUNNEL],
                        "endpoints": [f"https://localhost:{lb_port}"],
                        "upstream": f"unix:{home.guard_sock}",
                        "shared_redis_url": redis.url,
                        "status_cache_seconds": 0.2,
                    }
                    procs.append(await asyncio.to_thread(_replica, home, cfg))
                from gatewaykit import Appliance

                app = Appliance(home, GatewayRunner(home, GatewayConfig()), admin, guard)
                a = app.agent("calendar_agent")
                base = f"https://localhost:{lb_port}"
                g = await app.grant(a, audience=base, limits={"max_read_queries": 10000})
                gd = await app.grant(a, audience=TUNNEL)
                key = serialization.load_pem_private_key(a.files.key_file.read_bytes(), password=None)
                # a DPoP proof used on the replica about to die
                used = _proof(key, gd["token"])
                status, body = await _tunnel_read(tunnels[1], gd["token"], a.agent_id, used)
                assert status == 200 and body["value"] == "dark", body
                reads_before = len(ledger_events(home, action="read"))
                with haproxy(tmp_path, ports, check=True, port=lb_port) as lb:
                    base = f"https://localhost:{lb}"
                    counts = {"ok": 0, "wrong": 0, "clean": 0}
                    done = 0
                    wrong: list[tuple[int, Any]] = []
                    killed = asyncio.Event()
                    todo = iter(range(REQUESTS))

                    async def worker() -> None:
                        nonlocal done
                        # a new connection per request: haproxy's round robin moves on every time
                        async with agent_session(a, app.paths, force_close=True) as sess:
                            for _ in todo:
                                try:
                                    status, body, _ = await agent_call(
                                        sess, base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
                                    )
                                except (TimeoutError, aiohttp.ClientError, OSError):
                                    counts["clean"] += 1  # the connection broke: no answer, nothing wrong said
                                else:
                                    if status == 200 and body.get("value") == "dark":
                                        counts["ok"] += 1
                                    elif status in (502, 503) and isinstance(body, dict) and "error" in body:
                                        counts["clean"] += 1
                                    else:
                                        counts["wrong"] += 1
                                        wrong.append((status, body))
                                done += 1
                                if done == KILL_AFTER and not killed.is_set():
                                    procs[1].send_signal(signal.SIGKILL)  # mid-load, requests in flight
                                    killed.set()

                    await asyncio.gather(*(worker() for _ in range(WORKERS)))
                    assert killed.is_set() and procs[1].wait(10) == -signal.SIGKILL
                    print(f"replica killed mid-load: {counts} of {REQUESTS}")
                    assert counts["wrong"] == 0, (counts, wrong[:3])
                    assert counts["ok"] + counts["clean"] == REQUESTS
                    assert counts["clean"] <= WORKERS, counts  # at most the requests in flight at the kill
                    assert counts["ok"] >= REQUESTS - WORKERS
                    # the live replica serves everything now (haproxy marked the dead one down)
                    async with agent_session(a, app.paths, force_close=True) as sess:
                        for _ in range(6):
                            status, body, _ = await agent_call(
                                sess, base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
                            )
                            assert status == 200 and body["value"] == "dark", body
                # every read answered 200 is in the guard's one log (acknowledged = recorded)
                assert len(ledger_events(home, action="read")) - reads_before >= counts["ok"] + 6
                # the proof used on the dead replica is still used for the live one; a fresh one passes
                status, body = await _tunnel_read(tunnels[0], gd["token"], a.agent_id, used)
                assert (
                    status == 401
                    and body["error"]["code"] == "DPOP_INVALID"
                    and "already used" in body["error"]["message"]
                )
                fresh = _proof(key, gd["token"])
                status, body = await _tunnel_read(tunnels[0], gd["token"], a.agent_id, fresh)
                assert status == 200, body
                status, body = await _tunnel_read(tunnels[0], gd["token"], a.agent_id, fresh)
                assert status == 401 and body["error"]["code"] == "DPOP_INVALID"
            finally:
                for p in procs:
                    p.kill()
                    p.wait(10)
                    if p.stdout is not None:
                        p.stdout.close()
