"""The agent as a witness (gateway/client/witness.py): the SDK keeps the last checkpoint it verified
per gateway (uomp-checkpoints.json) and checks every checkpoint it gets against it.

A guard that signs a second history is simulated by a second home with the same keys and sessions:
a copy of the first one taken while its guard was stopped, whose log then diverges (or stays behind).
Each guard is honest about its own ``audit.db``, so a start-up integrity check in the guard lets both
run; only the agent, which saw the first history, can tell. Both serve the same URL in turn."""

from __future__ import annotations

import base64
import json
import shutil
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from gatewaykit import appliance
from guardkit import call, grant, guard_config, running_guard, seed, unix_session
from shortdir import short_dir

from gateway.client import AuditCheckpointInvalid, AuditLogError, AuditLogForked, UompClient
from gateway.client import witness as witness_mod
from gateway.config import Paths
from gateway.core.checkpoint import verifier_key
from gateway.ledger import auditkey

READ = {"tags": ["preference"], "keys": []}


def vkey(home: Paths) -> str:
    pub = auditkey.load(home).public_key()
    return verifier_key(auditkey.origin_for(pub), pub)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kept(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())["gateways"])


async def reads(base: str, token: str, n: int) -> None:
    async with aiohttp.ClientSession() as tcp:
        for _ in range(n):
            assert (await call(tcp, "GET", "/v1/memory/preference.theme", token=token, base=base))[0] == 200


async def test_honest_log_advances_and_a_fork_or_rollback_is_caught(home: Paths, tmp_path: Path) -> None:
    seed(home)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg = guard_config(tcp_port=port, audit_checkpoint_events=1)
    wfile = tmp_path / "agent" / witness_mod.WITNESS_FILE
    wfile.parent.mkdir()

    def client(g: dict[str, Any], **kw: Any) -> UompClient:
        return UompClient(
            agent_id="calendar_agent",
            session_id=g["session_id"],
            access_token=g["token"],
            base_url=base,
            witness_path=wfile,
            audit_verifier_key=vkey(home),
            **kw,
        )

    async with running_guard(home, cfg), unix_session(home) as s:
        g = await grant(s, home, read=READ, audience=base)
        async with client(g) as c:
            first = await c.audit_checkpoint()
            rec1 = kept(wfile)[base]
            assert rec1["tree_size"] == first["tree_size"] and wfile.stat().st_mode & 0o777 == 0o600
            await reads(base, g["token"], 3)
            second = await c.audit_checkpoint()
            assert second["tree_size"] > first["tree_size"]
            assert second["consistency"]["old_size"] == first["tree_size"]
            assert kept(wfile)[base]["tree_size"] == second["tree_size"]  # the record advanced
            # a proof verifies and moves the record forward too (inclusion and consistency checked)
            logs = await c.audit()
            read = next(e["id"] for e in logs if e["action"] == "read" and e["allowed"])
            bundle = await c.audit_proof(read)
            assert bundle["event"]["id"] == read and "consistency" in bundle

    # the copy: the same keys, sessions and log up to here
    fork_dir = short_dir("uomp-f")
    try:
        shutil.rmtree(fork_dir)
        shutil.copytree(home.home, fork_dir, ignore=shutil.ignore_patterns("*.sock"))
        fork = Paths(fork_dir)
        assert vkey(fork) == vkey(home)

        # the first home grows on; the agent sees it
        async with running_guard(home, cfg):
            await reads(base, g["token"], 4)
            async with client(g) as c:
                seen = (await c.audit_checkpoint())["tree_size"]
        record = wfile.read_bytes()
        assert kept(wfile)[base]["tree_size"] == seen

        # the copy is behind: it never signed the size the agent saw (a rollback)
        async with running_guard(fork, cfg):
            async with client(g) as c:
                with pytest.raises(AuditLogForked) as exc:
                    await c.audit_checkpoint()
                assert exc.value.code == "AUDIT_LOG_INCONSISTENT" and str(seen) in exc.value.message
                assert wfile.read_bytes() == record  # the kept checkpoint is not replaced
                # the copy grows past that size with other events: a second history under one key
                await reads(base, g["token"], 12)
                async with unix_session(fork) as fs:
                    await grant(fs, fork, read=READ, audience=base, agent_id="other_agent")
                import sqlite3

                conn = sqlite3.connect(fork.audit_db)
                assert conn.execute("SELECT MAX(size) FROM ledger_checkpoints").fetchone()[0] > seen
                conn.close()
                with pytest.raises(AuditLogForked) as exc:
                    await c.audit_checkpoint()  # the proof from the kept size does not lead to the kept root
                assert exc.value.code == "AUDIT_LOG_INCONSISTENT" and "not consistent" in exc.value.message
                with pytest.raises(AuditLogForked):
                    await c.audit_proof(read)
                assert wfile.read_bytes() == record
                # the error is distinct: not one of the gateway's refusals
                assert isinstance(exc.value, AuditLogError)

        # back on the honest log, the record still works and advances
        async with running_guard(home, cfg):
            async with client(g) as c:
                assert (await c.audit_checkpoint())["tree_size"] > seen
    finally:
        shutil.rmtree(fork_dir, ignore_errors=True)


async def test_tampered_proof_or_signature_is_refused(home: Paths, tmp_path: Path) -> None:
    seed(home)
    async with running_guard(home, guard_config(audit_checkpoint_events=1)) as gr, unix_session(home) as s:
        base = f"http://127.0.0.1:{gr.tcp_port}"
        g = await grant(s, home, read=READ, audience=base)
        wfile = tmp_path / witness_mod.WITNESS_FILE
        async with UompClient(
            agent_id="calendar_agent",
            session_id=g["session_id"],
            access_token=g["token"],
            base_url=base,
            witness_path=wfile,
            audit_verifier_key=vkey(home),
        ) as c:
            await c.audit_checkpoint()
        await reads(base, g["token"], 5)
        store = witness_mod.WitnessFile(wfile)
        old = store.get(base)
        assert old is not None
        async with aiohttp.ClientSession() as tcp:
            status, answer, _ = await call(
                tcp, "GET", f"/v1/audit/checkpoint?since={old.tree_size}", token=g["token"], base=base
            )
        assert status == 200
        key = vkey(home)
        cp, newer = witness_mod.check(old, key, answer["checkpoint"], answer["consistency"])  # the honest answer
        assert newer and cp.size == answer["tree_size"]

        path = answer["consistency"]["path"]
        flipped = [base64.b64encode(bytes(b ^ 1 for b in base64.b64decode(path[0]))).decode(), *path[1:]]
        for bad in (
            {**answer["consistency"], "path": flipped},
            {**answer["consistency"], "path": path[:-1]},
            {**answer["consistency"], "path": []},
            {**answer["consistency"], "old_size": old.tree_size - 1},
            None,
        ):
            with pytest.raises(AuditLogForked):
                witness_mod.check(old, key, answer["checkpoint"], bad)

        text, sig = answer["checkpoint"].split("\n\n")
        raw = bytearray(base64.b64decode(sig.split(" ")[-1]))
        raw[-1] ^= 1
        forged_sig = f"\n\n{sig.rsplit(' ', 1)[0]} {base64.b64encode(bytes(raw)).decode()}\n"
        forged_size = answer["checkpoint"].replace(f"\n{cp.size}\n", f"\n{cp.size + 1}\n", 1)
        for note in (text + forged_sig, forged_size, "not a note", None):
            with pytest.raises(AuditCheckpointInvalid):
                witness_mod.check(old, key, note, answer["consistency"])
        # the SDK itself, trusting another key than the gateway's: refused, record untouched
        before = wfile.read_bytes()
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        stranger = Ed25519PrivateKey.generate().public_key()
        async with UompClient(
            agent_id="calendar_agent",
            session_id=g["session_id"],
            access_token=g["token"],
            base_url=base,
            witness_path=tmp_path / "w2.json",
            audit_verifier_key=verifier_key(auditkey.origin_for(stranger), stranger),
        ) as c:
            with pytest.raises(AuditCheckpointInvalid):
                await c.audit_checkpoint()
        assert wfile.read_bytes() == before
        assert not (tmp_path / "w2.json").exists()


async def test_through_the_gateway_with_mtls(home: Paths, tmp_path: Path) -> None:
    async with appliance(home, guard_cfg=guard_config(audit_checkpoint_events=1)) as app:
        a = app.agent("agent_a")
        ga = await app.grant(a, read=READ)
        key = serialization.load_pem_private_key(a.files.key_file.read_bytes(), password=None)
        wfile = tmp_path / "w.json"
        async with UompClient(
            agent_id=a.agent_id,
            session_id=ga["session_id"],
            access_token=ga["token"],
            base_url=app.base,
            mode="mtls",
            ca_cert=a.files.ca_file.read_text(),
            agent_cert=a.files.cert_file.read_text(),
            agent_key=key,  # type: ignore[arg-type]
            witness_path=wfile,
            audit_verifier_key=vkey(home),
        ) as c:
            one = await c.audit_checkpoint()
            await c.get("preference.theme")
            two = await c.audit_checkpoint()
            assert two["tree_size"] > one["tree_size"] and two["consistency"]["old_size"] == one["tree_size"]
            assert kept(wfile)[app.base]["tree_size"] == two["tree_size"]


def test_the_bundle_carries_the_audit_key_and_the_record_lives_beside_it(home: Paths, tmp_path: Path) -> None:
    from gateway import ca_store
    from gateway.bundle import load_bundle
    from gateway.cli.main import main

    manifest = {
        "uomp_version": "1.0",
        "agent": {"id": "w_agent", "name": "W", "version": "1.0.0"},
        "requested_scopes": {"read": READ},
    }
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "uom.json").write_text(json.dumps(manifest))
    ca_store.init_all(home)
    out = tmp_path / "files"
    assert main(["--home", str(home.home), "authorize", str(agent), "--yes", "--remote", "--out", str(out)]) == 0
    bundle = load_bundle(out / "bundle.json")
    assert bundle.audit_verifier_key == vkey(home)
    client = UompClient.from_bundle(out / "bundle.json")
    assert client._witness is not None and client._witness.path == out / witness_mod.WITNESS_FILE
    assert client._audit_vkey == vkey(home)
