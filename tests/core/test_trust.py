"""The trust list (spec §16.4) and the three identity states ``uomp authorize`` shows.

A did:key signature proves only that some key signed the manifest: the publisher is named only
when that key is in the user's trust list, and only by the name the user gave it.
"""

from __future__ import annotations

import builtins
import json
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway import trust
from gateway.cli.main import main
from gateway.config import Paths
from gateway.core import didkey, manifest

MANIFEST: dict[str, Any] = {
    "uomp_version": "1.0",
    "agent": {"id": "bank_agent", "name": "Bank Helper", "version": "1.0.0", "publisher": "Big Bank Inc."},
    "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
    "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
}


def cli(home: Paths, *args: str) -> int:
    return main(["--home", str(home.home), *args])


def did_of(key: ed25519.Ed25519PrivateKey) -> str:
    return didkey.did_key_from_public(key.public_key())


def write_agent(d: Path, doc: dict[str, Any]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "uom.json").write_text(json.dumps(doc))
    return d


def signed(key: ed25519.Ed25519PrivateKey, **agent: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(MANIFEST))
    doc["agent"].update(agent)
    return manifest.sign_manifest(doc, key)


# ------------------------------------------------------------------------------ uomp trust


def test_trust_add_list_rm(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    did = did_of(key)
    assert cli(home, "trust", "list") == 0
    assert "empty" in capsys.readouterr().out
    assert cli(home, "trust", "add", did, "--name", "My Bank") == 0
    out = capsys.readouterr().out
    assert "My Bank" in out and didkey.fingerprint(key.public_key()) in out
    assert stat.S_IMODE(os.stat(home.trust_file).st_mode) == 0o600
    assert cli(home, "trust", "list", "--json") == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [(e["kind"], e["id"], e["name"]) for e in entries] == [("did", did, "My Bank")]
    # re-adding renames rather than duplicating
    assert cli(home, "trust", "add", did, "--name", "Bank (personal)") == 0
    assert "renamed" in capsys.readouterr().out
    assert [e.name for e in trust.load(home).entries] == ["Bank (personal)"]
    assert cli(home, "trust", "rm", did) == 0
    assert trust.load(home).entries == ()
    assert cli(home, "trust", "rm", did) == 1  # not there any more: said, not ignored
    assert "not in your trust list" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("did", "name", "needle"),
    [
        ("did:web:bank.example:a/b", "Bank", "not a valid did:web"),
        ("did:ethr:0xabc", "Bank", "did:ethr identities cannot be verified"),
        ("did:key:z6MkNOTBASE58", "Bank", "not a valid Ed25519 did:key"),
        (
            "did:key:zQ3shokFTS3brHcDQrn82RUDfCZESWL1ZdCEJwekUDPQiYBme",
            "Bank",
            "not a valid Ed25519 did:key",
        ),  # secp256k1
        ("bank", "Bank", "give a DID"),
        (None, "Bank\u202eknaB", "printable"),
        (None, "Bank\nInc", "printable"),
        (None, "", "printable"),
    ],
    ids=[
        "did-web",
        "did-ethr",
        "did-key-garbage",
        "did-key-not-ed25519",
        "not-a-did",
        "bidi-name",
        "newline-name",
        "empty-name",
    ],
)
def test_trust_add_refusals(
    home: Paths, capsys: pytest.CaptureFixture[str], did: str | None, name: str, needle: str
) -> None:
    did = did or did_of(ed25519.Ed25519PrivateKey.generate())
    assert cli(home, "trust", "add", did, "--name", name) == 1
    assert needle in capsys.readouterr().err
    assert not home.trust_file.exists()


@pytest.mark.parametrize(
    ("content", "mode", "needle"),
    [
        (b"{not json", 0o600, "invalid"),
        (b'{"uomp_trust": 1, "entries": {}}', 0o600, "invalid"),
        (b'{"uomp_trust": 2, "entries": []}', 0o600, "invalid"),
        (b'{"uomp_trust": 1, "entries": [{"kind": "did", "id": "did:key:zzz", "name": "x"}]}', 0o600, "invalid"),
        (b'{"uomp_trust": 1, "entries": []}', 0o666, "writable by other users"),
        (b'{"uomp_trust": 1, "entries": []}', 0o620, "writable by other users"),
    ],
    ids=["not-json", "entries-not-list", "future-version", "bad-did-key", "world-writable", "group-writable"],
)
def test_a_bad_trust_list_is_refused_not_read_as_empty(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, mode: int, needle: str
) -> None:
    home.trust_file.write_bytes(content)
    os.chmod(home.trust_file, mode)
    assert cli(home, "trust", "list") == 1
    assert "CONFIG_ERROR" in capsys.readouterr().err
    agent = write_agent(tmp_path / "a", signed(ed25519.Ed25519PrivateKey.generate()))
    assert cli(home, "authorize", str(agent), "--yes", "--print") == 1
    err = capsys.readouterr().err
    assert "CONFIG_ERROR" in err and needle in err


def test_concurrent_adds_lose_nothing(home: Paths) -> None:
    dids = [did_of(ed25519.Ed25519PrivateKey.generate()) for _ in range(12)]
    errors: list[BaseException] = []

    def add(i: int) -> None:
        try:
            trust.add(home, dids[i], f"publisher {i}")
        except BaseException as exc:  # pragma: no cover - shown by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(len(dids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(e.id for e in trust.load(home).entries) == sorted(dids)


# --------------------------------------------------------------- authorize: three identity states


def _authorize(home: Paths, agent: Path, env: Path, *extra: str) -> int:
    return cli(home, "authorize", str(agent), "--yes", "--env-file", str(env), *extra)


def test_trusted_key_is_named_by_the_users_name(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    trust.add(home, did_of(key), "My Bank")
    agent = write_agent(tmp_path / "a", signed(key))
    env = tmp_path / "a.env"
    assert _authorize(home, agent, env, "--require-verified") == 0
    out = capsys.readouterr().out
    assert "Publisher: My Bank (signed by a key in your trust list" in out
    assert '"Big Bank Inc." (the manifest\'s own claim)' in out
    assert "UNVERIFIED" not in out and "NEVER TRUSTED" not in out
    assert env.exists()


# Each row: how the attacker builds the manifest; all must fail --require-verified and show no trust.
def _self_signed(home: Paths, attacker: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    return signed(attacker)


def _same_publisher_name(home: Paths, attacker: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    trust.add(home, did_of(ed25519.Ed25519PrivateKey.generate()), "Big Bank Inc.")  # the real one
    return signed(attacker, publisher="Big Bank Inc.")


def _trusted_did_other_signer(home: Paths, attacker: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    real = ed25519.Ed25519PrivateKey.generate()
    trust.add(home, did_of(real), "Big Bank Inc.")
    doc = signed(attacker)
    doc["identity"]["did"] = did_of(real)  # claims the trusted DID, signature is the attacker's
    return doc


def _altered_after_signing(home: Paths, attacker: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    real = ed25519.Ed25519PrivateKey.generate()
    trust.add(home, did_of(real), "Big Bank Inc.")
    doc = signed(real)
    doc["requested_scopes"]["read"]["tags"].append("financial")  # widened by whoever relayed it
    return doc


def _unsigned(home: Paths, attacker: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    return json.loads(json.dumps(MANIFEST))


def _did_web_claim(home: Paths, attacker: ed25519.Ed25519PrivateKey) -> dict[str, Any]:
    doc = json.loads(json.dumps(MANIFEST))
    doc["identity"] = {"did": "did:web:bigbank.example", "verification_methods": ["did"]}
    return doc


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (_self_signed, "SIGNED BY A KEY YOU HAVE NEVER TRUSTED"),
        (_same_publisher_name, "SIGNED BY A KEY YOU HAVE NEVER TRUSTED"),
        (_trusted_did_other_signer, "UNVERIFIED PUBLISHER"),
        (_altered_after_signing, "UNVERIFIED PUBLISHER"),
        (_unsigned, "UNVERIFIED PUBLISHER"),
        (_did_web_claim, "UNVERIFIED PUBLISHER"),
    ],
    ids=[
        "self-made-did-key",
        "trusted-name-other-key",
        "trusted-did-other-signer",
        "altered-after-signing",
        "unsigned",
        "did-web-claim",
    ],
)
def test_untrusted_identities_are_not_verified(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str], build: Any, needle: str
) -> None:
    attacker = ed25519.Ed25519PrivateKey.generate()
    agent = write_agent(tmp_path / "a", build(home, attacker))
    env = tmp_path / "a.env"
    assert _authorize(home, agent, env, "--require-verified") == 1
    captured = capsys.readouterr()
    assert needle in captured.out
    assert "Identity:  verified" not in captured.out and "trust list)" not in captured.out
    assert '"Big Bank Inc." (the manifest\'s own claim' in captured.out
    assert "ACCESS_DENIED" in captured.err
    assert not env.exists()
    # without --require-verified it may run, still not named
    assert _authorize(home, agent, env) == 0
    out = capsys.readouterr().out
    assert needle in out and "Publisher: Big Bank" not in out


def test_untrusted_key_shows_its_fingerprint(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    agent = write_agent(tmp_path / "a", signed(key))
    assert _authorize(home, agent, tmp_path / "a.env") == 0
    out = capsys.readouterr().out
    assert did_of(key) in out and didkey.fingerprint(key.public_key()) in out
    assert trust.load(home).entries == ()  # --yes never trusts on its own


def test_trust_on_first_use_by_flag(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    agent = write_agent(tmp_path / "a", signed(key))
    env = tmp_path / "a.env"
    assert _authorize(home, agent, env, "--require-verified", "--trust-publisher", "Bank I checked") == 0
    out = capsys.readouterr().out
    assert "added to your trust list as 'Bank I checked'" in out
    [entry] = trust.load(home).entries
    assert (entry.id, entry.name, entry.how) == (did_of(key), "Bank I checked", "authorize")
    # next time: trusted, by that name
    assert _authorize(home, agent, env, "--require-verified") == 0
    assert "Publisher: Bank I checked (signed by a key in your trust list" in capsys.readouterr().out


@pytest.mark.parametrize(
    "build", [_unsigned, _trusted_did_other_signer, _did_web_claim], ids=["unsigned", "bad-signature", "did-web"]
)
def test_trust_publisher_needs_a_verified_signature(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str], build: Any
) -> None:
    agent = write_agent(tmp_path / "a", build(home, ed25519.Ed25519PrivateKey.generate()))
    before = trust.load(home).entries
    assert _authorize(home, agent, tmp_path / "a.env", "--trust-publisher", "Bank") == 1
    assert "no verified signature" in capsys.readouterr().err
    assert trust.load(home).entries == before


@pytest.mark.parametrize(
    ("answers", "trusted", "rc"),
    [
        (["Acme Payroll", "y"], "Acme Payroll", 0),
        (["", "y"], None, 0),
        (["Acme Payroll", "n"], "Acme Payroll", 1),
    ],
    ids=["trust-and-grant", "skip-trust-grant", "trust-then-decline-grant"],
)
def test_trust_on_first_use_asked_interactively(
    home: Paths,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    answers: list[str],
    trusted: str | None,
    rc: int,
) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    agent = write_agent(tmp_path / "a", signed(key))
    replies = iter(answers)
    prompts: list[str] = []

    def fake_input(prompt: str = "") -> str:
        prompts.append(prompt)
        return next(replies)

    monkeypatch.setattr(builtins, "input", fake_input)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    assert cli(home, "authorize", str(agent), "--env-file", str(tmp_path / "a.env")) == rc
    assert "Trust this key" in prompts[0] and "Grant this access" in prompts[1]
    names = [e.name for e in trust.load(home).entries]
    assert names == ([trusted] if trusted else [])


def test_a_description_cannot_forge_the_trusted_line(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = ed25519.Ed25519PrivateKey.generate()
    trust.add(home, did_of(real), "My Bank")
    forged = f"Reads your balance.\nPublisher: My Bank (signed by a key in your trust list: {did_of(real)})"
    doc = json.loads(json.dumps(MANIFEST))
    doc["agent"]["description"] = forged
    doc["requested_scopes"]["read"]["description"] = forged
    doc = manifest.sign_manifest(doc, ed25519.Ed25519PrivateKey.generate())
    assert _authorize(home, write_agent(tmp_path / "a", doc), tmp_path / "a.env") == 0
    lines = capsys.readouterr().out.splitlines()
    assert not [ln for ln in lines if ln.startswith("Publisher: My Bank")]
    assert sum(1 for ln in lines if ln.strip().startswith("> Publisher: My Bank")) == 2  # shown, as quoted text
