"""Sealing an agent's payload for upload (spec §15.6; docs/payloads.md), for :meth:`UompClient.upload_payload`.

Small payloads (``bytes`` whose sealed form is at most :data:`JSON_MAX_SEALED`) travel as the JSON
envelope. Everything else is sealed first into a private temporary file (0600, removed afterwards),
in 1 MiB blocks, counting its SHA-256 and length as it goes (the envelope must name them before the
body is sent), then streamed from that file: memory stays constant whatever the size. Only
:mod:`gateway.core` is used here (no server code).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import secrets
import tempfile
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from gateway.client.errors import ProtocolError
from gateway.core import envelope, sealing
from gateway.core.envelope import Envelope
from gateway.core.tokens import iso

JSON_MAX_SEALED = 256 * 1024  # sealed bytes sent inside the JSON envelope; larger: the streaming form
READ_BLOCK = 1024 * 1024
HASH_AHEAD = 4  # sealed blocks handed to the hashing thread and not yet hashed, at most


def new_payload_id() -> str:
    """A fresh random payload id."""
    return "pay_" + secrets.token_urlsafe(18)


def _envelope(binding: sealing.Binding, encryption: dict[str, str], size: int, digest: str) -> Envelope:
    return Envelope(
        binding.payload_id,
        binding.session_id,
        binding.agent_id,
        iso(time.time()),
        encryption,
        binding.format,
        size,
        digest,
    )


def seal_small(recipient: X25519PublicKey, binding: sealing.Binding, data: bytes) -> dict[str, Any]:
    """The JSON envelope for a payload held in memory."""
    encryption, sealed = sealing.seal_bytes(recipient, binding, data)
    env = _envelope(binding, encryption, len(sealed), sealing.ciphertext_hash(sealed))
    return {**env.header(), "ciphertext": base64.b64encode(sealed).decode()}


@dataclass
class SealedFile:
    """A payload sealed to a temporary file, with the envelope that describes it."""

    path: Path
    envelope: Envelope

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def seal_to_file(
    recipient: X25519PublicKey,
    binding: sealing.Binding,
    source: bytes | os.PathLike[str],
    *,
    directory: str | None = None,
) -> SealedFile:
    """Seal ``source`` (bytes, or a file read in blocks) into a private temporary file.

    This thread reads, encrypts and writes; one worker thread counts the SHA-256 of the same sealed
    blocks meanwhile (hashlib, the AEAD and file writes let go of the GIL on large buffers, so the
    two overlap), at most :data:`HASH_AHEAD` blocks behind. A bytes-like ``source`` is read in
    place, not copied: the caller must not change it until this returns. On any error or interrupt
    the worker is stopped, the file removed, and the error raised.
    """
    sealer = sealing.Sealer(recipient, binding)
    fd, name = tempfile.mkstemp(prefix="uomp-payload-", suffix=".sealed", dir=directory)
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as out, ThreadPoolExecutor(1, thread_name_prefix="uomp-seal-hash") as hasher:
            hashing: deque[Future[None]] = deque()

            def put(b: bytes | bytearray) -> None:
                # Each block is a new object nobody changes afterwards, so the worker may read it while
                # this thread goes on; a single worker takes them in order.
                nonlocal size
                if b:
                    if len(hashing) == HASH_AHEAD:
                        hashing.popleft().result()
                    hashing.append(hasher.submit(digest.update, b))
                    out.write(b)
                    size += len(b)

            put(sealer.prefix)
            if isinstance(source, bytes | bytearray | memoryview):
                view = memoryview(source)
                for at in range(0, len(view), READ_BLOCK):
                    put(sealer.update(view[at : at + READ_BLOCK]))
            else:
                block = bytearray(READ_BLOCK)  # reused: the sealer copies whatever it keeps of a block
                read = memoryview(block)
                with open(source, "rb") as src:
                    while n := src.readinto(block):
                        put(sealer.update(read[:n]))
            put(sealer.finish())
            for pending in hashing:
                pending.result()
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise
    return SealedFile(Path(name), _envelope(binding, sealer.encryption(), size, "sha256:" + digest.hexdigest()))


def check_format(fmt: str) -> None:
    """ValueError unless ``fmt`` is a media type."""
    if not isinstance(fmt, str) or not envelope.FORMAT.fullmatch(fmt):
        raise ValueError("format must be a media type such as text/markdown")


def check_answer(answer: dict[str, Any], payload_id: str, digest: str, session_id: str) -> str:
    """The ``payload_id`` of an upload's answer, once it names the payload and hash that were sent."""
    if answer.get("payload_id") != payload_id or answer.get("hash") != digest:
        raise ProtocolError(
            "BAD_RESPONSE", "the gateway's answer does not name the payload and hash sent", None, session_id
        )
    return payload_id
