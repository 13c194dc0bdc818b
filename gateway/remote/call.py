"""The steps every gateway request goes through: header and token checks, the gateway's
assertion to the guard, the request's one event (:func:`record`), the §8.4 error answer."""

from __future__ import annotations

import time

from gateway import contract, httpd, jsonio
from gateway.contract import (
    AGENT_HEADER,
)
from gateway.core import checks, http1
from gateway.core.capability import Capability
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError, known_code
from gateway.remote.request import Call
from gateway.remote.state import GatewayState, host_key
from gateway.remote.tls import server_name_of

RETRY_AFTER_SECONDS = "2"


def error_response(exc: UompError) -> httpd.Response:
    """The §8.4 error answer of ``exc`` (with ``WWW-Authenticate`` on 401, ``Retry-After`` on 503)."""
    headers = {"WWW-Authenticate": 'Bearer realm="uomp"'} if exc.status == 401 else None
    if exc.status == 503:  # the guard (or the uplink to it, or the shared state) is away or busy: retry after this
        headers = {"Retry-After": RETRY_AFTER_SECONDS}
    return httpd.json_response(exc.body(), status=exc.status, headers=headers)


def bearer_token(request: httpd.Request) -> str:
    """The token of the ``Authorization: Bearer`` (or ``DPoP``) header; INVALID_TOKEN without one."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() not in ("bearer", "dpop") or not value.strip():
        raise UompError(ErrorCode.INVALID_TOKEN, "missing Authorization: Bearer token")
    return value.strip()


def check_headers(state: GatewayState, call: Call) -> None:
    """Before routing: single-valued headers once, no client-sent identity headers, and the endpoint
    the request addressed (this listener's own; on TLS the Host must name the SNI host)."""
    request = call.request
    problem = contract.header_problem(request.raw_headers, verified_allowed=False)
    if problem is not None:
        raise UompError(ErrorCode.INVALID_REQUEST, problem)
    host = request.headers.get("Host", "")
    transport = request.transport
    if call.via == "mtls" and transport is not None:
        ssl_obj = call.ssl_object if call.ssl_object is not None else transport.get_extra_info("ssl_object")
        sni = server_name_of(ssl_obj)
        if sni is not None and host_key(host, "https").rsplit(":", 1)[0].strip("[]") != sni:
            raise UompError(ErrorCode.INVALID_REQUEST, "the Host header does not name the TLS server name (SNI)")
    call.endpoint = state.match_endpoint(call.via, host)


def check_token(state: GatewayState, call: Call, token: str) -> Capability:
    """Verify the token, then run the shared checks (:mod:`gateway.core.checks`) for this listener.

    On an mTLS connection whose earlier request passed all of this with the same token and the same
    request facts (:class:`ConnMemo`), only the token's expiry is looked at again."""
    route = call.route
    assert route is not None
    headers = call.request.headers
    header_agent = headers.get(AGENT_HEADER) or None
    host = headers.get("Host", "")
    key = (route.token_use, call.endpoint, header_agent, host)
    memo = call.memo
    if memo is not None and memo.token == token and memo.generation == state.generation and key in memo.passed:
        cap = memo.cap
        assert cap is not None
        now = time.time()
        if cap.claims.get("exp", 0) > now and cap.expires_at > now:
            call.cap, call.token_digest = cap, memo.digest
            return cap
    generation = state.generation
    cap, call.token_digest = state.verify_digest(token)
    call.cap = cap
    ident = call.identity
    presented = checks.Presented(
        token_use=route.token_use,
        profile="remote",
        audiences=state.listener_endpoints.get(call.via, set()),
        audience_required=True,
        endpoint=call.endpoint,
        check_endpoint=True,
        header_agent=header_agent,
        require_header_agent=True,
        proven_agent=ident.agent_id if ident else None,
        x5t=ident.x5t_s256 if ident else None,
        jkt=ident.jkt if ident else call.jkt,
        binding=checks.BIND_EITHER if ident is not None or call.jkt is None else checks.BIND_JKT,
        host=host,
    )
    checks.run_checks(cap, presented)
    if memo is not None:
        memo.remember(generation, token, cap, call.token_digest, key)
    return cap


def verified_headers(call: Call) -> dict[str, str]:
    """The gateway's assertion to the guard (contract): exactly the token it verified and who proved it."""
    headers = connection_assertion(call)
    headers[contract.VERIFIED_REQUEST_ID_HEADER] = call.request_id
    return headers


def connection_assertion(call: Call) -> dict[str, str]:
    """:func:`verified_headers` but the request id: the same for every request of a connection with
    one token (the client address, listener, certificate and token do not change on it)."""
    assert call.cap is not None and call.token is not None and call.token_digest is not None
    ident = call.identity
    return contract.assertion_headers(
        token=call.token,
        agent_id=call.cap.agent_id,
        listener=call.via,
        via=f"gateway:mtls:{ident.serial}" if ident else f"gateway:{call.via}",
        client=call.request.remote,
        serial=ident.serial if ident else None,
        x5t=ident.x5t_s256 if ident else None,
        jkt=ident.jkt if ident else call.jkt,
        digest=call.token_digest,
    )


def route_params(call: Call) -> None:
    """Key/tag for the audit event, and the own-session rule for the audit route."""
    request, route = call.request, call.route
    assert route is not None
    if route.name == "read_key":
        call.key = call.params.get("key")
    elif route.name in ("read_tag", "aggregate"):
        tags = request.query.getall("tag", [])
        call.tag = tags[0][:128] if len(tags) == 1 else None
    elif route.name == "audit":
        sids = request.query.getall("session_id", [])
        if call.cap is not None and any(s != call.cap.session_id for s in sids):
            raise UompError(
                ErrorCode.ACCESS_DENIED,
                "an agent may read only its own session's audit log",
                session_id=call.cap.session_id,
            )
    elif route.name in ("write", "delete"):
        call.key = call.params.get("key")
    elif (
        route.name in ("deletion_proof", "refresh")
        and call.cap is not None
        and call.params.get("sid") != call.cap.session_id
    ):
        raise UompError(ErrorCode.ACCESS_DENIED, "token is for another session", session_id=call.cap.session_id)


EVENT_ID_LOWER = contract.EVENT_ID_HEADER.lower()


def assertion_block(call: Call) -> http1.HeaderBlock:
    """The header lines of :func:`connection_assertion`, made (and checked) once per mTLS connection
    and token (kept on its :class:`ConnMemo`, dropped when the token changes); the request's own
    headers (its id) are sent after them."""
    memo, remote = call.memo, call.request.remote
    if memo is not None and memo.block is not None and memo.token == call.token and memo.block_remote == remote:
        return memo.block
    block = http1.header_block(connection_assertion(call))
    if memo is not None and memo.token == call.token:
        memo.block, memo.block_remote = block, remote
    return block


def error_code(raw: bytes) -> ErrorCode | None:
    """The §8.4 code of a guard answer's body, or None when it has none."""
    try:
        doc = jsonio.loads(raw)
        code = doc["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return known_code(code)


async def record(call: Call, *, status: int, allowed: bool, reason: str, code: str | None) -> None:
    """Make the request's event durable (in the guard's one log, or the local spool while the guard
    is unreachable) before its answer; STORE_UNAVAILABLE if it cannot be. Nothing when the guard
    already wrote the request's event.

    An event without a verified session is rate-limited per source (counted beyond the rate)."""
    if call.recorded:  # the guard wrote it
        fault_point(f"gateway_answer_{call.route.name if call.route else 'unknown'}")
        return
    state: GatewayState = call.state
    call.recorded = True
    source = None if call.cap is not None else (call.request.remote or "unknown")
    done = state.events.append(call.event(status=status, allowed=allowed, reason=reason, code=code), source=source)
    if done is not None:
        await done
    fault_point(f"gateway_answer_{call.route.name if call.route else 'unknown'}")


def unrecorded_response(exc: UompError) -> httpd.Response:
    """The answer when the event could not be made durable: 503, as the counted event says."""
    return error_response(
        exc if exc.code == ErrorCode.STORE_UNAVAILABLE else UompError(ErrorCode.STORE_UNAVAILABLE, "access log failed")
    )
