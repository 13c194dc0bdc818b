"""High-sensitivity memory items sealed one by one, on top of whatever protects the store file.

A ``sensitivity: high`` item's value is kept in ``items.value`` (and in the history rows the store's
triggers copy from it) as one JSON string::

    "uomp-sealed-item/1:<base64 of nonce (12 bytes) || AES-256-GCM ciphertext and tag>"

The AES-256-GCM key is derived per item: ``HKDF-SHA256(root, info = "uomp-sealed-item/1" 0x00 key)``,
and the associated data is the item's key and sensitivity, so a blob copied to another key,
relabelled (``sensitivity`` changed in the file), taken from another home or changed in any byte
does not open (``ITEM_SEAL_INVALID``). The root is 32 random bytes in ``.secrets/items.key`` (a JWK,
``kty: oct``), one
of the home's key files (:func:`gateway.atrest.journal.sealed_files`): sealed under the master key
in a sealed home, a 0600 file in a plain one; ``uomp secrets seal`` / ``unseal`` move it like the
other keys, so the sealed values never need rewriting. ``memory.db`` alone (even decrypted with
its SQLCipher key, or copied to another home) never holds a high value in clear.

The blob is a JSON string, so the store's SQL (``json_extract``, ``json_type``) sees no field in it:
numeric aggregates cannot read a sealed value (the store refuses them, see
:meth:`gateway.guard.store.MemoryStore.aggregate`). A value is opened only when an item is handed
out whole (:meth:`~gateway.guard.store.MemoryStore.get_if` after the guard's allow, tag pages of
authorized items, the user's own ``uomp memory`` / export / history reads); metadata reads never
touch it. A plaintext value of another sensitivity that starts with the sealed marker is refused
on write, so any text with the marker is a sealed blob.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gateway.atrest import vault
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError

MARKER = "uomp-sealed-item/1:"
# The stored text of a sealed value starts with this (a JSON string holding the marker).
STORED_PREFIX = '"' + MARKER
SEALED = "high"  # the sensitivity whose values are sealed
ROOT_BYTES = 32
KEY_USE = "uomp-sealed-item/1"
_INFO = b"uomp-sealed-item/1\0"


def items_key_path(paths: Paths) -> Path:
    """The home's item-sealing root key file."""
    return paths.items_key


def is_sealed_text(text: object) -> bool:
    """Whether a stored value text is a sealed blob."""
    return isinstance(text, str) and text.startswith(STORED_PREFIX)


def _aad(key: str, sensitivity: str) -> bytes:
    return _INFO + key.encode() + b"\0" + sensitivity.encode()


def _invalid(key: str, reason: str) -> UompError:
    # the item's key is the user's own name for it, never a value: safe to say which one
    return UompError(
        ErrorCode.ITEM_SEAL_INVALID,
        f"the sealed value of {key!r} does not open ({reason}); restore memory.db and .secrets/items.key "
        "from one backup of this home, or write the item again",
        details={"reason": reason},
    )


class ItemSealer:
    """Seals and opens the values of high-sensitivity items under one home's root key. ``repr``
    never shows the key."""

    def __init__(self, root: bytes) -> None:
        if len(root) != ROOT_BYTES:
            raise ValueError("a 32-byte root key")
        self._root = bytes(root)

    def __repr__(self) -> str:
        return "ItemSealer()"

    def _aead(self, key: str) -> AESGCM:
        sub = HKDF(hashes.SHA256(), 32, salt=None, info=_INFO + key.encode()).derive(self._root)
        return AESGCM(sub)

    def seal(self, key: str, sensitivity: str, text: str) -> str:
        """The stored text for the value text ``text`` of an item: sealed when ``sensitivity`` is
        high (whatever the text holds); otherwise ``text``, refused if it carries the sealed
        marker."""
        if sensitivity != SEALED:
            return refuse_marker(key, text)
        nonce = secrets.token_bytes(12)
        ct = self._aead(key).encrypt(nonce, text.encode("utf-8"), _aad(key, sensitivity))
        return json.dumps(MARKER + base64.b64encode(nonce + ct).decode("ascii"))

    def open(self, key: str, sensitivity: str, text: str) -> str:
        """The value text behind a stored text: a sealed blob opened (``ITEM_SEAL_INVALID`` if it
        was sealed for another key, another sensitivity, another home, or changed); any other text
        as it is."""
        if not is_sealed_text(text):
            return text
        if sensitivity != SEALED:
            raise _invalid(key, "SEALED_BUT_NOT_HIGH")
        try:
            raw = base64.b64decode(json.loads(text)[len(MARKER) :].encode("ascii"), validate=True)
            if len(raw) < 12 + 16:
                raise ValueError("short")
            plain = self._aead(key).decrypt(raw[:12], raw[12:], _aad(key, sensitivity))
            return plain.decode("utf-8")
        except InvalidTag:
            raise _invalid(key, "AUTHENTICATION_FAILED") from None
        except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
            raise _invalid(key, "MALFORMED") from None


def refuse_marker(key: str, text: str) -> str:
    """``text`` for a store without the home's item key: a value carrying the sealed marker is
    INVALID_REQUEST (it would read as a sealed blob)."""
    if is_sealed_text(text):
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"the value of {key!r} starts with {MARKER!r}, which marks sealed values; store it differently",
        )
    return text


def open_without_sealer(key: str, text: str) -> str:
    """What a store without the home's item key does with a stored text: a sealed blob is
    ``ITEM_SEAL_INVALID`` (it cannot be opened here), anything else is returned."""
    if is_sealed_text(text):
        raise _invalid(key, "NO_ITEM_KEY")
    return text


def sealer_for(paths: Paths) -> ItemSealer:
    """The home's sealer: its root read through :func:`gateway.atrest.vault.read_key` (opened with
    the master key in a sealed home), created (0600, sealed when the home is) on first use."""
    path = items_key_path(paths)
    with contextlib.suppress(FileNotFoundError):
        return _sealer_of(path, vault.read_key(path))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    k = base64.urlsafe_b64encode(secrets.token_bytes(ROOT_BYTES)).rstrip(b"=").decode("ascii")
    vault.create_key(path, json.dumps({"kty": "oct", "use": KEY_USE, "k": k}).encode() + b"\n")
    return _sealer_of(path, vault.read_key(path))


def _sealer_of(path: Path, raw: bytes) -> ItemSealer:
    try:
        jwk = json.loads(raw)
        if not isinstance(jwk, dict) or jwk.get("kty") != "oct" or jwk.get("use") != KEY_USE:
            raise ValueError("not an item key")
        k = str(jwk["k"])
        return ItemSealer(base64.urlsafe_b64decode(k + "=" * (-len(k) % 4)))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, binascii.Error):
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{path} is not a readable item key; restore it from a backup of this home (without it the "
            "high-sensitivity items do not open)",
        ) from None
