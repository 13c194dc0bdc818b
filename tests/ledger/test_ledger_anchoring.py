"""The anchoring backlog against a real local chain (anvil): checkpoints queued with the log,
anchored, final after confirmations, verified from the chain; an RPC outage loses nothing and the
backlog catches up; older queued checkpoints are superseded by the newest."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from anchorkit import ANVIL, ANVIL_MISSING, Anvil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway.anchor.base import Anchor
from gateway.ledger.anchorer import Anchorer, AnchorPolicy
from gateway.ledger.anchoring import backlog
from gateway.ledger.log import EventLog
from gateway.ledger.verify import verify_bundle

pytestmark = pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)
ORIGIN = "uomp.test/anchored"
KEY = Ed25519PrivateKey.generate()
POLICY = AnchorPolicy(poll_seconds=0.05, backoff_initial_seconds=0.1, backoff_max_seconds=0.5)


@pytest.fixture
def anvil(tmp_path: Path) -> Iterator[Anvil]:
    node = Anvil(tmp_path)
    node.start()
    yield node
    node.stop()


@pytest.fixture
async def backend(anvil: Anvil) -> AsyncIterator[object]:
    from eth_account import Account

    from gateway.anchor.evm import EvmBackend, EvmSettings, deploy

    owner = Account.create()
    anvil.fund(owner.address)
    address = await deploy(anvil.url, owner)
    b = EvmBackend(
        EvmSettings(
            rpc_url=anvil.url,
            contract=address,
            chain_id=31337,
            confirmations=2,
            rpc_attempts=1,
            backoff_initial_s=0.05,
            backoff_max_s=0.1,
            rpc_timeout_s=3.0,
        ),
        owner,
    )
    yield b
    await b.close()


def _log(path: Path) -> EventLog:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    return EventLog(conn, origin=ORIGIN, key=KEY, anchor_backend="evm")


def _append(log: EventLog, n: int, start: int, now: float) -> str:
    log.conn.execute("BEGIN IMMEDIATE")
    log.append(
        [
            {"id": f"evt_{i}", "ts": now, "action": "read", "session_id": "sess_a", "allowed": True}
            for i in range(start, start + n)
        ]
    )
    note = log.checkpoint(now=now)
    log.conn.execute("COMMIT")
    assert note is not None
    return note


async def _drain(anchorer: Anchorer, anvil: Anvil, db: sqlite3.Connection, size: int, *, rounds: int = 200) -> None:
    for i in range(rounds):
        await anchorer.step(now=10**10 + i)
        state = db.execute("SELECT state FROM ledger_anchors WHERE size = ?", (size,)).fetchone()[0]
        if state == "confirmed":
            return
        anvil.mine(1)
    raise AssertionError(f"checkpoint {size} never became final")


async def test_checkpoint_anchored_final_and_verified(tmp_path: Path, anvil: Anvil, backend: object) -> None:
    log = _log(tmp_path / "ledger.db")
    note = _append(log, 5, 0, 1000.0)
    anchorer = Anchorer(tmp_path / "ledger.db", backend, policy=POLICY)  # type: ignore[arg-type]
    await _drain(anchorer, anvil, log.conn, 5)
    row = log.conn.execute("SELECT ref, block_number FROM ledger_anchors WHERE size = 5").fetchone()
    await backend.verify(Anchor.for_checkpoint(note), row[0])  # type: ignore[attr-defined]
    bundle = log.proof_bundle("evt_2", chain=backend.describe())  # type: ignore[attr-defined]
    assert bundle["anchor"]["tx"] == row[0] and bundle["anchor"]["tree_size"] == 5
    verify_bundle(bundle, trusted_key=log.verifier_key())
    await backend.verify(Anchor.for_checkpoint(bundle["checkpoint"]), bundle["anchor"]["tx"])  # type: ignore[attr-defined]
    assert backlog(log.conn)["counts"]["confirmed"] == 1
    await anchorer.stop()


async def test_rpc_down_backlog_catches_up(tmp_path: Path, anvil: Anvil, backend: object) -> None:
    log = _log(tmp_path / "ledger.db")
    anchorer = Anchorer(tmp_path / "ledger.db", backend, policy=POLICY)  # type: ignore[arg-type]
    _append(log, 3, 0, 1000.0)
    await _drain(anchorer, anvil, log.conn, 3)
    anvil.stop()
    _append(log, 4, 3, 1001.0)
    for i in range(3):
        await anchorer.step(now=10**9 + i)
    b = backlog(log.conn)
    assert b["counts"]["queued"] == 1 and b["last_error"]
    assert log.conn.execute("SELECT attempts FROM ledger_anchors WHERE size = 7").fetchone()[0] >= 1
    anvil.start()
    await _drain(anchorer, anvil, log.conn, 7)
    assert backlog(log.conn)["counts"] == {
        "queued": 0,
        "submitted": 0,
        "confirmed": 2,
        "rejected": 0,
        "superseded": 0,
        "failed": 0,
    }
    await anchorer.stop()


async def test_older_queued_checkpoints_are_superseded(tmp_path: Path, anvil: Anvil, backend: object) -> None:
    log = _log(tmp_path / "ledger.db")
    for k in range(4):
        _append(log, 2, 2 * k, 1000.0 + k)
    anchorer = Anchorer(tmp_path / "ledger.db", backend, policy=POLICY)  # type: ignore[arg-type]
    await _drain(anchorer, anvil, log.conn, 8)
    counts = backlog(log.conn)["counts"]
    assert counts["confirmed"] == 1 and counts["superseded"] == 3
    # Every event, even one only in a superseded checkpoint, proves against the anchored one.
    bundle = log.proof_bundle("evt_0", chain={})
    assert bundle["anchor"]["tree_size"] == 8
    verify_bundle(bundle, trusted_key=log.verifier_key())
    await anchorer.stop()
