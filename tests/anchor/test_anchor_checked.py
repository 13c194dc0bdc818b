"""Anchors count only when the appliance checked them on the chain itself.

A real anvil behind a lying JSON-RPC stand-in (tests/anchor/lying_rpc.py): a receipt sent to
another address, a receipt with status 1 and no logs, logs from another contract, an event with
another root, no contract code or other code, a fabricated transaction; a reorg that drops the
transaction (anvil snapshot/revert) and a chain reset to an empty anvil. None yields
``confirmed``: each leaves ``rejected`` (or, for a confirmed anchor that is gone, ``queued`` again)
with its reason, is not bundled or shown as anchored, and is retried once the cause is gone; the
honest path still confirms.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from anchorkit import ANVIL, ANVIL_MISSING, Anvil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from lying_rpc import OTHER, LyingRpc

from gateway.anchor.base import Anchor, plain_http_remote
from gateway.ledger.anchorer import Anchorer, AnchorPolicy
from gateway.ledger.anchoring import backlog, summary
from gateway.ledger.log import EventLog

pytestmark = pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)
ORIGIN = "uomp.test/checked"
KEY = Ed25519PrivateKey.generate()
POLICY = AnchorPolicy(
    poll_seconds=0.05, backoff_initial_seconds=0.1, backoff_max_seconds=0.5, recheck_seconds=1000.0, recheck_count=4
)
T0 = 10.0**9


class Chain:
    """anvil, the UompAnchor deployed by ``owner``, a lying stand-in in front of it."""

    def __init__(self, anvil: Anvil, owner: Any, contract: str, lying: LyingRpc) -> None:
        self.anvil, self.owner, self.contract, self.lying = anvil, owner, contract, lying
        self.clock = T0

    def backend(self, url: str | None = None) -> Any:
        from gateway.anchor.evm import EvmBackend, EvmSettings

        return EvmBackend(
            EvmSettings(
                rpc_url=url or self.lying.url,
                contract=self.contract,
                chain_id=31337,
                confirmations=2,
                rpc_attempts=1,
                backoff_initial_s=0.05,
                backoff_max_s=0.1,
                rpc_timeout_s=3.0,
            ),
            self.owner,
        )

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock


@pytest.fixture
def anvil(tmp_path: Path) -> Iterator[Anvil]:
    node = Anvil(tmp_path)
    node.start()
    yield node
    node.stop()


@pytest.fixture
async def chain(anvil: Anvil) -> AsyncIterator[Chain]:
    from eth_account import Account

    from gateway.anchor.evm import deploy

    owner = Account.create()
    anvil.fund(owner.address)
    contract = await deploy(anvil.url, owner)
    lying = LyingRpc(anvil.url)
    await lying.start()
    yield Chain(anvil, owner, contract, lying)
    await lying.close()


def _log(path: Path) -> EventLog:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    return EventLog(conn, origin=ORIGIN, key=KEY, anchor_backend="evm")


def _append(log: EventLog, n: int, start: int) -> str:
    log.conn.execute("BEGIN IMMEDIATE")
    log.append(
        [
            {"id": f"evt_{i}", "ts": 1000.0 + i, "action": "read", "session_id": "sess_a", "allowed": True}
            for i in range(start, start + n)
        ]
    )
    note = log.checkpoint(now=1000.0 + start)
    log.conn.execute("COMMIT")
    assert note is not None
    return note


def _row(log: EventLog, size: int) -> dict[str, Any]:
    cur = log.conn.execute("SELECT * FROM ledger_anchors WHERE size = ?", (size,))
    names = [d[0] for d in cur.description]
    return dict(zip(names, cur.fetchone(), strict=True))


async def _rounds(
    anchorer: Anchorer, chain: Chain, log: EventLog, size: int, *, until: str, rounds: int = 40
) -> set[str]:
    """Step (mining a block after each round) until the row is in state ``until``; the states seen."""
    seen: set[str] = set()
    for _ in range(rounds):
        await anchorer.step(now=chain.tick())
        state = _row(log, size)["state"]
        seen.add(state)
        if state == until:
            return seen
        chain.anvil.mine(1)
    raise AssertionError(f"checkpoint {size} never reached {until}: saw {sorted(seen)}, row {_row(log, size)}")


def _decoy(anvil: Anvil) -> str:
    """A real transaction that has nothing to do with anchoring: a transfer to another address."""
    from eth_account import Account

    sender = Account.create().address
    anvil.fund(sender)
    anvil.rpc("anvil_impersonateAccount", sender)
    tx: str = anvil.rpc("eth_sendTransaction", {"from": sender, "to": OTHER, "value": "0x1"})
    anvil.mine(1)
    return tx


LIES = [
    "receipt_to_other",
    "receipt_no_logs",
    "logs_other_contract",
    "other_root",
    "no_code",
    "other_code",
    "other_chain",
    "fabricated",
]


@pytest.mark.parametrize("lie", LIES)
async def test_a_lying_node_never_yields_confirmed(tmp_path: Path, chain: Chain, lie: str) -> None:
    log = _log(tmp_path / "audit.db")
    note = _append(log, 4, 0)
    if lie == "fabricated":
        chain.lying.decoy = _decoy(chain.anvil)
    chain.lying.lies = {lie}
    backend = chain.backend()
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    try:
        seen = await _rounds(anchorer, chain, log, 4, until="rejected")
        for _ in range(6):  # and it stays out of confirmed, retried or not
            await anchorer.step(now=chain.tick())
            chain.anvil.mine(1)
            seen.add(_row(log, 4)["state"])
        assert "confirmed" not in seen
        row = _row(log, 4)
        assert row["rejected_reason"] and row["rejections"] >= 1 and row["verified_at"] is None
        assert log.proof_bundle("evt_1", chain={})["anchor"] is None
        b = backlog(log.conn)
        assert b["counts"]["confirmed"] == 0 and b["backlog_size"] == 1
        assert b["last_rejection"]["tree_size"] == 4 and "did not show checkpoint 4" in summary(b)
        if lie == "fabricated":
            assert chain.lying.sent_raw == 0
        # The cause gone, the same row is retried and confirmed from the chain it now reads.
        chain.lying.lies = set()
        await _rounds(anchorer, chain, log, 4, until="confirmed")
        row = _row(log, 4)
        assert row["verified_at"] is not None and row["ref"] != chain.lying.fake_hash
        honest = chain.backend(chain.anvil.url)
        try:
            await honest.verify(Anchor.for_checkpoint(note), row["ref"])
        finally:
            await honest.close()
        assert log.proof_bundle("evt_1", chain={})["anchor"]["tx"] == row["ref"]
    finally:
        await anchorer.stop()
        await backend.close()


async def test_a_submitted_row_is_checked_after_a_restart(tmp_path: Path, chain: Chain) -> None:
    """The worker stops with the anchor sent but not final; the next one (a restart) reads the
    lying receipt and does not confirm it."""
    log = _log(tmp_path / "audit.db")
    _append(log, 3, 0)
    backend = chain.backend()
    first = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    await first.step(now=chain.tick())
    assert _row(log, 3)["state"] == "submitted"
    await first.stop()
    chain.lying.lies = {"receipt_to_other"}
    chain.anvil.mine(3)
    second = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    try:
        await second.step(now=chain.tick())
        row = _row(log, 3)
        assert row["state"] == "rejected" and "not sent to the anchor contract" in row["rejected_reason"]
    finally:
        await second.stop()
        await backend.close()


async def test_a_confirmed_row_nobody_checked_is_checked_before_it_counts(tmp_path: Path, chain: Chain) -> None:
    """A row marked confirmed without a recorded check (an earlier version that believed the node)
    is checked again at the worker's first open, and is not bundled meanwhile."""
    log = _log(tmp_path / "audit.db")
    _append(log, 2, 0)
    log.conn.execute(
        "UPDATE ledger_anchors SET state = 'confirmed', ref = ?, block_number = 1 WHERE size = 2",
        (chain.lying.fake_hash,),
    )
    backend = chain.backend(chain.anvil.url)
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    try:
        await anchorer.step(now=chain.tick())
        assert _row(log, 2)["state"] != "confirmed"
        assert log.proof_bundle("evt_0", chain={})["anchor"] is None
        await _rounds(anchorer, chain, log, 2, until="confirmed")
        assert _row(log, 2)["ref"] != chain.lying.fake_hash
    finally:
        await anchorer.stop()
        await backend.close()


async def test_a_reorg_that_drops_the_transaction_sends_it_back_to_the_backlog(tmp_path: Path, chain: Chain) -> None:
    from gateway.dashboard import data
    from gateway.dashboard.data import Filters

    log = _log(tmp_path / "audit.db")
    note = _append(log, 5, 0)
    snapshot = chain.anvil.rpc("evm_snapshot")
    backend = chain.backend(chain.anvil.url)
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    try:
        await _rounds(anchorer, chain, log, 5, until="confirmed")
        tx = _row(log, 5)["ref"]
        chain.anvil.mine(6)  # well past the confirmation depth
        await anchorer.step(now=chain.tick())  # not due yet: nothing read again, nothing changes
        assert _row(log, 5)["state"] == "confirmed"
        assert chain.anvil.rpc("evm_revert", snapshot) is True
        chain.clock += POLICY.recheck_seconds  # the periodic recheck is due
        await anchorer.step(now=chain.tick())  # reads it again, finds it gone, sends it again
        row = _row(log, 5)
        assert row["state"] == "submitted" and tx in row["rejected_reason"] and row["verified_at"] is None
        assert log.proof_bundle("evt_2", chain={})["anchor"] is None
        paths = _paths_with(tmp_path, log)
        shown = data.timeline(paths, Filters("", "", "", "all"))
        assert shown and all(e["proof"] != "anchored" for e in shown)
        await _rounds(anchorer, chain, log, 5, until="confirmed")  # re-anchored
        await backend.verify(Anchor.for_checkpoint(note), _row(log, 5)["ref"])
        assert log.proof_bundle("evt_2", chain={})["anchor"]["tx"] == _row(log, 5)["ref"]
    finally:
        await anchorer.stop()
        await backend.close()


async def test_a_chain_reset_to_an_empty_node_is_rejected_until_the_contract_is_back(
    tmp_path: Path, chain: Chain
) -> None:
    """anvil restarted empty while the appliance was stopped: at start the confirmed anchor is
    read again and sent back; with no contract on the chain the row is rejected (named), and once
    the contract is deployed again at the configured address it is re-anchored."""
    from gateway.anchor.evm import deploy

    log = _log(tmp_path / "audit.db")
    _append(log, 3, 0)
    backend = chain.backend(chain.anvil.url)
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    await _rounds(anchorer, chain, log, 3, until="confirmed")
    await anchorer.stop()
    await backend.close()
    chain.anvil.stop()
    chain.anvil.state.unlink()
    chain.anvil.start()
    backend = chain.backend(chain.anvil.url)
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)  # a restart: recheck at start
    try:
        await anchorer.step(now=chain.tick())
        row = _row(log, 3)
        assert row["state"] == "rejected" and "no contract code" in row["rejected_reason"]
        assert log.proof_bundle("evt_0", chain={})["anchor"] is None
        assert "REJECTED" in summary(backlog(log.conn))
        chain.anvil.fund(chain.owner.address)
        assert (await deploy(chain.anvil.url, chain.owner)).lower() == chain.contract.lower()  # same deployer nonce
        await _rounds(anchorer, chain, log, 3, until="confirmed")
    finally:
        await anchorer.stop()
        await backend.close()


async def test_an_unreachable_chain_is_not_a_rejection(tmp_path: Path, chain: Chain) -> None:
    """The partner of the cases above: a recheck that cannot reach the chain changes nothing."""
    log = _log(tmp_path / "audit.db")
    _append(log, 2, 0)
    backend = chain.backend(chain.anvil.url)
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    try:
        await _rounds(anchorer, chain, log, 2, until="confirmed")
        chain.anvil.stop()
        assert await anchorer.recheck(now=chain.tick()) == 0
        assert _row(log, 2)["state"] == "confirmed"
        chain.anvil.start()
    finally:
        await anchorer.stop()
        await backend.close()


def test_plain_http_to_another_host_is_flagged() -> None:
    assert plain_http_remote("http://10.0.0.5:8545") and plain_http_remote("http://rpc.example.org/key")
    assert not plain_http_remote("http://127.0.0.1:8545") and not plain_http_remote("http://[::1]:8545")
    assert not plain_http_remote("http://localhost:8545") and not plain_http_remote("https://rpc.example.org")


def _paths_with(tmp_path: Path, log: EventLog) -> Any:
    """A data directory whose audit.db is this log's file (the dashboard reads it read-only)."""
    from gateway.config import Paths

    paths = Paths(tmp_path / "home")
    paths.audit_db.parent.mkdir(parents=True, exist_ok=True)
    if not paths.audit_db.exists():
        paths.audit_db.symlink_to(tmp_path / "audit.db")
    return paths


async def test_the_schema_upgrade_waits_out_a_busy_writer(tmp_path: Path) -> None:
    """The worker's first open adds its columns; while the log's writer holds the write lock that
    fails, and the next round does it (the worker never runs on a half-upgraded table)."""
    from gateway.anchor.none import NoneBackend

    log = _log(tmp_path / "audit.db")
    _append(log, 2, 0)
    anchorer = Anchorer(tmp_path / "audit.db", NoneBackend(), policy=POLICY)
    log.conn.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            await anchorer.step(now=T0)
    finally:
        log.conn.execute("COMMIT")
    await anchorer.step(now=T0 + 1)
    row = _row(log, 2)
    assert row["state"] == "confirmed" and row["verified_at"] == T0 + 1 and row["rejections"] == 0
    await anchorer.stop()
