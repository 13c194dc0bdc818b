"""The payload relay's routes on the gateway (spec §15.4, §15.6; docs/payloads.md for the bytes).

Plugged in with :func:`gateway.remote.state.register_route`, so the request path up to the handler is
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

import functools
import json
import re
from typing import Any

from gateway import httpd
from gateway.core import envelope
from gateway.core.capability import Capability
from gateway.core.envelope import Envelope
from gateway.core.tokens import iso
from gateway.errors import ErrorCode, UompError
from gateway.payloads.store import (
    MAX_UPLOAD_URL_TTL,
    PayloadMeta,
)
from gateway.remote.call import record
from gateway.remote.payload_service import MAX_URL_BODY, BodyReader, PayloadService, Unsettled
from gateway.remote.request import Call, Route
from gateway.remote.state import GatewayState, register_route


def _cap(call: Call) -> Capability:
    assert call.cap is not None
    return call.cap


async def _json(request: httpd.Request, limit: int, idle: float) -> Any:
    if request.content_length is not None and request.content_length > limit:
        raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"the JSON body exceeds {limit} bytes; use the streaming form")
    parts: list[bytes] = []
    size = 0
    reader = BodyReader(request, idle)
    try:
        while chunk := await reader.read():
            size += len(chunk)
            if size > limit:
                raise UompError(
                    ErrorCode.PAYLOAD_TOO_LARGE, f"the JSON body exceeds {limit} bytes; use the streaming form"
                )
            parts.append(chunk)
    finally:
        reader.close()
    try:
        return json.loads(b"".join(parts))
    except (ValueError, UnicodeDecodeError):
        raise UompError(ErrorCode.INVALID_REQUEST, "the body is not valid JSON") from None


def _header_envelope(request: httpd.Request) -> Envelope:
    values = request.headers.getall(envelope.HEADER_NAME, [])
    if len(values) != 1:
        raise UompError(
            ErrorCode.INVALID_REQUEST, f"the streaming form needs exactly one {envelope.HEADER_NAME} header"
        )
    return envelope.decode_header(values[0].strip(), trailer=True)


async def _answer(call: Call, meta: PayloadMeta) -> httpd.Response:
    await record(
        call,
        status=201,
        allowed=True,
        reason=f"payload {meta.payload_id} stored ({meta.hash})" + ("" if call.recorded else ", sent again"),
        code=None,
    )
    return httpd.json_response(
        {"payload_id": meta.payload_id, "hash": meta.hash, "size": meta.size, "expires_at": iso(meta.expires_at)},
        status=201,
    )


async def _audited(service: PayloadService, call: Call, work: Any) -> httpd.AnyResponse:
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


async def upload(service: PayloadService, call: Call) -> httpd.AnyResponse:
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


async def upload_url(service: PayloadService, call: Call) -> httpd.AnyResponse:
    cap = _cap(call)
    doc = await _json(call.request, MAX_URL_BODY, service.cfg.payload_body_idle_timeout_seconds)
    size = doc.get("size") if isinstance(doc, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < envelope.MIN_SEALED_BYTES:
        raise UompError(ErrorCode.INVALID_REQUEST, 'the body must be {"size": <bytes of the sealed payload>}')
    if size > service.cfg.payload_max_bytes:
        raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"a payload is at most {service.cfg.payload_max_bytes} bytes")
    ttl = min(service.cfg.payload_upload_url_seconds, MAX_UPLOAD_URL_TTL)
    token, expires = await service.worker.run(
        lambda: service.store.issue_upload_url(session_id=cap.session_id, agent_id=cap.agent_id, max_size=size, ttl=ttl)
    )
    url = f"https://{call.request.host}/v1/payload/presigned?t={token}"
    await record(call, status=201, allowed=True, reason="single-use upload URL issued", code=None)
    return httpd.json_response(
        {"upload_url": url, "method": "PUT", "max_size": size, "expires_at": iso(expires)}, status=201
    )


_URL_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")


async def presigned(service: PayloadService, call: Call) -> httpd.AnyResponse:
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
        sid, aid, max_size = await service.worker.run(service.store.consume_upload_url, tokens[0])
        if sid != cap.session_id or aid != cap.agent_id:
            raise UompError(ErrorCode.UPLOAD_URL_INVALID, "this upload URL is unknown, used or expired")
        return await service.receive(call, env, max_bytes=min(max_size, service.cfg.payload_max_bytes), body=None)

    return await _audited(service, call, work)


async def agent_get(service: PayloadService, call: Call) -> httpd.AnyResponse:
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


__all__ = ["install"]
