"""Enrollment without copying secrets (docs/enrollment.md), the pure parts: the one-time code, the
line the user hands to the agent, the manifest digest a code is bound to, and the sealing of the
approved answer to the agent's one-time X25519 key.

* The code: 12 characters of Crockford base32 (60 random bits), shown in three groups of four
  (``7K2M-QP4R-X9TZ``). Read back case-insensitively, without dashes or spaces, with ``O`` as ``0``
  and ``I``/``L`` as ``1``. Only its SHA-256 is stored.
* The line: ``https://HOST:PORT/enroll#code=7K2M-QP4R-X9TZ&ca=sha256:<64 hex>``. The fragment is
  never sent by an HTTP client; the agent reads the code and the CA fingerprint from it and talks to
  ``https://HOST:PORT``.
* The manifest digest: ``sha256:`` + hex SHA-256 of the manifest's RFC 8785 canonical JSON, so
  re-indenting the file changes nothing and any change of content does.
* The answer (certificate, tokens, CA, keys to check the audit log with) is sealed with HPKE base
  mode (RFC 9180, DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-256-GCM) to the X25519 public key
  the agent sent with its request, ``info = "uomp-enroll-v1" 0x00 request_id``: what waits in the
  gateway's enrollment store between approval and pickup opens only with the agent's key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from gateway.core import canonical, hpke
from gateway.errors import ErrorCode, UompError

ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32: no I, L, O, U
CODE_CHARS = 12
_READ_AS = str.maketrans({"O": "0", "I": "1", "L": "1"})
_CODE = re.compile(f"[{ALPHABET}]{{{CODE_CHARS}}}")
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")
MAX_MANIFEST_BYTES = 64 * 1024
SEAL_INFO = b"uomp-enroll-v1\x00"
_SUITE = hpke.X25519_SHA256_AES256GCM


def new_code() -> str:
    """A fresh one-time code (random, from the unambiguous alphabet), in groups of four."""
    raw = "".join(secrets.choice(ALPHABET) for _ in range(CODE_CHARS))
    return "-".join(raw[i : i + 4] for i in range(0, CODE_CHARS, 4))


def normalize_code(text: object) -> str | None:
    """The code's canonical form, or None when ``text`` cannot be a code (never says more)."""
    if not isinstance(text, str) or len(text) > 64:
        return None
    squeezed = re.sub(r"[\s-]", "", text).upper().translate(_READ_AS)
    return squeezed if _CODE.fullmatch(squeezed) else None


def code_hash(code: str) -> str:
    """What the store keeps of a canonical code (never the code itself)."""
    return hashlib.sha256(b"uomp-enroll-code\x00" + code.encode()).hexdigest()


def digest_equal(a: str, b: str) -> bool:
    """Constant-time equality of two hex digests or secrets."""
    return hmac.compare_digest(a.encode(), b.encode())


def manifest_digest(raw: bytes) -> str:
    """The digest a code is bound to; INVALID_REQUEST when ``raw`` is not one JSON object."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise UompError(ErrorCode.INVALID_REQUEST, f"the manifest is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise UompError(ErrorCode.INVALID_REQUEST, "the manifest is not JSON (send the agent's uom.json)") from exc
    if not isinstance(doc, dict):
        raise UompError(ErrorCode.INVALID_REQUEST, "the manifest must be a JSON object (the agent's uom.json)")
    return "sha256:" + hashlib.sha256(canonical.canonical_json(doc)).hexdigest()


def ca_fingerprint(ca_der: bytes) -> str:
    """The CA certificate's pin as the enrollment line carries it: ``sha256:`` and the DER's hex digest."""
    return "sha256:" + hashlib.sha256(ca_der).hexdigest()


@dataclass(frozen=True)
class Line:
    """The one line ``uomp agent invite`` prints: gateway URL, code, CA fingerprint."""

    url: str  # https://host[:port], no path
    code: str  # canonical form
    ca_fingerprint: str

    def text(self) -> str:
        shown = "-".join(self.code[i : i + 4] for i in range(0, CODE_CHARS, 4))
        return f"{self.url}/enroll#code={shown}&ca={self.ca_fingerprint}"


def parse_line(text: str) -> Line:
    """The enrollment line's parts; INVALID_REQUEST (saying what a line looks like) otherwise."""
    bad = "not an enrollment line; give the whole line 'uomp agent invite' printed (https://HOST:PORT/enroll#code=...&ca=sha256:...)"
    parts = urlsplit(text.strip())
    if parts.scheme != "https" or not parts.hostname or parts.path not in ("/enroll", "/enroll/"):
        raise UompError(ErrorCode.INVALID_REQUEST, bad)
    fields = parse_qs(parts.fragment, strict_parsing=False)
    code = normalize_code((fields.get("code") or [""])[0])
    fp = (fields.get("ca") or [""])[0].lower()
    if code is None or not _FINGERPRINT.fullmatch(fp):
        raise UompError(ErrorCode.INVALID_REQUEST, bad)
    return Line(f"https://{parts.netloc}", code, fp)


def b64u(raw: bytes) -> str:
    """base64url without padding."""
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unb64u(text: str) -> bytes:
    """The bytes of unpadded base64url (ValueError when it is not)."""
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def seal_public_key(text: object) -> X25519PublicKey:
    """The agent's one-time sealing key: 32 raw bytes, base64url. INVALID_REQUEST otherwise."""
    try:
        if not isinstance(text, str) or len(text) > 64:
            raise ValueError("not a string")
        return hpke.public_key_from_bytes(unb64u(text))
    except (ValueError, hpke.HpkeError) as exc:
        raise UompError(
            ErrorCode.INVALID_REQUEST, "seal_key must be an X25519 public key (32 bytes, base64url)"
        ) from exc


def seal(recipient: X25519PublicKey, request_id: str, plaintext: bytes) -> dict[str, str]:
    """The approved answer sealed (HPKE) to the agent's one-time key, bound to its request id."""
    enc, ct = hpke.seal(_SUITE, recipient, SEAL_INFO + request_id.encode(), plaintext)
    return {"enc": b64u(enc), "ciphertext": b64u(ct)}


def open_sealed(key: X25519PrivateKey, request_id: str, sealed: object) -> bytes:
    """The agent's side of :func:`seal`; INVALID_REQUEST when it does not open."""
    try:
        if not isinstance(sealed, dict):
            raise ValueError("not an object")
        enc, ct = unb64u(str(sealed["enc"])), unb64u(str(sealed["ciphertext"]))
        return hpke.open_(_SUITE, enc, key, SEAL_INFO + request_id.encode(), ct)
    except (KeyError, ValueError, hpke.HpkeError) as exc:
        raise UompError(
            ErrorCode.INVALID_REQUEST, "the approved answer does not open with this agent's key; enroll again"
        ) from exc
