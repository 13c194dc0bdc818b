"""Sealed payloads uploaded at a VPS gateway travel home over the uplink, into the home's store.

The ciphertext only: it is sealed to the user's X25519 key, whose private half never leaves home.

How: while the home side is connected, the gateway (the uplink's HTTP/2 client) offers each stored
payload of its relay on a stream of its own (``:authority`` :data:`gateway.uplink.trust.AUTHORITY`,
which no forwarded agent request carries; outside the in-flight budget), one at a time:
``PUT /uplink/v1/payload/<payload_id>``, the §15.6 envelope header in :data:`META_HEADER`, the sealed
bytes as the body, streamed from its file in :data:`BLOCK` pieces within HTTP/2 flow control (no
payload is ever whole in memory at either end). New uploads are seen within :data:`LOOK_SECONDS`.

At home (:class:`Inbox`), before a byte is stored: the path is ``PATH`` + a payload id and nothing
else (no ``/``, ``..`` or escapes reach a file name), the envelope header parses
(:func:`gateway.core.envelope.decode_header`) and names the same id, the size fits the home's
limits; then the key block (the first :data:`gateway.core.sealing.PREFIX_LEN` bytes) must open with
this home's payload key for exactly that payload id, session, agent and format (HPKE and the key
commitment; the body is never decrypted here): a payload sealed to another key, or relabelled, is
refused ``PAYLOAD_INVALID``. The bytes stream into ``payloads/arriving/`` (:class:`gateway.payloads.
store.Arrival`); at the end size and SHA-256 must be the envelope's (else ``PAYLOAD_HASH_MISMATCH``,
and the file is removed), the file is made durable and renamed into ``blobs/``, and its row is
inserted *arriving* (invisible). Then ``payload_arrived`` goes to the guard's audit log (``via``:
the uplink it came over; an id derived from the payload and its hash, so kept once however often it
is sent), and only then is the row published and the gateway answered ``201``. The upload itself
was audited once, at the VPS, when the agent sent it (``payload_uploaded``, through the uplink).

On the VPS, a ``201`` is the acknowledgement: the gateway deletes its copy at once (the home holds
it durably; a copy kept on the VPS would only widen what a stolen VPS yields). A refusal (4xx)
keeps it, offered again after :data:`REFUSED_RETRY_SECONDS` (a full session at home may have room
later) until it expires there; a failure (the link broke, 5xx, a time-out) after
:data:`RETRY_SECONDS`. Nothing is resumed mid-file: a broken transfer leaves at home only a part
file, which no reader sees and which is removed (its lock free) when the home side starts, and the
next offer sends it whole again. A row left *arriving* by a crash is settled (its event again, then
published) when the gateway offers it again, or when the home side connects.

Bounds: at most :data:`MAX_ARRIVALS` arrivals at once at home (more: 503 ``STORE_BUSY``); each
read or write of a transfer must move a byte within :data:`IDLE_SECONDS`; the home's answer comes
within :data:`ANSWER_SECONDS` of the last byte.

A little over ~500 lines: both ends of one exchange, the offer and the checks of its taker, kept
together so that the path, the headers and the answers they agree on are written once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, BinaryIO

from gateway.config import Paths
from gateway.core import envelope, sealing
from gateway.core.envelope import Envelope
from gateway.core.tokens import iso
from gateway.db import DbWorker
from gateway.errors import ErrorCode, UompError
from gateway.payloads import userkey
from gateway.payloads.store import (
    ARRIVING,
    PAYLOAD_ID,
    Limits,
    PayloadError,
    PayloadMeta,
    PayloadStorage,
    PayloadStore,
    fault_hold,
)
from gateway.uplink import trust
from gateway.uplink.link import Headers, Link, LinkDown, Stream, StreamReset

log = logging.getLogger("uomp.uplink")

PATH = "/uplink/v1/payload/"
META_HEADER = b"x-uomp-payload-meta"
BLOCK = 256 * 1024  # read from the file / written to it at once
WRITE_BLOCK = 1024 * 1024  # bytes gathered at home before one write in a thread
IDLE_SECONDS = 30.0
ANSWER_SECONDS = 60.0
LOOK_SECONDS = 0.5
RETRY_SECONDS = 5.0
REFUSED_RETRY_SECONDS = 300.0
MAX_ANSWER_BYTES = 16 * 1024
MAX_ARRIVALS = 2


def arrival_event_id(payload_id: str, digest: str) -> str:
    """The id of a payload's ``payload_arrived`` event: the same for every offer of the same bytes."""
    return "gw_" + hashlib.sha256(f"arrived\0{payload_id}\0{digest}".encode()).hexdigest()[:32]


def _refusal_event_id(payload_id: str, code: str) -> str:
    return "gw_" + hashlib.sha256(f"refused-home\0{payload_id}\0{code}".encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------------- VPS


class Outbox:
    """On the VPS: offer every stored payload to home, delete each one home acknowledged."""

    def __init__(self, store: PayloadStorage, worker: DbWorker) -> None:
        self.store = store
        self.worker = worker
        self.look_seconds = LOOK_SECONDS
        self.retry_seconds = RETRY_SECONDS
        self.refused_retry_seconds = REFUSED_RETRY_SECONDS
        self.paused = False  # nothing is offered meanwhile (what is stored waits; the tests hold payloads here)
        self._later: dict[str, float] = {}  # payload id -> (monotonic) not offered again before
        self.relayed = 0
        self.refused = 0
        self.relayed_at: float | None = None
        self.last_refusal: str | None = None

    def snapshot(self) -> dict[str, object]:
        return {
            "relayed": self.relayed,
            "relayed_at": self.relayed_at,
            "refused": self.refused,
            "last_refusal": self.last_refusal,
            "waiting": len(self._later),
        }

    async def follow(self, link: Link, alive: Callable[[], bool]) -> None:
        """Offer what is stored, again and again, while ``alive()`` (the link it runs on is the live one)."""
        loop = asyncio.get_running_loop()
        while alive():
            try:
                metas = await self.worker.run(self.store.list)
            except UompError as exc:
                log.warning("uplink: the payload store cannot be listed (%s)", exc.code)
                metas = []
            now = loop.time()
            held = {m.payload_id for m in metas}
            for pid in [p for p in self._later if p not in held]:
                del self._later[pid]
            for meta in metas:
                if not alive():
                    return
                if self.paused:
                    break
                if self._later.get(meta.payload_id, 0.0) > now:
                    continue
                try:
                    await self.push(link, meta)
                except (UompError, LinkDown, StreamReset, OSError, TimeoutError) as exc:
                    why = exc.message if isinstance(exc, UompError) else type(exc).__name__
                    log.warning("uplink: relaying payload %s home failed (%s); trying again", meta.payload_id, why)
                    self._later[meta.payload_id] = loop.time() + self.retry_seconds
            await asyncio.sleep(self.look_seconds)

    async def push(self, link: Link, meta: PayloadMeta) -> bool:
        """Offer one payload on its own stream; True when home acknowledged it (and it is gone here)."""
        env = Envelope(
            meta.payload_id,
            meta.session_id,
            meta.agent_id,
            iso(meta.created_at),
            {k: str(v) for k, v in meta.encryption.items()},
            meta.format,
            meta.size,
            meta.hash,
        )
        headers: Headers = [
            (b":method", b"PUT"),
            (b":scheme", b"https"),
            (b":authority", trust.AUTHORITY),
            (b":path", (PATH + meta.payload_id).encode()),
            (b"content-type", b"application/octet-stream"),
            (b"content-length", str(meta.size).encode()),
            (META_HEADER, envelope.encode_header(env).encode()),
        ]
        fh = await asyncio.to_thread(self.store.open_blob, meta.payload_id)
        st: Stream | None = None
        sender: asyncio.Task[None] | None = None
        head: asyncio.Task[Headers] | None = None
        try:
            st = link.open_stream(headers, end_stream=False)
            loop = asyncio.get_running_loop()
            sender = loop.create_task(self._send(link, st, fh, meta.size))
            head = loop.create_task(st.response_headers())
            await asyncio.wait({sender, head}, return_when=asyncio.FIRST_COMPLETED)
            if not head.done():
                with contextlib.suppress(StreamReset):  # home may answer early, then reset the rest
                    await sender  # any other failure ends the offer
                async with asyncio.timeout(ANSWER_SECONDS):
                    await asyncio.wait({head})
            raw = head.result()
            status = next((int(v) for k, v in raw if k == b":status" and v.isdigit()), -1)
            body = b""
            async with asyncio.timeout(IDLE_SECONDS):
                while len(body) <= MAX_ANSWER_BYTES and (piece := await st.read_chunk()):
                    body += piece
        finally:
            for t in (sender, head):
                if t is not None:
                    if not t.done():
                        t.cancel()
                    with contextlib.suppress(BaseException):
                        await t  # its outcome is taken here (a failure already ended the offer)
            if st is not None:
                link.forget(st)
            await asyncio.to_thread(fh.close)
        return await self._answered(meta, status, body)

    async def _answered(self, meta: PayloadMeta, status: int, body: bytes) -> bool:
        loop = asyncio.get_running_loop()
        if status == 201:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = {}
            if not isinstance(doc, dict) or doc.get("payload_id") != meta.payload_id or doc.get("hash") != meta.hash:
                raise UompError(ErrorCode.UPSTREAM_ERROR, "the home side's answer does not name the payload sent")
            await self.worker.run(self.store.delete, meta.payload_id)
            self.relayed += 1
            self.relayed_at = time.time()
            self._later.pop(meta.payload_id, None)
            log.info("uplink: payload %s is at home; the copy here is removed", meta.payload_id)
            return True
        code = "?"
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            code = str(json.loads(body)["error"]["code"])[:64]
        if 400 <= status < 500:
            self.refused += 1
            self.last_refusal = f"{meta.payload_id}: {code}"
            self._later[meta.payload_id] = loop.time() + self.refused_retry_seconds
            log.warning(
                "uplink: home refused payload %s (%s); kept here, offered again in %g s",
                meta.payload_id,
                code,
                self.refused_retry_seconds,
            )
            return False
        raise UompError(ErrorCode.UPSTREAM_ERROR, f"the home side answered {status} ({code})")

    async def _send(self, link: Link, st: Stream, fh: BinaryIO, size: int) -> None:
        left = size
        while True:
            block = await asyncio.to_thread(fh.read, min(BLOCK, left)) if left > 0 else b""
            left -= len(block)
            last = left <= 0 or not block
            async with asyncio.timeout(IDLE_SECONDS):
                await link.send_data(st.sid, block, end_stream=last)
            if last:
                return


# ------------------------------------------------------------------------------------ home


Recorder = Callable[[dict[str, Any]], Awaitable[None]]  # one payload event into the guard's audit log


class Inbox:
    """At home: take a payload the gateway offers (see the module's docstring), into this home's store."""

    def __init__(self, paths: Paths, *, via: str, record: Recorder, limits: Limits | None = None) -> None:
        self.paths = paths
        self.via = via  # what the arrival event names as where it came from
        self.record = record
        self.limits = limits or Limits()
        self._store: PayloadStore | None = None
        self._worker: DbWorker | None = None
        self._key: Any = None
        self._busy = 0
        self.idle_seconds = IDLE_SECONDS
        self.arrived = 0
        self.refused = 0
        self.last_refusal: str | None = None

    def snapshot(self) -> dict[str, object]:
        return {"arrived": self.arrived, "refused": self.refused, "last_refusal": self.last_refusal, "busy": self._busy}

    async def _open(self) -> tuple[PayloadStore, DbWorker]:
        if self._store is None or self._worker is None:

            def opening() -> PayloadStore:
                # not PayloadStore.open: its recovery would remove a local gateway's uploads in flight
                store = PayloadStore(self.paths.payload_dir, limits=self.limits)
                removed = store.sweep_arrivals()
                if removed:
                    log.info("uplink: removed %d payload part file(s) of arrivals a crash cut short", removed)
                return store

            worker = DbWorker("uplink-payloads", what="payload store")
            try:
                self._store = await worker.run(opening)
            except BaseException:
                worker.close()
                raise
            self._worker = worker
        return self._store, self._worker

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._store is not None:
            self._store.close()
            self._store = None

    async def settle_arriving(self) -> int:
        """Rows a crash left *arriving*: their event again (kept once), then published. How many."""
        store, worker = await self._open()
        done = 0
        for meta in await worker.run(store.arriving):
            await self._settle(meta)
            done += 1
        return done

    async def _settle(self, meta: PayloadMeta) -> PayloadMeta:
        """The arrival's event, then the row published; refused by the log (not the bytes uploaded): removed."""
        store, worker = await self._open()
        try:
            await self.record(self._arrived(meta))
        except UompError as exc:
            if 400 <= exc.status < 500:  # never visible
                await worker.run(store.delete, meta.payload_id)
            raise
        published = await worker.run(store.publish, meta.payload_id)
        assert isinstance(published, PayloadMeta)
        return published

    @staticmethod
    def _arrived(meta: PayloadMeta) -> dict[str, Any]:
        return {
            "action": "payload_arrived",
            "session_id": meta.session_id,
            "agent_id": meta.agent_id,
            "payload_id": meta.payload_id,
            "hash": meta.hash,
            "size": meta.size,
            "event_id": arrival_event_id(meta.payload_id, meta.hash),
        }

    @staticmethod
    def offer(method: str, path: str, headers: Headers) -> Envelope:
        """The offered payload's envelope; INVALID_REQUEST for anything but one well-formed offer."""
        pid = path[len(PATH) :] if path.startswith(PATH) else ""
        if method != "PUT" or not PAYLOAD_ID.fullmatch(pid):
            raise PayloadError(ErrorCode.INVALID_REQUEST, "an offered payload is PUT /uplink/v1/payload/<payload_id>")
        values = [v for k, v in headers if k == META_HEADER]
        if len(values) != 1:
            raise PayloadError(ErrorCode.INVALID_REQUEST, "an offered payload carries exactly one envelope header")
        env = envelope.decode_header(values[0].decode("ascii", "replace"))
        if env.payload_id != pid:
            raise PayloadError(ErrorCode.INVALID_REQUEST, "the envelope names another payload than the path")
        return env

    def _check_sealed(self, env: Envelope, head: bytes) -> None:
        """The key block opens with this home's payload key for exactly this payload (the body is not read)."""
        if self._key is None:
            self._key = userkey.load_private(self.paths)
        try:
            sealing.Opener(self._key, env.binding(), env.encryption, head)
        except sealing.SealError as exc:
            raise PayloadError(
                ErrorCode.PAYLOAD_INVALID,
                f"the relayed payload is not sealed to this home's payload key for its id, session, agent and "
                f"format ({exc}); refused",
            ) from None

    async def serve(self, link: Link, st: Stream, method: str, path: str) -> None:
        """One offer from the gateway, answered on its stream."""
        env: Envelope | None = None
        counted = False
        try:
            env = self.offer(method, path, st.headers or [])
            if self._busy >= MAX_ARRIVALS:
                raise UompError(ErrorCode.STORE_BUSY, "the home side is taking other payloads; retry shortly")
            self._busy += 1
            counted = True
            meta = await self._take(st, env)
        except UompError as exc:
            if env is not None and 400 <= exc.status < 500:
                await self._refused(env, exc)
            await answer(link, st, exc.status, exc.body())
            return
        finally:
            if counted:
                self._busy -= 1
        await answer(link, st, 201, {"payload_id": meta.payload_id, "hash": meta.hash, "arrived": True})

    async def _refused(self, env: Envelope, exc: UompError) -> None:
        self.refused += 1
        self.last_refusal = f"{env.payload_id}: {exc.code}"
        log.warning("uplink: refused payload %s from the gateway: %s", env.payload_id, exc.message)
        with contextlib.suppress(UompError):  # best effort: the refusal is answered in any case
            await self.record(
                {
                    "action": "payload_refused",
                    "session_id": env.session_id,
                    "agent_id": env.agent_id,
                    "payload_id": env.payload_id,
                    "code": exc.code,
                    "reason": f"relayed from the VPS gateway, refused at home: {exc.message}"[:200],
                    "event_id": _refusal_event_id(env.payload_id, exc.code),
                }
            )

    async def _take(self, st: Stream, env: Envelope) -> PayloadMeta:
        store, worker = await self._open()
        found = await worker.run(store.find, env.payload_id)
        if found is not None:
            if not found.same_upload(
                session_id=env.session_id, agent_id=env.agent_id, format=env.format, size=env.size, digest=env.hash
            ):
                raise PayloadError(ErrorCode.PAYLOAD_EXISTS, "another payload with this id is at home")
            if found.state == ARRIVING:  # a crash between the row and its event: settle it
                return await self._settle(found)
            return found  # already here (the acknowledgement was lost): nothing is read or written again
        if env.size > self.limits.max_bytes:
            raise PayloadError(
                ErrorCode.PAYLOAD_TOO_LARGE, f"a payload at home is at most {self.limits.max_bytes} bytes"
            )
        head = await _read_at_least(st, sealing.PREFIX_LEN, self.idle_seconds)
        self._check_sealed(env, head[: sealing.PREFIX_LEN])
        upload = await worker.run(
            lambda: store.begin_arrival(
                payload_id=env.payload_id,
                session_id=env.session_id,
                agent_id=env.agent_id,
                format=env.format,
                encryption=env.encryption,
                size=env.size,
            )
        )
        try:
            await asyncio.to_thread(upload.write, head)
            pieces: list[bytes] = []
            held = 0
            first = True
            while True:
                async with asyncio.timeout(self.idle_seconds):
                    piece = await st.read_chunk()
                if piece:
                    pieces.append(piece)
                    held += len(piece)
                    if upload.size + held > env.size:
                        raise PayloadError(
                            ErrorCode.PAYLOAD_TOO_LARGE, "the gateway sent more than the envelope's size"
                        )
                if held >= WRITE_BLOCK or (not piece and held):
                    await asyncio.to_thread(_write_all, upload, pieces)
                    pieces, held = [], 0
                    if first:
                        first = False
                        fault_hold("arrival_mid_body")
                if not piece:
                    break
            event_origin = {"arrived_via": self.via}
            meta = await worker.run(
                lambda: upload.commit(
                    declared_hash=env.hash,
                    declared_size=env.size,
                    event_id=arrival_event_id(env.payload_id, env.hash),
                    origin=event_origin,
                )
            )
        except TimeoutError:
            await asyncio.shield(asyncio.to_thread(upload.abort))
            raise UompError(
                ErrorCode.INVALID_REQUEST, f"the gateway sent nothing for {self.idle_seconds:g} s"
            ) from None
        except BaseException:
            await asyncio.shield(asyncio.to_thread(upload.abort))
            raise
        fault_hold("arrival_before_event")
        settled = await self._settle(meta)
        self.arrived += 1
        log.info("uplink: payload %s arrived from the gateway", env.payload_id)
        return settled


def _write_all(upload: Any, pieces: list[bytes]) -> None:
    for piece in pieces:
        upload.write(piece)


async def _read_at_least(st: Stream, n: int, idle: float) -> bytes:
    got = b""
    while len(got) < n:
        try:
            async with asyncio.timeout(idle):
                piece = await st.read_chunk()
        except TimeoutError:
            raise UompError(ErrorCode.INVALID_REQUEST, f"the gateway sent nothing for {idle:g} s") from None
        if not piece:
            raise PayloadError(ErrorCode.PAYLOAD_INVALID, "the relayed payload is shorter than its key block")
        got += piece
    return got


async def answer(link: Link, st: Stream, status: int, doc: dict[str, Any]) -> None:
    """A JSON answer on ``st`` (nothing when the stream or the link is gone)."""
    body = json.dumps(doc).encode()
    with contextlib.suppress(LinkDown, StreamReset):
        link.send_headers(
            st.sid,
            [
                (b":status", str(status).encode()),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            end_stream=False,
        )
        await link.send_data(st.sid, body, end_stream=True)
