"""Reporting abnormal sessions (spec §19.5) to an ERC-8004 Reputation Registry, only on the user's opt-in.

A session is abnormal when it ended although its agent owed a deletion proof and gave none
(``SessionRow.abnormal``). ``uomp registry report`` finds, for each abnormal session not reported
yet, the registry agent it was installed from (the user's own install records, by the manifest's
agent id; an agent id installed from two different registry agents is ambiguous and skipped), and
sends one ``giveFeedback(agentId, 0, 0, "uomp-deletion-proof", "missing", "", "", 0x0)`` to the
Reputation Registry configured for that registry, from the user's feedback account (a 0600 key
file). Nothing in it names the user, a session, a key or a value: an agent id, a value and two
fixed tags. Each report is recorded (``Paths.registry_reports``) after its transaction is mined,
so a session is reported once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import Paths, RegistryConfig
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write
from gateway.registry.ops import RegistryEntry, load_registries, now_iso

TAG1 = "uomp-deletion-proof"
TAG2 = "missing"
REPORTS_VERSION = 1


@dataclass(frozen=True)
class Report:
    """One abnormal session reported as ERC-8004 feedback."""

    session_id: str
    registry: str
    agent_id: int
    tx: str | None  # None: not sent (dry run)


def _install_records(paths: Paths) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    folder = paths.registry_installs_dir
    if not folder.is_dir():
        return out
    for f in sorted(folder.glob("0x*.json"))[:10_000]:
        try:
            doc = json.loads(f.read_bytes()[: 64 * 1024])
            if isinstance(doc.get("manifest_agent_id"), str):
                out.append(doc)
        except (OSError, ValueError, AttributeError):
            continue
    return out


def _reported(paths: Paths) -> dict[str, Any]:
    try:
        doc = json.loads(paths.registry_reports.read_bytes())
        if isinstance(doc, dict) and doc.get("uomp_registry_reports") == REPORTS_VERSION:
            return doc
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        raise UompError(
            ErrorCode.CONFIG_ERROR, f"{paths.registry_reports} is not a valid report record; fix or remove it"
        ) from exc
    return {"uomp_registry_reports": REPORTS_VERSION, "sessions": {}}


def pending(paths: Paths, sessions: list[dict[str, Any]]) -> tuple[list[tuple[str, RegistryEntry, int]], list[str]]:
    """(session id, registry, agent id) to report, and the reasons some abnormal sessions are not."""
    done = _reported(paths)["sessions"]
    registries = {e.id: e for e in load_registries(paths)}
    by_agent: dict[str, set[tuple[str, int]]] = {}
    for rec in _install_records(paths):
        by_agent.setdefault(rec["manifest_agent_id"], set()).add((str(rec["registry"]), int(rec["agent_id"])))
    todo: list[tuple[str, RegistryEntry, int]] = []
    skipped: list[str] = []
    for s in sessions:
        if not s.get("abnormal") or s["session_id"] in done:
            continue
        found = by_agent.get(s["agent_id"], set())
        if not found:
            continue  # not installed from a registry: nothing to report to
        if len(found) > 1:
            skipped.append(f"{s['session_id']}: agent {s['agent_id']} was installed from several registry agents")
            continue
        reg_id, agent_id = next(iter(found))
        entry = registries.get(reg_id)
        if entry is None or not entry.reputation:
            skipped.append(f"{s['session_id']}: registry {reg_id} has no Reputation Registry configured")
            continue
        todo.append((s["session_id"], entry, agent_id))
    return todo, skipped


def send(paths: Paths, cfg: RegistryConfig, session_id: str, entry: RegistryEntry, agent_id: int) -> Report:
    """One feedback transaction, mined, then recorded."""
    try:
        from web3 import HTTPProvider, Web3
        from web3.exceptions import ContractLogicError, Web3Exception

        from gateway.anchor.base import AnchorError
        from gateway.anchor.evm import load_private_key
    except ImportError as exc:
        raise UompError(
            ErrorCode.CONFIG_ERROR, "reporting needs web3: pip install 'uomp-gateway[anchor,registry]'"
        ) from exc
    if not entry.feedback_key_file:
        raise UompError(ErrorCode.CONFIG_ERROR, f"registry {entry.id} has no feedback key file (--feedback-key)")
    try:
        acct = load_private_key(Path(entry.feedback_key_file))
    except AnchorError as exc:
        raise UompError(ErrorCode.KEY_ERROR, str(exc)) from exc
    w3 = Web3(HTTPProvider(entry.rpc_url, request_kwargs={"timeout": cfg.rpc_timeout_seconds}))
    from importlib import resources

    abi = json.loads(resources.files("gateway.registry").joinpath("Erc8004ReputationRegistry.json").read_text())["abi"]
    contract = w3.eth.contract(address=Web3.to_checksum_address(entry.reputation), abi=abi)
    try:
        if w3.eth.chain_id != entry.chain_id:
            raise UompError(ErrorCode.REGISTRY_UNAVAILABLE, f"the node is not on chain {entry.chain_id}")
        fn = contract.functions.giveFeedback(agent_id, 0, 0, TAG1, TAG2, "", "", b"\0" * 32)
        tx = fn.build_transaction(
            {
                "from": acct.address,
                "nonce": w3.eth.get_transaction_count(acct.address, "pending"),
                "chainId": entry.chain_id,
            }
        )
        signed = acct.sign_transaction(tx)  # type: ignore[arg-type]
        tx_hash = w3.eth.send_raw_transaction(signed.raw_transaction)
        receipt = w3.eth.wait_for_transaction_receipt(tx_hash, timeout=cfg.rpc_timeout_seconds * 6)
    except ContractLogicError as exc:
        raise UompError(
            ErrorCode.REGISTRY_UNAVAILABLE, f"the Reputation Registry refused the feedback ({str(exc)[:120]})"
        ) from exc
    except (Web3Exception, OSError, ValueError) as exc:
        raise UompError(
            ErrorCode.REGISTRY_UNAVAILABLE, f"the feedback could not be sent ({type(exc).__name__}); try again later"
        ) from exc
    if receipt["status"] != 1:
        raise UompError(ErrorCode.REGISTRY_UNAVAILABLE, "the feedback transaction reverted")
    doc = _reported(paths)
    doc["sessions"][session_id] = {"registry": entry.id, "agent_id": agent_id, "tx": tx_hash.hex(), "at": now_iso()}
    atomic_write(paths.registry_reports, (json.dumps(doc, indent=2) + "\n").encode(), mode=0o600)
    return Report(session_id, entry.id, agent_id, "0x" + tx_hash.hex().removeprefix("0x"))
