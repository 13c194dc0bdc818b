"""did:web (W3C CCG did:web method): the DID document over https, and the manifest's key in it.

``did:web:example.com`` is ``https://example.com/.well-known/did.json``; ``did:web:example.com:u:alice``
is ``https://example.com/u/alice/did.json``; a port is percent-encoded (``did:web:host%3A8443``).
The document is fetched under the fetch rules of :mod:`gateway.registry.fetch` (https, public
addresses unless allowed, bounded size, time and redirects).

The key: ``identity.proof.verificationMethod`` must be ``<did>#<fragment>``, listed (by reference or
embedded) in the document's ``assertionMethod``, and be an Ed25519 key: ``Ed25519VerificationKey2020``
or ``Multikey`` (``publicKeyMultibase``, multicodec ed25519-pub), or ``JsonWebKey2020`` /
``JsonWebKey`` (``publicKeyJwk`` OKP/Ed25519). The document's ``id`` must be the DID itself. Any other
key type, a key not meant for assertions, or a document for another DID is refused with its reason.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import jose
from gateway.core.didkey import b58btc_decode
from gateway.registry.fetch import FetchPolicy, fetch

_HOST = re.compile(r"[A-Za-z0-9.-]+(%3[Aa][0-9]{1,5})?")
_SEGMENT = re.compile(r"[A-Za-z0-9._~%-]+")
ED25519_MULTICODEC = b"\xed\x01"
MULTIBASE_TYPES = ("Ed25519VerificationKey2020", "Multikey")
JWK_TYPES = ("JsonWebKey2020", "JsonWebKey")


class DidWebError(ValueError):
    """Why a did:web identity does not verify (a sentence for the authorization panel)."""


def did_web_url(did: str) -> str:
    """The https URL of the DID document of ``did`` (did:web only)."""
    if not did.startswith("did:web:"):
        raise DidWebError("not a did:web DID")
    parts = did[len("did:web:") :].split(":")
    host = parts[0]
    if not _HOST.fullmatch(host) or not all(_SEGMENT.fullmatch(p) for p in parts[1:]):
        raise DidWebError("the did:web identifier is malformed")
    host = urllib.parse.unquote(host)
    path = "/".join(parts[1:]) + "/did.json" if len(parts) > 1 else ".well-known/did.json"
    return f"https://{host}/{path}"


def resolve(did: str, policy: FetchPolicy) -> dict[str, Any]:
    """The DID document of ``did`` (its ``id`` checked), or DidWebError / UompError(FETCH_FAILED)."""
    body = fetch(did_web_url(did), policy).body
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise DidWebError("the DID document is not JSON") from exc
    if not isinstance(doc, dict):
        raise DidWebError("the DID document is not a JSON object")
    if doc.get("id") != did:
        raise DidWebError("the DID document is for another DID")
    return doc


def _ed25519_from_multibase(value: Any) -> ed25519.Ed25519PublicKey:
    if not isinstance(value, str) or not value.startswith("z") or len(value) > 128:
        raise DidWebError("the key's publicKeyMultibase is not base58btc")
    try:
        raw = b58btc_decode(value[1:])
    except ValueError as exc:
        raise DidWebError("the key's publicKeyMultibase does not decode") from exc
    if raw[:2] != ED25519_MULTICODEC or len(raw) != 34:
        raise DidWebError("the DID document's key is of another type than Ed25519; refused")
    return ed25519.Ed25519PublicKey.from_public_bytes(raw[2:])


def _ed25519_from_jwk(jwk: Any) -> ed25519.Ed25519PublicKey:
    if not isinstance(jwk, dict) or jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519" or "d" in jwk:
        raise DidWebError("the DID document's key is of another type than Ed25519; refused")
    try:
        raw = jose.b64u_decode(str(jwk.get("x", "")))
    except ValueError as exc:
        raise DidWebError("the key's publicKeyJwk x does not decode") from exc
    if len(raw) != 32:
        raise DidWebError("the key's publicKeyJwk x is not 32 bytes")
    return ed25519.Ed25519PublicKey.from_public_bytes(raw)


def assertion_key(doc: dict[str, Any], did: str, method_id: str) -> ed25519.Ed25519PublicKey:
    """The Ed25519 key ``method_id`` (``did#fragment``) of the document, if it may assert (sign) for the DID."""
    if not method_id.startswith(did + "#"):
        raise DidWebError("identity.proof.verificationMethod is not a key of this DID")
    fragment = method_id[len(did) :]

    def same(ref: Any) -> bool:
        return isinstance(ref, str) and ref in (method_id, fragment)

    assertion = doc.get("assertionMethod")
    if not isinstance(assertion, list):
        raise DidWebError("the DID document lists no assertionMethod: none of its keys may sign manifests")
    embedded = [m for m in assertion if isinstance(m, dict) and same(m.get("id"))]
    if not embedded and not any(same(m) for m in assertion):
        raise DidWebError("the signing key is not in the DID document's assertionMethod")
    methods = doc.get("verificationMethod", [])
    candidates = embedded
    if not candidates and isinstance(methods, list):
        candidates = [m for m in methods if isinstance(m, dict) and same(m.get("id"))]
    if len(candidates) != 1:
        raise DidWebError("the DID document does not define the signing key exactly once")
    vm = candidates[0]
    if vm.get("controller", did) != did:
        raise DidWebError("the signing key is controlled by another DID")
    kind = vm.get("type")
    if kind in MULTIBASE_TYPES:
        return _ed25519_from_multibase(vm.get("publicKeyMultibase"))
    if kind in JWK_TYPES:
        return _ed25519_from_jwk(vm.get("publicKeyJwk"))
    raise DidWebError(f"the DID document's key is of type {str(kind)[:60]!r}, not an Ed25519 key; refused")
