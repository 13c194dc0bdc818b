"""The user CA: pure builders (gateway.core.ca), the on-disk CA (gateway.ca_store), the CLI."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway import ca_registry, ca_store
from gateway.cli.main import main
from gateway.config import Paths
from gateway.core import ca
from gateway.errors import UompError

NOW = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)
ROOT = Path(__file__).resolve().parents[2]


def ext(cert: x509.Certificate, cls: type[x509.ExtensionType]) -> x509.Extension[x509.ExtensionType]:
    return cert.extensions.get_extension_for_class(cls)


@pytest.fixture(scope="module")
def the_ca() -> tuple[ca.CAPrivateKey, x509.Certificate]:
    return ca.create_ca(now=NOW)


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(tmp_path / "home")


@pytest.fixture
def ready(paths: Paths) -> Paths:
    ca_store.init_all(paths)
    return paths


def csr_for(agent_id: str = "bot", key_type: ca.KeyType = "p256") -> tuple[ca.AgentPrivateKey, bytes]:
    key = ca.new_key(key_type)
    return key, ca.make_csr(key, agent_id).public_bytes(serialization.Encoding.PEM)


def code_of(exc: pytest.ExceptionInfo[UompError]) -> str:
    return exc.value.code


# ------------------------------------------------------------------------------ core: CA


def test_ca_certificate_profile(the_ca: tuple[ca.CAPrivateKey, x509.Certificate]) -> None:
    key, cert = the_ca
    assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1)
    bc = ext(cert, x509.BasicConstraints)
    assert bc.critical and bc.value.ca is True and bc.value.path_length == 0
    ku = ext(cert, x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign and not ku.value.digital_signature
    ski = ext(cert, x509.SubjectKeyIdentifier).value
    assert ski.digest == x509.SubjectKeyIdentifier.from_public_key(key.public_key()).digest
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn == f"UOMP user CA {ca.short_id(key.public_key())}"
    assert cert.not_valid_after_utc - NOW == dt.timedelta(days=3650)
    assert cert.not_valid_before_utc == NOW - ca.CLOCK_SKEW
    cert.verify_directly_issued_by(cert)


def test_ed25519_ca_works() -> None:
    key, cert = ca.create_ca(key_type="ed25519", now=NOW)
    assert isinstance(key, ed25519.Ed25519PrivateKey)
    agent = ca.issue_agent_cert(key, cert, ca.new_key().public_key(), "bot", now=NOW)
    agent.verify_directly_issued_by(cert)
    crl = ca.build_crl(key, cert, [(agent.serial_number, NOW)], NOW)
    assert crl.is_signature_valid(key.public_key())


def test_server_certificate_profile(the_ca: tuple[ca.CAPrivateKey, x509.Certificate]) -> None:
    key, cert = the_ca
    skey = ca.new_key()
    server = ca.issue_server_cert(
        key, cert, skey.public_key(), ["gw.example.org", "192.0.2.7", "[2001:db8::1]"], now=NOW
    )
    assert ca.server_cert_names(server) == {
        "localhost",
        "127.0.0.1",
        "::1",
        "gw.example.org",
        "192.0.2.7",
        "2001:db8::1",
    }
    assert list(ext(server, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert ext(server, x509.BasicConstraints).value.ca is False
    assert server.not_valid_after_utc - NOW == dt.timedelta(days=365)
    server.verify_directly_issued_by(cert)


@pytest.mark.parametrize("bad", ["exa mple.org", "a/b", "-lead.example", "x" * 300, "foo..bar"])
def test_server_certificate_refuses_bad_hostnames(the_ca: tuple[ca.CAPrivateKey, x509.Certificate], bad: str) -> None:
    key, cert = the_ca
    with pytest.raises(UompError) as err:
        ca.issue_server_cert(key, cert, ca.new_key().public_key(), [bad], now=NOW)
    assert code_of(err) == "CA_ERROR"


# --------------------------------------------------------------------- core: agent certs


@pytest.mark.parametrize("key_type", ["p256", "ed25519"])
def test_agent_certificate_from_csr(the_ca: tuple[ca.CAPrivateKey, x509.Certificate], key_type: ca.KeyType) -> None:
    ca_key, ca_cert = the_ca
    agent_key, csr = csr_for("stock-analyst_v2.1", key_type)
    cert = ca.issue_agent_cert(ca_key, ca_cert, csr, "stock-analyst_v2.1", now=NOW)
    cert.verify_directly_issued_by(ca_cert)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "stock-analyst_v2.1"
    san = ext(cert, x509.SubjectAlternativeName).value
    assert list(san) == [x509.UniformResourceIdentifier("uomp://agent/stock-analyst_v2.1")]
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    ku = ext(cert, x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign
    bc = ext(cert, x509.BasicConstraints)
    assert bc.critical and bc.value.ca is False
    aki = ext(cert, x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == ext(ca_cert, x509.SubjectKeyIdentifier).value.digest
    assert (
        ext(cert, x509.SubjectKeyIdentifier).value.digest
        == x509.SubjectKeyIdentifier.from_public_key(agent_key.public_key()).digest
    )
    assert 0 < cert.serial_number < 2**128
    assert cert.not_valid_before_utc == NOW - dt.timedelta(seconds=60)
    assert cert.not_valid_after_utc == NOW + dt.timedelta(hours=24)
    assert ca.agent_id_from_cert(cert) == "stock-analyst_v2.1"
    assert ca.has_client_auth(cert)


def test_csr_subject_and_extensions_are_ignored(the_ca: tuple[ca.CAPrivateKey, x509.Certificate]) -> None:
    """A CSR asking for another identity or CA:TRUE gets neither: the CA decides the contents."""
    ca_key, ca_cert = the_ca
    key = ca.new_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "admin")]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier("uomp://agent/admin")]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert = ca.issue_agent_cert(ca_key, ca_cert, csr, "bot", now=NOW)
    assert ca.agent_id_from_cert(cert) == "bot"
    assert ext(cert, x509.BasicConstraints).value.ca is False


def test_serials_are_random(the_ca: tuple[ca.CAPrivateKey, x509.Certificate]) -> None:
    ca_key, ca_cert = the_ca
    pub = ca.new_key().public_key()
    serials = {ca.issue_agent_cert(ca_key, ca_cert, pub, "bot", now=NOW).serial_number for _ in range(20)}
    assert len(serials) == 20


BAD_AGENT_IDS = ["", "a/b", "a b", "x" * 129, ".", "..", "a?b", "a#b", "a%2Fb", "uomp://agent/x", "é", "a@b", "a\n"]


@pytest.mark.parametrize("agent_id", BAD_AGENT_IDS)
def test_bad_agent_ids_are_refused(the_ca: tuple[ca.CAPrivateKey, x509.Certificate], agent_id: str) -> None:
    ca_key, ca_cert = the_ca
    with pytest.raises(UompError) as err:
        ca.issue_agent_cert(ca_key, ca_cert, ca.new_key().public_key(), agent_id, now=NOW)
    assert code_of(err) == "CA_ERROR" and "invalid agent id" in err.value.message


def test_longest_agent_id_is_fine(the_ca: tuple[ca.CAPrivateKey, x509.Certificate]) -> None:
    ca_key, ca_cert = the_ca
    cert = ca.issue_agent_cert(ca_key, ca_cert, ca.new_key().public_key(), "a" * 128, now=NOW)
    assert ca.agent_id_from_cert(cert) == "a" * 128
    # CN is limited to 64 characters (RFC 5280): empty subject, so the SAN is critical (§4.2.1.6)
    assert len(cert.subject) == 0 and ext(cert, x509.SubjectAlternativeName).critical
    short = ca.issue_agent_cert(ca_key, ca_cert, ca.new_key().public_key(), "b" * 64, now=NOW)
    assert short.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "b" * 64
    assert not ext(short, x509.SubjectAlternativeName).critical


def _tampered_csr() -> bytes:
    _, pem = csr_for()
    der = bytearray(x509.load_pem_x509_csr(pem).public_bytes(serialization.Encoding.DER))
    der[-5] ^= 0x01  # inside the signature
    return bytes(der)


CSR_REFUSALS = [
    ("bad signature", _tampered_csr, "signature does not verify"),
    (
        "garbage",
        lambda: b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
        "cannot be parsed",
    ),
    ("empty", lambda: b"", "empty"),
    ("too large", lambda: b"x" * (ca.MAX_CSR_BYTES + 1), "larger than"),
    (
        "rsa key",
        lambda: (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bot")]))
            .sign(rsa.generate_private_key(65537, 2048), hashes.SHA256())
            .public_bytes(serialization.Encoding.PEM)
        ),
        "P-256 or Ed25519",
    ),
    (
        "p384 key",
        lambda: (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bot")]))
            .sign(ec.generate_private_key(ec.SECP384R1()), hashes.SHA256())
            .public_bytes(serialization.Encoding.PEM)
        ),
        "P-256 or Ed25519",
    ),
]


@pytest.mark.parametrize(("name", "make", "message"), CSR_REFUSALS, ids=[c[0] for c in CSR_REFUSALS])
def test_bad_csrs_are_refused(
    the_ca: tuple[ca.CAPrivateKey, x509.Certificate], name: str, make: object, message: str
) -> None:
    ca_key, ca_cert = the_ca
    assert callable(make)
    with pytest.raises(UompError) as err:
        ca.issue_agent_cert(ca_key, ca_cert, make(), "bot", now=NOW)
    assert code_of(err) == "CA_ERROR" and message in err.value.message


@pytest.mark.parametrize("lifetime", [dt.timedelta(seconds=30), dt.timedelta(days=91)])
def test_lifetime_bounds(the_ca: tuple[ca.CAPrivateKey, x509.Certificate], lifetime: dt.timedelta) -> None:
    ca_key, ca_cert = the_ca
    with pytest.raises(UompError, match="lifetime"):
        ca.issue_agent_cert(ca_key, ca_cert, ca.new_key().public_key(), "bot", lifetime, now=NOW)


def test_agent_cert_may_not_outlive_the_ca() -> None:
    ca_key, ca_cert = ca.create_ca(now=NOW, validity=dt.timedelta(hours=2))
    with pytest.raises(UompError, match="CA certificate expires"):
        ca.issue_agent_cert(ca_key, ca_cert, ca.new_key().public_key(), "bot", now=NOW)


def _with_sans(
    the_ca: tuple[ca.CAPrivateKey, x509.Certificate], names: list[x509.GeneralName] | None
) -> x509.Certificate:
    ca_key, ca_cert = the_ca
    key = ca.new_key()
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bot")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(NOW)
        .not_valid_after(NOW + dt.timedelta(hours=1))
    )
    if names is not None:
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return b.sign(ca_key, hashes.SHA256())


def test_agent_id_from_cert_needs_exactly_one_agent_uri(the_ca: tuple[ca.CAPrivateKey, x509.Certificate]) -> None:
    uri = x509.UniformResourceIdentifier
    assert ca.agent_id_from_cert(_with_sans(the_ca, None)) is None
    assert ca.agent_id_from_cert(_with_sans(the_ca, [x509.DNSName("bot.example")])) is None
    assert ca.agent_id_from_cert(_with_sans(the_ca, [uri("uomp://agent/a"), uri("uomp://agent/b")])) is None
    assert ca.agent_id_from_cert(_with_sans(the_ca, [uri("uomp://agent/a/../b")])) is None
    assert ca.agent_id_from_cert(_with_sans(the_ca, [uri("uomp://agent/")])) is None
    assert ca.agent_id_from_cert(_with_sans(the_ca, [uri("https://x"), uri("uomp://agent/ok")])) == "ok"


def test_crl_builder(the_ca: tuple[ca.CAPrivateKey, x509.Certificate]) -> None:
    ca_key, ca_cert = the_ca
    revoked_at = NOW - dt.timedelta(hours=1)
    crl = ca.build_crl(ca_key, ca_cert, [(123, revoked_at), (456, NOW)], NOW, number=7)
    assert crl.is_signature_valid(ca_key.public_key())  # type: ignore[arg-type]
    assert ca.crl_number(crl) == 7
    aki = crl.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == ext(ca_cert, x509.SubjectKeyIdentifier).value.digest
    entry = crl.get_revoked_certificate_by_serial_number(123)
    assert entry is not None and entry.revocation_date_utc == revoked_at
    assert crl.next_update_utc == NOW + dt.timedelta(days=7)
    assert crl.last_update_utc == NOW - ca.CLOCK_SKEW
    assert ca.crl_number(ca.build_crl(ca_key, ca_cert, [], NOW)) == int(NOW.timestamp() * 1000)


def test_parse_serial() -> None:
    assert ca.parse_serial("0xAB:CD") == 0xABCD
    for bad in ("", "xyz", "1" * 41):
        with pytest.raises(UompError):
            ca.parse_serial(bad)


# ----------------------------------------------------------------------------- ca_store


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_init_creates_files_with_private_modes(paths: Paths) -> None:
    made = ca_store.init_all(paths, ["gw.example.org"])
    assert made == {"agent CA": True, "gateway server certificate": True, "CRL": True}
    assert _mode(paths.ca_dir) == 0o700
    assert _mode(ca_store.ca_key_path(paths)) == 0o600
    assert _mode(ca_store.server_key_path(paths)) == 0o600
    assert _mode(ca_registry.registry_path(paths)) == 0o600
    key, cert = ca_store.load_ca(paths)
    server = x509.load_pem_x509_certificate(ca_store.server_cert_path(paths).read_bytes())
    server.verify_directly_issued_by(cert)
    assert "gw.example.org" in ca.server_cert_names(server)
    crl = x509.load_pem_x509_crl(ca_store.crl_path(paths).read_bytes())
    assert len(crl) == 0 and crl.is_signature_valid(key.public_key())  # type: ignore[arg-type]
    assert not [p for p in paths.ca_dir.iterdir() if p.name.endswith(".tmp")]


def test_init_never_regenerates_an_existing_ca(ready: Paths) -> None:
    files = [
        ca_store.ca_key_path(ready),
        ca_store.ca_cert_path(ready),
        ca_store.server_cert_path(ready),
        ca_store.server_key_path(ready),
        ca_store.crl_path(ready),
    ]
    before = [f.read_bytes() for f in files]
    assert ca_store.init_ca(ready) is False
    assert ca_store.init_all(ready) == {"agent CA": False, "gateway server certificate": False, "CRL": False}
    assert [f.read_bytes() for f in files] == before


def test_init_adds_hostnames_without_touching_the_ca(ready: Paths) -> None:
    ca_before = ca_store.ca_key_path(ready).read_bytes()
    key_before = ca_store.server_key_path(ready).read_bytes()
    assert ca_store.init_all(ready, ["a.example"])["gateway server certificate"] is True
    assert ca_store.init_all(ready, ["b.example"])["gateway server certificate"] is True
    names = ca.server_cert_names(x509.load_pem_x509_certificate(ca_store.server_cert_path(ready).read_bytes()))
    assert {"a.example", "b.example", "localhost"} <= names  # names are added, never dropped
    assert ca_store.init_all(ready, ["a.example"])["gateway server certificate"] is False
    assert ca_store.ca_key_path(ready).read_bytes() == ca_before
    assert ca_store.server_key_path(ready).read_bytes() == key_before


def test_a_gateway_cert_from_elsewhere_is_left_alone(ready: Paths) -> None:
    other_key, other_ca = ca.create_ca()
    mine = ca.new_key()
    custom = ca.cert_pem(ca.issue_server_cert(other_key, other_ca, mine.public_key(), ["gw.example.org"]))
    ca_store.server_cert_path(ready).write_bytes(custom)
    assert ca_store.init_all(ready, ["new.example"])["gateway server certificate"] is False
    assert ca_store.server_cert_path(ready).read_bytes() == custom


def test_server_cert_near_expiry_is_reissued(ready: Paths) -> None:
    later = ca.utcnow() + dt.timedelta(days=340)
    assert ca_store.init_all(ready, now=later)["gateway server certificate"] is True


BROKEN_FILES = [
    ("ca.key", b"not a key", "KEY_ERROR", "ca.key exists but is not a readable"),
    ("ca.key", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "KEY_ERROR", "ca.key"),
    ("ca.crt", b"not a cert", "CA_ERROR", "ca.crt exists but is not a readable PEM certificate"),
    ("issued.json", b"{nope", "CA_ERROR", "issued.json is not a valid certificate registry"),
]


@pytest.mark.parametrize(
    ("name", "content", "code", "message"), BROKEN_FILES, ids=[f"{n}-{i}" for i, (n, *_rest) in enumerate(BROKEN_FILES)]
)
def test_broken_files_are_clear_errors_never_replaced(
    ready: Paths, name: str, content: bytes, code: str, message: str
) -> None:
    target = ready.ca_dir / name
    target.write_bytes(content)
    for call in (lambda: ca_store.init_all(ready), lambda: ca_store.issue_from_csr(ready, "bot", csr_for()[1])):
        with pytest.raises(UompError) as err:
            call()
        assert code_of(err) == code and message in err.value.message
    assert target.read_bytes() == content


def test_ca_key_readable_by_others_is_refused(ready: Paths) -> None:
    os.chmod(ca_store.ca_key_path(ready), 0o644)
    with pytest.raises(UompError, match="readable by others") as err:
        ca_store.issue_from_csr(ready, "bot", csr_for()[1])
    assert code_of(err) == "KEY_ERROR"


def test_missing_ca_key_with_cert_present_is_refused(ready: Paths) -> None:
    ca_store.ca_key_path(ready).unlink()
    with pytest.raises(UompError, match=r"ca\.key is missing") as err:
        ca_store.init_all(ready)
    assert code_of(err) == "KEY_ERROR"
    assert not ca_store.ca_key_path(ready).exists()


def test_missing_ca_cert_is_remade_from_the_same_key(ready: Paths, tmp_path: Path) -> None:
    files = ca_store.issue_with_key(ready, "bot", tmp_path / "bot")
    key_before = ca_store.ca_key_path(ready).read_bytes()
    ca_store.ca_cert_path(ready).unlink()
    assert ca_store.init_all(ready)["agent CA"] is False
    assert ca_store.ca_key_path(ready).read_bytes() == key_before
    _, remade = ca_store.load_ca(ready)
    x509.load_pem_x509_certificate(files.cert_file.read_bytes()).verify_directly_issued_by(remade)


def test_issue_before_init_is_a_clear_error(paths: Paths) -> None:
    with pytest.raises(UompError, match=r"no CA in .*uomp ca init"):
        ca_store.issue_from_csr(paths, "bot", csr_for()[1])


def test_issue_from_csr_round_trip(ready: Paths) -> None:
    key, csr = csr_for("bot")
    pem = ca_store.issue_from_csr(ready, "bot", csr, dt.timedelta(hours=2))
    cert = x509.load_pem_x509_certificate(pem)
    cert.verify_directly_issued_by(ca_store.load_ca_cert(ready))
    assert cert.public_key() == key.public_key()
    assert ca.agent_id_from_cert(cert) == "bot"
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(hours=2, seconds=60)
    rows = ca_store.list_agents(ready)
    assert [(r.agent_id, r.serial, r.status) for r in rows] == [("bot", ca.serial_hex(cert.serial_number), "active")]


def test_issue_with_key_writes_files_and_reuses_the_key(ready: Paths, tmp_path: Path) -> None:
    out = tmp_path / "agents" / "bot"
    first = ca_store.issue_with_key(ready, "bot", out, key_type="ed25519")
    assert first.new_key
    assert _mode(out) == 0o700 and _mode(first.key_file) == 0o600
    assert first.ca_file.read_bytes() == ca_store.ca_cert_path(ready).read_bytes()
    key_pem = first.key_file.read_bytes()
    second = ca_store.issue_with_key(ready, "bot", out)
    assert not second.new_key and second.serial != first.serial
    assert first.key_file.read_bytes() == key_pem
    cert = x509.load_pem_x509_certificate(second.cert_file.read_bytes())
    assert isinstance(cert.public_key(), ed25519.Ed25519PublicKey)


def test_issue_with_unreadable_existing_agent_key_is_key_error(ready: Paths, tmp_path: Path) -> None:
    out = tmp_path / "bot"
    out.mkdir()
    (out / "agent.key").write_bytes(b"junk")
    os.chmod(out / "agent.key", 0o600)
    with pytest.raises(UompError, match=r"agent\.key exists but") as err:
        ca_store.issue_with_key(ready, "bot", out)
    assert code_of(err) == "KEY_ERROR" and (out / "agent.key").read_bytes() == b"junk"


# -------------------------------------------------------------------------------- renewal


def test_renew_keeps_agent_and_key(ready: Paths) -> None:
    _, csr = csr_for("bot")
    old = ca_store.issue_from_csr(ready, "bot", csr)
    due = ca.utcnow() + dt.timedelta(hours=17)  # in the last third of its 24 h
    new_pem = ca_store.renew(ready, old, None, dt.timedelta(hours=1), now=due)
    new = x509.load_pem_x509_certificate(new_pem)
    old_cert = x509.load_pem_x509_certificate(old)
    assert ca.agent_id_from_cert(new) == "bot"
    assert new.public_key() == old_cert.public_key()
    assert new.serial_number != old_cert.serial_number
    # DER works too, and a CSR rotates the key
    key2, csr2 = csr_for("whatever-the-csr-says")
    rotated = x509.load_pem_x509_certificate(
        ca_store.renew(ready, old_cert.public_bytes(serialization.Encoding.DER), csr2, now=due)
    )
    assert rotated.public_key() == key2.public_key() and ca.agent_id_from_cert(rotated) == "bot"
    rows = ca_store.list_agents(ready, now=due)
    assert {r.renewed_from for r in rows} == {None, ca.serial_hex(old_cert.serial_number)}


def test_renew_refusals(ready: Paths, tmp_path: Path) -> None:
    now = ca.utcnow()
    _, csr = csr_for("bot")
    expired = ca_store.issue_from_csr(ready, "bot", csr, dt.timedelta(hours=1), now=now - dt.timedelta(hours=3))
    revoked = ca_store.issue_from_csr(ready, "gone", csr)
    ca_store.revoke(ready, "gone")
    other_key, other_ca = ca.create_ca()
    foreign = ca.cert_pem(ca.issue_agent_cert(other_key, other_ca, x509.load_pem_x509_csr(csr), "bot"))
    ca_key, ca_cert = ca_store.load_ca(ready)
    unregistered = ca.cert_pem(ca.issue_agent_cert(ca_key, ca_cert, x509.load_pem_x509_csr(csr), "bot"))
    gateway = ca_store.server_cert_path(ready).read_bytes()
    cases = [
        (expired, "renewal refused: the presented certificate has expired"),
        (revoked, "was revoked"),
        (foreign, "renewal refused: the presented certificate was not issued by this CA"),
        (unregistered, "is not in this CA's registry"),
        (gateway, "renewal refused: the presented certificate is not an agent certificate"),
        (b"junk", "the certificate cannot be parsed"),
    ]
    for presented, message in cases:
        with pytest.raises(UompError) as err:
            ca_store.renew(ready, presented, None, now=now + dt.timedelta(hours=20))
        assert code_of(err) == "CA_ERROR", message
        assert message in err.value.message


# ------------------------------------------------------------------------------- revoking


def _crl(paths: Paths) -> x509.CertificateRevocationList:
    return x509.load_pem_x509_crl(ca_store.crl_path(paths).read_bytes())


def test_revoke_by_agent_revokes_all_active(ready: Paths) -> None:
    serials = [
        ca.serial_hex(x509.load_pem_x509_certificate(ca_store.issue_from_csr(ready, "bot", csr_for()[1])).serial_number)
        for _ in range(3)
    ]
    ca_store.issue_from_csr(ready, "other", csr_for()[1])
    n0 = ca.crl_number(_crl(ready))
    assert sorted(ca_store.revoke(ready, "bot")) == sorted(serials)
    crl = _crl(ready)
    assert {ca.serial_hex(r.serial_number) for r in crl} == set(serials)
    assert ca.crl_number(crl) > n0
    assert crl.is_signature_valid(ca_store.load_ca(ready)[0].public_key())  # type: ignore[arg-type]
    assert ca_store.revoked_serials(ready) == {int(s, 16) for s in serials}
    # again: nothing new, but the CRL is re-signed with a higher number
    assert ca_store.revoke(ready, "bot") == []
    assert ca.crl_number(_crl(ready)) > ca.crl_number(crl)
    statuses = {(r.agent_id, r.status) for r in ca_store.list_agents(ready)}
    assert statuses == {("bot", "revoked"), ("other", "active")}


def test_revoke_by_serial_and_ambiguity(ready: Paths) -> None:
    cert = x509.load_pem_x509_certificate(ca_store.issue_from_csr(ready, "bot", csr_for()[1]))
    keep = ca_store.issue_from_csr(ready, "bot", csr_for()[1])
    serial = ca.serial_hex(cert.serial_number)
    assert ca_store.revoke(ready, serial.upper()) == [serial]
    assert ca_store.revoked_serials(ready) == {cert.serial_number}
    assert x509.load_pem_x509_certificate(keep).serial_number not in ca_store.revoked_serials(ready)
    # an agent whose id is also a hex serial of another agent's certificate
    twin = x509.load_pem_x509_certificate(ca_store.issue_from_csr(ready, "other", csr_for()[1]))
    twin_hex = ca.serial_hex(twin.serial_number)
    ca_store.issue_from_csr(ready, twin_hex, csr_for()[1])
    with pytest.raises(UompError, match="both an agent id and a serial"):
        ca_store.revoke(ready, twin_hex)
    assert ca_store.revoke(ready, f"serial:{twin_hex}") == [twin_hex]
    assert len(ca_store.revoke(ready, f"agent:{twin_hex}")) == 1
    with pytest.raises(UompError, match="no certificate issued"):
        ca_store.revoke(ready, "nobody")
    with pytest.raises(UompError, match="hex digits"):
        ca_store.revoke(ready, "serial:nothex")


def test_revoke_by_serial_prefix_as_listed(ready: Paths) -> None:
    certs = [x509.load_pem_x509_certificate(ca_store.issue_from_csr(ready, "bot", csr_for()[1])) for _ in range(40)]
    serials = [ca.serial_hex(c.serial_number) for c in certs]
    unique = next(s for s in serials if sum(x.startswith(s[:6]) for x in serials) == 1)
    assert ca_store.revoke(ready, f"serial:{unique[:6]}…") == [unique]  # `uomp agent list` shows `3f…`
    assert ca_store.revoke(ready, f"{unique[:8].upper()}") == []  # bare, case-blind: found, already revoked
    # two certificates share a 1-digit prefix among 40 for sure; 4 digits are the least accepted
    shared = next(p for p in "0123456789abcdef" if sum(x.startswith(p) for x in serials) > 1)
    with pytest.raises(UompError, match="no certificate issued"):
        ca_store.revoke(ready, f"serial:{shared}")  # one digit is not a prefix search
    # issue until two serials share 4 digits (a birthday: ~300 certificates), then that prefix is ambiguous
    csr = csr_for()[1]
    fours: dict[str, list[str]] = {}
    for x in serials:
        fours.setdefault(x[:4], []).append(x)
    while all(len(v) < 2 for v in fours.values()) and len(fours) < 3000:
        x = ca.serial_hex(x509.load_pem_x509_certificate(ca_store.issue_from_csr(ready, "bot", csr)).serial_number)
        fours.setdefault(x[:4], []).append(x)
    prefix, hits = next((p, h) for p, h in fours.items() if len(h) > 1)
    with pytest.raises(UompError, match=f"matches {len(hits)} certificates"):
        ca_store.revoke(ready, f"serial:{prefix}")
    assert ca_store.revoke(ready, f"serial:{hits[0][:12]}") == [hits[0]]  # more digits: the one meant
    with pytest.raises(UompError, match="no certificate issued"):
        ca_store.revoke(ready, "serial:ffffffffffffff")
    assert {ca.serial_hex(r.serial_number) for r in _crl(ready)} == {unique, hits[0]}


def test_list_agents_marks_expired(ready: Paths) -> None:
    ca_store.issue_from_csr(ready, "old", csr_for()[1], dt.timedelta(hours=1), now=ca.utcnow() - dt.timedelta(hours=2))
    ca_store.issue_from_csr(ready, "new", csr_for()[1])
    assert [(r.agent_id, r.status) for r in ca_store.list_agents(ready)] == [("new", "active"), ("old", "expired")]


def test_registry_drops_long_expired_rows_and_crl_drops_expired_entries(ready: Paths) -> None:
    now = ca.utcnow()
    ca_store.issue_from_csr(ready, "ancient", csr_for()[1], dt.timedelta(hours=1), now=now - dt.timedelta(days=40))
    ca_store.issue_from_csr(ready, "stale", csr_for()[1], dt.timedelta(hours=1), now=now - dt.timedelta(days=3))
    ca_store.revoke(ready, "stale", now=now - dt.timedelta(days=3))
    assert len(_crl(ready)) == 1
    ca_store.issue_from_csr(ready, "fresh", csr_for()[1])
    ca_store.revoke(ready, "fresh")
    assert {r.agent_id for r in ca_store.list_agents(ready)} == {"stale", "fresh"}
    assert len(_crl(ready)) == 1  # "stale" expired more than a day ago: no CRL entry needed


def test_refresh_crl_only_when_due(ready: Paths) -> None:
    before = ca_store.crl_path(ready).read_bytes()
    assert ca_store.refresh_crl(ready) is False
    assert ca_store.crl_path(ready).read_bytes() == before
    assert ca_store.refresh_crl(ready, now=ca.utcnow() + dt.timedelta(days=4)) is True
    assert ca_store.crl_path(ready).read_bytes() != before
    ca_store.crl_path(ready).unlink()
    assert ca_store.refresh_crl(ready) is True and ca_store.crl_path(ready).exists()


def test_refresh_crl_repairs_a_crl_behind_the_registry(ready: Paths) -> None:
    cert = x509.load_pem_x509_certificate(ca_store.issue_from_csr(ready, "bot", csr_for()[1]))
    old_crl = ca_store.crl_path(ready).read_bytes()
    ca_store.revoke(ready, "bot")
    ca_store.crl_path(ready).write_bytes(old_crl)  # as if we crashed between registry and CRL writes
    assert ca_store.refresh_crl(ready) is True
    assert cert.serial_number in ca_store.revoked_serials(ready)


def test_concurrent_issuance_and_revocation_lose_nothing(ready: Paths) -> None:
    ca_store.issue_from_csr(ready, "pre", csr_for()[1])
    csrs = [csr_for()[1] for _ in range(24)]
    errors: list[BaseException] = []

    def issue(base: int) -> None:
        try:
            for j in range(base, base + 6):
                ca_store.issue_from_csr(ready, f"a{j}", csrs[j])
        except BaseException as exc:
            errors.append(exc)

    def revoke() -> None:
        try:
            for _ in range(3):
                ca_store.revoke(ready, "pre")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=issue, args=(i,)) for i in range(0, 24, 6)]
    threads.append(threading.Thread(target=revoke))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    rows = ca_store.list_agents(ready)
    assert len(rows) == 25 and {r.agent_id for r in rows} == {"pre", *(f"a{i}" for i in range(24))}
    assert len(ca_store.revoked_serials(ready)) == 1


# ------------------------------------------------------------------------------------ CLI


def test_cli_init_hook_and_agent_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "h"
    assert main(["--home", str(home), "init"]) == 0
    out = capsys.readouterr().out
    assert "agent CA: created" in out and "gateway server certificate: created" in out
    assert (home / "ca" / "ca.key").exists() and (home / "ca" / "crl.pem").exists()
    assert main(["--home", str(home), "ca", "init", "--hostname", "gw.example.org"]) == 0
    assert "agent CA: kept" in capsys.readouterr().out

    assert (
        main(["--home", str(home), "agent", "issue", "bot", "--out", str(tmp_path / "bot"), "--lifetime-hours", "2"])
        == 0
    )
    assert "agent.key" in capsys.readouterr().out
    _, csr = csr_for("bot2")
    (tmp_path / "bot2.csr").write_bytes(csr)
    assert (
        main(
            [
                "--home",
                str(home),
                "agent",
                "issue",
                "bot2",
                "--csr",
                str(tmp_path / "bot2.csr"),
                "--cert-out",
                str(tmp_path / "bot2.crt"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert ca.agent_id_from_cert(x509.load_pem_x509_certificate((tmp_path / "bot2.crt").read_bytes())) == "bot2"
    assert main(["--home", str(home), "agent", "issue", "bot2", "--csr", str(tmp_path / "bot2.csr")]) == 0
    assert capsys.readouterr().out.startswith("-----BEGIN CERTIFICATE-----")

    assert main(["--home", str(home), "agent", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["agent_id"] for r in rows) == ["bot", "bot2", "bot2"]
    assert main(["--home", str(home), "agent", "revoke", "bot"]) == 0
    assert "revoked " in capsys.readouterr().out
    assert main(["--home", str(home), "agent", "list"]) == 0
    table = capsys.readouterr().out
    assert "revoked" in table and "active" in table

    assert main(["--home", str(home), "agent", "issue", "a/b", "--out", str(tmp_path / "x")]) == 1
    assert "CA_ERROR" in capsys.readouterr().err
    assert (
        main(
            ["--home", str(home), "agent", "issue", "bot", "--out", str(tmp_path / "bot"), "--lifetime-hours", "100000"]
        )
        == 1
    )
    assert "lifetime" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --csr and --out are exclusive, one is required
        main(["--home", str(home), "agent", "issue", "bot"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_generate_gateway_certs_script(tmp_path: Path) -> None:
    env = {**os.environ, "UOMP_HOME": str(tmp_path / "home")}
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "generate-gateway-certs.sh"), "demo-agent", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "demo" / "agent.crt").exists() and (tmp_path / "demo" / "ca.crt").exists()
    assert _mode(tmp_path / "demo" / "agent.key") == 0o600
    assert str(tmp_path / "home" / "ca" / "gateway.crt") in out.stdout
