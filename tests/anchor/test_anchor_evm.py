"""The evm backend against a real local chain (anvil on 127.0.0.1, a free port per test).

anvil mines a block per transaction, so a fresh anchor has exactly 1 confirmation; the tests mine
more blocks (``anvil_mine``) to reach the configured depth.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from anchorkit import ANVIL, ANVIL_MISSING, ROOT, Anvil, closed_port, included, sample_anchor
from eth_account import Account
from eth_account.signers.local import LocalAccount

from gateway.anchor.base import (
    Anchor,
    AnchorMismatch,
    AnchorRejected,
    AnchorUnavailable,
    GatewayAccess,
    SessionGranted,
    Submitted,
)
from gateway.anchor.evm import EvmBackend, EvmSettings, artifact, deploy, load_private_key, write_private_key

pytestmark = pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)

FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "rpc_attempts": 3, "rpc_timeout_s": 10.0}


@pytest.fixture
def anvil(tmp_path: Path) -> Iterator[Anvil]:
    node = Anvil(tmp_path)
    node.start()
    yield node
    node.stop()


@pytest.fixture
def owner(anvil: Anvil) -> LocalAccount:
    acct: LocalAccount = Account.create()
    anvil.fund(acct.address)
    return acct


@pytest.fixture
async def backend(anvil: Anvil, owner: LocalAccount) -> AsyncIterator[EvmBackend]:
    address = await deploy(anvil.url, owner)
    b = EvmBackend(EvmSettings(rpc_url=anvil.url, contract=address, chain_id=31337, confirmations=2, **FAST), owner)
    yield b
    await b.close()


async def submit_mined(b: EvmBackend, anchor: Anchor) -> Submitted:
    sub = await b.submit(anchor)
    await included(b, sub)
    return sub


def reader(b: EvmBackend, **changes: object) -> EvmBackend:
    """A read-only backend on the same chain and contract (what a verifier holds)."""
    settings = dataclasses.replace(b.settings, **changes)  # type: ignore[arg-type]
    return EvmBackend(settings)


async def test_anchor_is_final_after_confirmations_and_verifies(backend: EvmBackend, anvil: Anvil) -> None:
    anchor = sample_anchor(1)
    sub = await submit_mined(backend, anchor)
    assert sub.backend == "evm" and sub.anchor_id == anchor.checkpoint_hash and not sub.found_on_chain
    st = await backend.status(sub)
    assert (st.state, st.confirmations, st.final) == ("confirmed", 1, False)
    with pytest.raises(AnchorUnavailable, match="not final yet"):
        await backend.verify(anchor, sub.ref)
    anvil.mine(1)
    st = await backend.status(sub)
    assert (st.state, st.confirmations, st.final) == ("confirmed", 2, True)
    await backend.verify(anchor, sub.ref)
    assert await backend.find(anchor) == sub.ref
    # a verifier that holds only the chain id, contract address and RPC URL agrees
    other = reader(backend)
    try:
        await other.verify(anchor, sub.ref)
    finally:
        await other.close()


async def test_checkpoint_only_anchor(backend: EvmBackend, anvil: Anvil) -> None:
    anchor = sample_anchor(2, events=False)
    sub = await submit_mined(backend, anchor)
    anvil.mine(1)
    await backend.verify(anchor, sub.ref)


def _tamper(anchor: Anchor, case: str) -> Anchor:
    r = dataclasses.replace
    flip = bytes([anchor.root[0] ^ 1]) + anchor.root[1:]
    if case == "root":
        return r(anchor, root=flip)
    if case == "tree_size":
        return r(anchor, tree_size=anchor.tree_size + 1)
    if case == "checkpoint_hash":
        return r(anchor, checkpoint_hash=flip)
    if case == "granted_expiry":
        g = anchor.granted[0]
        return r(anchor, granted=(SessionGranted(g.session_hash, g.agent_hash, g.expires_at + 1),))
    if case == "access_allowed_flipped":
        a = anchor.access[0]
        return r(
            anchor,
            access=(GatewayAccess(a.session_hash, a.agent_hash, a.endpoint_hash, not a.allowed), *anchor.access[1:]),
        )
    if case == "access_reordered":
        return r(anchor, access=tuple(reversed(anchor.access)))
    if case == "event_dropped":
        return r(anchor, revoked=())
    if case == "event_added":
        return r(anchor, revoked=anchor.revoked * 2)
    if case == "deletion_hash":
        d = anchor.deletions[0]
        return r(anchor, deletions=(dataclasses.replace(d, deletion_proof_hash=flip),))
    raise AssertionError(case)


TAMPER = [
    "root",
    "tree_size",
    "checkpoint_hash",
    "granted_expiry",
    "access_allowed_flipped",
    "access_reordered",
    "event_dropped",
    "event_added",
    "deletion_hash",
]


async def test_tampered_anchor_fails_verify(backend: EvmBackend, anvil: Anvil) -> None:
    anchor = sample_anchor(3)
    sub = await submit_mined(backend, anchor)
    anvil.mine(1)
    await backend.verify(anchor, sub.ref)
    for case in TAMPER:  # one chain, one transaction, every forgery refused
        with pytest.raises(AnchorMismatch) as info:
            await backend.verify(_tamper(anchor, case), sub.ref)
        assert info.value.code == "ANCHOR_MISMATCH" and not info.value.retryable, case


@pytest.mark.parametrize("case", ["unknown_tx", "other_anchors_tx", "malformed", "no_0x", "short"])
async def test_wrong_reference_fails_verify(backend: EvmBackend, anvil: Anvil, case: str) -> None:
    anchor, other = sample_anchor(4), sample_anchor(5)
    sub = await submit_mined(backend, anchor)
    sub_other = await submit_mined(backend, other)
    anvil.mine(2)
    ref = {
        "unknown_tx": "0x" + "ab" * 32,
        "other_anchors_tx": sub_other.ref,
        "malformed": "0x" + "zz" * 32,
        "no_0x": sub.ref[2:],
        "short": sub.ref[:-2],
    }[case]
    with pytest.raises(AnchorMismatch):
        await backend.verify(anchor, ref)


async def test_verify_refuses_a_contract_that_is_not_ours(
    backend: EvmBackend, anvil: Anvil, owner: LocalAccount
) -> None:
    anchor = sample_anchor(6)
    sub = await submit_mined(backend, anchor)
    anvil.mine(1)
    impostor = reader(backend, contract=owner.address)  # an address without our code
    try:
        with pytest.raises(AnchorMismatch, match="no contract code at"):
            await impostor.verify(anchor, sub.ref)
    finally:
        await impostor.close()
    other_code = reader(backend, code_hash="0x" + "22" * 32)  # our code, but not the code hash we were given
    try:
        with pytest.raises(AnchorMismatch, match="code hash differs"):
            await other_code.verify(anchor, sub.ref)
        with pytest.raises(AnchorMismatch, match="code hash differs"):
            await other_code.check_contract()
    finally:
        await other_code.close()


async def test_verify_refuses_another_chain(backend: EvmBackend, anvil: Anvil) -> None:
    anchor = sample_anchor(7)
    sub = await submit_mined(backend, anchor)
    anvil.mine(1)
    wrong = reader(backend, chain_id=1)
    try:
        with pytest.raises(AnchorRejected, match="chain 31337"):
            await wrong.verify(anchor, sub.ref)
    finally:
        await wrong.close()


async def test_resubmission_finds_the_anchor_instead_of_sending_again(
    backend: EvmBackend, anvil: Anvil, owner: LocalAccount
) -> None:
    anchor = sample_anchor(8)
    first = await submit_mined(backend, anchor)
    again = await backend.submit(anchor)
    assert again.ref == first.ref and again.found_on_chain
    # a "restarted" process (new backend, empty memory) finds it on chain too, sending nothing
    nonce_before = int(anvil.rpc("eth_getTransactionCount", owner.address, "pending"), 16)
    fresh = EvmBackend(backend.settings, owner)
    try:
        found = await fresh.submit(anchor)
    finally:
        await fresh.close()
    assert found.ref == first.ref and found.found_on_chain
    assert int(anvil.rpc("eth_getTransactionCount", owner.address, "pending"), 16) == nonce_before


async def test_only_the_owner_may_anchor(backend: EvmBackend, anvil: Anvil) -> None:
    stranger: LocalAccount = Account.create()
    anvil.fund(stranger.address)
    other = EvmBackend(backend.settings, stranger)
    try:
        with pytest.raises(AnchorRejected, match="not the contract's owner") as info:
            await other.submit(sample_anchor(9))
        assert not info.value.retryable
    finally:
        await other.close()


async def test_fee_cap(backend: EvmBackend, anvil: Anvil, owner: LocalAccount) -> None:
    base = int(anvil.rpc("eth_getBlockByNumber", "latest", False)["baseFeePerGas"], 16)
    tip = int(anvil.rpc("eth_maxPriorityFeePerGas"), 16)
    low = EvmBackend(dataclasses.replace(backend.settings, max_fee_per_gas_wei=base + tip - 1), owner)
    try:
        with pytest.raises(AnchorUnavailable, match="above the configured cap") as info:
            await low.submit(sample_anchor(20))
        assert info.value.retryable
    finally:
        await low.close()
    capped = EvmBackend(dataclasses.replace(backend.settings, max_fee_per_gas_wei=base + tip), owner)
    try:
        sub = await submit_mined(capped, sample_anchor(21))
        tx = anvil.rpc("eth_getTransactionByHash", sub.ref)
        assert int(tx["maxFeePerGas"], 16) == base + tip
    finally:
        await capped.close()


async def test_unfunded_account_is_a_clear_refusal(anvil: Anvil) -> None:
    with pytest.raises(AnchorRejected, match="insufficient funds"):
        await deploy(anvil.url, Account.create())


async def test_read_only_backend_cannot_submit(backend: EvmBackend) -> None:
    ro = reader(backend)
    try:
        with pytest.raises(AnchorRejected, match="read-only"):
            await ro.submit(sample_anchor(10))
    finally:
        await ro.close()


async def test_pending_dropped_and_resubmitted_with_the_same_bytes(
    backend: EvmBackend, anvil: Anvil, owner: LocalAccount
) -> None:
    anvil.rpc("evm_setAutomine", False)
    anchor = sample_anchor(16)
    sub = await backend.submit(anchor)
    assert (await backend.status(sub)).state == "pending"
    assert (await backend.submit(anchor)).ref == sub.ref  # still pending: nothing new is sent
    anvil.rpc("anvil_dropTransaction", sub.ref)
    assert (await backend.status(sub)).state == "dropped"
    again = await backend.submit(anchor)  # re-broadcasts the signed bytes: same hash, same nonce
    assert (again.ref, again.nonce) == (sub.ref, sub.nonce)
    assert (await backend.status(sub)).state == "pending"
    anvil.mine(2)
    assert (await backend.status(sub)).final
    await backend.verify(anchor, sub.ref)


async def test_a_transaction_the_node_lost_leaves_no_nonce_gap(backend: EvmBackend, anvil: Anvil) -> None:
    """The node forgets a pending anchor (restart, eviction); the next anchor must take its nonce,
    not the one after it, or it would wait forever behind a hole."""
    anvil.rpc("evm_setAutomine", False)
    lost = await backend.submit(sample_anchor(17))
    anvil.rpc("anvil_dropTransaction", lost.ref)
    anchor = sample_anchor(18)
    sub = await backend.submit(anchor)
    assert sub.nonce == lost.nonce
    anvil.mine(2)
    assert (await backend.status(sub)).final
    await backend.verify(anchor, sub.ref)


async def test_status_of_an_unknown_transaction_is_dropped(backend: EvmBackend) -> None:
    st = await backend.status(Submitted("evm", b"\x00" * 32, "0x" + "cd" * 32))
    assert st.state == "dropped"


async def test_rpc_down_is_retryable_and_the_same_anchor_goes_through_after(
    backend: EvmBackend, anvil: Anvil, owner: LocalAccount
) -> None:
    """anvil is stopped (its --state file keeps the chain: contract, balances, nonces), then
    started again on the same port; the backend object lives through it, as the appliance would."""
    anchor = sample_anchor(11)
    await submit_mined(backend, sample_anchor(12))  # the backend talked to the node before the outage
    anvil.stop()
    with pytest.raises(AnchorUnavailable) as info:
        await backend.submit(anchor)
    err = info.value
    assert err.retryable and err.code == "ANCHOR_UNAVAILABLE" and err.status == 503
    assert f"127.0.0.1:{anvil.port}" in str(err) and "after 3 attempts" in str(err)
    assert bytes(owner.key).hex() not in str(err) and bytes(owner.key).hex() not in repr(err.__cause__)
    with pytest.raises(AnchorUnavailable):
        await backend.find(anchor)
    anvil.start()
    sub = await submit_mined(backend, anchor)
    assert not sub.found_on_chain
    anvil.mine(1)
    assert (await backend.status(sub)).final
    await backend.verify(anchor, sub.ref)


async def test_transient_http_errors_are_retried_with_backoff(
    backend: EvmBackend, anvil: Anvil, owner: LocalAccount
) -> None:
    """A proxy in front of anvil answers every fourth request 503 (or drops the connection):
    each RPC call is retried and the anchor goes through, verified, with no error surfacing."""
    import aiohttp
    from aiohttp import web

    seen = {"n": 0, "failed": 0}

    async def forward(request: web.Request) -> web.StreamResponse:
        seen["n"] += 1
        if seen["n"] % 4 == 0:
            seen["failed"] += 1
            if seen["n"] % 8 == 0:
                assert request.transport is not None
                request.transport.close()  # connection reset mid-request
                return web.Response()
            return web.Response(status=503, text="busy")
        body = await request.read()
        async with (
            aiohttp.ClientSession() as s,
            s.post(anvil.url, data=body, headers={"content-type": "application/json"}) as r,
        ):
            return web.Response(body=await r.read(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    flaky = EvmBackend(dataclasses.replace(backend.settings, rpc_url=f"http://127.0.0.1:{port}/"), owner)
    try:
        anchor = sample_anchor(15)
        sub = await submit_mined(flaky, anchor)
        anvil.mine(1)
        await flaky.verify(anchor, sub.ref)
    finally:
        await flaky.close()
        await runner.cleanup()
    assert seen["failed"] >= 3


def _hostile(case: str, method: str, answer: dict[str, Any]) -> dict[str, Any] | str:
    """How a broken or hostile node rewrites anvil's answer."""
    result = answer.get("result")
    if case == "receipt-missing-fields" and method == "eth_getTransactionReceipt" and result:
        return {**answer, "result": {"status": "0x1"}}
    if case == "log-data-truncated" and method == "eth_getTransactionReceipt" and result:
        logs = [dict(log) for log in result["logs"]]
        logs[-1]["data"] = logs[-1]["data"][:40]
        return {**answer, "result": {**result, "logs": logs}}
    if case == "block-number-not-hex" and method == "eth_blockNumber":
        return {**answer, "result": "banana"}
    if case == "html-instead-of-json" and method == "eth_getLogs":
        return "<html>gateway timeout</html>"
    return answer


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("receipt-missing-fields", AnchorUnavailable),
        ("log-data-truncated", AnchorMismatch),
        ("block-number-not-hex", AnchorUnavailable),
        ("html-instead-of-json", AnchorUnavailable),
    ],
)
async def test_a_malformed_node_answer_is_a_clear_error(
    backend: EvmBackend, anvil: Anvil, owner: LocalAccount, case: str, error: type[Exception]
) -> None:
    import aiohttp
    from aiohttp import web

    anchor = sample_anchor(19)
    sub = await submit_mined(backend, anchor)
    anvil.mine(1)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with (
            aiohttp.ClientSession() as s,
            s.post(anvil.url, data=body, headers={"content-type": "application/json"}) as r,
        ):
            answer = json.loads(await r.read())
        out = _hostile(case, json.loads(body)["method"], answer)
        if isinstance(out, str):
            return web.Response(text=out, content_type="text/html")
        return web.json_response(out)

    app = web.Application()
    app.router.add_post("/", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    hostile = EvmBackend(dataclasses.replace(backend.settings, rpc_url=f"http://127.0.0.1:{port}/"), owner)
    try:
        with pytest.raises(error) as info:
            await hostile.verify(anchor, sub.ref)
        assert info.value.code in ("ANCHOR_UNAVAILABLE", "ANCHOR_MISMATCH")  # type: ignore[attr-defined]
    finally:
        await hostile.close()
        await runner.cleanup()


async def test_closed_port_is_retryable(owner: LocalAccount) -> None:
    b = EvmBackend(
        EvmSettings(rpc_url=f"http://127.0.0.1:{closed_port()}/secret-api-key", contract="0x" + "11" * 20, **FAST),
        owner,
    )
    try:
        with pytest.raises(AnchorUnavailable) as info:
            await b.submit(sample_anchor(13))
        assert "secret-api-key" not in str(info.value)
        assert "secret-api-key" not in json.dumps(b.describe())
    finally:
        await b.close()


async def test_describe_names_chain_contract_account_never_the_key(backend: EvmBackend, owner: LocalAccount) -> None:
    await backend.chain_id()
    d = backend.describe()
    assert d["backend"] == "evm" and d["chain_id"] == 31337 and d["account"] == owner.address
    assert d["contract"] == backend.settings.contract
    text = json.dumps(d)
    assert bytes(owner.key).hex() not in text
    report = await backend.report()
    assert report["contract_matches_artifact"] and report["account_is_owner"] and report["balance_wei"] > 0


async def test_nothing_on_chain_names_an_id_key_or_path(backend: EvmBackend, anvil: Anvil) -> None:
    anchor = sample_anchor(14)
    sub = await backend.submit(anchor)
    tx = anvil.rpc("eth_getTransactionByHash", sub.ref)
    receipt = anvil.rpc("eth_getTransactionReceipt", sub.ref)
    blob = (tx["input"] + json.dumps(receipt)).lower()
    for plain in [b"calendar_agent", b"sess_14", b"/v1/memory", b"preference", b"ciphertext bytes", b"del_1"]:
        assert plain.hex() not in blob, plain


def test_key_file_must_be_private(tmp_path: Path) -> None:
    acct: LocalAccount = Account.create()
    path = tmp_path / "anchor.key"
    write_private_key(path, acct)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_private_key(path).address == acct.address
    path.chmod(0o640)
    with pytest.raises(AnchorRejected, match="chmod 600") as info:
        load_private_key(path)
    assert bytes(acct.key).hex() not in str(info.value)
    path.chmod(0o600)
    path.write_text("not a key\n")
    with pytest.raises(AnchorRejected, match="does not hold"):
        load_private_key(path)
    with pytest.raises(AnchorRejected, match="already exists"):
        write_private_key(path, acct)


@pytest.mark.skipif(shutil.which("node") is None, reason="node not found: cannot recompile the contract")
def test_committed_artifact_is_what_the_pinned_solc_builds() -> None:
    tools = ROOT / "anchor-tools"
    if not (tools / "node_modules" / "solc" / "package.json").exists():
        pytest.skip("solc-js not installed (run scripts/setup-anvil.sh)")
    out = subprocess.run(
        ["node", "build-contract.mjs", "../contracts/UompAnchor.sol"],
        cwd=tools,
        capture_output=True,
        check=True,
        timeout=300,
    ).stdout
    assert out == (ROOT / "gateway" / "anchor" / "UompAnchor.json").read_bytes()
    assert artifact()["compiler"]["version"].startswith(
        json.loads((tools / "package.json").read_text())["dependencies"]["solc"] + "+"
    )
