"""The user's X25519 payload key (spec §15.6): agents seal payloads to its public half.

One file, ``$UOMP_HOME/.secrets/payload-x25519.key`` (0600, in the 0700 ``.secrets``): the private
key as unencrypted PKCS#8 PEM. It never leaves this machine; the public key is derived from it and
travels in every remote agent bundle as ``payload_public_key`` (standard base64 of the 32 raw bytes).

Made by ``uomp init``; a data directory from before payloads gets one the first time a command
needs it (:func:`ensure`). Creation is atomic and never replaces a key: the new key is written to a
temporary file (0600, fsync) and *linked* to the final name, which fails if another process got
there first; then both use the key on disk. Nothing here regenerates a key that exists but cannot
be read: payloads sealed to it would become unreadable, so that is a ``KEY_ERROR`` naming the file.
"""

from __future__ import annotations

import base64

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from gateway import pemkeys
from gateway.config import Paths

MAX_KEY_FILE_BYTES = 4096


_RESTORE = "a new key could not open the payloads sealed to this one"


def ensure(paths: Paths) -> bool:
    """Create the payload key pair if it is missing. True when this call made it."""
    return pemkeys.ensure(
        paths.payload_private_key, X25519PrivateKey.generate, X25519PrivateKey, what="payload key", restore=_RESTORE
    )


def load_private(paths: Paths) -> X25519PrivateKey:
    """The user's X25519 payload key; KEY_ERROR with the restore hint when missing or bad."""
    key = pemkeys.load(paths.payload_private_key, X25519PrivateKey, what="payload key", restore=_RESTORE)
    assert isinstance(key, X25519PrivateKey)  # pemkeys.load checked the type
    return key


def public_raw(key: X25519PrivateKey | X25519PublicKey) -> bytes:
    """The payload public key's 32 raw bytes (what agents seal to)."""
    pub = key.public_key() if isinstance(key, X25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_b64(paths: Paths) -> str:
    """The bundle's ``payload_public_key``; creates the key pair first if this home has none yet."""
    ensure(paths)
    return base64.b64encode(public_raw(load_private(paths))).decode()
