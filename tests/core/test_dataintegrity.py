"""eddsa-jcs-2022 (W3C Data Integrity EdDSA): the specification's test vectors, and manifests
signed with it, verified by the publisher check and by a standard verifier's view of the bytes."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import dataintegrity as di
from gateway.core.canonical import canonical_json
from gateway.core.didkey import b58btc_decode, b58btc_encode, public_key_from_did_key
from gateway.core.publisher import LEGACY_PROOF_UNTIL, sign_manifest, verify_identity

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "eddsa-jcs-2022"
ROOT = Path(__file__).resolve().parents[2]
MANIFEST: dict[str, Any] = json.loads((ROOT / "examples" / "calendar_agent" / "uom.json").read_text())


def vector_keys() -> tuple[ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey]:
    kp = json.loads((VECTORS / "keyPair.json").read_text())
    secret = b58btc_decode(kp["privateKeyMultibase"][1:])
    assert secret[:2] == b"\x80\x26"  # multicodec ed25519-priv
    return (
        ed25519.Ed25519PrivateKey.from_private_bytes(secret[2:]),
        public_key_from_did_key("did:key:" + kp["publicKeyMultibase"]),
    )


def signed_vector() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((VECTORS / "signedJCS.json").read_text())
    return doc


def test_the_specifications_signed_credential_verifies() -> None:
    _, pub = vector_keys()
    doc = signed_vector()
    unsecured = {k: v for k, v in doc.items() if k != "proof"}
    assert canonical_json(unsecured) == (VECTORS / "canonDocJCS.txt").read_bytes()
    di.verify_document(doc, pub)


def test_signing_the_vector_reproduces_its_proof_value() -> None:
    key, _ = vector_keys()
    doc = signed_vector()
    unsecured = {k: v for k, v in doc.items() if k != "proof"}
    options = {k: doc["proof"][k] for k in ("created", "verificationMethod", "proofPurpose")}
    assert di.sign_document(unsecured, options, key)["proof"] == doc["proof"]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda d: d["credentialSubject"].update(alumniOf="Another School"), id="document-changed"),
        pytest.param(lambda d: d["proof"].update(created="2023-02-24T23:36:39Z"), id="proof-options-changed"),
        pytest.param(lambda d: d["proof"].update(cryptosuite="eddsa-rdfc-2022"), id="other-cryptosuite"),
        pytest.param(lambda d: d["proof"].update({"@context": ["https://example.com/other"]}), id="other-context"),
        pytest.param(lambda d: d["proof"].update(proofValue="u" + d["proof"]["proofValue"][1:]), id="not-base58btc"),
        pytest.param(lambda d: d["proof"].update(proofValue="z" + b58btc_encode(b"\x00" * 63)), id="short-signature"),
        pytest.param(lambda d: d.pop("proof"), id="no-proof"),
    ],
)
def test_the_vector_altered_does_not_verify(change: Any) -> None:
    _, pub = vector_keys()
    doc = signed_vector()
    change(doc)
    with pytest.raises(di.ProofError):
        di.verify_document(doc, pub)


def test_the_vector_under_another_key_does_not_verify() -> None:
    with pytest.raises(di.ProofError, match="signature does not verify"):
        di.verify_document(signed_vector(), ed25519.Ed25519PrivateKey.generate().public_key())


# ------------------------------------------------------------------------------ manifests


def test_a_signed_manifest_is_a_standard_proof_over_the_manifest_without_its_proof() -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    signed = sign_manifest(MANIFEST, key, created="2026-12-01T00:00:00Z")
    proof = signed["identity"]["proof"]
    assert proof["type"] == "DataIntegrityProof" and proof["cryptosuite"] == "eddsa-jcs-2022"
    assert proof["proofValue"].startswith("z")
    # what a standard verifier is given: the manifest without identity.proof, the proof at the top
    standard = {**di.unsecured_manifest(signed), "proof": proof}
    di.verify_document(standard, key.public_key())
    result = verify_identity(signed)
    assert result.verified and result.public_key is not None and "eddsa-jcs-2022" in result.reason
    # denied partners: another key's DID, altered content
    altered = copy.deepcopy(signed)
    altered["requested_scopes"]["read"]["tags"].append("financial")
    assert not verify_identity(altered).verified
    with pytest.raises(di.ProofError):
        di.verify_document({**di.unsecured_manifest(altered), "proof": proof}, key.public_key())


def test_legacy_proofs_verify_during_the_transition_only() -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    legacy = sign_manifest(MANIFEST, key, suite="legacy")
    assert legacy["identity"]["proof"]["type"] == "Ed25519Signature2020"
    before = verify_identity(legacy, now=datetime(2027, 6, 30, tzinfo=UTC))
    assert before.verified and "legacy UOMP proof, accepted until 2027-07-01" in before.reason
    after = verify_identity(legacy, now=LEGACY_PROOF_UNTIL)
    assert not after.verified and "no longer accepted" in after.reason
    # a standard proof is not subject to the transition
    standard = sign_manifest(MANIFEST, key)
    assert verify_identity(standard, now=LEGACY_PROOF_UNTIL).verified
