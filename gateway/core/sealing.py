"""Sealing agent payloads to the user's X25519 key (spec §15.6), pure: bytes in, bytes out.

Construction ("UOMP payload v1"; every byte is specified in docs/payloads.md):

1. ``bound`` = RFC 8785 JSON of ``{"v": 1, "payload_id", "session_id", "agent_id", "format"}``;
   HPKE ``info`` = ``b"uomp-payload-v1\\x00" || bound``, so a ciphertext opens only as the payload,
   session, agent and format it was sealed for.
2. A random 32-byte file key is sealed with HPKE base mode, DHKEM(X25519, HKDF-SHA256),
   HKDF-SHA256, AES-256-GCM (:mod:`gateway.core.hpke`): ``enc`` (32 bytes, the envelope's
   ``sender_public_key``) and ``wrapped`` (48 bytes).
3. With a random 16-byte ``nonce`` (the envelope's ``nonce``): ``prk = HKDF-Extract(nonce,
   file_key)``, ``stream_key = HKDF-Expand(prk, "uomp-payload-v1 stream", 32)``, ``commitment =
   HKDF-Expand(prk, "uomp-payload-v1 commit", 32)``. The commitment makes the body key-committing:
   AES-GCM alone lets a crafted ciphertext open under two keys; a second file key cannot reproduce
   the stored commitment.
4. ``header_hash = SHA-256(bound || enc || nonce || wrapped || commitment)`` is the AAD of every
   body chunk, so no header field can be swapped under a body.
5. The body is age's STREAM: 64 KiB plaintext chunks, each AES-256-GCM under ``stream_key`` with
   the 12-byte nonce ``counter (11 bytes, big-endian) || last (0x00 or 0x01)``. Only the final
   chunk has ``last = 1``; it may be short, and it is empty only when the whole payload is empty.
   Truncation, reordering, a duplicated or dropped chunk, bytes after the end or a flipped bit all
   fail to open.

The sealed bytes (the envelope's ``ciphertext``) are ``wrapped || commitment || chunks``; the
envelope's ``hash`` is ``"sha256:" + hex(SHA-256(those bytes))``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from gateway.core import hpke
from gateway.core.canonical import canonical_json

ALGORITHM = "HPKE-X25519-SHA256-AES256GCM-STREAM64K"
VERSION = 1
CHUNK = 64 * 1024
TAG = 16
WRAPPED_LEN = 32 + TAG
COMMIT_LEN = 32
PREFIX_LEN = WRAPPED_LEN + COMMIT_LEN
NONCE_LEN = 16
_INFO_LABEL = b"uomp-payload-v1\x00"
_SUITE = hpke.X25519_SHA256_AES256GCM
MAX_CHUNKS = 1 << 40  # 64 PiB: far beyond any cap, well inside the 88-bit counter


class SealError(ValueError):
    """A payload that does not open: wrong key, tampered, truncated or malformed."""


@dataclass(frozen=True)
class Binding:
    """What a ciphertext is bound to; changing any field makes it fail to open."""

    payload_id: str
    session_id: str
    agent_id: str
    format: str

    def bound(self) -> bytes:
        return canonical_json(
            {
                "v": VERSION,
                "payload_id": self.payload_id,
                "session_id": self.session_id,
                "agent_id": self.agent_id,
                "format": self.format,
            }
        )

    def info(self) -> bytes:
        return _INFO_LABEL + self.bound()


def _derive(file_key: bytes, nonce: bytes) -> tuple[bytes, bytes]:
    prk = hmac.new(nonce, file_key, "sha256").digest()  # HKDF-Extract(salt=nonce, ikm=file_key)
    stream_key = HKDFExpand(hashes.SHA256(), 32, b"uomp-payload-v1 stream").derive(prk)
    commitment = HKDFExpand(hashes.SHA256(), 32, b"uomp-payload-v1 commit").derive(prk)
    return stream_key, commitment


def _chunk_nonce(counter: int, last: bool) -> bytes:
    if counter >= MAX_CHUNKS:
        raise SealError("payload too large")
    return counter.to_bytes(11, "big") + (b"\x01" if last else b"\x00")


class Sealer:
    """Seal one payload as a stream: :attr:`prefix`, then :meth:`chunk` for each plaintext piece."""

    def __init__(
        self,
        recipient: X25519PublicKey,
        binding: Binding,
        *,
        file_key: bytes | None = None,
        nonce: bytes | None = None,
        eph: X25519PrivateKey | None = None,
    ) -> None:
        # file_key / nonce / eph are fixed only by the committed test vectors.
        self.binding = binding
        key = os.urandom(32) if file_key is None else file_key
        self.nonce = os.urandom(NONCE_LEN) if nonce is None else nonce
        self.enc, ctx = hpke.setup_sender(_SUITE, recipient, binding.info(), eph=eph)
        wrapped = ctx.seal(key)
        stream_key, commitment = _derive(key, self.nonce)
        self._aead = AESGCM(stream_key)
        self.prefix = wrapped + commitment
        self._aad = hashlib.sha256(binding.bound() + self.enc + self.nonce + self.prefix).digest()
        self._counter = 0
        self._pending = b""
        self._done = False

    def encryption(self) -> dict[str, str]:
        """The envelope's ``encryption`` object."""
        return {
            "algorithm": ALGORITHM,
            "sender_public_key": base64.b64encode(self.enc).decode(),
            "nonce": base64.b64encode(self.nonce).decode(),
        }

    def _seal(self, data: bytes | memoryview, last: bool) -> bytes:
        out = self._aead.encrypt(_chunk_nonce(self._counter, last), data, self._aad)
        self._counter += 1
        return out

    def update(self, data: bytes | bytearray | memoryview) -> bytes | bytearray:
        """Take plaintext; return whatever whole chunks it completed (one chunk is held back,
        because only the end of the input says which chunk is the last)."""
        if self._done:
            raise SealError("sealer already finished")
        view = memoryview(data).cast("B")
        total = len(self._pending) + len(view)
        if total <= CHUNK:
            self._pending += view.tobytes()
            return b""
        n = (total - 1) // CHUNK  # full chunks that certainly are not the last
        out = bytearray(n * (CHUNK + TAG))
        dst = memoryview(out)
        at = 0
        for k in range(n):
            if k == 0 and self._pending:
                need = CHUNK - len(self._pending)
                piece: bytes | memoryview = self._pending + view[:need].tobytes()
                at = need
            else:
                piece = view[at : at + CHUNK]
                at += CHUNK
            self._aead.encrypt_into(
                _chunk_nonce(self._counter, False), piece, self._aad, dst[k * (CHUNK + TAG) : (k + 1) * (CHUNK + TAG)]
            )
            self._counter += 1
        self._pending = view[at:].tobytes() if n else self._pending + view.tobytes()
        return out

    def finish(self) -> bytes:
        if self._done:
            raise SealError("sealer already finished")
        self._done = True
        return self._seal(self._pending, last=True)


class Opener:
    """Open a sealed stream: feed ciphertext bytes (after the prefix) in any pieces; plaintext comes
    out only for chunks that authenticated, and :meth:`finish` fails unless the final chunk came."""

    def __init__(
        self, private_key: X25519PrivateKey, binding: Binding, encryption: Mapping[str, Any], prefix: bytes
    ) -> None:
        if encryption.get("algorithm") != ALGORITHM:
            raise SealError("unknown payload algorithm")
        try:
            enc = base64.b64decode(str(encryption["sender_public_key"]), validate=True)
            nonce = base64.b64decode(str(encryption["nonce"]), validate=True)
        except (KeyError, ValueError):
            raise SealError("malformed encryption header") from None
        if len(enc) != 32 or len(nonce) != NONCE_LEN or len(prefix) != PREFIX_LEN:
            raise SealError("malformed encryption header")
        wrapped, commitment = prefix[:WRAPPED_LEN], prefix[WRAPPED_LEN:]
        try:
            key = hpke.open_(_SUITE, enc, private_key, binding.info(), wrapped)
        except hpke.HpkeError:
            raise SealError(
                "the payload was not sealed to this key, or for another payload/session/agent/format"
            ) from None
        stream_key, expected = _derive(key, nonce)
        if not hmac.compare_digest(commitment, expected):
            raise SealError("key commitment does not match")
        self._aead = AESGCM(stream_key)
        self._aad = hashlib.sha256(binding.bound() + enc + nonce + prefix).digest()
        self._counter = 0
        self._buf = b""
        self._done = False

    def _open(self, ct: bytes | memoryview, last: bool) -> bytes:
        try:
            pt = self._aead.decrypt(_chunk_nonce(self._counter, last), ct, self._aad)
        except InvalidTag:
            raise SealError(f"chunk {self._counter} does not authenticate (tampered, reordered or truncated)") from None
        self._counter += 1
        return pt

    def update(self, data: bytes | bytearray | memoryview) -> bytes | bytearray:
        if self._done:
            if data:
                raise SealError("data after the final chunk")
            return b""
        view = memoryview(data).cast("B")
        total = len(self._buf) + len(view)
        # A full chunk is known not to be the last only once more bytes follow it.
        n = (total - 1) // (CHUNK + TAG) if total else 0
        if n == 0:
            self._buf += view.tobytes()
            return b""
        out = bytearray(n * CHUNK)
        dst = memoryview(out)
        at = 0
        for k in range(n):
            if k == 0 and self._buf:
                need = CHUNK + TAG - len(self._buf)
                piece: bytes | memoryview = self._buf + view[:need].tobytes()
                at = need
            else:
                piece = view[at : at + CHUNK + TAG]
                at += CHUNK + TAG
            try:
                self._aead.decrypt_into(
                    _chunk_nonce(self._counter, False), piece, self._aad, dst[k * CHUNK : (k + 1) * CHUNK]
                )
            except InvalidTag:
                raise SealError(
                    f"chunk {self._counter} does not authenticate (tampered, reordered or truncated)"
                ) from None
            self._counter += 1
        self._buf = view[at:].tobytes()
        return out

    def finish(self) -> bytes:
        if self._done:
            raise SealError("opener already finished")
        if len(self._buf) < TAG:
            raise SealError("truncated: the final chunk is missing")
        pt = self._open(self._buf, last=True)
        if not pt and self._counter > 1:
            raise SealError("an empty final chunk after a full one is not allowed")
        self._done = True
        self._buf = b""
        return pt


def sealed_size(plaintext: int) -> int:
    """The length of ``plaintext`` bytes once sealed: the key block, then every chunk with its tag
    (the last holds 1 to CHUNK bytes, or none for an empty payload)."""
    if plaintext < 0:
        raise ValueError("a length is not negative")
    return PREFIX_LEN + plaintext + max(1, -(-plaintext // CHUNK)) * TAG


def ciphertext_hash(sealed: bytes) -> str:
    """``sha256:<hex>`` of the sealed bytes (what the relay stores and the envelope names)."""
    return "sha256:" + hashlib.sha256(sealed).hexdigest()


def seal_bytes(recipient: X25519PublicKey, binding: Binding, plaintext: bytes) -> tuple[dict[str, str], bytes]:
    """(encryption object, sealed bytes) for a payload held in memory."""
    s = Sealer(recipient, binding)
    return s.encryption(), b"".join((s.prefix, s.update(plaintext), s.finish()))


def open_bytes(private_key: X25519PrivateKey, binding: Binding, encryption: Mapping[str, Any], sealed: bytes) -> bytes:
    """The plaintext of a payload sealed to ``private_key`` under ``binding``; SealError if anything was changed."""
    if len(sealed) < PREFIX_LEN:
        raise SealError("truncated: no key block")
    o = Opener(private_key, binding, encryption, sealed[:PREFIX_LEN])
    return b"".join((o.update(sealed[PREFIX_LEN:]), o.finish()))


def open_stream(
    private_key: X25519PrivateKey,
    binding: Binding,
    encryption: Mapping[str, Any],
    blocks: Iterable[bytes | bytearray | memoryview],
) -> Iterator[bytes | bytearray]:
    """Open sealed bytes arriving in blocks of any size; yields plaintext as chunks authenticate.

    The caller must treat the output as provisional until the generator ends without an error
    (write it to a temporary file and rename it only then).
    """
    head = b""
    opener: Opener | None = None
    for block in blocks:
        if opener is None:
            head += bytes(block)
            if len(head) < PREFIX_LEN:
                continue
            opener = Opener(private_key, binding, encryption, head[:PREFIX_LEN])
            block = head[PREFIX_LEN:]
        out = opener.update(block)
        if out:
            yield out
    if opener is None:
        raise SealError("truncated: no key block")
    yield opener.finish()
