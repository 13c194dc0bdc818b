"""OpenPGP publishers: a detached signature over the manifest by a key in the user's trust list.

The manifest carries ``identity.proof = {"type": "OpenPGPSignature2026", "fingerprint": <40 or 64
hex>, "proofValue": <base64url of the binary detached signature>}`` over the same bytes as every
other proof here (:func:`gateway.core.publisher.manifest_signing_input`: the manifest without
``proofValue``). The key is never taken from the manifest: only a certificate the user put in the
trust list (``uomp trust add-openpgp KEYFILE``) can verify, and a revoked or expired one does not.

Checked with Sequoia-PGP through ``pysequoia`` (the ``[openpgp]`` extra): a maintained OpenPGP
implementation (RFC 9580) whose verifier already refuses signatures by revoked, expired or
non-signing keys; PGPy, the other pure-Python choice, has had no release since 2022.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from gateway.core import jose
from gateway.core.publisher import manifest_signing_input
from gateway.errors import ErrorCode, UompError
from gateway.trust import TrustEntry, TrustList

PROOF_TYPE = "OpenPGPSignature2026"
MAX_KEY_BYTES = 64 * 1024
_FPR = re.compile(r"[0-9a-fA-F]{40}|[0-9a-fA-F]{64}")
MISSING = "OpenPGP support is not installed: pip install 'uomp-gateway[openpgp]'"


class OpenPgpError(ValueError):
    """Why an OpenPGP publisher does not verify (a sentence for the authorization panel)."""


def _lib() -> Any:
    try:
        import pysequoia
    except ImportError as exc:
        raise OpenPgpError(MISSING) from exc
    return pysequoia


def key_entry(armored: bytes, name: str) -> TrustEntry:
    """The trust-list entry for an OpenPGP certificate (public key); INVALID_REQUEST when it is not one."""
    try:
        p = _lib()
    except OpenPgpError as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, str(exc)) from exc
    if len(armored) > MAX_KEY_BYTES:
        raise UompError(ErrorCode.INVALID_REQUEST, f"an OpenPGP key file is at most {MAX_KEY_BYTES} bytes")
    try:
        cert = p.Cert.from_bytes(armored)
    except Exception as exc:  # pysequoia raises plain exceptions for unparsable input
        raise UompError(ErrorCode.INVALID_REQUEST, "not an OpenPGP public key; export it with gpg --export -a") from exc
    with warnings.catch_warnings():  # pysequoia deprecates the property, and has no other way to ask
        warnings.simplefilter("ignore", DeprecationWarning)
        secret = bool(cert.has_secret_keys)
    if secret:
        raise UompError(
            ErrorCode.INVALID_REQUEST, "this file holds a SECRET key: give the public key only (gpg --export -a)"
        )
    fpr = str(cert.fingerprint).lower()
    return TrustEntry(
        kind="openpgp", id=fpr, name=name, fingerprint=fpr, added_at="", how="trust add-openpgp", data=str(cert)
    )


def is_revoked(entry: TrustEntry) -> bool:
    """Whether the trusted OpenPGP key of ``entry`` carries a revocation."""
    p = _lib()
    return bool(p.Cert.from_bytes((entry.data or "").encode()).is_revoked)


def verify(manifest_raw: dict[str, Any], trusted: TrustList) -> TrustEntry:
    """The trust entry whose key made ``identity.proof``; OpenPgpError otherwise."""
    identity = manifest_raw.get("identity")
    proof = identity.get("proof") if isinstance(identity, dict) else None
    if not isinstance(proof, dict) or proof.get("type") != PROOF_TYPE:
        raise OpenPgpError(f"identity.proof.type is not {PROOF_TYPE}")
    fpr = proof.get("fingerprint")
    if not isinstance(fpr, str) or not _FPR.fullmatch(fpr):
        raise OpenPgpError("identity.proof.fingerprint is not an OpenPGP fingerprint (40 or 64 hex digits)")
    fpr = fpr.lower()
    entry = next((e for e in trusted.of_kind("openpgp") if e.id == fpr), None)
    if entry is None:
        raise OpenPgpError(f"the OpenPGP key {fpr} is not in your trust list (uomp trust add-openpgp KEYFILE)")
    p = _lib()
    try:
        cert = p.Cert.from_bytes((entry.data or "").encode())
    except Exception as exc:
        raise OpenPgpError(f"the trusted OpenPGP key {fpr} cannot be read; add it again") from exc
    if cert.is_revoked:
        raise OpenPgpError(f"the OpenPGP key {fpr} is REVOKED: its signatures no longer count")
    value = proof.get("proofValue")
    if not isinstance(value, str):
        raise OpenPgpError("identity.proof.proofValue is missing")
    try:
        sig = p.Sig.from_bytes(jose.b64u_decode(value))
        signed = manifest_signing_input(manifest_raw)
    except (ValueError, UompError) as exc:
        raise OpenPgpError("identity.proof.proofValue is not a base64url OpenPGP signature") from exc
    except Exception as exc:
        raise OpenPgpError("identity.proof.proofValue is not an OpenPGP signature") from exc
    try:
        result = p.verify(bytes=signed, store=lambda _ids: [cert], signature=sig)
    except Exception as exc:  # Sequoia: no valid signature (other bytes, other key, revoked, expired)
        raise OpenPgpError(
            "the signature does not verify: the manifest was altered, or signed by another, expired or revoked key"
        ) from exc
    if not result.valid_sigs or str(result.valid_sigs[0].certificate).lower() != fpr:
        raise OpenPgpError("the signature was not made by the key it names")
    return entry
