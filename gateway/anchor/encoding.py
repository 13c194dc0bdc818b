"""The spec §18.4.1 hashes, byte for byte. Pure: strings and bytes in, 32-byte hashes out.

Every ``a || b || c`` of §18.4.1 over *strings* is the Ethereum contract ABI encoding of the tuple
``(string a, string b, string c)`` -- Solidity's ``abi.encode(a, b, c)``, never ``abi.encodePacked``
-- hashed with keccak-256. A single string (``agentHash``, ``endpointHash``) is hashed as its raw
UTF-8 bytes, Solidity's ``keccak256(bytes(s))``. Why (docs/anchoring.md has the worked example):

* the plain concatenation of variable-length strings is ambiguous: ``("ab", "c")`` and
  ``("a", "bc")`` would share a hash, so one session could be passed off as another;
* ABI encoding is injective for a fixed tuple type (each string is a 32-byte length word then its
  bytes zero-padded to a 32-byte boundary, reached through 32-byte offset words), and anyone can
  recompute it with the tools the chain's users already have: ``keccak256(abi.encode(...))`` in
  Solidity, ``eth_abi``/web3.py, ethers, viem, ``cast abi-encode``;
* the same bytes serve the Starknet backend: the hashes are computed off chain and only the
  32-byte results are sent, so one verifier checks both chains.

Field values: ``session_id``, ``agent_id``, ``deletion_proof_id`` and ``memory_hash`` are the exact
strings the appliance stores (``memory_hash`` as the agent submitted it, e.g. ``"sha256:ab.."``),
UTF-8 encoded, no normalisation. ``granted_tags_json`` is the RFC 8785 canonical JSON of the
granted tags as a sorted (by code point), de-duplicated array: a function of the *set* of tags, so
a verifier rebuilds it from the session record. ``request_path`` is the *route template* (e.g.
``/v1/memory/{key}``), never a concrete path: a concrete path names a memory key, and the keccak of
a short guessable key is as good as the key itself to anyone with a dictionary.
``payloadHash`` is ``SHA-256(ciphertext)`` over the stored envelope bytes, as §18.4.1 says (not
keccak).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from gateway.core.canonical import canonical_json

HASH_SIZE = 32
MAX_FIELD_BYTES = 4096  # a hashed id or template longer than this is refused, not hashed
MAX_TAGS = 1024


def keccak256(data: bytes) -> bytes:
    """Keccak-256 as Ethereum uses it (the original Keccak padding, not SHA3-256)."""
    from Crypto.Hash import keccak  # pycryptodome: the [anchor] extra

    return bytes(keccak.new(data=data, digest_bits=256).digest())


def _utf8(name: str, value: str) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid Unicode (lone surrogate)") from None
    if len(raw) > MAX_FIELD_BYTES:
        raise ValueError(f"{name} is longer than {MAX_FIELD_BYTES} bytes")
    return raw


def _word(n: int) -> bytes:
    return n.to_bytes(32, "big")


def abi_encode_strings(*values: bytes) -> bytes:
    """``abi.encode(string, string, ...)`` of already UTF-8 encoded strings.

    Head: one 32-byte offset per string (from the start of the encoding). Tail, per string in
    order: a 32-byte big-endian length, then the bytes right-padded with zeros to a multiple of 32
    (nothing for the empty string).
    """
    head = bytearray()
    tail = bytearray()
    offset = 32 * len(values)
    for raw in values:
        head += _word(offset + len(tail))
        tail += _word(len(raw)) + raw + b"\x00" * (-len(raw) % 32)
    return bytes(head + tail)


def granted_tags_json(tags: Iterable[str]) -> bytes:
    """RFC 8785 JSON of the sorted, de-duplicated tag array: ``["a","b"]``."""
    tag_list = list(tags)
    if len(tag_list) > MAX_TAGS:
        raise ValueError(f"more than {MAX_TAGS} granted tags")
    for t in tag_list:
        _utf8("tag", t)
    return canonical_json(sorted(set(tag_list)))


def session_hash(session_id: str, agent_id: str, granted_tags: Iterable[str]) -> bytes:
    """``keccak256(abi.encode(session_id, agent_id, granted_tags_json))``."""
    return keccak256(
        abi_encode_strings(
            _utf8("session_id", session_id), _utf8("agent_id", agent_id), granted_tags_json(granted_tags)
        )
    )


def agent_hash(agent_id: str) -> bytes:
    """``keccak256(bytes(agent_id))``."""
    return keccak256(_utf8("agent_id", agent_id))


def endpoint_hash(route_template: str) -> bytes:
    """``keccak256(bytes(route_template))``: the route, never a path that carries a key or a query."""
    raw = _utf8("route_template", route_template)
    if not route_template.startswith("/") or any(c in route_template for c in "?#%"):
        raise ValueError("endpoint hash takes a route template such as /v1/memory/{key}, without query")
    return keccak256(raw)


def payload_hash(ciphertext: bytes) -> bytes:
    """``sha256(ciphertext)``."""
    return hashlib.sha256(ciphertext).digest()


def deletion_proof_hash(deletion_proof_id: str, session_id: str, memory_hash: str) -> bytes:
    """``keccak256(abi.encode(deletion_proof_id, session_id, memory_hash))``."""
    return keccak256(
        abi_encode_strings(
            _utf8("deletion_proof_id", deletion_proof_id),
            _utf8("session_id", session_id),
            _utf8("memory_hash", memory_hash),
        )
    )


def checkpoint_hash(signed_note: bytes | str) -> bytes:
    """SHA-256 of the signed checkpoint note's bytes (UTF-8), signature lines included: the anchor id."""
    raw = signed_note.encode("utf-8") if isinstance(signed_note, str) else bytes(signed_note)
    return hashlib.sha256(raw).digest()
