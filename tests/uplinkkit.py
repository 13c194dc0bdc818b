"""Test helpers: the split appliance — the guard at home on a real Unix socket, the gateway in its
own data directory (the VPS's, written by ``uomp uplink init``) with real TLS 1.3, and the home
side dialling the gateway's uplink listener, in this process or as a real ``uomp guard uplink``
process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gatewaykit import Appliance
from guardkit import running_guard, seed, unix_session
from shortdir import short_dir

from gateway import ca_store
from gateway.config import GatewayConfig, Paths
from gateway.remote.server import GatewayRunner
from gateway.remote.upstream import Upstream
from gateway.uplink import certs
from gateway.uplink.home import HomeUplink

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Split:
    app: Appliance  # paths = the home's (agents are issued and sessions granted at home)
    vps: Paths

    @property
    def gateway(self) -> GatewayRunner:
        return self.app.gateway

    @property
    def uplink_url(self) -> str:
        return f"https://localhost:{self.gateway.uplink_port}"

    def home_side(self, **kw: Any) -> HomeUplink:
        home = self.app.paths
        kw.setdefault("keepalive", 0.5)
        kw.setdefault("backoff_min", 0.05)
        kw.setdefault("backoff_max", 0.5)
        return HomeUplink(
            self.uplink_url,
            cert_file=kw.pop("cert_file", home.uplink_home_cert),
            key_file=kw.pop("key_file", home.uplink_home_key),
            ca_file=kw.pop("ca_file", home.uplink_ca_cert),
            pins_file=kw.pop("pins_file", home.uplink_pins),
            guard=kw.pop("guard", Upstream("unix", str(home.guard_sock))),
            paths=kw.pop("paths", home),  # the home's CRL and keys go to the gateway over the uplink
            **kw,
        )

    async def wait_connected(self, want: bool = True, seconds: float = 15.0) -> None:
        hub = self.gateway.uplink
        assert hub is not None
        for _ in range(int(seconds / 0.02)):
            if hub.connected == want and (self.gateway.monitor is None or self.gateway.monitor.up is want):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"uplink connected={hub.connected}, wanted {want}")


@contextlib.asynccontextmanager
async def split(home: Paths, *, home_side: bool = True, **gateway_overrides: Any) -> AsyncIterator[Split]:
    """The guard at ``home``, the gateway in a fresh VPS directory, (optionally) the home side in-process."""
    ca_store.init_all(home)
    seed(home)
    vps_dir = short_dir("uomp-vps-")
    made = certs.init(home, ["localhost"], vps_dir)
    vps = Paths(made.vps_dir)
    overrides: dict[str, Any] = {
        "listen_port": 0,
        "uplink_listen_port": 0,
        "uplink_keepalive_seconds": 0.5,
        "upstream_health_interval_seconds": 0.3,
        "upstream_timeout_seconds": 5.0,
    }
    overrides.update(gateway_overrides)
    cfg = dataclasses.replace(GatewayConfig(), **overrides)
    async with running_guard(home, None, serve_tcp=False) as guard, unix_session(home) as admin:
        gw = GatewayRunner(vps, cfg)
        await gw.start()
        s = Split(Appliance(home, gw, admin, guard), vps)
        task: asyncio.Task[None] | None = None
        try:
            if home_side:
                task = asyncio.get_running_loop().create_task(s.home_side().run())
                await s.wait_connected()
            yield s
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await gw.stop()


def home_process(
    home: Paths, url: str, *, fault: str | None = None, arm: Path | None = None
) -> subprocess.Popen[bytes]:
    """``uomp guard uplink URL`` as a real process (``fault``: a named kill point, armed by ``arm``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UOMP_")}
    env["UOMP_HOME"] = str(home.home)
    env["PYTHONPATH"] = str(ROOT)
    if fault is not None:
        env["UOMP_FAULT"] = fault
        env["UOMP_FAULT_ARM"] = str(arm)
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli.main", "guard", "uplink", url],
        env=env,
        cwd=str(ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # it logs every redial: a pipe nobody reads would fill and block it
    )


@contextlib.asynccontextmanager
async def stalling_guard():  # type: ignore[no-untyped-def]
    """A Unix socket that answers /v1/health and never answers anything else."""
    path = short_dir("uomp-stall-") / "g.sock"
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        with contextlib.suppress(Exception):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"GET /v1/health "):
                    await asyncio.sleep(3600)
                body = b'{"status": "ok"}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 16\r\n\r\n" + body)
                await writer.drain()

    srv = await asyncio.start_unix_server(serve, str(path))
    try:
        yield Upstream("unix", str(path))
    finally:
        srv.close()
        for w in held:
            w.close()
