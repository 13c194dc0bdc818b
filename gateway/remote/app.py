"""The remote gateway (spec §15): who may in, what may pass, and the record of both.

One catch-all aiohttp route receives every request, so the raw request-target is normalised once
(:mod:`gateway.remote.pathnorm`) before any routing decision. Then, in order:

1. route lookup in :data:`ROUTES` (unknown: 404 NOT_FOUND, §8.4 shape);
2. ``/v1/health`` answers at once, without authentication or detail: 200, or 503 STORE_UNAVAILABLE
   while the guard behind the gateway fails its health checks (``GatewayState.upstream_ok``).
   Before routing, headers: every single-valued header (``Authorization``, ``DPoP``,
   ``X-UOMP-*``, ``Host``, framing) at most once, no client-sent ``X-UOMP-Verified-*``
   (:func:`gateway.contract.header_problem`); the endpoint the request arrived on is the
   listener's own endpoint its ``Host`` names (on TLS, ``Host`` must agree with the SNI name);
3. transport identity: on the mTLS listener the client certificate (chain, validity and CRL were
   checked in the handshake; the URI SAN ``uomp://agent/<id>`` and EKU clientAuth here). A
   listener without client certificates (the tunnel origin) plugs in its own authenticator;
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

One log (issue 10): every request, allowed or refused, becomes one event in the guard's ledger
before its response is sent. A request the guard answered is recorded by the guard alone (it
answers with :data:`gateway.contract.EVENT_ID_HEADER`), with the gateway's fields handed over as
verified contract headers (listener, client address, certificate serial, request id); what the
gateway decides alone goes through :class:`gateway.remote.event_sink.EventSink`. The read quota is
the guard's alone: the agent sees the guard's ``X-UOMP-Quota-Remaining``.
"""

from __future__ import annotations

import logging
import re
import secrets
import ssl
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway import contract, jsonio
from gateway import keys as keyfiles
from gateway.config import GatewayConfig, GuardConfig, Paths, load_section
from gateway.contract import (
    AGENT_HEADER,
    QUOTA_HEADER,
    VERIFIED_AGENT_HEADER,
    VERIFIED_JKT_HEADER,
    VERIFIED_TOKEN_HEADER,
    VERIFIED_VIA_HEADER,
    VERIFIED_X5T_HEADER,
)
from gateway.core import checks, http1, tokens
from gateway.core.dpop import ReplayCache
from gateway.core.tokens import Capability
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError, known_code, parse_code
from gateway.remote import pathnorm, transport
from gateway.remote.access_log import AccessLog
from gateway.remote.event_sink import EventSink
from gateway.remote.forward import CHUNK, FORWARD_REQUEST_HEADERS, FORWARD_RESPONSE_HEADERS, Forwarder
from gateway.remote.metrics import Metrics
from gateway.remote.routenames import Listener, RouteName, TokenUse
from gateway.remote.tls import ClientCertChecker, ClientIdentity, server_name_of

log = logging.getLogger("uomp.gateway")

__all__ = [
    "AGENT_HEADER",
    "QUOTA_HEADER",
    "VERIFIED_AGENT_HEADER",
    "VERIFIED_JKT_HEADER",
    "VERIFIED_TOKEN_HEADER",
    "VERIFIED_VIA_HEADER",
    "VERIFIED_X5T_HEADER",
    "Call",
    "GatewayState",
    "Route",
    "create_gateway_app",
    "register_route",
]

MAX_STATUS_CACHE_SECONDS = 1.0
MAX_UPSTREAM_ERROR_BYTES = 64 * 1024


Handler = Callable[["Call"], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    """One row of the gateway's route table. The metrics label and the audit ``action`` of a request
    are its ``name``; adding a route is one row (here or beside its handler) plus its handler."""

    method: str
    pattern: re.Pattern[str]
    name: RouteName
    reads: bool = False  # counts against max_read_queries (in the guard: the one quota counter)
    auth: bool = True
    token_use: TokenUse = "access"  # "access", "refresh", or "none" (transport identity alone)
    status_check: bool = True  # ask the Auth Service about the session before the handler
    transports: tuple[Listener, ...] = ("mtls", "tunnel")  # listeners the route exists on
    handler: Handler | None = None  # None: forwarded to the guard after every check (:func:`forward`)


# §15.4. Session create, grant, close, revoke and list are deliberately absent: never reachable here.
ROUTES: list[Route] = [
    Route("GET", re.compile(r"/v1/health"), "health", auth=False),
    Route("GET", re.compile(r"/v1/memory/aggregate"), "aggregate", reads=True, status_check=False),
    Route("GET", re.compile(r"/v1/memory/(?P<key>[^/]+)"), "read_key", reads=True, status_check=False),
    Route("GET", re.compile(r"/v1/memory"), "read_tag", reads=True, status_check=False),
    Route("GET", re.compile(r"/v1/audit"), "audit", status_check=False),
    Route("POST", re.compile(r"/v1/sessions/(?P<sid>[^/]+)/deletion-proof"), "deletion_proof", status_check=False),
    # own session only (the guard decides)
    Route("GET", re.compile(r"/v1/audit/(?P<event_id>[^/]+)/proof"), "audit_proof", status_check=False),
    Route("GET", re.compile(r"/v1/audit/checkpoint"), "audit_checkpoint", status_check=False),
    # §10.1 / §20.4: no agent writes and no semantic query in this version. Forwarded (after every
    # check) so the agent gets the guard's own answer (WRITE_NOT_AVAILABLE / NOT_IMPLEMENTED) and
    # the guard's audit log records the attempt, exactly as on the guard itself.
    Route("PUT", re.compile(r"/v1/memory/(?P<key>[^/]+)"), "write", status_check=False),
    Route("DELETE", re.compile(r"/v1/memory/(?P<key>[^/]+)"), "delete", status_check=False),
    Route("POST", re.compile(r"/v1/memory/query"), "query", status_check=False),
]


@dataclass
class Call:
    """One request as it goes through the checks; becomes the ``gateway_access`` event."""

    request: web.Request
    route: Route | None = None
    target: pathnorm.Target | None = None
    params: dict[str, str] = field(default_factory=dict)
    identity: ClientIdentity | None = None
    via: str = "mtls"
    cap: Capability | None = None
    token: str | None = None
    token_digest: str | None = None  # SHA-256 (hex) of ``token``, sent to the guard
    endpoint: str | None = None  # host[:port] of this listener's endpoint the request addressed
    request_id: str = field(default_factory=lambda: "req_" + secrets.token_hex(8))
    key: str | None = None
    tag: str | None = None
    jkt: str | None = None
    recorded: bool = False
    memo: ConnMemo | None = None  # what this request's TLS connection established already (mTLS)
    # run once the token and the session passed their checks (the DPoP proof is recorded then)
    on_authenticated: list[Callable[[], None]] = field(default_factory=list)

    def event(self, *, status: int, allowed: bool, reason: str, code: str | None) -> dict[str, Any]:
        """The request's event for the guard's one log (§18.1/§18.2 fields, listener, via, code)."""
        cap = self.cap
        ident = self.identity
        return {
            "session_id": cap.session_id if cap else None,
            "agent_id": cap.agent_id if cap else (self.identity.agent_id if self.identity else None),
            "action": self.route.name if self.route else "unknown",
            "key": self.key,
            "tag": self.tag,
            "allowed": allowed,
            "reason": reason,
            "code": code,
            "method": self.request.method,
            "path": self.target.path if self.target else None,
            "status": status,
            "cert_serial": ident.serial if ident else None,
            "cert_fp": ident.x5t_s256 if ident else None,
            "listener": self.via,
            "via": f"gateway:mtls:{ident.serial}" if ident else f"gateway:{self.via}",
            "client": self.request.remote,
            "request_id": self.request_id,
        }


MEMO_ATTRIBUTE = "_uomp_gateway_memo"  # the ConnMemo's attribute on a connection's ssl.SSLObject
MAX_MEMO_CHECKS = 8  # (route use, endpoint, agent header, Host) combinations remembered per connection


class ConnMemo:
    """What one mTLS connection's earlier requests established, so its next requests skip the work
    whose answer cannot have changed (a keep-alive agent sends the same certificate and token each
    time), never a check whose answer can:

    * the certificate's parsed identity, for the DER the connection presents now (compared byte for
      byte on every request); its validity period and the CRL are checked again on every request;
    * the last token that passed verification and the shared checks on this connection, with the
      (route use, endpoint, agent header, Host) combinations it passed them for: reused only for
      the same token string, while the token's ``exp``/``expires_at`` lie ahead, and while the
      gateway's trusted keys and listener endpoints are those it was checked against
      (``GatewayState.generation``). Anything else goes through the full verification again.
    """

    __slots__ = (
        "block",
        "block_remote",
        "cap",
        "der",
        "digest",
        "generation",
        "identity",
        "not_after",
        "not_before",
        "passed",
        "token",
    )

    def __init__(self, der: bytes, identity: ClientIdentity) -> None:
        self.der = der
        self.identity = identity
        self.not_before = identity.not_before.timestamp()
        self.not_after = identity.not_after.timestamp()
        self.generation = -1
        self.token: str | None = None
        self.cap: Capability | None = None
        self.digest = ""
        self.passed: set[tuple[str, str | None, str | None, str]] = set()
        self.block: http1.HeaderBlock | None = None  # _connection_assertion's lines for ``token``
        self.block_remote: str | None = None

    def remember(
        self, generation: int, token: str, cap: Capability, digest: str, key: tuple[str, str | None, str | None, str]
    ) -> None:
        if self.token != token or self.generation != generation:
            self.generation, self.token, self.cap, self.digest = generation, token, cap, digest
            self.passed = set()
            self.block = None
        if len(self.passed) >= MAX_MEMO_CHECKS:
            self.passed.clear()
        self.passed.add(key)


class StatusCache:
    """Session status from the Auth Service, remembered for at most ``ttl`` seconds per token."""

    def __init__(self, forwarder: Forwarder, ttl: float, max_entries: int) -> None:
        self.forwarder = forwarder
        self.ttl = min(max(ttl, 0.0), MAX_STATUS_CACHE_SECONDS)
        self.max_entries = max(1, max_entries)
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}

    async def check(self, token: str, cap: Capability, digest: str | None = None) -> None:
        key = digest or contract.token_digest(token)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is None or hit[0] <= now:
            status, body = await self.forwarder.json_call("POST", "/v1/tokens/validate", body={"token": token})
            if status != 200:
                # The guard could not decide (STORE_BUSY: a lock held elsewhere; STORE_UNAVAILABLE): its
                # error is passed on and nothing is cached. Anything else: no validation route there (a
                # Local Profile port, say), which is not an answer either.
                err = body.get("error") if isinstance(body, dict) else None
                code = parse_code(err.get("code") if isinstance(err, dict) else None, ErrorCode.STORE_UNAVAILABLE)
                if status == 503 and code in (ErrorCode.STORE_BUSY, ErrorCode.STORE_UNAVAILABLE):
                    raise UompError(
                        code,
                        "the Auth Service could not check the session just now; try again shortly",
                        session_id=cap.session_id,
                    )
                raise UompError(
                    ErrorCode.STORE_UNAVAILABLE,
                    "the guard behind the gateway does not answer token "
                    "validation (it must be reached on its Unix socket)",
                )
            if len(self._cache) >= self.max_entries:
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if len(self._cache) >= self.max_entries:
                    self._cache.clear()
            self._cache[key] = (now + self.ttl, body)
            hit = self._cache[key]
        body = hit[1]
        if body.get("valid") is True:
            return
        code = parse_code(body.get("code"), ErrorCode.SESSION_REVOKED)
        if code not in (
            ErrorCode.TOKEN_EXPIRED,
            ErrorCode.SESSION_REVOKED,
            ErrorCode.SESSION_NOT_FOUND,
            ErrorCode.INVALID_TOKEN,
            ErrorCode.REFRESH_REUSED,
        ):
            code = ErrorCode.SESSION_REVOKED
        message = body.get("message")  # what happened, as the Auth Service says it (fixed sentences)
        if not isinstance(message, str) or not message or len(message) > 300:
            message = "the Auth Service reports this session is no longer active"
        raise UompError(code, message, session_id=cap.session_id)


_norm_endpoint = checks.norm_endpoint


def _host_key(host_header: str, scheme: str) -> str:
    """A Host header as the ``host[:port]`` of :func:`checks.endpoint_netloc` (default port dropped)."""
    return checks.endpoint_netloc(f"{scheme}://{host_header.strip()}") if host_header else ""


class GatewayState:
    def __init__(
        self,
        paths: Paths,
        cfg: GatewayConfig,
        *,
        forwarder: Forwarder,
        access: AccessLog,
        metrics: Metrics,
        endpoints: list[str],
        tunnel_endpoints: list[str] | None = None,
    ) -> None:
        self.paths = paths
        self.cfg = cfg
        self.forwarder = forwarder
        self.access = access  # the durable local spool of the one log (guard unreachable)
        self.events = EventSink(
            forwarder,
            access,
            unauth_events_per_second=cfg.access_log_unauth_events_per_second,
            unauth_burst=cfg.access_log_unauth_burst,
            summary_interval_seconds=cfg.access_log_summary_interval_seconds,
        )
        self.metrics = metrics
        # Each listener serves its own public endpoints (audience and allowed_endpoints are checked
        # against the listener the request arrived on, never against every endpoint of the gateway).
        # bumped whenever what a token is checked against changes (trusted keys, listener endpoints):
        # a connection's remembered checks (ConnMemo) are then done again
        self.generation = 0
        self.listener_endpoints: dict[str, set[str]] = {"mtls": set(), "tunnel": set()}
        self._listener_hosts: dict[str, dict[str, str]] = {"mtls": {}, "tunnel": {}}
        for e in endpoints:
            self.add_endpoint(e)
        for e in tunnel_endpoints or []:
            self.add_endpoint(e, listener="tunnel")
        self.status = StatusCache(forwarder, cfg.status_cache_seconds, cfg.status_cache_entries)
        paths.gateway_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.routes: list[Route] = list(ROUTES)
        self.handlers: dict[RouteName, Handler] = {}  # handlers bound at start-up (register_route)
        self.transport_auth: dict[str, Callable[[Call], Awaitable[None]]] = {"mtls": mtls_identity}
        self.certs = ClientCertChecker()
        self._verified: dict[str, Capability] = {}
        self._route_index: dict[tuple[str, str], list[Route]] = {}
        self._route_index_of: tuple[Route, ...] = ()
        self.replay = ReplayCache.sized(
            window_seconds=cfg.dpop_window_seconds,
            max_entries=cfg.dpop_replay_cache_entries,
            proofs_per_second_per_key=cfg.dpop_max_proofs_per_second_per_key,
        )
        # serials (hex) on the CRL last loaded; the server points this at its TLS reloader
        self.revoked_serials: Callable[[], frozenset[str]] = frozenset
        # False while the guard is known to be unreachable; the server points this at its upstream monitor
        self.upstream_ok: Callable[[], bool] = lambda: True
        self.reload_keys()

    def reload_keys(self) -> None:
        # The same trusted set as the Auth Service: a retired key is dropped once no token it signed
        # can still be alive (the lifetimes are the guard's, from the same config file).
        try:
            guard = load_section(GuardConfig, "guard", file=self.paths.config_file)
        except Exception:  # a broken [guard] section is the guard's to report; use the defaults
            guard = GuardConfig()
        lifetime = max(
            guard.token_lifetime_seconds, guard.remote_token_lifetime_seconds, guard.refresh_lifetime_seconds
        )
        self.public_keys = keyfiles.load_public_keys(self.paths, now=time.time(), max_token_lifetime=lifetime)
        self._verified = {}
        self.generation += 1

    def verify_digest(self, token: str) -> tuple[Capability, str]:
        """tokens.verify_token with a bounded cache of verified tokens (expiry re-checked on every hit),
        and the token's SHA-256 (the cache key, and what the guard is told)."""
        now = time.time()
        key = contract.token_digest(token)
        cap = self._verified.get(key)
        if cap is not None and cap.claims.get("exp", 0) > now and cap.expires_at > now:
            return cap, key
        cap = tokens.verify_token(token, self.public_keys, now=now)
        if len(self._verified) >= self.cfg.token_cache_entries:
            self._verified = {}
        self._verified[key] = cap
        return cap, key

    def verify(self, token: str) -> Capability:
        return self.verify_digest(token)[0]

    @property
    def endpoints(self) -> set[str]:
        """Every endpoint of every listener (normalised URLs)."""
        return self.listener_endpoints["mtls"] | self.listener_endpoints["tunnel"]

    def add_endpoint(self, url: str, *, listener: str = "mtls") -> None:
        """Serve ``url`` on ``listener`` ("mtls" or "tunnel": a tunnel supervisor reports each new
        public URL here with ``listener="tunnel"``)."""
        norm = _norm_endpoint(url)
        self.generation += 1
        self.listener_endpoints.setdefault(listener, set()).add(norm)
        self._listener_hosts.setdefault(listener, {})[checks.endpoint_netloc(norm)] = norm

    def discard_endpoint(self, url: str) -> None:
        """Stop serving ``url`` on every listener."""
        norm = _norm_endpoint(url)
        self.generation += 1
        for listener, urls in self.listener_endpoints.items():
            urls.discard(norm)
            hosts = self._listener_hosts.get(listener, {})
            if hosts.get(checks.endpoint_netloc(norm)) == norm:
                del hosts[checks.endpoint_netloc(norm)]

    def match_endpoint(self, listener: str, host_header: str) -> str | None:
        """The ``host[:port]`` of this listener's endpoint that ``host_header`` names, or None."""
        scheme = "https"  # every public endpoint is https (the tunnel's TLS ends at its edge)
        key = _host_key(host_header, scheme)
        return key if key in self._listener_hosts.get(listener, {}) else None

    def routes_for(self, listener: str, method: str) -> list[Route]:
        """The routes of ``listener`` for ``method``, in table order (rebuilt when the table changes)."""
        table = tuple(self.routes)
        if table != self._route_index_of:
            self._route_index, self._route_index_of = {}, table
        routes = self._route_index.get((listener, method))
        if routes is None:
            routes = [r for r in table if listener in r.transports and r.method == method]
            if routes:  # only methods of the table are kept (a client names any method it likes)
                self._route_index[(listener, method)] = routes
        return routes

    async def close(self) -> None:
        await self.events.close()  # what is queued reaches the guard (or the spool) first
        await self.forwarder.close()
        self.access.close()


STATE = web.AppKey("gateway_state", GatewayState)
LISTENER = web.AppKey("gateway_listener", str)


def register_route(state: GatewayState, route: Route, handler: Handler) -> None:
    """Add a gateway-served route (refresh, payloads) without touching the forwarding path."""
    state.routes.insert(0, route)
    state.handlers[route.name] = handler


RETRY_AFTER_SECONDS = "2"


def _error(exc: UompError) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="uomp"'} if exc.status == 401 else None
    if exc.status == 503:  # the guard (or the uplink to it) is away or busy: a client retries after this
        headers = {"Retry-After": RETRY_AFTER_SECONDS}
    return web.json_response(exc.body(), status=exc.status, headers=headers)


# ----------------------------------------------------------------------------- checks


async def mtls_identity(call: Call) -> None:
    ssl_obj = call.request.transport.get_extra_info("ssl_object") if call.request.transport else None
    der = ssl_obj.getpeercert(binary_form=True) if isinstance(ssl_obj, ssl.SSLObject) else None
    if not der:
        raise UompError(ErrorCode.CERT_REQUIRED, "a client certificate issued by the user's agent CA is required")
    state = call.request.app[STATE]
    # The CRL is checked at the handshake; a keep-alive connection made before a revocation is
    # refused here too, on its next request.
    revoked = state.revoked_serials()
    memo: ConnMemo | None = getattr(ssl_obj, MEMO_ATTRIBUTE, None)
    if memo is not None and memo.der == der:
        # The same certificate as this connection's earlier requests: its parsed identity is kept,
        # its validity period and the CRL are checked again now (as ClientCertChecker.check does).
        now = time.time()
        if now < memo.not_before:
            raise UompError(ErrorCode.CERT_REQUIRED, "the client certificate is not valid yet")
        if now > memo.not_after:
            raise UompError(ErrorCode.CERT_REQUIRED, "the client certificate has expired")
        if memo.identity.serial in revoked:
            raise UompError(ErrorCode.CERT_REQUIRED, "the client certificate has been revoked")
    else:
        memo = ConnMemo(der, state.certs.check(der, revoked=revoked))
        setattr(ssl_obj, MEMO_ATTRIBUTE, memo)
    call.identity = memo.identity
    call.memo = memo


def _bearer(request: web.Request) -> str:
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
    if call.via == "mtls" and request.transport is not None:
        sni = server_name_of(request.transport.get_extra_info("ssl_object"))
        if sni is not None and _host_key(host, "https").rsplit(":", 1)[0].strip("[]") != sni:
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
    headers = _connection_assertion(call)
    headers[contract.VERIFIED_REQUEST_ID_HEADER] = call.request_id
    return headers


def _connection_assertion(call: Call) -> dict[str, str]:
    """:func:`verified_headers` but the request id: the same for every request of a connection with
    one token (the client address, listener, certificate and token do not change on it)."""
    assert call.cap is not None and call.token is not None and call.token_digest is not None
    headers = {
        "Authorization": f"Bearer {call.token}",
        AGENT_HEADER: call.cap.agent_id,
        VERIFIED_AGENT_HEADER: call.cap.agent_id,
        VERIFIED_VIA_HEADER: f"gateway:mtls:{call.identity.serial}" if call.identity else f"gateway:{call.via}",
        VERIFIED_TOKEN_HEADER: call.token_digest,
        # audit only: the guard writes these into the request's one event
        contract.VERIFIED_LISTENER_HEADER: call.via,
    }
    if call.request.remote:
        headers[contract.VERIFIED_CLIENT_HEADER] = call.request.remote
    if call.identity is not None:
        headers[contract.VERIFIED_SERIAL_HEADER] = call.identity.serial
        headers[VERIFIED_X5T_HEADER] = call.identity.x5t_s256
        headers[VERIFIED_JKT_HEADER] = call.identity.jkt
    elif call.jkt is not None:
        headers[VERIFIED_JKT_HEADER] = call.jkt
    return headers


def _route_params(call: Call) -> None:
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


# ---------------------------------------------------------------------------- forwarding


async def forward(call: Call) -> web.StreamResponse:
    state = call.request.app[STATE]
    request = call.request
    assert call.target is not None and call.cap is not None and call.token is not None
    # Only allow-listed client headers (each single-valued or harmless: never Authorization or
    # X-UOMP-Agent-Id), the request's id, and the assertion's lines (the verified token and agent).
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_REQUEST_HEADERS}
    headers[contract.VERIFIED_REQUEST_ID_HEADER] = call.request_id
    block = _assertion_block(call)
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
            if low == _EVENT_ID_LOWER:
                # The guard wrote this request's one event (with the gateway's fields): nothing to add here.
                call.recorded = True
        if upstream.status >= 400:
            # A refusal is small: read it whole (bounded) so the access log records the guard's code.
            raw = await upstream.read(MAX_UPSTREAM_ERROR_BYTES)
            code = _error_code(raw) or f"HTTP_{upstream.status}"
            await _record(call, status=upstream.status, allowed=False, reason="refused by the memory guard", code=code)
            return web.Response(body=raw, status=upstream.status, headers=headers_out)
        if upstream.body is not None:  # read whole already (every JSON answer of the guard)
            await _record(call, status=upstream.status, allowed=True, reason="forwarded", code=None)
            return web.Response(body=upstream.body, status=upstream.status, headers=headers_out)
        resp = web.StreamResponse(status=upstream.status, headers=headers_out)
        if upstream.content_length is not None:
            resp.content_length = upstream.content_length
        await _record(call, status=upstream.status, allowed=True, reason="forwarded", code=None)
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


_EVENT_ID_LOWER = contract.EVENT_ID_HEADER.lower()


def _assertion_block(call: Call) -> http1.HeaderBlock:
    """The header lines of :func:`_connection_assertion`, made (and checked) once per mTLS connection
    and token (kept on its :class:`ConnMemo`, dropped when the token changes); the request's own
    headers (its id) are sent after them."""
    memo, remote = call.memo, call.request.remote
    if memo is not None and memo.block is not None and memo.token == call.token and memo.block_remote == remote:
        return memo.block
    block = http1.header_block(_connection_assertion(call))
    if memo is not None and memo.token == call.token:
        memo.block, memo.block_remote = block, remote
    return block


def _error_code(raw: bytes) -> ErrorCode | None:
    try:
        doc = jsonio.loads(raw)
        code = doc["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return known_code(code)


async def _record(call: Call, *, status: int, allowed: bool, reason: str, code: str | None) -> None:
    """Make the request's event durable (in the guard's one log, or the local spool while the guard
    is unreachable) before its answer; STORE_UNAVAILABLE if it cannot be. Nothing when the guard
    already wrote the request's event.

    An event without a verified session is rate-limited per source (counted beyond the rate)."""
    state = call.request.app[STATE]
    if call.recorded:  # the guard wrote it
        fault_point(f"gateway_answer_{call.route.name if call.route else 'unknown'}")
        return
    call.recorded = True
    source = None if call.cap is not None else (call.request.remote or "unknown")
    done = state.events.append(call.event(status=status, allowed=allowed, reason=reason, code=code), source=source)
    if done is not None:
        await done
    fault_point(f"gateway_answer_{call.route.name if call.route else 'unknown'}")


def _unrecorded(exc: UompError) -> web.Response:
    """The answer when the event could not be made durable: 503, as the counted event says."""
    return _error(
        exc if exc.code == ErrorCode.STORE_UNAVAILABLE else UompError(ErrorCode.STORE_UNAVAILABLE, "access log failed")
    )


async def entry(request: web.Request) -> web.StreamResponse:
    transport.request_started(request)
    state = request.app[STATE]
    listener = request.app[LISTENER]
    started = time.perf_counter()
    call = Call(request, via=listener)
    resp: web.StreamResponse
    code: str | None = None
    try:
        resp = await _dispatch(state, call)
    except UompError as exc:
        code = exc.code
        if exc.session_id is None and call.cap is not None:
            exc.session_id = call.cap.session_id
        resp = _error(exc)
        try:
            await _record(call, status=exc.status, allowed=False, reason=exc.message, code=exc.code)
        except UompError as log_exc:  # the event could not be written: the client gets 503, not 500
            code, resp = ErrorCode.STORE_UNAVAILABLE, _unrecorded(log_exc)
    except Exception as exc:
        code = ErrorCode.INTERNAL
        log.error("unhandled %s in gateway handler", type(exc).__name__)
        resp = _error(UompError(ErrorCode.INTERNAL, "internal error"))
        try:
            await _record(call, status=500, allowed=False, reason="internal error", code=ErrorCode.INTERNAL)
        except UompError as log_exc:
            code, resp = ErrorCode.STORE_UNAVAILABLE, _unrecorded(log_exc)
    finally:
        transport.request_finished(request)
    transport.last_answer(request, resp)
    state.metrics.observe_request(call.route.name if call.route else "unknown", code, time.perf_counter() - started)
    return resp


async def _dispatch(state: GatewayState, call: Call) -> web.StreamResponse:
    request = call.request
    check_headers(state, call)
    call.target = pathnorm.normalize_target(request.raw_path)
    listener = request.app[LISTENER]
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
    await state.access.ready()  # fail closed while the access log cannot be written (tries one write)
    if not route.auth:
        if not state.upstream_ok():
            raise UompError(ErrorCode.STORE_UNAVAILABLE, "the memory guard is unreachable")
        resp = web.json_response({"status": "ok"})
        return resp  # health answers are not decisions about anyone's data: not in the log
    await state.transport_auth[listener](call)
    if route.token_use == "none":
        return await (route.handler or state.handlers[route.name])(call)
    call.token = _bearer(request)
    cap = check_token(state, call, call.token)
    _route_params(call)
    # A DPoP proof is recorded (on_authenticated) only for a live session: a revoked agent must not
    # fill the replay cache, so a request with such a hook still asks first (the mTLS path never does).
    if route.status_check or (call.on_authenticated and route.token_use == "access"):
        await state.status.check(call.token, cap, call.token_digest)
    for done in call.on_authenticated:
        done()
    transport.authenticated(request)  # the connection leaves the unverified budget (tunnel listener)
    handler = route.handler or state.handlers.get(route.name, forward)
    return await handler(call)


class _EveryRequest(web.UrlDispatcher):
    """aiohttp's router with one answer: every request that aiohttp parsed goes to :func:`entry`,
    whatever its path (an encoded newline, say, would match no route pattern), which routes it
    itself (:data:`ROUTES`): one JSON answer shape, one access event. Without a path walk or a
    middleware per request (they cost more than the rest of the routing)."""

    def __init__(self) -> None:
        super().__init__()
        self._route = self.add_route("*", "/{tail:.*}", entry)

    async def resolve(self, request: web.Request) -> web.UrlMappingMatchInfo:
        return web.UrlMappingMatchInfo({}, self._route)


def create_gateway_app(state: GatewayState, *, listener: str) -> web.Application:
    with warnings.catch_warnings():  # aiohttp 3 calls a custom router deprecated (it stays in every 3.x)
        warnings.simplefilter("ignore", DeprecationWarning)
        app = web.Application(client_max_size=state.cfg.max_body_bytes, router=_EveryRequest())
    app[STATE] = state
    app[LISTENER] = listener
    app.on_response_prepare.append(_server_header)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    # No library or Python version advertised to the internet.
    response.headers["Server"] = "uomp-gateway"
