"""The uplink's identities: a dedicated uplink CA kept at home, the home side's client certificate,
the VPS uplink listener's server certificate, and the SPKI pins each side keeps of the other.

Why a dedicated CA and not the user's agent CA: the agent listener trusts the agent CA only and the
uplink listener trusts the uplink CA only, so an agent certificate can never pass the uplink
handshake and an uplink certificate can never pass the agent handshake, by the chain alone —
the separation does not rest on a name or EKU check being right in two places. The uplink CA key
never leaves home (the VPS gets only its own certificate and key), it signs nothing but these two
certificates, and re-keying the uplink (``uomp uplink init --force``) touches no agent. On top of
the chain each side pins the other's exact public key (SHA-256 of the SubjectPublicKeyInfo,
RFC 7469 style): a second certificate issued by the same CA is refused too.

Roles in the certificates: the home side's has EKU clientAuth and the URI SAN
``uomp://uplink/home``; the VPS's has EKU serverAuth and the VPS's DNS names / IPs.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.config import Paths
from gateway.core import ca
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write, ensure_private_dir

HOME_URI = "uomp://uplink/home"
CERT_VALIDITY = dt.timedelta(days=397)


def spki_pin(cert: x509.Certificate) -> str:
    """base64 SHA-256 of the certificate's SubjectPublicKeyInfo (the pin)."""
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


def pin_of_der(der: bytes) -> str:
    """The SPKI pin (SHA-256 of the certificate's public key) of a DER certificate."""
    return spki_pin(x509.load_der_x509_certificate(der))


def is_home_cert(cert: x509.Certificate) -> bool:
    """Exactly the home role: the ``uomp://uplink/home`` URI SAN and EKU clientAuth."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False
    return san.get_values_for_type(x509.UniformResourceIdentifier) == [HOME_URI] and (
        ExtendedKeyUsageOID.CLIENT_AUTH in eku
    )


def _issue_home(ca_key: ca.CAPrivateKey, ca_cert: x509.Certificate, pub: ca.AgentPublicKey) -> x509.Certificate:
    now = ca.utcnow()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "UOMP uplink home")]))
        .issuer_name(ca_cert.subject)
        .public_key(pub)
        .serial_number(ca.random_serial())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + CERT_VALIDITY, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(HOME_URI)]), critical=False)
    )
    return builder.sign(ca_key, None if isinstance(ca_key, ed25519.Ed25519PrivateKey) else hashes.SHA256())


def _write_pins(path: Path, pins: Sequence[str]) -> None:
    atomic_write(path, json.dumps({"pins": list(pins)}).encode() + b"\n", mode=0o600)


def load_pins(path: Path) -> set[str]:
    """The pins in ``path`` (one a line); CONFIG_ERROR when missing or empty."""
    try:
        doc = json.loads(path.read_bytes())
        pins = doc["pins"]
        if not isinstance(pins, list) or not all(isinstance(p, str) and len(p) == 44 for p in pins) or not pins:
            raise ValueError
    except FileNotFoundError:
        raise UompError(
            ErrorCode.CONFIG_ERROR, f"{path} is missing; run 'uomp uplink init' at home and copy its VPS directory"
        ) from None
    except (OSError, ValueError, KeyError, TypeError):
        raise UompError(ErrorCode.CONFIG_ERROR, f"{path} is not a pin file; run 'uomp uplink init' again") from None
    return set(pins)


@dataclass(frozen=True)
class UplinkInit:
    """What ``uomp uplink init`` made: the VPS's directory and the two pins."""

    vps_dir: Path  # the VPS's data directory, to copy as a whole
    home_pin: str
    server_pin: str


def init(paths: Paths, vps_hosts: Sequence[str], vps_dir: Path, *, force: bool = False) -> UplinkInit:
    """At home: the uplink CA (kept), the home identity (kept), the VPS's uplink identity (exported
    with the gateway-side files the VPS needs into ``vps_dir``; its key is not kept at home).

    ``vps_dir`` gets: ``uplink/`` (server.crt, server.key, uplink-ca.crt, pins.json = the home pin),
    ``ca/`` (the agent CA certificate, the gateway's certificate and key for the agent listener, the
    CRL) and ``.secrets/jwks.json`` (public keys). No CA key, no signing key, no audit key, no
    memory, no admin credential."""
    if not vps_hosts:
        raise UompError(ErrorCode.USAGE, "name the VPS: --vps-host HOST (its DNS name or IP address)")
    ensure_private_dir(paths.uplink_dir, "uplink directory")
    if force or not paths.uplink_ca_key.exists():
        ca_key, ca_cert = ca.create_ca()
        atomic_write(paths.uplink_ca_key, ca.key_pem(ca_key), mode=0o600)
        atomic_write(paths.uplink_ca_cert, ca.cert_pem(ca_cert), mode=0o644)
        force = True
    else:
        ca_key = ca.load_private_key(paths.uplink_ca_key.read_bytes())
        ca_cert = ca.load_cert(paths.uplink_ca_cert.read_bytes())
    if force or not paths.uplink_home_key.exists():
        home_key = ca.new_key()
        atomic_write(paths.uplink_home_key, ca.key_pem(home_key), mode=0o600)
        home_cert = _issue_home(ca_key, ca_cert, home_key.public_key())
        atomic_write(paths.uplink_home_cert, ca.cert_pem(home_cert), mode=0o644)
    home_cert = ca.load_cert(paths.uplink_home_cert.read_bytes())
    # a new VPS identity on every init: its key goes to the VPS only
    server_key = ca.new_key()
    server_cert = ca.issue_server_cert(ca_key, ca_cert, server_key.public_key(), list(vps_hosts))
    home_pin, server_pin = spki_pin(home_cert), spki_pin(server_cert)
    _write_pins(paths.uplink_pins, [server_pin])
    vps = Paths(vps_dir)
    ensure_private_dir(vps.home, "VPS directory")
    ensure_private_dir(vps.uplink_dir, "uplink directory")
    ensure_private_dir(vps.ca_dir, "CA directory")
    ensure_private_dir(vps.secrets, "secrets directory")
    atomic_write(vps.uplink_server_key, ca.key_pem(server_key), mode=0o600)
    atomic_write(vps.uplink_server_cert, ca.cert_pem(server_cert), mode=0o644)
    atomic_write(vps.uplink_ca_cert, ca.cert_pem(ca_cert), mode=0o644)
    _write_pins(vps.uplink_pins, [home_pin])
    export_gateway_files(paths, vps)
    return UplinkInit(vps.home, home_pin, server_pin)


def export_gateway_files(paths: Paths, vps: Paths) -> None:
    """The files of the agent-facing gateway the VPS needs (public material and the gateway's own
    TLS identity): copied again after `uomp agent revoke` (CRL) or `uomp keys rotate` (jwks)."""
    for d, what in ((vps.home, "data directory"), (vps.ca_dir, "CA directory"), (vps.secrets, "secrets directory")):
        ensure_private_dir(d, what)
    for src, dst, mode in (
        (paths.ca_cert, vps.ca_cert, 0o644),
        (paths.gateway_cert, vps.gateway_cert, 0o644),
        (paths.gateway_key, vps.gateway_key, 0o600),
        (paths.crl, vps.crl, 0o644),
        (paths.jwks, vps.jwks, 0o644),
        (paths.revoked_keys, vps.revoked_keys, 0o644),
    ):
        if src.exists():
            atomic_write(dst, src.read_bytes(), mode=mode)
        elif dst.exists():
            dst.unlink()
