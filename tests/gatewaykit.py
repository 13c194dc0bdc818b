"""Test helpers: the whole appliance on 127.0.0.1 (guard on a real Unix socket, gateway with real TLS 1.3)."""

from __future__ import annotations

import contextlib
import dataclasses
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from guardkit import grant, running_guard, seed, unix_session

from gateway import ca_store
from gateway.client.tls import build_client_context
from gateway.config import GatewayConfig, GuardConfig, Paths
from gateway.core import jose
from gateway.guard.server import GuardRunner
from gateway.remote.server import GatewayRunner


@dataclasses.dataclass
class Agent:
    agent_id: str
    files: ca_store.IssuedFiles

    @property
    def x5t(self) -> str:
        cert = x509.load_pem_x509_certificate(self.files.cert_file.read_bytes())
        return jose.cert_thumbprint(cert.public_bytes(serialization.Encoding.DER))

    @property
    def jkt(self) -> str:
        cert = x509.load_pem_x509_certificate(self.files.cert_file.read_bytes())
        return jose.key_thumbprint(cert.public_key())  # type: ignore[arg-type]

    def ssl(self) -> ssl.SSLContext:
        return build_client_context(self.files.ca_file, self.files.cert_file, self.files.key_file)


@dataclasses.dataclass
class Appliance:
    paths: Paths
    gateway: GatewayRunner
    admin: aiohttp.ClientSession
    guard: GuardRunner | None = None  # the in-process guard (its services: counters, state)

    @property
    def base(self) -> str:
        return f"https://localhost:{self.gateway.port}"

    def agent(self, agent_id: str, *, sub: str | None = None) -> Agent:
        out = self.paths.home / "agents-test" / (sub or agent_id)
        return Agent(agent_id, ca_store.issue_with_key(self.paths, agent_id, out))

    async def grant(
        self, agent: Agent, *, read: dict[str, Any] | None = None, bind: bool = True, **extra: Any
    ) -> dict[str, Any]:
        extra.setdefault("profile", "remote")
        extra.setdefault("audience", self.base)
        if bind:
            extra.setdefault("cnf", {"x5t#S256": agent.x5t, "jkt": agent.jkt})
        return await grant(
            self.admin, self.paths, read=read or {"tags": ["preference"], "keys": []}, agent_id=agent.agent_id, **extra
        )


def ca_file(paths: Paths) -> Path:
    return ca_store.ca_cert_path(paths)


@contextlib.asynccontextmanager
async def appliance(
    paths: Paths, *, guard_cfg: GuardConfig | None = None, **gateway_overrides: Any
) -> AsyncIterator[Appliance]:
    ca_store.init_all(paths)
    seed(paths)
    cfg = dataclasses.replace(GatewayConfig(listen_port=0), **gateway_overrides)
    async with running_guard(paths, guard_cfg, serve_tcp=False) as guard, unix_session(paths) as admin:
        gw = GatewayRunner(paths, cfg)
        await gw.start()
        try:
            yield Appliance(paths, gw, admin, guard)
        finally:
            await gw.stop()


def agent_session(agent: Agent | None, paths: Paths, **kwargs: Any) -> aiohttp.ClientSession:
    ctx = agent.ssl() if agent else build_client_context(ca_file(paths))
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, **kwargs))


async def agent_call(
    session: aiohttp.ClientSession,
    base: str,
    path: str,
    *,
    token: str | None,
    agent_id: str | None,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    json_body: Any = None,
    data: bytes | None = None,
) -> tuple[int, Any, Any]:
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    if agent_id is not None:
        hdrs["X-UOMP-Agent-Id"] = agent_id
    async with session.request(method, base + path, headers=hdrs, json=json_body, data=data) as resp:
        raw = await resp.read()
        try:
            import json

            body = json.loads(raw)
        except ValueError:
            body = raw
        return resp.status, body, resp.headers


def ledger_events(paths: Paths, **match: Any) -> list[dict[str, Any]]:
    """The one log: every event body of the guard's ledger, in sequence order, whose
    fields equal ``match`` (e.g. ``action="read"``, ``listener="mtls"``). Read from audit.db as it is
    on disk: what a test sees here is durable."""
    import json
    import sqlite3

    conn = sqlite3.connect(f"file:{paths.audit_db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT body FROM ledger_events WHERE body IS NOT NULL ORDER BY seq").fetchall()
    finally:
        conn.close()
    events = [json.loads(r[0]) for r in rows]
    return [e for e in events if all(e.get(k) == v for k, v in match.items())]


def verify_ledger(paths: Paths) -> Any:
    """``uomp audit verify`` on the guard's ledger: the verifier's report (``.ok``, ``.events``)."""
    import sqlite3

    from gateway.ledger import auditkey
    from gateway.ledger.verify import verify_log

    key = auditkey.load(paths)
    conn = sqlite3.connect(paths.audit_db)
    try:
        return verify_log(conn, origin=auditkey.origin_for(key.public_key()), public_key=key.public_key())
    finally:
        conn.close()
