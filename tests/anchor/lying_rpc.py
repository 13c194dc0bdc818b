"""A JSON-RPC stand-in on 127.0.0.1 that forwards every call to a real anvil but lies in named ways.

``LyingRpc.lies`` is a set of lie names, changed by the test at any time:

* ``receipt_to_other``: a receipt's ``to`` is another address;
* ``receipt_no_logs``: a receipt keeps ``status = 1`` and loses its logs;
* ``logs_other_contract``: every log (in receipts and ``eth_getLogs``) comes from another address;
* ``other_root``: the ``CheckpointAnchored`` log carries another root;
* ``no_code`` / ``other_code``: ``eth_getCode`` answers nothing / other bytes;
* ``other_chain``: ``eth_chainId`` answers another chain (a replaced node);
* ``fabricated``: nothing is sent; ``anchoredBlock`` answers a block, ``eth_getLogs`` a made-up
  ``CheckpointAnchored`` log in a made-up transaction, whose receipt is a real receipt of the
  decoy transaction (``decoy``: a plain transfer made by the test) under the made-up hash.

Only the answers change; what the node does is anvil's own.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import aiohttp
from aiohttp import web
from anchorkit import free_port

from gateway.anchor.encoding import keccak256

OTHER = "0x000000000000000000000000000000000000dEaD"
ANCHORED_BLOCK = "0x" + keccak256(b"anchoredBlock(bytes32)")[:4].hex()
CHECKPOINT_TOPIC = "0x" + keccak256(b"CheckpointAnchored(bytes32,uint64,bytes32)").hex()
LIES = frozenset(
    {
        "receipt_to_other",
        "receipt_no_logs",
        "logs_other_contract",
        "other_root",
        "no_code",
        "other_code",
        "other_chain",
        "fabricated",
    }
)


class LyingRpc:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.lies: set[str] = set()
        self.decoy: str | None = None  # a real transaction hash (fabricated receipts copy it)
        self.fake_hash = "0x" + hashlib.sha256(b"made up").hexdigest()
        self.sent_raw = 0  # eth_sendRawTransaction calls forwarded
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/", self._handle)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, method: str, params: list[Any]) -> dict[str, Any]:
        assert self._session is not None
        async with self._session.post(
            self.upstream, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
        ) as resp:
            out: dict[str, Any] = await resp.json()
            return out

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        if isinstance(body, list):
            return web.json_response([await self._one(b) for b in body])
        return web.json_response(await self._one(body))

    async def _one(self, req: dict[str, Any]) -> dict[str, Any]:
        method, params = req["method"], req.get("params") or []
        out = await self._answer(method, params)
        out["id"] = req.get("id")
        return out

    async def _answer(self, method: str, params: list[Any]) -> dict[str, Any]:
        lies = self.lies
        if "fabricated" in lies:
            made = await self._fabricated(method, params)
            if made is not None:
                return {"jsonrpc": "2.0", "result": made}
        if method == "eth_sendRawTransaction":
            self.sent_raw += 1
        if method == "eth_getCode" and "no_code" in lies:
            return {"jsonrpc": "2.0", "result": "0x"}
        if method == "eth_chainId" and "other_chain" in lies:
            return {"jsonrpc": "2.0", "result": "0x1"}
        if method == "eth_getCode" and "other_code" in lies:
            return {"jsonrpc": "2.0", "result": "0x6080604052600080fd"}
        out = await self._forward(method, params)
        result = out.get("result")
        if method == "eth_getTransactionReceipt" and isinstance(result, dict):
            if "receipt_to_other" in lies:
                result["to"] = OTHER
            if "receipt_no_logs" in lies:
                result["logs"] = []
            result["logs"] = [self._log(x) for x in result.get("logs", [])]
        if method == "eth_getLogs" and isinstance(result, list):
            out["result"] = [self._log(x) for x in result]
        return out

    def _log(self, log: dict[str, Any]) -> dict[str, Any]:
        log = copy.deepcopy(log)
        if "logs_other_contract" in self.lies:
            log["address"] = OTHER
        if "other_root" in self.lies and log.get("topics", [None])[0] == CHECKPOINT_TOPIC:
            data = log["data"][2:]
            log["data"] = "0x" + hashlib.sha256(b"another root").hexdigest() + data[64:]
        return log

    async def _fabricated(self, method: str, params: list[Any]) -> Any:
        if method == "eth_sendRawTransaction":
            return self.fake_hash  # never forwarded: no transaction reaches the chain
        if method == "eth_call" and str(params[0].get("data", "")).startswith(ANCHORED_BLOCK):
            return "0x" + (1).to_bytes(32, "big").hex()
        if method in ("eth_getTransactionReceipt", "eth_getTransactionByHash") and params[0] == self.fake_hash:
            assert self.decoy is not None
            real = (await self._forward(method, [self.decoy]))["result"]
            real["transactionHash" if method == "eth_getTransactionReceipt" else "hash"] = self.fake_hash
            return real
        if method == "eth_getLogs":
            flt = params[0]
            topics = flt.get("topics") or []
            if len(topics) == 2 and topics[0] == CHECKPOINT_TOPIC:
                assert self.decoy is not None
                real = (await self._forward("eth_getTransactionReceipt", [self.decoy]))["result"]
                address = flt.get("address")
                return [
                    {
                        "address": address[0] if isinstance(address, list) else address,
                        "topics": topics,
                        "data": "0x" + "00" * 32 + (7).to_bytes(32, "big").hex(),
                        "blockNumber": real["blockNumber"],
                        "blockHash": real["blockHash"],
                        "transactionHash": self.fake_hash,
                        "transactionIndex": "0x0",
                        "logIndex": "0x0",
                        "removed": False,
                    }
                ]
        return None
