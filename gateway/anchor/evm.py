"""The ``evm`` backend: anchors go to the UompAnchor contract (contracts/UompAnchor.sol) through
web3.py's async client on any EVM JSON-RPC node.

* One transaction per anchor: ``anchor(root, treeSize, checkpointHash, granted[], revoked[],
  access[], payloads[], deletions[])`` emits the §18.4.1 events, then ``CheckpointAnchored``.
* Transactions are EIP-1559 (type 2), signed locally with the configured account (the key never
  leaves this process): nonce from the node's pending count (authoritative: no gap if the node
  loses a transaction); gas from ``eth_estimateGas`` plus a margin; fees from the node (``2 * baseFee + tip``,
  tip from ``eth_maxPriorityFeePerGas``), refused above an optional cap.
* Every RPC call is retried with exponential backoff on transport failures (refused, reset, timed
  out, HTTP 5xx/429); when the attempts run out it raises :class:`AnchorUnavailable` (retryable),
  whose message names the node as ``scheme://host:port`` only (RPC URLs often carry API keys).
* Idempotent: the contract keeps ``anchoredBlock[checkpointHash]`` and reverts a second anchor of
  the same checkpoint, so ``submit`` first asks the chain (``find``) and returns the existing
  transaction instead of sending another; a resend of a transaction we already signed re-sends
  the same bytes (same hash).
* ``verify`` trusts nothing it was given but the chain: chain id, the contract's runtime code
  (must equal the committed artifact's), the receipt (status, target, the exact event sequence),
  the event log queried separately with ``eth_getLogs``, and ``anchoredBlock``; and it requires
  the configured number of confirmations.

Longer than ~500 lines on purpose: one backend; sending, finding and checking an anchor against the
chain share the same RPC calls and their failure rules.
"""

from __future__ import annotations

import asyncio
import json
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from eth_account import Account
from eth_account.signers.local import LocalAccount
from eth_typing import ChecksumAddress
from hexbytes import HexBytes
from web3 import AsyncHTTPProvider, AsyncWeb3
from web3.contract import AsyncContract
from web3.exceptions import ContractLogicError, TransactionNotFound, Web3Exception, Web3RPCError

from gateway.anchor.base import (
    MAX_INFLIGHT,
    Anchor,
    AnchorMismatch,
    AnchorRejected,
    AnchorUnavailable,
    Confirmation,
    DataDeletionProofSubmitted,
    GatewayAccess,
    PayloadAnchored,
    SessionGranted,
    SessionRevoked,
    Submitted,
    answers_checked,
    check_rpc_url,
    redact_url,
)
from gateway.anchor.encoding import keccak256

T = TypeVar("T")

_ALREADY_ANCHORED = keccak256(b"AlreadyAnchored(bytes32,uint256)")[:4]
_NOT_OWNER = keccak256(b"NotOwner()")[:4]


def artifact() -> dict[str, Any]:
    """The committed compile output of contracts/UompAnchor.sol (scripts/build-contract.sh)."""
    text = resources.files("gateway.anchor").joinpath("UompAnchor.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


@dataclass(frozen=True)
class EvmSettings:
    """Where and how to anchor. Every limit has its unit in its name."""

    rpc_url: str
    contract: str | None = None  # 0x address; None only for deploy
    chain_id: int | None = None  # expected chain id; None = whatever the node says (pinned on first use)
    code_hash: str | None = None  # 0x keccak-256 of the contract's runtime code; None = the committed artifact's
    confirmations: int = 2  # blocks deep (1 = in the newest block) before an anchor is final
    rpc_timeout_s: float = 10.0  # per RPC request
    rpc_attempts: int = 4  # tries per RPC call before AnchorUnavailable
    backoff_initial_s: float = 0.5  # first retry delay; doubles per retry
    backoff_max_s: float = 8.0  # cap on one retry delay
    gas_margin_pct: int = 20  # added to eth_estimateGas
    max_fee_per_gas_wei: int | None = None  # refuse (retry later) when the node's fees are above it
    receipt_timeout_s: float = 120.0  # deploy: how long to wait for the deployment's receipt
    receipt_poll_s: float = 0.25  # deploy: receipt polling interval

    def __post_init__(self) -> None:
        check_rpc_url(self.rpc_url)
        if self.confirmations < 1 or self.rpc_attempts < 1 or self.rpc_timeout_s <= 0:
            raise ValueError("confirmations and rpc_attempts must be >= 1 and rpc_timeout_s > 0")
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s or self.gas_margin_pct < 0:
            raise ValueError("bad backoff or gas margin")
        if self.code_hash is not None:
            try:
                ok = self.code_hash.startswith("0x") and len(bytes.fromhex(self.code_hash[2:])) == 32
            except ValueError:
                ok = False
            if not ok:
                raise ValueError("code_hash must be a 0x-prefixed 32-byte hex keccak-256")


def artifact_code_hash() -> str:
    """0x keccak-256 of the committed artifact's runtime code (what ``uomp anchor deploy`` puts on chain)."""
    return "0x" + keccak256(bytes.fromhex(artifact()["deployedBytecode"][2:])).hex()


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError, asyncio.TimeoutError, OSError)):
        return True
    if isinstance(exc, aiohttp.ClientResponseError):
        return exc.status >= 500 or exc.status == 429
    return False


def _rpc_message(exc: Web3RPCError) -> str:
    msg = exc.rpc_response.get("error", {}).get("message", "") if exc.rpc_response else ""
    return str(msg) if isinstance(msg, str) else ""


def _revert_selector(exc: ContractLogicError) -> bytes:
    data = exc.data if isinstance(exc.data, str) else ""
    try:
        return bytes.fromhex(data.removeprefix("0x"))[:4]
    except ValueError:
        return b""


def load_private_key(path: Path) -> LocalAccount:
    """An EVM account from a file holding its 0x-hex private key; the file must be 0600 (or stricter)."""
    try:
        st = path.stat()
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AnchorRejected(f"key file {path.name} must not be readable by group or others (chmod 600)")
        text = path.read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        raise AnchorRejected(f"cannot read key file {path.name}") from None
    try:
        acct: LocalAccount = Account.from_key(text)
    except Exception:
        raise AnchorRejected(f"key file {path.name} does not hold an EVM private key") from None
    return acct


def write_private_key(path: Path, account: LocalAccount) -> None:
    """Write ``account``'s key as 0x-hex to a new 0600 file (atomically; refuses to overwrite)."""
    from gateway.fsutil import atomic_write

    if path.exists():
        raise AnchorRejected(f"key file {path.name} already exists")
    atomic_write(path, ("0x" + bytes(account.key).hex() + "\n").encode(), mode=0o600)


class EvmBackend:
    """Anchors on an EVM chain through ``UompAnchor.sol`` (web3.py), every answer checked against the chain."""

    name = "evm"

    def __init__(self, settings: EvmSettings, account: LocalAccount | None = None) -> None:
        self.settings = settings
        self._account = account
        self._art = artifact()
        timeout = aiohttp.ClientTimeout(total=settings.rpc_timeout_s)
        self._w3 = AsyncWeb3(
            AsyncHTTPProvider(settings.rpc_url, request_kwargs={"timeout": timeout}, exception_retry_configuration=None)
        )
        # We sign locally and check the chain id ourselves; web3's validation middleware would add
        # an eth_chainId round trip to every call.
        self._w3.middleware_onion.remove("validation")
        self._contract: AsyncContract | None = None
        if settings.contract is not None:
            if not AsyncWeb3.is_address(settings.contract):
                raise AnchorRejected("contract is not an EVM address")
            self._contract = self._w3.eth.contract(
                address=AsyncWeb3.to_checksum_address(settings.contract), abi=self._art["abi"]
            )
        self._chain_id = settings.chain_id
        self.code_hash = (settings.code_hash or artifact_code_hash()).lower()
        self._lock = asyncio.Lock()
        # anchor id -> Submitted of a transaction this process signed and sent, not yet seen mined
        self._inflight: dict[bytes, tuple[Submitted, bytes]] = {}

    # --- plumbing ----------------------------------------------------------------------------

    @property
    def _where(self) -> str:
        return redact_url(self.settings.rpc_url)

    async def _rpc(self, what: str, call: Callable[[], Awaitable[T]], *, rpc_errors: bool = False) -> T:
        """``call()`` with retries on transport failures; AnchorUnavailable when they run out.

        A node's JSON-RPC error answer (Web3RPCError) reaches the caller only with ``rpc_errors``
        (it knows what to make of it); otherwise it, and any other unusable answer, is
        AnchorUnavailable. Reverts and "no such transaction" always reach the caller.
        """
        s = self.settings
        last = ""
        for attempt in range(s.rpc_attempts):
            if attempt:
                await asyncio.sleep(min(s.backoff_max_s, s.backoff_initial_s * (2 ** (attempt - 1))))
            try:
                return await call()
            except (TransactionNotFound, ContractLogicError):
                raise
            except Web3RPCError:
                if rpc_errors:
                    raise
                raise AnchorUnavailable(f"chain RPC {self._where} answered {what} with an error") from None
            except Web3Exception as exc:
                raise AnchorUnavailable(
                    f"chain RPC {self._where} gave an unusable answer to {what} ({type(exc).__name__})"
                ) from None
            except Exception as exc:
                if not _is_transient(exc):
                    raise
                last = type(exc).__name__
        raise AnchorUnavailable(f"chain RPC {self._where} failed for {what} after {s.rpc_attempts} attempts ({last})")

    def _need_contract(self) -> AsyncContract:
        if self._contract is None:
            raise AnchorRejected("no anchor contract configured (deploy one first)")
        return self._contract

    def _need_account(self) -> LocalAccount:
        if self._account is None:
            raise AnchorRejected("no anchoring account configured (read-only backend)")
        return self._account

    async def chain_id(self) -> int:
        """The node's chain id, checked once against the configured one."""
        got = await self._rpc("eth_chainId", lambda: self._w3.eth.chain_id)
        if self._chain_id is None:
            self._chain_id = got
        elif got != self._chain_id:
            raise AnchorRejected(f"node is on chain {got}, configured chain is {self._chain_id}")
        return got

    async def _head(self) -> int:
        return await self._rpc("eth_blockNumber", lambda: self._w3.eth.block_number)

    async def _fees(self) -> tuple[int, int]:
        block = await self._rpc("eth_getBlockByNumber", lambda: self._w3.eth.get_block("latest"))
        base = int(block.get("baseFeePerGas", 0))
        tip = int(await self._rpc("eth_maxPriorityFeePerGas", lambda: self._w3.eth.max_priority_fee))
        max_fee = 2 * base + tip
        cap = self.settings.max_fee_per_gas_wei
        if cap is not None and max_fee > cap:
            if base + tip > cap:
                raise AnchorUnavailable(f"chain fees ({base + tip} wei/gas) are above the configured cap; retry later")
            max_fee = cap
        return max_fee, tip

    async def _nonce(self, address: ChecksumAddress) -> int:
        pending = await self._rpc(
            "eth_getTransactionCount", lambda: self._w3.eth.get_transaction_count(address, "pending")
        )
        # The node's pending count is authoritative: it already counts our transactions in its pool,
        # and never running ahead of it means a transaction the node lost leaves no nonce gap that
        # would stall every later anchor. submit() is serialised by a lock, so we do not race ourselves.
        return int(pending)

    async def _send_raw(self, raw: bytes, tx_hash: bytes) -> None:
        """Broadcast signed bytes; a node that already has them (or mined them) counts as success."""
        try:
            await self._rpc("eth_sendRawTransaction", lambda: self._w3.eth.send_raw_transaction(raw), rpc_errors=True)
        except Web3RPCError as exc:
            if await self._known(tx_hash):
                return
            msg = _rpc_message(exc).lower()
            if "nonce too low" in msg:
                raise AnchorUnavailable("account nonce moved on (another sender?); resubmit") from None
            if "insufficient funds" in msg:
                raise AnchorRejected("anchoring account has insufficient funds") from None
            if "underpriced" in msg or "fee" in msg:
                raise AnchorUnavailable("node refused the fee; resubmit later") from None
            raise AnchorRejected(f"node refused the transaction: {msg[:120]}") from None

    async def _known(self, tx_hash: bytes) -> bool:
        try:
            await self._rpc("eth_getTransactionByHash", lambda: self._w3.eth.get_transaction(HexBytes(tx_hash)))
        except TransactionNotFound:
            return False
        return True

    async def _sign_and_send(self, tx: dict[str, Any]) -> tuple[bytes, bytes, int]:
        """Fill nonce, gas and fees, sign, send. Returns (tx hash, raw bytes, nonce)."""
        acct = self._need_account()
        chain = await self.chain_id()
        nonce = await self._nonce(acct.address)
        max_fee, tip = await self._fees()
        probe = {**tx, "from": acct.address, "nonce": nonce, "chainId": chain}
        try:
            gas = await self._rpc(
                "eth_estimateGas",
                lambda: self._w3.eth.estimate_gas(probe),  # type: ignore[arg-type]
                rpc_errors=True,
            )
        except ContractLogicError:
            raise
        except Web3RPCError as exc:
            msg = _rpc_message(exc).lower()
            if "insufficient funds" in msg or "exceeds allowance" in msg:
                raise AnchorRejected("anchoring account has insufficient funds") from None
            raise AnchorRejected(f"gas estimation failed: {msg[:120]}") from None
        signed = acct.sign_transaction(
            {
                **tx,
                "type": 2,
                "chainId": chain,
                "nonce": nonce,
                "gas": gas + gas * self.settings.gas_margin_pct // 100,
                "maxFeePerGas": max_fee,
                "maxPriorityFeePerGas": tip,
            }
        )
        raw, tx_hash = bytes(signed.raw_transaction), bytes(signed.hash)
        await self._send_raw(raw, tx_hash)
        return tx_hash, raw, nonce

    # --- the backend contract ----------------------------------------------------------------

    def _calldata(self, anchor: Anchor) -> str:
        contract = self._need_contract()
        data: str = contract.encode_abi(
            "anchor",
            args=[
                anchor.root,
                anchor.tree_size,
                anchor.checkpoint_hash,
                [(e.session_hash, e.agent_hash, e.expires_at) for e in anchor.granted],
                [(e.session_hash, e.agent_hash) for e in anchor.revoked],
                [(e.session_hash, e.agent_hash, e.endpoint_hash, e.allowed) for e in anchor.access],
                [(e.payload_hash, e.session_hash, e.agent_hash) for e in anchor.payloads],
                [(e.session_hash, e.agent_hash, e.deletion_proof_hash) for e in anchor.deletions],
            ],
        )
        return data

    @answers_checked
    async def submit(self, anchor: Anchor) -> Submitted:
        contract = self._need_contract()
        self._need_account()
        async with self._lock:
            existing = await self.find(anchor)
            if existing is not None:
                self._inflight.pop(anchor.anchor_id, None)
                return Submitted(self.name, anchor.anchor_id, existing, found_on_chain=True)
            sent = self._inflight.pop(anchor.anchor_id, None)
            if sent is not None:
                prev, raw = sent
                state = (await self.status(prev)).state
                if state == "dropped":  # gone from the pool: the same bytes again, if the nonce is still free
                    try:
                        await self._send_raw(raw, _parse_ref(prev.ref))
                        state = "pending"
                    except AnchorUnavailable:
                        pass
                if state in ("pending", "confirmed"):
                    self._inflight[anchor.anchor_id] = sent
                    return prev
                # failed (reverted) or unrecoverable: build a new transaction
            tx = {"to": contract.address, "data": self._calldata(anchor), "value": 0}
            try:
                tx_hash, raw, nonce = await self._sign_and_send(tx)
            except ContractLogicError as exc:
                selector = _revert_selector(exc)
                if selector == _ALREADY_ANCHORED:
                    # mined between our find() and the estimate (or by another process)
                    found = await self.find(anchor)
                    if found is not None:
                        return Submitted(self.name, anchor.anchor_id, found, found_on_chain=True)
                    raise AnchorUnavailable("anchor is on chain but its log is not visible yet; retry") from None
                if selector == _NOT_OWNER:
                    raise AnchorRejected("the anchoring account is not the contract's owner") from None
                raise AnchorRejected("the contract rejected the anchor") from None
            submitted = Submitted(self.name, anchor.anchor_id, "0x" + tx_hash.hex(), nonce=nonce)
            self._inflight[anchor.anchor_id] = (submitted, raw)
            while len(self._inflight) > MAX_INFLIGHT:  # forgetting only loses the same-bytes resend
                del self._inflight[next(iter(self._inflight))]
            return submitted

    @answers_checked
    async def status(self, submitted: Submitted) -> Confirmation:
        ref = submitted.ref
        tx_hash = _parse_ref(ref)
        try:
            receipt = await self._rpc(
                "eth_getTransactionReceipt", lambda: self._w3.eth.get_transaction_receipt(HexBytes(tx_hash))
            )
        except TransactionNotFound:
            state = "pending" if await self._known(tx_hash) else "dropped"
            return Confirmation(state=state, ref=ref)  # type: ignore[arg-type]
        block = int(receipt["blockNumber"])
        if int(receipt["status"]) != 1:
            return Confirmation(state="failed", block_number=block, ref=ref)
        depth = max(0, await self._head() - block + 1)
        return Confirmation(
            state="confirmed",
            confirmations=depth,
            final=depth >= self.settings.confirmations,
            block_number=block,
            ref=ref,
            detail={"required": self.settings.confirmations},
        )

    @answers_checked
    async def find(self, anchor: Anchor) -> str | None:
        contract = self._need_contract()
        block = int(
            await self._rpc("anchoredBlock", lambda: contract.functions.anchoredBlock(anchor.checkpoint_hash).call())
        )
        if block == 0:
            return None
        for log in await self._checkpoint_logs(anchor.checkpoint_hash, block):
            return "0x" + bytes(log["transactionHash"]).hex()
        return None

    async def _checkpoint_logs(self, checkpoint_hash: bytes, block: int) -> list[Any]:
        contract = self._need_contract()
        topic0 = "0x" + keccak256(b"CheckpointAnchored(bytes32,uint64,bytes32)").hex()
        flt: Any = {
            "address": contract.address,
            "fromBlock": block,
            "toBlock": block,
            "topics": [topic0, "0x" + checkpoint_hash.hex()],
        }
        logs: list[Any] = list(await self._rpc("eth_getLogs", lambda: self._w3.eth.get_logs(flt)))
        return logs

    @answers_checked
    async def verify(self, anchor: Anchor, receipt_ref: str) -> None:
        contract = self._need_contract()
        tx_hash = _parse_ref(receipt_ref)
        await self.check_contract()
        try:
            receipt = await self._rpc(
                "eth_getTransactionReceipt", lambda: self._w3.eth.get_transaction_receipt(HexBytes(tx_hash))
            )
        except TransactionNotFound:
            raise AnchorMismatch("the chain has no receipt for this transaction") from None
        if bytes(receipt["transactionHash"]) != tx_hash:
            raise AnchorMismatch("the node answered with the receipt of another transaction")
        if int(receipt["status"]) != 1:
            raise AnchorMismatch("the anchoring transaction reverted")
        if str(receipt["to"] or "").lower() != contract.address.lower():
            raise AnchorMismatch("the transaction was not sent to the anchor contract")
        block = int(receipt["blockNumber"])
        depth = await self._head() - block + 1
        if depth < self.settings.confirmations:
            need = self.settings.confirmations
            raise AnchorUnavailable(f"anchor not final yet ({max(depth, 0)} of {need} confirmations)")
        ours = [log for log in receipt["logs"] if str(log["address"]).lower() == contract.address.lower()]
        decoded = [self._decode(log) for log in ours]
        expected = _expected_events(anchor)
        if anchor.checkpoint_only and decoded:  # the other events' kinds only (their fields are not known here)
            if any(name not in _EVENT_KINDS for name, _ in decoded[:-1]):
                raise AnchorMismatch("the transaction emitted an event that is not one of the anchor's")
            decoded = decoded[-1:]
        if len(decoded) != len(expected):
            raise AnchorMismatch(f"the transaction emitted {len(decoded)} anchor events, expected {len(expected)}")
        for i, (got, want) in enumerate(zip(decoded, expected, strict=True)):
            if got[0] != want[0]:
                raise AnchorMismatch(f"event {i} is {got[0]}, expected {want[0]}")
            for key, value in want[1].items():
                if got[1].get(key) != value:
                    raise AnchorMismatch(f"event {i} ({want[0]}) field {key} does not match the chain")
        logs = await self._checkpoint_logs(anchor.checkpoint_hash, block)
        mine = [log for log in logs if bytes(log["transactionHash"]) == tx_hash]
        if len(logs) != 1 or len(mine) != 1 or bytes(mine[0]["blockHash"]) != bytes(receipt["blockHash"]):
            raise AnchorMismatch("the chain's event log does not show this checkpoint in this transaction")
        args = self._decode(mine[0])[1]
        if (args["root"], args["treeSize"]) != (anchor.root, anchor.tree_size):
            raise AnchorMismatch("the event log's checkpoint does not match")
        at = int(
            await self._rpc("anchoredBlock", lambda: contract.functions.anchoredBlock(anchor.checkpoint_hash).call())
        )
        if at != block:
            raise AnchorMismatch("the contract records this checkpoint in a different block")

    @answers_checked
    async def check_contract(self) -> None:
        """The node is on the configured chain and the contract address holds code whose keccak-256
        is the expected code hash (configured, else the committed artifact's)."""
        contract = self._need_contract()
        await self.chain_id()
        code = bytes(await self._rpc("eth_getCode", lambda: self._w3.eth.get_code(contract.address)))
        if not code:
            raise AnchorMismatch(f"no contract code at {contract.address} on this chain (a reset or another chain?)")
        if "0x" + keccak256(code).hex() != self.code_hash:
            raise AnchorMismatch(f"the code at {contract.address} is not the expected UompAnchor (code hash differs)")

    @answers_checked
    async def newest_anchor(self, from_block: int = 0) -> dict[str, Any] | None:
        """The largest checkpoint this contract anchored, read from the chain's event log (only the
        owner can anchor): ``{tree_size, root, checkpoint_hash, tx, block}``, or None. The contract
        is checked first (chain id, code hash). One ``eth_getLogs`` from ``from_block``: nodes that
        cap the block range of a query need a recent ``from_block``."""
        contract = self._need_contract()
        await self.check_contract()
        flt: Any = {
            "address": contract.address,
            "fromBlock": from_block,
            "toBlock": "latest",
            "topics": ["0x" + _TOPICS["CheckpointAnchored"].hex()],
        }
        logs: list[Any] = list(await self._rpc("eth_getLogs", lambda: self._w3.eth.get_logs(flt)))
        best: dict[str, Any] | None = None
        for log in logs:
            if str(log["address"]).lower() != contract.address.lower() or log.get("removed"):
                continue
            args = self._decode(log)[1]
            if best is None or int(args["treeSize"]) > best["tree_size"]:
                best = {
                    "tree_size": int(args["treeSize"]),
                    "root": bytes(args["root"]),
                    "checkpoint_hash": bytes(args["checkpointHash"]),
                    "tx": "0x" + bytes(log["transactionHash"]).hex(),
                    "block": int(log["blockNumber"]),
                }
        return best

    @answers_checked
    async def contract_events(self, from_block: int = 0) -> list[dict[str, Any]]:
        """Every §18.4.1 event this contract emitted, read from the chain's event log (after
        ``check_contract``): ``{kind, args, tx, block}`` in log order. One ``eth_getLogs`` from
        ``from_block`` (nodes that cap the block range of a query need a recent ``from_block``)."""
        contract = self._need_contract()
        await self.check_contract()
        topics = ["0x" + _TOPICS[k].hex() for k in sorted(_EVENT_KINDS)]
        flt: Any = {"address": contract.address, "fromBlock": from_block, "toBlock": "latest", "topics": [topics]}
        logs: list[Any] = list(await self._rpc("eth_getLogs", lambda: self._w3.eth.get_logs(flt)))
        out: list[dict[str, Any]] = []
        for log in logs:
            if str(log["address"]).lower() != contract.address.lower() or log.get("removed"):
                continue
            kind, args = self._decode(log)
            if kind in _EVENT_KINDS:
                out.append(
                    {
                        "kind": kind,
                        "args": args,
                        "tx": "0x" + bytes(log["transactionHash"]).hex(),
                        "block": int(log["blockNumber"]),
                    }
                )
        return out

    def _decode(self, log: Any) -> tuple[str, dict[str, Any]]:
        contract = self._need_contract()
        topic0 = bytes(log["topics"][0]) if log["topics"] else b""
        for event in (
            "SessionGranted",
            "SessionRevoked",
            "GatewayAccess",
            "PayloadAnchored",
            "DataDeletionProofSubmitted",
            "CheckpointAnchored",
            "OwnershipTransferred",
        ):
            if topic0 == _TOPICS[event]:
                try:
                    decoded = getattr(contract.events, event)().process_log(log)
                except Exception:
                    raise AnchorMismatch(f"a {event} log of the anchor contract does not decode") from None
                return event, dict(decoded["args"])
        return "unknown", {}

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "anchors_on_chain": True,
            "rpc": self._where,
            "chain_id": self._chain_id,
            "contract": self._contract.address if self._contract is not None else None,
            "account": self._account.address if self._account is not None else None,
            "confirmations": self.settings.confirmations,
            "code_hash": self.code_hash,
            "compiler": self._art["compiler"]["version"],
        }

    async def close(self) -> None:
        await self._w3.provider.disconnect()

    # --- operator functions (uomp anchor deploy / status) ------------------------------------

    @answers_checked
    async def deploy(self) -> dict[str, Any]:
        """Deploy a new UompAnchor owned by the configured account; wait for its receipt."""
        acct = self._need_account()
        tx_hash, _, _ = await self._sign_and_send({"data": self._art["bytecode"], "value": 0})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.receipt_timeout_s
        while True:
            try:
                receipt = await self._rpc(
                    "eth_getTransactionReceipt", lambda: self._w3.eth.get_transaction_receipt(HexBytes(tx_hash))
                )
                break
            except TransactionNotFound:
                if loop.time() > deadline:
                    raise AnchorUnavailable("deployment not mined before the receipt deadline") from None
                await asyncio.sleep(self.settings.receipt_poll_s)
        if int(receipt["status"]) != 1 or not receipt.get("contractAddress"):
            raise AnchorRejected("deployment reverted")
        address = str(receipt["contractAddress"])
        self._contract = self._w3.eth.contract(address=AsyncWeb3.to_checksum_address(address), abi=self._art["abi"])
        where = AsyncWeb3.to_checksum_address(address)
        code = bytes(await self._rpc("eth_getCode", lambda: self._w3.eth.get_code(where)))
        if "0x" + keccak256(code).hex() != artifact_code_hash():
            raise AnchorMismatch("the deployed code is not the committed UompAnchor build")
        return {
            "contract": address,
            "chain_id": self._chain_id,
            "owner": acct.address,
            "tx": "0x" + tx_hash.hex(),
            "block": int(receipt["blockNumber"]),
            "code_hash": "0x" + keccak256(code).hex(),
        }

    @answers_checked
    async def report(self) -> dict[str, Any]:
        """What ``uomp anchor status`` prints: chain, head, contract, owner, account balance."""
        out = self.describe()
        out["chain_id"] = await self.chain_id()
        out["head"] = await self._head()
        if self._contract is not None:
            contract = self._contract
            code = await self._rpc("eth_getCode", lambda: self._w3.eth.get_code(contract.address))
            out["contract_matches_artifact"] = "0x" + keccak256(bytes(code)).hex() == self.code_hash
            if out["contract_matches_artifact"]:
                owner = await self._rpc("owner", lambda: contract.functions.owner().call())
                out["owner"] = str(owner)
                if self._account is not None:
                    out["account_is_owner"] = str(owner).lower() == self._account.address.lower()
        if self._account is not None:
            acct = self._account
            out["balance_wei"] = int(await self._rpc("eth_getBalance", lambda: self._w3.eth.get_balance(acct.address)))
        return out


_TOPICS = {
    name: keccak256(sig.encode())
    for name, sig in {
        "SessionGranted": "SessionGranted(bytes32,bytes32,uint256)",
        "SessionRevoked": "SessionRevoked(bytes32,bytes32)",
        "GatewayAccess": "GatewayAccess(bytes32,bytes32,bytes32,bool)",
        "PayloadAnchored": "PayloadAnchored(bytes32,bytes32,bytes32)",
        "DataDeletionProofSubmitted": "DataDeletionProofSubmitted(bytes32,bytes32,bytes32)",
        "CheckpointAnchored": "CheckpointAnchored(bytes32,uint64,bytes32)",
        "OwnershipTransferred": "OwnershipTransferred(address,address)",
    }.items()
}


_EVENT_KINDS = frozenset(
    {"SessionGranted", "SessionRevoked", "GatewayAccess", "PayloadAnchored", "DataDeletionProofSubmitted"}
)


def _parse_ref(ref: str) -> bytes:
    try:
        raw = bytes.fromhex(ref.removeprefix("0x"))
    except ValueError:
        raw = b""
    if len(raw) != 32 or not ref.startswith("0x"):
        raise AnchorMismatch("receipt reference is not a 0x-prefixed 32-byte transaction hash")
    return raw


def _expected_events(anchor: Anchor) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    g: SessionGranted
    for g in anchor.granted:
        out.append(
            ("SessionGranted", {"sessionHash": g.session_hash, "agentHash": g.agent_hash, "expiresAt": g.expires_at})
        )
    r: SessionRevoked
    for r in anchor.revoked:
        out.append(("SessionRevoked", {"sessionHash": r.session_hash, "agentHash": r.agent_hash}))
    a: GatewayAccess
    for a in anchor.access:
        out.append(
            (
                "GatewayAccess",
                {
                    "sessionHash": a.session_hash,
                    "agentHash": a.agent_hash,
                    "endpointHash": a.endpoint_hash,
                    "allowed": a.allowed,
                },
            )
        )
    p: PayloadAnchored
    for p in anchor.payloads:
        out.append(
            (
                "PayloadAnchored",
                {"payloadHash": p.payload_hash, "sessionHash": p.session_hash, "agentHash": p.agent_hash},
            )
        )
    d: DataDeletionProofSubmitted
    for d in anchor.deletions:
        out.append(
            (
                "DataDeletionProofSubmitted",
                {"sessionHash": d.session_hash, "agentHash": d.agent_hash, "deletionProofHash": d.deletion_proof_hash},
            )
        )
    out.append(
        (
            "CheckpointAnchored",
            {"root": anchor.root, "treeSize": anchor.tree_size, "checkpointHash": anchor.checkpoint_hash},
        )
    )
    return out


async def deploy(rpc_url: str, private_key: str | LocalAccount, *, chain_id: int | None = None) -> str:
    """Deploy UompAnchor with ``private_key``'s account as owner; returns the contract address."""
    acct = private_key if isinstance(private_key, LocalAccount) else Account.from_key(private_key)
    backend = EvmBackend(EvmSettings(rpc_url=rpc_url, chain_id=chain_id), acct)
    try:
        return str((await backend.deploy())["contract"])
    finally:
        await backend.close()
