"""``uomp mcp serve`` as a real process, driven by the real MCP client of the official SDK
(``mcp.ClientSession`` over ``stdio_client`` and ``streamable_http_client``), against the running
appliance through real mTLS (and DPoP through the tunnel origin): every tool, every refusal as a tool
error with our code, revocation and token refresh mid-session, and the server's stderr free of
tokens, keys and memory values (with ``-v``: even debug logging)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agentkit import TUNNEL, agent_appliance, make_bundle
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from gatewaykit import Appliance, ledger_events
from guardkit import admin_headers, call
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from portkit import free_port

from gateway.bundle import load_bundle
from gateway.cli.main import main as uomp
from gateway.client.tokens import iso_ts
from gateway.config import Paths
from gateway.core import jose
from gateway.mcp.tools import TOOL_NAMES

pytestmark = pytest.mark.timeout(90)

UOMP = str(Path(sys.executable).parent / "uomp")
PLAINTEXT = "result-for-the-user-7f3a9c: buy nothing"
RETENTION = {"level": "session", "proof_required": True, "deletion_method": "process_termination"}


@pytest.fixture
async def app(home: Paths) -> AsyncIterator[Appliance]:
    # a checkpoint after every event: an event's proof is there at once
    async with agent_appliance(home, guard={"audit_checkpoint_events": 1}) as a:
        yield a


def identity_file(tmp: Path) -> tuple[ed25519.Ed25519PrivateKey, Path]:
    key = ed25519.Ed25519PrivateKey.generate()
    path = tmp / "identity.pem"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return key, path


@contextlib.asynccontextmanager
async def stdio_session(args: list[str], errlog: Path) -> AsyncIterator[ClientSession]:
    with errlog.open("w") as err:
        params = StdioServerParameters(command=UOMP, args=args)
        async with stdio_client(params, errlog=err) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


async def tool(session: ClientSession, name: str, args: dict[str, Any] | None = None) -> Any:
    """The tool's structured answer; fails the test on a tool error."""
    result: Any = await session.call_tool(name, args or {})
    assert not result.is_error, (name, result.content)
    assert json.loads(result.content[0].text) == result.structured_content
    return result.structured_content


async def refused(session: ClientSession, name: str, args: dict[str, Any] | None = None) -> str:
    """A tool error's code (and its text is ``CODE: reason``)."""
    result: Any = await session.call_tool(name, args or {})
    assert result.is_error, (name, result.structured_content)
    err = result.structured_content["error"]
    assert result.content[0].text == f"{err['code']}: {err['message']}" and err["message"]
    return str(err["code"])


async def revoke(app: Appliance, sid: str) -> None:
    status, body, _ = await call(app.admin, "POST", f"/v1/sessions/{sid}/revoke", headers=admin_headers(app.paths))
    assert status == 200, body


def secrets_of(bundle: Path) -> set[str]:
    b = load_bundle(bundle)
    key_body = "".join((b.agent_key or "").splitlines()[1:-1])
    return {b.access_token, b.refresh_token or "", key_body[:60], b.access_token.rsplit(".", 1)[-1]}


def assert_clean(errlog: Path, secrets: set[str], values: tuple[str, ...]) -> str:
    text = errlog.read_text()
    for s in secrets | set(values):
        assert s and s not in text, f"{s[:12]}... in the server's stderr"
    return text


# ------------------------------------------------------------------------------ stdio, mTLS


async def test_every_tool_over_stdio_and_a_clean_debug_log(app: Appliance, tmp_path: Path) -> None:
    identity, identity_path = identity_file(tmp_path)
    bundle, _ = await make_bundle(
        app,
        tmp_path / "bundle.json",
        create_extra={
            "identity_public_jwk": jose.public_jwk(identity.public_key()),
            "data_retention_policy": RETENTION,
        },
    )
    secrets = secrets_of(bundle)
    identity_body = identity_path.read_text().splitlines()[1]
    errlog = tmp_path / "stderr.log"
    args = ["-v", "mcp", "serve", "--bundle", str(bundle), "--identity-key", str(identity_path)]
    async with stdio_session(args, errlog) as s:
        listed = (await s.list_tools()).tools
        assert tuple(t.name for t in listed) == TOOL_NAMES
        for t in listed:
            assert t.input_schema["type"] == "object" and t.input_schema["additionalProperties"] is False
            assert set(t.input_schema["required"]) <= set(t.input_schema["properties"]) and t.description
        by_name = {t.name: t for t in listed}
        assert by_name["memory_read"].input_schema["required"] == ["key"]
        assert by_name["memory_aggregate"].input_schema["properties"]["op"]["enum"] == [
            "sum",
            "avg",
            "count",
            "min",
            "max",
        ]

        assert (await tool(s, "memory_read", {"key": "preference.theme"}))["value"] == "dark"
        page = await tool(s, "memory_list", {"tag": "preference", "limit": 1})
        keys = [i["key"] for i in page["items"]]
        while page["next_cursor"] is not None:
            assert len(page["items"]) == 1
            page = await tool(s, "memory_list", {"tag": "preference", "limit": 1, "cursor": page["next_cursor"]})
            keys += [i["key"] for i in page["items"]]
        assert sorted(keys) == ["preference.lang", "preference.secret_hobby", "preference.theme"]
        assert (await tool(s, "memory_aggregate", {"tag": "preference", "op": "count"}))["result"] == 3

        grant = await tool(s, "grant_describe")
        assert "Items tagged: preference." in grant["words"] and "is active" in grant["words"]
        assert grant["session"]["granted_scopes"]["read"]["tags"] == ["preference"]
        assert "deletion_method=process_termination" in grant["words"]

        events = (await tool(s, "audit_events", {"limit": 50}))["events"]
        read = next(e for e in events if e.get("action") == "read" and e.get("allowed"))
        proof = await tool(s, "audit_proof", {"event_id": read["id"]})
        assert proof["event"]["id"] == read["id"] and proof["checkpoint"]

        resources = {str(r.uri) for r in (await s.list_resources()).resources}
        assert resources == {"uomp://grant", "uomp://tag/preference"}
        tagged = json.loads((await s.read_resource("uomp://tag/preference")).contents[0].text)
        assert {i["key"] for i in tagged["items"]} == set(keys)
        assert "words" in json.loads((await s.read_resource("uomp://grant")).contents[0].text)
        with pytest.raises(MCPError):  # ungranted tag: not a resource, and nothing is read
            await s.read_resource("uomp://tag/identity")

        up = await tool(s, "payload_upload", {"content": PLAINTEXT, "format": "text/plain"})
        assert up["sealed"] is True and up["bytes"] == len(PLAINTEXT)
        blobs = [p for p in app.paths.home.rglob("*") if p.is_file() and up["payload_id"] in p.name]
        assert blobs and all(PLAINTEXT.encode() not in p.read_bytes() for p in blobs)

        # not the manifest's deletion method: the Auth Service refuses the signed proof
        assert await refused(s, "deletion_proof_submit", {"method": "secure_wipe"}) == "INVALID_REQUEST"
        done = await tool(s, "deletion_proof_submit", {"fields_accessed": ["key", "value"]})
        assert done["status"] == "accepted"
        sid = load_bundle(bundle).session_id
        assert (await tool(s, "session_end")) == {"session_id": sid, "status": "closed"}
        assert await refused(s, "memory_read", {"key": "preference.theme"}) == "SESSION_REVOKED"
        assert await refused(s, "grant_describe") == "SESSION_REVOKED"
    assert ledger_events(app.paths, action="deletion_proof", session_id=sid, allowed=True)
    assert ledger_events(app.paths, action="session_close", session_id=sid, allowed=True)
    text = assert_clean(
        errlog, secrets | secrets_of(bundle) | {identity_body}, ("dark", "lockpicking", PLAINTEXT, "buy nothing")
    )
    assert "tool memory_read answered" in text and "DEBUG" in text  # it does log, at debug level too


async def test_refusals_quota_renewal_and_revocation_mid_session(app: Appliance, tmp_path: Path) -> None:
    # the agent certificate is 50 minutes into its hour: the SDK under the server renews it first
    age = (dt.timedelta(hours=1), dt.timedelta(minutes=50))
    bundle, g = await make_bundle(app, tmp_path / "bundle.json", limits={"max_read_queries": 3}, cert_age=age)
    old_cert = load_bundle(bundle).agent_cert
    errlog = tmp_path / "stderr.log"
    async with stdio_session(["mcp", "serve", "--bundle", str(bundle)], errlog) as s:
        assert (await tool(s, "grant_describe"))["token"]["max_read_queries"] == 3
        assert load_bundle(bundle).agent_cert != old_cert  # renewed underneath, written back
        assert len(ledger_events(app.paths, action="renew", allowed=True)) == 1
        # the gateway's refusals
        assert await refused(s, "memory_read", {"key": "user.password"}) == "ACCESS_DENIED"
        assert await refused(s, "memory_list", {"tag": "identity"}) == "ACCESS_DENIED"
        assert await refused(s, "audit_proof", {"event_id": "ev_" + "0" * 32}) == "NOT_FOUND"
        assert await refused(s, "memory_aggregate", {"tag": "preference", "op": "sum"}) == "INVALID_REQUEST"
        # the schema's, before anything is sent
        for name, args in (
            ("memory_read", {}),
            ("memory_read", {"key": 7}),
            ("memory_read", {"key": ""}),
            ("memory_read", {"key": "preference.theme", "as_admin": True}),
            ("memory_list", {"tag": "preference", "limit": 0}),
            ("memory_list", {"tag": "preference", "limit": True}),
            ("memory_aggregate", {"tag": "preference", "op": "median"}),
            ("deletion_proof_submit", {"memory_hash": "sha256:xyz"}),
            ("payload_upload", {"content": "x", "encoding": "rot13"}),
            ("no_such_tool", {}),
        ):
            assert await refused(s, name, args) == "INVALID_REQUEST", (name, args)
        assert await refused(s, "payload_upload", {"content": "***", "encoding": "base64"}) == "INVALID_REQUEST"
        assert await refused(s, "payload_upload", {"content": "x", "format": "not a type"}) == "INVALID_REQUEST"
        assert await refused(s, "deletion_proof_submit") == "CONFIG_ERROR"  # no --identity-key
        # the read quota (3; the ACCESS_DENIED read above counted): refused, the server goes on
        assert (await tool(s, "memory_read", {"key": "preference.theme"}))["value"] == "dark"
        assert await refused(s, "memory_read", {"key": "preference.lang"}) == "QUOTA_EXCEEDED"
        assert (await tool(s, "audit_events", {"limit": 5}))["events"]  # not a read: still answered
        # revoked by the user mid-session: the next call fails
        await revoke(app, g["session_id"])
        assert await refused(s, "audit_events") == "SESSION_REVOKED"
        assert await refused(s, "session_end") == "SESSION_REVOKED"
        assert len((await s.list_tools()).tools) == len(TOOL_NAMES)  # still serving
    assert_clean(errlog, secrets_of(bundle), ("dark", "hunter2"))


# --------------------------------------------------------------- streamable HTTP, DPoP, refresh


@contextlib.asynccontextmanager
async def http_server(args: list[str], errlog: Path) -> AsyncIterator[str]:
    port = free_port()
    with errlog.open("w") as err:
        proc = await asyncio.create_subprocess_exec(
            UOMP, *args, "--http", f"127.0.0.1:{port}", stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=err
        )
        try:
            for _ in range(200):
                if proc.returncode is not None:
                    raise AssertionError(errlog.read_text())
                with contextlib.suppress(OSError):
                    _, w = await asyncio.open_connection("127.0.0.1", port)
                    w.close()
                    break
                await asyncio.sleep(0.05)
            yield f"http://127.0.0.1:{port}/mcp"
        finally:
            if proc.returncode is None:
                proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)


async def test_http_dpop_refresh_and_revocation_mid_session(app: Appliance, tmp_path: Path) -> None:
    # 10-second access tokens: the SDK under the server refreshes ahead of expiry on every call
    bundle, g = await make_bundle(app, tmp_path / "bundle.json", url=TUNNEL, token_lifetime_seconds=10)
    first = secrets_of(bundle)
    origin = f"http://127.0.0.1:{app.gateway.tunnel_port}"
    errlog = tmp_path / "stderr.log"
    word = secrets.token_urlsafe(32)
    token_file = tmp_path / "mcp-http.token"
    token_file.write_text(word + "\n")
    token_file.chmod(0o600)
    args = ["mcp", "serve", "--bundle", str(bundle), "--dpop", "--base-url", origin]
    args += ["--http-token-file", str(token_file)]
    async with http_server(args, errlog) as url:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        async with aiohttp.ClientSession() as h:  # a local process without the token file: 401, no tool runs
            for hdrs in ({}, {"Authorization": "Bearer " + word[:-1]}, {"Authorization": word}):
                async with h.post(url, json=body, headers=hdrs) as r:
                    assert r.status == 401 and (await r.json())["error"]["code"] == "UNAUTHORIZED"
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {word}"})
        async with (
            http,
            streamable_http_client(url, http_client=http) as (read, write),
            ClientSession(read, write) as s,
        ):
            await s.initialize()
            sid = g["session_id"]
            # the token the bundle came with, then refreshed by the server mid-session
            assert (await tool(s, "memory_read", {"key": "preference.theme"}))["value"] == "dark"
            before = load_bundle(bundle)
            refreshes = len(ledger_events(app.paths, action="refresh", session_id=sid, allowed=True))
            # wait until the access token is in its last half (where the SDK refreshes ahead of expiry)
            expires = iso_ts(before.access_expires_at) or 0.0
            await asyncio.sleep(max(0.0, expires - 5 - time.time() + 0.3))
            assert (await tool(s, "memory_read", {"key": "preference.lang"}))["value"] == "en"
            after = load_bundle(bundle)
            assert after.access_token != before.access_token and after.refresh_token != before.refresh_token
            events = ledger_events(app.paths, action="refresh", session_id=sid, allowed=True)
            assert len(events) == refreshes + 1 and events[-1].get("listener") == "tunnel"
            assert await refused(s, "memory_read", {"key": "user.passport"}) == "ACCESS_DENIED"
            await revoke(app, g["session_id"])
            assert await refused(s, "memory_read", {"key": "preference.theme"}) == "SESSION_REVOKED"
        # not for a page of another origin (DNS rebinding): refused before any tool runs
        async with aiohttp.ClientSession() as h:
            hdrs = {"Host": "evil.example", "Origin": "http://evil.example", "Authorization": f"Bearer {word}"}
            async with h.post(url, json=body, headers=hdrs) as r:
                assert r.status in (400, 403, 421)
    assert_clean(errlog, first | secrets_of(bundle) | {word}, ("dark", "lockpicking"))


def test_http_binds_loopback_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = tmp_path / "none.json"
    for where in ("0.0.0.0:8765", "192.0.2.1:8765", "example.com:8765"):
        assert uomp(["mcp", "serve", "--bundle", str(bundle), "--http", where]) == 1
        assert "loopback only" in capsys.readouterr().err
    assert uomp(["mcp", "serve", "--bundle", str(bundle), "--http", "127.0.0.1"]) == 1
    assert "HOST:PORT" in capsys.readouterr().err
    assert uomp(["mcp", "serve", "--bundle", str(bundle)]) == 1
    assert "CONFIG_ERROR" in capsys.readouterr().err
    weak = tmp_path / "weak.token"
    weak.write_text("short")
    weak.chmod(0o600)
    open_file = tmp_path / "open.token"
    open_file.write_text("x" * 40)
    open_file.chmod(0o644)
    for token_file, says in ((weak, "at least 32"), (open_file, "chmod 600"), (tmp_path / "none", "no HTTP token")):
        argv = [
            "mcp",
            "serve",
            "--bundle",
            str(bundle),
            "--http",
            "127.0.0.1:8765",
            "--http-token-file",
            str(token_file),
        ]
        assert uomp(argv) == 1
        assert says in capsys.readouterr().err
    assert uomp(["mcp", "serve", "--bundle", str(bundle), "--http-token-file", str(weak)]) == 1  # stdio: no token
    assert "for --http" in capsys.readouterr().err
