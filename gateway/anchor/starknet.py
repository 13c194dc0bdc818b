"""The ``starknet`` backend: anchors go to the UompAnchor Cairo contract (contracts/cairo/) as
INVOKE v3 transactions of a configured account, built and signed offline with starknet-py.

Tested only against a local stand-in JSON-RPC server (tests/starknet_standin.py), never against a
real Starknet node (none installs here); the Cairo contract is committed but not compiled here.

* Calldata (:func:`anchor_calldata`) follows Cairo's Serde: a u256 is two felts (low 128 bits,
  then high), a u64 or bool one felt, an ``Array<T>`` its length then its elements. The account's
  ``__execute__`` takes ``Array<Call>``: ``[1, contract, selector("anchor"), len, *calldata]``
  (the Cairo 1 account layout of OpenZeppelin and Argent accounts).
* Signing (:meth:`StarknetBackend.build_invoke`) is offline: the transaction hash (SNIP-8 v3,
  Poseidon) and the Stark-curve ECDSA signature are starknet-py's, from the nonce, chain id and
  the configured resource bounds; the key never leaves this process.
* Submission, receipts, events, ``anchored_block`` and nonces go over JSON-RPC with
  ``FullNodeClient``; transport failures are retried with backoff, then AnchorUnavailable.
* Events as the Cairo contract emits them: ``keys = [selector(name), *key fields]``,
  ``data = [*other fields]`` (:func:`expected_events`).

Longer than ~500 lines on purpose: one backend, with the transaction encoding it signs offline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from starknet_py.hash.selector import get_selector_from_name
from starknet_py.net.client_errors import ClientError
from starknet_py.net.client_models import Call, ResourceBounds, ResourceBoundsMapping
from starknet_py.net.full_node_client import FullNodeClient
from starknet_py.net.http_client import ServerError
from starknet_py.net.models.transaction import InvokeV3
from starknet_py.net.signer.key_pair import KeyPair
from starknet_py.net.signer.stark_curve_signer import StarkCurveSigner

from gateway.anchor.base import (
    MAX_INFLIGHT,
    Anchor,
    AnchorMismatch,
    AnchorRejected,
    AnchorUnavailable,
    Confirmation,
    Submitted,
    answers_checked,
    check_rpc_url,
    redact_url,
)

T = TypeVar("T")

FELT_MAX = 2**251 + 17 * 2**192  # the Stark field prime; felts are in [0, FELT_MAX)
TX_NOT_FOUND = 29  # Starknet JSON-RPC error code: "Transaction hash not found"
_EVENTS = (
    "SessionGranted",
    "SessionRevoked",
    "GatewayAccess",
    "PayloadAnchored",
    "DataDeletionProofSubmitted",
    "CheckpointAnchored",
)
SELECTORS = {name: get_selector_from_name(name) for name in (*_EVENTS, "anchor", "anchored_block")}


def _u256(h: bytes) -> list[int]:
    v = int.from_bytes(h, "big")
    return [v & ((1 << 128) - 1), v >> 128]


def anchor_calldata(anchor: Anchor) -> list[int]:
    """Serde of ``anchor(root, tree_size, checkpoint_hash, granted, revoked, access, payloads, deletions)``."""
    out = [*_u256(anchor.root), anchor.tree_size, *_u256(anchor.checkpoint_hash)]
    out.append(len(anchor.granted))
    for g in anchor.granted:
        out += [*_u256(g.session_hash), *_u256(g.agent_hash), g.expires_at]
    out.append(len(anchor.revoked))
    for r in anchor.revoked:
        out += [*_u256(r.session_hash), *_u256(r.agent_hash)]
    out.append(len(anchor.access))
    for a in anchor.access:
        out += [*_u256(a.session_hash), *_u256(a.agent_hash), *_u256(a.endpoint_hash), int(a.allowed)]
    out.append(len(anchor.payloads))
    for p in anchor.payloads:
        out += [*_u256(p.payload_hash), *_u256(p.session_hash), *_u256(p.agent_hash)]
    out.append(len(anchor.deletions))
    for d in anchor.deletions:
        out += [*_u256(d.session_hash), *_u256(d.agent_hash), *_u256(d.deletion_proof_hash)]
    return out


def execute_calldata(calls: list[Call]) -> list[int]:
    """A Cairo 1 account's ``__execute__(calls: Array<Call>)`` calldata."""
    out = [len(calls)]
    for c in calls:
        out += [c.to_addr, c.selector, len(c.calldata), *c.calldata]
    return out


def expected_events(anchor: Anchor) -> list[tuple[list[int], list[int]]]:
    """(keys, data) of every event ``anchor`` makes the contract emit, in order."""
    s = SELECTORS
    out: list[tuple[list[int], list[int]]] = []
    for g in anchor.granted:
        out.append(([s["SessionGranted"], *_u256(g.session_hash), *_u256(g.agent_hash)], [g.expires_at]))
    for r in anchor.revoked:
        out.append(([s["SessionRevoked"], *_u256(r.session_hash), *_u256(r.agent_hash)], []))
    for a in anchor.access:
        out.append(
            (
                [s["GatewayAccess"], *_u256(a.session_hash), *_u256(a.agent_hash)],
                [*_u256(a.endpoint_hash), int(a.allowed)],
            )
        )
    for p in anchor.payloads:
        out.append(([s["PayloadAnchored"], *_u256(p.payload_hash), *_u256(p.session_hash)], _u256(p.agent_hash)))
    for d in anchor.deletions:
        out.append(
            (
                [s["DataDeletionProofSubmitted"], *_u256(d.session_hash), *_u256(d.agent_hash)],
                _u256(d.deletion_proof_hash),
            )
        )
    out.append(([s["CheckpointAnchored"], *_u256(anchor.checkpoint_hash)], [*_u256(anchor.root), anchor.tree_size]))
    return out


@dataclass(frozen=True)
class StarknetSettings:
    """Where and how to anchor. Gas amounts are units, prices are FRI (10**-18 STRK) per unit."""

    rpc_url: str
    account: int  # address of the anchoring account contract (a deployed Cairo 1 account)
    contract: int  # address of the deployed UompAnchor
    chain_id: int  # e.g. starknet_py.net.models.StarknetChainId.SEPOLIA
    confirmations: int = 1  # blocks deep once ACCEPTED_ON_L2 (ACCEPTED_ON_L1 is always final)
    rpc_timeout_s: float = 10.0
    rpc_attempts: int = 4
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 8.0
    l1_gas_max_amount: int = 0
    l1_gas_max_price_fri: int = 10**15
    l2_gas_max_amount: int = 40_000_000
    l2_gas_max_price_fri: int = 10**11
    l1_data_gas_max_amount: int = 2_000
    l1_data_gas_max_price_fri: int = 10**12
    events_chunk: int = 100  # starknet_getEvents page size
    events_max_pages: int = 10  # a node that keeps paging beyond this (for one block) is refused

    def __post_init__(self) -> None:
        check_rpc_url(self.rpc_url)
        if self.confirmations < 1 or self.rpc_attempts < 1 or self.rpc_timeout_s <= 0:
            raise ValueError("confirmations and rpc_attempts must be >= 1 and rpc_timeout_s > 0")
        for name in ("account", "contract", "chain_id"):
            if not 0 < getattr(self, name) < FELT_MAX:
                raise ValueError(f"{name} must be a non-zero felt")

    def resource_bounds(self) -> ResourceBoundsMapping:
        return ResourceBoundsMapping(
            l1_gas=ResourceBounds(self.l1_gas_max_amount, self.l1_gas_max_price_fri),
            l2_gas=ResourceBounds(self.l2_gas_max_amount, self.l2_gas_max_price_fri),
            l1_data_gas=ResourceBounds(self.l1_data_gas_max_amount, self.l1_data_gas_max_price_fri),
        )


def load_stark_key(path: Path) -> KeyPair:
    """A Stark key pair from a file holding the 0x-hex private key; the file must be 0600."""
    try:
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AnchorRejected(f"key file {path.name} must not be readable by group or others (chmod 600)")
        text = path.read_text("ascii").strip()
        key = int(text, 16)
    except (OSError, UnicodeDecodeError, ValueError):
        raise AnchorRejected(f"key file {path.name} does not hold a Stark private key") from None
    if not 0 < key < FELT_MAX:
        raise AnchorRejected(f"key file {path.name} does not hold a Stark private key")
    return KeyPair.from_private_key(key)


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError, asyncio.TimeoutError, OSError)):
        return True
    if isinstance(exc, ClientError) and isinstance(exc.code, str) and exc.code.isdigit():
        status = int(exc.code)  # an HTTP status (starknet-py puts it in `code`)
        return status >= 500 or status == 429
    return False


def _not_found(exc: ClientError) -> bool:
    return str(exc.code) == str(TX_NOT_FOUND)  # typed str, an int on the wire


def _hex(n: int) -> str:
    return hex(n)


class StarknetBackend:
    """Anchors on Starknet through the Cairo contract (starknet-py); tested only against a local stand-in."""

    name = "starknet"

    def __init__(self, settings: StarknetSettings, key_pair: KeyPair | None = None) -> None:
        self.settings = settings
        self._key = key_pair
        self._session: aiohttp.ClientSession | None = None
        self._client: FullNodeClient | None = None
        self._lock = asyncio.Lock()
        self._inflight: dict[bytes, Submitted] = {}

    # --- plumbing ----------------------------------------------------------------------------

    @property
    def _where(self) -> str:
        return redact_url(self.settings.rpc_url)

    def _node(self) -> FullNodeClient:
        if self._client is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.settings.rpc_timeout_s))
            self._client = FullNodeClient(node_url=self.settings.rpc_url, session=self._session)
        return self._client

    async def _rpc(self, what: str, call: Callable[[FullNodeClient], Awaitable[T]], *, rpc_errors: bool = False) -> T:
        s = self.settings
        last = ""
        for attempt in range(s.rpc_attempts):
            if attempt:
                await asyncio.sleep(min(s.backoff_max_s, s.backoff_initial_s * (2 ** (attempt - 1))))
            try:
                return await call(self._node())
            except Exception as exc:
                if _is_transient(exc):
                    last = type(exc).__name__
                    continue
                if isinstance(exc, ClientError) and rpc_errors:
                    raise
                if isinstance(exc, (ClientError, ServerError)):
                    raise AnchorUnavailable(f"Starknet RPC {self._where} answered {what} with an error") from None
                if isinstance(exc, (KeyError, ValueError, TypeError)) or type(exc).__module__.startswith("marshmallow"):
                    raise AnchorUnavailable(f"Starknet RPC {self._where} gave an unusable answer to {what}") from None
                raise
        raise AnchorUnavailable(
            f"Starknet RPC {self._where} failed for {what} after {s.rpc_attempts} attempts ({last})"
        )

    @answers_checked
    async def check_contract(self) -> None:
        """The chain id only: the contract's class is not checked (the stand-in has no classes)."""
        await self._check_chain()

    async def _check_chain(self) -> None:
        got = await self._rpc("starknet_chainId", lambda c: c.get_chain_id())
        if int(str(got), 16) != self.settings.chain_id:
            raise AnchorRejected(f"node is on chain {got}, configured chain is {_hex(self.settings.chain_id)}")

    def _need_key(self) -> KeyPair:
        if self._key is None:
            raise AnchorRejected("no anchoring key configured (read-only backend)")
        return self._key

    # --- offline signing ---------------------------------------------------------------------

    def build_invoke(self, anchor: Anchor, nonce: int) -> InvokeV3:
        """The signed INVOKE v3 of ``anchor`` at ``nonce``; no network."""
        key = self._need_key()
        s = self.settings
        call = Call(to_addr=s.contract, selector=SELECTORS["anchor"], calldata=anchor_calldata(anchor))
        tx = InvokeV3(
            version=3,
            signature=[],
            nonce=nonce,
            resource_bounds=s.resource_bounds(),
            calldata=execute_calldata([call]),
            sender_address=s.account,
            tip=0,
        )
        signer = StarkCurveSigner(account_address=s.account, key_pair=key, chain_id=s.chain_id)
        return dataclasses.replace(tx, signature=signer.sign_transaction(tx))

    def tx_hash(self, tx: InvokeV3) -> int:
        return int(tx.calculate_hash(self.settings.chain_id))

    # --- the backend contract ----------------------------------------------------------------

    @answers_checked
    async def submit(self, anchor: Anchor) -> Submitted:
        self._need_key()
        async with self._lock:
            existing = await self.find(anchor)
            if existing is not None:
                self._inflight.pop(anchor.anchor_id, None)
                return Submitted(self.name, anchor.anchor_id, existing, found_on_chain=True)
            prev = self._inflight.get(anchor.anchor_id)
            if prev is not None and (await self.status(prev)).state in ("pending", "confirmed"):
                return prev
            await self._check_chain()
            nonce = await self._nonce()
            tx = self.build_invoke(anchor, nonce)
            try:
                sent = await self._rpc(
                    "starknet_addInvokeTransaction", lambda c: c.send_transaction(tx), rpc_errors=True
                )
            except ClientError as exc:
                msg = str(exc.message or "").lower()
                if "nonce" in msg:
                    raise AnchorUnavailable("account nonce moved on (another sender?); resubmit") from None
                if "balance" in msg or "fee" in msg or "resource" in msg:
                    raise AnchorRejected("the account cannot pay the configured resource bounds") from None
                if "validat" in msg or "signature" in msg:
                    raise AnchorRejected("the account refused the signature (wrong key for this account?)") from None
                raise AnchorRejected(f"node refused the transaction (code {exc.code})") from None
            if int(sent.transaction_hash) != self.tx_hash(tx):
                raise AnchorMismatch("the node returned a different transaction hash than we signed")
            submitted = Submitted(self.name, anchor.anchor_id, _hex(sent.transaction_hash), nonce=nonce)
            self._inflight[anchor.anchor_id] = submitted
            return submitted

    async def _nonce(self) -> int:
        """The account's nonce in the latest block, or one past our newest transaction that the
        node still holds (the latest block does not count pooled transactions). Never further
        ahead: a transaction the node lost must not leave a gap that stalls later ones."""
        latest = int(
            await self._rpc(
                "starknet_getNonce", lambda c: c.get_contract_nonce(self.settings.account, block_number="latest")
            )
        )
        for key in [k for k, s in self._inflight.items() if s.nonce is not None and s.nonce < latest]:
            del self._inflight[key]  # executed: find() locates it on chain from now on
        while len(self._inflight) > MAX_INFLIGHT:
            del self._inflight[next(iter(self._inflight))]
        ours = sorted(
            (s for s in self._inflight.values() if s.nonce is not None and s.nonce >= latest),
            key=lambda s: s.nonce or 0,
            reverse=True,
        )
        for sub in ours:
            if (await self.status(sub)).state in ("pending", "confirmed"):
                return (sub.nonce or 0) + 1
        return latest

    @answers_checked
    async def status(self, submitted: Submitted) -> Confirmation:
        ref = submitted.ref
        tx_hash = _parse_ref(ref)
        try:
            receipt = await self._rpc(
                "starknet_getTransactionReceipt", lambda c: c.get_transaction_receipt(tx_hash), rpc_errors=True
            )
        except ClientError as exc:
            if not _not_found(exc):
                raise AnchorUnavailable("Starknet RPC answered the receipt query with an error") from None
            try:
                await self._rpc(
                    "starknet_getTransactionStatus", lambda c: c.get_transaction_status(tx_hash), rpc_errors=True
                )
            except ClientError as exc2:
                if _not_found(exc2):
                    return Confirmation(state="dropped", ref=ref)
                raise AnchorUnavailable("Starknet RPC answered the status query with an error") from None
            return Confirmation(state="pending", ref=ref)
        block = int(receipt.block_number)
        if receipt.execution_status is not None and receipt.execution_status.value == "REVERTED":
            return Confirmation(state="failed", block_number=block, ref=ref)
        head = await self._rpc("starknet_blockNumber", lambda c: c.get_block_number())
        depth = max(0, int(head) - block + 1)
        on_l1 = receipt.finality_status.value == "ACCEPTED_ON_L1"
        accepted = on_l1 or receipt.finality_status.value == "ACCEPTED_ON_L2"
        return Confirmation(
            state="confirmed",
            confirmations=depth,
            final=accepted and (on_l1 or depth >= self.settings.confirmations),
            block_number=block,
            ref=ref,
            detail={"finality_status": receipt.finality_status.value, "required": self.settings.confirmations},
        )

    async def _anchored_block(self, checkpoint_hash: bytes) -> int:
        call = Call(
            to_addr=self.settings.contract, selector=SELECTORS["anchored_block"], calldata=_u256(checkpoint_hash)
        )
        out = await self._rpc("starknet_call", lambda c: c.call_contract(call, block_number="latest"))
        if len(out) != 1:
            raise AnchorUnavailable("anchored_block returned an unexpected shape")
        return int(out[0])

    async def _checkpoint_events(self, checkpoint_hash: bytes, block: int) -> list[Any]:
        lo, hi = _u256(checkpoint_hash)
        keys: list[list[int | str]] = [[SELECTORS["CheckpointAnchored"]], [lo], [hi]]
        events: list[Any] = []
        token: str | None = None
        for _ in range(self.settings.events_max_pages):

            def page(c: FullNodeClient, after: str | None = token) -> Awaitable[Any]:
                return c.get_events(
                    address=self.settings.contract,
                    keys=keys,
                    from_block_number=block,
                    to_block_number=block,
                    continuation_token=after,
                    chunk_size=self.settings.events_chunk,
                )

            chunk = await self._rpc("starknet_getEvents", page)
            events += chunk.events
            token = chunk.continuation_token
            if token is None:
                return events
        raise AnchorUnavailable("Starknet RPC kept paging the events of one block; refusing to read on")

    @answers_checked
    async def contract_events(self, from_block: int = 0) -> list[dict[str, Any]]:
        """Every §18.4.1 event of the contract from ``from_block`` to the head, decoded with the EVM
        field names (``{kind, args, tx, block}``), after ``check_contract``. At most
        ``events_max_pages`` pages of ``events_chunk``: more is AnchorUnavailable, never a short list."""
        await self.check_contract()
        head = int(await self._rpc("starknet_blockNumber", lambda c: c.get_block_number()))
        names = {
            SELECTORS[k]: k
            for k in (
                "SessionGranted",
                "SessionRevoked",
                "GatewayAccess",
                "PayloadAnchored",
                "DataDeletionProofSubmitted",
            )
        }
        keys: list[list[int | str]] = [list(names)]
        events: list[Any] = []
        token: str | None = None
        for _ in range(self.settings.events_max_pages):

            def page(c: FullNodeClient, after: str | None = token) -> Awaitable[Any]:
                return c.get_events(
                    address=self.settings.contract,
                    keys=keys,
                    from_block_number=from_block,
                    to_block_number=head,
                    continuation_token=after,
                    chunk_size=self.settings.events_chunk,
                )

            chunk = await self._rpc("starknet_getEvents", page)
            events += chunk.events
            token = chunk.continuation_token
            if token is None:
                break
        else:
            raise AnchorUnavailable("Starknet RPC has more events than this verify reads (events_max_pages)")
        out: list[dict[str, Any]] = []
        for e in events:
            if int(e.from_address) != self.settings.contract or not e.keys or int(e.keys[0]) not in names:
                continue
            kind = names[int(e.keys[0])]
            k, d = [int(x) for x in e.keys[1:]], [int(x) for x in e.data]

            def u(pair: list[int]) -> bytes:
                return (pair[0] + (pair[1] << 128)).to_bytes(32, "big")

            args: dict[str, Any]
            if kind == "PayloadAnchored":
                args = {"payloadHash": u(k[0:2]), "sessionHash": u(k[2:4]), "agentHash": u(d[0:2])}
            else:
                args = {"sessionHash": u(k[0:2]), "agentHash": u(k[2:4])}
                if kind == "SessionGranted":
                    args["expiresAt"] = d[0]
                elif kind == "DataDeletionProofSubmitted":
                    args["deletionProofHash"] = u(d[0:2])
                elif kind == "GatewayAccess":
                    args["endpointHash"], args["allowed"] = u(d[0:2]), bool(d[2])
            out.append({"kind": kind, "args": args, "tx": _hex(int(e.transaction_hash)), "block": int(e.block_number)})
        return out

    @answers_checked
    async def find(self, anchor: Anchor) -> str | None:
        block = await self._anchored_block(anchor.checkpoint_hash)
        if block == 0:
            return None
        for event in await self._checkpoint_events(anchor.checkpoint_hash, block):
            return _hex(event.transaction_hash)
        return None

    @answers_checked
    async def verify(self, anchor: Anchor, receipt_ref: str) -> None:
        tx_hash = _parse_ref(receipt_ref)
        await self._check_chain()
        try:
            receipt = await self._rpc(
                "starknet_getTransactionReceipt", lambda c: c.get_transaction_receipt(tx_hash), rpc_errors=True
            )
        except ClientError as exc:
            if _not_found(exc):
                raise AnchorMismatch("the chain has no receipt for this transaction") from None
            raise AnchorUnavailable("Starknet RPC answered the receipt query with an error") from None
        if receipt.execution_status is None or receipt.execution_status.value != "SUCCEEDED":
            raise AnchorMismatch("the anchoring transaction did not succeed")
        st = await self.status(Submitted(self.name, anchor.anchor_id, receipt_ref))
        if not st.final:
            raise AnchorUnavailable(f"anchor not final yet ({st.confirmations} of {self.settings.confirmations})")
        ours = [(list(e.keys), list(e.data)) for e in receipt.events if int(e.from_address) == self.settings.contract]
        expected = expected_events(anchor)
        if anchor.checkpoint_only and ours:  # a proof bundle: the checkpoint event is what is checked
            ours = ours[-1:]
        if len(ours) != len(expected):
            raise AnchorMismatch(f"the transaction emitted {len(ours)} anchor events, expected {len(expected)}")
        for i, (got, want) in enumerate(zip(ours, expected, strict=True)):
            if got != want:
                raise AnchorMismatch(f"event {i} does not match the chain")
        block = int(receipt.block_number)
        events = await self._checkpoint_events(anchor.checkpoint_hash, block)
        mine = [e for e in events if int(e.transaction_hash) == tx_hash]
        if len(events) != 1 or len(mine) != 1 or (list(mine[0].keys), list(mine[0].data)) != expected[-1]:
            raise AnchorMismatch("the chain's event log does not show this checkpoint in this transaction")
        if await self._anchored_block(anchor.checkpoint_hash) != block:
            raise AnchorMismatch("the contract records this checkpoint in a different block")

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "anchors_on_chain": True,
            "rpc": self._where,
            "chain_id": _hex(self.settings.chain_id),
            "contract": _hex(self.settings.contract),
            "account": _hex(self.settings.account),
            "confirmations": self.settings.confirmations,
            "tested_against": "a local stand-in JSON-RPC server only, never a real Starknet node",
        }

    @answers_checked
    async def report(self) -> dict[str, Any]:
        out = self.describe()
        await self._check_chain()
        out["head"] = int(await self._rpc("starknet_blockNumber", lambda c: c.get_block_number()))
        out["account_nonce"] = int(
            await self._rpc(
                "starknet_getNonce", lambda c: c.get_contract_nonce(self.settings.account, block_number="latest")
            )
        )
        return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None
        self._client = None


def _parse_ref(ref: str) -> int:
    try:
        value = int(ref, 16) if ref.startswith("0x") else -1
    except ValueError:
        value = -1
    if not 0 < value < FELT_MAX:
        raise AnchorMismatch("receipt reference is not a 0x-hex Starknet transaction hash")
    return value
