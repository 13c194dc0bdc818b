"""Test helpers for agent-side tests: the appliance with its mTLS listener AND the tunnel-origin
listener (DPoP), and agent bundles from real grants (key and certificate made here, the grant through
the real management API), for the SDK, ``uomp mcp serve`` and the agent-self routes."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from gatewaykit import Appliance
from guardkit import grant, guard_config, running_guard, seed, unix_session

from gateway import ca_store
from gateway.bundle import AgentBundle, write_bundle
from gateway.config import GatewayConfig, Paths
from gateway.core import ca, jose
from gateway.core.checkpoint import verifier_key
from gateway.ledger import auditkey
from gateway.payloads import userkey
from gateway.remote.server import GatewayRunner

TUNNEL = "https://tunnel.example"


@contextlib.asynccontextmanager
async def agent_appliance(
    paths: Paths, *, guard: dict[str, Any] | None = None, **gateway: Any
) -> AsyncIterator[Appliance]:
    """Guard on its Unix socket (and the Local Profile on loopback TCP), gateway with real TLS 1.3 on
    its mTLS listener and the plain-http tunnel origin whose public URL is :data:`TUNNEL`."""
    ca_store.init_all(paths)
    seed(paths)
    gateway.setdefault("tunnel_origin_port", 0)
    gateway.setdefault("tunnel_endpoints", [TUNNEL])
    gateway.setdefault("status_cache_seconds", 0)
    cfg = dataclasses.replace(GatewayConfig(listen_port=0), **gateway)
    async with running_guard(paths, guard_config(**(guard or {}))) as g, unix_session(paths) as admin:
        gw = GatewayRunner(paths, cfg)
        await gw.start()
        try:
            yield Appliance(paths, gw, admin, g)
        finally:
            await gw.stop()


def binding(cert_pem: bytes) -> dict[str, str]:
    cert = x509.load_pem_x509_certificate(cert_pem)
    pub: Any = cert.public_key()
    return {
        "x5t#S256": jose.cert_thumbprint(cert.public_bytes(serialization.Encoding.DER)),
        "jkt": jose.key_thumbprint(pub),
    }


async def make_bundle(
    app: Appliance,
    path: Path,
    *,
    agent_id: str = "calendar_agent",
    read: dict[str, Any] | None = None,
    url: str | None = None,
    create_extra: dict[str, Any] | None = None,
    cert_age: tuple[dt.timedelta, dt.timedelta] | None = None,
    **grant_extra: Any,
) -> tuple[Path, dict[str, Any]]:
    """A 0600 bundle for a real remote grant (refresh token included) to ``url`` (default the mTLS
    listener; :data:`TUNNEL` for DPoP); the grant answer too. ``cert_age`` = (lifetime, age): a
    certificate issued ``age`` ago for ``lifetime``, its tokens bound by key (``jkt``) alone, so they
    outlive its renewal."""
    out = path.parent / (path.stem + "-files")
    if cert_age is None:
        files = ca_store.issue_with_key(app.paths, agent_id, out)
    else:
        files = ca_store.issue_with_key(app.paths, agent_id, out, cert_age[0], now=ca.utcnow() - cert_age[1])
        grant_extra.setdefault("cnf", {"jkt": binding(files.cert_file.read_bytes())["jkt"]})
    cert_pem = files.cert_file.read_bytes()
    url = url or app.base
    pub = auditkey.load(app.paths).public_key()
    grant_extra.setdefault("cnf", binding(cert_pem))
    g = await grant(
        app.admin,
        app.paths,
        read=read or {"tags": ["preference"], "keys": []},
        agent_id=agent_id,
        profile="remote",
        audience=url,
        refresh=True,
        create_extra=create_extra,
        **grant_extra,
    )
    write_bundle(
        path,
        AgentBundle(
            agent_id=agent_id,
            session_id=g["session_id"],
            gateway_url=url,
            access_token=g["token"],
            access_expires_at=g["expires_at"],
            refresh_token=g["refresh_token"],
            refresh_expires_at=g["refresh_expires_at"],
            ca_cert=ca_store.ca_cert_path(app.paths).read_text(),
            agent_cert=cert_pem.decode(),
            agent_key=files.key_file.read_text(),
            payload_public_key=userkey.public_b64(app.paths),
            audit_verifier_key=verifier_key(auditkey.origin_for(pub), pub),
        ),
    )
    return path, g
