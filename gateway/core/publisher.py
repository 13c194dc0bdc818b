"""The publisher identity of an agent manifest (spec §16), pure: verify or make a did:key proof.

Two proof forms verify. The standard one: a W3C Data Integrity proof, ``type: "DataIntegrityProof"``,
``cryptosuite: "eddsa-jcs-2022"`` (:mod:`gateway.core.dataintegrity`) over the manifest without
``identity.proof``; :func:`sign_manifest` makes it. The legacy UOMP construction (type
``Ed25519Signature2020``, a plain Ed25519 signature over the canonical manifest without
``proofValue``; see :mod:`gateway.core.manifest`) still verifies until ``LEGACY_PROOF_UNTIL``, its
reason saying so; after that date it is reported unverified with the way to re-sign.

The rules (what is signed, which encodings of ``proofValue`` are accepted, why every other method
is "unverified") are documented in :mod:`gateway.core.manifest`, which re-exports this module's
public names; the did:key and base58btc encodings are :mod:`gateway.core.didkey`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import dataintegrity, jose
from gateway.core.canonical import canonical_json
from gateway.core.didkey import b58btc_decode, did_key_from_public, public_key_from_did_key
from gateway.errors import ErrorCode, UompError

MAX_DID = 2048
MAX_PROOF_VALUE = 4096
VERIFICATION_METHODS = ("did", "gpg", "x509", "registry")
PROOF_TYPE = "Ed25519Signature2020"  # the legacy UOMP construction (not the W3C suite of that name)
LEGACY_PROOF_UNTIL = datetime(2027, 7, 1, tzinfo=UTC)  # legacy proofs verify before this instant
LEGACY_NOTE = (
    "legacy UOMP proof, accepted until 2027-07-01: the publisher should re-sign with DataIntegrityProof eddsa-jcs-2022"
)
UNSUPPORTED_REASON = "method not supported by this verifier: reported as unverified publisher"
DID_PATTERN = re.compile(r"did:[a-z0-9]+:[A-Za-z0-9._:%-]+")


@dataclass(frozen=True)
class IdentityResult:
    """What a publisher identity check found: verified or not, by which method, and why."""

    verified: bool
    method: str  # "did:key", "did:ethr", "did:web", "gpg", "x509", "registry" or "none"
    did: str | None
    public_key: ed25519.Ed25519PublicKey | None  # set only when verified
    reason: str


def _proof_value_member(proof: Mapping[str, Any]) -> str | None:
    names = [n for n in ("proofValue", "proof_value") if n in proof]
    if len(names) != 1:
        return None
    return names[0]


def manifest_signing_input(manifest_raw: Mapping[str, Any]) -> bytes:
    """The bytes a publisher signs: canonical_json of the manifest without identity.proof.proofValue.

    Raises ``INVALID_REQUEST`` when the manifest has no identity.proof object or cannot be
    canonicalised.
    """
    identity = manifest_raw.get("identity")
    proof = identity.get("proof") if isinstance(identity, dict) else None
    if not isinstance(identity, dict) or not isinstance(proof, dict):
        raise UompError(ErrorCode.INVALID_REQUEST, "manifest has no identity.proof object")
    stripped_proof = {k: v for k, v in proof.items() if k not in ("proofValue", "proof_value")}
    doc = dict(manifest_raw)
    doc["identity"] = {**identity, "proof": stripped_proof}
    return canonical_json(doc)


def _signature_candidates(value: str) -> list[bytes]:
    """64-byte decodings of ``value``: multibase 'z' base58btc and/or unpadded base64url."""
    out: list[bytes] = []
    if value.startswith("z"):
        try:
            sig = b58btc_decode(value[1:])
            if len(sig) == 64:
                out.append(sig)
        except ValueError:
            pass
    try:
        sig = jose.b64u_decode(value)
        if len(sig) == 64:
            out.append(sig)
    except ValueError:
        pass
    return out


def proof_verifies(manifest_raw: Mapping[str, Any], pub: ed25519.Ed25519PublicKey) -> bool:
    """Whether ``identity.proof.proofValue`` is ``pub``'s Ed25519 signature over :func:`manifest_signing_input`
    (the construction of the module docstring, whatever DID method named the key)."""
    identity = manifest_raw.get("identity")
    proof = identity.get("proof") if isinstance(identity, dict) else None
    if not isinstance(proof, dict):
        return False
    if dataintegrity.is_eddsa_jcs(proof):
        try:
            dataintegrity.verify_proof(dataintegrity.unsecured_manifest(manifest_raw), proof, pub)
        except dataintegrity.ProofError:
            return False
        return True
    if proof.get("type") != PROOF_TYPE or datetime.now(UTC) >= LEGACY_PROOF_UNTIL:
        return False
    member = _proof_value_member(proof)
    value = proof.get(member) if member else None
    if not isinstance(value, str) or len(value) > MAX_PROOF_VALUE:
        return False
    try:
        signed = manifest_signing_input(manifest_raw)
    except UompError:
        return False
    for sig in _signature_candidates(value):
        try:
            pub.verify(sig, signed)
        except InvalidSignature:
            continue
        return True
    return False


def _unverified(method: str, did: str | None, reason: str) -> IdentityResult:
    return IdentityResult(verified=False, method=method, did=did, public_key=None, reason=reason)


def verify_identity(manifest_raw: Mapping[str, Any], *, now: datetime | None = None) -> IdentityResult:
    """Verify the publisher identity of a decoded manifest (see the module docstring).

    Never raises for a bad or unsupported identity: the answer is ``verified=False`` with a
    reason the CLI shows next to "unverified publisher".
    """
    if not isinstance(manifest_raw, Mapping):
        return _unverified("none", None, "manifest is not an object: reported as unverified publisher")
    identity = manifest_raw.get("identity")
    if identity is None:
        return _unverified("none", None, "manifest declares no identity: reported as unverified publisher")
    if not isinstance(identity, dict):
        return _unverified("none", None, "identity is malformed: reported as unverified publisher")
    did = identity.get("did")
    if did is not None and (not isinstance(did, str) or not DID_PATTERN.fullmatch(did) or len(did) > MAX_DID):
        return _unverified("none", None, "identity.did is malformed: reported as unverified publisher")
    if not did:
        methods = identity.get("verification_methods", identity.get("verificationMethods"))
        method = "none"
        if isinstance(methods, list) and methods and isinstance(methods[0], str):
            method = methods[0] if methods[0] in VERIFICATION_METHODS else "none"
        if method == "none":
            return _unverified("none", None, "identity names no method: reported as unverified publisher")
        return _unverified(method, None, UNSUPPORTED_REASON)
    did_method = ":".join(did.split(":")[:2])
    if did_method != "did:key":
        return _unverified(did_method, did, UNSUPPORTED_REASON)

    try:
        pub = public_key_from_did_key(did)
    except ValueError:
        return _unverified(
            "did:key", did, "did:key is malformed or not an Ed25519 key: reported as unverified publisher"
        )
    proof = identity.get("proof")
    if not isinstance(proof, dict):
        return _unverified("did:key", did, "identity.proof is missing: reported as unverified publisher")
    vm = proof.get("verificationMethod")
    if vm is not None and (not isinstance(vm, str) or (vm != did and not vm.startswith(did + "#"))):
        return _unverified(
            "did:key",
            did,
            "identity.proof.verificationMethod names another key: reported as unverified publisher",
        )
    if dataintegrity.is_eddsa_jcs(proof):
        try:
            dataintegrity.verify_proof(dataintegrity.unsecured_manifest(manifest_raw), proof, pub)
        except dataintegrity.ProofError as exc:
            return _unverified("did:key", did, f"{exc}: reported as unverified publisher")
        return IdentityResult(
            verified=True,
            method="did:key",
            did=did,
            public_key=pub,
            reason="manifest proof (DataIntegrityProof eddsa-jcs-2022) verified for this did:key (the key is "
            "self-certifying: compare the DID with the one the publisher advertises)",
        )
    if proof.get("type") != PROOF_TYPE:
        return _unverified(
            "did:key",
            did,
            f"identity.proof is neither a {dataintegrity.PROOF_TYPE} ({dataintegrity.CRYPTOSUITE}) nor a "
            f"legacy {PROOF_TYPE} proof: reported as unverified publisher",
        )
    if (now or datetime.now(UTC)) >= LEGACY_PROOF_UNTIL:
        return _unverified(
            "did:key",
            did,
            "legacy UOMP proofs are no longer accepted (since 2027-07-01); the publisher must re-sign with "
            "DataIntegrityProof eddsa-jcs-2022: reported as unverified publisher",
        )
    member = _proof_value_member(proof)
    value = proof.get(member) if member else None
    if not isinstance(value, str) or len(value) > MAX_PROOF_VALUE:
        return _unverified("did:key", did, "identity.proof.proofValue is missing: reported as unverified publisher")
    candidates = _signature_candidates(value)
    if not candidates:
        return _unverified(
            "did:key",
            did,
            "identity.proof.proofValue is not a 64-byte signature (base64url or multibase base58btc): "
            "reported as unverified publisher",
        )
    try:
        signed = manifest_signing_input(manifest_raw)
    except UompError:
        return _unverified("did:key", did, "manifest cannot be canonicalised: reported as unverified publisher")
    for sig in candidates:
        try:
            pub.verify(sig, signed)
        except InvalidSignature:
            continue
        return IdentityResult(
            verified=True,
            method="did:key",
            did=did,
            public_key=pub,
            reason="manifest signature verified for this did:key (the key is self-certifying: "
            f"compare the DID with the one the publisher advertises); {LEGACY_NOTE}",
        )
    return _unverified(
        "did:key",
        did,
        "signature does not verify: the manifest was altered or signed by another key; "
        "reported as unverified publisher",
    )


def sign_manifest(
    manifest: Mapping[str, Any],
    private_key: ed25519.Ed25519PrivateKey,
    did: str | None = None,
    *,
    created: str | None = None,
    suite: str = dataintegrity.CRYPTOSUITE,
) -> dict[str, Any]:
    """A copy of ``manifest`` with ``identity`` set to a did:key and a fresh proof (tests, examples).

    ``suite``: ``"eddsa-jcs-2022"`` (default, a W3C DataIntegrityProof) or ``"legacy"`` (the old
    UOMP construction, for transition tests).

    ``did`` defaults to the key's own did:key; a ``did`` that is not the key's did:key is
    refused (KEY_ERROR), since nothing could verify it. ``identity.verification_methods``
    defaults to ``["did"]``; ``created`` defaults to now (UTC). ``proofValue`` is base64url.
    """
    own = did_key_from_public(private_key.public_key())
    if did is not None and did != own:
        raise UompError(ErrorCode.KEY_ERROR, "did does not match the signing key (only did:key can be signed here)")
    doc = copy.deepcopy(dict(manifest))
    existing = doc.get("identity")
    identity: dict[str, Any] = dict(existing) if isinstance(existing, dict) else {}
    identity["did"] = own
    if "verification_methods" not in identity and "verificationMethods" not in identity:
        identity["verification_methods"] = ["did"]
    fragment = own[len("did:key:") :]
    when = created or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if suite == dataintegrity.CRYPTOSUITE:
        identity.pop("proof", None)
        doc["identity"] = identity
        options = {"created": when, "verificationMethod": f"{own}#{fragment}", "proofPurpose": "assertionMethod"}
        identity["proof"] = dataintegrity.sign_proof(dataintegrity.unsecured_manifest(doc), options, private_key)
        return doc
    if suite != "legacy":
        raise UompError(ErrorCode.INVALID_REQUEST, f"unknown proof suite {suite!r}: eddsa-jcs-2022 or legacy")
    identity["proof"] = {
        "type": PROOF_TYPE,
        "created": when,
        "verificationMethod": f"{own}#{fragment}",
    }
    doc["identity"] = identity
    signature = private_key.sign(manifest_signing_input(doc))
    identity["proof"]["proofValue"] = jose.b64u_encode(signature)
    return doc
