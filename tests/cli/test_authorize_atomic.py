"""`uomp authorize` is all or nothing: a refused or failed authorize leaves no usable session and no file;
unreadable certificate or CSR files are one INVALID_REQUEST line naming the file."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from gateway import ca_store
from gateway.cli.main import main
from gateway.config import Paths
from gateway.keys import init_home

MANIFEST = {
    "uomp_version": "1.0",
    "agent": {"id": "calendar_agent", "name": "Calendar Assistant", "version": "1.2.0"},
    "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
    "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
}


@pytest.fixture
def agent(tmp_path: Path) -> Path:
    d = tmp_path / "agent"
    d.mkdir()
    (d / "uom.json").write_text(json.dumps(MANIFEST))
    return d


def sessions(home: Paths) -> list[tuple[str, str]]:
    if not home.auth_db.exists():
        return []
    db = sqlite3.connect(home.auth_db)
    try:
        return [(r[0], r[1]) for r in db.execute("SELECT status, status_reason FROM sessions")]
    finally:
        db.close()


def authorize(home: Paths, agent: Path, *extra: str) -> int:
    return main(["--home", str(home.home), "authorize", str(agent), "--yes", "--remote", *extra])


def other_ca_cert(tmp_path: Path) -> Path:
    other = Paths(tmp_path / "other-home")
    init_home(other)
    ca_store.init_all(other)
    return ca_store.issue_with_key(other, "calendar_agent", tmp_path / "other-files").cert_file


@pytest.mark.parametrize("case", ["not-pem", "missing", "empty", "other-ca", "other-agent", "bad-csr", "out-is-file"])
def test_refused_inputs_are_one_line_and_leave_nothing(
    home: Paths, agent: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ca_store.init_all(home)
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"this is not a certificate\n")
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    args = {
        "not-pem": ["--cert", str(junk)],
        "missing": ["--cert", str(tmp_path / "nope.crt")],
        "empty": ["--cert", str(empty)],
        "other-ca": ["--cert", str(other_ca_cert(tmp_path))],
        "other-agent": ["--cert", str(ca_store.issue_with_key(home, "someone_else", tmp_path / "se").cert_file)],
        "bad-csr": ["--csr", str(junk)],
        "out-is-file": ["--out", str(junk)],
    }[case]
    want = {
        "not-pem": "is not a certificate",
        "missing": "cannot read --cert",
        "empty": "is not a certificate",
        "other-ca": "was not issued by your CA",
        "other-agent": "names agent 'someone_else'",
        "bad-csr": "cannot be parsed",
        "out-is-file": "exists and is not a directory",
    }[case]
    capsys.readouterr()
    bundle = tmp_path / "bundle.json"
    assert authorize(home, agent, *args, "--bundle", str(bundle)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error INVALID_REQUEST: ") and want in err, err
    assert len(err.strip().splitlines()) == 1 and "INTERNAL" not in err
    assert sessions(home) == [] and not bundle.exists()


def test_a_failure_after_the_session_was_made_ends_it_and_removes_the_new_files(
    home: Paths, agent: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert authorize(home, agent, "--out", str(tmp_path / "x")) == 1  # no CA yet: refused before anything
    assert "error CA_ERROR: no CA in" in capsys.readouterr().err and sessions(home) == []
    ca_store.init_all(home)
    out = tmp_path / "agent-files"
    in_the_way = tmp_path / "bundle-is-a-dir"
    in_the_way.mkdir()
    (in_the_way / "keep").write_text("x")
    assert authorize(home, agent, "--out", str(out), "--bundle", str(in_the_way)) == 1
    [(status, reason)] = sessions(home)
    assert status == "revoked" and reason.startswith("authorize did not finish")
    assert not (out / "agent.key").exists() and not (out / "agent.crt").exists()
    assert (in_the_way / "keep").exists()
    # the partner: the same command with a usable bundle path works, and makes one more session only
    bundle = tmp_path / "bundle.json"
    assert authorize(home, agent, "--out", str(out), "--bundle", str(bundle)) == 0
    assert sorted(s for s, _ in sessions(home)) == ["active", "revoked"]
    assert (out / "agent.key").exists() and json.loads(bundle.read_text())["agent_id"] == "calendar_agent"


def test_a_good_cert_and_a_good_csr_are_accepted(home: Paths, agent: Path, tmp_path: Path) -> None:
    ca_store.init_all(home)
    files = ca_store.issue_with_key(home, "calendar_agent", tmp_path / "issued")
    assert (
        authorize(
            home,
            agent,
            "--cert",
            str(files.cert_file),
            "--key-file",
            str(files.key_file),
            "--bundle",
            str(tmp_path / "b1.json"),
        )
        == 0
    )
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, hashes.SHA256())
    (tmp_path / "agent.csr").write_bytes(csr.public_bytes(serialization.Encoding.PEM))
    assert authorize(home, agent, "--csr", str(tmp_path / "agent.csr"), "--bundle", str(tmp_path / "b2.json")) == 0
    assert [s for s, _ in sessions(home)] == ["active", "active"]
