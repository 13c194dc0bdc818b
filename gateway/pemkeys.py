"""Private keys kept as one PKCS#8 PEM file each (the audit signing key, the payload key).

Made once, never replaced: a new key could not continue what the old one signed or open what was
sealed to it, so a missing key is created atomically (:func:`gateway.fsutil.create_private_file`)
and a present but unreadable one is a ``KEY_ERROR`` naming the file and why it must be restored.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from gateway.atrest import vault
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import ensure_private_dir

MAX_KEY_FILE_BYTES = 4096


def ensure(path: Path, generate: Callable[[], PrivateKeyTypes], kind: Any, *, what: str, restore: str) -> bool:
    """Create the key at ``path`` (``generate()``) unless present; True when this call made it."""
    if path.exists():
        load(path, kind, what=what, restore=restore)  # validates (mode, format); never replaced
        return False
    ensure_private_dir(path.parent)
    key = generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    made = vault.create_key(path, pem)  # sealed in a sealed home
    load(path, kind, what=what, restore=restore)
    return made


def load(path: Path, kind: Any, *, what: str, restore: str) -> PrivateKeyTypes:
    """The key at ``path``: 0600 or stricter, small, PEM, of type ``kind``; else KEY_ERROR."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UompError(ErrorCode.KEY_ERROR, f"no {what} at {path}; run 'uomp init'") from None
    if st.st_mode & 0o077:
        raise UompError(
            ErrorCode.KEY_ERROR, f"{path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it"
        )
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise UompError(ErrorCode.KEY_ERROR, f"{path} is too large to be a {what}")
    try:
        key = serialization.load_pem_private_key(vault.read_key(path), password=None)
    except UompError:
        raise
    except (OSError, ValueError, TypeError) as exc:
        raise UompError(
            ErrorCode.KEY_ERROR, f"{path} is not a readable {what} ({type(exc).__name__}); restore it: {restore}"
        ) from None
    if not isinstance(key, kind):
        raise UompError(ErrorCode.KEY_ERROR, f"{path} is not a {what} of the right type")
    out: PrivateKeyTypes = key
    return out
