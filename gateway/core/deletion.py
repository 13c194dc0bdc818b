"""Deletion proofs (spec §19.3, §19.4), pure.

An agent whose manifest declares ``proof_required`` submits, before its session closes, a
statement that it deleted what it read, signed with its identity key:

    {"deletion_proof_id", "session_id", "agent_id", "deleted_at", "memory_hash",
     "fields_accessed" (optional), "method", "proof_value"}

:func:`parse_deletion_proof` checks the shape: exactly these members (anything else is refused,
so what is recorded is what was signed), each of its type and bounded; ``memory_hash`` is
``sha256:`` followed by 64 lower-case hex digits; ``deleted_at`` ISO 8601.

:func:`verify_deletion_proof` checks it against the request and the token:

* ``INVALID_REQUEST``: ``session_id`` differs from the path's; ``deleted_at`` more than 60 s in
  the future; ``deleted_at`` after the token's ``expires_at`` (§19.4); ``method`` differs from
  the manifest's ``deletion_method`` (when the manifest declared one; with no declared policy
  there is nothing to match and any of the three methods is accepted);
* ``ACCESS_DENIED``: the path's session, the proof's session or the proof's agent is not the
  token's; the agent has no verified identity key (no ``did:key`` manifest signature was
  verified at authorization, so there is nothing to check the proof against); the signature
  does not verify.

Signature: Ed25519 (RFC 8032) over ``canonical_json`` (RFC 8785) of the proof object without its
``proof_value`` member. ``proof_value`` is the 64-byte signature in base64url (padded or not)
or standard base64 (padded); both are accepted. Note that the public TypeScript reference SDK
currently puts ``"sha256:<memory hash>"`` in ``proof_value``, which is not a signature: such
proofs are refused (ACCESS_DENIED), never recorded as verified.

Not here: ``deletionProofHash = keccak256(deletion_proof_id || session_id || memory_hash)`` of
§18.4.1/§19.6. ``cryptography`` has no Keccak-256 (its SHA3-256 uses different padding and gives
different digests), so the hash is left to the anchoring code that brings a Keccak
implementation.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import jose
from gateway.core.canonical import canonical_json
from gateway.core.manifest import DELETION_METHODS
from gateway.core.tokens import parse_iso
from gateway.errors import ErrorCode, UompError

# Tolerated clock skew for deleted_at ahead of our clock.
DELETED_AT_SKEW_SECONDS = 60
MAX_ID = 128
MAX_FIELDS = 64
MAX_FIELD_NAME = 128
MAX_PROOF_VALUE = 256
REQUIRED_MEMBERS = (
    "deletion_proof_id",
    "session_id",
    "agent_id",
    "deleted_at",
    "memory_hash",
    "method",
    "proof_value",
)
OPTIONAL_MEMBERS = ("fields_accessed",)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_MEMORY_HASH = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class DeletionProof:
    """A verified §19 deletion proof: which session's data the agent deleted, when, and the hash of what it had read."""

    deletion_proof_id: str
    session_id: str
    agent_id: str
    deleted_at: str  # as sent (it is what was signed)
    deleted_at_ts: float  # seconds since the epoch
    memory_hash: str
    fields_accessed: tuple[str, ...] | None
    method: str
    proof_value: str
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)


def _bad(message: str) -> UompError:
    return UompError(ErrorCode.INVALID_REQUEST, message)


def _denied(message: str) -> UompError:
    return UompError(ErrorCode.ACCESS_DENIED, message)


def _ident(body: Mapping[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise _bad(f"deletion proof {name} must be 1-{MAX_ID} characters of A-Z a-z 0-9 . _ : -")
    return value


def parse_deletion_proof(body: Any) -> DeletionProof:
    """Check the §19.3 shape of a submitted deletion proof; every failure is INVALID_REQUEST."""
    if not isinstance(body, dict):
        raise _bad("deletion proof must be a JSON object")
    missing = [m for m in REQUIRED_MEMBERS if m not in body]
    if missing:
        raise _bad("deletion proof is missing " + ", ".join(missing))
    unknown = set(body) - set(REQUIRED_MEMBERS) - set(OPTIONAL_MEMBERS)
    if unknown:
        raise _bad("deletion proof has members outside spec §19.3")
    proof_id = _ident(body, "deletion_proof_id")
    session_id = _ident(body, "session_id")
    agent_id = _ident(body, "agent_id")
    deleted_at = body["deleted_at"]
    try:
        deleted_at_ts = parse_iso(deleted_at)
    except (ValueError, OverflowError) as exc:
        raise _bad("deletion proof deleted_at must be an ISO 8601 timestamp") from exc
    memory_hash = body["memory_hash"]
    if not isinstance(memory_hash, str) or not _MEMORY_HASH.fullmatch(memory_hash):
        raise _bad("deletion proof memory_hash must be sha256:<64 lower-case hex digits>")
    fields_accessed: tuple[str, ...] | None = None
    fa = body.get("fields_accessed")
    if fa is not None:
        if (
            not isinstance(fa, list)
            or len(fa) > MAX_FIELDS
            or not all(isinstance(f, str) and 0 < len(f) <= MAX_FIELD_NAME for f in fa)
        ):
            raise _bad(f"deletion proof fields_accessed must be a list of at most {MAX_FIELDS} field names")
        fields_accessed = tuple(fa)
    method = body["method"]
    if method not in DELETION_METHODS:
        raise _bad("deletion proof method must be one of " + ", ".join(DELETION_METHODS))
    proof_value = body["proof_value"]
    if not isinstance(proof_value, str) or not proof_value or len(proof_value) > MAX_PROOF_VALUE:
        raise _bad("deletion proof proof_value must be a signature string")
    return DeletionProof(
        deletion_proof_id=proof_id,
        session_id=session_id,
        agent_id=agent_id,
        deleted_at=deleted_at,
        deleted_at_ts=deleted_at_ts,
        memory_hash=memory_hash,
        fields_accessed=fields_accessed,
        method=method,
        proof_value=proof_value,
        raw=dict(body),
    )


def deletion_signing_input(proof: Mapping[str, Any]) -> bytes:
    """canonical_json of the proof object without ``proof_value``: the bytes the agent signs."""
    return canonical_json({k: v for k, v in proof.items() if k != "proof_value"})


def _decode_signature(value: str) -> bytes | None:
    """64 bytes from base64url (padding optional) or standard base64 (padded); None otherwise."""
    if not re.fullmatch(r"[A-Za-z0-9+/_-]+={0,2}", value):
        return None
    if ("+" in value or "/" in value) and ("-" in value or "_" in value):
        return None  # mixed alphabets
    text = value.replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 64 else None


def verify_deletion_proof(
    proof: DeletionProof,
    *,
    path_session_id: str,
    token_session_id: str,
    token_agent_id: str,
    token_expires_at: float,
    agent_public_key: ed25519.Ed25519PublicKey | None,
    declared_method: str | None,
    now: float,
) -> None:
    """Accept (return None) or refuse (raise) a parsed proof; see the module docstring."""
    if proof.session_id != path_session_id:
        raise _bad("deletion proof session_id does not match the path")
    if path_session_id != token_session_id:
        raise _denied("token is not for this session")
    if proof.agent_id != token_agent_id:
        raise _denied("deletion proof agent_id is not the token's agent")
    if proof.deleted_at_ts > now + DELETED_AT_SKEW_SECONDS:
        raise _bad("deletion proof deleted_at is in the future")
    if proof.deleted_at_ts > token_expires_at:
        raise _bad("deletion proof deleted_at is after the token expired")
    if declared_method is not None and proof.method != declared_method:
        raise _bad("deletion proof method does not match the manifest's deletion_method")
    if agent_public_key is None:
        raise _denied("agent has no verified identity key; deletion proofs cannot be verified")
    signature = _decode_signature(proof.proof_value)
    if signature is None:
        raise _denied("deletion proof proof_value is not an Ed25519 signature (base64url or base64)")
    try:
        agent_public_key.verify(signature, deletion_signing_input(proof.raw))
    except InvalidSignature as exc:
        raise _denied("deletion proof signature is invalid") from exc


def sign_deletion_proof(fields: Mapping[str, Any], private_key: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    """``fields`` plus ``proof_value`` (base64url Ed25519 signature); for the SDK and tests."""
    doc = {k: v for k, v in fields.items() if k != "proof_value"}
    doc["proof_value"] = jose.b64u_encode(private_key.sign(deletion_signing_input(doc)))
    return doc
