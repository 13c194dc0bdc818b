"""W3C Data Integrity EdDSA, the ``eddsa-jcs-2022`` cryptosuite (W3C vc-di-eddsa), pure.

For a document and a proof (``type: "DataIntegrityProof"``, ``cryptosuite: "eddsa-jcs-2022"``):

1. the proof configuration is the proof without ``proofValue``; when the document has an
   ``@context``, the configuration's ``@context`` must be the same (and is set so when signing);
2. both are canonicalised with JCS (RFC 8785, :func:`gateway.core.canonical.canonical_json`, on
   the maintained ``rfc8785`` package);
3. the signed bytes are ``SHA-256(canonical proof configuration) || SHA-256(canonical document)``
   (64 bytes), signed with Ed25519 (RFC 8032);
4. ``proofValue`` is multibase base58btc (``z``) of the 64-byte signature.

:func:`verify_document` / :func:`sign_document` work on a secured document whose proof is its
top-level ``proof`` member (the W3C test vectors). A UOMP manifest keeps its proof at
``identity.proof`` (spec §6.2): :func:`unsecured_manifest` is the manifest with that member removed,
so the same bytes are signed as a standard verifier checks on ``{...manifest without
identity.proof, "proof": identity.proof}``.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core.canonical import canonical_json
from gateway.core.didkey import b58btc_decode, b58btc_encode
from gateway.errors import UompError

PROOF_TYPE = "DataIntegrityProof"
CRYPTOSUITE = "eddsa-jcs-2022"
MAX_PROOF_VALUE = 256


class ProofError(ValueError):
    """Why a Data Integrity proof does not verify (a sentence for the authorization panel)."""


def is_eddsa_jcs(proof: Any) -> bool:
    """Whether ``proof`` claims to be a Data Integrity ``eddsa-jcs-2022`` proof."""
    return isinstance(proof, Mapping) and proof.get("type") == PROOF_TYPE and proof.get("cryptosuite") == CRYPTOSUITE


def hash_data(unsecured: Mapping[str, Any], proof_config: Mapping[str, Any]) -> bytes:
    """SHA-256(JCS(proof configuration)) || SHA-256(JCS(unsecured document)); UompError if not canonicalisable."""
    return (
        hashlib.sha256(canonical_json(dict(proof_config))).digest()
        + hashlib.sha256(canonical_json(dict(unsecured))).digest()
    )


def _config(unsecured: Mapping[str, Any], proof: Mapping[str, Any]) -> dict[str, Any]:
    if not is_eddsa_jcs(proof):
        raise ProofError(f"the proof is not a {PROOF_TYPE} with cryptosuite {CRYPTOSUITE}")
    config = {k: v for k, v in proof.items() if k != "proofValue"}
    if "@context" in unsecured and config.get("@context", unsecured["@context"]) != unsecured["@context"]:
        raise ProofError("the proof's @context is not the document's")
    return config


def verify_proof(unsecured: Mapping[str, Any], proof: Mapping[str, Any], pub: ed25519.Ed25519PublicKey) -> None:
    """Raise ProofError unless ``proof`` is ``pub``'s eddsa-jcs-2022 proof over ``unsecured``."""
    config = _config(unsecured, proof)
    value = proof.get("proofValue")
    if not isinstance(value, str) or not value.startswith("z") or len(value) > MAX_PROOF_VALUE:
        raise ProofError("proofValue is not multibase base58btc (z…)")
    try:
        sig = b58btc_decode(value[1:])
    except ValueError as exc:
        raise ProofError("proofValue does not decode as base58btc") from exc
    if len(sig) != 64:
        raise ProofError("proofValue is not a 64-byte Ed25519 signature")
    try:
        data = hash_data(unsecured, config)
    except UompError as exc:
        raise ProofError("the document cannot be canonicalised (JCS)") from exc
    try:
        pub.verify(sig, data)
    except InvalidSignature as exc:
        raise ProofError("signature does not verify: the document was altered or signed by another key") from exc


def sign_proof(
    unsecured: Mapping[str, Any], options: Mapping[str, Any], key: ed25519.Ed25519PrivateKey
) -> dict[str, Any]:
    """The proof (``options`` plus type, cryptosuite, @context when the document has one, proofValue)."""
    config = {**options, "type": PROOF_TYPE, "cryptosuite": CRYPTOSUITE}
    if "@context" in unsecured:
        config["@context"] = copy.deepcopy(unsecured["@context"])
    sig = key.sign(hash_data(unsecured, config))
    return {**config, "proofValue": "z" + b58btc_encode(sig)}


def verify_document(secured: Mapping[str, Any], pub: ed25519.Ed25519PublicKey) -> None:
    """A document whose top-level ``proof`` is an eddsa-jcs-2022 proof by ``pub``; ProofError otherwise."""
    proof = secured.get("proof")
    if not isinstance(proof, Mapping):
        raise ProofError("the document has no proof")
    verify_proof({k: v for k, v in secured.items() if k != "proof"}, proof, pub)


def sign_document(
    unsecured: Mapping[str, Any], options: Mapping[str, Any], key: ed25519.Ed25519PrivateKey
) -> dict[str, Any]:
    """``unsecured`` with an ``eddsa-jcs-2022`` proof made under ``options`` with ``key``."""
    return {**copy.deepcopy(dict(unsecured)), "proof": sign_proof(unsecured, options, key)}


def unsecured_manifest(manifest_raw: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest without ``identity.proof``: what an eddsa-jcs-2022 manifest proof covers."""
    doc = copy.deepcopy(dict(manifest_raw))
    identity = doc.get("identity")
    if isinstance(identity, dict):
        identity.pop("proof", None)
    return doc
