"""Publisher verification by did:web (a DID document over HTTPS from a loopback server with a CA
made here) and by X.509 (a code-signing certificate chaining to a CA in the trust list), each
state with its refusals, through verify_publisher and through `uomp authorize`."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from registrykit import DocServer

from gateway import trust
from gateway.cli.main import main
from gateway.config import Paths
from gateway.core import dataintegrity, jose
from gateway.core.didkey import b58btc_encode
from gateway.core.publisher import manifest_signing_input
from gateway.identity import x509pub
from gateway.identity.verify import verify_publisher
from gateway.keys import init_home
from gateway.registry.fetch import FetchPolicy

ROOT = Path(__file__).resolve().parents[2]
MANIFEST: dict[str, Any] = json.loads((ROOT / "examples" / "calendar_agent" / "uom.json").read_text())


@pytest.fixture
def docs(tmp_path: Path) -> Iterator[DocServer]:
    server = DocServer(tmp_path)
    yield server
    server.close()


@pytest.fixture
def home(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "home")
    init_home(paths)
    return paths


def policy(docs: DocServer, **kw: Any) -> FetchPolicy:
    return FetchPolicy(**{"allow_internal": True, "ca_file": docs.ca_file, "timeout_s": 5.0, **kw})


# ------------------------------------------------------------------------------ did:web


def did_of(docs: DocServer, path: str = "") -> str:
    return f"did:web:127.0.0.1%3A{docs.port}" + (":" + path.replace("/", ":") if path else "")


def did_document(did: str, pub: ed25519.Ed25519PublicKey, *, form: str = "multikey") -> dict[str, Any]:
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    vm: dict[str, Any] = {"id": f"{did}#key-1", "controller": did}
    if form == "multikey":
        vm.update(type="Multikey", publicKeyMultibase="z" + b58btc_encode(b"\xed\x01" + raw))
    elif form == "jwk":
        vm.update(type="JsonWebKey2020", publicKeyJwk={"kty": "OKP", "crv": "Ed25519", "x": jose.b64u_encode(raw)})
    return {"id": did, "verificationMethod": [vm], "assertionMethod": [f"{did}#key-1"]}


def sign_did_web(manifest: dict[str, Any], key: ed25519.Ed25519PrivateKey, did: str) -> dict[str, Any]:
    doc = copy.deepcopy(manifest)
    doc["identity"] = {"did": did, "verification_methods": ["did"]}
    options = {
        "created": "2026-12-01T00:00:00Z",
        "verificationMethod": f"{did}#key-1",
        "proofPurpose": "assertionMethod",
    }
    doc["identity"]["proof"] = dataintegrity.sign_proof(doc, options, key)
    return doc


def serve_did(docs: DocServer, did_doc: dict[str, Any], path: str = "") -> None:
    docs.put(f"/{path}/did.json" if path else "/.well-known/did.json", json.dumps(did_doc).encode())


@pytest.mark.parametrize("form", ["multikey", "jwk"])
@pytest.mark.parametrize("path", ["", "pub/acme"])
def test_did_web_verifies_then_is_trusted_once_in_the_list(docs: DocServer, home: Paths, form: str, path: str) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    did = did_of(docs, path)
    serve_did(docs, did_document(did, key.public_key(), form=form), path)
    signed = sign_did_web(MANIFEST, key, did)
    got = verify_publisher(signed, trust.load(home), policy(docs))
    assert got.verified and got.method == "did:web" and got.trust_entry is None
    assert got.public_key is not None
    trust.add(home, did, "Acme")
    got = verify_publisher(signed, trust.load(home), policy(docs))
    assert got.verified and got.trust_entry is not None and got.trust_entry.name == "Acme"


def _other_type(did: str, key: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    p256 = ec.generate_private_key(ec.SECP256R1()).public_key()
    nums = p256.public_numbers()
    jwk = {
        "kty": "EC",
        "crv": "P-256",
        "x": jose.b64u_encode(nums.x.to_bytes(32, "big")),
        "y": jose.b64u_encode(nums.y.to_bytes(32, "big")),
    }
    doc = did_document(did, key.public_key())
    doc["verificationMethod"][0] = {
        "id": f"{did}#key-1",
        "type": "JsonWebKey2020",
        "controller": did,
        "publicKeyJwk": jwk,
    }
    return doc


def _secp256k1_multikey(did: str, key: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    doc = did_document(did, key.public_key())
    doc["verificationMethod"][0]["publicKeyMultibase"] = "z" + b58btc_encode(b"\xe7\x01" + b"\x02" * 33)
    return doc


def _not_assertion(did: str, key: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    doc = did_document(did, key.public_key())
    doc["assertionMethod"] = []
    doc["authentication"] = [f"{did}#key-1"]
    return doc


def _other_did(did: str, key: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    doc = did_document(did, key.public_key())
    doc["id"] = "did:web:elsewhere.example"
    return doc


def _other_key(did: str, key: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    return did_document(did, ed25519.Ed25519PrivateKey.generate().public_key())


def _other_controller(did: str, key: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    doc = did_document(did, key.public_key())
    doc["verificationMethod"][0]["controller"] = "did:web:elsewhere.example"
    return doc


@pytest.mark.parametrize(
    ("make", "why"),
    [
        pytest.param(_other_type, "another type than Ed25519", id="p256-jwk"),
        pytest.param(_secp256k1_multikey, "another type than Ed25519", id="secp256k1-multikey"),
        pytest.param(_not_assertion, "not in the DID document's assertionMethod", id="not-assertion"),
        pytest.param(_other_did, "for another DID", id="other-did"),
        pytest.param(_other_key, "signature does not verify", id="other-key"),
        pytest.param(_other_controller, "controlled by another DID", id="other-controller"),
    ],
)
def test_did_web_refusals(docs: DocServer, home: Paths, make: Any, why: str) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    did = did_of(docs)
    serve_did(docs, make(did, key))
    trust.add(home, did, "Acme")  # trusted or not, a bad document never verifies
    got = verify_publisher(sign_did_web(MANIFEST, key, did), trust.load(home), policy(docs))
    assert not got.verified and got.trust_entry is None and got.public_key is None
    assert why in got.reason


def test_did_web_signature_over_other_bytes_and_fetch_rules(docs: DocServer, home: Paths) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    did = did_of(docs)
    serve_did(docs, did_document(did, key.public_key()))
    signed = sign_did_web(MANIFEST, key, did)
    assert verify_publisher(signed, trust.load(home), policy(docs)).verified
    altered = copy.deepcopy(signed)
    altered["requested_scopes"]["read"]["tags"] = ["financial"]
    got = verify_publisher(altered, trust.load(home), policy(docs))
    assert not got.verified and "signature does not verify" in got.reason
    # the same document, not reachable under the rules: unverified, never an exception
    for pol, why in (
        (FetchPolicy(ca_file=docs.ca_file), "non-public address"),
        (FetchPolicy(allow_internal=True), "TLS certificate not trusted"),
    ):
        got = verify_publisher(signed, trust.load(home), pol)
        assert not got.verified and why in got.reason
    docs.docs.clear()
    got = verify_publisher(signed, trust.load(home), policy(docs))
    assert not got.verified and "HTTP 404" in got.reason


def test_authorize_shows_did_web_states(
    docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UOMP_REGISTRY_CA_FILE", str(docs.ca_file))
    monkeypatch.setenv("UOMP_REGISTRY_ALLOW_INTERNAL", "true")
    key = ed25519.Ed25519PrivateKey.generate()
    did = did_of(docs)
    serve_did(docs, did_document(did, key.public_key()))
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "uom.json").write_text(json.dumps(sign_did_web(MANIFEST, key, did)))
    args = ["--home", str(home.home), "authorize", str(agent), "--yes", "--print", "--allow-local"]
    assert main([*args, "--require-verified"]) == 1
    out = capsys.readouterr()
    assert "SIGNED BY A KEY YOU HAVE NEVER TRUSTED" in out.out and did in out.out
    assert "error ACCESS_DENIED" in out.err
    assert main(["--home", str(home.home), "trust", "add", did, "--name", "Acme Corp"]) == 0
    assert main([*args, "--require-verified"]) == 0
    assert f"Publisher: Acme Corp (signed by a key in your trust list: {did})" in capsys.readouterr().out
    # the web site now publishes another key: the same manifest is unverified again
    serve_did(docs, did_document(did, ed25519.Ed25519PrivateKey.generate().public_key()))
    assert main([*args, "--require-verified"]) == 1
    assert "UNVERIFIED PUBLISHER" in capsys.readouterr().out


# ------------------------------------------------------------------------------ X.509


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str = "Publisher Root CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    leaf_key: Any,
    *,
    eku: list[x509.ObjectIdentifier] | None = None,
    expired: bool = False,
    digital_signature: bool = True,
    is_ca: bool = False,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    start, end = (
        (now - dt.timedelta(days=30), now - dt.timedelta(days=1))
        if expired
        else (now - dt.timedelta(hours=1), now + dt.timedelta(days=30))
    )
    b = (
        x509.CertificateBuilder()
        .subject_name(_name("Example Publisher Ltd"))
        .issuer_name(ca_cert.subject)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature, False, False, False, False, is_ca, False, False, False), critical=True
        )
        .add_extension(
            x509.ExtendedKeyUsage(eku if eku is not None else [ExtendedKeyUsageOID.CODE_SIGNING]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(leaf_key.public_key()), critical=False)
    )
    return b.sign(ca_key, hashes.SHA256())


def sign_x509(manifest: dict[str, Any], leaf_key: Any, chain: list[x509.Certificate]) -> dict[str, Any]:
    doc = copy.deepcopy(manifest)
    x5c = [base64.b64encode(c.public_bytes(serialization.Encoding.DER)).decode() for c in chain]
    doc["identity"] = {
        "verification_methods": ["x509"],
        "proof": {"type": x509pub.PROOF_TYPE, "created": "2026-12-01T00:00:00Z", "x5c": x5c},
    }
    data = manifest_signing_input(doc)
    if isinstance(leaf_key, ed25519.Ed25519PrivateKey):
        sig = leaf_key.sign(data)
    else:
        sig = leaf_key.sign(data, ec.ECDSA(hashes.SHA256()))
    doc["identity"]["proof"]["proofValue"] = jose.b64u_encode(sig)
    return doc


def trust_ca(home: Paths, cert: x509.Certificate, name: str = "Corp CA") -> None:
    trust.add_entry(home, x509pub.ca_entry(cert.public_bytes(serialization.Encoding.PEM), name))


@pytest.mark.parametrize("leaf_type", ["ed25519", "p256"])
def test_x509_chain_to_a_trusted_ca_verifies(home: Paths, leaf_type: str) -> None:
    ca_key, ca_cert = make_ca()
    leaf_key: Any = (
        ed25519.Ed25519PrivateKey.generate() if leaf_type == "ed25519" else ec.generate_private_key(ec.SECP256R1())
    )
    signed = sign_x509(MANIFEST, leaf_key, [make_leaf(ca_key, ca_cert, leaf_key)])
    # denied partner first: the same manifest while no CA is trusted
    got = verify_publisher(signed, trust.load(home), FetchPolicy())
    assert not got.verified and "no CA is in your trust list" in got.reason
    trust_ca(home, ca_cert)
    got = verify_publisher(signed, trust.load(home), FetchPolicy())
    assert got.verified and got.method == "x509" and got.trust_entry is not None
    assert got.trust_entry.name == "Corp CA" and "Example Publisher Ltd" in (got.subject or "")
    # the identity key for deletion proofs: the leaf's, when it is Ed25519
    assert (got.public_key is not None) == (leaf_type == "ed25519")


def _x509_case(case: str) -> tuple[dict[str, Any], x509.Certificate]:
    ca_key, ca_cert = make_ca()
    leaf_key = ed25519.Ed25519PrivateKey.generate()
    if case == "other-ca":
        other_key, other_cert = make_ca("Someone Else CA")
        return sign_x509(MANIFEST, leaf_key, [make_leaf(other_key, other_cert, leaf_key)]), ca_cert
    kw: dict[str, Any] = {
        "expired": {"expired": True},
        "server-eku": {"eku": [ExtendedKeyUsageOID.SERVER_AUTH]},
        "client-eku": {"eku": [ExtendedKeyUsageOID.CLIENT_AUTH]},
        "no-digital-signature": {"digital_signature": False},
        "leaf-is-ca": {"is_ca": True},
    }.get(case, {})
    signed = sign_x509(MANIFEST, leaf_key, [make_leaf(ca_key, ca_cert, leaf_key, **kw)])
    if case == "other-bytes":
        signed["agent"]["name"] = "Calendar Assistant Pro"
    if case == "other-signer":
        stranger = ed25519.Ed25519PrivateKey.generate()
        again = sign_x509(MANIFEST, stranger, [make_leaf(ca_key, ca_cert, leaf_key)])
        signed = again
    return signed, ca_cert


@pytest.mark.parametrize(
    ("case", "why"),
    [
        pytest.param("other-ca", "does not verify against your trusted CAs", id="other-ca"),
        pytest.param("expired", "does not verify against your trusted CAs", id="expired"),
        pytest.param("server-eku", "not for code signing", id="server-eku"),
        pytest.param("client-eku", "not for code signing", id="client-eku"),
        pytest.param("no-digital-signature", "does not allow digital signatures", id="no-digital-signature"),
        pytest.param("leaf-is-ca", "does not verify against your trusted CAs", id="leaf-is-ca"),
        pytest.param("other-bytes", "signature does not verify", id="other-bytes"),
        pytest.param("other-signer", "signature does not verify", id="other-signer"),
    ],
)
def test_x509_refusals(home: Paths, case: str, why: str) -> None:
    signed, ca_cert = _x509_case(case)
    trust_ca(home, ca_cert)
    got = verify_publisher(signed, trust.load(home), FetchPolicy())
    assert not got.verified and got.trust_entry is None
    assert why in got.reason, got.reason


def test_authorize_with_a_trusted_ca(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca_key, ca_cert = make_ca()
    leaf_key = ed25519.Ed25519PrivateKey.generate()
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "uom.json").write_text(json.dumps(sign_x509(MANIFEST, leaf_key, [make_leaf(ca_key, ca_cert, leaf_key)])))
    args = [
        "--home",
        str(home.home),
        "authorize",
        str(agent),
        "--yes",
        "--print",
        "--allow-local",
        "--require-verified",
    ]
    assert main(args) == 1
    out = capsys.readouterr()
    assert "UNVERIFIED PUBLISHER: no CA is in your trust list" in out.out and "error ACCESS_DENIED" in out.err
    pem = tmp_path / "ca.pem"
    pem.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    assert main(["--home", str(home.home), "trust", "add-ca", str(pem), "--name", "Corp CA"]) == 0
    assert main(args) == 0
    assert (
        "Publisher: Corp CA (verified, x509: manifest signed by the code-signing certificate" in capsys.readouterr().out
    )
    # a leaf certificate is not a CA: refused when added as one
    leaf_pem = tmp_path / "leaf.pem"
    leaf_pem.write_bytes(make_leaf(ca_key, ca_cert, leaf_key).public_bytes(serialization.Encoding.PEM))
    assert main(["--home", str(home.home), "trust", "add-ca", str(leaf_pem), "--name", "X"]) == 1
    assert "not a CA certificate" in capsys.readouterr().err


def test_trust_require_policy_gives_no_session_to_other_publishers(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[trust] require = ["x509"]: a did:key publisher in the trust list is refused (no session made),
    an X.509 publisher chaining to a trusted CA is granted."""
    from gateway.core.manifest import sign_manifest

    home.config_file.parent.mkdir(parents=True, exist_ok=True)
    home.config_file.write_text('[trust]\nrequire = ["x509"]\n')
    key = ed25519.Ed25519PrivateKey.generate()
    signed = sign_manifest(MANIFEST, key)
    trust.add(home, signed["identity"]["did"], "Key Publisher")
    by_key = tmp_path / "by-key"
    by_key.mkdir()
    (by_key / "uom.json").write_text(json.dumps(signed))
    h = ["--home", str(home.home)]
    assert main([*h, "authorize", str(by_key), "--yes", "--print", "--allow-local"]) == 1
    err = capsys.readouterr().err
    assert "error ACCESS_DENIED" in err and "verified by did:key" in err and "no session is created" in err
    assert main([*h, "sessions", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    ca_key, ca_cert = make_ca()
    leaf_key = ed25519.Ed25519PrivateKey.generate()
    by_ca = tmp_path / "by-ca"
    by_ca.mkdir()
    (by_ca / "uom.json").write_text(json.dumps(sign_x509(MANIFEST, leaf_key, [make_leaf(ca_key, ca_cert, leaf_key)])))
    assert main([*h, "authorize", str(by_ca), "--yes", "--print", "--allow-local"]) == 1  # CA not trusted yet
    assert "not verified against your trust list" in capsys.readouterr().err
    trust_ca(home, ca_cert)
    assert main([*h, "authorize", str(by_ca), "--yes", "--print", "--allow-local"]) == 0
    # a setting naming no method this version knows is refused, not ignored
    home.config_file.write_text('[trust]\nrequire = ["blockchain"]\n')
    assert main([*h, "authorize", str(by_ca), "--yes", "--print", "--allow-local"]) == 1
    assert "error CONFIG_ERROR" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the dashboard's enrollment view


def test_dashboard_enrollment_view_checks_x509_as_approve_does(home: Paths) -> None:
    """The agents page shows an X.509-signed manifest as ``uomp requests approve`` would check it: unverified
    until its CA is trusted, then trusted by the CA's name; another CA's chain stays unverified."""
    from gateway.core import manifest
    from gateway.dashboard.enroll_view import publisher_view

    ca_key, ca_cert = make_ca()
    leaf_key = ed25519.Ed25519PrivateKey.generate()
    signed = manifest.parse_manifest(
        json.dumps(sign_x509(MANIFEST, leaf_key, [make_leaf(ca_key, ca_cert, leaf_key)])).encode()
    )
    state, text = publisher_view(signed, home)
    assert state == "unverified" and "no CA is in your trust list" in text
    other_key, other_cert = make_ca("Someone Else CA")
    foreign = manifest.parse_manifest(
        json.dumps(sign_x509(MANIFEST, leaf_key, [make_leaf(other_key, other_cert, leaf_key)])).encode()
    )
    trust_ca(home, ca_cert)
    assert publisher_view(signed, home) == ("trusted", "Corp CA (verified, x509: in your trust list)")
    state, text = publisher_view(foreign, home)
    assert state == "unverified" and "does not verify against your trusted CAs" in text


def test_dashboard_enrollment_view_never_fetches_a_did_web_document(docs: DocServer, home: Paths) -> None:
    """Rendering the page fetches nothing: a did:web publisher is "unchecked" there (its document is served and
    would verify), and checked at approval time; a did:key manifest is still checked on the page."""
    from gateway.core import manifest
    from gateway.dashboard.enroll_view import publisher_view

    key = ed25519.Ed25519PrivateKey.generate()
    did = did_of(docs)
    serve_did(docs, did_document(did, key.public_key()))
    signed = manifest.parse_manifest(json.dumps(sign_did_web(MANIFEST, key, did)).encode())
    state, text = publisher_view(signed, home)
    assert state == "unchecked" and did in text and "when you approve" in text
    assert docs.hits == {}
    assert verify_publisher(signed.raw, trust.load(home), policy(docs)).verified  # the approval's check passes
    plain = manifest.parse_manifest((ROOT / "examples" / "calendar_agent" / "uom.json").read_bytes())
    assert publisher_view(plain, home)[0] in ("unverified", "untrusted")
