"""The remote gateway (spec §15): who may in, what may pass, and the record of both.

Every request that :mod:`gateway.httpd` parsed comes to :func:`entry`, whatever its path (an
encoded newline, say, would match no route pattern), so the raw request-target is normalised once
(:mod:`gateway.remote.pathnorm`) before any routing decision. Then, in order:

1. route lookup in :data:`ROUTES` (unknown: 404 NOT_FOUND, §8.4 shape);
2. ``/v1/health`` answers at once, without authentication or detail: 200, or 503 STORE_UNAVAILABLE
   while the guard behind the gateway fails its health checks (``GatewayState.upstream_ok``).
   Before routing, headers: every single-valued header (``Authorization``, ``DPoP``,
   ``X-UOMP-*``, ``Host``, framing) at most once, no client-sent ``X-UOMP-Verified-*``
   (:func:`gateway.contract.header_problem`); the endpoint the request arrived on is the
   listener's own endpoint its ``Host`` names (on TLS, ``Host`` must agree with the SNI name);
3. transport identity: on the mTLS listener the client certificate (chain and purpose were
   checked in the handshake; the URI SAN ``uomp://agent/<id>``, EKU clientAuth, validity period
   and CRL here). A certificate of ours that is revoked, expired or not yet valid is refused
   before step 1, on every route (:func:`gateway.remote.identity.peer_check`: 401 CERT_REQUIRED
   with its ``reason``, the connection closed after the answer). A listener without client
   certificates (the tunnel origin) plugs in its own authenticator;
4. the token (§7.3, §15.2, §15.4): ``Authorization: Bearer`` and ``X-UOMP-Agent-Id``; signature and
   claims (:func:`gateway.core.tokens.verify_token`), then the checks of
   :mod:`gateway.core.checks` in their documented order (token use, profile remote, audience one
   of *this listener's* endpoints, ``allowed_endpoints``, agents, ``cnf`` binding);
5. session status from the Auth Service (cached for at most ``status_cache_seconds`` <= 1 s), on
   the routes the gateway answers itself (refresh, payloads): a forwarded request is checked by the
   guard, which reads the session's status on every request (revocation effective at once, §13.4);
6. the route's handler: forward to the guard (default), or a handler registered by another part
   of the gateway (refresh, payloads) through :func:`register_route`. What is forwarded carries the
   token the gateway verified (never a client header copy) and the verified-identity headers of
   :mod:`gateway.contract`, among them the token's hash, which the guard compares with its own.

One log: every request, allowed or refused, becomes one event in the guard's ledger
before its response is sent. A request the guard answered is recorded by the guard alone (it
answers with :data:`gateway.contract.EVENT_ID_HEADER`), with the gateway's fields handed over as
verified contract headers (listener, client address, certificate serial, request id); what the
gateway decides alone goes through :class:`gateway.remote.event_sink.EventSink`. The read quota is
the guard's alone: the agent sees the guard's ``X-UOMP-Quota-Remaining``.
"""

from __future__ import annotations

import email.utils
import logging
import time
from typing import ClassVar

from gateway import httpd
from gateway.errors import ErrorCode, UompError
from gateway.remote import pathnorm, transport
from gateway.remote.call import (
    bearer_token,
    check_headers,
    check_token,
    error_response,
    record,
    route_params,
    unrecorded_response,
)
from gateway.remote.forward import forward
from gateway.remote.identity import mtls_identity, peer_check
from gateway.remote.request import Call
from gateway.remote.state import LISTENER, STATE, GatewayState

log = logging.getLogger("uomp.gateway")

BODY_BROKEN = "the request body broke off or was malformed"


async def entry(request: httpd.Request) -> httpd.AnyResponse:
    """Every request of a gateway listener: route, identity, checks, then the handler or the forward; one event each."""
    transport.request_started(request)
    state = request.app[STATE]
    listener = request.app[LISTENER]
    started = time.perf_counter()
    call = Call(request, state, via=listener)
    resp: httpd.AnyResponse
    code: str | None = None
    failed: UompError | None = None  # the refusal whose event is written below
    try:
        try:
            resp = await _dispatch(state, call)
        except (UompError, httpd.BodyError) as caught:
            # a body that broke off or was malformed is the client's: INVALID_REQUEST, never INTERNAL
            failed = caught if isinstance(caught, UompError) else UompError(ErrorCode.INVALID_REQUEST, BODY_BROKEN)
            if failed.session_id is None and call.cap is not None:
                failed.session_id = call.cap.session_id
        except Exception as exc:
            log.error("unhandled %s in gateway handler", type(exc).__name__)
            failed = UompError(ErrorCode.INTERNAL, "internal error")
        if failed is not None:
            # Written after the except clauses, not inside one: nothing caught stays "being handled"
            # while this waits for the guard (a compiled coroutine does not restore that state when
            # it suspends), where it would become the context of unrelated exceptions.
            code, resp = failed.code, error_response(failed)
            try:
                await record(call, status=failed.status, allowed=False, reason=failed.message, code=failed.code)
            except UompError as log_exc:  # the event could not be written: the client gets 503, not 500
                code, resp = ErrorCode.STORE_UNAVAILABLE, unrecorded_response(log_exc)
    finally:
        transport.request_finished(request)
    transport.last_answer(request, resp)
    state.metrics.observe_request(call.route.name if call.route else "unknown", code, time.perf_counter() - started)
    return resp


async def _dispatch(state: GatewayState, call: Call) -> httpd.AnyResponse:
    request = call.request
    listener = call.via
    if listener == "mtls":
        peer_check(call)  # a revoked or expired certificate of ours: 401 before anything else
    check_headers(state, call)
    call.target = pathnorm.normalize_target(request.raw_path)
    # the first route of the table (in order) with this method whose pattern matches
    for route in state.routes_for(listener, request.method):
        m = route.pattern.fullmatch(call.target.path)
        if m:
            call.route = route
            call.params = {k: v for k, v in m.groupdict().items() if v is not None}
            break
    else:
        if any(r.pattern.fullmatch(call.target.path) for r in state.routes if listener in r.transports):
            raise UompError(ErrorCode.METHOD_NOT_ALLOWED, "method not allowed on this endpoint")
        raise UompError(ErrorCode.NOT_FOUND, "no such endpoint")
    route = call.route
    assert route is not None
    if not state.access.writable:
        await state.access.ready()  # fail closed while the access log cannot be written (tries one write)
    if not route.auth:
        if (own := route.handler or state.handlers.get(route.name)) is not None:
            return await own(call)  # answers for agents without credentials yet (enroll_routes.py)
        if not state.upstream_ok():
            raise UompError(ErrorCode.STORE_UNAVAILABLE, "the memory guard is unreachable")
        resp = httpd.json_response({"status": "ok"})
        return resp  # health answers are not decisions about anyone's data: not in the log
    await state.transport_auth[listener](call)
    if route.token_use == "none":
        return await (route.handler or state.handlers[route.name])(call)
    call.token = bearer_token(request)
    cap = check_token(state, call, call.token)
    route_params(call)
    # A DPoP proof is recorded (on_authenticated) only for a live session: a revoked agent must not
    # fill the replay cache, so a request with such a hook still asks first (the mTLS path never does).
    if route.status_check or (call.on_authenticated and route.token_use == "access"):
        await state.status.check(call.token, cap, call.token_digest)
    for done in call.on_authenticated:
        if (pending := done()) is not None:
            await pending
    transport.authenticated(request)  # the connection leaves the unverified budget (tunnel listener)
    handler = route.handler or state.handlers.get(route.name, forward)
    return await handler(call)


async def _every_request(request: httpd.Request, _handler: httpd.Handler) -> httpd.AnyResponse:
    # The app's one middleware, unrouted by httpd: entry routes by the gateway's own table.
    return await entry(request)


def _decorate(request: httpd.Request, headers: dict[str, str]) -> None:
    server_headers(headers)


def server_headers(headers: dict[str, str]) -> None:
    """What every answer of a gateway listener carries: ``Server`` (no library or Python version
    advertised to the internet) and ``Date`` (RFC 9110 §6.6.1)."""
    headers["Server"] = "uomp-gateway"
    headers["Date"] = http_date()


class _Clock:
    """Now as an IMF-fixdate, made at most once a second."""

    second: ClassVar[int] = 0
    text: ClassVar[str] = ""

    @classmethod
    def now(cls) -> str:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.text = second, email.utils.formatdate(second, usegmt=True)
        return cls.text


http_date = _Clock.now


def _refusal(status: int) -> httpd.Response:
    resp = httpd.json_response(transport.parse_refusal(status).body(), status=status)  # the transport's status kept
    server_headers(resp.headers)
    return resp


def create_gateway_app(state: GatewayState, *, listener: str) -> httpd.App:
    """The gateway's app for ``listener`` (``mtls``, ``tunnel`` or ``metrics``)."""
    app = httpd.App(middleware=_every_request, refusal=_refusal, decorate=_decorate, routed=False)
    app[STATE] = state
    state.transport_auth.setdefault("mtls", mtls_identity)
    app[LISTENER] = listener
    return app
