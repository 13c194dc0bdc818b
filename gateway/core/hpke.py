"""HPKE (RFC 9180) base mode with DHKEM(X25519, HKDF-SHA256) and HKDF-SHA256, pure.

Composed from ``cryptography``'s X25519, HMAC-SHA256 / HKDF-Expand and AES-GCM exactly as RFC 9180
§4 (the labelled KDF), §4.1 (DHKEM), §5.1 (key schedule) and §5.2 (nonce sequence) say. We carry
our own composition instead of ``cryptography.hazmat.primitives.hpke.Suite`` because that API has
no ``aad`` and no way to fix the ephemeral key, so it cannot be checked against the RFC's
known-answer vectors; the tests check this module against RFC 9180 A.1.1 (same KEM and KDF, the
AES-128-GCM AEAD) and against ``cryptography``'s own HPKE for the AES-256-GCM suite we use, in
both directions.

The suite the payload relay uses is :data:`X25519_SHA256_AES256GCM` (0x0020, 0x0001, 0x0002).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

MODE_BASE = 0x00
KEM_X25519_SHA256 = 0x0020
KDF_HKDF_SHA256 = 0x0001
N_H = 32  # HKDF-SHA256 output
N_ENC = 32  # X25519 public key
N_N = 12  # AES-GCM nonce
N_T = 16  # AES-GCM tag
_VERSION = b"HPKE-v1"


class HpkeError(ValueError):
    """Decryption failed, a key is malformed, or a sequence number is exhausted."""


@dataclass(frozen=True)
class Suite:
    """An HPKE ciphersuite with the X25519/HKDF-SHA256 KEM: the AEAD and its key length."""

    aead_id: int
    key_len: int  # Nk

    @property
    def kem_suite_id(self) -> bytes:
        return b"KEM" + KEM_X25519_SHA256.to_bytes(2, "big")

    @property
    def suite_id(self) -> bytes:
        return (
            b"HPKE"
            + KEM_X25519_SHA256.to_bytes(2, "big")
            + KDF_HKDF_SHA256.to_bytes(2, "big")
            + self.aead_id.to_bytes(2, "big")
        )


X25519_SHA256_AES128GCM = Suite(aead_id=0x0001, key_len=16)
X25519_SHA256_AES256GCM = Suite(aead_id=0x0002, key_len=32)


def _extract(salt: bytes, ikm: bytes) -> bytes:
    # HKDF-Extract (RFC 5869 §2.2): HMAC-Hash(salt, IKM); an empty salt acts as HashLen zeros.
    return hmac.new(salt or bytes(N_H), ikm, "sha256").digest()


def _expand(prk: bytes, info: bytes, length: int) -> bytes:
    return HKDFExpand(hashes.SHA256(), length, info).derive(prk)


def labeled_extract(suite_id: bytes, salt: bytes, label: bytes, ikm: bytes) -> bytes:
    """LabeledExtract (RFC 9180 §4)."""
    return _extract(salt, _VERSION + suite_id + label + ikm)


def labeled_expand(suite_id: bytes, prk: bytes, label: bytes, info: bytes, length: int) -> bytes:
    """LabeledExpand (RFC 9180 §4)."""
    return _expand(prk, length.to_bytes(2, "big") + _VERSION + suite_id + label + info, length)


def _raw(pk: X25519PublicKey) -> bytes:
    return pk.public_bytes(Encoding.Raw, PublicFormat.Raw)


def public_key_from_bytes(raw: bytes) -> X25519PublicKey:
    """An X25519 public key from its 32 raw bytes; HpkeError for another length."""
    if len(raw) != N_ENC:
        raise HpkeError("an X25519 public key is 32 bytes")
    return X25519PublicKey.from_public_bytes(raw)


def derive_key_pair(ikm: bytes) -> X25519PrivateKey:
    """DeriveKeyPair (RFC 9180 §7.1.3) for X25519: deterministic, for known-answer tests."""
    kem = X25519_SHA256_AES256GCM.kem_suite_id
    dkp_prk = labeled_extract(kem, b"", b"dkp_prk", ikm)
    return X25519PrivateKey.from_private_bytes(labeled_expand(kem, dkp_prk, b"sk", b"", 32))


def _dh(sk: X25519PrivateKey, pk: X25519PublicKey) -> bytes:
    try:
        dh = sk.exchange(pk)
    except ValueError:  # all-zero shared secret: a low-order public key
        raise HpkeError("invalid X25519 public key") from None
    if not any(dh):
        raise HpkeError("invalid X25519 public key")
    return dh


def _extract_and_expand(dh: bytes, kem_context: bytes) -> bytes:
    kem = X25519_SHA256_AES256GCM.kem_suite_id
    eae_prk = labeled_extract(kem, b"", b"eae_prk", dh)
    return labeled_expand(kem, eae_prk, b"shared_secret", kem_context, N_H)


def encap(pk_r: X25519PublicKey, *, eph: X25519PrivateKey | None = None) -> tuple[bytes, bytes]:
    """(shared_secret, enc). ``eph`` fixes the ephemeral key (tests only)."""
    sk_e = eph or X25519PrivateKey.generate()
    enc = _raw(sk_e.public_key())
    shared = _extract_and_expand(_dh(sk_e, pk_r), enc + _raw(pk_r))
    return shared, enc


def decap(enc: bytes, sk_r: X25519PrivateKey) -> bytes:
    """Decap (RFC 9180 §4.1): the shared secret from the sender's ``enc`` and the recipient's key."""
    pk_e = public_key_from_bytes(enc)
    return _extract_and_expand(_dh(sk_r, pk_e), enc + _raw(sk_r.public_key()))


class Context:
    """An HPKE encryption context (RFC 9180 §5.2): one key, a base nonce and a sequence number."""

    def __init__(self, suite: Suite, key: bytes, base_nonce: bytes, exporter_secret: bytes) -> None:
        self.suite = suite
        self._aead = AESGCM(key)
        self.base_nonce = base_nonce
        self.exporter_secret = exporter_secret
        self.seq = 0

    def _nonce(self) -> bytes:
        if self.seq >= (1 << (8 * N_N)) - 1:
            raise HpkeError("message limit reached")
        return bytes(a ^ b for a, b in zip(self.base_nonce, self.seq.to_bytes(N_N, "big"), strict=True))

    def seal(self, plaintext: bytes, aad: bytes = b"") -> bytes:
        ct = self._aead.encrypt(self._nonce(), plaintext, aad)
        self.seq += 1
        return ct

    def open(self, ciphertext: bytes, aad: bytes = b"") -> bytes:
        try:
            pt = self._aead.decrypt(self._nonce(), ciphertext, aad)
        except InvalidTag:
            raise HpkeError("decryption failed") from None
        self.seq += 1
        return pt

    def export(self, exporter_context: bytes, length: int) -> bytes:
        return labeled_expand(self.suite.suite_id, self.exporter_secret, b"sec", exporter_context, length)


def key_schedule(suite: Suite, shared_secret: bytes, info: bytes) -> Context:
    """KeySchedule for mode_base (RFC 9180 §5.1): no PSK."""
    sid = suite.suite_id
    psk_id_hash = labeled_extract(sid, b"", b"psk_id_hash", b"")
    info_hash = labeled_extract(sid, b"", b"info_hash", info)
    context = bytes([MODE_BASE]) + psk_id_hash + info_hash
    secret = labeled_extract(sid, shared_secret, b"secret", b"")
    key = labeled_expand(sid, secret, b"key", context, suite.key_len)
    base_nonce = labeled_expand(sid, secret, b"base_nonce", context, N_N)
    exporter = labeled_expand(sid, secret, b"exp", context, N_H)
    return Context(suite, key, base_nonce, exporter)


def setup_sender(
    suite: Suite, pk_r: X25519PublicKey, info: bytes, *, eph: X25519PrivateKey | None = None
) -> tuple[bytes, Context]:
    """SetupBaseS (RFC 9180 §5.1.1): (enc, the sender's context)."""
    shared, enc = encap(pk_r, eph=eph)
    return enc, key_schedule(suite, shared, info)


def setup_receiver(suite: Suite, enc: bytes, sk_r: X25519PrivateKey, info: bytes) -> Context:
    """SetupBaseR (RFC 9180 §5.1.1): the recipient's context for ``enc``."""
    return key_schedule(suite, decap(enc, sk_r), info)


def seal(suite: Suite, pk_r: X25519PublicKey, info: bytes, plaintext: bytes, aad: bytes = b"") -> tuple[bytes, bytes]:
    """Single-shot (RFC 9180 §6.1): (enc, ciphertext)."""
    enc, ctx = setup_sender(suite, pk_r, info)
    return enc, ctx.seal(plaintext, aad)


def open_(suite: Suite, enc: bytes, sk_r: X25519PrivateKey, info: bytes, ciphertext: bytes, aad: bytes = b"") -> bytes:
    """Single-shot open (RFC 9180 §6.1); the AEAD refuses a changed ciphertext or ``aad``."""
    return setup_receiver(suite, enc, sk_r, info).open(ciphertext, aad)
