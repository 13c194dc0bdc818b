"""The §18.4.1 events on a real chain: each grant, revocation, accepted deletion proof and payload
upload becomes exactly one event of the UompAnchor contract with the hashes of docs/anchoring.md,
counted only once checked on chain, never lost or doubled by a kill -9, never confirmed through a
lying node, and nothing on chain names a key, a value, a token or an id.

The appliance part runs a real guard (Unix socket, real SQLite files) anchoring on a real anvil.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from anchorkit import ANVIL, ANVIL_MISSING, Anvil
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from lying_rpc import LyingRpc

from gateway.anchor import encoding as enc
from gateway.config import Paths
from gateway.ledger.anchorer import Anchorer, AnchorPolicy
from gateway.ledger.anchoring import backlog, check_facts, summary
from gateway.ledger.log import EventLog

pytestmark = pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)
ORIGIN = "uomp.test/events"
KEY = Ed25519PrivateKey.generate()
POLICY = AnchorPolicy(
    poll_seconds=0.05, backoff_initial_seconds=0.1, backoff_max_seconds=0.5, recheck_seconds=1000.0, recheck_count=4
)
REPO = Path(__file__).resolve().parents[2]


class Chain:
    def __init__(self, anvil: Anvil, owner: Any, contract: str, key_file: Path) -> None:
        self.anvil, self.owner, self.contract, self.key_file = anvil, owner, contract, key_file
        self.clock = 10.0**9

    def backend(self, url: str | None = None) -> Any:
        from gateway.anchor.evm import EvmBackend, EvmSettings

        return EvmBackend(
            EvmSettings(
                rpc_url=url or self.anvil.url,
                contract=self.contract,
                chain_id=31337,
                confirmations=1,
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

    async def events(self) -> list[dict[str, Any]]:
        b = self.backend()
        try:
            out: list[dict[str, Any]] = await b.contract_events()
            return out
        finally:
            await b.close()


@pytest.fixture
def anvil(tmp_path: Path) -> Iterator[Anvil]:
    node = Anvil(tmp_path)
    node.start()
    yield node
    node.stop()


@pytest.fixture
async def chain(anvil: Anvil, tmp_path: Path) -> AsyncIterator[Chain]:
    from eth_account import Account

    from gateway.anchor.evm import deploy, write_private_key

    owner = Account.create()
    anvil.fund(owner.address)
    key_file = tmp_path / "anchor.key"
    write_private_key(key_file, owner)
    contract = await deploy(anvil.url, owner)
    yield Chain(anvil, owner, contract, key_file)


# ----------------------------------------------------------------------------- log-level helpers

SID, AGENT, TAGS, EXPIRES = "sess_0123456789abcdef", "calendar_agent", ["ui", "preference"], 1_900_000_000


def _log(path: Path) -> EventLog:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    return EventLog(conn, origin=ORIGIN, key=KEY, anchor_backend="evm")


def _append(log: EventLog, bodies: list[dict[str, Any]]) -> int:
    log.conn.execute("BEGIN IMMEDIATE")
    log.append(bodies)
    log.checkpoint(now=1000.0)
    log.conn.execute("COMMIT")
    return int(log.conn.execute("SELECT MAX(size) FROM ledger_checkpoints").fetchone()[0])


def _grant_body(n: int = 0) -> dict[str, Any]:
    return {
        "id": f"log_grant{n}",
        "ts": 1000.0 + n,
        "action": "session_granted",
        "session_id": SID,
        "agent_id": AGENT,
        "allowed": True,
        "reason": "granted by the user",
        "tags": TAGS,
        "expires_at": EXPIRES,
    }


def _reads(n: int, start: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"log_read{i}",
            "ts": 2000.0 + i,
            "action": "read",
            "session_id": SID,
            "agent_id": AGENT,
            "key": "preference.theme",
            "allowed": True,
            "reason": "scope matched",
        }
        for i in range(start, start + n)
    ]


def _facts(log: EventLog) -> list[tuple[Any, ...]]:
    return log.conn.execute(
        "SELECT e.seq, e.kind, e.anchor_size, a.state FROM ledger_anchor_events e"
        " LEFT JOIN ledger_anchors a ON a.size = e.anchor_size ORDER BY e.seq"
    ).fetchall()


def _expected_grant() -> tuple[bytes, bytes, int]:
    return enc.session_hash(SID, AGENT, TAGS), enc.agent_hash(AGENT), EXPIRES


async def _until_confirmed(anchorer: Anchorer, chain: Chain, log: EventLog, rounds: int = 40) -> None:
    for _ in range(rounds):
        await anchorer.step(now=chain.tick())
        facts = _facts(log)
        if facts and all(f[3] == "confirmed" for f in facts):
            return
        chain.anvil.mine(1)
    raise AssertionError(f"facts never confirmed: {_facts(log)}")


def _grants_on_chain(events: list[dict[str, Any]]) -> list[tuple[bytes, bytes, int]]:
    return [
        (bytes(e["args"]["sessionHash"]), bytes(e["args"]["agentHash"]), int(e["args"]["expiresAt"]))
        for e in events
        if e["kind"] == "SessionGranted"
    ]


# ----------------------------------------------------------------------------- kill -9

_WORKER = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from eth_account import Account
from gateway.anchor.evm import EvmBackend, EvmSettings, load_private_key
from gateway.ledger.anchorer import Anchorer, AnchorPolicy

async def main():
    b = EvmBackend(EvmSettings(rpc_url={url!r}, contract={contract!r}, chain_id=31337, confirmations=1,
                               rpc_attempts=1), load_private_key(Path({key!r})))
    a = Anchorer(Path({db!r}), b, policy=AnchorPolicy(poll_seconds=0.05))
    for _ in range(20):
        await a.step()
        await asyncio.sleep(0.05)
    await a.stop()
    await b.close()
    print("no fault fired")
asyncio.run(main())
"""


@pytest.mark.parametrize("point", ["anchor.facts_derived", "anchor.facts_bound", "anchor.sent"])
async def test_a_kill_9_between_the_audit_event_and_the_send_neither_loses_nor_doubles(
    tmp_path: Path, chain: Chain, point: str
) -> None:
    db = tmp_path / "audit.db"
    log = _log(db)
    _append(log, [_grant_body(), *_reads(3, 0)])
    arm = tmp_path / "arm"
    arm.write_text("1")
    script = _WORKER.format(
        tests=str(REPO / "tests"), url=chain.anvil.url, contract=chain.contract, key=str(chain.key_file), db=str(db)
    )
    env = {**os.environ, "UOMP_FAULT": point, "UOMP_FAULT_ARM": str(arm)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not arm.exists()
    sent = point == "anchor.sent"
    assert len(_grants_on_chain(await chain.events())) == (1 if sent else 0)
    # a second checkpoint arrives meanwhile: it must not carry the fact again
    _append(log, _reads(2, 10))
    backend = chain.backend()
    anchorer = Anchorer(db, backend, policy=POLICY)
    try:
        await _until_confirmed(anchorer, chain, log)
        for _ in range(3):
            await anchorer.step(now=chain.tick())
            chain.anvil.mine(1)
    finally:
        await anchorer.stop()
        await backend.close()
    events = await chain.events()
    assert _grants_on_chain(events) == [_expected_grant()]  # exactly one, with the right hashes
    assert [f[1] for f in _facts(log)] == ["SessionGranted"]
    assert check_facts(log.conn, events) == []


# ----------------------------------------------------------------------------- a lying node


@pytest.mark.parametrize("lie", ["receipt_no_logs", "logs_other_contract", "receipt_to_other", "other_code"])
async def test_a_lying_node_never_confirms_a_fact(tmp_path: Path, chain: Chain, lie: str) -> None:
    log = _log(tmp_path / "audit.db")
    size = _append(log, [_grant_body(), *_reads(2, 0)])
    lying = LyingRpc(chain.anvil.url)
    await lying.start()
    lying.lies = {lie}
    backend = chain.backend(lying.url)
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    try:
        seen: set[str] = set()
        for _ in range(12):
            await anchorer.step(now=chain.tick())
            chain.anvil.mine(1)
            seen |= {str(f[3]) for f in _facts(log)}
        assert "confirmed" not in seen and "rejected" in seen, seen
        assert _facts(log)[0][2] == size  # bound to its checkpoint, which was not superseded
        b = backlog(log.conn)
        assert b["events"]["SessionGranted"] == {"rejected": 1}
        assert "§18.4.1 events: 0 on chain (checked), 0 pending, 1 REJECTED" in summary(b)
        # a newer checkpoint comes: the fact stays with the rejected one, and is not sent twice
        _append(log, _reads(2, 10))
        lying.lies = set()
        await _until_confirmed(anchorer, chain, log)
    finally:
        await anchorer.stop()
        await backend.close()
        await lying.close()
    events = await chain.events()
    assert _grants_on_chain(events) == [_expected_grant()]
    assert check_facts(log.conn, events) == []


async def test_verify_finds_an_event_on_chain_that_no_audit_event_holds(tmp_path: Path, chain: Chain) -> None:
    """uomp audit verify's event check: a doubled or made-up §18.4.1 event on chain is red; so is a
    confirmed fact the chain does not hold, and a stored fact that differs from its audit event."""
    from anchorkit import sample_anchor

    from gateway.cli.audit import _verify_anchors

    log = _log(tmp_path / "audit.db")
    _append(log, [_grant_body(), *_reads(2, 0)])
    backend = chain.backend()
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    try:
        await _until_confirmed(anchorer, chain, log)
    finally:
        await anchorer.stop()
        await backend.close()
    checked, problems = await _verify_anchors(log.conn, chain.backend())
    assert checked == 1 and problems == []
    # a proof bundle's verifier knows the checkpoint, not the facts: checkpoint_only checks the rest's kinds
    from gateway.anchor.base import Anchor, AnchorMismatch

    _size, ref, note = log.conn.execute(
        "SELECT a.size, a.ref, c.note FROM ledger_anchors a JOIN ledger_checkpoints c"
        " ON c.size = a.size WHERE a.state = 'confirmed'"
    ).fetchone()
    b = chain.backend()
    try:
        await b.verify(Anchor.for_checkpoint(note, checkpoint_only=True), ref)
        with pytest.raises(AnchorMismatch):
            await b.verify(Anchor.for_checkpoint(note), ref)  # the transaction carries a SessionGranted
    finally:
        await b.close()
    # the owner's key anchors something the log does not hold
    b = chain.backend()
    try:
        await b.submit(sample_anchor(7))
        chain.anvil.mine(1)
    finally:
        await b.close()
    _, problems = await _verify_anchors(log.conn, chain.backend())
    assert any("matches no audit event" in p for p in problems), problems
    # a stored fact edited (another agent hash): red against its audit event
    log.conn.execute("UPDATE ledger_anchor_events SET agent_hash = ?", (enc.agent_hash("other"),))
    _, problems = await _verify_anchors(log.conn, chain.backend())
    assert any("does not match its audit event" in p for p in problems), problems


# ----------------------------------------------------------------------------- the appliance


def _configure(paths: Paths, chain: Chain) -> None:
    before = paths.config_file.read_text() if paths.config_file.exists() else ""
    paths.config_file.write_text(
        before + "\n[anchor]\n"
        f'backend = "evm"\nrpc_url = "{chain.anvil.url}"\ncontract = "{chain.contract}"\n'
        f'chain_id = 31337\nkey_file = "{chain.key_file}"\nconfirmations = 1\npoll_seconds = 0.1\n'
    )


def _raw_chain_bytes(anvil: Anvil, contract: str) -> bytes:
    """Every log of the contract (topics and data) and every transaction's input, as bytes."""
    logs = anvil.rpc("eth_getLogs", {"address": contract, "fromBlock": "0x0", "toBlock": "latest"})
    out = bytearray()
    for entry in logs:
        for t in entry["topics"]:
            out += bytes.fromhex(t[2:])
        out += bytes.fromhex(entry["data"][2:])
        tx = anvil.rpc("eth_getTransactionByHash", entry["transactionHash"])
        out += bytes.fromhex(tx["input"][2:])
    return bytes(out)


async def test_the_appliance_anchors_each_fact_once_with_the_hashes_and_names_nothing(
    home: Paths, chain: Chain
) -> None:
    from guardkit import admin_headers, call, grant, running_guard, seed, unix_session

    from gateway.contract import VERIFIED_AGENT_HEADER
    from gateway.core import jose
    from gateway.core.deletion import sign_deletion_proof
    from gateway.core.tokens import iso, parse_iso

    _configure(home, chain)
    seed(home)
    identity = Ed25519PrivateKey.generate()
    ciphertext = os.urandom(300)
    async with running_guard(home) as guard, unix_session(home) as s:
        g = await grant(
            s,
            home,
            read={"tags": ["preference", "ui"]},
            create_extra={"identity_public_jwk": jose.public_jwk(identity.public_key())},
        )
        sid, token = g["session_id"], g["token"]
        status, item, _ = await call(
            s, "GET", "/v1/memory/preference.theme", token=token, headers={"X-UOMP-Agent-Id": AGENT}
        )
        assert status == 200 and item["value"] == "dark"
        digest = "sha256:" + hashlib.sha256(ciphertext).hexdigest()
        status, body, _ = await call(
            s,
            "POST",
            "/v1/payload/audit",
            headers={VERIFIED_AGENT_HEADER: AGENT},
            json_body={
                "action": "payload_uploaded",
                "session_id": sid,
                "agent_id": AGENT,
                "payload_id": "pay_" + "a" * 24,
                "hash": digest,
                "size": 300,
            },
        )
        assert status == 200, body
        memory_hash = "sha256:" + "ab" * 32
        proof = sign_deletion_proof(
            {
                "deletion_proof_id": "del_events_1",
                "session_id": sid,
                "agent_id": AGENT,
                "deleted_at": iso(time.time()),
                "memory_hash": memory_hash,
                "method": "process_termination",
            },
            identity,
        )
        status, body, _ = await call(
            s,
            "POST",
            f"/v1/sessions/{sid}/deletion-proof",
            token=token,
            headers={"X-UOMP-Agent-Id": AGENT},
            json_body=proof,
        )
        assert status == 200, body
        status, session, _ = await call(s, "GET", f"/v1/sessions/{sid}", headers=admin_headers(home))
        status, body, _ = await call(s, "POST", f"/v1/sessions/{sid}/revoke", headers=admin_headers(home), json_body={})
        assert status == 200, body
        conn = sqlite3.connect(home.audit_db, isolation_level=None)
        try:
            deadline = time.monotonic() + 30
            while True:
                b = (
                    backlog(conn)
                    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ledger_anchor_events'").fetchone()
                    else {"events": {}}
                )
                ev = b["events"]
                if len(ev) == 4 and all(v == {"confirmed": 1} for v in ev.values()):
                    break
                assert time.monotonic() < deadline, b
                await asyncio.sleep(0.2)
        finally:
            conn.close()
        del guard
    events = await chain.events()
    kinds = sorted(e["kind"] for e in events)
    assert kinds == sorted(["SessionGranted", "SessionRevoked", "PayloadAnchored", "DataDeletionProofSubmitted"])
    s_hash, a_hash = enc.session_hash(sid, AGENT, ["ui", "preference"]), enc.agent_hash(AGENT)
    by = {e["kind"]: e["args"] for e in events}
    expires = parse_iso(session["expires_at"])
    assert (by["SessionGranted"]["sessionHash"], by["SessionGranted"]["agentHash"]) == (s_hash, a_hash)
    assert abs(by["SessionGranted"]["expiresAt"] - expires) <= 1
    assert (by["SessionRevoked"]["sessionHash"], by["SessionRevoked"]["agentHash"]) == (s_hash, a_hash)
    assert by["PayloadAnchored"]["payloadHash"] == hashlib.sha256(ciphertext).digest()
    assert by["PayloadAnchored"]["sessionHash"] == s_hash
    assert by["DataDeletionProofSubmitted"]["deletionProofHash"] == enc.deletion_proof_hash(
        "del_events_1", sid, memory_hash
    )
    conn = sqlite3.connect(home.audit_db, isolation_level=None)
    try:
        assert check_facts(conn, events) == []
    finally:
        conn.close()
    # Nothing on chain names a key, a value, a token or an id, as text or as its bytes.
    raw = _raw_chain_bytes(chain.anvil, chain.contract)
    from guardkit import ITEMS

    needles = [
        token,
        sid,
        AGENT,
        "del_events_1",
        memory_hash,
        memory_hash[7:],
        "pay_" + "a" * 24,
        "/v1/memory",
        *[i.key for i in ITEMS],
        *[json.dumps(i.value) for i in ITEMS],
        "dark",
        "lockpicking",
        "Alice",
    ]
    for text in needles:
        assert text.encode() not in raw, text


async def test_a_checkpoint_stored_after_the_rounds_derivation_still_carries_its_facts(tmp_path: Path) -> None:
    """The grant and its checkpoint land between the round's derivation and the send: the facts
    the checkpoint covers are derived before its content is fixed (not left for a later one)."""
    from gateway.anchor.none import NoneBackend

    db = tmp_path / "audit.db"
    log = _log(db)
    anchorer = Anchorer(db, NoneBackend(), policy=POLICY)
    try:
        await anchorer.step(now=1.0)  # the round's derivation: nothing yet
        size = _append(log, [*_reads(2, 0), _grant_body()])
        await asyncio.to_thread(anchorer._bind_facts, size)
        assert _facts(log) == [(3, "SessionGranted", size, "queued")]
    finally:
        await anchorer.stop()


async def test_a_reorg_that_drops_a_fact_re_anchors_it_once(tmp_path: Path, chain: Chain) -> None:
    """A confirmed fact whose transaction the chain no longer holds goes back to the backlog with
    its checkpoint (not confirmed meanwhile) and is on chain exactly once afterwards."""
    log = _log(tmp_path / "audit.db")
    _append(log, [_grant_body(), *_reads(2, 0)])
    snapshot = chain.anvil.rpc("evm_snapshot")
    backend = chain.backend()
    anchorer = Anchorer(tmp_path / "audit.db", backend, policy=POLICY)
    try:
        await _until_confirmed(anchorer, chain, log)
        assert chain.anvil.rpc("evm_revert", snapshot) is True
        assert _grants_on_chain(await chain.events()) == []
        assert await anchorer.recheck(now=chain.tick()) == 1
        assert backlog(log.conn)["events"]["SessionGranted"] == {"queued": 1}  # with its checkpoint, not confirmed
        await _until_confirmed(anchorer, chain, log)
        for _ in range(3):
            await anchorer.step(now=chain.tick())
            chain.anvil.mine(1)
    finally:
        await anchorer.stop()
        await backend.close()
    events = await chain.events()
    assert _grants_on_chain(events) == [_expected_grant()]
    assert check_facts(log.conn, events) == []


async def test_a_failed_anchor_gives_its_facts_to_the_next_checkpoint(tmp_path: Path, chain: Chain) -> None:
    """Not the owner: the chain refuses the anchor (failed, nothing on chain); its facts are not
    lost with it but go, once, with the next checkpoint."""
    from eth_account import Account

    from gateway.anchor.evm import EvmBackend, EvmSettings

    db = tmp_path / "audit.db"
    log = _log(db)
    first = _append(log, [_grant_body(), *_reads(1, 0)])
    stranger = Account.create()
    chain.anvil.fund(stranger.address)
    wrong = EvmBackend(
        EvmSettings(rpc_url=chain.anvil.url, contract=chain.contract, chain_id=31337, confirmations=1, rpc_attempts=1),
        stranger,
    )
    anchorer = Anchorer(db, wrong, policy=POLICY)
    try:
        await anchorer.step(now=chain.tick())
    finally:
        await anchorer.stop()
        await wrong.close()
    assert log.conn.execute("SELECT state FROM ledger_anchors WHERE size = ?", (first,)).fetchone() == ("failed",)
    assert _facts(log) == [(1, "SessionGranted", None, None)]  # given back, not lost
    second = _append(log, _reads(1, 5))
    backend = chain.backend()
    anchorer = Anchorer(db, backend, policy=POLICY)
    try:
        await _until_confirmed(anchorer, chain, log)
    finally:
        await anchorer.stop()
        await backend.close()
    assert _facts(log) == [(1, "SessionGranted", second, "confirmed")]
    assert _grants_on_chain(await chain.events()) == [_expected_grant()]
