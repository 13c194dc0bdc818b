"""The at-rest formats: a master key sealed by a passphrase, and key files sealed by the master key.

Master key: 32 random bytes and a random id (16 hex) that names the home it belongs to. Its slot
(``.secrets/master.json``, 0600) is one of:

* ``method: "passphrase"``: the master wrapped with AES-256-GCM under a key derived from the
  passphrase by Argon2id (RFC 9106; ``cryptography``'s implementation, OpenSSL underneath). The
  parameters are stored in the slot and bounded when read (a planted slot cannot make the unlock
  take gigabytes); the slot's id, method and parameters are the associated data;
* ``method: "keyring"``: the master kept in the OS keychain through ``keyring`` (service
  :data:`KEYRING_SERVICE`, user name the id); the slot holds a check value so a keychain entry of
  another home is refused.

Either may carry ``db``: the name of the file format of the home's SQLCipher databases
(:data:`gateway.atrest.memdb.PROFILES`; none is the format of a home sealed before it was recorded).
It is not secret and not in the associated data: a wrong name opens no database (their page HMAC
refuses it), and the refusal names it.

A sealed key file is ``UOMP-SEALED/1`` on the first line and one JSON object on the second:
``{"v": 1, "home": id, "role": ".secrets/ed25519-private.jwk", "nonce", "ct"}``, AES-256-GCM under
``HKDF-SHA256(master, info="uomp-atrest/v1/files")`` with the home id and the role (the file's
place in the home) as associated data: a sealed file moved to another name, another home's file,
or any changed byte does not open.
"""

from __future__ import annotations

import base64
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.argon2 import Argon2id
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gateway.errors import ErrorCode, UompError

SEALED_MAGIC = b"UOMP-SEALED/1\n"
SLOT_VERSION = 1
KEYRING_SERVICE = "uomp-master-key"
MAX_SLOT_BYTES = 4096
MAX_SEALED_BYTES = 64 * 1024
MAX_PASSPHRASE_BYTES = 1024

# RFC 9106 §4, second recommended option: t=3, p=4, m=64 MiB (about 0.2-0.5 s here).
DEFAULT_KDF = {"alg": "argon2id", "iterations": 3, "lanes": 4, "memory_kib": 64 * 1024}
# What a slot may ask for: enough room for stronger settings, never a denial of service.
KDF_BOUNDS = {"iterations": (1, 16), "lanes": (1, 16), "memory_kib": (8 * 1024, 1024 * 1024)}


def b64(data: bytes) -> str:
    """Standard base64 text of ``data``."""
    return base64.b64encode(data).decode("ascii")


def _unb64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string")
    return base64.b64decode(value.encode("ascii"), validate=True)


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class MasterKey:
    """The home's master key. ``repr`` never shows the key."""

    home_id: str
    key: bytes

    def __repr__(self) -> str:
        return f"MasterKey(home_id={self.home_id!r})"

    @classmethod
    def generate(cls) -> MasterKey:
        return cls(secrets.token_hex(8), secrets.token_bytes(32))

    def subkey(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose (``files``, ...): HKDF-SHA256 of the master."""
        return HKDF(hashes.SHA256(), 32, salt=None, info=b"uomp-atrest/v1/" + purpose.encode()).derive(self.key)


def passphrase_bytes(passphrase: str | bytes) -> bytes:
    """A passphrase as bytes (UTF-8); refused when empty."""
    raw = passphrase.encode("utf-8") if isinstance(passphrase, str) else bytes(passphrase)
    if not raw:
        raise UompError(ErrorCode.PASSPHRASE_WRONG, "the passphrase is empty; give a non-empty passphrase")
    if len(raw) > MAX_PASSPHRASE_BYTES:
        raise UompError(
            ErrorCode.PASSPHRASE_WRONG, f"the passphrase is longer than {MAX_PASSPHRASE_BYTES} bytes; use a shorter one"
        )
    return raw


def kdf_params(kdf: Any) -> dict[str, Any]:
    """The Argon2id parameters of a slot or backup, their bounds checked; KEY_ERROR otherwise."""
    if not isinstance(kdf, dict) or kdf.get("alg") != "argon2id":
        raise ValueError("unknown KDF")
    out: dict[str, Any] = {"alg": "argon2id"}
    for name, (low, high) in KDF_BOUNDS.items():
        v = kdf.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise ValueError(f"KDF {name} out of bounds")
        out[name] = v
    salt = _unb64(kdf.get("salt"), "salt")
    if not 16 <= len(salt) <= 64:
        raise ValueError("salt length")
    out["salt"] = kdf["salt"]
    if out["memory_kib"] < 8 * out["lanes"]:
        raise ValueError("memory below 8 KiB per lane")
    return out


def derive(passphrase: bytes, kdf: dict[str, Any]) -> bytes:
    """The 32-byte key Argon2id derives from ``passphrase`` under ``kdf``."""
    return Argon2id(
        salt=_unb64(kdf["salt"], "salt"),
        length=32,
        iterations=kdf["iterations"],
        lanes=kdf["lanes"],
        memory_cost=kdf["memory_kib"],
    ).derive(passphrase)


def _slot_aad(slot: dict[str, Any]) -> bytes:
    head = {k: slot[k] for k in ("v", "id", "method", "kdf") if k in slot}
    return b"uomp-master-slot/1\0" + _canonical(head)


def wrap_with_passphrase(
    master: MasterKey, passphrase: str | bytes, kdf: dict[str, Any] | None = None, *, db: str | None = None
) -> bytes:
    """The ``master.json`` bytes of a passphrase slot; ``db``: the home's database format (its ``db``)."""
    params = dict(DEFAULT_KDF if kdf is None else kdf)
    params["salt"] = b64(secrets.token_bytes(16))
    params = kdf_params(params)
    slot: dict[str, Any] = {"v": SLOT_VERSION, "id": master.home_id, "method": "passphrase", "kdf": params}
    nonce = secrets.token_bytes(12)
    wrapped = AESGCM(derive(passphrase_bytes(passphrase), params)).encrypt(nonce, master.key, _slot_aad(slot))
    slot.update({"nonce": b64(nonce), "wrapped": b64(wrapped)})
    if db is not None:
        slot["db"] = db
    return _canonical(slot) + b"\n"


def keyring_slot(master: MasterKey, *, db: str | None = None) -> bytes:
    """The ``master.json`` bytes of a keychain slot (the key itself goes into the keychain)."""
    slot: dict[str, Any] = {"v": SLOT_VERSION, "id": master.home_id, "method": "keyring", "service": KEYRING_SERVICE}
    slot["check"] = b64(hmac.new(master.subkey("keyring-check"), _slot_aad(slot), "sha256").digest())
    if db is not None:
        slot["db"] = db
    return _canonical(slot) + b"\n"


def parse_slot(raw: bytes, where: str) -> dict[str, Any]:
    """A slot's fields, checked for shape (KEY_ERROR naming ``where`` otherwise)."""
    try:
        if len(raw) > MAX_SLOT_BYTES:
            raise ValueError("too large")
        slot = json.loads(raw)
        if not isinstance(slot, dict) or slot.get("v") != SLOT_VERSION:
            raise ValueError("unknown version")
        home_id = slot.get("id")
        if not isinstance(home_id, str) or len(home_id) != 16 or any(c not in "0123456789abcdef" for c in home_id):
            raise ValueError("bad id")
        method = slot.get("method")
        if method == "passphrase":
            slot["kdf"] = kdf_params(slot.get("kdf"))
            if len(_unb64(slot.get("nonce"), "nonce")) != 12 or len(_unb64(slot.get("wrapped"), "wrapped")) != 48:
                raise ValueError("bad wrapped key")
        elif method == "keyring":
            if not isinstance(slot.get("service"), str) or len(_unb64(slot.get("check"), "check")) != 32:
                raise ValueError("bad keyring slot")
        else:
            raise ValueError("unknown method")
        if "db" in slot and not (isinstance(slot["db"], str) and 0 < len(slot["db"]) <= 64):
            raise ValueError("bad db format name")
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{where} is not a readable master key slot ({exc}); restore it from a backup: without it the "
            "sealed keys cannot be opened",
        ) from None
    out: dict[str, Any] = slot
    return out


def unwrap_with_passphrase(slot: dict[str, Any], passphrase: str | bytes) -> MasterKey:
    """The master key of a passphrase slot; PASSPHRASE_WRONG when the passphrase does not open it
    (AES-GCM's tag check, constant time; the Argon2id cost is paid on every attempt)."""
    key = derive(passphrase_bytes(passphrase), slot["kdf"])
    try:
        raw = AESGCM(key).decrypt(_unb64(slot["nonce"], "nonce"), _unb64(slot["wrapped"], "wrapped"), _slot_aad(slot))
    except InvalidTag:
        raise UompError(
            ErrorCode.PASSPHRASE_WRONG,
            "the passphrase does not open this home's keys; give the passphrase the keys were sealed with",
        ) from None
    return MasterKey(slot["id"], raw)


def check_keyring_master(slot: dict[str, Any], raw: bytes) -> MasterKey:
    """The master key read from the keychain, if it is this home's (KEY_ERROR otherwise)."""
    master = MasterKey(slot["id"], raw)
    head = {k: slot[k] for k in ("v", "id", "method", "service")}
    want = hmac.new(master.subkey("keyring-check"), _slot_aad(head), "sha256").digest()
    if len(raw) != 32 or not hmac.compare_digest(want, _unb64(slot["check"], "check")):
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"the keychain entry {slot['service']}/{slot['id']} is not this home's master key; restore the entry "
            "or unlock with the passphrase of a backup",
        )
    return master


def is_sealed(blob: bytes) -> bool:
    """Whether ``blob`` is a sealed key file (it starts with the sealed magic)."""
    return blob.startswith(SEALED_MAGIC)


def _file_aad(home_id: str, role: str) -> bytes:
    return b"uomp-sealed-file/1\0" + home_id.encode() + b"\0" + role.encode()


def seal_file(master: MasterKey, role: str, plaintext: bytes) -> bytes:
    """``plaintext`` sealed under the master key, bound to this home and the file's role."""
    nonce = secrets.token_bytes(12)
    ct = AESGCM(master.subkey("files")).encrypt(nonce, plaintext, _file_aad(master.home_id, role))
    body = {"v": 1, "home": master.home_id, "role": role, "nonce": b64(nonce), "ct": b64(ct)}
    return SEALED_MAGIC + _canonical(body) + b"\n"


def open_file(master: MasterKey, role: str, blob: bytes, where: str) -> bytes:
    """The plaintext of a sealed key file; KEY_ERROR naming ``where`` if it is damaged, truncated,
    another home's, or another file's (moved or swapped)."""
    try:
        if len(blob) > MAX_SEALED_BYTES or not is_sealed(blob):
            raise ValueError("not a sealed file")
        body = json.loads(blob[len(SEALED_MAGIC) :])
        if not isinstance(body, dict) or body.get("v") != 1:
            raise ValueError("unknown version")
        if body.get("home") != master.home_id:
            raise ValueError("sealed for another home")
        if body.get("role") != role:
            raise ValueError(f"sealed as {body.get('role')!r}, not as {role!r}")
        nonce = _unb64(body.get("nonce"), "nonce")
        ct = _unb64(body.get("ct"), "ct")
        return AESGCM(master.subkey("files")).decrypt(nonce, ct, _file_aad(master.home_id, role))
    except InvalidTag:
        reason = "it was changed or damaged"
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        reason = str(exc)[:80]
    raise UompError(
        ErrorCode.KEY_ERROR,
        f"{where} is sealed but does not open ({reason}); restore it from a backup of this home",
    )


def random_tag() -> str:
    """A short random tag for a stage or temporary name."""
    return os.urandom(6).hex()
