"""Opaque cursors for paged tag reads (spec §10.3 + ``next``), pure.

A cursor says where the next page starts (the last key served) and the page size the agent asked
for. It is sealed with AES-256-GCM under a key only the guard holds, with the session id, the agent
id and the tag as associated data, so it is:

* opaque: the last key is encrypted (an agent whose ``allowed_fields`` hide keys learns none);
* tamper-evident: any change to the bytes fails authentication;
* bound: presented by another session, another agent or for another tag it fails the same way, so
  a cursor cannot be replayed across sessions or queries;
* short-lived: it carries its expiry time.

Every failure is the same ``INVALID_REQUEST`` with a fixed sentence (nothing about why it failed,
and never the cursor text).
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.errors import ErrorCode, UompError

CURSOR_VERSION = 1
KEY_BYTES = 32
NONCE_BYTES = 12
# version + nonce + (limit, expiry) + a 256-character key in UTF-8 (<= 1024 bytes) + tag, in base64url
MAX_CURSOR_CHARS = 1600
_HEAD = struct.Struct(">IQ")  # limit, expiry (seconds since the epoch)
_AAD_PREFIX = b"uomp-tag-cursor-v1\x00"
INVALID_CURSOR = "cursor is not valid for this session and tag; start the read again without it"
EXPIRED_CURSOR = "cursor has expired; start the read again without it"


@dataclass(frozen=True)
class CursorState:
    """What a page cursor carries back: the last key served and the page size."""

    after: str  # the last key already served
    limit: int  # the page size the agent asked for


def new_key() -> bytes:
    """A fresh random cursor key (kept by the guard; cursors are sealed with it)."""
    return os.urandom(KEY_BYTES)


def _aad(session_id: str, agent_id: str, tag: str) -> bytes:
    return _AAD_PREFIX + b"\x00".join(p.encode("utf-8", "surrogatepass") for p in (session_id, agent_id, tag))


def seal(key: bytes, *, session_id: str, agent_id: str, tag: str, after: str, limit: int, expires_at: int) -> str:
    """A cursor for the next page, sealed (AES-GCM) to this session, agent and tag, expiring at ``expires_at``."""
    nonce = os.urandom(NONCE_BYTES)
    payload = _HEAD.pack(limit, max(0, int(expires_at))) + after.encode("utf-8")
    box = AESGCM(key).encrypt(nonce, payload, _aad(session_id, agent_id, tag))
    return base64.urlsafe_b64encode(bytes([CURSOR_VERSION]) + nonce + box).rstrip(b"=").decode("ascii")


def open_cursor(key: bytes, cursor: str, *, session_id: str, agent_id: str, tag: str, now: float) -> CursorState:
    """The state sealed in ``cursor``; INVALID_REQUEST if it is not one this key sealed for exactly
    this session, agent and tag, or if it has expired."""
    bad = UompError(ErrorCode.INVALID_REQUEST, INVALID_CURSOR, session_id=session_id)
    if not isinstance(cursor, str) or not 0 < len(cursor) <= MAX_CURSOR_CHARS:
        raise bad
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad from exc
    if len(raw) < 1 + NONCE_BYTES + 16 or raw[0] != CURSOR_VERSION:
        raise bad
    try:
        payload = AESGCM(key).decrypt(raw[1 : 1 + NONCE_BYTES], raw[1 + NONCE_BYTES :], _aad(session_id, agent_id, tag))
        limit, expires = _HEAD.unpack_from(payload)
        after = payload[_HEAD.size :].decode("utf-8")
    except (InvalidTag, struct.error, UnicodeDecodeError) as exc:
        raise bad from exc
    if now >= expires:
        raise UompError(ErrorCode.INVALID_REQUEST, EXPIRED_CURSOR, session_id=session_id)
    return CursorState(after, limit)
