"""Gateway-served routes for agents, plugged into the router without touching the forwarding path:

* ``POST /v1/sessions/{id}/refresh`` (spec §15.5) — a refresh token, bound to the presenting key
  (client certificate or DPoP key), buys a new access token and a new refresh token from the Auth
  Service over the Unix socket. Rotation and reuse detection live in the Auth Service, atomically.
* ``POST /v1/certificates/renew`` — the agent's current, still valid certificate buys a new one
  for the same agent id (like ``step ca renew``): mTLS listener only, no token. Only in the last
  ``renew_window_fraction`` of the certificate's life (``RENEWAL_TOO_EARLY`` before, decided on
  the event loop from the verified certificate, before any work), one renewal at a time per agent
  and at most ``renew_max_per_agent`` per ``renew_rate_window_seconds`` (``RATE_LIMITED``); the
  signing, registry write and fsync run in a worker thread. Every outcome is a
  ``gateway_access`` event (``action: renew``), the new serial in its reason.
* the tunnel-origin transport: requests that arrive through the Cloudflare quick tunnel carry no
  client certificate (TLS ends at Cloudflare's edge), so each must carry an RFC 9449 DPoP proof
  by the key the token is bound to (``cnf.jkt``). Tunnel traffic is never treated as mTLS.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import ssl
import time
import weakref

from gateway import ca_store, httpd
from gateway.core import ca
from gateway.errors import ErrorCode, UompError, parse_code
from gateway.remote.call import record, verified_headers
from gateway.remote.identity import dpop_identity
from gateway.remote.request import Call, Route
from gateway.remote.state import STATE, GatewayState, register_route

MAX_CSR_BYTES = 16 * 1024


async def refresh(call: Call) -> httpd.AnyResponse:
    """``POST /v1/sessions/{id}/refresh``: the agent's refresh, forwarded to the Auth Service with the gateway's
    assertion."""
    state = call.request.app[STATE]
    assert call.cap is not None and call.token is not None
    headers = verified_headers(call)
    status, body = await state.forwarder.json_call(
        "POST", f"/v1/sessions/{call.cap.session_id}/refresh", headers=headers
    )
    call.recorded = True  # the guard wrote the refresh's one event (rotation or refusal)
    if status >= 400:
        raw_err = body.get("error")
        err: dict[str, object] = raw_err if isinstance(raw_err, dict) else {}
        code = parse_code(err.get("code"), ErrorCode.UPSTREAM_ERROR)
        if code not in (
            ErrorCode.INVALID_TOKEN,
            ErrorCode.TOKEN_EXPIRED,
            ErrorCode.SESSION_REVOKED,
            ErrorCode.SESSION_NOT_FOUND,
            ErrorCode.REFRESH_REUSED,
            ErrorCode.TOKEN_BINDING_MISMATCH,
            ErrorCode.STORE_UNAVAILABLE,
            ErrorCode.STORE_BUSY,
        ):
            code = ErrorCode.UPSTREAM_ERROR
        raise UompError(code, str(err.get("message", "refresh refused"))[:200], session_id=call.cap.session_id)
    await record(call, status=200, allowed=True, reason="refresh token rotated", code=None)
    return httpd.json_response(body)


# Agents with a renewal in progress, per gateway: a second concurrent renewal is refused at once.
_RENEWING: weakref.WeakKeyDictionary[GatewayState, set[str]] = weakref.WeakKeyDictionary()
# Agents the CA found over their renewal rate, per gateway: agent id -> monotonic time until which
# further requests are refused on the event loop without asking the CA again (bounded: agents
# need a certificate from the user's CA, and the map is cleared if it ever gets this big).
_LIMITED: weakref.WeakKeyDictionary[GatewayState, dict[str, float]] = weakref.WeakKeyDictionary()
RATE_LIMIT_MEMORY_SECONDS = 60.0
MAX_LIMITED_AGENTS = 10_000


async def renew_certificate(call: Call) -> httpd.AnyResponse:
    """``POST /v1/certificates/renew``: a new certificate for the presented one, within its rate and window."""
    state = call.request.app[STATE]
    cfg = state.cfg
    request = call.request
    ssl_obj = request.transport.get_extra_info("ssl_object") if request.transport else None
    der = ssl_obj.getpeercert(binary_form=True) if isinstance(ssl_obj, ssl.SSLObject) else None
    ident = call.identity
    if not der or ident is None:
        raise UompError(ErrorCode.CERT_REQUIRED, "renewal needs the current client certificate")
    now = dt.datetime.now(dt.UTC)
    # Pure checks first, on the event loop: an early renewal costs no thread, lock or disk.
    ca_store.check_renewal_window(ident.not_before, ident.not_after, now, cfg.renew_window_fraction)
    limited = _LIMITED.setdefault(state, {})
    if limited.get(ident.agent_id, 0.0) > time.monotonic():
        raise UompError(ErrorCode.RATE_LIMITED, "too many certificate renewals for this agent; try again later")
    busy = _RENEWING.setdefault(state, set())
    if ident.agent_id in busy:
        raise UompError(ErrorCode.RATE_LIMITED, "a renewal for this agent is already in progress")
    busy.add(ident.agent_id)
    try:
        csr = await _read_csr(request)
        pem = await asyncio.to_thread(
            ca_store.renew,
            state.paths,
            der,
            csr,
            ca.AGENT_CERT_LIFETIME,
            now,
            window_fraction=cfg.renew_window_fraction,
            max_per_agent=cfg.renew_max_per_agent,
            rate_window=dt.timedelta(seconds=cfg.renew_rate_window_seconds),
        )
    except UompError as exc:
        if exc.code == ErrorCode.RATE_LIMITED:
            if len(limited) >= MAX_LIMITED_AGENTS:
                limited.clear()
            limited[ident.agent_id] = time.monotonic() + min(
                RATE_LIMIT_MEMORY_SECONDS, float(cfg.renew_rate_window_seconds)
            )
        raise
    finally:
        busy.discard(ident.agent_id)
    cert = ca.load_cert(pem)
    serial = ca.serial_hex(cert.serial_number)
    not_after = cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    await record(
        call,
        status=200,
        allowed=True,
        code=None,
        reason=f"certificate renewed: new serial {serial}, valid until {not_after}",
    )
    return httpd.json_response({"certificate": pem.decode(), "serial": serial, "not_after": not_after})


async def _read_csr(request: httpd.Request) -> bytes | None:
    if not request.can_read_body:
        return None
    if request.content_length is not None and request.content_length > MAX_CSR_BYTES:
        raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, "renewal request too large")
    # the whole body: one read() returns only what has arrived so far (the listener's body
    # deadline bounds the time)
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > MAX_CSR_BYTES:
            raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, "renewal request too large")
        parts.append(chunk)
    raw = b"".join(parts)
    if not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise UompError(ErrorCode.INVALID_REQUEST, "renewal body must be JSON") from exc
    csr_text = body.get("csr") if isinstance(body, dict) else None
    if csr_text is None:
        return None
    if not isinstance(csr_text, str):
        raise UompError(ErrorCode.INVALID_REQUEST, "csr must be a PEM string")
    return csr_text.encode()


ROUTES = (
    (
        Route(
            "POST",
            re.compile(r"/v1/sessions/(?P<sid>[^/]+)/refresh"),
            "refresh",
            token_use="refresh",
            status_check=False,
        ),
        refresh,
    ),
    (
        Route("POST", re.compile(r"/v1/certificates/renew"), "renew", token_use="none", transports=("mtls",)),
        renew_certificate,
    ),
)


def install(state: GatewayState) -> None:
    """Registers the refresh and renewal routes, and the tunnel listener's DPoP identity."""
    for route, handler in ROUTES:
        register_route(state, route, handler)
    state.transport_auth["tunnel"] = dpop_identity
