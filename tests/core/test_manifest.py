"""uom.json (spec §6) parsing, retention levels (§6.5) and did:key identity (§16)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import jose
from gateway.core.canonical import canonical_json
from gateway.core.capability import Scope
from gateway.core.manifest import (
    UNSUPPORTED_REASON,
    RetentionPolicy,
    b58btc_decode,
    b58btc_encode,
    did_key_from_public,
    manifest_signing_input,
    parse_manifest,
    public_key_from_did_key,
    retention_level,
    sign_manifest,
    verify_identity,
)
from gateway.errors import UompError

# Spec Appendix B, verbatim.
APPENDIX_B = b"""{
  "uomp_version": "1.0",
  "agent": {
    "id": "calendar_agent",
    "name": "Calendar Assistant",
    "version": "1.2.0",
    "description": "Helps manage your schedule and todos",
    "publisher": "example-org"
  },
  "requested_scopes": {
    "read": {
      "tags": ["preference", "identity:public"],
      "keys": [],
      "description": "Read user preferences and public identity info for personalized schedule suggestions"
    },
    "write": {
      "tags": ["preference"],
      "keys": [],
      "description": "Write schedule-related preferences"
    }
  },
  "required_capabilities": ["memory.read"],
  "optional_capabilities": ["memory.query"],
  "requires_remote": false,
  "data_retention_policy": {
    "max_retention_seconds": 300,
    "deletion_method": "process_termination",
    "proof_required": false,
    "description": "Agent clears all user data within 5 minutes after task completion"
  },
  "identity": {
    "did": "did:ethr:0xabc123...",
    "verification_methods": ["did", "gpg"],
    "proof": {
      "type": "Ed25519Signature2020",
      "created": "2026-07-12T10:00:00Z",
      "proofValue": "..."
    }
  }
}
"""


def base() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(APPENDIX_B)
    del doc["identity"]
    return doc


def errors_of(data: Any) -> dict[str, str]:
    with pytest.raises(UompError) as e:
        parse_manifest(data)
    assert e.value.code == "MANIFEST_INVALID"
    details = e.value.details
    assert details is not None
    errs = {item["field"]: item["message"] for item in details["errors"]}
    assert details["lines"] == [f"{item['field']}: {item['message']}" for item in details["errors"]]
    n = len(details["errors"])
    assert e.value.message == f"uom.json is invalid: {n} problem{'s' if n != 1 else ''}"
    return errs


# ----------------------------------------------------------------------------- parsing


def test_appendix_b_parses() -> None:
    m = parse_manifest(APPENDIX_B)
    assert m.uomp_version == "1.0"
    assert (m.agent.id, m.agent.name, m.agent.version) == ("calendar_agent", "Calendar Assistant", "1.2.0")
    assert m.agent.publisher == "example-org"
    assert m.read == Scope(tags=("preference", "identity:public"), keys=())
    assert m.write == Scope(tags=("preference",))
    assert m.read_description and m.read_description.startswith("Read user preferences")
    assert m.required_capabilities == ("memory.read",)
    assert m.optional_capabilities == ("memory.query",)
    assert m.requires_remote is False
    assert m.retention == RetentionPolicy(
        max_retention_seconds=300,
        deletion_method="process_termination",
        proof_required=False,
        description="Agent clears all user data within 5 minutes after task completion",
    )
    assert m.identity is not None and m.identity.did == "did:ethr:0xabc123..."
    assert m.identity.verification_methods == ("did", "gpg")
    assert m.identity.proof_type == "Ed25519Signature2020" and m.identity.proof_value == "..."
    assert retention_level(m.retention) == "short"


def test_dict_input_and_bytes_input_agree() -> None:
    assert parse_manifest(json.loads(APPENDIX_B)) == parse_manifest(APPENDIX_B)


def test_camel_case_spellings_are_accepted() -> None:
    doc = {
        "uompVersion": "1.0",
        "agent": {"id": "a", "name": "A", "version": "0.1.0"},
        "requestedScopes": {
            "read": {
                "tags": ["t"],
                "keys": ["k"],
                "denyTags": ["financial"],
                "denyKeys": ["user.password"],
                "allowedFields": ["key", "value"],
            }
        },
        "requiredCapabilities": ["memory.read"],
        "requiresRemote": True,
        "dataRetentionPolicy": {
            "maxRetentionSeconds": 0,
            "deletionMethod": "ephemeral_storage",
            "proofRequired": True,
            "thirdPartySharing": True,
            "encryptionAtRest": True,
        },
        "identity": {"did": "did:web:example.com", "verificationMethods": ["did"]},
    }
    m = parse_manifest(doc)
    assert m.read == Scope(
        tags=("t",),
        keys=("k",),
        deny_tags=("financial",),
        deny_keys=("user.password",),
        allowed_fields=("key", "value"),
    )
    assert m.write == Scope()
    assert m.requires_remote is True
    assert m.retention == RetentionPolicy(0, "ephemeral_storage", True, True, True, None)
    assert m.identity is not None and m.identity.verification_methods == ("did",)


def test_snake_case_scope_extras_and_unknown_members_are_accepted() -> None:
    doc = base()
    doc["external_data_sources"] = ["yahoo-finance"]
    doc["requested_scopes"]["read"].update(
        {
            "deny_tags": ["financial"],
            "deny_keys": [],
            "allowed_fields": ["key", "value"],
            "fields": {"portfolio:holdings": ["symbol"]},
            "purposes": {"portfolio:holdings": "why"},
        }
    )
    doc["agent"]["name"] = "持仓分析助手"  # non-ASCII names are fine
    m = parse_manifest(doc)
    assert m.read.deny_tags == ("financial",) and m.read.allowed_fields == ("key", "value")
    assert m.agent.name == "持仓分析助手"


def test_minimal_manifest() -> None:
    m = parse_manifest(
        {"uomp_version": "1.0", "agent": {"id": "x", "name": "X", "version": "1.0.0"}, "requested_scopes": {}}
    )
    assert m.read == Scope() and m.retention is None and m.identity is None
    assert retention_level(m.retention) == "no_guarantee"


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        doc = doc[p]
    if value is _DELETE:
        del doc[last]
    else:
        doc[last] = value


_DELETE = object()

BAD_FIELDS: list[tuple[str, Any, str, str]] = [
    # (path to change, new value, field reported, message)
    ("uomp_version", "2.0", "uomp_version", 'must be "1.0"'),
    ("uomp_version", 1.0, "uomp_version", 'must be "1.0"'),
    ("uomp_version", _DELETE, "uomp_version", 'is required ("1.0")'),
    ("agent", _DELETE, "agent", "is required"),
    ("agent", [], "agent", "must be an object"),
    ("agent.id", _DELETE, "agent.id", "is required"),
    ("agent.id", "", "agent.id", "must be 1-128 characters of A-Z a-z 0-9 . _ - starting with a letter or digit"),
    (
        "agent.id",
        "a" * 129,
        "agent.id",
        "must be 1-128 characters of A-Z a-z 0-9 . _ - starting with a letter or digit",
    ),
    ("agent.id", "../etc", "agent.id", "must be 1-128 characters of A-Z a-z 0-9 . _ - starting with a letter or digit"),
    (
        "agent.id",
        "cal agent",
        "agent.id",
        "must be 1-128 characters of A-Z a-z 0-9 . _ - starting with a letter or digit",
    ),
    ("agent.id", 7, "agent.id", "must be 1-128 characters of A-Z a-z 0-9 . _ - starting with a letter or digit"),
    ("agent.name", _DELETE, "agent.name", "is required"),
    ("agent.name", "   ", "agent.name", "must not be empty"),
    ("agent.name", "x" * 201, "agent.name", "must be at most 200 characters"),
    ("agent.name", "Calendar\x1b[2J", "agent.name", "must not contain control or bidirectional-override characters"),
    ("agent.name", "Cal\u202eradnelac", "agent.name", "must not contain control or bidirectional-override characters"),
    ("agent.name", "Cal\u2028endar", "agent.name", "must not contain control or bidirectional-override characters"),
    ("agent.name", ["x"], "agent.name", "must be a string"),
    ("agent.version", "1.2", "agent.version", "must be a semantic version such as 1.2.0 (MAJOR.MINOR.PATCH)"),
    ("agent.version", "v1.2.0", "agent.version", "must be a semantic version such as 1.2.0 (MAJOR.MINOR.PATCH)"),
    ("agent.version", "١.٢.٣", "agent.version", "must be a semantic version such as 1.2.0 (MAJOR.MINOR.PATCH)"),
    ("agent.version", _DELETE, "agent.version", "is required"),
    ("agent.description", 5, "agent.description", "must be a string"),
    ("agent.publisher", "a\nb", "agent.publisher", "must not contain control or bidirectional-override characters"),
    ("requested_scopes", _DELETE, "requested_scopes", "is required"),
    ("requested_scopes.read", "preference", "requested_scopes.read", "must be an object"),
    (
        "requested_scopes.read.tags",
        _DELETE,
        "requested_scopes.read.tags",
        "is required (a list of strings, may be empty)",
    ),
    ("requested_scopes.read.tags", "preference", "requested_scopes.read.tags", "must be a list of strings"),
    ("requested_scopes.read.tags", ["ok", 3], "requested_scopes.read.tags[1]", "must be a non-empty string"),
    ("requested_scopes.read.tags", ["ok", ""], "requested_scopes.read.tags[1]", "must be a non-empty string"),
    (
        "requested_scopes.read.keys",
        _DELETE,
        "requested_scopes.read.keys",
        "is required (a list of strings, may be empty)",
    ),
    ("requested_scopes.write.keys", [None], "requested_scopes.write.keys[0]", "must be a non-empty string"),
    ("requested_scopes.read.tags", ["x" * 257], "requested_scopes.read.tags[0]", "must be at most 256 characters"),
    ("requested_scopes.read.tags", ["a"] * 1025, "requested_scopes.read.tags", "must have at most 1024 items"),
    ("requested_scopes.read.deny_tags", "financial", "requested_scopes.read.deny_tags", "must be a list of strings"),
    (
        "requested_scopes.read.allowed_fields",
        [1],
        "requested_scopes.read.allowed_fields[0]",
        "must be a non-empty string",
    ),
    ("requested_scopes.read.description", 1, "requested_scopes.read.description", "must be a string"),
    ("required_capabilities", "memory.read", "required_capabilities", "must be a list of strings"),
    (
        "required_capabilities",
        ["Memory Read"],
        "required_capabilities[0]",
        "must be a capability name such as memory.read",
    ),
    (
        "optional_capabilities",
        ["memory.read"],
        "optional_capabilities",
        "must not repeat a required capability: memory.read",
    ),
    ("requires_remote", "yes", "requires_remote", "must be true or false"),
    ("data_retention_policy", 300, "data_retention_policy", "must be an object"),
    (
        "data_retention_policy.max_retention_seconds",
        _DELETE,
        "data_retention_policy.max_retention_seconds",
        "is required",
    ),
    (
        "data_retention_policy.max_retention_seconds",
        -1,
        "data_retention_policy.max_retention_seconds",
        "must be a number of seconds >= 0",
    ),
    (
        "data_retention_policy.max_retention_seconds",
        "300",
        "data_retention_policy.max_retention_seconds",
        "must be a number of seconds >= 0",
    ),
    (
        "data_retention_policy.max_retention_seconds",
        True,
        "data_retention_policy.max_retention_seconds",
        "must be a number of seconds >= 0",
    ),
    (
        "data_retention_policy.deletion_method",
        "shred",
        "data_retention_policy.deletion_method",
        "must be one of process_termination, secure_wipe, ephemeral_storage",
    ),
    ("data_retention_policy.deletion_method", _DELETE, "data_retention_policy.deletion_method", "is required"),
    ("data_retention_policy.proof_required", "false", "data_retention_policy.proof_required", "must be true or false"),
    (
        "data_retention_policy.third_party_sharing",
        0,
        "data_retention_policy.third_party_sharing",
        "must be true or false",
    ),
    (
        "data_retention_policy.encryption_at_rest",
        1,
        "data_retention_policy.encryption_at_rest",
        "must be true or false",
    ),
    ("identity", "did:key:z", "identity", "must be an object"),
    ("identity.did", "not-a-did", "identity.did", "must be a DID (did:<method>:<identifier>)"),
    (
        "identity.verification_methods",
        ["pgp"],
        "identity.verification_methods[0]",
        "must be one of did, gpg, x509, registry",
    ),
    ("identity.proof", "sig", "identity.proof", "must be an object"),
    ("identity.proof.type", _DELETE, "identity.proof.type", "is required"),
    ("identity.proof.created", "yesterday", "identity.proof.created", "must be an ISO 8601 timestamp"),
    ("identity.proof.proofValue", _DELETE, "identity.proof.proofValue", "is required"),
]


@pytest.mark.parametrize(
    ("path", "value", "field", "message"),
    BAD_FIELDS,
    ids=[f"{p}={'<deleted>' if v is _DELETE else repr(v)[:20]}" for p, v, _, _ in BAD_FIELDS],
)
def test_each_bad_field_is_reported(path: str, value: Any, field: str, message: str) -> None:
    doc = json.loads(APPENDIX_B)
    _set(doc, path, value)
    errs = errors_of(doc)
    assert errs == {field: message}


def test_every_bad_field_is_reported_at_once() -> None:
    doc = json.loads(APPENDIX_B)
    doc["uomp_version"] = "0.9"
    doc["agent"]["id"] = "bad id"
    doc["agent"]["version"] = "latest"
    doc["requested_scopes"]["read"]["tags"] = "preference"
    doc["data_retention_policy"]["deletion_method"] = "forget"
    doc["requires_remote"] = "no"
    errs = errors_of(doc)
    assert set(errs) == {
        "uomp_version",
        "agent.id",
        "agent.version",
        "requested_scopes.read.tags",
        "data_retention_policy.deletion_method",
        "requires_remote",
    }
    with pytest.raises(UompError) as e:
        parse_manifest(doc)
    assert e.value.message == "uom.json is invalid: 6 problems"
    assert e.value.details is not None
    assert "agent.id: must be 1-128 characters" in " | ".join(e.value.details["lines"])


def test_both_spellings_of_one_member_is_an_error() -> None:
    doc = base()
    doc["requested_scopes"]["read"]["deny_tags"] = ["a"]
    doc["requested_scopes"]["read"]["denyTags"] = ["b"]
    assert errors_of(doc) == {"requested_scopes.read.deny_tags": "given twice (as deny_tags and denyTags)"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"{", "not valid JSON (line 1, column 2: Expecting property name enclosed in double quotes)"),
        (b"[]", "must be a JSON object"),
        (b"\xff\xfe{}", "file is not UTF-8"),
        (b'{"a": NaN}', "not valid JSON"),
        (b'{"uomp_version": "1.0", "uomp_version": "1.0"}', "duplicate member name 'uomp_version'"),
        (b" " * (256 * 1024 + 1), "file is larger than 262144 bytes"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    ],
    ids=["truncated", "array", "not utf8", "NaN", "duplicate member", "too large", "deep nesting"],
)
def test_undecodable_files(data: bytes, message: str) -> None:
    assert errors_of(data) == {"$": message}


def test_utf8_bom_is_tolerated() -> None:
    assert parse_manifest(b"\xef\xbb\xbf" + APPENDIX_B).agent.id == "calendar_agent"


# ----------------------------------------------------------------------------- retention


@pytest.mark.parametrize(
    ("seconds", "method", "level"),
    [
        (0, "process_termination", "zero"),
        (0, "ephemeral_storage", "zero"),
        (1, "process_termination", "short"),
        (300, "process_termination", "short"),
        (600, "process_termination", "short"),
        (601, "secure_wipe", "session"),
        (3600, "secure_wipe", "session"),
        (86_400, "secure_wipe", "session"),
        (86_401, "secure_wipe", "no_guarantee"),
        (10**12, "process_termination", "no_guarantee"),
    ],
)
def test_retention_levels(seconds: float, method: str, level: str) -> None:
    assert retention_level(RetentionPolicy(seconds, method)) == level


def test_missing_policy_is_no_guarantee() -> None:
    assert retention_level(None) == "no_guarantee"


# ----------------------------------------------------------------------------- did:key


KEY = ed25519.Ed25519PrivateKey.generate()


def test_base58btc_round_trip_and_leading_zeros() -> None:
    for data in (b"", b"\x00", b"\x00\x00\x01", b"hello world", bytes(range(256))):
        assert b58btc_decode(b58btc_encode(data)) == data
    assert b58btc_encode(b"hello world") == "StV1DL6CwTryKyV"  # well-known base58 vector
    with pytest.raises(ValueError):
        b58btc_decode("0OIl")


def test_did_key_known_vector() -> None:
    # Ed25519 did:keys always start with z6Mk (multicodec 0xed01 under base58btc).
    did = did_key_from_public(KEY.public_key())
    assert did.startswith("did:key:z6Mk")
    raw = KEY.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    back = public_key_from_did_key(did).public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert back == raw


def test_did_key_from_rfc8032_test_key() -> None:
    # RFC 8032 §7.1 TEST 1 secret key; its public key d75a98… as a did:key.
    sk = ed25519.Ed25519PrivateKey.from_private_bytes(
        bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
    )
    pub = sk.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert pub.hex() == "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
    did = did_key_from_public(sk.public_key())
    assert b58btc_decode(did[len("did:key:z") :]) == b"\xed\x01" + pub


def test_published_did_key_example_decodes() -> None:
    # The example Ed25519 did:key of the W3C did:key method specification.
    pub = public_key_from_did_key("did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK")
    assert did_key_from_public(pub) == "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"


@pytest.mark.parametrize(
    "did",
    [
        "did:key:zQ3shokFTS3brHcDQrn82RUDfCZESWL1ZdCEJwekUDPQiYBme",  # secp256k1 did:key
        "did:key:z",
        "did:key:mABC",  # not base58btc multibase
        "did:key:z0OIl",
    ],
)
def test_non_ed25519_did_keys_are_refused(did: str) -> None:
    with pytest.raises(ValueError):
        public_key_from_did_key(did)


def test_sign_and_verify_round_trip() -> None:
    signed = sign_manifest(base(), KEY, created="2026-07-12T10:00:00Z")
    did = did_key_from_public(KEY.public_key())
    assert signed["identity"]["did"] == did
    assert signed["identity"]["proof"]["type"] == "DataIntegrityProof"
    assert signed["identity"]["proof"]["cryptosuite"] == "eddsa-jcs-2022"
    # The manifest still parses, and the signed manifest verifies.
    assert parse_manifest(json.dumps(signed).encode()).identity is not None
    result = verify_identity(signed)
    assert result.verified and result.method == "did:key" and result.did == did
    assert result.public_key is not None
    assert jose.key_thumbprint(result.public_key) == jose.key_thumbprint(KEY.public_key())
    # Also after a trip through bytes with different white space and member order.
    text = json.dumps(signed, indent=4, sort_keys=True, ensure_ascii=True).encode()
    assert verify_identity(json.loads(text)).verified


def test_signing_input_is_whole_manifest_without_proof_value() -> None:
    signed = sign_manifest(base(), KEY, suite="legacy")
    expected = copy.deepcopy(signed)
    del expected["identity"]["proof"]["proofValue"]
    assert manifest_signing_input(signed) == canonical_json(expected)
    sig = jose.b64u_decode(signed["identity"]["proof"]["proofValue"])
    KEY.public_key().verify(sig, canonical_json(expected))


def test_multibase_proof_value_is_accepted() -> None:
    signed = sign_manifest(base(), KEY, suite="legacy")
    sig = jose.b64u_decode(signed["identity"]["proof"]["proofValue"])
    signed["identity"]["proof"]["proofValue"] = "z" + b58btc_encode(sig)
    assert verify_identity(signed).verified


def test_sign_manifest_refuses_a_foreign_did() -> None:
    with pytest.raises(UompError) as e:
        sign_manifest(base(), KEY, "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK")
    assert e.value.code == "KEY_ERROR"


def _tamper(path: str, value: Any) -> dict[str, Any]:
    signed = sign_manifest(base(), KEY)
    _set(signed, path, value)
    return signed


TAMPERED = [
    ("agent name", "agent.name", "Calendar Assistant Pro"),
    ("wider read scope", "requested_scopes.read.tags", ["preference", "financial"]),
    ("retention", "data_retention_policy.max_retention_seconds", 0),
    ("added member", "requires_remote", True),
    ("removed member", "optional_capabilities", _DELETE),
    ("proof created", "identity.proof.created", "2030-01-01T00:00:00Z"),
]


@pytest.mark.parametrize(("name", "path", "value"), TAMPERED, ids=[t[0] for t in TAMPERED])
def test_tampered_manifest_is_unverified(name: str, path: str, value: Any) -> None:
    result = verify_identity(_tamper(path, value))
    assert not result.verified and result.public_key is None
    assert result.method == "did:key"
    assert result.reason.startswith("signature does not verify")


def test_signed_by_another_key_is_unverified() -> None:
    other = ed25519.Ed25519PrivateKey.generate()
    signed = sign_manifest(base(), other)
    signed["identity"]["did"] = did_key_from_public(KEY.public_key())
    del signed["identity"]["proof"]["verificationMethod"]
    result = verify_identity(signed)
    assert not result.verified and result.reason.startswith("signature does not verify")


UNVERIFIED = [
    (
        "did:ethr",
        {"did": "did:ethr:0xabc123", "proof": {"type": "Ed25519Signature2020", "proofValue": "x"}},
        "did:ethr",
        UNSUPPORTED_REASON,
    ),
    ("did:web", {"did": "did:web:example.com"}, "did:web", UNSUPPORTED_REASON),
    ("gpg", {"verification_methods": ["gpg"]}, "gpg", UNSUPPORTED_REASON),
    ("x509", {"verificationMethods": ["x509"]}, "x509", UNSUPPORTED_REASON),
    ("no method", {}, "none", "identity names no method: reported as unverified publisher"),
    ("malformed did", {"did": 5}, "none", "identity.did is malformed: reported as unverified publisher"),
    ("no proof", {"did": "DIDKEY"}, "did:key", "identity.proof is missing: reported as unverified publisher"),
    (
        "wrong proof type",
        {"did": "DIDKEY", "proof": {"type": "RsaSignature2018", "proofValue": "x"}},
        "did:key",
        "identity.proof is neither a DataIntegrityProof (eddsa-jcs-2022) nor a legacy Ed25519Signature2020 proof: "
        "reported as unverified publisher",
    ),
    (
        "no proofValue",
        {"did": "DIDKEY", "proof": {"type": "Ed25519Signature2020"}},
        "did:key",
        "identity.proof.proofValue is missing: reported as unverified publisher",
    ),
    (
        "proofValue not a signature",
        {"did": "DIDKEY", "proof": {"type": "Ed25519Signature2020", "proofValue": "..."}},
        "did:key",
        "identity.proof.proofValue is not a 64-byte signature (base64url or multibase base58btc): "
        "reported as unverified publisher",
    ),
    (
        "secp256k1 did:key",
        {"did": "did:key:zQ3shokFTS3brHcDQrn82RUDfCZESWL1ZdCEJwekUDPQiYBme"},
        "did:key",
        "did:key is malformed or not an Ed25519 key: reported as unverified publisher",
    ),
]


@pytest.mark.parametrize(("name", "identity", "method", "reason"), UNVERIFIED, ids=[u[0] for u in UNVERIFIED])
def test_unverifiable_identities(name: str, identity: dict[str, Any], method: str, reason: str) -> None:
    doc = base()
    did = did_key_from_public(KEY.public_key())
    doc["identity"] = json.loads(json.dumps(identity).replace("DIDKEY", did))
    result = verify_identity(doc)
    assert (result.verified, result.method, result.reason) == (False, method, reason)
    assert result.public_key is None


def test_appendix_b_identity_is_unverified_did_ethr() -> None:
    result = verify_identity(json.loads(APPENDIX_B))
    assert not result.verified
    assert result.method == "did:ethr" and result.did == "did:ethr:0xabc123..."
    assert result.reason == "method not supported by this verifier: reported as unverified publisher"


def test_no_identity_is_unverified() -> None:
    result = verify_identity(base())
    assert not result.verified and result.method == "none"
    assert result.reason == "manifest declares no identity: reported as unverified publisher"


def test_uncanonicalisable_manifest_is_unverified() -> None:
    signed = sign_manifest(base(), KEY)
    signed["huge"] = 2**60
    result = verify_identity(signed)
    assert not result.verified
    assert result.reason == "the document cannot be canonicalised (JCS): reported as unverified publisher"
