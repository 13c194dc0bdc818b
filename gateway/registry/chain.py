"""Reading an ERC-8004 Identity Registry over plain Ethereum JSON-RPC, bounded.

Only reads: ``eth_chainId``, ``eth_getCode``, ``eth_blockNumber``, ``eth_call`` (``ownerOf``,
``tokenURI``, ``getMetadata``, ``supportsInterface``) and ``eth_getLogs`` (``Registered``,
``URIUpdated``, ``Transfer``). Every call has a time-out and a bounded answer size, and every
answer is checked for its shape: a node that answers something else (garbage, another chain, a
wrong type, an address without code) is ``REGISTRY_UNAVAILABLE`` with a message naming the node as
scheme://host:port only (RPC URLs often carry API keys).

The ABI encodings are written out here (a handful of fixed signatures) instead of pulling in a
full Ethereum client for reads; ``tests/registry`` checks them against the compiled contract's ABI
and against a real anvil.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.anchor.base import redact_url
from gateway.errors import ErrorCode, UompError

MAX_RPC_ANSWER_BYTES = 16 * 1024 * 1024
MAX_LOGS_ANSWER_BYTES = 4 * 1024 * 1024  # one eth_getLogs answer; a larger range is halved
MAX_STRING_BYTES = 64 * 1024  # a tokenURI / metadata value longer than this is refused
ERC721_INTERFACE = bytes.fromhex("80ac58cd")
_HEX = re.compile(r"0x[0-9a-fA-F]*")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{40}")


# keccak-256 of the signatures, written out (tests/registry checks each against keccak and the ABI)
SELECTORS = {
    "supportsInterface(bytes4)": bytes.fromhex("01ffc9a7"),
    "ownerOf(uint256)": bytes.fromhex("6352211e"),
    "tokenURI(uint256)": bytes.fromhex("c87b56dd"),
    "getMetadata(uint256,string)": bytes.fromhex("cb4799f2"),
}
REGISTERED = "0xca52e62c367d81bb2e328eb795f7c7ba24afb478408a26c0e201d155c449bc4a"  # Registered(uint256,string,address)
URI_UPDATED = "0x3a2c7fffc2cba7582c690e3b82c453ea02a308326a98a3ad7576c606336409fb"  # URIUpdated(uint256,string,address)
TRANSFER = "0xddf252ad1be2c89b69c2b068fc378daa952ba7f163c4a11628f55a4df523b3ef"  # Transfer(address,address,uint256)


def selector(signature: str) -> bytes:
    """The 4-byte function selector of a known contract ``signature``."""
    return SELECTORS[signature]


@dataclass(frozen=True)
class LogEvent:
    """One registry event read from the chain: its kind, block and agent."""

    kind: str  # "registered" | "uri" | "transfer"
    block: int
    index: int
    agent_id: int
    uri: str | None
    owner: str | None


class RpcRefused(UompError):
    """The node answered with a JSON-RPC error (for eth_call: the contract reverted)."""


class AnswerTooLarge(UompError):
    """The node's answer is over MAX_RPC_ANSWER_BYTES (for eth_getLogs: ask for fewer blocks)."""


def _word(n: int) -> bytes:
    return n.to_bytes(32, "big")


def _encode_string(s: bytes) -> bytes:
    pad = (-len(s)) % 32
    return _word(len(s)) + s + b"\0" * pad


class Chain:
    """One registry contract on one node."""

    def __init__(self, rpc_url: str, chain_id: int, address: str, *, timeout_s: float) -> None:
        self.rpc_url, self.chain_id, self.address, self.timeout_s = rpc_url, chain_id, address.lower(), timeout_s
        self.node = redact_url(rpc_url)

    # ---------------------------------------------------------------- transport

    def _bad(self, what: str) -> UompError:
        return UompError(
            ErrorCode.REGISTRY_UNAVAILABLE,
            f"the registry's node {self.node} {what}; check the --rpc URL and that it is the chain you meant",
        )

    def rpc(self, method: str, *params: Any, max_bytes: int | None = None) -> Any:
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": list(params)}).encode()
        # the URL is http(s), checked when the registry was added (check_rpc_url)
        req = urllib.request.Request(self.rpc_url, data=body, headers={"Content-Type": "application/json"})  # noqa: S310
        deadline = time.monotonic() + self.timeout_s
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310
                raw = self._read(resp, method, deadline, max_bytes or MAX_RPC_ANSWER_BYTES)
        except urllib.error.HTTPError as exc:
            raise self._bad(f"answered HTTP {exc.code} to {method}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise self._bad(f"cannot be reached or did not answer {method} in {self.timeout_s:g} s") from exc
        if len(raw) > (max_bytes or MAX_RPC_ANSWER_BYTES):
            bad = self._bad(f"answered {method} with more than {max_bytes or MAX_RPC_ANSWER_BYTES} bytes")
            raise AnswerTooLarge(bad.code, bad.message)
        try:
            out = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise self._bad(f"answered {method} with something that is not JSON") from exc
        if not isinstance(out, dict):
            raise self._bad(f"answered {method} with something that is not a JSON-RPC answer")
        if "error" in out:
            err = out["error"]
            msg = err.get("message") if isinstance(err, dict) else None
            text = msg[:120] if isinstance(msg, str) else "an error"
            raise RpcRefused(
                ErrorCode.REGISTRY_UNAVAILABLE, f"the registry's node {self.node} refused {method}: {text}"
            )
        if "result" not in out:
            raise self._bad(f"answered {method} without a result")
        return out["result"]

    def _read(self, resp: Any, method: str, deadline: float, limit: int) -> bytes:
        """The whole answer by ``deadline`` (however slowly the node drips it), at most the size bound + 1."""
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            if time.monotonic() > deadline:
                raise self._bad(f"did not finish answering {method} in {self.timeout_s:g} s")
            chunk = resp.read1(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)

    def _quantity(self, value: Any, what: str) -> int:
        if not isinstance(value, str) or not _HEX.fullmatch(value) or len(value) < 3 or len(value) > 66:
            raise self._bad(f"answered {what} with something that is not a number")
        return int(value, 16)

    def _data(self, value: Any, what: str) -> bytes:
        if not isinstance(value, str) or not _HEX.fullmatch(value) or len(value) % 2:
            raise self._bad(f"answered {what} with something that is not hex data")
        return bytes.fromhex(value[2:])

    def call(self, data: bytes, what: str) -> bytes:
        return self._data(self.rpc("eth_call", {"to": self.address, "data": "0x" + data.hex()}, "latest"), what)

    # ---------------------------------------------------------------- checks and reads

    def check(self) -> None:
        """The node is on the configured chain and the address holds an ERC-721 contract."""
        got = self._quantity(self.rpc("eth_chainId"), "eth_chainId")
        if got != self.chain_id:
            raise self._bad(f"is on chain {got}, not chain {self.chain_id}")
        code = self._data(self.rpc("eth_getCode", self.address, "latest"), "eth_getCode")
        if not code:
            raise UompError(
                ErrorCode.REGISTRY_UNAVAILABLE,
                f"no contract at {self.address} on chain {self.chain_id}; check the registry address",
            )
        try:
            answer = self.call(
                selector("supportsInterface(bytes4)") + ERC721_INTERFACE.ljust(32, b"\0"), "supportsInterface"
            )
        except UompError:
            answer = b""
        if len(answer) != 32 or int.from_bytes(answer, "big") != 1:
            raise UompError(
                ErrorCode.REGISTRY_UNAVAILABLE,
                f"the contract at {self.address} is not an ERC-721 (ERC-8004 Identity) registry",
            )

    def block_number(self) -> int:
        return self._quantity(self.rpc("eth_blockNumber"), "eth_blockNumber")

    def _string_result(self, data: bytes, what: str) -> bytes:
        if len(data) < 64:
            raise self._bad(f"answered {what} with too few bytes")
        offset = int.from_bytes(data[:32], "big")
        if offset + 32 > len(data):
            raise self._bad(f"answered {what} with a bad offset")
        length = int.from_bytes(data[offset : offset + 32], "big")
        if length > MAX_STRING_BYTES or offset + 32 + length > len(data):
            raise self._bad(f"answered {what} with a bad or too long value")
        return data[offset + 32 : offset + 32 + length]

    def owner_of(self, agent_id: int) -> str | None:
        """The token's owner, or None when the registry has no such agent (the call reverts)."""
        try:
            data = self.call(selector("ownerOf(uint256)") + _word(agent_id), "ownerOf")
        except RpcRefused:  # a revert: no such token
            return None
        if len(data) != 32 or data[:12] != b"\0" * 12:
            raise self._bad("answered ownerOf with something that is not an address")
        return "0x" + data[12:].hex()

    def token_uri(self, agent_id: int) -> str:
        data = self.call(selector("tokenURI(uint256)") + _word(agent_id), "tokenURI")
        raw = self._string_result(data, "tokenURI")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._bad("answered tokenURI with bytes that are not UTF-8") from exc

    def metadata(self, agent_id: int, key: str) -> bytes:
        k = key.encode()
        data = selector("getMetadata(uint256,string)") + _word(agent_id) + _word(64) + _encode_string(k)
        return self._string_result(self.call(data, "getMetadata"), "getMetadata")

    # ---------------------------------------------------------------- events

    def events(self, from_block: int, to_block: int, block_range: int) -> Iterator[LogEvent]:
        """Registered, URIUpdated and Transfer events of the registry in [from_block, to_block], in chain order.

        At most ``block_range`` blocks a call; a range whose answer is over the size bound is halved
        and asked again (down to one block, whose answer over the bound is an error)."""
        start = from_block
        span = block_range
        while start <= to_block:
            end = min(to_block, start + span - 1)
            try:
                logs = self.rpc(
                    "eth_getLogs",
                    {
                        "address": self.address,
                        "fromBlock": hex(start),
                        "toBlock": hex(end),
                        "topics": [[REGISTERED, URI_UPDATED, TRANSFER]],
                    },
                    max_bytes=MAX_LOGS_ANSWER_BYTES,
                )
            except AnswerTooLarge:
                if end == start:
                    raise
                span = max(1, (end - start + 1) // 2)
                continue
            if not isinstance(logs, list):
                raise self._bad("answered eth_getLogs with something that is not a list")
            parsed = [self._log(entry) for entry in logs]
            yield from sorted((e for e in parsed if e is not None), key=lambda e: (e.block, e.index))
            start = end + 1
            span = block_range

    def _log(self, entry: Any) -> LogEvent | None:
        if not isinstance(entry, dict):
            raise self._bad("answered eth_getLogs with an entry that is not an object")
        if str(entry.get("address", "")).lower() != self.address:
            raise self._bad("answered eth_getLogs with a log of another contract")
        if entry.get("removed") is True:
            return None
        topics = entry.get("topics")
        if not isinstance(topics, list) or not topics or not all(isinstance(t, str) for t in topics):
            raise self._bad("answered eth_getLogs with a log without topics")
        block = self._quantity(entry.get("blockNumber"), "eth_getLogs")
        index = self._quantity(entry.get("logIndex"), "eth_getLogs")
        t0 = topics[0].lower()
        if t0 in (REGISTERED, URI_UPDATED):
            if len(topics) != 3:
                raise self._bad("answered eth_getLogs with a Registered/URIUpdated log of the wrong shape")
            agent_id = self._quantity(topics[1], "eth_getLogs")
            data = self._data(entry.get("data"), "eth_getLogs")
            try:
                uri = self._string_result(data, "eth_getLogs").decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self._bad("answered eth_getLogs with a URI that is not UTF-8") from exc
            owner = self._topic_address(topics[2]) if t0 == REGISTERED else None
            return LogEvent("registered" if t0 == REGISTERED else "uri", block, index, agent_id, uri, owner)
        if t0 == TRANSFER:
            if len(topics) != 4:
                return None  # an ERC-20-shaped Transfer cannot come from this registry; ignore it
            return LogEvent(
                "transfer", block, index, self._quantity(topics[3], "eth_getLogs"), None, self._topic_address(topics[2])
            )
        return None

    def _topic_address(self, t: str) -> str:
        if not _HEX.fullmatch(t) or len(t) != 66 or t[2:26].strip("0"):
            raise self._bad("answered eth_getLogs with a topic that is not an address")
        return "0x" + t[26:].lower()


def is_address(text: str) -> bool:
    """Whether ``text`` is a 0x-prefixed 20-byte hex address."""
    return bool(_ADDRESS.fullmatch(text))
