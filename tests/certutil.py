"""Test helpers: mint a CA, a gateway server certificate and agent certificates into a directory.

Built on :mod:`gateway.core.ca` (the real builders), plus hand-built variants the CA would never
issue, for failing cases: no clientAuth EKU, serverAuth EKU, no agent URI SAN. Everything is
written as PEM files so a test can hand paths to ``build_server_context`` / ``build_client_context``.

    certs = make_cert_set(tmp_path)
    server = build_server_context(certs.server_cert, certs.server_key, certs.ca_cert, certs.crl)
    client = certs.client_context("good")       # or "expired", "wrong_ca", "no_eku", ...
"""

from __future__ import annotations

import datetime as dt
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.client.tls import build_client_context
from gateway.core import ca

# Variants make_cert_set() writes, and what each is for.
VARIANTS = {
    "good": "P-256 agent certificate from the CA, valid now",
    "ed25519": "Ed25519 agent certificate from the CA, valid now",
    "expired": "from the CA, expired an hour ago",
    "not_yet_valid": "from the CA, valid from tomorrow",
    "wrong_ca": "same agent id, issued by another CA",
    "wrong_ca_expired": "same agent id, issued by another CA, expired an hour ago",
    "no_eku": "from the CA, no extended key usage extension at all",
    "server_eku": "from the CA, EKU serverAuth only",
    "no_san": "from the CA, EKU clientAuth but no uomp://agent/ URI SAN",
}


@dataclass(frozen=True)
class AgentFiles:
    name: str
    agent_id: str
    cert_file: Path
    key_file: Path
    cert: x509.Certificate

    @property
    def der(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.DER)

    @property
    def serial(self) -> str:
        return ca.serial_hex(self.cert.serial_number)


@dataclass
class CertSet:
    dir: Path
    ca_key: ca.CAPrivateKey
    ca: x509.Certificate
    ca_cert: Path
    ca_key_file: Path
    server_cert: Path
    server_key: Path
    crl: Path
    other_ca_cert: Path
    agents: dict[str, AgentFiles] = field(default_factory=dict)

    def client_context(self, variant: str | None = "good") -> ssl.SSLContext:
        """A client context trusting this CA, presenting ``variant``'s certificate (None: none)."""
        if variant is None:
            return build_client_context(self.ca_cert)
        a = self.agents[variant]
        return build_client_context(self.ca_cert, a.cert_file, a.key_file)

    def revoke(self, *variants: str, now: dt.datetime | None = None) -> None:
        """Rewrite the CRL listing these variants' serials."""
        now = now or ca.utcnow()
        entries = [(self.agents[v].cert.serial_number, now) for v in variants]
        _write(self.crl, ca.crl_pem(ca.build_crl(self.ca_key, self.ca, entries, now)))


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def write_key(path: Path, key: ca.CAPrivateKey) -> Path:
    return _write(path, ca.key_pem(key), 0o600)


def write_cert(path: Path, cert: x509.Certificate) -> Path:
    return _write(path, ca.cert_pem(cert))


def custom_agent_cert(
    ca_key: ca.CAPrivateKey,
    ca_cert: x509.Certificate,
    public_key: ca.AgentPublicKey,
    agent_id: str,
    *,
    eku: list[x509.ObjectIdentifier] | None,
    uri_san: bool = True,
    now: dt.datetime | None = None,
    lifetime: dt.timedelta = dt.timedelta(hours=1),
) -> x509.Certificate:
    """An agent-like certificate with a chosen EKU (None = no EKU extension) and optional URI SAN."""
    now = now or ca.utcnow()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, agent_id)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(ca.random_serial())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    if eku is not None:
        b = b.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    if uri_san:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(ca.AGENT_URI_PREFIX + agent_id)]),
            critical=False,
        )
    else:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(f"{agent_id}.example")]), critical=False)
    return b.sign(ca_key, None if isinstance(ca_key, ed25519.Ed25519PrivateKey) else hashes.SHA256())


def make_cert_set(
    out_dir: Path, agent_id: str = "agent-1", hostnames: tuple[str, ...] = (), *, variants: tuple[str, ...] = ()
) -> CertSet:
    """CA, server cert, empty CRL and agent certificates (all of VARIANTS unless ``variants`` given)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    now = ca.utcnow()
    ca_key, ca_cert = ca.create_ca()
    server_key = ca.new_key()
    server_cert = ca.issue_server_cert(ca_key, ca_cert, server_key.public_key(), list(hostnames))
    other_key, other_ca = ca.create_ca()
    cs = CertSet(
        dir=out_dir,
        ca_key=ca_key,
        ca=ca_cert,
        ca_cert=write_cert(out_dir / "ca.crt", ca_cert),
        ca_key_file=write_key(out_dir / "ca.key", ca_key),
        server_cert=write_cert(out_dir / "server.crt", server_cert),
        server_key=write_key(out_dir / "server.key", server_key),
        crl=_write(out_dir / "crl.pem", ca.crl_pem(ca.build_crl(ca_key, ca_cert, [], now))),
        other_ca_cert=write_cert(out_dir / "other-ca.crt", other_ca),
    )
    for name in variants or tuple(VARIANTS):
        key = ca.new_key("ed25519" if name == "ed25519" else "p256")
        pub = key.public_key()
        if name in ("good", "ed25519"):
            cert = ca.issue_agent_cert(ca_key, ca_cert, pub, agent_id, now=now)
        elif name == "expired":
            cert = ca.issue_agent_cert(
                ca_key, ca_cert, pub, agent_id, dt.timedelta(hours=1), now=now - dt.timedelta(hours=2)
            )
        elif name == "not_yet_valid":
            cert = ca.issue_agent_cert(ca_key, ca_cert, pub, agent_id, now=now + dt.timedelta(days=1))
        elif name == "wrong_ca":
            cert = ca.issue_agent_cert(other_key, other_ca, pub, agent_id, now=now)
        elif name == "wrong_ca_expired":
            cert = ca.issue_agent_cert(
                other_key, other_ca, pub, agent_id, dt.timedelta(hours=1), now=now - dt.timedelta(hours=2)
            )
        elif name == "no_eku":
            cert = custom_agent_cert(ca_key, ca_cert, pub, agent_id, eku=None, now=now)
        elif name == "server_eku":
            cert = custom_agent_cert(ca_key, ca_cert, pub, agent_id, eku=[ExtendedKeyUsageOID.SERVER_AUTH], now=now)
        elif name == "no_san":
            cert = custom_agent_cert(
                ca_key, ca_cert, pub, agent_id, eku=[ExtendedKeyUsageOID.CLIENT_AUTH], uri_san=False, now=now
            )
        else:
            raise ValueError(f"unknown variant {name}")
        cs.agents[name] = AgentFiles(
            name=name,
            agent_id=agent_id,
            cert_file=write_cert(out_dir / f"agent-{name}.crt", cert),
            key_file=write_key(out_dir / f"agent-{name}.key", key),
            cert=cert,
        )
    return cs
