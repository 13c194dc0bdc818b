"""X.509 publishers: a manifest signed with the key of a certificate that chains to a CA the user trusts.

The manifest carries ``identity.proof = {"type": "X509Signature2026", "x5c": [leaf, intermediate…],
"proofValue": …}``: ``x5c`` as in RFC 7517 (standard base64 DER, leaf first), ``proofValue`` the
base64url signature of the leaf key over the same bytes as every other proof here
(:func:`gateway.core.publisher.manifest_signing_input`: the manifest without ``proofValue``, so the
chain itself is signed too). Leaf keys: Ed25519, ECDSA P-256 (SHA-256) or RSA (PKCS#1 v1.5, SHA-256).

The chain is built and checked by ``cryptography``'s path validation against the user's trusted CAs
only (their certificates are in the trust list) at the current time: validity, basic constraints,
signatures. The leaf must have the ``digitalSignature`` key usage (when the extension is present)
and the ``codeSigning`` extended key usage; a server or client certificate is not a publisher's.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Sequence
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import Criticality, ExtensionPolicy, PolicyBuilder, Store, VerificationError

from gateway.core import jose
from gateway.core.publisher import manifest_signing_input
from gateway.errors import ErrorCode, UompError
from gateway.trust import TrustEntry

PROOF_TYPE = "X509Signature2026"
MAX_CHAIN = 5
MAX_CERT_B64 = 16 * 1024


class X509Error(ValueError):
    """Why an X.509 publisher does not verify (a sentence for the authorization panel)."""


def _leaf_usage(_policy: Any, cert: x509.Certificate, eku: x509.ExtendedKeyUsage | None) -> None:
    if eku is None or ExtendedKeyUsageOID.CODE_SIGNING not in eku:
        raise ValueError("the publisher certificate is not for code signing (no codeSigning extended key usage)")
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not ku.digital_signature:
        raise ValueError("the publisher certificate's key usage does not allow digital signatures")


def _ee_policy() -> ExtensionPolicy:
    return (
        ExtensionPolicy.permit_all()
        .require_present(x509.ExtendedKeyUsage, Criticality.AGNOSTIC, _leaf_usage)
        .may_be_present(x509.BasicConstraints, Criticality.AGNOSTIC, _not_a_ca)
    )


def _not_a_ca(_policy: Any, _cert: x509.Certificate, bc: x509.BasicConstraints | None) -> None:
    if bc is not None and bc.ca:
        raise ValueError("the publisher certificate is a CA certificate")


def chain_from_proof(proof: Any) -> list[x509.Certificate]:
    """The certificate chain an X.509 identity proof carries; X509Error for a malformed one."""
    if not isinstance(proof, dict) or proof.get("type") != PROOF_TYPE:
        raise X509Error(f"identity.proof.type is not {PROOF_TYPE}")
    x5c = proof.get("x5c")
    if not isinstance(x5c, list) or not 1 <= len(x5c) <= MAX_CHAIN:
        raise X509Error(f"identity.proof.x5c is not a list of 1-{MAX_CHAIN} certificates")
    certs = []
    for item in x5c:
        if not isinstance(item, str) or len(item) > MAX_CERT_B64:
            raise X509Error("identity.proof.x5c holds something that is not a base64 certificate")
        try:
            certs.append(x509.load_der_x509_certificate(base64.b64decode(item, validate=True)))
        except ValueError as exc:
            raise X509Error("identity.proof.x5c holds something that is not a DER certificate") from exc
    return certs


def verify(
    manifest_raw: dict[str, Any], roots: Sequence[x509.Certificate], *, now: dt.datetime | None = None
) -> x509.Certificate:
    """The leaf certificate that signed ``manifest_raw``, chained to one of ``roots``; X509Error otherwise."""
    identity = manifest_raw.get("identity")
    proof = identity.get("proof") if isinstance(identity, dict) else None
    chain = chain_from_proof(proof)
    assert isinstance(proof, dict)
    if not roots:
        raise X509Error("no CA is in your trust list (uomp trust add-ca FILE --name NAME)")
    builder = (
        PolicyBuilder()
        .store(Store(list(roots)))
        .time(now or dt.datetime.now(dt.UTC))
        .max_chain_depth(MAX_CHAIN)
        .extension_policies(ca_policy=ExtensionPolicy.webpki_defaults_ca(), ee_policy=_ee_policy())
    )
    try:
        builder.build_client_verifier().verify(chain[0], chain[1:])
    except VerificationError as exc:
        raise X509Error(f"the certificate chain does not verify against your trusted CAs: {str(exc)[:200]}") from exc
    leaf = chain[0]
    value = proof.get("proofValue")
    if not isinstance(value, str):
        raise X509Error("identity.proof.proofValue is missing")
    try:
        sig = jose.b64u_decode(value)
        signed = manifest_signing_input(manifest_raw)
    except (ValueError, UompError) as exc:
        raise X509Error("identity.proof.proofValue is not base64url, or the manifest cannot be canonicalised") from exc
    pub = leaf.public_key()
    try:
        if isinstance(pub, ed25519.Ed25519PublicKey):
            pub.verify(sig, signed)
        elif isinstance(pub, ec.EllipticCurvePublicKey) and isinstance(pub.curve, ec.SECP256R1):
            pub.verify(sig, signed, ec.ECDSA(hashes.SHA256()))
        elif isinstance(pub, rsa.RSAPublicKey):
            pub.verify(sig, signed, padding.PKCS1v15(), hashes.SHA256())
        else:
            raise X509Error("the publisher certificate's key type is not Ed25519, P-256 or RSA")
    except InvalidSignature as exc:
        raise X509Error("the signature does not verify: the manifest was altered or signed by another key") from exc
    return leaf


def subject_text(cert: x509.Certificate) -> str:
    """A certificate's subject in RFC 4514 form, bounded."""
    return cert.subject.rfc4514_string()[:200]


def fingerprint(cert: x509.Certificate) -> str:
    """A certificate's SHA-256 fingerprint, ``SHA256:<hex>``."""
    return "SHA256:" + cert.fingerprint(hashes.SHA256()).hex()


def ca_entry(pem: bytes, name: str) -> TrustEntry:
    """The trust-list entry for a CA certificate (PEM); INVALID_REQUEST when it is not a usable CA."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise UompError(ErrorCode.INVALID_REQUEST, "not a PEM certificate; give the CA's certificate file") from exc
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        bc = None
    if bc is None or not bc.ca:
        raise UompError(
            ErrorCode.INVALID_REQUEST, "this certificate is not a CA certificate (basicConstraints CA:TRUE)"
        )
    fp = fingerprint(cert)
    text = cert.public_bytes(serialization.Encoding.PEM).decode()
    return TrustEntry(kind="x509-ca", id=fp, name=name, fingerprint=fp, added_at="", how="trust add-ca", data=text)
