"""The verifiable audit log end to end: a real guard records reads and refusals as Merkle events
with signed checkpoints; `uomp audit verify` is green, proof bundles verify alone, tampering with
audit.db is red with the first bad sequence number; with [anchor] on a real local chain (anvil)
the guard anchors its checkpoints and both the log and a bundle are checked against the chain."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
from anchorkit import ANVIL, ANVIL_MISSING, Anvil
from guardkit import call, grant, guard_config, running_guard, seed, unix_session

from gateway.cli.main import main
from gateway.config import Paths

READ = {"tags": ["preference"], "keys": []}


def cli(home: Paths, *args: str) -> int:
    return main(["--home", str(home.home), *args])


async def _traffic(home: Paths, cfg_overrides: dict[str, object] | None = None) -> str:
    """A session, allowed and refused reads, a revocation; returns the session id."""
    seed(home)
    async with running_guard(home, guard_config(**(cfg_overrides or {}))) as g:
        async with unix_session(home) as s:
            granted = await grant(s, home, read=READ)
            tok, sid = granted["token"], granted["session_id"]
            hdr = {"X-UOMP-Agent-Id": "calendar_agent"}
            assert (await call(s, "GET", "/v1/memory/preference.theme", token=tok, headers=hdr))[0] == 200
            assert (await call(s, "GET", "/v1/memory/user.password", token=tok, headers=hdr))[0] in (403, 404)
            assert (await call(s, "GET", "/v1/memory?tag=preference", token=tok, headers=hdr))[0] == 200
            from guardkit import admin_headers

            assert (await call(s, "POST", f"/v1/sessions/{sid}/revoke", headers=admin_headers(home)))[0] == 200
            assert (await call(s, "GET", "/v1/memory/preference.theme", token=tok, headers=hdr))[0] == 401
        await g.services.audit.writer.probe()  # type: ignore[union-attr]
    return str(sid)


def test_verify_proof_and_tamper(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sid = asyncio.run(_traffic(home))
    assert cli(home, "audit", "verify", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["events"] >= 6 and report["checkpoints"] >= 1 and report["first_bad_seq"] is None
    # Every refusal is an event too; newest last; unknown session is an error.
    assert cli(home, "audit", "--session", sid, "--json") == 0
    events = json.loads(capsys.readouterr().out)
    assert any(not e["allowed"] for e in events)
    assert [e["timestamp"] for e in events] == sorted(e["timestamp"] for e in events)
    assert cli(home, "audit", "--session", "sess_nope") != 0
    capsys.readouterr()
    # A proof bundle for one read, checked alone.
    conn = sqlite3.connect(home.audit_db)
    event_id = conn.execute("SELECT id FROM ledger_events WHERE action = 'read' ORDER BY seq LIMIT 1").fetchone()[0]
    bundle = tmp_path / "proof.json"
    assert cli(home, "audit", "proof", event_id, "--out", str(bundle)) == 0
    assert oct(bundle.stat().st_mode & 0o777) == "0o600"
    assert cli(home, "audit", "verify-proof", str(bundle)) == 0
    assert "proof OK" in capsys.readouterr().out
    forged = json.loads(bundle.read_text())
    forged["event"]["allowed"] = not forged["event"]["allowed"]
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    assert cli(home, "audit", "verify-proof", str(tmp_path / "forged.json")) == 1
    assert "INVALID" in capsys.readouterr().out
    # Tamper with the file: flip a refusal into an allow, keep the leaf; verify names the event.
    seq, body = conn.execute("SELECT seq, body FROM ledger_events WHERE allowed = 0 ORDER BY seq LIMIT 1").fetchone()
    conn.execute(
        "UPDATE ledger_events SET body = ? WHERE seq = ?", (body.replace('"allowed":false', '"allowed":true'), seq)
    )
    conn.commit()
    assert cli(home, "audit", "verify", "--json") == 1
    bad = json.loads(capsys.readouterr().out)
    assert not bad["ok"] and bad["first_bad_seq"] == seq
    # Truncate the tail past the last checkpoint's size: also red.
    conn.execute("UPDATE ledger_events SET body = ? WHERE seq = ?", (body, seq))
    last = conn.execute("SELECT MAX(seq) FROM ledger_events").fetchone()[0]
    conn.execute("DELETE FROM ledger_events WHERE seq = ?", (last,))
    conn.commit()
    assert cli(home, "audit", "verify") == 1
    assert f"#{last}" in capsys.readouterr().out
    conn.close()


def test_proof_of_unknown_event_is_an_error(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(_traffic(home))
    assert cli(home, "audit", "proof", "log_doesnotexist") != 0
    assert cli(home, "audit", "proof") != 0


@pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)
def test_anchored_on_a_local_chain(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eth_account import Account

    from gateway.anchor.evm import write_private_key

    anvil = Anvil(tmp_path)
    anvil.start()
    try:
        owner = Account.create()
        anvil.fund(owner.address)
        key_file = tmp_path / "owner.key"
        write_private_key(key_file, owner)
        assert cli(home, "anchor", "deploy", "--rpc", anvil.url, "--key-file", str(key_file)) == 0
        contract = json.loads(capsys.readouterr().out)["contract"]
        home.config_file.write_text(
            f'[anchor]\nbackend = "evm"\nrpc_url = "{anvil.url}"\ncontract = "{contract}"\n'
            f'chain_id = 31337\nkey_file = "{key_file}"\nconfirmations = 1\n'
            f"poll_seconds = 0.2\n"
        )

        async def run() -> None:
            await _traffic(home, {"audit_checkpoint_seconds": 0.2})
            # The appliance again, long enough for the anchoring worker to drain the backlog.
            async with running_guard(home, guard_config(audit_checkpoint_seconds=0.2)):
                for _ in range(300):
                    conn = sqlite3.connect(home.audit_db)
                    done = conn.execute("SELECT COUNT(*) FROM ledger_anchors WHERE state = 'confirmed'").fetchone()[0]
                    pending = conn.execute(
                        "SELECT COUNT(*) FROM ledger_anchors WHERE state IN ('queued', 'submitted')"
                    ).fetchone()[0]
                    conn.close()
                    if done and not pending:
                        return
                    await asyncio.to_thread(anvil.mine, 1)
                    await asyncio.sleep(0.1)
                raise AssertionError("the backlog was not anchored")

        asyncio.run(run())
        assert cli(home, "audit", "verify", "--json") == 0
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] and report["anchors_verified"] >= 1
        conn = sqlite3.connect(home.audit_db)
        event_id = conn.execute("SELECT id FROM ledger_events ORDER BY seq LIMIT 1").fetchone()[0]
        conn.close()
        bundle = tmp_path / "anchored.json"
        assert cli(home, "audit", "proof", event_id, "--out", str(bundle)) == 0
        capsys.readouterr()
        anvil.mine(3)  # a verifier counts 2 confirmations by default (the appliance was set to 1)
        assert cli(home, "audit", "verify-proof", str(bundle), "--rpc", anvil.url) == 0
        assert "checked on chain" in capsys.readouterr().out
        assert cli(home, "anchor", "status") == 0
        status = json.loads(capsys.readouterr().out)
        assert status["backlog"]["counts"]["confirmed"] >= 1
    finally:
        anvil.stop()


def test_two_writers_on_one_log_take_turns_without_a_fork(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    """Two audit logs open on the same file (the guard and `uomp` in another process) append in
    turns. Each batch re-reads the tree's edge only when another connection committed since its
    own last write (PRAGMA data_version): a skipped re-read would append on a stale edge
    and fork the tree, which `uomp audit verify` finds. Batches of one and of several events."""
    from gateway.guard.audit import make_row, open_audit

    cfg = guard_config()
    a, b = open_audit(home, cfg), open_audit(home, cfg)
    try:

        def rows(who: str, n: int) -> list[tuple[object, ...]]:
            return [
                make_row(session_id=f"sess_{who}", agent_id=who, action="read", allowed=True, reason="ok", key=f"k{i}")
                for i in range(n)
            ]

        for n in (1, 3, 1, 2, 5):
            for log in (a, b, a):
                if n == 1:  # through the group-commit writer
                    log.flush_sync(log.submit(rows("x", 1)[0]))
                else:  # one batch of n, written at once
                    log.write_now(rows("y", n))
        for log in (a, b):
            log.writer.probe_sync()
        size = sqlite3.connect(home.audit_db).execute("SELECT MAX(seq), COUNT(*) FROM ledger_events").fetchone()
        assert size[0] == size[1] == 3 * (1 + 3 + 1 + 2 + 5)
    finally:
        a.close()
        b.close()
    assert cli(home, "audit", "verify", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["events"] == 36 and report["first_bad_seq"] is None
