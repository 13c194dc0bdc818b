"""Signed checkpoints in the C2SP formats: signed-note (c2sp.org/signed-note) carrying a
tlog-checkpoint body (c2sp.org/tlog-checkpoint). Pure: text and keys in, verified values out.

A checkpoint's note text is::

    <origin>\\n
    <tree size, decimal>\\n
    <base64 root hash>\\n
    timestamp <unix seconds>\\n          (our one extension line: when the appliance signed it)

and the signed note appends a blank line and one signature line per signer::

    — <key name> <base64(key id (4 bytes) || Ed25519 signature (64 bytes))>\\n

The signature covers the note text including its final newline. The key id is the first four
bytes of SHA-256(key name || 0x0A || 0x01 || public key); 0x01 names Ed25519. A verifier key is
shared as ``<name>+<hex key id>+<base64(0x01 || public key)>``, the form other tlog tools read.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

ED25519 = b"\x01"
SIG_PREFIX = "\u2014 "  # em dash, space
MAX_NOTE_BYTES = 64 * 1024
MAX_SIGNATURES = 100
MAX_TREE_SIZE = (1 << 63) - 1
_NAME = re.compile(r"[\x21-\x2a\x2c-\x7e]+")  # printable ASCII, no space, no '+'
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")


class NoteError(ValueError):
    """A note, checkpoint or key that does not parse or does not verify."""


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def key_id(name: str, public_key: Ed25519PublicKey, kind: bytes = ED25519) -> bytes:
    """The signed-note key id: SHA-256(name || 0x0A || kind || key)[:4]; ``kind`` is the signature
    type byte (0x01 Ed25519 note signatures, 0x04 C2SP cosignature/v1)."""
    return hashlib.sha256(name.encode() + b"\n" + kind + _raw_public(public_key)).digest()[:4]


def verifier_key(name: str, public_key: Ed25519PublicKey, kind: bytes = ED25519) -> str:
    """The signed-note verifier key ``name+keyid+base64(kind || key)`` for ``public_key``."""
    _check_name(name)
    return f"{name}+{key_id(name, public_key, kind).hex()}+{base64.b64encode(kind + _raw_public(public_key)).decode()}"


def parse_verifier_key(vkey: str, kind: bytes = ED25519) -> tuple[str, Ed25519PublicKey]:
    """``name+keyid+base64(kind || key)``, its id checked; NoteError for anything else."""
    parts = vkey.strip().split("+", 2)  # the base64 key may itself contain '+'
    if len(parts) != 3:
        raise NoteError("a verifier key is name+keyid+key")
    name, kid_hex, b64 = parts
    _check_name(name)
    try:
        raw = base64.b64decode(b64, validate=True)
        kid = bytes.fromhex(kid_hex)
    except (binascii.Error, ValueError):
        raise NoteError("verifier key is not valid hex/base64") from None
    if len(raw) != 33 or raw[:1] != kind or len(kid) != 4:
        raise NoteError("verifier key is not an Ed25519 key" + ("" if kind == ED25519 else " of this kind"))
    pub = Ed25519PublicKey.from_public_bytes(raw[1:])
    if key_id(name, pub, kind) != kid:
        raise NoteError("verifier key id does not match its name and key")
    return name, pub


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise NoteError("a key name is printable ASCII without spaces or '+'")


def _check_text(text: str) -> None:
    if not text or not text.endswith("\n") or "\n\n" in text:
        raise NoteError("note text must be non-empty, end in a newline and have no blank line")
    if any(ord(c) < 0x20 and c != "\n" for c in text):
        raise NoteError("note text has a control character")


def sign_note(text: str, name: str, private_key: Ed25519PrivateKey) -> str:
    """``text`` signed by ``name``'s key as a signed note (text, blank line, one signature line);
    NoteError past the size bound."""
    _check_name(name)
    _check_text(text)
    sig = private_key.sign(text.encode())
    line = f"{SIG_PREFIX}{name} {base64.b64encode(key_id(name, private_key.public_key()) + sig).decode()}\n"
    note = f"{text}\n{line}"
    if len(note.encode()) > MAX_NOTE_BYTES:
        raise NoteError("note too large")
    return note


def open_note(note: str, name: str, public_key: Ed25519PublicKey) -> str:
    """Return the note's text if it carries a valid signature by ``(name, public_key)``.

    Signature lines of other keys are ignored (a checkpoint may carry witnesses' cosignatures); a
    line that claims our key but does not verify rejects the whole note.
    """
    text, lines = split_note(note)
    want = key_id(name, public_key)
    for signer, blob in signature_lines(lines):
        if signer != name or blob[:4] != want:
            continue
        try:
            public_key.verify(blob[4:], text.encode())
        except InvalidSignature:
            raise NoteError("checkpoint signature does not verify") from None
        return text
    raise NoteError(f"note is not signed by {name}")


def split_note(note: str) -> tuple[str, list[str]]:
    """A signed note's text and its signature lines (without their newlines), within the bounds."""
    if len(note.encode()) > MAX_NOTE_BYTES:
        raise NoteError("note too large")
    cut = note.rfind("\n\n")
    if cut < 0:
        raise NoteError("note has no signature block")
    text, sigs = note[: cut + 1], note[cut + 2 :]
    _check_text(text)
    if not sigs.endswith("\n"):
        raise NoteError("signature block must end in a newline")
    lines = sigs[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise NoteError("too many signatures")
    return text, lines


def signature_lines(lines: list[str]) -> Iterator[tuple[str, bytes]]:
    """(signer name, key id || signature) of each ``— name base64`` line; NoteError on any other."""
    for line in lines:
        if not line.startswith(SIG_PREFIX):
            raise NoteError("malformed signature line")
        try:
            signer, b64 = line[len(SIG_PREFIX) :].split(" ")
            blob = base64.b64decode(b64, validate=True)
        except (ValueError, binascii.Error):
            raise NoteError("malformed signature line") from None
        if len(blob) < 5:
            raise NoteError("malformed signature line")
        yield signer, blob


@dataclass(frozen=True)
class Checkpoint:
    """A C2SP tlog checkpoint: the log's origin, its size, the root over that many events, and when it was signed."""

    origin: str
    size: int
    root: bytes
    timestamp: int

    def text(self) -> str:
        if "\n" in self.origin or not self.origin:
            raise NoteError("bad origin")
        if not 0 <= self.size <= MAX_TREE_SIZE or len(self.root) != 32:
            raise NoteError("bad tree size or root")
        return f"{self.origin}\n{self.size}\n{base64.b64encode(self.root).decode()}\ntimestamp {self.timestamp}\n"

    def sign(self, name: str, private_key: Ed25519PrivateKey) -> str:
        return sign_note(self.text(), name, private_key)

    @classmethod
    def parse(cls, text: str) -> Checkpoint:
        lines = text.split("\n")
        if len(lines) < 4 or lines[-1] != "":
            raise NoteError("a checkpoint has an origin, a size and a root hash")
        origin, size_s, root_b64, *ext = lines[:-1]
        if not origin or not _DECIMAL.fullmatch(size_s) or int(size_s) > MAX_TREE_SIZE:
            raise NoteError("bad checkpoint origin or size")
        try:
            root = base64.b64decode(root_b64, validate=True)
        except (binascii.Error, ValueError):  # ValueError: non-ASCII text (found by fuzzing)
            raise NoteError("checkpoint root is not base64") from None
        if len(root) != 32:
            raise NoteError("checkpoint root is not 32 bytes")
        stamps = [e for e in ext if e.startswith("timestamp ")]
        if len(stamps) != 1 or not _DECIMAL.fullmatch(stamps[0][len("timestamp ") :]):
            raise NoteError("checkpoint needs exactly one timestamp line")
        return cls(origin, int(size_s), root, int(stamps[0][len("timestamp ") :]))

    @classmethod
    def open(cls, note: str, name: str, public_key: Ed25519PublicKey) -> Checkpoint:
        cp = cls.parse(open_note(note, name, public_key))
        if cp.origin != name:
            raise NoteError("checkpoint origin is not the signer's name")
        return cp
