"""C2SP signed notes and checkpoints: a published vector, round trips, and every tampering refused."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway.core.checkpoint import Checkpoint, NoteError, open_note, parse_verifier_key, sign_note, verifier_key

# The example of the C2SP signed-note specification (data only).
SPEC_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
SPEC_NOTE = (
    "This is an example message.\n\n"
    "\u2014 example.com/foo "
    "Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n"
)


def test_published_signed_note_verifies() -> None:
    name, pub = parse_verifier_key(SPEC_VKEY)
    assert open_note(SPEC_NOTE, name, pub) == "This is an example message.\n"
    assert verifier_key(name, pub) == SPEC_VKEY
    with pytest.raises(NoteError):
        open_note(SPEC_NOTE.replace("example message", "example massage"), name, pub)


KEY = Ed25519PrivateKey.generate()
ORIGIN = "uomp.test/appliance-audit"
CP = Checkpoint(ORIGIN, 12345, bytes(range(32)), 1_790_000_000)


def test_checkpoint_round_trip() -> None:
    note = CP.sign(ORIGIN, KEY)
    root_b64 = base64.b64encode(bytes(range(32))).decode()
    assert note.startswith(f"{ORIGIN}\n12345\n{root_b64}\ntimestamp 1790000000\n\n\u2014 ")
    assert Checkpoint.open(note, ORIGIN, KEY.public_key()) == CP


def _tamper(note: str, old: str, new: str) -> str:
    assert old in note
    return note.replace(old, new, 1)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda n: _tamper(n, "12345", "12346"), id="size"),
        pytest.param(lambda n: _tamper(n, "timestamp 1790000000", "timestamp 1790000001"), id="timestamp"),
        pytest.param(lambda n: _tamper(n, ORIGIN + "\n", "uomp.test/other\n"), id="origin"),
        pytest.param(lambda n: _tamper(n, "AAECAwQF", "AAECAwQG"), id="root"),
        pytest.param(lambda n: n[:-2] + ("A" if n[-2] != "A" else "B") + "\n", id="signature-byte"),
        pytest.param(lambda n: n.split("\n\n")[0] + "\n", id="signature-removed"),
        pytest.param(lambda n: n.replace("\u2014", "--"), id="dash"),
        pytest.param(lambda n: n.rstrip("\n"), id="no-final-newline"),
        pytest.param(lambda n: n.replace("\n\n", "\nextra\n\n"), id="line-added"),
    ],
)
def test_tampered_checkpoints_refused(mutate) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NoteError):
        Checkpoint.open(mutate(CP.sign(ORIGIN, KEY)), ORIGIN, KEY.public_key())


def test_other_key_refused_and_foreign_signatures_ignored() -> None:
    other = Ed25519PrivateKey.generate()
    with pytest.raises(NoteError):
        Checkpoint.open(CP.sign(ORIGIN, other), ORIGIN, KEY.public_key())
    # A witness's cosignature under another name is ignored, ours still verifies.
    note = CP.sign(ORIGIN, KEY)
    witness = sign_note(CP.text(), "witness.example", other).split("\n\n")[1]
    assert Checkpoint.open(note + witness, ORIGIN, KEY.public_key()) == CP


@pytest.mark.parametrize("text", ["", "no newline", "a\n\nb\n", "bell\x07\n"])
def test_bad_note_text_refused(text: str) -> None:
    with pytest.raises(NoteError):
        sign_note(text, ORIGIN, KEY)


@pytest.mark.parametrize(
    "body",
    [
        "o\n01\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\ntimestamp 1\n",
        "o\n-1\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\ntimestamp 1\n",
        "o\n1\nAAAA\ntimestamp 1\n",
        "o\n1\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n",
        "o\n1\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\ntimestamp 1\ntimestamp 2\n",
        "o\n99999999999999999999\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\ntimestamp 1\n",
    ],
    ids=["leading-zero", "negative", "short-root", "no-timestamp", "two-timestamps", "huge"],
)
def test_bad_checkpoint_bodies(body: str) -> None:
    with pytest.raises(NoteError):
        Checkpoint.parse(body)


def test_verifier_keys_round_trip_whatever_their_base64() -> None:
    # Base64 of a key often contains '+', the field separator of a verifier key.
    for _ in range(64):
        key = Ed25519PrivateKey.generate().public_key()
        name, pub = parse_verifier_key(verifier_key(ORIGIN, key))
        assert name == ORIGIN and verifier_key(name, pub) == verifier_key(ORIGIN, key)
