"""The user's certificate authority, pure: certificate and CRL builders, no file I/O.

Everything here takes keys, certificates and bytes and returns ``cryptography.x509`` objects; the
files under ``$UOMP_HOME/ca`` are :mod:`gateway.ca_store`'s business.

Three kinds of certificate come out of this module (RFC 5280 profile, checked by OpenSSL's
``X509_V_FLAG_X509_STRICT`` on both ends of the TLS connection):

* the **CA**: self-signed, ``CA:TRUE, pathlen:0`` (it signs end entities only, never another CA),
  ``keyCertSign`` + ``cRLSign``, SKI (and AKI = SKI), ten years;
* the **gateway server certificate**: EKU ``serverAuth``, SANs ``localhost``/``127.0.0.1``/``::1``
  plus the configured host names and addresses, one year;
* **agent client certificates**: short-lived (24 h by default), EKU ``clientAuth`` only, one URI SAN
  ``uomp://agent/<agent_id>`` that *is* the agent's transport identity, CN = agent id (when it
  fits RFC 5280's 64-character limit), random 128-bit serial.

Agent ids are restricted to ``[A-Za-z0-9._-]{1,128}`` (not all dots) so an id can never smuggle
URI syntax (``/``, ``?``, ``#``, ``%``, ``@``) into the SAN, and ``agent_id_from_cert`` refuses
anything that would not have come out of this module.

Longer than ~500 lines on purpose: the builders and the checks of the same certificates and CRLs,
side by side, so a rule is written once for both.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import re
import secrets
from collections.abc import Iterable, Sequence
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.errors import ErrorCode, UompError

CAPrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
AgentPublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
AgentPrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
KeyType = Literal["p256", "ed25519"]

AGENT_URI_PREFIX = "uomp://agent/"
AGENT_ID_MAX_CHARS = 128
CN_MAX_CHARS = 64  # RFC 5280 Appendix A ub-common-name
_AGENT_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
# DNS names for the server certificate: LDH labels, optionally one leading "*." wildcard label.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_RE = re.compile(rf"(\*\.)?{_LABEL}(\.{_LABEL})*")

CA_VALIDITY = dt.timedelta(days=3650)
SERVER_CERT_VALIDITY = dt.timedelta(days=365)
AGENT_CERT_LIFETIME = dt.timedelta(hours=24)
# Short-lived is the point of agent certificates (renewal replaces revocation for the common case);
# anything longer than this is refused rather than silently shortened.
AGENT_CERT_MAX_LIFETIME = dt.timedelta(days=90)
AGENT_CERT_MIN_LIFETIME = dt.timedelta(minutes=1)
# notBefore is back-dated by this much so a peer whose clock is slightly behind accepts a fresh cert.
CLOCK_SKEW = dt.timedelta(seconds=60)
CRL_VALIDITY = dt.timedelta(days=7)
# A CSR larger than this is refused before it is parsed (bounded work per request).
MAX_CSR_BYTES = 16 * 1024
MAX_CERT_BYTES = 16 * 1024


def utcnow() -> dt.datetime:
    """The current time, timezone-aware UTC."""
    return dt.datetime.now(dt.UTC)


def aware_utc(now: dt.datetime | None) -> dt.datetime:
    """``now`` as an aware UTC datetime (the current time for ``None``); ValueError for a naive one."""
    if now is None:
        return utcnow()
    if now.tzinfo is None:
        raise ValueError("naive datetime: pass an aware UTC datetime")
    return now.astimezone(dt.UTC)


# ------------------------------------------------------------------------------ identifiers


def validate_agent_id(agent_id: str) -> str:
    """Return ``agent_id`` if it is 1-128 chars of ``[A-Za-z0-9._-]`` and not all dots, else CA_ERROR."""
    if not isinstance(agent_id, str) or not _AGENT_ID_RE.fullmatch(agent_id) or set(agent_id) == {"."}:
        raise UompError(
            ErrorCode.CA_ERROR,
            f"invalid agent id: use 1-{AGENT_ID_MAX_CHARS} characters of A-Z a-z 0-9 . _ - (not only dots)",
        )
    return agent_id


def serial_hex(serial: int) -> str:
    """The one spelling of a serial number used in files, logs and the CLI: lower-case hex, no padding."""
    return format(serial, "x")


def parse_serial(text: str) -> int:
    """Hex serial, optionally ``0x``-prefixed or colon-separated (as ``openssl x509 -serial`` prints it)."""
    raw = text.strip().lower().removeprefix("0x").replace(":", "")
    if not raw or not re.fullmatch(r"[0-9a-f]{1,40}", raw):
        raise UompError(ErrorCode.CA_ERROR, "a serial number is 1-40 hex digits")
    return int(raw, 16)


def random_serial() -> int:
    """A random positive 128-bit serial (RFC 5280 §4.1.2.2 allows up to 20 octets; CAB BR want >= 64 bits)."""
    while True:
        serial = secrets.randbits(128)
        if serial:
            return serial


def new_key(key_type: KeyType = "p256") -> AgentPrivateKey:
    """A fresh agent or CA private key of ``key_type`` (P-256 or Ed25519); CA_ERROR for any other type."""
    if key_type == "p256":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    raise UompError(ErrorCode.CA_ERROR, f"unsupported key type {key_type!r} (p256 or ed25519)")


def _check_key_type(key: object, what: str) -> None:
    if isinstance(key, ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey):
        return
    if isinstance(key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        return
    raise UompError(ErrorCode.CA_ERROR, f"{what} must be ECDSA P-256 or Ed25519")


def _sig_hash(key: CAPrivateKey) -> hashes.SHA256 | None:
    # Ed25519 signs the message itself (RFC 8410); ECDSA P-256 pairs with SHA-256.
    return None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()


def short_id(public_key: AgentPublicKey) -> str:
    """Eight hex digits of the SHA-256 of the SubjectPublicKeyInfo: tells one user's CA from another's."""
    spki = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()[:8]


def _ski(public_key: AgentPublicKey) -> x509.SubjectKeyIdentifier:
    return x509.SubjectKeyIdentifier.from_public_key(public_key)


def _aki_from(ca_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound as exc:
        raise UompError(ErrorCode.CA_ERROR, "the CA certificate has no subject key identifier") from exc
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _public_of(key: CAPrivateKey) -> AgentPublicKey:
    return key.public_key()


# ------------------------------------------------------------------------------------ the CA


def create_ca(
    key: CAPrivateKey | None = None,
    *,
    key_type: KeyType = "p256",
    now: dt.datetime | None = None,
    validity: dt.timedelta = CA_VALIDITY,
) -> tuple[CAPrivateKey, x509.Certificate]:
    """A new self-signed user CA: ``(key, cert)``. ECDSA P-256 unless ``key_type='ed25519'``."""
    now = aware_utc(now)
    if key is None:
        key = new_key(key_type)
    _check_key_type(key, "the CA key")
    pub = _public_of(key)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "UOMP"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"UOMP user CA {short_id(pub)}"),
        ]
    )
    ski = _ski(pub)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(pub)
        .serial_number(random_serial())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + validity)
        # RFC 5280 §4.2.1.9: critical; pathlen 0 = this CA signs end-entity certificates only.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        # RFC 5280 §4.2.1.3: a CA key signs certificates and CRLs, nothing else.
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)  # §4.2.1.2: MUST in CA certificates
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
    )
    return key, builder.sign(key, _sig_hash(key))


def check_ca_pair(ca_key: CAPrivateKey, ca_cert: x509.Certificate) -> None:
    """CA_ERROR unless ``ca_cert`` is a CA certificate for ``ca_key``."""
    mine = ca_key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    theirs = ca_cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if mine != theirs:
        raise UompError(ErrorCode.CA_ERROR, "the CA key does not match the CA certificate")
    try:
        bc = ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound as exc:
        raise UompError(ErrorCode.CA_ERROR, "the CA certificate has no basic constraints") from exc
    if not bc.ca:
        raise UompError(ErrorCode.CA_ERROR, "the CA certificate is not a CA (CA:FALSE)")


# ------------------------------------------------------------------------ server certificate


def _server_sans(hostnames: Iterable[str]) -> list[x509.GeneralName]:
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    for raw in hostnames:
        host = raw.strip().strip("[]")  # allow "[::1]" as written in URLs
        if not host:
            continue
        name: x509.GeneralName
        try:
            name = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            if len(host) > 253 or not _DNS_RE.fullmatch(host):
                raise UompError(ErrorCode.CA_ERROR, f"not a host name or IP address: {host!r}") from None
            name = x509.DNSName(host.lower().rstrip("."))
        if name not in sans:
            sans.append(name)
    return sans


def server_cert_names(cert: x509.Certificate) -> set[str]:
    """The DNS names and IP addresses (as text) a server certificate covers."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    out = {n.lower() for n in san.get_values_for_type(x509.DNSName)}
    out |= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return out


def wanted_server_names(hostnames: Iterable[str]) -> set[str]:
    """The names ``issue_server_cert(hostnames=...)`` would put in the SAN, as text."""
    out: set[str] = set()
    for n in _server_sans(hostnames):
        out.add(str(n.value).lower() if isinstance(n, x509.DNSName) else str(n.value))
    return out


def issue_server_cert(
    ca_key: CAPrivateKey,
    ca_cert: x509.Certificate,
    server_public_key: AgentPublicKey,
    hostnames: Sequence[str] = (),
    *,
    now: dt.datetime | None = None,
    validity: dt.timedelta = SERVER_CERT_VALIDITY,
) -> x509.Certificate:
    """The gateway's TLS server certificate, signed by the user CA."""
    now = aware_utc(now)
    _check_key_type(server_public_key, "the gateway key")
    not_after = min(now + validity, ca_cert.not_valid_after_utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "UOMP"),
                    x509.NameAttribute(NameOID.COMMON_NAME, "UOMP gateway"),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(server_public_key)
        .serial_number(random_serial())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage_signature_only(), critical=True)
        # RFC 5280 §4.2.1.12 / RFC 5246 §7.4.2: a TLS server certificate, nothing else.
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        # RFC 6125 / RFC 9525: identities are in the SAN, never the CN.
        .add_extension(x509.SubjectAlternativeName(_server_sans(hostnames)), critical=False)
        .add_extension(_ski(server_public_key), critical=False)
        .add_extension(_aki_from(ca_cert), critical=False)
    )
    return builder.sign(ca_key, _sig_hash(ca_key))


def _key_usage_signature_only() -> x509.KeyUsage:
    # TLS 1.3 with EC / Ed25519 keys only ever signs (CertificateVerify): digitalSignature alone.
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


# ------------------------------------------------------------------------- agent certificates


def load_csr(data: bytes) -> x509.CertificateSigningRequest:
    """Parse a PEM or DER CSR and verify its self-signature (proof of possession of the key)."""
    if not isinstance(data, bytes | bytearray) or not data:
        raise UompError(ErrorCode.CA_ERROR, "the certificate signing request is empty")
    if len(data) > MAX_CSR_BYTES:
        raise UompError(ErrorCode.CA_ERROR, f"the certificate signing request is larger than {MAX_CSR_BYTES} bytes")
    try:
        if bytes(data).lstrip().startswith(b"-----BEGIN"):
            csr = x509.load_pem_x509_csr(bytes(data))
        else:
            csr = x509.load_der_x509_csr(bytes(data))
    except ValueError as exc:
        raise UompError(ErrorCode.CA_ERROR, "the certificate signing request cannot be parsed") from exc
    try:
        valid = csr.is_signature_valid
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm) as exc:
        raise UompError(
            ErrorCode.CA_ERROR, "the certificate signing request uses an unsupported key or signature"
        ) from exc
    if not valid:
        raise UompError(ErrorCode.CA_ERROR, "the certificate signing request signature does not verify")
    return csr


def load_cert(data: bytes) -> x509.Certificate:
    """Parse one PEM or DER certificate; CA_ERROR if it is neither."""
    if not isinstance(data, bytes | bytearray) or not data:
        raise UompError(ErrorCode.CA_ERROR, "the certificate is empty")
    if len(data) > MAX_CERT_BYTES:
        raise UompError(ErrorCode.CA_ERROR, f"the certificate is larger than {MAX_CERT_BYTES} bytes")
    try:
        if bytes(data).lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(bytes(data))
        return x509.load_der_x509_certificate(bytes(data))
    except ValueError as exc:
        raise UompError(ErrorCode.CA_ERROR, "the certificate cannot be parsed") from exc


def csr_public_key(csr: x509.CertificateSigningRequest) -> AgentPublicKey:
    """The public key a CSR carries, refused unless it is a key type the CA issues for."""
    pub = csr.public_key()
    _check_key_type(pub, "the agent key")
    assert isinstance(pub, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey)
    return pub


def issue_agent_cert(
    ca_key: CAPrivateKey,
    ca_cert: x509.Certificate,
    csr_or_public_key: x509.CertificateSigningRequest | AgentPublicKey | bytes,
    agent_id: str,
    lifetime: dt.timedelta = AGENT_CERT_LIFETIME,
    now: dt.datetime | None = None,
) -> x509.Certificate:
    """A short-lived client certificate for ``agent_id``.

    ``csr_or_public_key``: a parsed CSR, CSR bytes (PEM/DER) or a public key. A CSR's signature is
    verified (the requester holds the private key); only its public key is used: subject and
    extensions requested in the CSR are ignored, the CA decides them.
    """
    now = aware_utc(now)
    validate_agent_id(agent_id)
    if not AGENT_CERT_MIN_LIFETIME <= lifetime <= AGENT_CERT_MAX_LIFETIME:
        raise UompError(
            ErrorCode.CA_ERROR,
            f"agent certificate lifetime must be between {AGENT_CERT_MIN_LIFETIME} and {AGENT_CERT_MAX_LIFETIME}",
        )
    pub: object
    if isinstance(csr_or_public_key, bytes | bytearray):
        pub = csr_public_key(load_csr(bytes(csr_or_public_key)))
    elif isinstance(csr_or_public_key, x509.CertificateSigningRequest):
        if not csr_or_public_key.is_signature_valid:
            raise UompError(ErrorCode.CA_ERROR, "the certificate signing request signature does not verify")
        pub = csr_public_key(csr_or_public_key)
    else:
        pub = csr_or_public_key
    _check_key_type(pub, "the agent key")
    assert isinstance(pub, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey)
    if now + lifetime > ca_cert.not_valid_after_utc:
        raise UompError(ErrorCode.CA_ERROR, "the CA certificate expires before this agent certificate would")
    # CN = agent id for people and logs (the identity is the URI SAN). RFC 5280's ub-common-name is
    # 64 characters: a longer id gets an empty subject, and then §4.2.1.6 makes the SAN critical.
    fits = len(agent_id) <= CN_MAX_CHARS
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, agent_id)] if fits else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(pub)
        .serial_number(random_serial())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage_signature_only(), critical=True)
        # RFC 5280 §4.2.1.12: clientAuth only, so the cert is useless as a server certificate.
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        # The transport identity of the agent (SPIFFE-style URI SAN, RFC 5280 §4.2.1.6).
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(AGENT_URI_PREFIX + agent_id)]),
            critical=not fits,
        )
        .add_extension(_ski(pub), critical=False)
        .add_extension(_aki_from(ca_cert), critical=False)
    )
    return builder.sign(ca_key, _sig_hash(ca_key))


def agent_id_from_cert(cert: x509.Certificate) -> str | None:
    """The agent id of a client certificate: exactly one ``uomp://agent/<id>`` URI SAN, else None."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):
        return None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(AGENT_URI_PREFIX)]
    if len(uris) != 1:
        return None
    candidate = uris[0][len(AGENT_URI_PREFIX) :]
    if not _AGENT_ID_RE.fullmatch(candidate) or set(candidate) == {"."}:
        return None
    return candidate


def has_client_auth(cert: x509.Certificate) -> bool:
    """True when the certificate carries an EKU extension that lists clientAuth (absent EKU = False)."""
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (x509.ExtensionNotFound, ValueError):
        return False
    return ExtendedKeyUsageOID.CLIENT_AUTH in eku


def is_issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    """True when ``ca_cert``'s key signed ``cert`` and the issuer name matches."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


# ------------------------------------------------------------------------------------- CRLs


def build_crl(
    ca_key: CAPrivateKey,
    ca_cert: x509.Certificate,
    revoked: Iterable[tuple[int, dt.datetime]],
    now: dt.datetime | None = None,
    next_update: dt.timedelta = CRL_VALIDITY,
    *,
    number: int | None = None,
) -> x509.CertificateRevocationList:
    """A CRL (RFC 5280 §5) listing ``(serial, revoked_at)`` pairs.

    ``number`` is the CRL number (§5.2.3, MUST be monotonically increasing); when omitted the
    current time in milliseconds is used, which increases as long as the clock does.
    ``thisUpdate`` is back-dated by the clock skew allowance, like certificates.
    """
    now = aware_utc(now)
    if number is None:
        number = int(now.timestamp() * 1000)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - CLOCK_SKEW)
        .next_update(now + next_update)
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(_aki_from(ca_cert), critical=False)
    )
    for serial, revoked_at in revoked:
        entry = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(aware_utc(revoked_at)).build()
        builder = builder.add_revoked_certificate(entry)
    return builder.sign(ca_key, _sig_hash(ca_key))


def crl_number(crl: x509.CertificateRevocationList) -> int:
    """The CRL's number (0 when it has no CRLNumber extension): a newer CRL has a larger one."""
    try:
        return int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
    except x509.ExtensionNotFound:
        return 0


# ----------------------------------------------------------------------------- serialisation


def cert_pem(cert: x509.Certificate) -> bytes:
    """The certificate as PEM bytes."""
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: CAPrivateKey) -> bytes:
    """Unencrypted PKCS#8 PEM (the file is 0600 in a 0700 directory; the gateway must read it unattended)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def crl_pem(crl: x509.CertificateRevocationList) -> bytes:
    """The CRL as PEM bytes."""
    return crl.public_bytes(serialization.Encoding.PEM)


def load_private_key(data: bytes) -> CAPrivateKey:
    """A P-256 or Ed25519 private key from PEM; ValueError on anything else."""
    key = serialization.load_pem_private_key(data, password=None)
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    raise ValueError("not a P-256 or Ed25519 private key")


def make_csr(key: AgentPrivateKey, agent_id: str) -> x509.CertificateSigningRequest:
    """What an agent (or the SDK) sends: a CSR with CN = agent id (if it fits), signed with its key."""
    validate_agent_id(agent_id)
    cn = [x509.NameAttribute(NameOID.COMMON_NAME, agent_id)] if len(agent_id) <= CN_MAX_CHARS else []
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name(cn))
        .sign(key, None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256())
    )
