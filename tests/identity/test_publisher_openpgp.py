"""OpenPGP publishers (Sequoia-PGP through pysequoia): a detached signature over the manifest by a
key in the trust list verifies; other bytes, another key, a key not trusted, a revoked key do not."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from gateway import trust
from gateway.cli.main import main
from gateway.config import Paths
from gateway.core import jose
from gateway.core.publisher import manifest_signing_input
from gateway.identity import openpgp
from gateway.identity.verify import verify_publisher
from gateway.keys import init_home
from gateway.registry.fetch import FetchPolicy

pysequoia = pytest.importorskip("pysequoia")

ROOT = Path(__file__).resolve().parents[2]
MANIFEST: dict[str, Any] = json.loads((ROOT / "examples" / "calendar_agent" / "uom.json").read_text())


@pytest.fixture
def home(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "home")
    init_home(paths)
    return paths


class Publisher:
    def __init__(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.tsk = pysequoia.Tsk.generate("Example Publisher <pub@example.com>")
            self.public = str(self.tsk.extract_certificate())
        self.cert = pysequoia.Cert.from_bytes(self.public.encode())
        self.fpr = str(self.cert.fingerprint).lower()

    def sign(self, manifest: dict[str, Any], *, fingerprint: str | None = None) -> dict[str, Any]:
        doc = copy.deepcopy(manifest)
        doc["identity"] = {
            "verification_methods": ["gpg"],
            "proof": {
                "type": openpgp.PROOF_TYPE,
                "created": "2026-12-01T00:00:00Z",
                "fingerprint": fingerprint or self.fpr,
            },
        }
        sig = pysequoia.sign(
            self.tsk.signer(), manifest_signing_input(doc), mode=pysequoia.SignatureMode.DETACHED, armor=False
        )
        doc["identity"]["proof"]["proofValue"] = jose.b64u_encode(sig)
        return doc

    def revoked_public(self) -> str:
        rev = self.cert.revoke(self.tsk.certifier())
        return str(pysequoia.Cert.from_bytes(bytes(self.cert) + bytes(rev)))


def trust_key(home: Paths, armored: str, name: str = "Example Publisher") -> None:
    trust.add_entry(home, openpgp.key_entry(armored.encode(), name))


def test_signature_by_a_trusted_key_verifies(home: Paths) -> None:
    pub = Publisher()
    signed = pub.sign(MANIFEST)
    got = verify_publisher(signed, trust.load(home), FetchPolicy())
    assert not got.verified and "not in your trust list" in got.reason
    trust_key(home, pub.public)
    got = verify_publisher(signed, trust.load(home), FetchPolicy())
    assert got.verified and got.method == "gpg" and got.trust_entry is not None
    assert got.trust_entry.id == pub.fpr and got.trust_entry.name == "Example Publisher"


def test_refusals(home: Paths) -> None:
    pub, other = Publisher(), Publisher()
    trust_key(home, pub.public)
    trusted = trust.load(home)
    altered = pub.sign(MANIFEST)
    altered["requested_scopes"]["read"]["tags"] = ["financial"]
    cases = {
        "other-bytes": (altered, "does not verify"),
        # another key's signature naming the trusted key's fingerprint
        "other-key": (other.sign(MANIFEST, fingerprint=pub.fpr), "does not verify"),
        "untrusted-key": (other.sign(MANIFEST), "not in your trust list"),
    }
    bad_sig = pub.sign(MANIFEST)
    bad_sig["identity"]["proof"]["proofValue"] = jose.b64u_encode(b"not a signature")
    cases["garbage-signature"] = (bad_sig, "not an OpenPGP signature")
    bad_fpr = pub.sign(MANIFEST)
    bad_fpr["identity"]["proof"]["fingerprint"] = "1234"
    cases["bad-fingerprint"] = (bad_fpr, "not an OpenPGP fingerprint")
    for name, (doc, why) in cases.items():
        got = verify_publisher(doc, trusted, FetchPolicy())
        assert not got.verified and got.trust_entry is None, name
        assert why in got.reason, (name, got.reason)


def test_a_revoked_key_no_longer_verifies(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pub = Publisher()
    signed = pub.sign(MANIFEST)
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "uom.json").write_text(json.dumps(signed))
    key_file = tmp_path / "pub.asc"
    key_file.write_text(pub.public)
    h = ["--home", str(home.home)]
    args = [*h, "authorize", str(agent), "--yes", "--print", "--allow-local", "--require-verified"]
    assert main(args) == 1
    assert "error ACCESS_DENIED" in capsys.readouterr().err
    assert main([*h, "trust", "add-openpgp", str(key_file), "--name", "Example Publisher"]) == 0
    assert main(args) == 0
    assert f"Publisher: Example Publisher (verified, gpg: manifest signed by the OpenPGP key {pub.fpr}" in (
        capsys.readouterr().out
    )
    # the publisher revokes its key; the user updates the trust list with the revocation
    key_file.write_text(pub.revoked_public())
    assert main([*h, "trust", "add-openpgp", str(key_file), "--name", "Example Publisher"]) == 0
    assert "REVOKED" in capsys.readouterr().out
    assert main(args) == 1
    out = capsys.readouterr()
    assert "REVOKED" in out.out and "error ACCESS_DENIED" in out.err


def test_a_secret_key_is_not_accepted_into_the_trust_list(home: Paths) -> None:
    pub = Publisher()
    with pytest.raises(Exception, match="SECRET key"):
        openpgp.key_entry(bytes(pub.tsk), "x") if hasattr(pub.tsk, "__bytes__") else openpgp.key_entry(
            str(pub.tsk).encode(), "x"
        )
    with pytest.raises(Exception, match="not an OpenPGP public key"):
        openpgp.key_entry(b"-----BEGIN PGP PUBLIC KEY BLOCK-----\nnope\n", "x")
