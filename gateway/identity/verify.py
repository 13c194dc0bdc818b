"""The publisher of a manifest, checked by the method it names (spec §16.3), against the user's trust list.

:func:`verify_publisher` answers a :class:`PublisherResult` (an ``IdentityResult`` plus the trust
entry that vouches for it). The states ``uomp authorize`` shows:

* verified and vouched for (``trust_entry`` set): a did:key or did:web in the trust list whose key
  signed the manifest; an X.509 chain to a CA in the trust list; an OpenPGP signature by a key in
  the trust list;
* verified, never trusted (``verified``, no ``trust_entry``): a did:key or did:web whose key
  signed it, the DID not in the list (X.509 and OpenPGP cannot be in this state: without a trusted
  CA or key there is nothing to verify against);
* unverified, with the reason.

``verified`` is set only on the line after the check that justifies it passed.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core.publisher import IdentityResult, proof_verifies, verify_identity
from gateway.errors import UompError
from gateway.identity import didweb, openpgp, x509pub
from gateway.registry.fetch import FetchPolicy
from gateway.trust import TrustEntry, TrustList

SUFFIX = ": reported as unverified publisher"


@dataclass(frozen=True)
class PublisherResult(IdentityResult):
    """A publisher check's result, with the trust entry and subject it rests on."""

    trust_entry: TrustEntry | None = None
    subject: str | None = None  # X.509: the leaf's subject; OpenPGP: the key's user id


def _unverified(method: str, did: str | None, reason: str) -> PublisherResult:
    return PublisherResult(verified=False, method=method, did=did, public_key=None, reason=reason + SUFFIX)


def _methods(identity: dict[str, Any]) -> list[str]:
    m = identity.get("verification_methods", identity.get("verificationMethods"))
    return [x for x in m if isinstance(x, str)] if isinstance(m, list) else []


def method_of(manifest_raw: Any) -> str:
    """The check ``verify_publisher`` applies: "x509", "openpgp", "did:web" (the only one that fetches), else "did"."""
    identity = manifest_raw.get("identity") if isinstance(manifest_raw, dict) else None
    if not isinstance(identity, dict):
        return "did"
    proof = identity.get("proof")
    proof_type = proof.get("type") if isinstance(proof, dict) else None
    if proof_type == x509pub.PROOF_TYPE:
        return "x509"
    if proof_type == openpgp.PROOF_TYPE:
        return "openpgp"
    did = identity.get("did")
    return "did:web" if isinstance(did, str) and did.startswith("did:web:") else "did"


def verify_publisher(
    manifest_raw: Any, trusted: TrustList, policy: FetchPolicy, *, now: dt.datetime | None = None
) -> PublisherResult:
    """Never raises for a bad identity: the answer says why it is unverified."""
    method = method_of(manifest_raw)
    if method == "x509":
        return _x509(manifest_raw, trusted, now)
    if method == "openpgp":
        return _openpgp(manifest_raw, trusted)
    if method == "did:web":
        return _did_web(manifest_raw, manifest_raw["identity"]["did"], trusted, policy)
    base = verify_identity(manifest_raw)
    entry = trusted.find_did(base.did) if base.verified else None
    return PublisherResult(
        verified=base.verified,
        method=base.method,
        did=base.did,
        public_key=base.public_key,
        reason=base.reason,
        trust_entry=entry,
    )


def _did_web(manifest_raw: dict[str, Any], did: str, trusted: TrustList, policy: FetchPolicy) -> PublisherResult:
    proof = manifest_raw["identity"].get("proof")
    if not isinstance(proof, dict):
        return _unverified("did:web", did, "identity.proof is missing")
    method_id = proof.get("verificationMethod")
    if not isinstance(method_id, str):
        return _unverified("did:web", did, "identity.proof.verificationMethod is missing (did#key-id)")
    try:
        doc = didweb.resolve(did, policy)
        pub = didweb.assertion_key(doc, did, method_id)
    except didweb.DidWebError as exc:
        return _unverified("did:web", did, str(exc))
    except UompError as exc:
        return _unverified("did:web", did, f"the DID document could not be fetched ({exc.message})")
    if not proof_verifies(manifest_raw, pub):
        return _unverified(
            "did:web", did, "signature does not verify: the manifest was altered or signed by another key"
        )
    return PublisherResult(
        verified=True,
        method="did:web",
        did=did,
        public_key=pub,
        reason="manifest signature verified with the key the DID document of this did:web publishes "
        "(whoever controls that web site controls this identity)",
        trust_entry=trusted.find_did(did),
    )


def _x509(manifest_raw: dict[str, Any], trusted: TrustList, now: dt.datetime | None) -> PublisherResult:
    entries = trusted.of_kind("x509-ca")
    roots: list[tuple[TrustEntry, x509.Certificate]] = []
    for e in entries:
        try:
            roots.append((e, x509.load_pem_x509_certificate((e.data or "").encode())))
        except ValueError:
            continue
    try:
        leaf = x509pub.verify(manifest_raw, [c for _, c in roots], now=now)
    except x509pub.X509Error as exc:
        return _unverified("x509", None, str(exc))
    entry = _issuing_root(leaf, manifest_raw, roots)
    leaf_key = leaf.public_key()
    return PublisherResult(
        verified=True,
        method="x509",
        did=None,
        # an Ed25519 leaf key is the identity key deletion proofs are checked against (§19.4)
        public_key=leaf_key if isinstance(leaf_key, ed25519.Ed25519PublicKey) else None,
        reason=f"manifest signed by the code-signing certificate {x509pub.subject_text(leaf)}, "
        f"which chains to the CA you trust as {entry.name!r}",
        trust_entry=entry,
        subject=x509pub.subject_text(leaf),
    )


def _issuing_root(
    leaf: x509.Certificate, manifest_raw: dict[str, Any], roots: list[tuple[TrustEntry, x509.Certificate]]
) -> TrustEntry:
    """The trust entry of the root the chain ends at (the last certificate's issuer)."""
    chain = x509pub.chain_from_proof(manifest_raw["identity"]["proof"])
    top = chain[-1]
    for e, c in roots:
        if c.subject == top.issuer or c == top:
            return e
    return roots[0][0]


def _openpgp(manifest_raw: dict[str, Any], trusted: TrustList) -> PublisherResult:
    try:
        entry = openpgp.verify(manifest_raw, trusted)
    except openpgp.OpenPgpError as exc:
        return _unverified("gpg", None, str(exc))
    return PublisherResult(
        verified=True,
        method="gpg",
        did=None,
        public_key=None,
        reason=f"manifest signed by the OpenPGP key {entry.id}, which you trust as {entry.name!r}",
        trust_entry=entry,
    )
