"""Forwarding a verified request to the Memory Guard (:func:`forward`, the handler of every row
without its own): allow-listed headers, the gateway's assertion, a bounded body, the guard's
answer streamed back and its event recorded."""

from __future__ import annotations

import logging

from gateway import contract, httpd
from gateway.errors import ErrorCode, UompError
from gateway.remote.call import EVENT_ID_LOWER, assertion_block, error_code, record
from gateway.remote.guard_client import CHUNK, FORWARD_REQUEST_HEADERS, FORWARD_RESPONSE_HEADERS
from gateway.remote.request import Call
from gateway.remote.state import GatewayState

log = logging.getLogger("uomp.gateway")

MAX_UPSTREAM_ERROR_BYTES = 64 * 1024


async def forward(call: Call) -> httpd.AnyResponse:
    """A verified request to the guard (allow-listed headers and the assertion) and its answer back."""
    state: GatewayState = call.state
    request = call.request
    assert call.target is not None and call.cap is not None and call.token is not None
    # Only allow-listed client headers (each single-valued or harmless: never Authorization or
    # X-UOMP-Agent-Id), the request's id, and the assertion's lines (the verified token and agent).
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_REQUEST_HEADERS}
    headers[contract.VERIFIED_REQUEST_ID_HEADER] = call.request_id
    block = assertion_block(call)
    body: bytes | None = None
    if request.method in ("POST", "PUT"):
        if request.content_length is not None and request.content_length > state.cfg.max_body_bytes:
            raise UompError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"request body exceeds {state.cfg.max_body_bytes} bytes",
                session_id=call.cap.session_id,
            )
        # The whole body (one read() returns only what has arrived so far), bounded.
        parts: list[bytes] = []
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > state.cfg.max_body_bytes:
                raise UompError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"request body exceeds {state.cfg.max_body_bytes} bytes",
                    session_id=call.cap.session_id,
                )
            parts.append(chunk)
        body = b"".join(parts)
    path = call.target.upstream_target
    upstream = await state.forwarder.request(request.method, path, headers, body=body, block=block)
    try:
        if upstream.status >= 500 and upstream.content_type != "application/json":
            raise UompError(ErrorCode.UPSTREAM_ERROR, "the memory guard answered with an invalid response")
        # The guard's quota header passes through: its counter is the only one.
        headers_out = {}
        for k, v in upstream.headers:
            low = k.lower()
            if low in FORWARD_RESPONSE_HEADERS:
                headers_out[k] = v
            if low == EVENT_ID_LOWER:
                # The guard wrote this request's one event (with the gateway's fields): nothing to add here.
                call.recorded = True
        if upstream.status >= 400:
            # A refusal is small: read it whole (bounded) so the access log records the guard's code.
            raw = await upstream.read(MAX_UPSTREAM_ERROR_BYTES)
            code = error_code(raw) or f"HTTP_{upstream.status}"
            await record(call, status=upstream.status, allowed=False, reason="refused by the memory guard", code=code)
            return httpd.Response(body=raw, status=upstream.status, headers=headers_out)
        if upstream.body is not None:  # read whole already (every JSON answer of the guard)
            await record(call, status=upstream.status, allowed=True, reason="forwarded", code=None)
            return httpd.Response(body=upstream.body, status=upstream.status, headers=headers_out)
        resp = httpd.StreamResponse(status=upstream.status, headers=headers_out)
        if upstream.content_length is not None:
            resp.content_length = upstream.content_length
        await record(call, status=upstream.status, allowed=True, reason="forwarded", code=None)
        await resp.prepare(request)
        try:
            async for chunk in upstream.iter_chunks(CHUNK):
                await resp.write(chunk)
        except UompError as exc:  # timed out or broken mid-response: the status line is already sent
            log.warning("upstream %s mid-response on %s", exc.code, call.route.name if call.route else "?")
            resp.force_close()
            return resp
        await resp.write_eof()
        return resp
    finally:
        upstream.release()
