"""The §18.4.1 events through the starknet backend, against the local stand-in JSON-RPC server
(tests/starknet_standin.py, which decodes the calldata and emits what the Cairo contract would):
the same backlog, bound to the checkpoint that covers them, confirmed only once read back. Never
run against a real Starknet node."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from starknet_py.net.models import StarknetChainId
from starknet_py.net.signer.stark_curve_signer import KeyPair
from starknet_standin import StandIn, StandInServer

from gateway.anchor import encoding as enc
from gateway.anchor.starknet import StarknetBackend, StarknetSettings, expected_events
from gateway.ledger.anchorer import Anchorer, AnchorPolicy
from gateway.ledger.anchoring import anchor_for, backlog, check_facts
from gateway.ledger.log import EventLog

CHAIN = int(StarknetChainId.SEPOLIA)
ACCOUNT = 0x0123456789ABCDEF0123456789ABCDEF0123456789ABCDEF0123456789ABCDE
CONTRACT = 0x04A0C0FFEE00000000000000000000000000000000000000000000000000CAFE
KEY = KeyPair.from_private_key(0x5EC2E7_0000_0000_0000_0000_0000_0000_0000_0000_0000_0002)
POLICY = AnchorPolicy(poll_seconds=0.05, backoff_initial_seconds=0.1, backoff_max_seconds=0.5, recheck_seconds=1000.0)


async def test_grant_and_payload_facts_reach_the_stand_in_and_are_checked(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    node = StandIn(chain_id=CHAIN, account=ACCOUNT, public_key=KEY.public_key, contract=CONTRACT, owner=ACCOUNT)
    server = StandInServer(node)
    await server.start()
    conn = sqlite3.connect(tmp_path / "audit.db", isolation_level=None, check_same_thread=False)
    log = EventLog(conn, origin="uomp.test/sn", key=Ed25519PrivateKey.generate(), anchor_backend="starknet")
    conn.execute("BEGIN IMMEDIATE")
    log.append(
        [
            {
                "id": "log_g",
                "ts": 1.0,
                "action": "session_granted",
                "session_id": "sess_sn",
                "agent_id": "ag",
                "allowed": True,
                "reason": "granted",
                "tags": ["b", "a"],
                "expires_at": 1_900_000_000,
            },
            {
                "id": "log_p",
                "ts": 2.0,
                "action": "payload_uploaded",
                "session_id": "sess_sn",
                "agent_id": "ag",
                "allowed": True,
                "reason": "stored",
                "detail": "sha256:" + "cd" * 32,
            },
        ]
    )
    log.checkpoint(now=1000.0)
    conn.execute("COMMIT")
    backend = StarknetBackend(
        StarknetSettings(
            rpc_url=server.url,
            account=ACCOUNT,
            contract=CONTRACT,
            chain_id=CHAIN,
            confirmations=1,
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        ),
        KEY,
    )
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    try:
        clock = 10.0**9
        for _ in range(20):
            clock += 1
            await anchorer.step(now=clock)
            node.mine(1)
            if backlog(conn)["events"].get("PayloadAnchored") == {"confirmed": 1}:
                break
        assert backlog(conn)["events"] == {"SessionGranted": {"confirmed": 1}, "PayloadAnchored": {"confirmed": 1}}
        anchor = anchor_for(conn, 2, conn.execute("SELECT note FROM ledger_checkpoints WHERE size = 2").fetchone()[0])
        assert anchor.granted[0].session_hash == enc.session_hash("sess_sn", "ag", ["a", "b"])
        assert anchor.payloads[0].payload_hash == bytes.fromhex("cd" * 32)
        mined = [tx for tx in node.txs.values() if tx.block is not None]
        assert len(mined) == 1 and mined[0].events == expected_events(anchor)
        # uomp audit verify's event check reads the same events back from the node
        events = await backend.contract_events()
        assert sorted(e["kind"] for e in events) == ["PayloadAnchored", "SessionGranted"]
        assert check_facts(conn, events) == []
        assert any("matches no audit event" in p for p in check_facts(conn, events + events[:1]))
    finally:
        await anchorer.stop()
        await backend.close()
        await server.stop()
        conn.close()
