"""The external witness: C2SP tlog-cosignature/v1 (Ed25519) cosignatures of the audit log's
checkpoints, and the witness directory that keeps them (``uomp audit witness --dir DIR``).

**Cosignature line** (c2sp.org/tlog-cosignature, a signed-note signature line)::

    — <witness name> base64(key id (4 bytes) || timestamp (u64, big-endian) || Ed25519 signature (64 bytes))\\n

key id = SHA-256(name || 0x0A || 0x04 || 32-byte public key)[:4] (0x04 names a cosignature/v1
key, so the witness key can never be taken for a log key, whose type byte is 0x01). The signed
message is ``cosignature/v1\\n`` || ``time <timestamp, decimal>\\n`` || the checkpoint's note text
(every line, the final newline included, no signature line). The witness's verifier key is
``<name>+<hex key id>+<base64(0x04 || public key)>``.

**Witness directory** (on another disk or machine, 0700): ``witness-ed25519.key`` (the witness's
own key, PKCS#8 PEM, 0600, made on first use, never written anywhere else), ``witness.vkey`` (its
verifier key), ``checkpoint`` (the newest cosigned checkpoint: the appliance's signed note with
the cosignature line appended, replaced atomically) and ``history`` (every cosigned checkpoint,
one JSON line each, appended and fsynced before ``checkpoint`` is replaced); ``lock`` keeps two
runs from interleaving. One directory witnesses one appliance (one audit key). A checkpoint is
cosigned only after its signature verifies with the audit key and a consistency proof from the
last cosigned checkpoint verifies; so whatever the witness cosigned, no later log under the same
audit key can drop or rewrite it without ``uomp audit verify --witness-dir`` turning red.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gateway import pemkeys
from gateway.core import checkpoint
from gateway.core.checkpoint import MAX_NOTE_BYTES, SIG_PREFIX, Checkpoint, NoteError
from gateway.fsutil import atomic_write, ensure_private_dir, fsync_dir

COSIGNATURE_V1 = b"\x04"
HEADER = "cosignature/v1\n"
MAX_TIMESTAMP = (1 << 63) - 1
KEY_FILE = "witness-ed25519.key"
VKEY_FILE = "witness.vkey"
CHECKPOINT_FILE = "checkpoint"
HISTORY_FILE = "history"
LOCK_FILE = "lock"
MAX_VKEY_BYTES = 1024


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def key_id(name: str, public_key: Ed25519PublicKey) -> bytes:
    """The cosignature/v1 key id of a witness key."""
    return checkpoint.key_id(name, public_key, COSIGNATURE_V1)


def verifier_key(name: str, public_key: Ed25519PublicKey) -> str:
    """The cosignature/v1 verifier key string of a witness key."""
    return checkpoint.verifier_key(name, public_key, COSIGNATURE_V1)


def parse_verifier_key(vkey: str) -> tuple[str, Ed25519PublicKey]:
    """A cosignature/v1 verifier key, its id checked; NoteError for anything else."""
    return checkpoint.parse_verifier_key(vkey, COSIGNATURE_V1)


def signed_message(text: str, timestamp: int) -> bytes:
    """What a cosignature/v1 signs: header line, time line, then the checkpoint's note text."""
    if not 0 <= timestamp <= MAX_TIMESTAMP:
        raise NoteError("cosignature timestamp out of range")
    return f"{HEADER}time {timestamp}\n{text}".encode()


def cosign(note: str, name: str, private_key: Ed25519PrivateKey, timestamp: int) -> str:
    """``note`` (a signed checkpoint) with this witness's cosignature line appended."""
    text, _ = checkpoint.split_note(note)
    sig = private_key.sign(signed_message(text, timestamp))
    blob = key_id(name, private_key.public_key()) + struct.pack(">Q", timestamp) + sig
    return f"{note}{SIG_PREFIX}{name} {base64.b64encode(blob).decode()}\n"


def open_cosigned(note: str, name: str, public_key: Ed25519PublicKey) -> tuple[str, int]:
    """The note text and the cosignature's timestamp when ``note`` carries a valid cosignature by
    ``(name, public_key)``; a line that claims this key and does not verify rejects the note."""
    text, lines = checkpoint.split_note(note)
    want = key_id(name, public_key)
    for signer, blob in checkpoint.signature_lines(lines):
        if signer != name or blob[:4] != want:
            continue
        if len(blob) != 4 + 8 + 64:
            raise NoteError("the witness's cosignature is not a cosignature/v1 signature")
        (timestamp,) = struct.unpack(">Q", blob[4:12])
        try:
            public_key.verify(blob[12:], signed_message(text, timestamp))
        except InvalidSignature:
            raise NoteError("the witness's cosignature does not verify") from None
        return text, timestamp
    raise NoteError(f"the checkpoint is not cosigned by {name}")


# ----------------------------------------------------------------------------------- witness directory


class WitnessDirError(ValueError):
    """The witness directory cannot vouch for anything (a tampered file, another key)."""


@dataclass(frozen=True)
class Cosigned:
    """A checkpoint the external witness cosigned: the note with its cosignature line, and when."""

    note: str  # the appliance's signed note with the cosignature line
    checkpoint: Checkpoint
    timestamp: int


class WitnessDir:
    """The external witness's directory (a mount): its key, its state, the notes it cosigned."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def exists(self) -> bool:
        return (self.path / KEY_FILE).exists()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One witness run at a time on this directory (an exclusive lock on ``lock``)."""
        fd = os.open(self.path / LOCK_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def has_cosigned(self) -> bool:
        return (self.path / CHECKPOINT_FILE).exists()

    def ensure_key(self) -> bool:
        """Make the witness key and its verifier key file if missing; True when this call made it."""
        ensure_private_dir(self.path, "witness directory")
        made = pemkeys.ensure(
            self.path / KEY_FILE,
            Ed25519PrivateKey.generate,
            Ed25519PrivateKey,
            what="witness key",
            restore="a new witness key would not vouch for what the old one cosigned",
        )
        if made or not (self.path / VKEY_FILE).exists():
            atomic_write(
                self.path / VKEY_FILE, (verifier_key(*self._name_pub(self._private())) + "\n").encode(), mode=0o644
            )
        return made

    def _private(self) -> Ed25519PrivateKey:
        key = pemkeys.load(
            self.path / KEY_FILE,
            Ed25519PrivateKey,
            what="witness key",
            restore="a new witness key would not vouch for what the old one cosigned",
        )
        assert isinstance(key, Ed25519PrivateKey)
        return key

    @staticmethod
    def _name_pub(key: Ed25519PrivateKey) -> tuple[str, Ed25519PublicKey]:
        pub = key.public_key()
        return "uomp-witness/" + hashlib.sha256(_raw(pub)).hexdigest()[:16], pub

    def signer(self) -> tuple[str, Ed25519PrivateKey]:
        key = self._private()
        name, _ = self._name_pub(key)
        return name, key

    def verifier(self) -> tuple[str, Ed25519PublicKey]:
        """The witness's name and public key, from ``witness.vkey``."""
        try:
            with (self.path / VKEY_FILE).open("rb") as fh:
                raw = fh.read(MAX_VKEY_BYTES + 1)
            if len(raw) > MAX_VKEY_BYTES:
                raise NoteError("too large")
            return parse_verifier_key(raw.decode("ascii"))
        except FileNotFoundError:
            raise WitnessDirError(
                f"{self.path} holds no witness key ({VKEY_FILE}); run 'uomp audit witness --dir {self.path}'"
            ) from None
        except (OSError, UnicodeDecodeError, NoteError) as exc:
            raise WitnessDirError(f"the witness verifier key {self.path / VKEY_FILE} is not valid ({exc})") from None

    def newest(
        self, *, origin: str, log_key: Ed25519PublicKey, name: str, witness_key: Ed25519PublicKey
    ) -> Cosigned | None:
        """The newest cosigned checkpoint, None when the witness has cosigned nothing yet. It must
        carry a valid cosignature by the witness key and a valid signature by the audit key."""
        try:
            with (self.path / CHECKPOINT_FILE).open("rb") as fh:
                raw = fh.read(MAX_NOTE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise WitnessDirError(f"the witness's checkpoint cannot be read ({exc.strerror})") from None
        try:
            if len(raw) > MAX_NOTE_BYTES:
                raise NoteError("too large")
            note = raw.decode("utf-8")
            text, timestamp = open_cosigned(note, name, witness_key)
            cp = Checkpoint.open(note, origin, log_key)
            if cp.text() != text:
                raise NoteError("the cosigned text is not the checkpoint")
        except (UnicodeDecodeError, NoteError) as exc:
            raise WitnessDirError(
                f"the witness's checkpoint {self.path / CHECKPOINT_FILE} is not a checkpoint of "
                f"{origin} cosigned by {name} ({exc})"
            ) from None
        return Cosigned(note, cp, timestamp)

    def store(self, cosigned: Cosigned) -> None:
        """The history line first (appended, fsynced), then the newest checkpoint (atomically)."""
        line = (
            json.dumps({"size": cosigned.checkpoint.size, "timestamp": cosigned.timestamp, "note": cosigned.note})
            + "\n"
        )
        fd = os.open(self.path / HISTORY_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.path)
        atomic_write(self.path / CHECKPOINT_FILE, cosigned.note.encode())
