"""The plain functions behind `uomp anchor deploy|status` (gateway/anchor/ops.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from anchorkit import ANVIL, ANVIL_MISSING, Anvil, included, sample_anchor
from eth_account import Account
from eth_account.signers.local import LocalAccount

from gateway.anchor.base import AnchorRejected
from gateway.anchor.evm import EvmBackend, write_private_key
from gateway.anchor.none import NoneBackend
from gateway.anchor.ops import anchor_deploy, anchor_status, make_backend
from gateway.anchor.starknet import StarknetBackend


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "bitcoin"}, "unknown anchor backend"),
        ({"kind": "evm"}, "needs an RPC URL"),
        ({"kind": "starknet", "rpc_url": "http://127.0.0.1:1"}, "needs a contract, an account and a chain id"),
        (
            {"kind": "starknet", "rpc_url": "http://127.0.0.1:1", "contract": "0xzz", "account": "0x1", "chain_id": 1},
            "not a 0x-hex felt",
        ),
        (
            {"kind": "starknet", "rpc_url": "http://127.0.0.1:1", "contract": "0x0", "account": "0x1", "chain_id": 1},
            "must be a non-zero felt",
        ),
        ({"kind": "evm", "rpc_url": "http://127.0.0.1:1", "contract": "0x1234"}, "not an EVM address"),
        ({"kind": "evm", "rpc_url": "http://127.0.0.1:1", "key_file": Path("/nonexistent/k")}, "cannot read"),
        ({"kind": "evm", "rpc_url": "127.0.0.1:8545"}, "http:// or https://"),
        ({"kind": "evm", "rpc_url": "ftp://127.0.0.1/"}, "http:// or https://"),
        ({"kind": "evm", "rpc_url": "http://127.0.0.1:99999/secret"}, "http:// or https://"),
        (
            {"kind": "starknet", "rpc_url": "http:///nohost", "contract": "0x1", "account": "0x1", "chain_id": 1},
            "http:// or https://",
        ),
    ],
    ids=[
        "unknown-kind",
        "evm-no-rpc",
        "starknet-missing",
        "starknet-bad-hex",
        "starknet-zero",
        "evm-bad-address",
        "missing-key-file",
        "no-scheme",
        "ftp",
        "bad-port",
        "no-host",
    ],
)
def test_make_backend_refusals(kwargs: dict[str, object], message: str) -> None:
    kind = kwargs.pop("kind")
    with pytest.raises(AnchorRejected, match=message):
        make_backend(kind, **kwargs)  # type: ignore[arg-type]


async def test_make_backend_kinds(tmp_path: Path) -> None:
    assert isinstance(make_backend("none"), NoneBackend)
    key = tmp_path / "evm.key"
    acct: LocalAccount = Account.create()
    write_private_key(key, acct)
    evm = make_backend(
        "evm", rpc_url="http://127.0.0.1:1", contract="0x" + "11" * 20, chain_id=5, key_file=key, confirmations=3
    )
    assert isinstance(evm, EvmBackend)
    assert evm.describe()["account"] == acct.address and evm.describe()["confirmations"] == 3
    await evm.close()
    skey = tmp_path / "stark.key"
    skey.write_text("0xabc\n")
    skey.chmod(0o600)
    sn = make_backend(
        "starknet", rpc_url="http://127.0.0.1:1", contract="0xc0de", account="0xacc", chain_id=7, key_file=skey
    )
    assert isinstance(sn, StarknetBackend) and sn.describe()["account"] == "0xacc"
    await sn.close()


async def test_status_of_the_none_backend() -> None:
    b = make_backend("none")
    sub = await b.submit(sample_anchor(1))
    report = await anchor_status(b, sub)
    assert report["backend"] == "none" and report["anchor"]["state"] == "not_anchored"


@pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)
async def test_deploy_then_status_from_key_files(tmp_path: Path) -> None:
    node = Anvil(tmp_path)
    node.start()
    try:
        acct: LocalAccount = Account.create()
        node.fund(acct.address)
        key = tmp_path / "anchor-evm.key"
        write_private_key(key, acct)
        info = await anchor_deploy(node.url, key)
        assert info["owner"] == acct.address and info["chain_id"] == 31337 and info["block"] >= 1
        b = make_backend("evm", rpc_url=node.url, contract=info["contract"], chain_id=info["chain_id"], key_file=key)
        try:
            sub = await b.submit(sample_anchor(2))
            await included(b, sub)
            report = await anchor_status(b, sub)
        finally:
            await b.close()
        json.dumps(report)
        assert report["contract_matches_artifact"] and report["account_is_owner"]
        assert report["anchor"]["state"] == "confirmed" and report["anchor"]["confirmations"] == 1
        assert acct.key.hex().removeprefix("0x") not in json.dumps(report)
    finally:
        node.stop()
