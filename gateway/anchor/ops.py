"""Plain functions behind ``uomp anchor deploy`` and ``uomp anchor status`` (the CLI wires them).

Each returns a JSON-serialisable dict (never a key) or raises an :class:`AnchorError`
(a UompError: the CLI prints ``code: message`` and exits non-zero). docs/anchoring.md shows usage.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from gateway.anchor.base import AnchorBackend, AnchorRejected, Submitted, plain_http_remote, redact_url
from gateway.anchor.none import NoneBackend

BACKENDS = ("none", "evm", "starknet")


def make_backend(
    kind: str,
    *,
    rpc_url: str | None = None,
    contract: str | None = None,
    chain_id: int | None = None,
    key_file: Path | None = None,
    account: str | None = None,
    confirmations: int | None = None,
    code_hash: str | None = None,
    rpc_attempts: int | None = None,
) -> AnchorBackend:
    """A backend from plain settings. ``key_file`` absent: read-only (status, find, verify).

    evm: ``contract`` 0x address, ``chain_id`` optional (pinned from the node otherwise),
    ``key_file`` a 0600 file with the 0x-hex private key, ``code_hash`` the 0x keccak-256 of the
    contract's runtime code (printed by ``uomp anchor deploy``; None: the committed artifact's).
    starknet: ``contract`` and ``account`` 0x felts, ``chain_id`` required, ``key_file`` the
    account's 0x-hex Stark private key (0600).
    """
    if kind == "none":
        return NoneBackend()
    if kind not in BACKENDS:
        raise AnchorRejected(f"unknown anchor backend {kind!r} (one of {', '.join(BACKENDS)})")
    if not rpc_url:
        raise AnchorRejected(f"the {kind} backend needs an RPC URL")
    extra: dict[str, Any] = {} if confirmations is None else {"confirmations": confirmations}
    if rpc_attempts is not None:  # a status report tries once: it reports an outage, it does not wait it out
        extra["rpc_attempts"] = rpc_attempts
    if kind == "evm":
        from gateway.anchor.evm import EvmBackend, EvmSettings, load_private_key

        try:
            evm_settings = EvmSettings(
                rpc_url=rpc_url, contract=contract, chain_id=chain_id, code_hash=code_hash or None, **extra
            )
        except ValueError as exc:  # our own messages: they never echo the URL
            raise AnchorRejected(str(exc)) from None
        acct = load_private_key(key_file) if key_file is not None else None
        return EvmBackend(evm_settings, acct)
    from gateway.anchor.starknet import StarknetBackend, StarknetSettings, load_stark_key

    if not contract or not account or chain_id is None:
        raise AnchorRejected("the starknet backend needs a contract, an account and a chain id")
    try:
        account_felt, contract_felt = int(account, 16), int(contract, 16)
    except ValueError:
        raise AnchorRejected("starknet contract or account is not a 0x-hex felt") from None
    try:
        settings = StarknetSettings(
            rpc_url=rpc_url, account=account_felt, contract=contract_felt, chain_id=chain_id, **extra
        )
    except ValueError as exc:  # our own messages: they never echo the URL
        raise AnchorRejected(str(exc)) from None
    key = load_stark_key(key_file) if key_file is not None else None
    return StarknetBackend(settings, key)


def rpc_warnings(backend: str, rpc_url: str) -> list[str]:
    """Warnings about the anchoring settings (for `uomp doctor` and the start banner)."""
    if backend == "none" or not rpc_url or not plain_http_remote(rpc_url):
        return []
    return [
        f"the chain RPC {redact_url(rpc_url)} is plain http to another host: anyone on the path can read "
        "and answer for it (every anchor is still checked, but can be stalled or hidden); use https://"
    ]


async def anchor_deploy(rpc_url: str, key_file: Path, *, chain_id: int | None = None) -> dict[str, Any]:
    """``uomp anchor deploy``: deploy UompAnchor (EVM) owned by the key file's account.

    Returns ``{"contract", "chain_id", "owner", "tx", "block", "code_hash"}``; put ``contract``,
    ``chain_id`` and ``code_hash`` in the appliance's anchoring settings. (Starknet: declare and deploy the Cairo
    contract with Starknet tooling; this project cannot compile it.)
    """
    from gateway.anchor.evm import EvmBackend, EvmSettings, load_private_key

    backend = EvmBackend(EvmSettings(rpc_url=rpc_url, chain_id=chain_id), load_private_key(key_file))
    try:
        return await backend.deploy()
    finally:
        await backend.close()


async def anchor_status(backend: AnchorBackend, submitted: Submitted | None = None) -> dict[str, Any]:
    """``uomp anchor status``: the backend's description and, for chains, the live view (chain id,
    head, contract check, owner, balance or nonce); with ``submitted``, that anchor's confirmation."""
    report = getattr(backend, "report", None)
    out: dict[str, Any] = await report() if report is not None else backend.describe()
    if submitted is not None:
        out["anchor"] = {"anchor_id": submitted.anchor_id.hex(), **asdict(await backend.status(submitted))}
    return out
