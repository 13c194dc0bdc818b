"""What the user sees of anchoring: `uomp anchor status` during an outage, `uomp audit verify-proof`
with the user's own trust roots, the plain-http warning, a rejected anchor in `uomp status`, the
dashboard and the metrics."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from anchorkit import ANVIL, ANVIL_MISSING, Anvil, closed_port

from gateway.anchor.base import Anchor
from gateway.cli.main import main
from gateway.config import Paths
from gateway.ledger import auditkey
from gateway.ledger.log import EventLog

SOME_CONTRACT = "0x5FbDB2315678afecb367f032d93F642f64180aa3"


def _log(paths: Paths) -> EventLog:
    auditkey.ensure(paths)
    key = auditkey.load(paths)
    conn = sqlite3.connect(paths.audit_db, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    return EventLog(conn, origin=auditkey.origin_for(key.public_key()), key=key, anchor_backend="evm")


def _events(log: EventLog, n: int = 3) -> str:
    log.conn.execute("BEGIN IMMEDIATE")
    log.append(
        [
            {
                "id": f"evt_{i}",
                "ts": 1000.0 + i,
                "timestamp": "2026-12-01T00:00:00Z",
                "action": "read",
                "session_id": "sess_a",
                "agent_id": "a1",
                "allowed": True,
            }
            for i in range(n)
        ]
    )
    note = log.checkpoint(now=1000.0)
    log.conn.execute("COMMIT")
    assert note is not None
    return note


def _config(paths: Paths, rpc: str, contract: str = SOME_CONTRACT, extra: str = "") -> None:
    paths.config_file.write_text(
        f'[anchor]\nbackend = "evm"\nrpc_url = "{rpc}"\ncontract = "{contract}"\n'
        f"chain_id = 31337\nconfirmations = 1\n{extra}"
    )


def test_anchor_status_during_an_outage_shows_the_backlog(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    _config(home, f"http://127.0.0.1:{closed_port()}")
    log = _log(home)
    _events(log)
    log.conn.execute("UPDATE ledger_anchors SET attempts = 3, last_error = 'ANCHOR_UNAVAILABLE: chain RPC down'")
    capsys.readouterr()
    assert main(["--home", str(home.home), "anchor", "status"]) == 0
    out = capsys.readouterr()
    status = json.loads(out.out)
    b = status["backlog"]
    assert b["backlog_size"] == 1 and b["oldest_pending_tree_size"] == 3 and b["oldest_pending_seconds"] is not None
    assert b["last_error"] == "ANCHOR_UNAVAILABLE: chain RPC down"
    assert status["chain"]["reachable"] is False and status["chain"]["error"] == "ANCHOR_UNAVAILABLE"
    assert "NOT REACHABLE" in out.err and "backlog: 1 checkpoint(s)" in out.err
    # The partner: a rejected anchor is a failure of the command (exit 1), reported the same way.
    log.conn.execute(
        "UPDATE ledger_anchors SET state = 'rejected', last_error = 'the transaction was not sent to "
        "the anchor contract'"
    )
    assert main(["--home", str(home.home), "anchor", "status"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["backlog"]["counts"]["rejected"] == 1 and "REJECTED" in out.err


def test_a_rejected_anchor_is_loud_in_status_dashboard_and_metrics(
    home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli.gateway import _anchor_metrics
    from gateway.cli.status import _anchoring
    from gateway.dashboard import data
    from gateway.remote.metrics import Metrics

    _config(home, "http://127.0.0.1:8545")
    log = _log(home)
    _events(log)
    log.conn.execute("UPDATE ledger_anchors SET state = 'confirmed', ref = '0x' || hex(randomblob(32))")
    log.conn.execute(
        "UPDATE ledger_anchors SET state = 'rejected', ref = NULL,"
        " last_error = 'no contract code at 0x5F (a reset or another chain?)'"
    )
    a = _anchoring(home)
    assert a["rejected"] and "REJECTED" in a["note"] and "0 anchored" in a["note"]
    shown = data.timeline(home, data.Filters())
    assert shown and {e["proof"] for e in shown} == {"rejected"}
    assert "no contract code" in shown[0]["anchor_error"]
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("gateway.dashboard", "templates"), autoescape=True)
    badge = env.from_string('{% from "_macros.html" import proof_badge %}{{ proof_badge(r) }}').render(r=shown[0])
    assert "badge rejected" in badge and "no contract code" in badge and "badge anchored" not in badge
    m = Metrics()
    _anchor_metrics(home, m)
    text = m.render()
    assert 'uomp_anchors{state="rejected"} 1' in text and 'uomp_anchors{state="confirmed"} 0' in text
    assert main(["--home", str(home.home), "status"]) in (1, 3)
    assert "anchors REJECTED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("url", "warned"),
    [
        ("http://10.1.2.3:8545", True),
        ("http://rpc.example.org/k", True),
        ("https://rpc.example.org/k", False),
        ("http://127.0.0.1:8545", False),
    ],
)
def test_plain_http_rpc_to_another_host_is_warned(
    home: Paths, capsys: pytest.CaptureFixture[str], url: str, warned: bool
) -> None:
    from gateway.cli.doctor import run_checks
    from gateway.cli.gateway import _anchor_warnings

    _config(home, url)
    lines = "\n".join(run_checks(home).lines)
    assert ("WARNING" in lines and "plain http" in lines) is warned
    assert "/k" not in lines  # the URL's path (often an API key) is never echoed
    capsys.readouterr()
    _anchor_warnings(home)
    assert ("anchoring: WARNING" in capsys.readouterr().out) is warned


@pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)
async def test_verify_proof_trusts_the_users_chain_not_the_bundles(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Someone who holds the audit key anchors the same checkpoint on a contract of their own and
    names it in the bundle: the bundle's contract is a claim, checked against the user's."""
    import asyncio

    from anchorkit import included
    from eth_account import Account

    from gateway.anchor.evm import EvmBackend, EvmSettings, deploy
    from gateway.ledger.anchorer import Anchorer, AnchorPolicy

    node = Anvil(tmp_path)
    await asyncio.to_thread(node.start)
    try:
        owner, other = Account.create(), Account.create()
        node.fund(owner.address)
        node.fund(other.address)
        ours, theirs = await deploy(node.url, owner), await deploy(node.url, other)
        _config(home, node.url, ours)
        log = _log(home)
        note = _events(log)
        mine = EvmBackend(EvmSettings(rpc_url=node.url, contract=ours, chain_id=31337, confirmations=1), owner)
        anchorer = Anchorer(home.audit_db, mine, policy=AnchorPolicy(poll_seconds=0.05))
        for i in range(40):
            await anchorer.step(now=10.0**9 + i)
            if log.conn.execute("SELECT state FROM ledger_anchors").fetchone()[0] == "confirmed":
                break
            node.mine(1)
        await anchorer.stop()
        await mine.close()
        fake = EvmBackend(EvmSettings(rpc_url=node.url, contract=theirs, chain_id=31337, confirmations=1), other)
        sub = await fake.submit(Anchor.for_checkpoint(note))
        await included(fake, sub)
        await fake.close()
        node.mine(2)

        def verify_proof(bundle: dict[str, Any], *flags: str) -> tuple[int, str]:
            f = tmp_path / "bundle.json"
            f.write_text(json.dumps(bundle))
            capsys.readouterr()
            rc = main(["--home", str(home.home), "audit", "verify-proof", str(f), "--rpc", node.url, *flags])
            return rc, capsys.readouterr().out

        capsys.readouterr()
        assert main(["--home", str(home.home), "audit", "proof", "evt_1"]) == 0
        bundle = json.loads(capsys.readouterr().out)
        assert bundle["anchor"]["contract"] == ours
        rc, out = await asyncio.to_thread(verify_proof, bundle)
        assert rc == 0 and "checked on chain" in out, out
        forged = {**bundle, "anchor": {**bundle["anchor"], "contract": theirs, "tx": sub.ref}}
        rc, out = await asyncio.to_thread(verify_proof, forged)
        assert rc == 1 and "not the one you trust" in out, out
        unnamed = {**bundle, "anchor": {k: v for k, v in forged["anchor"].items() if k != "contract"}}
        rc, out = await asyncio.to_thread(verify_proof, unnamed)
        assert rc == 1 and "INVALID on chain" in out, out
        # Flags name the trust roots for a bundle checked elsewhere; they win over the configuration.
        rc, out = await asyncio.to_thread(verify_proof, forged, "--contract", theirs, "--chain-id", "31337")
        assert rc == 0 and f"contract {theirs}, from your flags" in out, out
        rc, out = await asyncio.to_thread(verify_proof, bundle, "--contract", ours, "--chain-id", "1")
        assert rc == 1 and "chain 31337" in out, out
        rc, out = await asyncio.to_thread(verify_proof, bundle, "--code-hash", "0x" + "11" * 32)
        assert rc == 1 and "code hash differs" in out, out
    finally:
        await asyncio.to_thread(node.stop)


@pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)
async def test_verify_checks_the_log_against_the_newest_anchor_on_chain(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollback that deletes the newest events, their tree nodes, checkpoints and anchor rows is
    red in `uomp audit verify`: the chain still holds the larger anchor."""
    import asyncio

    from eth_account import Account

    from gateway.anchor.evm import EvmBackend, EvmSettings, deploy
    from gateway.ledger.anchorer import Anchorer, AnchorPolicy

    node = Anvil(tmp_path)
    await asyncio.to_thread(node.start)
    try:
        owner = Account.create()
        node.fund(owner.address)
        contract = await deploy(node.url, owner)
        _config(home, node.url, contract)
        log = _log(home)
        backend = EvmBackend(EvmSettings(rpc_url=node.url, contract=contract, chain_id=31337, confirmations=1), owner)
        anchorer = Anchorer(home.audit_db, backend, policy=AnchorPolicy(poll_seconds=0.05))
        _events(log, 5)
        log.conn.execute("BEGIN IMMEDIATE")
        log.append(
            [
                {"id": f"evt_b{i}", "ts": 2000.0 + i, "action": "read", "session_id": "sess_a", "allowed": True}
                for i in range(3)
            ]
        )
        assert log.checkpoint(now=2000.0) is not None
        log.conn.execute("COMMIT")
        for i in range(60):
            await anchorer.step(now=10.0**9 + i)
            if log.conn.execute("SELECT state FROM ledger_anchors WHERE size = 8").fetchone()[0] == "confirmed":
                break
            node.mine(1)
        await anchorer.stop()
        await backend.close()
        node.mine(2)

        def verify() -> tuple[int, dict[str, Any]]:
            capsys.readouterr()
            rc = main(["--home", str(home.home), "audit", "verify", "--json"])
            return rc, json.loads(capsys.readouterr().out)

        rc, report = await asyncio.to_thread(verify)
        assert rc == 0 and report["ok"], report
        c = log.conn
        c.execute("DELETE FROM ledger_events WHERE seq > 5")
        c.execute("DELETE FROM merkle_nodes WHERE ((idx + 1) << level) > 5")
        c.execute("DELETE FROM ledger_checkpoints WHERE size > 5")
        c.execute("DELETE FROM ledger_anchors WHERE size > 5")
        rc, report = await asyncio.to_thread(verify)
        assert rc == 1 and not report["ok"]
        assert any("first missing size 6" in p for p in report["problems"]), report
    finally:
        await asyncio.to_thread(node.stop)


def test_a_proof_never_carries_an_anchor_nobody_checked(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    """A row marked confirmed without a recorded check (an earlier version believed the node): the
    bundle `uomp audit proof` writes carries no anchor until the worker checked it."""
    _config(home, "http://127.0.0.1:8545")
    log = _log(home)
    _events(log)
    log.conn.execute(
        "UPDATE ledger_anchors SET state = 'confirmed', ref = '0x' || lower(hex(randomblob(32))), block_number = 7"
    )
    capsys.readouterr()
    assert main(["--home", str(home.home), "audit", "proof", "evt_1"]) == 0
    assert json.loads(capsys.readouterr().out)["anchor"] is None
    # The partner: a row the worker checked (verified_at) is bundled.
    log.conn.execute("UPDATE ledger_anchors SET state = 'confirmed', verified_at = 1.0")
    assert main(["--home", str(home.home), "audit", "proof", "evt_1"]) == 0
    assert json.loads(capsys.readouterr().out)["anchor"]["block"] == 7
