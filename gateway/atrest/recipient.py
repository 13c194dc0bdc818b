"""Backup recipients: X25519 identities (a 0600 PEM file) and their public keys
(``uomp-x25519:`` and 64 hex digits), the idea of age's X25519 recipients: a backup to a recipient
carries a fresh ephemeral public key; its chunk key is ``HKDF-SHA256(X25519(ephemeral, recipient),
salt = ephemeral || recipient, info = "uomp-backup/2/x25519")``."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gateway.errors import ErrorCode, UompError

PREFIX = "uomp-x25519:"
INFO = b"uomp-backup/2/x25519"
MAX_IDENTITY_BYTES = 4096


def recipient_text(public: X25519PublicKey) -> str:
    """The public key a user passes to ``--to-recipient`` (``uomp-x25519:`` and 64 hex digits)."""
    return PREFIX + public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def parse_recipient(text: str) -> X25519PublicKey:
    """A ``--to-recipient`` value as a key; USAGE with the expected form otherwise."""
    body = text.strip().removeprefix(PREFIX)
    try:
        raw = bytes.fromhex(body)
        if len(raw) != 32 or not text.strip().startswith(PREFIX):
            raise ValueError("length")
        return X25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise UompError(
            ErrorCode.USAGE,
            f"not a backup recipient key; give the '{PREFIX}<64 hex>' line 'uomp backup keygen' printed",
        ) from None


def new_identity(path: Path) -> X25519PublicKey:
    """A new X25519 identity written to ``path`` (created 0600, never overwritten); its public key."""
    key = X25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key.public_key()


def load_identity(path: Path) -> X25519PrivateKey:
    """The X25519 identity in ``path``; KEY_ERROR when it is not one or others may read it."""
    try:
        if os.stat(path).st_mode & 0o077:
            raise UompError(
                ErrorCode.UNSAFE_PERMISSIONS, f"the identity file {path} is readable by others; chmod 600 it"
            )
        with open(path, "rb") as fh:
            raw = fh.read(MAX_IDENTITY_BYTES + 1)
        key = serialization.load_pem_private_key(raw[:MAX_IDENTITY_BYTES], password=None)
        if not isinstance(key, X25519PrivateKey):
            raise ValueError("not an X25519 key")
        return key
    except (OSError, ValueError, TypeError) as exc:
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{path} is not a backup identity ({type(exc).__name__}); give the file 'uomp backup keygen' wrote",
        ) from None


def derive_key(shared: bytes, epk: bytes, rpk: bytes) -> bytes:
    """The chunk key of a backup to a recipient: HKDF-SHA256 of the X25519 shared secret."""
    return HKDF(hashes.SHA256(), 32, salt=epk + rpk, info=INFO).derive(shared)


def raw(pub: X25519PublicKey) -> bytes:
    """The 32 bytes of an X25519 public key."""
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
