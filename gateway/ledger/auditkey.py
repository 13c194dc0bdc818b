"""The appliance's audit signing key: Ed25519, signs the event log's checkpoints.

``$UOMP_HOME/.secrets/audit-ed25519.key`` (0600, PKCS#8 PEM), made on first use and never replaced
(a new key could not continue the old checkpoints' signatures; a broken file is a ``KEY_ERROR``).
The log's origin (the checkpoint's first line, and the signer's name) is derived from the public
key, so it is stable for the life of the key: ``uomp-audit/<16 hex>``.
"""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gateway import pemkeys
from gateway.config import Paths

MAX_KEY_FILE_BYTES = 4096


_RESTORE = "a new key would not continue the log's signed checkpoints"


def ensure(paths: Paths) -> bool:
    """Create the audit key if it is missing; True when this call made it."""
    return pemkeys.ensure(
        paths.audit_key, Ed25519PrivateKey.generate, Ed25519PrivateKey, what="audit signing key", restore=_RESTORE
    )


def load(paths: Paths) -> Ed25519PrivateKey:
    """The audit log's Ed25519 signing key from the home; KEY_ERROR with the restore hint when it is missing or bad."""
    key = pemkeys.load(paths.audit_key, Ed25519PrivateKey, what="audit signing key", restore=_RESTORE)
    assert isinstance(key, Ed25519PrivateKey)  # pemkeys.load checked the type
    return key


def origin_for(public_key: Ed25519PublicKey) -> str:
    """The log's checkpoint origin, named by its key: ``uomp-audit/`` and 16 hex digits of the key's SHA-256."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "uomp-audit/" + hashlib.sha256(raw).hexdigest()[:16]
