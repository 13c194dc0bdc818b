"""Deletion proofs (spec §19.3/§19.4): a good proof is accepted, each refusal has its code."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import jose
from gateway.core.canonical import canonical_json
from gateway.core.deletion import (
    DeletionProof,
    deletion_signing_input,
    parse_deletion_proof,
    sign_deletion_proof,
    verify_deletion_proof,
)
from gateway.errors import UompError

NOW = 1_783_852_500.0  # 2026-07-12T10:35:00Z
EXPIRES = NOW + 600
KEY = ed25519.Ed25519PrivateKey.generate()
OTHER = ed25519.Ed25519PrivateKey.generate()

FIELDS: dict[str, Any] = {
    "deletion_proof_id": "del_lx3k9a",
    "session_id": "sess_abc123",
    "agent_id": "calendar_agent",
    "deleted_at": "2026-07-12T10:35:00Z",
    "memory_hash": "sha256:" + "ab" * 32,
    "fields_accessed": ["key", "value"],
    "method": "process_termination",
}


def good(**changes: Any) -> dict[str, Any]:
    return sign_deletion_proof({**FIELDS, **changes}, KEY)


def check(body: Any, **overrides: Any) -> None:
    kwargs: dict[str, Any] = {
        "path_session_id": "sess_abc123",
        "token_session_id": "sess_abc123",
        "token_agent_id": "calendar_agent",
        "token_expires_at": EXPIRES,
        "agent_public_key": KEY.public_key(),
        "declared_method": "process_termination",
        "now": NOW,
    }
    kwargs.update(overrides)
    verify_deletion_proof(parse_deletion_proof(body), **kwargs)


# ----------------------------------------------------------------------------- acceptance


def test_good_proof_is_accepted() -> None:
    body = good()
    proof = parse_deletion_proof(body)
    assert isinstance(proof, DeletionProof)
    assert proof.deleted_at_ts == NOW
    assert proof.fields_accessed == ("key", "value")
    check(body)


def test_signature_covers_canonical_json_without_proof_value() -> None:
    body = good()
    sig = jose.b64u_decode(body["proof_value"])
    KEY.public_key().verify(sig, canonical_json(FIELDS))
    assert deletion_signing_input(body) == canonical_json(FIELDS)


@pytest.mark.parametrize(
    "encode",
    [
        lambda s: base64.b64encode(s).decode(),  # standard, padded
        lambda s: base64.urlsafe_b64encode(s).decode(),  # url-safe, padded
        jose.b64u_encode,  # url-safe, unpadded
    ],
    ids=["base64", "base64url padded", "base64url"],
)
def test_proof_value_encodings(encode: Any) -> None:
    body = good()
    body["proof_value"] = encode(jose.b64u_decode(body["proof_value"]))
    check(body)


def test_optional_fields_accessed_and_js_timestamps() -> None:
    fields = {k: v for k, v in FIELDS.items() if k != "fields_accessed"}
    fields["deleted_at"] = "2026-07-12T10:34:59.123Z"  # what JavaScript's toISOString() writes
    check(sign_deletion_proof(fields, KEY))


def test_no_declared_method_accepts_any_method() -> None:
    check(good(method="secure_wipe"), declared_method=None)


def test_small_clock_skew_is_tolerated() -> None:
    check(good(deleted_at="2026-07-12T10:35:59Z"))


# ----------------------------------------------------------------------------- refusals


@dataclass
class Case:
    name: str
    body: Any
    code: str
    message: str
    overrides: dict[str, Any] = field(default_factory=dict)


def _without(name: str) -> dict[str, Any]:
    body = good()
    del body[name]
    return body


def _tampered(**changes: Any) -> dict[str, Any]:
    body = good()
    body.update(changes)
    return body


SHAPE = [
    Case("not an object", ["x"], "INVALID_REQUEST", "deletion proof must be a JSON object"),
    Case("missing proof_value", _without("proof_value"), "INVALID_REQUEST", "deletion proof is missing proof_value"),
    Case("missing memory_hash", _without("memory_hash"), "INVALID_REQUEST", "deletion proof is missing memory_hash"),
    Case(
        "unknown member",
        good(extra="x"),
        "INVALID_REQUEST",
        "deletion proof has members outside spec §19.3",
    ),
    Case(
        "bad proof id",
        good(deletion_proof_id="del xxx"),
        "INVALID_REQUEST",
        "deletion proof deletion_proof_id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
    ),
    Case(
        "session id too long",
        good(session_id="s" * 129),
        "INVALID_REQUEST",
        "deletion proof session_id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
    ),
    Case(
        "agent id not a string",
        good(agent_id=5),
        "INVALID_REQUEST",
        "deletion proof agent_id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
    ),
    Case(
        "deleted_at not ISO",
        good(deleted_at="yesterday"),
        "INVALID_REQUEST",
        "deletion proof deleted_at must be an ISO 8601 timestamp",
    ),
    Case(
        "deleted_at a number",
        good(deleted_at=NOW),
        "INVALID_REQUEST",
        "deletion proof deleted_at must be an ISO 8601 timestamp",
    ),
    Case(
        "memory_hash without prefix",
        good(memory_hash="ab" * 32),
        "INVALID_REQUEST",
        "deletion proof memory_hash must be sha256:<64 lower-case hex digits>",
    ),
    Case(
        "memory_hash short",
        good(memory_hash="sha256:abc123"),
        "INVALID_REQUEST",
        "deletion proof memory_hash must be sha256:<64 lower-case hex digits>",
    ),
    Case(
        "memory_hash upper-case",
        good(memory_hash="sha256:" + "AB" * 32),
        "INVALID_REQUEST",
        "deletion proof memory_hash must be sha256:<64 lower-case hex digits>",
    ),
    Case(
        "fields_accessed not a list",
        good(fields_accessed="key"),
        "INVALID_REQUEST",
        "deletion proof fields_accessed must be a list of at most 64 field names",
    ),
    Case(
        "fields_accessed too long",
        good(fields_accessed=["f"] * 65),
        "INVALID_REQUEST",
        "deletion proof fields_accessed must be a list of at most 64 field names",
    ),
    Case(
        "unknown method",
        good(method="shredder"),
        "INVALID_REQUEST",
        "deletion proof method must be one of process_termination, secure_wipe, ephemeral_storage",
    ),
    Case(
        "proof_value too long",
        _tampered(proof_value="A" * 257),
        "INVALID_REQUEST",
        "deletion proof proof_value must be a signature string",
    ),
    Case(
        "proof_value empty",
        _tampered(proof_value=""),
        "INVALID_REQUEST",
        "deletion proof proof_value must be a signature string",
    ),
]

CHECKS = [
    Case(
        "session_id differs from path",
        good(session_id="sess_other"),
        "INVALID_REQUEST",
        "deletion proof session_id does not match the path",
    ),
    Case(
        "path session is not the token's",
        good(session_id="sess_other"),
        "ACCESS_DENIED",
        "token is not for this session",
        {"path_session_id": "sess_other"},
    ),
    Case(
        "agent is not the token's",
        good(agent_id="other_agent"),
        "ACCESS_DENIED",
        "deletion proof agent_id is not the token's agent",
    ),
    Case(
        "deleted_at in the future",
        good(deleted_at="2026-07-12T10:36:01Z"),
        "INVALID_REQUEST",
        "deletion proof deleted_at is in the future",
    ),
    Case(
        "deleted_at after token expiry",
        good(deleted_at="2026-07-12T10:35:00Z"),
        "INVALID_REQUEST",
        "deletion proof deleted_at is after the token expired",
        {"token_expires_at": NOW - 1},
    ),
    Case(
        "method differs from manifest",
        good(method="secure_wipe"),
        "INVALID_REQUEST",
        "deletion proof method does not match the manifest's deletion_method",
    ),
    Case(
        "no registered identity key",
        good(),
        "ACCESS_DENIED",
        "agent has no verified identity key; deletion proofs cannot be verified",
        {"agent_public_key": None},
    ),
    Case(
        "signed by another key",
        sign_deletion_proof(FIELDS, OTHER),
        "ACCESS_DENIED",
        "deletion proof signature is invalid",
    ),
    Case(
        "tampered memory_hash",
        _tampered(memory_hash="sha256:" + "cd" * 32),
        "ACCESS_DENIED",
        "deletion proof signature is invalid",
    ),
    Case(
        "tampered deleted_at",
        _tampered(deleted_at="2026-07-12T10:30:00Z"),
        "ACCESS_DENIED",
        "deletion proof signature is invalid",
    ),
    Case(
        "fields_accessed removed after signing",
        {k: v for k, v in good().items() if k != "fields_accessed"},
        "ACCESS_DENIED",
        "deletion proof signature is invalid",
    ),
    Case(
        "reference SDK style proof_value (a hash, not a signature)",
        _tampered(proof_value="sha256:" + "ab" * 32),
        "ACCESS_DENIED",
        "deletion proof proof_value is not an Ed25519 signature (base64url or base64)",
    ),
    Case(
        "proof_value of the wrong length",
        _tampered(proof_value=jose.b64u_encode(b"\x00" * 32)),
        "ACCESS_DENIED",
        "deletion proof proof_value is not an Ed25519 signature (base64url or base64)",
    ),
    Case(
        "proof_value with mixed alphabets",
        _tampered(proof_value="+" + jose.b64u_encode(b"\x00" * 63) + "_"),
        "ACCESS_DENIED",
        "deletion proof proof_value is not an Ed25519 signature (base64url or base64)",
    ),
]


@pytest.mark.parametrize("case", SHAPE + CHECKS, ids=[c.name for c in SHAPE + CHECKS])
def test_refusal(case: Case) -> None:
    with pytest.raises(UompError) as e:
        check(case.body, **case.overrides)
    assert (e.value.code, e.value.message) == (case.code, case.message)


def test_sign_deletion_proof_replaces_an_existing_proof_value() -> None:
    body = sign_deletion_proof({**FIELDS, "proof_value": "stale"}, KEY)
    check(body)
