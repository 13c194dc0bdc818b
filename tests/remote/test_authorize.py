"""``uomp authorize`` (local and remote) and the deletion-proof life cycle, through the real CLI and guard."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from guardkit import admin_headers, call, running_guard, seed, unix_session

from gateway import ca_store
from gateway.bundle import load_bundle
from gateway.cli.main import main
from gateway.config import Paths
from gateway.core import deletion, jose, manifest, tokens

MANIFEST: dict[str, Any] = {
    "uomp_version": "1.0",
    "agent": {"id": "calendar_agent", "name": "Calendar Assistant", "version": "1.2.0", "publisher": "example-org"},
    "requested_scopes": {
        "read": {"tags": ["preference"], "keys": [], "description": "your preferences"},
        "write": {"tags": [], "keys": []},
    },
    "data_retention_policy": {
        "max_retention_seconds": 300,
        "deletion_method": "process_termination",
        "proof_required": True,
    },
}


def write_manifest(d: Path, doc: dict[str, Any]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "uom.json").write_text(json.dumps(doc))
    return d


def signed_manifest(key: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    doc = json.loads(json.dumps(MANIFEST))
    return manifest.sign_manifest(doc, key, manifest.did_key_from_public(key.public_key()))


def cli(home: Paths, *args: str) -> int:
    return main(["--home", str(home.home), *args])


def test_local_authorize_writes_private_env_file(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = write_manifest(tmp_path / "agent", MANIFEST)
    env = tmp_path / "agent.env"
    assert cli(home, "authorize", str(agent), "--yes", "--env-file", str(env)) == 0
    out = capsys.readouterr().out
    assert "UNVERIFIED PUBLISHER" in out and "Calendar Assistant" in out
    assert stat.S_IMODE(os.stat(env).st_mode) == 0o600
    values = dict(line.split("=", 1) for line in env.read_text().splitlines())
    assert values["UOMP_BASE_URL"] == "http://127.0.0.1:9374"
    cap = tokens.verify_token(
        values["UOM_TOKEN"], __import__("gateway.keys").keys.load_public_keys(home), now=time.time()
    )
    assert cap.agent_id == "calendar_agent" and cap.read.tags == ("preference",) and cap.profile == "local"
    assert values["UOM_TOKEN"] not in out  # written to the file, not echoed


def test_no_guarantee_warning_and_refusals(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = {k: v for k, v in MANIFEST.items() if k != "data_retention_policy"}
    agent = write_manifest(tmp_path / "nog", doc)
    assert cli(home, "authorize", str(agent), "--yes", "--print") == 0
    assert "NO RETENTION GUARANTEE" in capsys.readouterr().out
    # unverified + --require-verified: refused, nothing granted
    assert cli(home, "authorize", str(agent), "--yes", "--require-verified") == 1
    assert "could not be verified" in capsys.readouterr().err
    # without --yes and without a terminal: refused rather than assumed
    assert cli(home, "authorize", str(agent)) == 1
    # asking for more than requested needs --widen
    assert cli(home, "authorize", str(agent), "--yes", "--tag", "identity") == 1
    assert "--widen" in capsys.readouterr().err
    # a bad manifest: every problem listed
    bad = write_manifest(tmp_path / "bad", {"uomp_version": "9", "agent": {"id": "../x"}})
    assert cli(home, "authorize", str(bad), "--yes") == 1
    err = capsys.readouterr().err
    assert "MANIFEST_INVALID" in err and "agent.id" in err and "uomp_version" in err


def test_verified_identity_and_remote_bundle(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    agent = write_manifest(tmp_path / "agent", signed_manifest(key))
    ca_store.init_all(home)
    bundle_path = tmp_path / "bundle.json"
    assert (
        cli(
            home,
            "authorize",
            str(agent),
            "--yes",
            "--remote",
            "--gateway-url",
            "https://gw.example:9443",
            "--out",
            str(tmp_path / "agentfiles"),
            "--bundle",
            str(bundle_path),
            "--trust-publisher",
            "Example Org",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Publisher: Example Org (signed by did:key" in out  # verified, and trusted by the user's word
    assert stat.S_IMODE(os.stat(bundle_path).st_mode) == 0o600
    b = load_bundle(bundle_path)
    assert b.refresh_token and b.agent_key and b.agent_cert and b.gateway_url == "https://gw.example:9443"
    keys_ = __import__("gateway.keys").keys.load_public_keys(home)
    cap = tokens.verify_token(b.access_token, keys_, now=time.time())
    assert cap.profile == "remote" and cap.audience == "https://gw.example:9443"
    assert cap.allowed_endpoints == ("gw.example:9443",)
    assert cap.expires_at - cap.issued_at <= 600  # §20.1: 10 minutes at most for the remote profile
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(b.agent_cert.encode())
    from cryptography.hazmat.primitives import serialization

    assert cap.cnf_x5t == jose.cert_thumbprint(cert.public_bytes(serialization.Encoding.DER))
    assert cap.cnf_jkt == jose.key_thumbprint(cert.public_key())  # type: ignore[arg-type]
    rt = tokens.verify_token(b.refresh_token or "", keys_, now=time.time())
    assert rt.is_refresh and rt.read.is_empty() and rt.cnf_x5t == cap.cnf_x5t
    assert rt.expires_at - rt.issued_at <= 7 * 24 * 3600


async def test_deletion_proof_flow(home: Paths, tmp_path: Path) -> None:
    seed(home)
    key = ed25519.Ed25519PrivateKey.generate()
    agent = write_manifest(tmp_path / "agent", signed_manifest(key))
    env = tmp_path / "a.env"
    assert cli(home, "authorize", str(agent), "--yes", "--task-bound", "--env-file", str(env)) == 0
    token = dict(line.split("=", 1) for line in env.read_text().splitlines())["UOM_TOKEN"]
    cap = tokens.jose.parse_compact(token).payload
    sid = cap["session_id"]
    fields = {
        "deletion_proof_id": "del_1",
        "session_id": sid,
        "agent_id": "calendar_agent",
        "deleted_at": tokens.iso(time.time()),
        "memory_hash": "sha256:" + "ab" * 32,
        "fields_accessed": ["key", "value"],
        "method": "process_termination",
    }
    async with running_guard(home), unix_session(home) as s:
        assert (await call(s, "GET", "/v1/memory/preference.theme", token=token))[0] == 200
        # refusals first: signed by another key; wrong method; another session in the body
        other = deletion.sign_deletion_proof(fields, ed25519.Ed25519PrivateKey.generate())
        status, body, _ = await call(s, "POST", f"/v1/sessions/{sid}/deletion-proof", token=token, json_body=other)
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
        wrong = deletion.sign_deletion_proof({**fields, "method": "secure_wipe"}, key)
        status, body, _ = await call(s, "POST", f"/v1/sessions/{sid}/deletion-proof", token=token, json_body=wrong)
        assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
        status, body, _ = await call(
            s,
            "POST",
            "/v1/sessions/sess_other/deletion-proof",
            token=token,
            json_body=deletion.sign_deletion_proof(fields, key),
        )
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
        # the good one: accepted, and task_bound closes the session
        good = deletion.sign_deletion_proof(fields, key)
        status, body, _ = await call(s, "POST", f"/v1/sessions/{sid}/deletion-proof", token=token, json_body=good)
        assert (status, body) == (200, {"status": "accepted", "deletion_proof_id": "del_1"})
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=token)
        assert status == 401 and body["error"]["code"] == "SESSION_REVOKED"
        status, body, _ = await call(s, "GET", f"/v1/sessions/{sid}", headers=admin_headers(home))
        assert body["status"] == "closed" and body["deletion_proof_id"] == "del_1"


async def test_missing_deletion_proof_is_recorded(home: Paths, tmp_path: Path) -> None:
    seed(home)
    agent = write_manifest(tmp_path / "agent", MANIFEST)  # proof_required: true
    env = tmp_path / "a.env"
    assert cli(home, "authorize", str(agent), "--yes", "--duration", "1", "--env-file", str(env)) == 0
    # let the minute pass: move the session's expiry into the past in its real database
    import sqlite3

    db = sqlite3.connect(home.auth_db)
    db.execute("UPDATE sessions SET expires_at = ?", (time.time() - 1,))
    db.commit()
    db.close()
    async with running_guard(home) as g:
        assert g.services is not None
        g.services.auth.expire_due()
        rows = g.services.audit.recent(limit=20)
    actions = [r["action"] for r in rows]
    assert "deletion_proof_missing" in actions
    # a session that ended with its proof records no such event (see test_deletion_proof_flow)
