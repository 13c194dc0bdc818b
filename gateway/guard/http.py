"""The HTTP plumbing shared by every guard route: app keys, the §8.4 error answer and its
middleware, the public request helpers (admin check, bounded body and query parsing, bearer
parsing, what a listener presents), the audit fields of a request, and the route-table row."""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass
from typing import Any, Literal

from gateway import contract, httpd, jsonio
from gateway import keys as keyfiles
from gateway.contract import (
    AGENT_HEADER,
    REQUIRED_VERIFIED,
    VERIFIED_AGENT_HEADER,
    VERIFIED_JKT_HEADER,
    VERIFIED_SERIAL_HEADER,
    VERIFIED_TOKEN_HEADER,
    VERIFIED_VIA_HEADER,
    VERIFIED_X5T_HEADER,
)
from gateway.core import checks
from gateway.errors import ErrorCode, UompError, caused_by
from gateway.guard.auth import token_hash
from gateway.guard.services import GuardServices

log = logging.getLogger("uomp.guard")

MAX_QUERY_PARAM = 256


SERVICES = httpd.AppKey("services", GuardServices)
LISTENER = httpd.AppKey("listener", str)


json_response = httpd.json_response


def error_response(exc: UompError, *, transport_status: int | None = None) -> httpd.Response:
    """The §8.4 answer for ``exc``, with its code's status. ``transport_status``: the status the HTTP
    layer chose for a request it refused before any handler (400, 414, 431, ...), kept on the wire as
    it was; the body's code is then INVALID_REQUEST (or INTERNAL for a 5xx)."""
    status = exc.status if transport_status is None else transport_status
    headers = {"WWW-Authenticate": 'Bearer realm="uomp"'} if status == 401 else None
    return json_response(exc.body(), status, headers)


_HTTP_CODES = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED, 413: ErrorCode.PAYLOAD_TOO_LARGE}


def refusal(status: int) -> httpd.Response:
    """The answer to a request the HTTP layer could not parse or that broke one of its limits: the
    §8.4 shape under the transport's status, nothing of the request in it."""
    if status < 500:
        err = UompError(ErrorCode.INVALID_REQUEST, "malformed or oversized request")
    else:
        err = UompError(ErrorCode.INTERNAL, "internal error")
    resp = error_response(err, transport_status=status)
    resp.headers["Server"] = SERVER_NAME
    return resp


SERVER_NAME = "uomp-guard"


async def errors_middleware(request: httpd.Request, handler: httpd.Handler) -> httpd.AnyResponse:
    """Every guard answer that is not a success is a §8.4 error body; the request's headers are checked first."""
    try:
        # Single-valued headers once; identity headers only as the gateway's assertion on the socket.
        problem = contract.header_problem(request.raw_headers, verified_allowed=request.app[LISTENER] == "unix")
        if problem is not None:
            raise UompError(ErrorCode.INVALID_REQUEST, problem)
        refused = request.app[SERVICES].audit.integrity  # a damaged or rolled-back log: nothing is served
        if refused is not None and request.path != "/v1/health":
            raise refused
        return await handler(request)
    except UompError as exc:
        return error_response(exc)
    except httpd.HTTPError as exc:
        code = _HTTP_CODES.get(exc.status, ErrorCode.INVALID_REQUEST)
        msg = {
            ErrorCode.NOT_FOUND: "no such endpoint",
            ErrorCode.METHOD_NOT_ALLOWED: "method not allowed on this endpoint",
            ErrorCode.PAYLOAD_TOO_LARGE: "request body too large",
        }.get(code, "invalid request")
        return error_response(
            UompError(code, msg), transport_status=exc.status if code == ErrorCode.INVALID_REQUEST else None
        )
    except Exception as exc:  # never leak internals; never 500 with a stack trace to a client
        log.error("unhandled %s on %s %s", type(exc).__name__, request.method, endpoint(request))
        return error_response(UompError(ErrorCode.INTERNAL, "internal error"))


def endpoint(request: httpd.Request) -> str:
    """The request's path as a log line may show it: the pattern of the route it matched
    (``/v1/memory/{key}``), so no memory key, session or payload id from the path reaches the log;
    a path that matched no route only when it is a literal route (of another method)."""
    if request.route is not None:
        return request.route
    if any(pattern == request.path for _, pattern in request.app.router.table()):
        return request.path
    return "(a path of no literal route)"


def bearer_token(request: httpd.Request) -> str:
    """The token of the ``Authorization: Bearer`` (or ``DPoP``) header; INVALID_TOKEN without one."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() not in ("bearer", "dpop") or not value.strip():
        raise UompError(ErrorCode.INVALID_TOKEN, "missing Authorization: Bearer token")
    return value.strip()


def require_admin(request: httpd.Request) -> None:
    """UNAUTHORIZED unless the request carries the user's admin credential (compared in constant time)."""
    svc = request.app[SERVICES]
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not keyfiles.admin_matches(value.strip(), svc.admin_credential):
        raise UompError(ErrorCode.UNAUTHORIZED, "the management API needs the user's admin credential")


BODY_READ_SECONDS = 30.0  # a request body arrives whole within this, or the request is refused (400)


async def read_body(request: httpd.Request, limit: int) -> bytes:
    """The whole request body, at most ``limit`` bytes: read until its end (one ``read()`` returns
    only what has arrived so far, so a body that comes in pieces is joined here). Larger is 413
    PAYLOAD_TOO_LARGE (from the declared length, before anything is read, or once the bytes read pass
    it); a body that does not arrive whole within :data:`BODY_READ_SECONDS`, or breaks off, is 400."""
    too_large = UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"request body exceeds {limit} bytes; send less per request")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(BODY_READ_SECONDS):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise too_large
                parts.append(chunk)
    except TimeoutError:
        raise caused_by(
            UompError(
                ErrorCode.INVALID_REQUEST,
                f"the request body did not arrive whole within {BODY_READ_SECONDS:g} s; send it at once",
            ),
            None,
        )
    except OSError as exc:
        raise caused_by(
            UompError(ErrorCode.INVALID_REQUEST, f"the request body broke off ({type(exc).__name__}); send it again"),
            None,
        )
    return b"".join(parts)


async def json_body(request: httpd.Request, limit: int | None = None) -> dict[str, Any]:
    """The request body as a JSON object, read to its end within ``limit``; ``{}`` for an empty body."""
    svc = request.app[SERVICES]
    raw = await read_body(request, svc.cfg.max_body_bytes if limit is None else limit)
    if not raw.strip():
        return {}
    try:
        body = jsonio.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise caused_by(UompError(ErrorCode.INVALID_REQUEST, "request body is not valid JSON"), exc)
    if not isinstance(body, dict):
        raise UompError(ErrorCode.INVALID_REQUEST, "request body must be a JSON object")
    return body


def query_param(
    request: httpd.Request, name: str, *, required: bool = True, max_len: int = MAX_QUERY_PARAM
) -> str | None:
    """The one value of query parameter ``name`` (bounded); INVALID_REQUEST when repeated or missing and required."""
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise UompError(ErrorCode.INVALID_REQUEST, f"query parameter {name} given more than once")
    if not values or not values[0]:
        if required:
            raise UompError(ErrorCode.INVALID_REQUEST, f"query parameter {name} is required")
        return None
    if len(values[0]) > max_len:
        raise UompError(ErrorCode.INVALID_REQUEST, f"query parameter {name} is too long")
    return values[0]


ASSERTED_KEY = httpd.RequestKey("uomp_asserted", bool)


def is_asserted(request: httpd.Request) -> bool:
    """True when the request carries the gateway's verified-identity headers (Unix socket only);
    worked out once per request."""
    known = request.get(ASSERTED_KEY)
    if known is None:
        known = request.app[LISTENER] == "unix" and any(
            name.lower().startswith(contract.VERIFIED_PREFIX) for name in request.headers
        )
        request[ASSERTED_KEY] = known
    return known


def presented_for(request: httpd.Request, th: str, *, use: str = "access") -> checks.Presented:
    """What this listener knows about the request, for :func:`gateway.core.checks.run_checks`.

    On the Unix socket with the gateway's assertion: the token must be exactly the one the gateway
    verified (hash compared in constant time), and the agent and binding are the gateway's. Else
    (the Local Profile listener, or the socket without an assertion): local-profile tokens only.
    """
    svc = request.app[SERVICES]
    h = request.headers
    if is_asserted(request):
        if any(not h.get(name) for name in REQUIRED_VERIFIED):
            raise UompError(ErrorCode.INVALID_REQUEST, "incomplete gateway assertion")
        if not hmac.compare_digest(th.removeprefix("sha256:").encode(), h[VERIFIED_TOKEN_HEADER].encode()):
            raise UompError(ErrorCode.INVALID_TOKEN, "the token is not the one the gateway verified")
        if svc.revoked is not None:  # a gateway with a stale CRL (a VPS) does not let a revoked certificate in
            svc.revoked.check(serial=h.get(VERIFIED_SERIAL_HEADER), x5t=h.get(VERIFIED_X5T_HEADER))
        return checks.Presented(
            token_use=use,
            profile="remote",
            audiences=None,
            audience_required=True,
            endpoint=None,
            check_endpoint=False,
            header_agent=h.get(AGENT_HEADER) or None,
            require_header_agent=False,
            proven_agent=h[VERIFIED_AGENT_HEADER],
            x5t=h.get(VERIFIED_X5T_HEADER) or None,
            jkt=h.get(VERIFIED_JKT_HEADER) or None,
            binding=checks.BIND_EITHER,
        )
    # The socket has no URL of its own: a local token's audience is compared on the TCP listener only.
    audiences = svc.local_audiences if request.app[LISTENER] == "tcp" else None
    return checks.Presented(
        token_use=use,
        profile="local",
        audiences=audiences,
        audience_required=False,
        endpoint=None,
        check_endpoint=False,
        header_agent=h.get(AGENT_HEADER) or None,
        require_header_agent=False,
        proven_agent=None,
        x5t=None,
        jkt=None,
        binding=checks.BIND_NONE,
    )


def prepare(request: httpd.Request, *, use: str = "access") -> tuple[str, str, checks.Presented]:
    """The token, its hash and what the listener presents, for :meth:`AuthService.authenticate` (on
    the event loop: headers and one SHA-256, no I/O)."""
    token = bearer_token(request)
    th = token_hash(token)
    return token, th, presented_for(request, th, use=use)


EVENT_KEY = httpd.RequestKey("uomp_event_id", str)  # the id of the event written for this request
MAX_AUDIT_FIELD = 200


def event_via(request: httpd.Request) -> str:
    """How the request reached the guard, for its event: the gateway's ``Via`` on the socket, else ``local``."""
    return request.headers.get(VERIFIED_VIA_HEADER, "local") if request.app[LISTENER] == "unix" else "local"


def event_fields(request: httpd.Request, *, code: str | None = None) -> dict[str, Any]:
    """The one-log fields of a request's event: the listener it came in on and, for a request the
    gateway forwarded (its assertion, on the Unix socket only), the gateway's audit headers
    (:data:`gateway.contract.AUDIT_HEADERS`): listener, client address, certificate serial and
    fingerprint, request id. A refusal's stable ``code`` too."""
    out: dict[str, Any] = {"code": code}
    if is_asserted(request):
        h = request.headers
        for header, name in contract.AUDIT_HEADERS:
            value = h.get(header)
            if value:
                out[name] = value[:MAX_AUDIT_FIELD]
        out.setdefault("listener", "gateway")
    else:
        out["listener"] = request.app[LISTENER]
    return out


GuardListener = Literal["unix", "tcp"]
BOTH: tuple[GuardListener, ...] = ("unix", "tcp")
UNIX_ONLY: tuple[GuardListener, ...] = ("unix",)


@dataclass(frozen=True)
class GuardRoute:
    """One row of the guard's route table: adding a route is one row plus its handler."""

    method: str
    path: str  # a pattern of httpd.Router: {name} is one path segment
    handler: httpd.Handler
    listeners: tuple[GuardListener, ...] = BOTH  # UNIX_ONLY: the gateway's (and the CLI's) internal routes


def page_limit(request: httpd.Request, maximum: int) -> int | None:
    """The ``limit`` query parameter as 1..``maximum``, or None when absent; INVALID_REQUEST otherwise."""
    raw = query_param(request, "limit", required=False)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= maximum:
        raise UompError(ErrorCode.INVALID_REQUEST, f"limit must be an integer from 1 to {maximum}")
    return int(raw)
