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

from gateway.config import Paths
from gateway.errors import UompError
from gateway.fsutil import create_private_file, ensure_private_dir

MAX_KEY_FILE_BYTES = 4096


def ensure(paths: Paths) -> bool:
    """Create the audit key if it is missing; True when this call made it."""
    if paths.audit_key.exists():
        load(paths)
        return False
    ensure_private_dir(paths.secrets)
    pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption())
    made = create_private_file(paths.audit_key, pem)
    load(paths)
    return made


def load(paths: Paths) -> Ed25519PrivateKey:
    path = paths.audit_key
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UompError("KEY_ERROR", f"no audit signing key at {path}; run 'uomp init'") from None
    if st.st_mode & 0o077:
        raise UompError("KEY_ERROR", f"{path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise UompError("KEY_ERROR", f"{path} is too large to be a key")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise UompError("KEY_ERROR", f"{path} is not a readable Ed25519 key ({type(exc).__name__}); restore it: "
                        "a new key would not continue the log's signed checkpoints") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UompError("KEY_ERROR", f"{path} is not an Ed25519 private key")
    return key


def origin_for(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "uomp-audit/" + hashlib.sha256(raw).hexdigest()[:16]
