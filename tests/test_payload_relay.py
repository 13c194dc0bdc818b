"""Issue 11: the encrypted payload relay end to end on 127.0.0.1: the real guard on its Unix socket,
the gateway with real TLS 1.3 (mTLS listener and the DPoP tunnel-origin listener), bundles made by
the real ``uomp authorize --remote``, the SDK sealing and uploading, the CLI pulling and opening.
Every accepted case has refused partners, each with its code; refusals leave nothing behind."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import sqlite3
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from gatewaykit import Appliance, agent_session
from guardkit import admin_headers, call, grant, guard_config, running_guard, seed, unix_session
from test_sdk import TUNNEL, access_events, authorize_csr, authorize_out, sdk_appliance

from gateway import ca_store
from gateway.bundle import load_bundle, write_bundle
from gateway.cli.main import main as uomp
from gateway.client import (
    AccessDenied,
    ClientOptions,
    ConfigError,
    InvalidRequest,
    PayloadRejected,
    QuotaExceeded,
    UompClient,
)
from gateway.client import payloads as sdk_payloads
from gateway.config import Paths
from gateway.core import envelope, sealing
from gateway.core.tokens import iso
from gateway.payloads import userkey
from gateway.remote.tls import build_client_context

pytestmark = pytest.mark.timeout(120)

SECRET = b"MARKER-plaintext-7f3a9c annual report: portfolio up 12%\n"
UOMP = [sys.executable, "-m", "gateway.cli.main"]


@pytest.fixture
async def app(home: Paths) -> AsyncIterator[Appliance]:
    async with sdk_appliance(home, status_cache_seconds=0, payload_max_bytes=8 << 20,
                             payload_max_json_bytes=64 << 10) as a:
        yield a


def store_state(paths: Paths) -> tuple[list[str], list[str], list[str]]:
    """(index rows, blob files, temporary files) of the payload store."""
    root = paths.payload_dir
    conn = sqlite3.connect(root / "index.db")
    try:
        rows = [r[0] for r in conn.execute("SELECT payload_id FROM payloads")]
    finally:
        conn.close()
    return rows, sorted(p.name for p in (root / "blobs").iterdir()), sorted(p.name for p in (root / "tmp").iterdir())


def audit_rows(paths: Paths, action: str | None = None) -> list[dict[str, Any]]:
    conn = sqlite3.connect(paths.audit_db)
    conn.row_factory = sqlite3.Row
    try:
        rows = [dict(r) for r in conn.execute("SELECT * FROM audit_logs ORDER BY seq")]
    finally:
        conn.close()
    return [r for r in rows if action is None or r["action"] == action]


def cli(paths: Paths, *args: str, capsys: pytest.CaptureFixture[str] | None = None) -> tuple[int, str, str]:
    rc = uomp(["--home", str(paths.home), *args])
    if capsys is None:
        return rc, "", ""
    out = capsys.readouterr()
    return rc, out.out, out.err


async def acli(paths: Paths, *args: str) -> tuple[int, str, str]:
    """The CLI in a subprocess (the guard serves in this process's event loop)."""
    proc = await asyncio.create_subprocess_exec(*UOMP, "--home", str(paths.home), *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# ---------------------------------------------------------------------------------- keys


def test_init_makes_the_payload_key_and_an_old_home_gets_one(home: Paths, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    assert not home.payload_private_key.exists()  # a home from before payloads (conftest: init_home only)
    rc, out, _ = cli(home, "payload", "pubkey", capsys=capsys)
    assert rc == 0 and len(base64.b64decode(out.strip())) == 32
    assert oct(home.payload_private_key.stat().st_mode & 0o777) == "0o600"
    rc, out2, _ = cli(home, "payload", "pubkey", capsys=capsys)
    assert out2 == out  # never replaced
    rc, out3, _ = cli(home, "init", capsys=capsys)
    assert rc == 0 and "payload key: kept" in out3
    # a broken key file is an error naming it, never silently replaced
    home.payload_private_key.write_bytes(b"garbage")
    rc, _, err = cli(home, "payload", "pubkey", capsys=capsys)
    assert rc == 1 and "KEY_ERROR" in err and str(home.payload_private_key) in err
    home.payload_private_key.unlink()
    os.chmod(home.secrets, 0o700)
    rc, out4, _ = cli(home, "init", capsys=capsys)
    assert "payload key: created" in out4


def test_concurrent_creation_yields_one_key(home: Paths) -> None:
    results: list[str] = []

    def make() -> None:
        results.append(userkey.public_b64(home))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 8
    assert [p.name for p in home.secrets.iterdir() if "payload" in p.name] == ["payload-x25519.key"]


# ------------------------------------------------------------------------ the happy paths


async def test_sdk_uploads_cli_lists_pulls_and_removes(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    b = load_bundle(bundle)
    assert b.payload_public_key == userkey.public_b64(app.paths)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    async with UompClient.from_bundle(bundle) as c:
        small = await c.upload_payload(SECRET, format="text/markdown")
        streamed = await c.upload_payload(big, format="application/octet-stream")
        via_url = await c.upload_payload(SECRET * 10, format="text/plain", presigned=True)
        empty = await c.upload_payload(b"", format="text/plain")
    rc, out, err = await acli(app.paths, "payload", "list", "--json")
    assert rc == 0, err
    listed = {p["payload_id"]: p for p in json.loads(out)}
    assert set(listed) == {small, streamed, via_url, empty}
    assert listed[small]["session_id"] == b.session_id and listed[small]["agent_id"] == b.agent_id
    assert listed[small]["format"] == "text/markdown" and not listed[small]["opened"]
    rc, table, _ = await acli(app.paths, "payload", "list")
    assert small in table and "text/markdown" in table
    for pid, want in ((small, SECRET), (streamed, big.read_bytes()), (via_url, SECRET * 10), (empty, b"")):
        out_file = tmp_path / f"{pid}.out"
        rc, _, err = await acli(app.paths, "payload", "pull", pid, "--out", str(out_file))
        assert rc == 0, err
        assert out_file.read_bytes() == want
        assert oct(out_file.stat().st_mode & 0o777) == "0o600"
    rc, out, _ = await acli(app.paths, "payload", "list", "--json")
    assert all(p["opened"] for p in json.loads(out))
    # every accepted payload is one payload_uploaded event carrying its hash
    uploaded = audit_rows(app.paths, "payload_uploaded")
    assert sorted(r["key"] for r in uploaded) == sorted(listed)
    for r in uploaded:
        assert r["detail"] == listed[r["key"]]["hash"] and r["allowed"] == 1 and r["session_id"] == b.session_id
    assert len(audit_rows(app.paths, "payload_opened")) == 4
    rc, _, err = await acli(app.paths, "payload", "rm", small)
    assert rc == 0, err
    rows, blobs, tmp = store_state(app.paths)
    assert small not in rows and small not in blobs and tmp == []
    rc, _, err = await acli(app.paths, "payload", "pull", small, "--out", str(tmp_path / "gone"))
    assert rc == 1 and "NOT_FOUND" in err and not (tmp_path / "gone").exists()


async def test_dpop_upload_through_the_tunnel_origin(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_out(app, tmp_path, url=TUNNEL)
    origin = f"http://127.0.0.1:{app.gateway.tunnel_port}"
    data = os.urandom(600 * 1024)
    async with UompClient.from_bundle(bundle, mode="dpop", base_url=origin) as c:
        pid = await c.upload_payload(SECRET, format="text/markdown")
        pid2 = await c.upload_payload(data, format="application/octet-stream")
        pid3 = await c.upload_payload(data[:1000], format="text/plain", presigned=True)
        with pytest.raises(InvalidRequest) as nf:
            await c._call("GET", f"/v1/payload/{pid}")
        assert nf.value.code == "NOT_FOUND"
    for p, want in ((pid, SECRET), (pid2, data), (pid3, data[:1000])):
        rc, _, err = await acli(app.paths, "payload", "pull", p, "--out", str(tmp_path / p))
        assert rc == 0, err
        assert (tmp_path / p).read_bytes() == want
    assert {e["listener"] for e in access_events(app.paths) if e["action"] == "payload_upload"} == {"tunnel"}
