"""The remote gateway (spec §15): who may in, what may pass, and the record of both.

One catch-all aiohttp route receives every request, so the raw request-target is normalised once
(:mod:`gateway.remote.pathnorm`) before any routing decision. Then, in order:

1. route lookup in :data:`ROUTES` (unknown: 404 NOT_FOUND, §8.4 shape);
2. ``/v1/health`` answers at once, without authentication or detail: 200, or 503 STORE_UNAVAILABLE
   while the guard behind the gateway fails its health checks (``GatewayState.upstream_ok``);
3. transport identity: on the mTLS listener the client certificate (chain, validity and CRL were
   checked in the handshake; the URI SAN ``uomp://agent/<id>`` and EKU clientAuth here). A
   listener without client certificates (the tunnel origin) plugs in its own authenticator;
4. the token (§7.3, §15.2, §15.4): ``Authorization: Bearer`` and ``X-UOMP-Agent-Id``; EdDSA with a
   known ``kid``; ``exp``/``expires_at``; ``profile`` remote; ``audience`` one of this gateway's
   endpoints; ``allowed_endpoints`` contains the host the request came in on; token agent ==
   certificate agent == header agent; ``cnf`` binding; a refresh token never reads memory;
5. session status from the Auth Service (cached for at most ``status_cache_seconds`` <= 1 s);
6. the quota (reads only), atomically, persisted;
7. the route's handler: forward to the guard (default), or a handler registered by another part
   of the gateway (refresh, payloads) through :func:`register_route`.

Every request, allowed or refused, becomes one ``gateway_access`` event in the durable access log
before its response is sent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from gateway import keys as keyfiles
from gateway.config import GatewayConfig, Paths
from gateway.core import tokens
from gateway.core.dpop import ReplayCache
from gateway.core.quota import QuotaLedger
from gateway.core.tokens import Capability
from gateway.durable import fault_point
from gateway.errors import STATUS, UompError
from gateway.guard.db import DbWorker, connect, transaction
from gateway.remote import pathnorm, transport
from gateway.remote.access_log import AccessLog
from gateway.remote.forward import CHUNK, FORWARD_REQUEST_HEADERS, FORWARD_RESPONSE_HEADERS, Forwarder
from gateway.remote.metrics import Metrics
from gateway.remote.tls import ClientCertChecker, ClientIdentity

log = logging.getLogger("uomp.gateway")

VERIFIED_AGENT_HEADER = "X-UOMP-Verified-Agent"
VERIFIED_VIA_HEADER = "X-UOMP-Verified-Via"
VERIFIED_X5T_HEADER = "X-UOMP-Verified-X5t"
VERIFIED_JKT_HEADER = "X-UOMP-Verified-Jkt"
QUOTA_HEADER = "X-UOMP-Quota-Remaining"
AGENT_HEADER = "X-UOMP-Agent-Id"
STATUS_CACHE_ENTRIES = 16384
MAX_STATUS_CACHE_SECONDS = 1.0
VERIFIED_CACHE_ENTRIES = 4096
MAX_UPSTREAM_ERROR_BYTES = 64 * 1024


@dataclass(frozen=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    name: str
    reads: bool = False  # counts against max_read_queries
    auth: bool = True
    token_use: str = "access"  # "access", "refresh", or "none" (transport identity alone)
    status_check: bool = True  # ask the Auth Service about the session before the handler
    transports: tuple[str, ...] = ("mtls", "tunnel")  # listeners the route exists on


Handler = Callable[["Call"], Awaitable[web.StreamResponse]]

# §15.4. Session create, grant, close, revoke and list are deliberately absent: never reachable here.
ROUTES: list[Route] = [
    Route("GET", re.compile(r"/v1/health"), "health", auth=False),
    Route("GET", re.compile(r"/v1/memory/aggregate"), "aggregate", reads=True),
    Route("GET", re.compile(r"/v1/memory/(?P<key>[^/]+)"), "read_key", reads=True),
    Route("GET", re.compile(r"/v1/memory"), "read_tag", reads=True),
    Route("GET", re.compile(r"/v1/audit"), "audit"),
    Route("POST", re.compile(r"/v1/sessions/(?P<sid>[^/]+)/deletion-proof"), "deletion_proof"),
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
    remaining: int | None = None
    key: str | None = None
    tag: str | None = None
    jkt: str | None = None
    recorded: bool = False
    # run once the token and the session passed their checks (the DPoP proof is recorded then)
    on_authenticated: list[Callable[[], None]] = field(default_factory=list)

    def event(self, *, status: int, allowed: bool, reason: str, code: str | None) -> dict[str, Any]:
        cap = self.cap
        return {
            "type": "gateway_access",
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
            "cert_serial": self.identity.serial if self.identity else None,
            "listener": self.via,
            "query_count_remaining": self.remaining,
        }


class StatusCache:
    """Session status from the Auth Service, remembered for at most ``ttl`` seconds per token."""

    def __init__(self, forwarder: Forwarder, ttl: float) -> None:
        self.forwarder = forwarder
        self.ttl = min(max(ttl, 0.0), MAX_STATUS_CACHE_SECONDS)
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}

    async def check(self, token: str, cap: Capability) -> None:
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is None or hit[0] <= now:
            _status, body = await self.forwarder.json_call("POST", "/v1/tokens/validate", body={"token": token})
            if len(self._cache) >= STATUS_CACHE_ENTRIES:
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if len(self._cache) >= STATUS_CACHE_ENTRIES:
                    self._cache.clear()
            self._cache[key] = (now + self.ttl, body)
            hit = self._cache[key]
        body = hit[1]
        if body.get("valid") is True:
            return
        code = body.get("code")
        if code not in ("TOKEN_EXPIRED", "SESSION_REVOKED", "SESSION_NOT_FOUND", "INVALID_TOKEN", "REFRESH_REUSED"):
            code = "SESSION_REVOKED"
        message = body.get("message")  # what happened, as the Auth Service says it (fixed sentences)
        if not isinstance(message, str) or not message or len(message) > 300:
            message = "the Auth Service reports this session is no longer active"
        raise UompError(str(code), message, session_id=cap.session_id)


class QuotaStore:
    """Gateway-side quota counters in ``$UOMP_HOME/gateway/quota.db`` (survive restarts).

    The ledger runs on the database's own worker thread (:meth:`consume`), so a lock held on
    quota.db by another process never stalls the gateway's event loop: past the bounded wait the
    read is 503 STORE_BUSY."""

    SCHEMA = "CREATE TABLE IF NOT EXISTS quota (session_id TEXT PRIMARY KEY, reserved INTEGER NOT NULL);"

    def __init__(self, path: Path) -> None:
        self.db = connect(path, schema=self.SCHEMA, what="gateway quota database")
        self.ledger = QuotaLedger(self._load, self._persist)
        self.worker = DbWorker("gateway-quota", what="gateway quota database")

    async def consume(self, session_id: str, limit: int | None) -> int | None:
        """:meth:`QuotaLedger.consume` on the worker thread."""
        return await self.worker.run(self.ledger.consume, session_id, limit)

    def _load(self, sid: str) -> int:
        r = self.db.execute("SELECT reserved FROM quota WHERE session_id=?", (sid,)).fetchone()
        return int(r[0]) if r else 0

    def _persist(self, sid: str, mark: int) -> None:
        with transaction(self.db, what="gateway quota database"):
            self.db.execute("INSERT INTO quota VALUES (?,?) ON CONFLICT(session_id) DO UPDATE SET "
                            "reserved=excluded.reserved", (sid, mark))

    def close(self) -> None:
        self.worker.close()
        self.ledger.flush()
        self.db.close()


def _norm_endpoint(url: str) -> str:
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    port = parts.port
    default = {"https": 443, "http": 80}.get(scheme)
    netloc = host if port in (None, default) else f"{host}:{port}"
    if ":" in host and not host.startswith("["):
        netloc = f"[{host}]" if port in (None, default) else f"[{host}]:{port}"
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


class GatewayState:
    def __init__(self, paths: Paths, cfg: GatewayConfig, *, forwarder: Forwarder, access: AccessLog,
                 metrics: Metrics, endpoints: list[str]) -> None:
        self.paths = paths
        self.cfg = cfg
        self.forwarder = forwarder
        self.access = access
        self.metrics = metrics
        self.endpoints = {_norm_endpoint(e) for e in endpoints}
        self.status = StatusCache(forwarder, cfg.status_cache_seconds)
        paths.gateway_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.quota = QuotaStore(paths.gateway_dir / "quota.db")
        self.handlers: dict[str, Handler] = {}
        self.routes: list[Route] = list(ROUTES)
        self.transport_auth: dict[str, Callable[[Call], Awaitable[None]]] = {"mtls": mtls_identity}
        self.certs = ClientCertChecker()
        self._verified: dict[str, Capability] = {}
        self.replay = ReplayCache.sized(window_seconds=cfg.dpop_window_seconds,
                                        max_entries=cfg.dpop_replay_cache_entries,
                                        proofs_per_second_per_key=cfg.dpop_max_proofs_per_second_per_key)
        # serials (hex) on the CRL last loaded; the server points this at its TLS reloader
        self.revoked_serials: Callable[[], frozenset[str]] = frozenset
        # False while the guard is known to be unreachable; the server points this at its upstream monitor
        self.upstream_ok: Callable[[], bool] = lambda: True
        self.reload_keys()

    def reload_keys(self) -> None:
        self.public_keys = keyfiles.load_public_keys(self.paths)
        self._verified = {}

    def verify(self, token: str) -> Capability:
        """tokens.verify_token with a bounded cache of verified tokens (expiry re-checked on every hit)."""
        now = time.time()
        key = hashlib.sha256(token.encode("ascii", "replace")).hexdigest()
        cap = self._verified.get(key)
        if cap is not None and cap.claims.get("exp", 0) > now and cap.expires_at > now:
            return cap
        cap = tokens.verify_token(token, self.public_keys, now=now)
        if len(self._verified) >= VERIFIED_CACHE_ENTRIES:
            self._verified = {}
        self._verified[key] = cap
        return cap

    def add_endpoint(self, url: str) -> None:
        self.endpoints.add(_norm_endpoint(url))

    async def close(self) -> None:
        await self.forwarder.close()
        self.quota.close()
        self.access.close()


STATE = web.AppKey("gateway_state", GatewayState)
LISTENER = web.AppKey("gateway_listener", str)


def register_route(state: GatewayState, route: Route, handler: Handler) -> None:
    """Add a gateway-served route (refresh, payloads) without touching the forwarding path."""
    state.routes.insert(0, route)
    state.handlers[route.name] = handler


def _error(exc: UompError) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="uomp"'} if exc.status == 401 else None
    return web.json_response(exc.body(), status=exc.status, headers=headers)


# ----------------------------------------------------------------------------- checks


async def mtls_identity(call: Call) -> None:
    ssl_obj = call.request.transport.get_extra_info("ssl_object") if call.request.transport else None
    der = ssl_obj.getpeercert(binary_form=True) if isinstance(ssl_obj, ssl.SSLObject) else None
    if not der:
        raise UompError("CERT_REQUIRED", "a client certificate issued by the user's agent CA is required")
    state = call.request.app[STATE]
    # The CRL is checked at the handshake; a keep-alive connection made before a revocation is
    # refused here too, on its next request.
    call.identity = state.certs.check(der, revoked=state.revoked_serials())


def _bearer(request: web.Request) -> str:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() not in ("bearer", "dpop") or not value.strip():
        raise UompError("INVALID_TOKEN", "missing Authorization: Bearer token")
    return value.strip()


def _host_matches(allowed: tuple[str, ...], host_header: str) -> bool:
    host = host_header.strip().lower()
    bare = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    for entry in allowed:
        e = entry.strip().lower()
        if "://" in e:
            parts = urlsplit(e)
            e = parts.netloc
        if e in (host, bare):
            return True
    return False


def check_token(state: GatewayState, call: Call, token: str) -> Capability:
    request = call.request
    cap = state.verify(token)
    call.cap = cap
    route = call.route
    assert route is not None
    if route.token_use == "access" and cap.is_refresh:
        raise UompError("INVALID_TOKEN", "a refresh token never reads memory", session_id=cap.session_id)
    if route.token_use == "refresh" and not cap.is_refresh:
        raise UompError("INVALID_TOKEN", "this route needs a refresh token", session_id=cap.session_id)
    if cap.profile != "remote":
        raise UompError("INVALID_TOKEN", "token profile is not remote", session_id=cap.session_id)
    # The refusals name what was expected (issue 12: a user must be able to tell a wrong
    # --gateway-url from an attack); the token's signature has been checked, so these are our names.
    if cap.audience is None or _norm_endpoint(cap.audience) not in state.endpoints:
        raise UompError("INVALID_TOKEN", f"token audience {str(cap.audience)[:200]!r} is not this gateway (it "
                        f"accepts {', '.join(sorted(state.endpoints)[:8])}); authorize the agent with one of those "
                        "as --gateway-url", session_id=cap.session_id)
    if cap.allowed_endpoints is not None and not _host_matches(cap.allowed_endpoints, request.host):
        raise UompError("ACCESS_DENIED", f"token is not allowed on this endpoint: it is for "
                        f"{', '.join(cap.allowed_endpoints[:4])[:200]}, this request came to host "
                        f"{request.host[:100]!r}", session_id=cap.session_id)
    header_agent = request.headers.get(AGENT_HEADER)
    if not header_agent:
        raise UompError("INVALID_REQUEST", "X-UOMP-Agent-Id header is required", session_id=cap.session_id)
    transport_agent = call.identity.agent_id if call.identity else None
    if header_agent != cap.agent_id or (transport_agent is not None and transport_agent != cap.agent_id):
        raise UompError("AGENT_MISMATCH", "token agent, certificate agent and X-UOMP-Agent-Id must be the same",
                        session_id=cap.session_id)
    # RFC 8705 / RFC 9449 sender constraint.
    if call.identity is not None:
        # Either thumbprint proves possession: x5t#S256 names this certificate, jkt its key, so a
        # certificate renewed for the same key keeps the token usable (the Auth Service agrees).
        bound_ok = cap.cnf_x5t is None and cap.cnf_jkt is None
        if cap.cnf_x5t is not None and cap.cnf_x5t == call.identity.x5t_s256:
            bound_ok = True
        if cap.cnf_jkt is not None and cap.cnf_jkt == call.identity.jkt:
            bound_ok = True
        if not bound_ok:
            raise UompError("TOKEN_BINDING_MISMATCH", "token is bound to another certificate",
                            session_id=cap.session_id)
    elif call.jkt is not None:
        if cap.cnf_jkt is None or cap.cnf_jkt != call.jkt:
            raise UompError("TOKEN_BINDING_MISMATCH", "token is not bound to the DPoP key", session_id=cap.session_id)
    else:
        raise UompError("CERT_REQUIRED", "no proof of possession for this token", session_id=cap.session_id)
    return cap


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
            raise UompError("ACCESS_DENIED", "an agent may read only its own session's audit log",
                            session_id=call.cap.session_id)
    elif (route.name in ("deletion_proof", "refresh") and call.cap is not None
          and call.params.get("sid") != call.cap.session_id):
        raise UompError("ACCESS_DENIED", "token is for another session", session_id=call.cap.session_id)


# ---------------------------------------------------------------------------- forwarding


async def forward(call: Call) -> web.StreamResponse:
    state = call.request.app[STATE]
    request = call.request
    assert call.target is not None and call.cap is not None and call.token is not None
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_REQUEST_HEADERS}
    headers[VERIFIED_AGENT_HEADER] = call.cap.agent_id
    headers[VERIFIED_VIA_HEADER] = (f"gateway:mtls:{call.identity.serial}" if call.identity
                                    else f"gateway:{call.via}")
    body: bytes | None = None
    if request.method in ("POST", "PUT"):
        if request.content_length is not None and request.content_length > state.cfg.max_body_bytes:
            raise UompError("PAYLOAD_TOO_LARGE", f"request body exceeds {state.cfg.max_body_bytes} bytes",
                            session_id=call.cap.session_id)
        # The whole body (one read() returns only what has arrived so far), bounded.
        parts: list[bytes] = []
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > state.cfg.max_body_bytes:
                raise UompError("PAYLOAD_TOO_LARGE", f"request body exceeds {state.cfg.max_body_bytes} bytes",
                                session_id=call.cap.session_id)
            parts.append(chunk)
        body = b"".join(parts)
    path = call.target.upstream_path + (f"?{call.target.query}" if call.target.query else "")
    upstream = await state.forwarder.request(request.method, path, headers, body=body)
    try:
        if upstream.status >= 500 and upstream.content_type != "application/json":
            raise UompError("UPSTREAM_ERROR", "the memory guard answered with an invalid response")
        headers_out = {k: v for k, v in upstream.headers
                       if k.lower() in FORWARD_RESPONSE_HEADERS and k.lower() != QUOTA_HEADER.lower()}
        if call.remaining is not None:
            headers_out[QUOTA_HEADER] = str(call.remaining)
        if upstream.status >= 400:
            # A refusal is small: read it whole (bounded) so the access log records the guard's code.
            raw = await upstream.read(MAX_UPSTREAM_ERROR_BYTES)
            code = _error_code(raw) or f"HTTP_{upstream.status}"
            await _record(call, status=upstream.status, allowed=False, reason="refused by the memory guard",
                          code=code)
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


def _error_code(raw: bytes) -> str | None:
    try:
        doc = json.loads(raw)
        code = doc["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) and code in STATUS else None


async def _record(call: Call, *, status: int, allowed: bool, reason: str, code: str | None) -> None:
    """Make the request's event durable before its answer; STORE_UNAVAILABLE if it cannot be.

    An event without a verified session is rate-limited per source (counted beyond the rate)."""
    state = call.request.app[STATE]
    if call.recorded:
        return
    call.recorded = True
    source = None if call.cap is not None else (call.request.remote or "unknown")
    ticket = state.access.append(call.event(status=status, allowed=allowed, reason=reason, code=code),
                                 source=source)
    await state.access.flush(ticket)
    fault_point(f"gateway_answer_{call.route.name if call.route else 'unknown'}")


def _unrecorded(exc: UompError) -> web.Response:
    """The answer when the event could not be made durable: 503, as the counted event says."""
    return _error(exc if exc.code == "STORE_UNAVAILABLE" else UompError("STORE_UNAVAILABLE", "access log failed"))


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
        if call.remaining is not None:
            resp.headers[QUOTA_HEADER] = str(call.remaining)
        try:
            await _record(call, status=exc.status, allowed=False, reason=exc.message, code=exc.code)
        except UompError as log_exc:  # the event could not be written: the client gets 503, not 500
            code, resp = "STORE_UNAVAILABLE", _unrecorded(log_exc)
    except Exception as exc:
        code = "INTERNAL"
        log.error("unhandled %s in gateway handler", type(exc).__name__)
        resp = _error(UompError("INTERNAL", "internal error"))
        try:
            await _record(call, status=500, allowed=False, reason="internal error", code="INTERNAL")
        except UompError as log_exc:
            code, resp = "STORE_UNAVAILABLE", _unrecorded(log_exc)
    finally:
        transport.request_finished(request)
    state.metrics.observe_request(call.route.name if call.route else "unknown", code,
                                  time.perf_counter() - started)
    return resp


async def _dispatch(state: GatewayState, call: Call) -> web.StreamResponse:
    request = call.request
    call.target = pathnorm.normalize_target(request.raw_path)
    listener = request.app[LISTENER]
    routes = [r for r in state.routes if listener in r.transports]
    for route in routes:
        m = route.pattern.fullmatch(call.target.path)
        if m and route.method == request.method:
            call.route = route
            call.params = {k: v for k, v in m.groupdict().items() if v is not None}
            break
    else:
        if any(r.pattern.fullmatch(call.target.path) for r in routes):
            raise UompError("METHOD_NOT_ALLOWED", "method not allowed on this endpoint")
        raise UompError("NOT_FOUND", "no such endpoint")
    route = call.route
    assert route is not None
    await state.access.ready()  # fail closed while the access log cannot be written (tries one write)
    if not route.auth:
        if not state.upstream_ok():
            raise UompError("STORE_UNAVAILABLE", "the memory guard is unreachable")
        resp = web.json_response({"status": "ok"})
        await _record(call, status=200, allowed=True, reason="health", code=None)
        return resp
    await state.transport_auth[listener](call)
    if route.token_use == "none":
        return await state.handlers[route.name](call)
    call.token = _bearer(request)
    cap = check_token(state, call, call.token)
    _route_params(call)
    if route.status_check:
        await state.status.check(call.token, cap)
    for done in call.on_authenticated:
        done()
    transport.authenticated(request)  # the connection leaves the unverified budget (tunnel listener)
    if route.reads:
        remaining = await state.quota.consume(cap.session_id, cap.max_read_queries)
        if remaining == -1:
            call.remaining = 0
            raise UompError("QUOTA_EXCEEDED", "read query quota is exhausted", session_id=cap.session_id)
        call.remaining = remaining
    handler = state.handlers.get(route.name, forward)
    return await handler(call)


def create_gateway_app(state: GatewayState, *, listener: str) -> web.Application:
    app = web.Application(client_max_size=state.cfg.max_body_bytes)
    app[STATE] = state
    app[LISTENER] = listener
    app.router.add_route("*", "/{tail:.*}", entry)
    app.on_response_prepare.append(_server_header)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    # No library or Python version advertised to the internet.
    response.headers["Server"] = "uomp-gateway"
