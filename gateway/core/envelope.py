"""The payload envelope (spec §15.6; docs/payloads.md), pure: parse and check its shape, or build one.

Two forms travel to ``POST /v1/payload/upload``:

* the JSON form: exactly the §15.6 fields, ``ciphertext`` the standard base64 of the sealed bytes;
* the streaming form: the same object without ``ciphertext`` (the *header*), sent as the
  ``X-UOMP-Payload-Envelope`` request header (base64url of its UTF-8 JSON, no padding), the sealed
  bytes being the request body. Its ``hash`` may instead be :data:`HASH_TRAILER`: the body is then
  the sealed bytes followed by their raw 32-byte SHA-256 (:data:`TRAILER_LEN`), so a sender can
  send while it seals; the relay checks that hash before it keeps anything, as it checks a declared
  one. Only where the caller allows it (``trailer=True``): the agent-facing upload routes.

:func:`parse` refuses anything else with ``INVALID_REQUEST`` and a fixed sentence naming the field
(never echoing a value): a missing or extra field, a wrong type, an unknown algorithm, a key or
nonce of the wrong length, a ``size`` below the smallest sealed payload. Whether ``session_id`` and
``agent_id`` match the token, and the hash and size of the bytes received, are checked by the relay.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from gateway.core import sealing
from gateway.core.tokens import parse_iso
from gateway.errors import ErrorCode, UompError

HEADER_NAME = "X-UOMP-Payload-Envelope"
HEADER_FIELDS = frozenset({"payload_id", "session_id", "agent_id", "timestamp", "encryption", "format", "size", "hash"})
JSON_FIELDS = HEADER_FIELDS | {"ciphertext"}
ENCRYPTION_FIELDS = frozenset({"algorithm", "sender_public_key", "nonce"})
MIN_SEALED_BYTES = sealing.PREFIX_LEN + sealing.TAG  # key block + one (empty) final chunk
MAX_ID_CHARS = 256
MAX_HEADER_CHARS = 4096  # the base64url header; a real one is about 700 characters

PAYLOAD_ID = re.compile(r"pay_[A-Za-z0-9_-]{8,64}")
HASH = re.compile(r"sha256:[0-9a-f]{64}")
HASH_TRAILER = "sha256:trailer"  # the streaming header's hash: the body's last TRAILER_LEN bytes carry it
TRAILER_LEN = 32
TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z")
_TOKEN = r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,63}"
FORMAT = re.compile(rf"{_TOKEN}/{_TOKEN}(;[ ]?[A-Za-z0-9_.-]{{1,32}}=[A-Za-z0-9_.-]{{1,64}}){{0,4}}")


@dataclass(frozen=True)
class Envelope:
    """The §15.6 payload envelope header: whose payload it is, how it is sealed, its format and size."""

    payload_id: str
    session_id: str
    agent_id: str
    timestamp: str
    encryption: dict[str, str]
    format: str
    size: int
    hash: str

    @property
    def trailer(self) -> bool:
        """The hash follows the sealed bytes in the body (the streaming form only)."""
        return self.hash == HASH_TRAILER

    def binding(self) -> sealing.Binding:
        return sealing.Binding(self.payload_id, self.session_id, self.agent_id, self.format)

    def header(self) -> dict[str, Any]:
        """The envelope without ``ciphertext`` (the streaming form's header)."""
        return {
            "payload_id": self.payload_id,
            "session_id": self.session_id,
            "agent_id": self.agent_id,
            "timestamp": self.timestamp,
            "encryption": dict(self.encryption),
            "format": self.format,
            "size": self.size,
            "hash": self.hash,
        }


def _bad(field: str, what: str) -> UompError:
    return UompError(ErrorCode.INVALID_REQUEST, f"envelope field {field} {what}")


def _b64(value: Any, field: str, length: int) -> None:
    if not isinstance(value, str) or len(value) > 4 * length:
        raise _bad(field, "must be standard base64")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(field, "must be standard base64") from None
    if len(raw) != length:
        raise _bad(field, f"must be {length} bytes")


def parse(doc: Any, *, streaming: bool, trailer: bool = False) -> tuple[Envelope, str | None]:
    """(envelope, the base64 ciphertext of the JSON form or None). Shape only; see the module docstring.
    ``trailer``: a streaming header may name :data:`HASH_TRAILER` as its hash."""
    if not isinstance(doc, dict):
        raise UompError(ErrorCode.INVALID_REQUEST, "the envelope must be a JSON object")
    want = HEADER_FIELDS if streaming else JSON_FIELDS
    missing = sorted(want - doc.keys())
    if missing:
        raise UompError(ErrorCode.INVALID_REQUEST, f"the envelope lacks {', '.join(missing)}")
    extra = doc.keys() - want
    if extra:
        what = (
            "ciphertext belongs in the body in the streaming form"
            if "ciphertext" in extra
            else "the envelope has fields §15.6 does not define"
        )
        raise UompError(ErrorCode.INVALID_REQUEST, what)
    pid = doc["payload_id"]
    if not isinstance(pid, str) or not PAYLOAD_ID.fullmatch(pid):
        raise _bad("payload_id", "must be pay_ followed by 8-64 URL-safe characters")
    for name in ("session_id", "agent_id"):
        v = doc[name]
        if not isinstance(v, str) or not v or len(v) > MAX_ID_CHARS or not v.isprintable():
            raise _bad(name, f"must be a string of 1-{MAX_ID_CHARS} printable characters")
    ts = doc["timestamp"]
    if not isinstance(ts, str) or not TIMESTAMP.fullmatch(ts):
        raise _bad("timestamp", "must be an RFC 3339 UTC time such as 2026-07-14T10:15:00Z")
    try:
        parse_iso(ts)
    except (ValueError, OverflowError):
        raise _bad("timestamp", "is not a valid time") from None
    enc = doc["encryption"]
    if not isinstance(enc, dict) or enc.keys() != ENCRYPTION_FIELDS:
        raise _bad("encryption", "must hold exactly algorithm, sender_public_key and nonce")
    if enc["algorithm"] != sealing.ALGORITHM:
        raise _bad("encryption.algorithm", f"must be {sealing.ALGORITHM}")
    _b64(enc["sender_public_key"], "encryption.sender_public_key", 32)
    _b64(enc["nonce"], "encryption.nonce", sealing.NONCE_LEN)
    fmt = doc["format"]
    if not isinstance(fmt, str) or not FORMAT.fullmatch(fmt):
        raise _bad("format", "must be a media type such as text/markdown")
    size = doc["size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < MIN_SEALED_BYTES:
        raise _bad("size", f"must be an integer of at least {MIN_SEALED_BYTES} (the sealed bytes' length)")
    digest = doc["hash"]
    later = trailer and streaming and digest == HASH_TRAILER
    if not isinstance(digest, str) or not (later or HASH.fullmatch(digest)):
        raise _bad(
            "hash",
            f"must be sha256: followed by 64 lower-case hex digits (or {HASH_TRAILER}, in an upload's streaming form)"
            if streaming
            else "must be sha256: followed by 64 lower-case hex digits",
        )
    ciphertext: str | None = None
    if not streaming:
        ct = doc["ciphertext"]
        if not isinstance(ct, str):
            raise _bad("ciphertext", "must be standard base64")
        ciphertext = ct
    env = Envelope(
        pid,
        doc["session_id"],
        doc["agent_id"],
        ts,
        {k: str(enc[k]) for k in ("algorithm", "sender_public_key", "nonce")},
        fmt,
        size,
        digest,
    )
    return env, ciphertext


def decode_ciphertext(text: str) -> bytes:
    """Standard base64 ciphertext as bytes; INVALID_REQUEST for anything else."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("ciphertext", "must be standard base64") from None


def encode_header(env: Envelope) -> str:
    """The ``X-UOMP-Payload-Envelope`` value: base64url (no padding) of the header's compact JSON."""
    raw = json.dumps(env.header(), separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_header(value: str, *, trailer: bool = False) -> Envelope:
    """The envelope from its header value (base64url JSON, bounded); INVALID_REQUEST for a malformed one.
    ``trailer``: its hash may be :data:`HASH_TRAILER`."""
    if not value or len(value) > MAX_HEADER_CHARS or not re.fullmatch(r"[A-Za-z0-9_-]+", value):
        raise UompError(
            ErrorCode.INVALID_REQUEST, f"{HEADER_NAME} must be base64url (no padding) of the envelope header"
        )
    try:
        doc = json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
    except (binascii.Error, ValueError):
        raise UompError(ErrorCode.INVALID_REQUEST, f"{HEADER_NAME} does not decode to a JSON object") from None
    return parse(doc, streaming=True, trailer=trailer)[0]


def parse_public_key(text: str) -> X25519PublicKey:
    """A bundle's ``payload_public_key`` (standard base64 of 32 raw bytes); ValueError if malformed."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) != 32:
        raise ValueError("an X25519 public key is 32 bytes")
    return X25519PublicKey.from_public_bytes(raw)
