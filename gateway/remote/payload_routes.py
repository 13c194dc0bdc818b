"""The payload relay's routes on the gateway (spec §15.4, §15.6; docs/payloads.md for the bytes).

Plugged in with :func:`gateway.remote.app.register_route`, so the request path up to the handler is
the gateway's usual one: transport identity (client certificate, or DPoP on the tunnel listener),
the access token with its binding, the session's status from the Auth Service. Then:

* ``POST /v1/payload/upload``: one sealed payload. Either the JSON envelope (``Content-Type:
  application/json``, at most ``payload_max_json_bytes``) or the streaming form
  (``Content-Type: application/octet-stream``, the envelope without ``ciphertext`` in the
  ``X-UOMP-Payload-Envelope`` header, the sealed bytes as the body). Checked before a byte is
  stored: the envelope's shape, ``session_id`` and ``agent_id`` against the token, the declared
  size against the caps. The body streams to a temporary file in bounded pieces (never whole in
  memory; an upload that sends more than it declared is cut off at once), then its size and
  SHA-256 are checked against the envelope. Answers ``201 {payload_id, hash, size, expires_at}``.
* ``POST /v1/payload/upload-url`` ``{"size": N}``: a single-use upload URL bound to this session
  and agent, at most N bytes, valid ``payload_upload_url_seconds`` (<= 10 min).
* ``PUT /v1/payload/presigned?t=<token>``: uses such a URL (streaming form only). Like every route
  here it still needs the agent's certificate or DPoP proof and access token: a leaked URL alone is
  worth nothing. Spent, late, unknown, or for another session: ``403 UPLOAD_URL_INVALID`` alike.
  The token travels in the query, which the access log never records.
* ``GET /v1/payload/{id}``: agents never read payloads (the user pulls them over the guard's Unix
  socket): the same ``404 NOT_FOUND`` for a payload of another session, the agent's own, and one
  that does not exist, so nothing can be learnt from it.

The store (:mod:`gateway.payloads.store`) is opened here, at start-up, which removes what a crash
left behind (blobs without an index row, stray temporary files); then the sweep (at once, then
every ``payload_gc_interval_seconds``) settles pending rows and records, as one ``payload_refused``
each, the uploads a crash cut short before removing their temporary files. Every SQLite call on
the store runs on one worker thread; file writes run in threads; the sweep too. Nothing of a payload
is ever logged: not its bytes, not the upload-URL token.

Audit: every accepted payload is exactly one ``payload_uploaded`` event in the guard's audit log
(its hash in ``detail``, its id in ``key``, its size in ``request_size``), whatever the crashes and
retries; every upload refused after the token was accepted is a ``payload_refused`` event with the
code. The event and the payload become visible together: the sealed bytes are made durable first
as a *pending* row that no reader sees, holding the event's id (``gw_…``, chosen here); then the
event is written under that id (the guard keeps one event per id, however often it is sent); then
the row is published. A crash between any two steps leaves a pending row, which is settled (the
same event sent again, then published) at start-up, by the sweep every
``payload_gc_interval_seconds``, or when the agent sends the same upload again. Idempotent retries:
an upload whose ``payload_id`` is stored or pending with the same session, agent, format, size and
hash is answered ``201`` with the stored entry (without reading its body, and with no second
``payload_uploaded``; the retry's own request is a ``payload_upload`` access event); the same id
with anything else is ``409 PAYLOAD_EXISTS``. When the event cannot be confirmed (the guard went
away mid-call) the answer is ``503 STORE_UNAVAILABLE`` without a ``payload_refused`` (the payload
may yet be accepted): the agent sends the same upload again. (Requests refused before the token was
accepted are ``gateway_access`` events in the gateway's access log, like every request.) All of it
goes through :class:`PayloadAudit`.

Test-only fault points on this path (:func:`gateway.payloads.store.fault_hold`):
``payload_before_write``, ``payload_before_fsync``, ``payload_after_rename`` (store),
``payload_pending``, ``payload_after_event``, ``payload_before_answer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway import contract
from gateway.core import envelope
from gateway.core.envelope import Envelope
from gateway.core.tokens import Capability, iso
from gateway.db import DbWorker
from gateway.errors import ErrorCode, UompError
from gateway.payloads.store import (
    MAX_UPLOAD_URL_TTL,
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
from gateway.remote.app import (
    VERIFIED_AGENT_HEADER,
    VERIFIED_VIA_HEADER,
    Call,
    GatewayState,
    Route,
    _record,
    register_route,
)
from gateway.remote.event_sink import new_event_id

log = logging.getLogger("uomp.gateway.payloads")

WRITE_BLOCK = 1024 * 1024  # body bytes gathered before one write to the temporary file
AUDIT_PATH = "/v1/payload/audit"  # the guard's internal route (Unix socket)
MAX_URL_BODY = 1024
SETTLE_RETRY_SECONDS = 1.0  # a pending payload the guard could not confirm: tried again this soon


def _as_uomp(exc: PayloadError) -> UompError:
    return UompError(exc.code, str(exc))


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
        try:
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
        except PayloadError as exc:
            raise _as_uomp(exc) from None

    async def _stream(self, request: web.Request, upload: PayloadUploading) -> None:
        """The body into ``upload``, in blocks of at most WRITE_BLOCK bytes, each written in a thread."""
        idle = self.cfg.payload_body_idle_timeout_seconds
        pending: list[bytes] = []
        held = 0
        while True:
            chunk = await read_chunk(request, idle)
            if chunk:
                if upload.size + held + len(chunk) > upload.max_bytes:
                    raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, "the body is longer than the envelope's size")
                pending.append(chunk)
                held += len(chunk)
            if held >= WRITE_BLOCK or (not chunk and held):
                block = b"".join(pending)
                pending, held = [], 0
                try:
                    await asyncio.to_thread(upload.write, block)
                except PayloadError as exc:
                    raise _as_uomp(exc) from None
            if not chunk:
                return

    def _precheck(self, session_id: str, size: int) -> None:
        """On the worker: refuse now what the commit would refuse (commit checks again, atomically)."""
        self.store.check_caps(session_id, extra_bytes=size)

    async def _existing(self, call: Call, cap: Capability, env: Envelope) -> PayloadMeta | None:
        """An upload of an id already kept: the same payload again is answered with what is kept
        (settled first when pending); anything else under that id is PAYLOAD_EXISTS."""
        try:
            found = await self.worker.run(self.store.find, env.payload_id)
        except PayloadError as exc:
            raise _as_uomp(exc) from None
        if found is None:
            return None
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
                raise Unsettled(exc.code, str(exc)) from None
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
        if body is None and request.content_length is not None and request.content_length != env.size:
            raise UompError(ErrorCode.PAYLOAD_SIZE_MISMATCH, "Content-Length is not the envelope's size")
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
                await self._stream(request, upload)
            if upload.size != env.size:
                raise UompError(
                    ErrorCode.PAYLOAD_SIZE_MISMATCH, f"the envelope declared {env.size} bytes, {upload.size} arrived"
                )
            digest = upload.hash
            if digest != env.hash:
                raise UompError(ErrorCode.PAYLOAD_HASH_MISMATCH, "the ciphertext does not match the envelope's hash")
            try:  # what commit would refuse (caps), checked before anything is kept
                await self.worker.run(self._precheck, cap.session_id, upload.size)
            except PayloadError as exc:
                raise _as_uomp(exc) from None
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
            raise _as_uomp(exc) from None  # commit removed what it wrote
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


async def read_chunk(request: web.Request, idle: float) -> bytes:
    """The next piece of the body (b"" at its end); a stall of ``idle`` seconds or a dropped
    connection is INVALID_REQUEST (so the refusal is audited like any other)."""
    try:
        async with asyncio.timeout(idle):
            return await request.content.readany()
    except TimeoutError:
        raise UompError(ErrorCode.INVALID_REQUEST, f"the upload sent nothing for {idle:g} s") from None
    except (OSError, aiohttp.ClientError, HttpProcessingError) as exc:  # dropped mid-body
        raise UompError(ErrorCode.INVALID_REQUEST, f"the upload broke off ({type(exc).__name__})") from None


def _cap(call: Call) -> Capability:
    assert call.cap is not None
    return call.cap


async def _json(request: web.Request, limit: int, idle: float) -> Any:
    if request.content_length is not None and request.content_length > limit:
        raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"the JSON body exceeds {limit} bytes; use the streaming form")
    parts: list[bytes] = []
    size = 0
    while chunk := await read_chunk(request, idle):  # (read(n) returns only what has arrived so far)
        size += len(chunk)
        if size > limit:
            raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"the JSON body exceeds {limit} bytes; use the streaming form")
        parts.append(chunk)
    try:
        return json.loads(b"".join(parts))
    except (ValueError, UnicodeDecodeError):
        raise UompError(ErrorCode.INVALID_REQUEST, "the body is not valid JSON") from None


def _header_envelope(request: web.Request) -> Envelope:
    values = request.headers.getall(envelope.HEADER_NAME, [])
    if len(values) != 1:
        raise UompError(
            ErrorCode.INVALID_REQUEST, f"the streaming form needs exactly one {envelope.HEADER_NAME} header"
        )
    return envelope.decode_header(values[0].strip())


async def _answer(call: Call, meta: PayloadMeta) -> web.Response:
    await _record(
        call,
        status=201,
        allowed=True,
        reason=f"payload {meta.payload_id} stored ({meta.hash})" + ("" if call.recorded else ", sent again"),
        code=None,
    )
    return web.json_response(
        {"payload_id": meta.payload_id, "hash": meta.hash, "size": meta.size, "expires_at": iso(meta.expires_at)},
        status=201,
    )


async def _audited(service: PayloadService, call: Call, work: Any) -> web.StreamResponse:
    """Run ``work(holder)``; a refusal is audited in the guard, then raised (the access log has it too)."""
    holder: dict[str, str | None] = {"payload_id": None}
    try:
        meta = await work(holder)
    except Unsettled:
        raise  # not refused: the payload may yet be accepted (the access log has this request)
    except UompError as exc:
        await service.audit.refused(call, _cap(call), holder["payload_id"], exc)
        raise
    return await _answer(call, meta)


async def upload(service: PayloadService, call: Call) -> web.StreamResponse:
    request = call.request

    async def work(holder: dict[str, str | None]) -> PayloadMeta:
        ctype = request.content_type
        if ctype == "application/json":
            env, text = envelope.parse(
                await _json(request, service.cfg.payload_max_json_bytes, service.cfg.payload_body_idle_timeout_seconds),
                streaming=False,
            )
            holder["payload_id"] = env.payload_id
            assert text is not None
            body = envelope.decode_ciphertext(text)
            if len(body) != env.size:
                raise UompError(ErrorCode.PAYLOAD_SIZE_MISMATCH, "the ciphertext's length is not the envelope's size")
            return await service.receive(call, env, max_bytes=service.cfg.payload_max_bytes, body=body)
        if ctype == "application/octet-stream":
            env = _header_envelope(request)
            holder["payload_id"] = env.payload_id
            return await service.receive(call, env, max_bytes=service.cfg.payload_max_bytes, body=None)
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            "Content-Type must be application/json (the envelope) or application/octet-stream (the streaming form)",
        )

    return await _audited(service, call, work)


async def upload_url(service: PayloadService, call: Call) -> web.StreamResponse:
    cap = _cap(call)
    doc = await _json(call.request, MAX_URL_BODY, service.cfg.payload_body_idle_timeout_seconds)
    size = doc.get("size") if isinstance(doc, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < envelope.MIN_SEALED_BYTES:
        raise UompError(ErrorCode.INVALID_REQUEST, 'the body must be {"size": <bytes of the sealed payload>}')
    if size > service.cfg.payload_max_bytes:
        raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"a payload is at most {service.cfg.payload_max_bytes} bytes")
    ttl = min(service.cfg.payload_upload_url_seconds, MAX_UPLOAD_URL_TTL)
    try:
        token, expires = await service.worker.run(
            lambda: service.store.issue_upload_url(
                session_id=cap.session_id, agent_id=cap.agent_id, max_size=size, ttl=ttl
            )
        )
    except PayloadError as exc:
        raise _as_uomp(exc) from None
    url = f"https://{call.request.host}/v1/payload/presigned?t={token}"
    await _record(call, status=201, allowed=True, reason="single-use upload URL issued", code=None)
    return web.json_response(
        {"upload_url": url, "method": "PUT", "max_size": size, "expires_at": iso(expires)}, status=201
    )


_URL_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")


async def presigned(service: PayloadService, call: Call) -> web.StreamResponse:
    request = call.request

    async def work(holder: dict[str, str | None]) -> PayloadMeta:
        cap = _cap(call)
        tokens = request.query.getall("t", [])
        if len(tokens) != 1 or not _URL_TOKEN.fullmatch(tokens[0]):
            raise UompError(ErrorCode.UPLOAD_URL_INVALID, "this upload URL is unknown, used or expired")
        if request.content_type != "application/octet-stream":
            raise UompError(
                ErrorCode.INVALID_REQUEST, "an upload URL takes the streaming form (application/octet-stream)"
            )
        env = _header_envelope(request)
        holder["payload_id"] = env.payload_id
        try:
            sid, aid, max_size = await service.worker.run(service.store.consume_upload_url, tokens[0])
        except PayloadError as exc:
            raise _as_uomp(exc) from None
        if sid != cap.session_id or aid != cap.agent_id:
            raise UompError(ErrorCode.UPLOAD_URL_INVALID, "this upload URL is unknown, used or expired")
        return await service.receive(call, env, max_bytes=min(max_size, service.cfg.payload_max_bytes), body=None)

    return await _audited(service, call, work)


async def agent_get(service: PayloadService, call: Call) -> web.StreamResponse:
    # Agents never read payloads. One answer whatever the id: no existence leak, no store lookup.
    raise UompError(ErrorCode.NOT_FOUND, "no such payload")


ROUTES = (
    (Route("POST", re.compile(r"/v1/payload/upload"), "payload_upload"), upload),
    (Route("POST", re.compile(r"/v1/payload/upload-url"), "payload_upload_url"), upload_url),
    (Route("PUT", re.compile(r"/v1/payload/presigned"), "payload_presigned"), presigned),
    (Route("GET", re.compile(r"/v1/payload/(?P<pid>[^/]+)"), "payload_get"), agent_get),
)


def install(state: GatewayState) -> PayloadService:
    """Open the store (removing crash leftovers) and register the routes; the caller starts and closes it."""
    service = PayloadService(state)
    for route, handler in ROUTES:
        register_route(state, route, functools.partial(handler, service))
    return service


__all__ = ["PayloadAudit", "PayloadService", "install"]
