"""The agent as a witness of the gateway's audit log (docs/audit.md "Agents as witnesses").

The SDK keeps, per gateway, the newest checkpoint it verified: ``uomp-checkpoints.json`` beside
the agent bundle (0600, written atomically under an ``flock`` on ``uomp-checkpoints.json.lock``,
so agents sharing the directory share the record)::

    {"uomp_witness": 1, "gateways": {"<gateway url>": {"verifier_key": ..., "tree_size": N,
                                                       "root": base64, "checkpoint": signed note}}}

Every checkpoint the gateway hands over (``GET /v1/audit/checkpoint``, ``GET /v1/audit/{id}/proof``)
is asked for with ``since=<kept tree size>`` and checked here before it counts:

1. the signed note opens under the trusted verifier key (the bundle's ``audit_verifier_key``; without
   one, the key the record kept first) -> else :class:`AuditCheckpointInvalid`;
2. the answer's ``consistency`` links the kept tree size and the new one (RFC 9162 §2.1.4, whichever
   is smaller is the old tree), and proves it -> else :class:`AuditLogForked`. A gateway that says it
   never signed the kept size (400 ``AUDIT_SIZE_UNKNOWN``) is a log shorter than one it showed: forked;
3. only then, and only when the new checkpoint is larger, is the record replaced.

Pure checks (:func:`check`) and the file (:class:`WitnessFile`); :mod:`.sdk` calls them.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.client.errors import AuditCheckpointInvalid, AuditLogForked, ConfigError, ProtocolError, Unavailable
from gateway.core import merkle
from gateway.core.canonical import canonical_json
from gateway.core.checkpoint import Checkpoint, NoteError, parse_verifier_key
from gateway.fsutil import atomic_write

WITNESS_FILE = "uomp-checkpoints.json"
WITNESS_VERSION = 1
MAX_WITNESS_BYTES = 1024 * 1024
MAX_PROOF_HASHES = 128  # a consistency proof has at most ~2·log2(2^63) hashes


@dataclass(frozen=True)
class Kept:
    """The newest checkpoint this agent verified for one gateway."""

    verifier_key: str
    tree_size: int
    root: bytes
    checkpoint: str

    def to_json(self) -> dict[str, Any]:
        return {
            "verifier_key": self.verifier_key,
            "tree_size": self.tree_size,
            "root": base64.b64encode(self.root).decode(),
            "checkpoint": self.checkpoint,
        }


def open_checkpoint(note: Any, vkey: str) -> Checkpoint:
    """The checkpoint in ``note`` if it is signed by ``vkey``; else :class:`AuditCheckpointInvalid`."""
    if not isinstance(note, str):
        raise AuditCheckpointInvalid("AUDIT_CHECKPOINT_INVALID", "the gateway's answer has no signed checkpoint")
    try:
        name, pub = parse_verifier_key(vkey)
        return Checkpoint.open(note, name, pub)
    except NoteError as exc:
        raise AuditCheckpointInvalid(
            "AUDIT_CHECKPOINT_INVALID",
            f"the audit checkpoint does not verify under the trusted audit key ({exc}); tell the user",
        ) from None


def _hashes(raw: Any) -> list[bytes]:
    if not isinstance(raw, list) or len(raw) > MAX_PROOF_HASHES:
        raise ProtocolError("BAD_RESPONSE", "the consistency proof is not a bounded list of hashes")
    try:
        return [base64.b64decode(h, validate=True) for h in raw]
    except (binascii.Error, TypeError, ValueError):
        raise ProtocolError("BAD_RESPONSE", "the consistency proof holds a hash that is not base64") from None


def check(kept: Kept | None, vkey: str, note: Any, consistency: Any) -> tuple[Checkpoint, bool]:
    """Verify a checkpoint the gateway sent against the kept one. Returns the checkpoint and whether
    it should replace the kept one (larger, and proven consistent with it)."""
    cp = open_checkpoint(note, vkey)
    if kept is None:
        return cp, True
    forked = (
        f"the audit log (tree size {cp.size}) is not consistent with the checkpoint this agent kept (tree "
        f"size {kept.tree_size})"
    )
    if not isinstance(consistency, Mapping):
        raise AuditLogForked(
            "AUDIT_LOG_INCONSISTENT",
            f"{forked}: no consistency proof was sent; keep uomp-checkpoints.json as evidence and tell the user",
        )
    old, new = sorted((kept.tree_size, cp.size))
    sizes = (consistency.get("old_size"), consistency.get("new_size"))
    if any(type(v) is not int for v in sizes) or sizes != (old, new):
        raise AuditLogForked(
            "AUDIT_LOG_INCONSISTENT",
            f"{forked}: the proof is for other sizes; keep uomp-checkpoints.json as evidence and tell the user",
        )
    path = _hashes(consistency.get("path"))
    old_root, new_root = (kept.root, cp.root) if kept.tree_size <= cp.size else (cp.root, kept.root)
    try:
        merkle.verify_consistency(old, new, old_root, new_root, path)
    except merkle.ProofError as exc:
        raise AuditLogForked(
            "AUDIT_LOG_INCONSISTENT",
            f"{forked} ({exc}): forked or rolled back; keep uomp-checkpoints.json as evidence and tell the user",
        ) from None
    return cp, cp.size > kept.tree_size


def check_inclusion(bundle: Mapping[str, Any], cp: Checkpoint) -> None:
    """The bundle's event is leaf ``leaf_index`` of the checkpoint's tree (RFC 9162 §2.1.3)."""
    event, index = bundle.get("event"), bundle.get("leaf_index")
    if not isinstance(event, dict) or not isinstance(index, int) or bundle.get("tree_size") != cp.size:
        raise ProtocolError("BAD_RESPONSE", "the proof bundle is malformed")
    try:
        merkle.verify_inclusion(
            index, cp.size, merkle.leaf_hash(canonical_json(event)), _hashes(bundle.get("inclusion_path")), cp.root
        )
    except merkle.ProofError as exc:
        raise AuditLogForked(
            "AUDIT_LOG_INCONSISTENT", f"the event is not in the signed checkpoint ({exc}); tell the user"
        ) from None


class WitnessFile:
    """``uomp-checkpoints.json``: the kept checkpoint per gateway URL."""

    def __init__(self, path: Path, *, lock_timeout_seconds: float = 30.0) -> None:
        self.path = Path(path)
        self.lock_timeout_seconds = lock_timeout_seconds

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Blocking (run it off the event loop): one writer at a time across processes."""
        lock_path = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError("CONFIG_ERROR", f"cannot open {lock_path}: {exc.strerror}") from None
        try:
            deadline = time.monotonic() + self.lock_timeout_seconds
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise Unavailable("LOCK_TIMEOUT", f"another process holds {lock_path}") from None
                    time.sleep(0.02)
            yield
        finally:
            os.close(fd)

    def _doc(self) -> dict[str, Any]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {"uomp_witness": WITNESS_VERSION, "gateways": {}}
        except OSError as exc:
            raise ConfigError("CONFIG_ERROR", f"cannot read {self.path}: {exc.strerror}") from None
        if len(raw) > MAX_WITNESS_BYTES:
            raise ConfigError("CONFIG_ERROR", f"{self.path} is too large to be a checkpoint record")
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if (
            not isinstance(doc, dict)
            or doc.get("uomp_witness") != WITNESS_VERSION
            or not isinstance(doc.get("gateways"), dict)
        ):
            raise ConfigError(
                "CONFIG_ERROR",
                f"{self.path} is not a checkpoint record; restore it from a backup "
                "(deleting it makes the agent trust the next checkpoint it sees)",
            )
        return doc

    def get(self, gateway: str) -> Kept | None:
        entry = self._doc()["gateways"].get(gateway)
        if entry is None:
            return None
        try:
            kept = Kept(
                str(entry["verifier_key"]),
                int(entry["tree_size"]),
                base64.b64decode(entry["root"]),
                str(entry["checkpoint"]),
            )
        except (KeyError, TypeError, ValueError, binascii.Error):
            raise ConfigError("CONFIG_ERROR", f"{self.path}: the record for {gateway} is malformed") from None
        # what the record says is checked like any checkpoint: the file is not a trust root of its own
        cp = open_checkpoint(kept.checkpoint, kept.verifier_key)
        if (cp.size, cp.root) != (kept.tree_size, kept.root):
            raise ConfigError("CONFIG_ERROR", f"{self.path}: the record for {gateway} does not match its checkpoint")
        return kept

    def put(self, gateway: str, kept: Kept) -> None:
        doc = self._doc()
        doc["gateways"][gateway] = kept.to_json()
        atomic_write(self.path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), mode=0o600)
