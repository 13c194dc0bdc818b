"""``did:key`` for Ed25519 keys and the base58btc alphabet it is written in, pure.

A ``did:key`` names a key by spelling the key itself: ``did:key:z`` + base58btc(0xed 0x01 ||
32-byte Ed25519 public key) (the multicodec prefix ``ed25519-pub`` and the multibase ``z``). It is
self-certifying (whoever holds the private key can sign for it) and says nothing about who that
is: that is the user's trust list (:mod:`gateway.trust`, spec §16.4).

:func:`fingerprint` is the short form shown to people next to the full DID: ``SHA256:`` and the
base64url RFC 7638 thumbprint of the key's JWK (the same thumbprint ``cnf.jkt`` uses).
"""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import jose

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}
MAX_B58 = 512  # characters; bounds the big-integer work
ED25519_PUB_MULTICODEC = b"\xed\x01"  # varint(0xed), multicodec "ed25519-pub"
DID_KEY_PREFIX = "did:key:z"


def b58btc_encode(data: bytes) -> str:
    """Bitcoin-alphabet base58: one '1' per leading zero byte, then the big-endian number."""
    zeros = len(data) - len(data.lstrip(b"\x00"))
    n = int.from_bytes(data, "big")
    digits: list[str] = []
    while n:
        n, r = divmod(n, 58)
        digits.append(_B58[r])
    return "1" * zeros + "".join(reversed(digits))


def b58btc_decode(text: str) -> bytes:
    """Inverse of :func:`b58btc_encode`; ValueError on any character outside the alphabet."""
    if not isinstance(text, str) or len(text) > MAX_B58:
        raise ValueError("not base58btc")
    n = 0
    for c in text:
        idx = _B58_INDEX.get(c)
        if idx is None:
            raise ValueError("not base58btc")
        n = n * 58 + idx
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\x00" * zeros + body


def did_key_from_public(pub: ed25519.Ed25519PublicKey) -> str:
    """``did:key:z…`` for an Ed25519 public key (multibase base58btc of 0xed01 || 32 bytes)."""
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return DID_KEY_PREFIX + b58btc_encode(ED25519_PUB_MULTICODEC + raw)


def public_key_from_did_key(did: str) -> ed25519.Ed25519PublicKey:
    """The Ed25519 key inside a ``did:key``; ValueError for any other shape or key type."""
    if not isinstance(did, str) or not did.startswith(DID_KEY_PREFIX):
        raise ValueError("not a base58btc did:key")
    decoded = b58btc_decode(did[len(DID_KEY_PREFIX) :])
    if len(decoded) != 34 or not decoded.startswith(ED25519_PUB_MULTICODEC):
        raise ValueError("did:key is not an Ed25519 public key")
    return ed25519.Ed25519PublicKey.from_public_bytes(decoded[2:])


def fingerprint(pub: ed25519.Ed25519PublicKey) -> str:
    """``SHA256:<base64url RFC 7638 thumbprint>``: the short name of a key shown to the user."""
    return "SHA256:" + jose.key_thumbprint(pub)
