"""The gateway's long-lived state, shared by its listeners: trusted keys and verified-token cache,
listener endpoints, the route table and its handlers, the session-status cache, the event sink."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway import contract, httpd
from gateway import keys as keyfiles
from gateway.config import GatewayConfig, GuardConfig, Paths, load_section
from gateway.core import checks, tokens
from gateway.core.capability import Capability
from gateway.core.dpop import ReplayCache
from gateway.core.tokencache import ExpiringMap, remember_verified
from gateway.errors import ErrorCode, UompError, parse_code
from gateway.remote.access_log import AccessLog
from gateway.remote.event_sink import EventSink
from gateway.remote.guard_client import Forwarder
from gateway.remote.metrics import Metrics
from gateway.remote.request import Call, Handler, Route
from gateway.remote.routenames import RouteName
from gateway.remote.routes import ROUTES
from gateway.remote.tls import NO_TRUST_LIMITS, ClientCertChecker, Trust

MAX_STATUS_CACHE_SECONDS = 1.0


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


norm_endpoint = checks.norm_endpoint


def host_key(host_header: str, scheme: str) -> str:
    """A Host header as the ``host[:port]`` of :func:`checks.endpoint_netloc` (default port dropped)."""
    return checks.endpoint_netloc(f"{scheme}://{host_header.strip()}") if host_header else ""


class GatewayState:
    """What every gateway request shares: settings, keys, endpoints, the route table, the guard client and caches."""

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
        self.transport_auth: dict[str, Callable[[Call], Awaitable[None]]] = {}
        self.certs = ClientCertChecker()
        self._verified: ExpiringMap[Capability] = ExpiringMap(cfg.token_cache_entries)
        self._route_index: dict[tuple[str, str], list[Route]] = {}
        self._route_index_of: tuple[Route, ...] = ()
        self.replay = ReplayCache.sized(
            window_seconds=cfg.dpop_window_seconds,
            max_entries=cfg.dpop_replay_cache_entries,
            proofs_per_second_per_key=cfg.dpop_max_proofs_per_second_per_key,
        )
        # the CRL and CA last loaded (revoked serials, nextUpdate, CA validity) for the per-connection
        # certificate check (identity.peer_check); the server points this at its TLS reloader
        self.tls_trust: Callable[[], Trust] = lambda: NO_TRUST_LIMITS
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
        self._verified.clear()
        self.generation += 1

    def verify_digest(self, token: str) -> tuple[Capability, str]:
        """tokens.verify_token with a cache of the access tokens verified and still alive
        (gateway/core/tokencache.py), and the token's SHA-256 (the cache key, and what the guard is told)."""
        now = time.time()
        key = contract.token_digest(token)
        cap = self._verified.get(key, now)
        if cap is not None:
            return cap, key
        cap = tokens.verify_token(token, self.public_keys, now=now)
        remember_verified(self._verified, key, cap, now)
        return cap, key

    def verify(self, token: str) -> Capability:
        return self.verify_digest(token)[0]

    @property
    def verified_cached(self) -> int:
        """Access tokens in the verification cache (live ones only, gateway/core/tokencache.py)."""
        return len(self._verified)

    @property
    def endpoints(self) -> set[str]:
        """Every endpoint of every listener (normalised URLs)."""
        return self.listener_endpoints["mtls"] | self.listener_endpoints["tunnel"]

    def add_endpoint(self, url: str, *, listener: str = "mtls") -> None:
        """Serve ``url`` on ``listener`` ("mtls" or "tunnel": a tunnel supervisor reports each new
        public URL here with ``listener="tunnel"``)."""
        norm = norm_endpoint(url)
        self.generation += 1
        self.listener_endpoints.setdefault(listener, set()).add(norm)
        self._listener_hosts.setdefault(listener, {})[checks.endpoint_netloc(norm)] = norm

    def discard_endpoint(self, url: str) -> None:
        """Stop serving ``url`` on every listener."""
        norm = norm_endpoint(url)
        self.generation += 1
        for listener, urls in self.listener_endpoints.items():
            urls.discard(norm)
            hosts = self._listener_hosts.get(listener, {})
            if hosts.get(checks.endpoint_netloc(norm)) == norm:
                del hosts[checks.endpoint_netloc(norm)]

    def match_endpoint(self, listener: str, host_header: str) -> str | None:
        """The ``host[:port]`` of this listener's endpoint that ``host_header`` names, or None."""
        scheme = "https"  # every public endpoint is https (the tunnel's TLS ends at its edge)
        key = host_key(host_header, scheme)
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


STATE = httpd.AppKey("gateway_state", GatewayState)
LISTENER = httpd.AppKey("gateway_listener", str)


def register_route(state: GatewayState, route: Route, handler: Handler) -> None:
    """Add a gateway-served route (refresh, payloads) without touching the forwarding path."""
    state.routes.insert(0, route)
    state.handlers[route.name] = handler
