"""A local stand-in for a Starknet JSON-RPC node (spec 0.10), for tests/anchor/test_anchor_starknet.py.

It is NOT Starknet: it runs no Cairo. It plays one account (a public key and a nonce) and one
UompAnchor contract whose behaviour it emulates from contracts/cairo/src/lib.cairo (owner check,
at-most-once per checkpoint, the events). What it checks for real, independently of the client:

* the shape of ``starknet_addInvokeTransaction`` (exact field set, hex felts, version 0x3, L1 DA
  modes, resource bounds in range);
* the transaction hash, recomputed here from the JSON fields per SNIP-8 (Poseidon over the v3
  fields), written from the specification rather than taken from starknet-py;
* the signature, checked against the account's public key over that hash;
* the nonce, the ``__execute__`` calldata (one call, to the contract, ``anchor``'s selector,
  the right length) and the anchor arguments (decoded field by field).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from poseidon_py.poseidon_hash import poseidon_hash_many
from starknet_py.hash.selector import get_selector_from_name
from starknet_py.hash.utils import verify_message_signature

HEX = re.compile(r"0x(0|[1-9a-f][0-9a-f]*)")
FELT_MAX = 2**251 + 17 * 2**192
INVOKE_V3_FIELDS = {
    "type",
    "version",
    "sender_address",
    "calldata",
    "signature",
    "nonce",
    "resource_bounds",
    "tip",
    "paymaster_data",
    "account_deployment_data",
    "nonce_data_availability_mode",
    "fee_data_availability_mode",
}
SPEC_VERSION = "0.10.2"


def short_string(s: str) -> int:
    return int.from_bytes(s.encode("ascii"), "big")


class RpcError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def felt(value: Any, name: str) -> int:
    if not isinstance(value, str) or not HEX.fullmatch(value):
        raise RpcError(-32602, f"{name} is not a 0x-hex felt")
    n = int(value, 16)
    if n >= FELT_MAX:
        raise RpcError(-32602, f"{name} is not a felt")
    return n


def invoke_v3_hash(tx: dict[str, Any], chain_id: int) -> int:
    """SNIP-8: h("invoke", version, sender, h(tip, bounds...), h(paymaster), chain, nonce, DA modes,
    h(account deployment data), h(calldata)), h = Poseidon over felts."""

    def bound(name: str, b: dict[str, Any]) -> int:
        amount, price = felt(b["max_amount"], "max_amount"), felt(b["max_price_per_unit"], "max_price_per_unit")
        if amount >= 2**64 or price >= 2**128:
            raise RpcError(-32602, "resource bound out of range")
        return (short_string(name) << 192) | (amount << 128) | price

    rb = tx["resource_bounds"]
    if set(rb) != {"l1_gas", "l2_gas", "l1_data_gas"}:
        raise RpcError(-32602, "resource_bounds must name l1_gas, l2_gas and l1_data_gas")
    fee_fields = poseidon_hash_many(
        [
            felt(tx["tip"], "tip"),
            bound("L1_GAS", rb["l1_gas"]),
            bound("L2_GAS", rb["l2_gas"]),
            bound("L1_DATA", rb["l1_data_gas"]),
        ]
    )
    da = {"L1": 0, "L2": 1}
    modes = (da[tx["nonce_data_availability_mode"]] << 32) | da[tx["fee_data_availability_mode"]]
    return poseidon_hash_many(
        [
            short_string("invoke"),
            felt(tx["version"], "version"),
            felt(tx["sender_address"], "sender_address"),
            fee_fields,
            poseidon_hash_many([felt(x, "paymaster_data") for x in tx["paymaster_data"]]),
            chain_id,
            felt(tx["nonce"], "nonce"),
            modes,
            poseidon_hash_many([felt(x, "account_deployment_data") for x in tx["account_deployment_data"]]),
            poseidon_hash_many([felt(x, "calldata") for x in tx["calldata"]]),
        ]
    )


@dataclass
class Tx:
    hash: int
    block: int | None
    events: list[tuple[list[int], list[int]]]
    reverted: str | None = None


@dataclass
class StandIn:
    chain_id: int
    account: int
    public_key: int
    contract: int
    owner: int
    nonce: int = 0  # the account's nonce as of the latest block (executed transactions)
    head: int = 100
    auto_mine: bool = True
    l1_accepted_upto: int = -1  # blocks <= this are ACCEPTED_ON_L1
    endless_paging: bool = False  # a hostile node: getEvents always says "there is more"
    garble: str = ""  # a broken node: "receipt" (fields missing), "events" (non-hex keys), "call" (two felts)
    txs: dict[int, Tx] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)
    anchored: dict[int, int] = field(default_factory=dict)  # checkpoint hash (as int) -> block
    received: list[dict[str, Any]] = field(default_factory=list)  # every accepted invoke, as sent
    calls: list[str] = field(default_factory=list)  # every method called, in order

    # --- block production --------------------------------------------------------------------

    def mine(self, blocks: int = 1) -> None:
        for _ in range(blocks):
            self.head += 1
            for h in self.pending:
                self._execute(self.txs[h], self.head)
            self.pending.clear()

    def drop(self, tx_hash: int) -> None:
        """The node forgets a pooled transaction (restart, eviction)."""
        self.pending.remove(tx_hash)
        del self.txs[tx_hash]

    def _execute(self, tx: Tx, block: int) -> None:
        self.nonce += 1  # the account's nonce moves on execution, reverted or not
        tx.block = block
        args = tx.events  # decoded anchor call stashed here until execution
        self.txs[tx.hash] = tx
        tx.events = []
        if tx.reverted:
            return
        root, size, cp = args[0][1][0], args[0][1][1], args[0][1][2]
        if cp in self.anchored:
            tx.reverted = "ALREADY_ANCHORED"
            return
        self.anchored[cp] = block
        tx.events = [*args[1:], self._checkpoint_event(root, size, cp)]

    def _checkpoint_event(self, root: int, size: int, cp: int) -> tuple[list[int], list[int]]:
        sel = get_selector_from_name("CheckpointAnchored")
        return [sel, cp & (2**128 - 1), cp >> 128], [root & (2**128 - 1), root >> 128, size]

    # --- the contract ------------------------------------------------------------------------

    def decode_anchor(self, cd: list[int]) -> list[tuple[list[int], list[int]]]:
        """(root, size, checkpoint) then the events, as the Cairo contract would emit them."""
        pos = 0

        def take(n: int) -> list[int]:
            nonlocal pos
            if pos + n > len(cd):
                raise RpcError(-32602, "anchor calldata too short")
            out = cd[pos : pos + n]
            pos += n
            return out

        def u256() -> tuple[int, list[int]]:
            lo, hi = take(2)
            if lo >= 2**128 or hi >= 2**128:
                raise RpcError(-32602, "u256 limb out of range")
            return lo | (hi << 128), [lo, hi]

        root, _ = u256()
        (size,) = take(1)
        if size >= 2**64:
            raise RpcError(-32602, "tree_size is not a u64")
        cp, _ = u256()
        out: list[tuple[list[int], list[int]]] = [([], [root, size, cp])]
        sel = get_selector_from_name
        for name, layout in (
            ("SessionGranted", "kk1"),
            ("SessionRevoked", "kk"),
            ("GatewayAccess", "kkdb"),
            ("PayloadAnchored", "kkd"),
            ("DataDeletionProofSubmitted", "kkd"),
        ):
            (count,) = take(1)
            if count > 1000:
                raise RpcError(-32602, "array too long")
            for _ in range(count):
                keys, data = [sel(name)], []
                for kind in layout:
                    if kind == "k":
                        keys += u256()[1]
                    elif kind == "d":
                        data += u256()[1]
                    elif kind == "1":
                        (v,) = take(1)
                        if v >= 2**64:
                            raise RpcError(-32602, "expires_at is not a u64")
                        data.append(v)
                    else:
                        (v,) = take(1)
                        if v not in (0, 1):
                            raise RpcError(-32602, "bool is not 0 or 1")
                        data.append(v)
                out.append((keys, data))
        if pos != len(cd):
            raise RpcError(-32602, "anchor calldata has trailing felts")
        return out

    # --- JSON-RPC ----------------------------------------------------------------------------

    def add_invoke(self, params: dict[str, Any]) -> dict[str, Any]:
        tx = params.get("invoke_transaction")
        if not isinstance(tx, dict) or set(tx) != INVOKE_V3_FIELDS:
            raise RpcError(-32602, "invoke_transaction has the wrong fields")
        if tx["type"] != "INVOKE" or tx["version"] != "0x3":
            raise RpcError(-32602, "only INVOKE v3")
        if tx["nonce_data_availability_mode"] != "L1" or tx["fee_data_availability_mode"] != "L1":
            raise RpcError(-32602, "data availability modes must be L1")
        if felt(tx["sender_address"], "sender_address") != self.account:
            raise RpcError(20, "Contract not found")
        h = invoke_v3_hash(tx, self.chain_id)
        sig = [felt(x, "signature") for x in tx["signature"]]
        if len(sig) != 2 or not verify_message_signature(h, sig, self.public_key):
            raise RpcError(55, "Account validation failed: invalid signature")
        if felt(tx["nonce"], "nonce") != self.nonce + len(self.pending):  # no gaps, no duplicates
            raise RpcError(52, "Invalid transaction nonce")
        cd = [felt(x, "calldata") for x in tx["calldata"]]
        if len(cd) < 4 or cd[0] != 1 or cd[1] != self.contract or cd[2] != get_selector_from_name("anchor"):
            raise RpcError(-32602, "expected one call to the anchor contract's anchor entry point")
        if cd[3] != len(cd) - 4:
            raise RpcError(-32602, "inner calldata length is wrong")
        decoded = self.decode_anchor(cd[4:])
        self.received.append(tx)
        record = Tx(hash=h, block=None, events=decoded, reverted=None if self.account == self.owner else "NOT_OWNER")
        self.txs[h] = record
        self.pending.append(h)
        if self.auto_mine:
            self.mine(1)
        return {"transaction_hash": hex(h)}

    def receipt(self, params: dict[str, Any]) -> dict[str, Any]:
        h = felt(params.get("transaction_hash"), "transaction_hash")
        tx = self.txs.get(h)
        if tx is None or tx.block is None:
            raise RpcError(29, "Transaction hash not found")
        out: dict[str, Any] = {
            "type": "INVOKE",
            "transaction_hash": hex(h),
            "actual_fee": {"amount": "0x1", "unit": "FRI"},
            "execution_status": "REVERTED" if tx.reverted else "SUCCEEDED",
            "finality_status": "ACCEPTED_ON_L1" if tx.block <= self.l1_accepted_upto else "ACCEPTED_ON_L2",
            "block_hash": hex(0xB10C000 + tx.block),
            "block_number": tx.block,
            "messages_sent": [],
            "events": [
                {"from_address": hex(self.contract), "keys": [hex(k) for k in keys], "data": [hex(d) for d in data]}
                for keys, data in tx.events
            ],
            "execution_resources": {"l1_gas": 0, "l1_data_gas": 128, "l2_gas": 1000000},
        }
        if tx.reverted:
            out["revert_reason"] = tx.reverted
        return out

    def tx_status(self, params: dict[str, Any]) -> dict[str, Any]:
        h = felt(params.get("transaction_hash"), "transaction_hash")
        tx = self.txs.get(h)
        if tx is None:
            raise RpcError(29, "Transaction hash not found")
        if tx.block is None:
            return {"finality_status": "RECEIVED"}
        return {"finality_status": "ACCEPTED_ON_L2", "execution_status": "REVERTED" if tx.reverted else "SUCCEEDED"}

    def call(self, params: dict[str, Any]) -> list[str]:
        req = params["request"]
        if felt(req["contract_address"], "contract_address") != self.contract:
            raise RpcError(20, "Contract not found")
        if felt(req["entry_point_selector"], "selector") != get_selector_from_name("anchored_block"):
            raise RpcError(21, "Invalid message selector")
        lo, hi = (felt(x, "calldata") for x in req["calldata"])
        return [hex(self.anchored.get(lo | (hi << 128), 0))]

    def events(self, params: dict[str, Any]) -> dict[str, Any]:
        flt = params["filter"]
        if self.endless_paging:
            return {"events": [], "continuation_token": "more"}
        lo = flt.get("from_block", {}).get("block_number", 0)
        hi = flt.get("to_block", {}).get("block_number", self.head)
        keys = [[felt(k, "key") for k in alt] for alt in flt.get("keys", [])]
        if felt(flt.get("address"), "address") != self.contract:
            return {"events": []}
        out = []
        for tx in sorted(self.txs.values(), key=lambda t: (t.block or 0, t.hash)):
            if tx.block is None or not lo <= tx.block <= hi:
                continue
            for i, (ek, ed) in enumerate(tx.events):
                if all(not alt or (j < len(ek) and ek[j] in alt) for j, alt in enumerate(keys)):
                    out.append(
                        {
                            "from_address": hex(self.contract),
                            "keys": [hex(k) for k in ek],
                            "data": [hex(d) for d in ed],
                            "block_hash": hex(0xB10C000 + tx.block),
                            "block_number": tx.block,
                            "transaction_hash": hex(tx.hash),
                            "transaction_index": 0,
                            "event_index": i,
                        }
                    )
        return {"events": out}

    def dispatch(self, method: str, params: Any) -> Any:
        self.calls.append(method)
        result = self._dispatch(method, params)
        if self.garble == "receipt" and method == "starknet_getTransactionReceipt":
            return {"transaction_hash": result["transaction_hash"]}
        if self.garble == "events" and method == "starknet_getEvents":
            return {"events": [{**e, "keys": ["banana"]} for e in result["events"]] or [{"keys": ["banana"]}]}
        if self.garble == "call" and method == "starknet_call":
            return [*result, "0x1"]
        return result

    def _dispatch(self, method: str, params: Any) -> Any:
        if method == "starknet_specVersion":
            return SPEC_VERSION
        if method == "starknet_chainId":
            return hex(self.chain_id)
        if method == "starknet_blockNumber":
            return self.head
        if method == "starknet_getNonce":
            if felt(params.get("contract_address"), "contract_address") != self.account:
                raise RpcError(20, "Contract not found")
            return hex(self.nonce)
        handlers = {
            "starknet_addInvokeTransaction": self.add_invoke,
            "starknet_getTransactionReceipt": self.receipt,
            "starknet_getTransactionStatus": self.tx_status,
            "starknet_call": self.call,
            "starknet_getEvents": self.events,
        }
        if method not in handlers:
            raise RpcError(-32601, "Method not found")
        return handlers[method](params)


class StandInServer:
    """The stand-in behind aiohttp on 127.0.0.1; ``stop``/``start`` keep its state and port."""

    def __init__(self, node: StandIn) -> None:
        self.node = node
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/rpc"

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            result = self.node.dispatch(body["method"], body.get("params", {}))
        except RpcError as exc:
            return web.json_response(
                {"jsonrpc": "2.0", "id": body.get("id"), "error": {"code": exc.code, "message": exc.message}}
            )
        except (KeyError, TypeError, ValueError) as exc:
            return web.json_response(
                {
                    "jsonrpc": "2.0",
                    "id": body.get("id"),
                    "error": {"code": -32602, "message": f"Invalid params: {type(exc).__name__}"},
                }
            )
        return web.json_response({"jsonrpc": "2.0", "id": body.get("id"), "result": result})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/rpc", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        if not self.port:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
