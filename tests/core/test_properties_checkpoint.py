"""Property tests of the signed-note / checkpoint parser (gateway/core/checkpoint.py).

Documented error: NoteError only. Round trip: a signed checkpoint opens to itself; any changed
character of the note is refused or opens to the same checkpoint.
"""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import checkpoint
from gateway.core.checkpoint import Checkpoint, NoteError

KEY = Ed25519PrivateKey.generate()
NAME = "uomp.test/log"


@pytest.mark.parametrize(
    "root_line",
    [
        "AAAAAAAAAAA53oO82qwfONGSwALxa7KKf0HnpGRR7xNKY4P8XkIUDB/AXQO\xff\xff\xffSA5XPA53SMIAgE=",  # found by fuzz
        "é" * 44,
        "ＡＡＡＡ",
        "AAAA\u200b",
    ],
    ids=["fuzz-crash", "latin1", "fullwidth", "zero-width"],
)
def test_non_ascii_root_is_a_note_error(root_line: str) -> None:
    """Found by scripts/fuzz.sh (checkpoint target): a non-ASCII root line escaped as a bare ValueError."""
    with pytest.raises(NoteError):
        Checkpoint.parse(f"{NAME}\n4\n{root_line}\ntimestamp 1\n")


def test_signed_non_ascii_root_is_refused_as_note_error() -> None:
    note = checkpoint.sign_note(f"{NAME}\n4\nAAAA\xe9AAA\ntimestamp 1\n", NAME, KEY)
    with pytest.raises(NoteError):
        Checkpoint.open(note, NAME, KEY.public_key())


@settings(max_examples=80, deadline=None)
@given(size=st.integers(0, 2**40), root=st.binary(min_size=32, max_size=32), ts=st.integers(0, 2**40))
def test_round_trip(size: int, root: bytes, ts: int) -> None:
    cp = Checkpoint(NAME, size, root, ts)
    assert Checkpoint.open(cp.sign(NAME, KEY), NAME, KEY.public_key()) == cp


@settings(max_examples=120, deadline=None)
@given(pos=st.integers(min_value=0), ch=st.characters(codec="utf-8"))
def test_altered_note_never_opens_to_other_text(pos: int, ch: str) -> None:
    cp = Checkpoint(NAME, 7, bytes(range(32)), 1_780_000_000)
    note = cp.sign(NAME, KEY)
    i = pos % len(note)
    forged = note[:i] + ch + note[i + 1 :]
    try:
        got = Checkpoint.open(forged, NAME, KEY.public_key())
    except NoteError:
        return
    assert got == cp


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_any_text_raises_note_error_only(text: str) -> None:
    for fn in (
        lambda: Checkpoint.parse(text),
        lambda: checkpoint.open_note(text, NAME, KEY.public_key()),
        lambda: checkpoint.parse_verifier_key(text),
    ):
        try:
            fn()
        except NoteError:
            pass
        except ValueError as exc:  # NoteError is a ValueError: anything else is the bug class
            raise AssertionError(f"{type(exc).__name__} escaped: {exc}") from exc


def test_unicode_digits_in_size_refused() -> None:
    root = base64.b64encode(bytes(32)).decode()
    with pytest.raises(NoteError):
        Checkpoint.parse(f"{NAME}\n\u0663\n{root}\ntimestamp 1\n")
