"""The starknet backend against a local stand-in JSON-RPC server (tests/starknet_standin.py).

No Starknet node installs here: these tests check the hashing, signing, request shapes and the
backend's logic; they have never been run against a real Starknet node.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from anchorkit import closed_port, sample_anchor
from starknet_py.hash.utils import verify_message_signature
from starknet_py.net.models import StarknetChainId
from starknet_py.net.signer.stark_curve_signer import KeyPair
from starknet_standin import StandIn, StandInServer, invoke_v3_hash

from gateway.anchor.base import AnchorMismatch, AnchorRejected, AnchorUnavailable, Submitted
from gateway.anchor.starknet import (
    StarknetBackend,
    StarknetSettings,
    anchor_calldata,
    expected_events,
    load_stark_key,
)

CHAIN = int(StarknetChainId.SEPOLIA)
ACCOUNT = 0x0123456789ABCDEF0123456789ABCDEF0123456789ABCDEF0123456789ABCDE
CONTRACT = 0x04A0C0FFEE00000000000000000000000000000000000000000000000000CAFE
FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "rpc_attempts": 3}
KEY = KeyPair.from_private_key(0x5EC2E7_0000_0000_0000_0000_0000_0000_0000_0000_0000_0001)


@pytest.fixture
async def chain() -> AsyncIterator[StandInServer]:
    server = StandInServer(
        StandIn(chain_id=CHAIN, account=ACCOUNT, public_key=KEY.public_key, contract=CONTRACT, owner=ACCOUNT)
    )
    await server.start()
    yield server
    await server.stop()


def settings(url: str, **changes: object) -> StarknetSettings:
    base = StarknetSettings(rpc_url=url, account=ACCOUNT, contract=CONTRACT, chain_id=CHAIN, confirmations=2, **FAST)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.fixture
async def backend(chain: StandInServer) -> AsyncIterator[StarknetBackend]:
    b = StarknetBackend(settings(chain.url), KEY)
    yield b
    await b.close()


def test_offline_signing_matches_the_specified_hash_and_key() -> None:
    """No server at all: the hash starknet-py computes equals SNIP-8 recomputed from the JSON, and
    the signature verifies under the account's public key."""
    from starknet_py.net.full_node_client import _create_broadcasted_txn

    b = StarknetBackend(settings(f"http://127.0.0.1:{closed_port()}/rpc"), KEY)
    anchor = sample_anchor(1)
    tx = b.build_invoke(anchor, nonce=7)
    wire = _create_broadcasted_txn(tx)
    h = invoke_v3_hash(wire, CHAIN)
    assert h == b.tx_hash(tx)
    assert verify_message_signature(h, list(tx.signature), KEY.public_key)
    other = KeyPair.from_private_key(0x1234)
    assert not verify_message_signature(h, list(tx.signature), other.public_key)
    # the calldata is __execute__([anchor call]) and round-trips through the stand-in's decoder
    assert tx.calldata[:3] == [1, CONTRACT, tx.calldata[2]] and tx.calldata[3] == len(tx.calldata) - 4
    node = StandIn(chain_id=CHAIN, account=ACCOUNT, public_key=KEY.public_key, contract=CONTRACT, owner=ACCOUNT)
    decoded = node.decode_anchor(anchor_calldata(anchor))
    root, size, cp = decoded[0][1]
    assert (root.to_bytes(32, "big"), size, cp.to_bytes(32, "big")) == (
        anchor.root,
        anchor.tree_size,
        anchor.checkpoint_hash,
    )
    assert decoded[1:] == expected_events(anchor)[:-1]


async def test_submit_confirm_verify(backend: StarknetBackend, chain: StandInServer) -> None:
    anchor = sample_anchor(2)
    sub = await backend.submit(anchor)
    assert sub.backend == "starknet" and sub.anchor_id == anchor.checkpoint_hash and sub.nonce == 0
    assert len(chain.node.received) == 1
    st = await backend.status(sub)
    assert (st.state, st.confirmations, st.final) == ("confirmed", 1, False)
    with pytest.raises(AnchorUnavailable, match="not final yet"):
        await backend.verify(anchor, sub.ref)
    chain.node.mine(1)
    st = await backend.status(sub)
    assert (st.state, st.confirmations, st.final) == ("confirmed", 2, True)
    await backend.verify(anchor, sub.ref)
    assert await backend.find(anchor) == sub.ref
    reader = StarknetBackend(backend.settings)  # no key: verify only
    try:
        await reader.verify(anchor, sub.ref)
    finally:
        await reader.close()


async def test_accepted_on_l1_is_final_at_any_depth(backend: StarknetBackend, chain: StandInServer) -> None:
    sub = await backend.submit(sample_anchor(3))
    chain.node.l1_accepted_upto = chain.node.head
    assert (await backend.status(sub)).final


async def test_pending_then_confirmed_and_dropped(backend: StarknetBackend, chain: StandInServer) -> None:
    chain.node.auto_mine = False
    sub = await backend.submit(sample_anchor(4))
    assert (await backend.status(sub)).state == "pending"
    chain.node.mine(2)
    assert (await backend.status(sub)).final
    assert (await backend.status(Submitted("starknet", b"\x00" * 32, "0x1234"))).state == "dropped"


async def test_nonces_follow_pooled_transactions_but_never_leave_a_gap(
    backend: StarknetBackend, chain: StandInServer
) -> None:
    chain.node.auto_mine = False
    first = await backend.submit(sample_anchor(12))
    second = await backend.submit(sample_anchor(13))  # the first is still pooled: the next nonce
    assert (first.nonce, second.nonce) == (0, 1)
    chain.node.drop(int(second.ref, 16))  # the node loses the newest one
    third = await backend.submit(sample_anchor(14))
    assert third.nonce == 1  # takes the lost one's nonce, no gap
    chain.node.mine(2)
    assert (await backend.status(first)).final and (await backend.status(third)).final
    assert (await backend.status(second)).state == "dropped"


TAMPER = ["root", "tree_size", "checkpoint_hash", "event_dropped", "access_flipped"]


async def test_tampered_anchor_fails_verify(backend: StarknetBackend, chain: StandInServer) -> None:
    anchor = sample_anchor(5)
    sub = await backend.submit(anchor)
    chain.node.mine(1)
    await backend.verify(anchor, sub.ref)
    flip = bytes([anchor.root[0] ^ 1]) + anchor.root[1:]
    a0 = anchor.access[0]
    forged = {
        "root": dataclasses.replace(anchor, root=flip),
        "tree_size": dataclasses.replace(anchor, tree_size=anchor.tree_size - 1),
        "checkpoint_hash": dataclasses.replace(anchor, checkpoint_hash=flip),
        "event_dropped": dataclasses.replace(anchor, granted=()),
        "access_flipped": dataclasses.replace(
            anchor, access=(dataclasses.replace(a0, allowed=not a0.allowed), *anchor.access[1:])
        ),
    }
    for case in TAMPER:
        with pytest.raises(AnchorMismatch):
            await backend.verify(forged[case], sub.ref)
    for ref in ("0x" + "ab" * 31, "1234", "0xzz"):
        with pytest.raises(AnchorMismatch):
            await backend.verify(anchor, ref)


async def test_a_node_that_pages_forever_is_refused(backend: StarknetBackend, chain: StandInServer) -> None:
    anchor = sample_anchor(11)
    sub = await backend.submit(anchor)
    chain.node.mine(1)
    chain.node.endless_paging = True
    with pytest.raises(AnchorUnavailable, match="kept paging"):
        await backend.verify(anchor, sub.ref)
    assert chain.node.calls.count("starknet_getEvents") <= backend.settings.events_max_pages + 2


@pytest.mark.parametrize("garble", ["receipt", "events", "call"])
async def test_a_malformed_node_answer_is_a_clear_error(
    backend: StarknetBackend, chain: StandInServer, garble: str
) -> None:
    anchor = sample_anchor(15)
    sub = await backend.submit(anchor)
    chain.node.mine(1)
    chain.node.garble = garble
    with pytest.raises(AnchorUnavailable, match=r"unusable answer|unexpected shape"):
        await backend.verify(anchor, sub.ref)


async def test_resubmission_is_found_not_resent(backend: StarknetBackend, chain: StandInServer) -> None:
    anchor = sample_anchor(6)
    first = await backend.submit(anchor)
    fresh = StarknetBackend(backend.settings, KEY)  # a restarted process
    try:
        again = await fresh.submit(anchor)
    finally:
        await fresh.close()
    assert again.ref == first.ref and again.found_on_chain
    assert len(chain.node.received) == 1 and chain.node.nonce == 1


async def test_a_wrong_key_is_refused_by_the_account(chain: StandInServer) -> None:
    b = StarknetBackend(settings(chain.url), KeyPair.from_private_key(0x777))
    try:
        with pytest.raises(AnchorRejected, match="refused the signature"):
            await b.submit(sample_anchor(7))
    finally:
        await b.close()
    assert chain.node.received == []


async def test_not_the_owner_reverts_and_never_verifies(chain: StandInServer, backend: StarknetBackend) -> None:
    chain.node.owner = 0x999
    anchor = sample_anchor(8)
    sub = await backend.submit(anchor)
    chain.node.mine(1)
    assert (await backend.status(sub)).state == "failed"
    with pytest.raises(AnchorMismatch, match="did not succeed"):
        await backend.verify(anchor, sub.ref)


async def test_wrong_chain_is_refused(chain: StandInServer) -> None:
    b = StarknetBackend(settings(chain.url, chain_id=int(StarknetChainId.MAINNET)), KEY)
    try:
        with pytest.raises(AnchorRejected, match="configured chain"):
            await b.submit(sample_anchor(9))
    finally:
        await b.close()


async def test_rpc_down_is_retryable_then_goes_through(backend: StarknetBackend, chain: StandInServer) -> None:
    anchor = sample_anchor(10)
    await chain.stop()
    with pytest.raises(AnchorUnavailable) as info:
        await backend.submit(anchor)
    assert info.value.retryable and "after 3 attempts" in str(info.value)
    await chain.start()  # same port, same state
    sub = await backend.submit(anchor)
    chain.node.mine(1)
    await backend.verify(anchor, sub.ref)


async def test_describe_says_what_it_was_tested_against(backend: StarknetBackend) -> None:
    d = backend.describe()
    assert d["backend"] == "starknet" and "stand-in" in d["tested_against"]
    assert hex(KEY.private_key)[2:] not in json.dumps(d)


def test_stark_key_file(tmp_path: Path) -> None:
    path = tmp_path / "stark.key"
    path.write_text(hex(KEY.private_key) + "\n")
    path.chmod(0o600)
    assert load_stark_key(path).public_key == KEY.public_key
    path.chmod(0o644)
    with pytest.raises(AnchorRejected, match="chmod 600"):
        load_stark_key(path)
    path.chmod(0o600)
    path.write_text("0x0\n")
    with pytest.raises(AnchorRejected, match="does not hold"):
        load_stark_key(path)
