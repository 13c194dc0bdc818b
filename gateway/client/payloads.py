"""Sealing an agent's payload for upload (spec §15.6; docs/payloads.md), for :meth:`UompClient.upload_payload`.

Small payloads (``bytes`` whose sealed form is at most :data:`JSON_MAX_SEALED`) travel as the JSON
envelope. Everything else is sealed in 1 MiB blocks while it is sent (:class:`SealedStream`), in the
streaming form whose hash follows the bytes (:data:`gateway.core.envelope.HASH_TRAILER`); a retry
seals the same bytes again and names their hash in the envelope. Nothing sealed is kept on disk or
in memory: memory stays constant whatever the size. :func:`seal_to_file` seals into a private
temporary file instead (0600), for callers that want the sealed bytes. Only :mod:`gateway.core` is
used here (no server code).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import os
import queue
import secrets
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from gateway.client.errors import ProtocolError
from gateway.core import envelope, sealing
from gateway.core.envelope import Envelope
from gateway.core.tokens import iso

JSON_MAX_SEALED = 256 * 1024  # sealed bytes sent inside the JSON envelope; larger: the streaming form
READ_BLOCK = 1024 * 1024
HASH_AHEAD = 4  # sealed blocks handed to the hashing thread and not yet hashed, at most
PASS_AHEAD = 4  # sealed blocks a SealedStream's pass holds for its sender, at most
PASS_POLL = 0.1  # seconds between looks at whether the other side of a pass went away
# The body is handed to the transport in pieces of this size: what a socket does not take at once
# asyncio's transport copies into its own growing buffer and moves along as it drains (on Python
# 3.11 most of an upload's CPU went there with 1 MiB writes); a piece this size mostly goes at once.
SEND_SLICE = 64 * 1024


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


class SealStopped(Exception):
    """A pass of :class:`SealedStream` was given up (its sender went away)."""


def seal_blocks(
    sealer: sealing.Sealer,
    source: bytes | bytearray | os.PathLike[str],
    sink: Callable[[bytes | bytearray], object],
    stop: threading.Event | None = None,
) -> tuple[int, str]:
    """Seal ``source`` (bytes, or a file read in :data:`READ_BLOCK` blocks), each sealed block to
    ``sink`` in order; (sealed length, ``sha256:<hex>`` of the sealed bytes).

    This thread reads and encrypts; one worker thread counts the SHA-256 of the same sealed blocks
    meanwhile (hashlib, the AEAD and file writes let go of the GIL on large buffers, so the two
    overlap), at most :data:`HASH_AHEAD` blocks behind. Each block is a new object nobody changes
    afterwards. A bytes-like ``source`` is read in place, not copied: the caller must not change it
    until this returns. ``stop``, once set, makes the next block raise :class:`SealStopped`. On any
    error the worker is stopped and the error raised.
    """
    digest = hashlib.sha256()
    size = 0
    with ThreadPoolExecutor(1, thread_name_prefix="uomp-seal-hash") as hasher:
        hashing: deque[Future[None]] = deque()

        def put(b: bytes | bytearray) -> None:
            nonlocal size
            if b:
                if stop is not None and stop.is_set():
                    raise SealStopped("sealing was given up")
                if len(hashing) == HASH_AHEAD:
                    hashing.popleft().result()
                hashing.append(hasher.submit(digest.update, b))  # one worker: in order
                sink(b)
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
    return size, "sha256:" + digest.hexdigest()


def seal_to_file(
    recipient: X25519PublicKey,
    binding: sealing.Binding,
    source: bytes | bytearray | os.PathLike[str],
    *,
    directory: str | None = None,
) -> SealedFile:
    """Seal ``source`` into a private temporary file (:func:`seal_blocks`); on any error or
    interrupt the file is removed and the error raised."""
    sealer = sealing.Sealer(recipient, binding)
    fd, name = tempfile.mkstemp(prefix="uomp-payload-", suffix=".sealed", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            size, digest = seal_blocks(sealer, source, out.write)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise
    return SealedFile(Path(name), _envelope(binding, sealer.encryption(), size, digest))


@dataclass(frozen=True)
class _End:
    digest: str


@dataclass(frozen=True)
class _Failed:
    error: BaseException


CHANGED = "the payload's source changed length while it was sealed"


def _slices(block: bytes | bytearray) -> Iterator[memoryview]:
    view = memoryview(block)
    for at in range(0, len(view), SEND_SLICE):
        yield view[at : at + SEND_SLICE]


class SealedStream:
    """One large payload, sealed while it is sent, as often as it must be sent (no sealed copy on
    disk or in memory).

    Every pass seals the source anew with the same file key, nonce and ephemeral key, so every pass
    yields the same bytes: a retry is the same upload. The first pass is sent in the streaming form
    whose hash follows the bytes (:attr:`envelope`, hash :data:`gateway.core.envelope.HASH_TRAILER`);
    once a pass has run to its end the hash is known (:attr:`digest`) and a retry names it in the
    envelope (:meth:`named`), so the relay can tell it is the upload it may already hold. A retry
    after a pass cut short first seals once without sending to learn the hash (:meth:`learn_digest`).
    A source whose bytes change between passes seals to other bytes, which the relay refuses as a
    hash mismatch; one whose length changes fails the pass (ValueError).

    A pass runs in a worker thread at most :data:`PASS_AHEAD` blocks ahead of its sender; it ends
    when the sender stops reading (its generator closed, or :meth:`close`), and :meth:`close` waits
    for it, so nothing reads the source after the upload returns.
    """

    def __init__(
        self, recipient: X25519PublicKey, binding: sealing.Binding, source: bytes | bytearray | os.PathLike[str]
    ) -> None:
        self._recipient = recipient
        self._binding = binding
        self._source = source
        self._keys = {"file_key": os.urandom(32), "nonce": os.urandom(sealing.NONCE_LEN)}
        self._eph = X25519PrivateKey.generate()
        plain = len(source) if isinstance(source, bytes | bytearray) else os.stat(source).st_size
        self.envelope = _envelope(
            binding, self._sealer().encryption(), sealing.sealed_size(plain), envelope.HASH_TRAILER
        )
        self.digest: str | None = None  # sha256:<hex> of the sealed bytes, once a pass has run to its end
        self._stop = threading.Event()
        self._running: asyncio.Future[tuple[int, str]] | None = None

    def _sealer(self) -> sealing.Sealer:
        return sealing.Sealer(self._recipient, self._binding, eph=self._eph, **self._keys)

    def named(self) -> Envelope:
        """The envelope naming the hash (known once a pass ran to its end)."""
        assert self.digest is not None
        return dataclasses.replace(self.envelope, hash=self.digest)

    def _sealed(self, size: int, digest: str) -> None:
        if size != self.envelope.size:
            raise ValueError(CHANGED)
        if self.digest is not None and digest != self.digest:
            raise ValueError("the payload's source changed while it was sent")
        self.digest = digest

    async def learn_digest(self) -> str:
        """The sealed bytes' hash: sealed once more without sending, unless a pass already told it."""
        if self.digest is None:
            async for _ in self.body(trailer=False):
                pass
        assert self.digest is not None
        return self.digest

    async def body(self, *, trailer: bool) -> AsyncGenerator[bytes | memoryview, None]:
        """One pass as a request body: the sealed bytes in :data:`SEND_SLICE` pieces as they are
        made, then (``trailer``) their raw SHA-256. Raises, so the request is broken off rather than
        completed, if the seal fails or brings other than the declared length."""
        await self.close()
        pieces: queue.Queue[bytes | bytearray | _End | _Failed] = queue.Queue(PASS_AHEAD)
        self._stop = stop = threading.Event()

        def give(item: bytes | bytearray | _End | _Failed) -> None:
            while not stop.is_set():
                try:
                    pieces.put(item, timeout=PASS_POLL)
                    return
                except queue.Full:
                    continue
            raise SealStopped("the sender went away")

        def run() -> tuple[int, str]:
            try:
                size, digest = seal_blocks(self._sealer(), self._source, give, stop)
            except BaseException as exc:
                with contextlib.suppress(SealStopped):
                    give(_Failed(exc))
                raise
            with contextlib.suppress(SealStopped):
                give(_End(digest))
            return size, digest

        def take() -> bytes | bytearray | _End | _Failed | None:
            while True:
                try:
                    return pieces.get(timeout=PASS_POLL)
                except queue.Empty:
                    if stop.is_set():
                        return None

        self._running = asyncio.ensure_future(asyncio.to_thread(run))
        sent = 0
        try:
            while True:
                item = await asyncio.to_thread(take)
                if isinstance(item, _End):
                    self._sealed(sent, item.digest)
                    if trailer:
                        yield bytes.fromhex(item.digest.removeprefix("sha256:"))
                    return
                if item is None or isinstance(item, _Failed):
                    raise RuntimeError("sealing the payload failed") from (None if item is None else item.error)
                sent += len(item)
                if sent > self.envelope.size:
                    raise ValueError(CHANGED)
                for piece in _slices(item):
                    yield piece
        finally:
            stop.set()

    async def failure(self) -> BaseException | None:
        """Why the last pass failed, if the seal itself did (not its sender); the pass is stopped
        and waited for."""
        running = self._running
        if running is None:
            return None
        self._stop.set()
        with contextlib.suppress(BaseException):
            await asyncio.shield(running)
        if running.cancelled():
            return None
        exc = running.exception()
        return None if isinstance(exc, SealStopped) else exc

    async def close(self) -> None:
        """Stop the pass in progress, if any, and wait until it no longer reads the source."""
        self._stop.set()
        running, self._running = self._running, None
        if running is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(running)


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
