"""JOSE pieces, pure: base64url, JWK (RFC 7517/8037), compact JWS (RFC 7515), thumbprints.

No I/O. Bytes and dicts in, verified objects out. Only two algorithms exist here:
``EdDSA`` (Ed25519, RFC 8037) and ``ES256`` (P-256, for DPoP proofs and agent keys). Anything
else, ``none`` and every HMAC algorithm included, is refused before a key is even looked at.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

from gateway import jsonio
from gateway.errors import ErrorCode, UompError

PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey
PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey

# A compact JWS longer than this is refused before any parsing (bounded work per request).
MAX_JWS_BYTES = 16 * 1024
SUPPORTED_ALGS = frozenset({"EdDSA", "ES256"})


def b64u_encode(data: bytes) -> str:
    """Base64url without padding (RFC 7515 §2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64u_decode(text: str) -> bytes:
    """Strict base64url without padding; raises ValueError on anything else."""
    if not isinstance(text, str) or "=" in text:
        raise ValueError("not unpadded base64url")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError("not base64url") from exc
    if b64u_encode(raw) != text:  # rejects non-canonical encodings and stray characters
        raise ValueError("non-canonical base64url")
    return raw


def _json_b64(obj: dict[str, Any]) -> str:
    return b64u_encode(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


# --------------------------------------------------------------------------------------- JWK


def public_jwk(key: PublicKey | PrivateKey, *, kid: str | None = None) -> dict[str, Any]:
    """The public JWK of a key (private material never included)."""
    pub = key.public_key() if isinstance(key, ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey) else key
    jwk: dict[str, Any]
    if isinstance(pub, ed25519.Ed25519PublicKey):
        raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        jwk = {"kty": "OKP", "crv": "Ed25519", "x": b64u_encode(raw)}
    elif isinstance(pub, ec.EllipticCurvePublicKey) and isinstance(pub.curve, ec.SECP256R1):
        nums = pub.public_numbers()
        jwk = {
            "kty": "EC",
            "crv": "P-256",
            "x": b64u_encode(nums.x.to_bytes(32, "big")),
            "y": b64u_encode(nums.y.to_bytes(32, "big")),
        }
    else:
        raise UompError(ErrorCode.KEY_ERROR, "unsupported key type (Ed25519 and P-256 only)")
    if kid is not None:
        jwk["kid"] = kid
    return jwk


def private_jwk(key: ed25519.Ed25519PrivateKey, *, kid: str) -> dict[str, Any]:
    """Ed25519 private JWK in the shape the TypeScript reference writes (kty, crv, x, d, kid, alg)."""
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    jwk = public_jwk(key)
    jwk["d"] = b64u_encode(raw)
    jwk["kid"] = kid
    jwk["alg"] = "EdDSA"
    return jwk


def load_public_jwk(jwk: Any) -> PublicKey:
    """A public key from a JWK dict; private members, if present, are ignored."""
    if not isinstance(jwk, dict):
        raise ValueError("JWK is not an object")
    kty, crv = jwk.get("kty"), jwk.get("crv")
    if kty == "OKP" and crv == "Ed25519":
        x = b64u_decode(jwk.get("x", ""))
        if len(x) != 32:
            raise ValueError("Ed25519 x must be 32 bytes")
        return ed25519.Ed25519PublicKey.from_public_bytes(x)
    if kty == "EC" and crv == "P-256":
        x, y = b64u_decode(jwk.get("x", "")), b64u_decode(jwk.get("y", ""))
        if len(x) != 32 or len(y) != 32:
            raise ValueError("P-256 coordinates must be 32 bytes")
        nums = ec.EllipticCurvePublicNumbers(int.from_bytes(x, "big"), int.from_bytes(y, "big"), ec.SECP256R1())
        return nums.public_key()  # raises ValueError when the point is not on the curve
    raise ValueError("unsupported JWK (OKP/Ed25519 and EC/P-256 only)")


def load_private_jwk(jwk: Any) -> ed25519.Ed25519PrivateKey:
    """An Ed25519 private key from its OKP JWK; ValueError unless ``d`` (and ``x`` when present) are right."""
    if not isinstance(jwk, dict) or jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
        raise ValueError("not an Ed25519 private JWK")
    d = b64u_decode(jwk.get("d", ""))
    if len(d) != 32:
        raise ValueError("Ed25519 d must be 32 bytes")
    key = ed25519.Ed25519PrivateKey.from_private_bytes(d)
    if "x" in jwk and public_jwk(key)["x"] != jwk["x"]:
        raise ValueError("JWK x does not match d")
    return key


def jwk_thumbprint(jwk: dict[str, Any]) -> str:
    """RFC 7638 SHA-256 thumbprint, base64url. Only the required members, in lexicographic order."""
    kty = jwk.get("kty")
    if kty == "OKP":
        members = {"crv": jwk["crv"], "kty": "OKP", "x": jwk["x"]}
    elif kty == "EC":
        members = {"crv": jwk["crv"], "kty": "EC", "x": jwk["x"], "y": jwk["y"]}
    else:
        raise ValueError("unsupported kty for thumbprint")
    canon = json.dumps(members, separators=(",", ":"), sort_keys=True).encode("utf-8")
    return b64u_encode(hashlib.sha256(canon).digest())


def key_thumbprint(key: PublicKey | PrivateKey) -> str:
    """The RFC 7638 JWK thumbprint of a key's public half (what ``cnf.jkt`` binds)."""
    return jwk_thumbprint(public_jwk(key))


def cert_thumbprint(cert_der: bytes) -> str:
    """RFC 8705 ``x5t#S256``: base64url SHA-256 of the DER certificate."""
    return b64u_encode(hashlib.sha256(cert_der).digest())


# --------------------------------------------------------------------------------------- JWS


def sign_compact(header: dict[str, Any], payload: dict[str, Any], key: PrivateKey) -> str:
    """Compact JWS. ``header['alg']`` is set from the key type."""
    h = dict(header)
    if isinstance(key, ed25519.Ed25519PrivateKey):
        h["alg"] = "EdDSA"
    elif isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        h["alg"] = "ES256"
    else:
        raise UompError(ErrorCode.KEY_ERROR, "unsupported signing key")
    signing_input = f"{_json_b64(h)}.{_json_b64(payload)}".encode("ascii")
    if isinstance(key, ed25519.Ed25519PrivateKey):
        sig = key.sign(signing_input)
    else:
        r, s = decode_dss_signature(key.sign(signing_input, ec.ECDSA(hashes.SHA256())))
        sig = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    return f"{signing_input.decode('ascii')}.{b64u_encode(sig)}"


@dataclass(frozen=True)
class ParsedJWS:
    """A compact JWS split and decoded, its signature not yet checked."""

    header: dict[str, Any]
    payload: dict[str, Any]
    signing_input: bytes
    signature: bytes


def parse_compact(token: str, *, what: str = "token", code: ErrorCode = ErrorCode.INVALID_TOKEN) -> ParsedJWS:
    """Split and decode a compact JWS without verifying it. Every failure is ``code``."""
    if not isinstance(token, str) or len(token) > MAX_JWS_BYTES:
        raise UompError(code, f"{what} is missing or too long")
    parts = token.split(".")
    if len(parts) != 3:
        raise UompError(code, f"{what} is not a compact JWS")
    try:
        header = jsonio.loads(b64u_decode(parts[0]))
        payload = jsonio.loads(b64u_decode(parts[1]))
        signature = b64u_decode(parts[2])
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise UompError(code, f"{what} is malformed") from exc
    if not isinstance(header, dict) or not isinstance(payload, dict):
        raise UompError(code, f"{what} header and payload must be JSON objects")
    alg = header.get("alg")
    if alg not in SUPPORTED_ALGS:
        raise UompError(code, f"{what} algorithm is not accepted")
    if "crit" in header:
        raise UompError(code, f"{what} has critical header parameters this server does not understand")
    return ParsedJWS(header, payload, f"{parts[0]}.{parts[1]}".encode("ascii"), signature)


def verify_signature(parsed: ParsedJWS, key: PublicKey) -> bool:
    """True when the signature verifies with ``key`` under the header's alg (alg pinned to key type)."""
    alg = parsed.header.get("alg")
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            if alg != "EdDSA":
                return False
            key.verify(parsed.signature, parsed.signing_input)
            return True
        if isinstance(key, ec.EllipticCurvePublicKey):
            if alg != "ES256" or len(parsed.signature) != 64:
                return False
            r = int.from_bytes(parsed.signature[:32], "big")
            s = int.from_bytes(parsed.signature[32:], "big")
            key.verify(encode_dss_signature(r, s), parsed.signing_input, ec.ECDSA(hashes.SHA256()))
            return True
    except InvalidSignature:
        return False
    return False
