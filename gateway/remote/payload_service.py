"""The payload relay's service on the gateway: the store on its worker thread, uploads streamed to
disk within their limits, and each payload's events in the guard's one log (:class:`PayloadAudit`);
the routes that use it are :mod:`gateway.remote.payload_routes`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
from typing import Any

from gateway import contract, httpd
from gateway.contract import VERIFIED_AGENT_HEADER, VERIFIED_VIA_HEADER
from gateway.core import envelope
from gateway.core.capability import Capability
from gateway.core.envelope import Envelope
from gateway.db import DbWorker
from gateway.errors import ErrorCode, UompError
from gateway.payloads.store import (
    STORED,
    Interrupted,
    Limits,
    PayloadError,
    PayloadMeta,
    PayloadStorage,
    PayloadStore,
    PayloadUploading,
    fault_hold,
)
from gateway.remote.event_sink import new_event_id
from gateway.remote.request import Call
from gateway.remote.state import GatewayState

log = logging.getLogger("uomp.gateway.payloads")

WRITE_BLOCK = 1024 * 1024  # body bytes gathered before one write to the temporary file
# the unread body bytes of an upload held before reading pauses (it resumes below half): a small
# buffer pauses and resumes the socket for nearly every piece a TLS read brings
BODY_BUFFER = WRITE_BLOCK

AUDIT_PATH = "/v1/payload/audit"  # the guard's internal route (Unix socket)
MAX_URL_BODY = 1024
SETTLE_RETRY_SECONDS = 1.0  # a pending payload the guard could not confirm: tried again this soon


class Unsettled(UompError):
    """The payload is stored pending, but its event was not confirmed: no refusal is recorded (a
    retry or the sweep settles it)."""


class PayloadAudit:
    """The one place payload events are written (today: the guard's audit log over its socket)."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    @staticmethod
    def origin(call: Call) -> dict[str, str]:
        """The request's audit fields as the guard takes them (kept with a pending row, so that an
        event settled later carries the fields of the request that sent the payload)."""
        headers = {
            VERIFIED_VIA_HEADER: (f"gateway:mtls:{call.identity.serial}" if call.identity else f"gateway:{call.via}"),
            contract.VERIFIED_LISTENER_HEADER: call.via,
            contract.VERIFIED_REQUEST_ID_HEADER: call.request_id,
        }
        if call.request.remote:
            headers[contract.VERIFIED_CLIENT_HEADER] = call.request.remote
        if call.identity is not None:
            headers[contract.VERIFIED_SERIAL_HEADER] = call.identity.serial
            headers[contract.VERIFIED_X5T_HEADER] = call.identity.x5t_s256
        return headers

    async def _post(self, origin: dict[str, str], body: dict[str, Any]) -> None:
        headers = {**origin, VERIFIED_AGENT_HEADER: body["agent_id"]}
        status, answer = await self.state.forwarder.json_call("POST", AUDIT_PATH, body=body, headers=headers)
        if status != 200 or answer.get("recorded") is not True:
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE, "the audit log did not record the payload event; nothing was kept"
            )

    async def _send(self, call: Call, body: dict[str, Any]) -> None:
        await self._post(self.origin(call), body)
        call.recorded = True  # one event per request: the guard wrote it, with the gateway's fields

    async def settle(self, meta: PayloadMeta) -> None:
        """(Re)send a pending row's ``payload_uploaded`` under its event id (kept once by the guard)."""
        assert meta.event_id is not None
        await self._post(dict(meta.origin or {}), self._uploaded_body(meta))

    @staticmethod
    def _uploaded_body(meta: PayloadMeta) -> dict[str, Any]:
        return {
            "action": "payload_uploaded",
            "session_id": meta.session_id,
            "agent_id": meta.agent_id,
            "payload_id": meta.payload_id,
            "hash": meta.hash,
            "size": meta.size,
            "format": meta.format,
            "event_id": meta.event_id,
        }

    async def interrupted(self, item: Interrupted) -> None:
        """The removal at start-up of an upload a crash cut short (never answered, never stored)."""
        await self._post(
            {VERIFIED_VIA_HEADER: "gateway:recovery", contract.VERIFIED_LISTENER_HEADER: "gateway"},
            {
                "action": "payload_refused",
                "session_id": item.session_id,
                "agent_id": item.agent_id,
                "payload_id": item.payload_id,
                "code": ErrorCode.STORE_UNAVAILABLE,
                "reason": "the upload was cut short by a gateway crash; its partial bytes were removed at "
                "start-up: send it again",
                "event_id": item.event_id,
            },
        )

    async def uploaded(self, call: Call, meta: PayloadMeta) -> None:
        await self._send(call, self._uploaded_body(meta))

    async def refused(self, call: Call, cap: Capability, payload_id: str | None, exc: UompError) -> None:
        """Best effort: a refusal is answered even when the guard cannot record it (the gateway's
        access log has it in any case)."""
        body = {
            "action": "payload_refused",
            "session_id": cap.session_id,
            "agent_id": cap.agent_id,
            "payload_id": payload_id,
            "code": exc.code,
            "reason": exc.message[:200],
        }
        try:
            await self._send(call, body)
        except UompError as err:
            log.warning("a refused payload upload could not be audited in the guard (%s)", err.code)


class PayloadService:
    """The relay's upload side: sealed payloads in, bounded, each recorded once in the guard's log."""

    def __init__(self, state: GatewayState) -> None:
        cfg = state.cfg
        self.state = state
        self.cfg = cfg
        self.limits = Limits(
            max_bytes=cfg.payload_max_bytes,
            max_per_session=cfg.payload_max_per_session,
            max_bytes_per_session=cfg.payload_max_bytes_per_session,
            ttl_seconds=cfg.payload_ttl_seconds,
        )
        store = PayloadStore(state.paths.payload_dir, limits=self.limits)
        removed = store.recover()  # what a crash left; pending rows and interrupted uploads are settled in start()
        if removed:
            log.info("removed %d unfinished payload upload file(s) left by a crash", removed)
        self.store: PayloadStorage = store
        self.worker = DbWorker("payloads", what="payload store")
        self.audit = PayloadAudit(state)
        self._gc_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # a pending payload to settle before the next round

    # ----------------------------------------------------------------------- life cycle

    def start(self) -> None:
        if self._gc_task is None:
            self._gc_task = asyncio.get_running_loop().create_task(self._gc_loop())

    async def _gc_loop(self) -> None:
        interval = max(self.cfg.payload_gc_interval_seconds, 0.05)
        failing = False
        while True:
            wait = interval
            self._wake.clear()
            try:
                await self.settle_pending()
                failing = False
            except Exception as exc:  # the guard may not answer yet (start-up, a restart): retry soon
                if not failing:
                    log.warning(
                        "settling pending payloads failed (%s); retrying every %g s",
                        type(exc).__name__,
                        SETTLE_RETRY_SECONDS,
                    )
                failing = True
                wait = min(interval, SETTLE_RETRY_SECONDS)
            try:
                removed = await self.worker.run(self.store.gc)
                if removed:
                    log.info("removed %d expired payload(s)", removed)
            except Exception as exc:  # keep sweeping; the next round retries
                log.warning("payload expiry sweep failed (%s)", type(exc).__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    def settle_soon(self) -> None:
        """A pending payload could not be settled in its request: the sweep tries again shortly."""
        asyncio.get_running_loop().call_later(SETTLE_RETRY_SECONDS, self._wake.set)

    async def settle_pending(self) -> int:
        """Settle every pending row (a crash, or a guard that went away, between the durable bytes
        and the published row): its event again under its id, then publish; and record the removal
        of every upload a crash cut short (``payload_refused``, under an id derived from its
        temporary file, so kept once), then remove its file. How many."""
        done = 0
        if isinstance(self.store, PayloadStore):
            for item in list(self.store.interrupted):
                await self.audit.interrupted(item)
                await self.worker.run(self.store.forget_interrupted, item)
                done += 1
        for meta in await self.worker.run(self.store.pending):
            await self._settle(meta)
            done += 1
        if done:
            log.info("settled %d pending payload(s)", done)
        return done

    async def _settle(self, meta: PayloadMeta) -> PayloadMeta:
        await self.audit.settle(meta)
        return await self.worker.run(self.store.publish, meta.payload_id)

    async def close(self) -> None:
        if self._gc_task is not None:
            self._gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gc_task
            self._gc_task = None
        self.worker.close()
        self.store.close()

    # ---------------------------------------------------------------------- receiving

    def _check_binding(self, cap: Capability, env: Envelope) -> None:
        if env.session_id != cap.session_id:
            raise UompError(ErrorCode.ACCESS_DENIED, "the envelope's session_id is not the token's session")
        if env.agent_id != cap.agent_id:
            raise UompError(ErrorCode.AGENT_MISMATCH, "the envelope's agent_id is not the token's agent")

    async def _begin(self, cap: Capability, env: Envelope) -> PayloadUploading:
        return await self.worker.run(
            lambda: self.store.begin(
                payload_id=env.payload_id,
                session_id=cap.session_id,
                agent_id=cap.agent_id,
                format=env.format,
                encryption=env.encryption,
                max_bytes=env.size,
            )
        )

    async def _stream(self, request: httpd.Request, upload: PayloadUploading, trailer: bytearray | None) -> None:
        """The body into ``upload`` in blocks of about WRITE_BLOCK bytes, each written (and hashed)
        in a thread while the next is read. Held at most: the block being written, the one being
        gathered, and the server's buffer (about BODY_BUFFER), whatever the payload's size. The pieces
        are the bytes as they came off the wire, never joined (only the one the sealed bytes end in
        is cut, when a trailer follows); the upload's own lock keeps an abort from touching the file
        while a write is still running. ``trailer``: the bytes after the envelope's size, at most
        TRAILER_LEN, go there instead of into the upload."""
        loop = asyncio.get_running_loop()
        request.content.set_buffer(BODY_BUFFER)
        reader = BodyReader(request, self.cfg.payload_body_idle_timeout_seconds)
        pieces: list[bytes] = []
        held = 0
        received = upload.size
        writing: asyncio.Future[None] | None = None
        try:
            while True:
                chunk = await reader.read()
                if chunk:
                    received += len(chunk)
                    piece = chunk
                    over = received - upload.max_bytes
                    if over > 0:
                        if trailer is None or over > envelope.TRAILER_LEN:
                            raise UompError(
                                ErrorCode.PAYLOAD_TOO_LARGE,
                                "the body is longer than the envelope's size"
                                + ("" if trailer is None else " and its hash"),
                            )
                        cut = len(chunk) - (over - len(trailer))  # where this chunk passes the size
                        trailer += chunk[cut:]
                        piece = chunk[:cut]
                    if piece:
                        pieces.append(piece)
                        held += len(piece)
                if held >= WRITE_BLOCK or (not chunk and held):
                    if writing is not None:
                        await writing  # the block before is on disk (or its error raised here)
                    writing = loop.run_in_executor(None, write_pieces, upload, pieces)
                    pieces, held = [], 0
                if not chunk:
                    if writing is not None:
                        await writing
                    return
        finally:
            reader.close()
            if writing is not None and not writing.done():
                writing.add_done_callback(_consume)  # its error, if any, is the abort's business now

    def _precheck(self, session_id: str, size: int) -> None:
        """On the worker: refuse now what the commit would refuse (commit checks again, atomically)."""
        self.store.check_caps(session_id, extra_bytes=size)

    async def _existing(self, call: Call, cap: Capability, env: Envelope) -> PayloadMeta | None:
        """An upload of an id already kept: the same payload again is answered with what is kept
        (settled first when pending); anything else under that id is PAYLOAD_EXISTS."""
        found = await self.worker.run(self.store.find, env.payload_id)
        if found is None:
            return None
        if env.trailer:  # its hash is not known yet: a retry names it in the envelope
            raise UompError(
                ErrorCode.PAYLOAD_EXISTS,
                "a payload with this payload_id is stored; a retry of the same bytes names their hash in the "
                "envelope, else choose a new payload_id",
            )
        if not found.same_upload(
            session_id=cap.session_id, agent_id=cap.agent_id, format=env.format, size=env.size, digest=env.hash
        ):
            raise UompError(
                ErrorCode.PAYLOAD_EXISTS,
                "another payload with this payload_id is stored; a retry must "
                "send the same bytes, else choose a new payload_id",
            )
        if found.state != STORED:
            try:
                found = await self._settle(found)
            except PayloadError as exc:
                raise Unsettled(exc.code, exc.message) from None
            except UompError as exc:
                raise Unsettled(exc.code, f"{exc.message}; send the same upload again") from None
        call.recorded = False  # this request's own event: an access event (the payload's one is kept)
        return found

    async def receive(self, call: Call, env: Envelope, *, max_bytes: int, body: bytes | None) -> PayloadMeta:
        """Store one payload (body given, or streamed from the request); see the module docstring."""
        cap = call.cap
        assert cap is not None
        self._check_binding(cap, env)
        request = call.request
        if env.size > max_bytes:
            raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"the payload's declared size exceeds {max_bytes} bytes")
        trailer = bytearray() if env.trailer else None  # only a streamed body has one (envelope.parse)
        length = env.size + (0 if trailer is None else envelope.TRAILER_LEN)
        if body is None and request.content_length is not None and request.content_length != length:
            raise UompError(
                ErrorCode.PAYLOAD_SIZE_MISMATCH,
                "Content-Length is not the envelope's size" + ("" if trailer is None else " plus its 32-byte hash"),
            )
        again = await self._existing(call, cap, env)
        if again is not None:
            return again
        upload = await self._begin(cap, env)
        try:
            fault_hold("payload_before_write")
            if body is not None:
                if len(body) > env.size:
                    raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, "the ciphertext is longer than the envelope's size")
                await asyncio.to_thread(upload.write, body)
            else:
                await self._stream(request, upload, trailer)
            if upload.size != env.size or (trailer is not None and len(trailer) != envelope.TRAILER_LEN):
                raise UompError(
                    ErrorCode.PAYLOAD_SIZE_MISMATCH,
                    f"the envelope declared {env.size} bytes, {upload.size} arrived"
                    if upload.size != env.size
                    else "the sealed bytes must be followed by their 32-byte SHA-256",
                )
            digest, declared = upload.hash, env.hash if trailer is None else "sha256:" + trailer.hex()
            if not hmac.compare_digest(digest, declared):
                where = "the envelope's hash" if trailer is None else "the hash that follows it"
                raise UompError(ErrorCode.PAYLOAD_HASH_MISMATCH, f"the ciphertext does not match {where}")
            env = dataclasses.replace(env, hash=digest)  # a trailer's hash checked: from here on, as if named
            # what commit would refuse (caps), checked before anything is kept
            await self.worker.run(self._precheck, cap.session_id, upload.size)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(upload.abort))
            raise
        event_id = new_event_id()
        origin = self.audit.origin(call)
        try:  # durable but pending (invisible), holding the event's id
            meta = await self.worker.run(
                lambda: upload.commit(declared_hash=env.hash, declared_size=env.size, event_id=event_id, origin=origin)
            )
        except PayloadError as exc:
            if exc.code == ErrorCode.PAYLOAD_EXISTS:  # the same upload, sent twice at once: one payload
                again = await self._existing(call, cap, env)
                if again is not None:
                    return again
            raise  # commit removed what it wrote
        except UompError:
            upload.abort()  # the worker refused the call before commit ran (STORE_BUSY)
            raise
        fault_hold("payload_pending")
        try:
            await self.audit.uploaded(call, meta)  # the payload's one event, durable
        except UompError as exc:
            self.settle_soon()
            raise Unsettled(
                exc.code, "the payload is kept but its audit event is not confirmed; send the same upload again"
            ) from None
        fault_hold("payload_after_event")
        try:
            meta = await self.worker.run(self.store.publish, meta.payload_id)
        except (PayloadError, UompError) as exc:
            self.settle_soon()
            raise Unsettled(
                ErrorCode.STORE_UNAVAILABLE,
                f"the payload's event is recorded but the store did not publish it ({exc}); send the same upload again",
            ) from None
        fault_hold("payload_before_answer")
        return meta


def write_pieces(upload: PayloadUploading, pieces: list[bytes]) -> None:
    """In a thread: append ``pieces`` to ``upload`` in order (no join: each is written and hashed
    as it came off the wire)."""
    for piece in pieces:
        upload.write(piece)


def _consume(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class BodyReader:
    """A request body, piece by piece, each read allowed ``idle`` seconds to bring bytes (a stall is
    INVALID_REQUEST, like a dropped connection, so the refusal is audited like any other).

    One timer serves the whole body: it fires at most once per ``idle`` seconds, and re-arms itself
    for the read in progress instead of each piece creating and cancelling its own deadline. The
    bound is exact: a read still waiting ``idle`` seconds after it began is cancelled then. Use it
    from the task that awaits :meth:`read`; :meth:`close` when done."""

    def __init__(self, request: httpd.Request, idle: float) -> None:
        self.idle = idle
        self._content = request.content
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._since: float | None = None  # when the read in progress began
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self._cancelling = 0

    def _check(self) -> None:
        self._timer = None
        if self._since is None:  # no read waiting: the next read arms the timer again
            return
        due = self._since + self.idle
        if self._loop.time() >= due:
            self._expired = True
            self._cancelling = self._task.cancelling()  # cancellations asked by others before this one
            self._task.cancel()
        else:
            self._timer = self._loop.call_at(due, self._check)

    async def read(self) -> bytes:
        """The next piece (b"" at the body's end): one piece as the server received it, not a join
        of all it holds (no copy here)."""
        if self._expired:
            raise self._stalled()
        self._since = now = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(now + self.idle, self._check)
        try:
            return await self._content.readany()
        except asyncio.CancelledError:
            # ours alone becomes the refusal; one asked by anyone else as well stays a cancellation
            if self._expired and self._task.uncancel() <= self._cancelling:
                raise self._stalled() from None
            raise
        except OSError as exc:  # dropped mid-body, or its bytes were malformed
            raise UompError(ErrorCode.INVALID_REQUEST, f"the upload broke off ({type(exc).__name__})") from None
        finally:
            self._since = None

    def _stalled(self) -> UompError:
        return UompError(ErrorCode.INVALID_REQUEST, f"the upload sent nothing for {self.idle:g} s")

    def close(self) -> None:
        """Stop the timer (the body is read, or abandoned)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._since = None
