"""Running the gateway: the mTLS listener, the optional tunnel-origin and metrics listeners,
TLS reloads (SIGHUP and file changes), and clean shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway import ca_store, httpd, keys
from gateway.config import GatewayConfig, Paths
from gateway.errors import ErrorCode, UompError
from gateway.eventloop import cancel_all
from gateway.netutil import check_bind
from gateway.remote import agent_routes, enroll_routes, payload_routes, payload_service, transport
from gateway.remote.access_log import AccessLog
from gateway.remote.app import create_gateway_app
from gateway.remote.guard_client import Forwarder, Upstream
from gateway.remote.metrics import Metrics, create_metrics_app
from gateway.remote.state import GatewayState
from gateway.remote.tls import TLSReloader
from gateway.remote.upstream_health import UpstreamMonitor

if TYPE_CHECKING:  # the uplink's code (h2, hpack) is loaded only by a gateway that has one
    from gateway.uplink.hub import UplinkHub

log = logging.getLogger("uomp.gateway")

MAX_HEADERS = 64  # header lines of one request


def tls_paths(paths: Paths, cfg: GatewayConfig) -> tuple[Path, Path, Path, Path]:
    """The server certificate, its key, the agent CA and the CRL the mTLS listener uses."""
    return (
        Path(cfg.server_cert) if cfg.server_cert else ca_store.server_cert_path(paths),
        Path(cfg.server_key) if cfg.server_key else ca_store.server_key_path(paths),
        Path(cfg.agent_ca) if cfg.agent_ca else ca_store.ca_cert_path(paths),
        Path(cfg.agent_crl) if cfg.agent_crl else ca_store.crl_path(paths),
    )


def _flush_done(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("one log: an event could not be recorded (%s)", type(fut.exception()).__name__)


async def _renewal_at_home(call: Any) -> httpd.AnyResponse:
    raise UompError(
        ErrorCode.NOT_IMPLEMENTED,
        "certificate renewal is not served by a VPS gateway (its CA key stays at home); "
        "get a new certificate at home: uomp authorize --remote (docs/vps.md)",
    )


async def _enrollment_at_home(call: Any) -> httpd.AnyResponse:
    raise UompError(
        ErrorCode.NOT_IMPLEMENTED,
        "enrollment is not served by a VPS gateway (its codes and requests are kept at home); "
        "enroll at home, or authorize the agent there: uomp authorize --remote (docs/vps.md)",
    )


class GatewayRunner:
    """Starts and stops the gateway's listeners, state, watchers and workers."""

    def __init__(self, paths: Paths, cfg: GatewayConfig) -> None:
        self.paths = paths
        self.cfg = cfg
        self.state: GatewayState | None = None
        self.reloader: TLSReloader | None = None
        # One registry (budgets, deadlines, counters) per listener; the budgets are fitted under the
        # file descriptor limit at start.
        self.registry = transport.ConnectionRegistry(transport.Limits.for_listener(cfg, "mtls"), name="mtls")
        self.tunnel_registry = transport.ConnectionRegistry(transport.Limits.for_listener(cfg, "tunnel"), name="tunnel")
        # the metrics listener (loopback, no authentication): every connection is unverified
        self.metrics_registry = transport.ConnectionRegistry(
            transport.Limits.for_listener(cfg, "metrics"), name="metrics"
        )
        self.fd_limit: int | None = None
        self._servers: list[asyncio.Server] = []
        self._http: list[httpd.Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.port: int | None = None
        self.tunnel_port: int | None = None
        self.metrics_port: int | None = None
        # Other parts of the gateway (refresh, payloads, DPoP listener) hook in here before start().
        self.setup_hooks: list[Callable[[GatewayState], None]] = []
        # Extra sections of the status file ($UOMP_HOME/gateway/status.json), e.g. "guard" (supervisor).
        self.status_sources: dict[str, Callable[[], dict[str, Any]]] = {}
        self.monitor: UpstreamMonitor | None = None
        self.payloads: payload_service.PayloadService | None = None
        self.uplink: UplinkHub | None = None  # the guard at home, over the outbound uplink
        self.uplink_port: int | None = None
        self.shared: Any = None  # gateway.remote.shared_state.SharedState when shared_redis_url is set

    def _http_server(self, app: httpd.App, name: str) -> httpd.Server:
        # no connection budget here: the listener's ConnectionRegistry counts from accept
        server = httpd.Server(
            app,
            name=name,
            max_connections=None,
            keepalive_seconds=self.cfg.keepalive_timeout_seconds,
            max_line=self.cfg.max_header_bytes,
            max_field=self.cfg.max_header_bytes,
            max_headers=MAX_HEADERS,
        )
        self._http.append(server)
        return server

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # close whatever was opened (access log lock, databases, listeners)
            raise

    async def _start(self) -> None:
        cfg = self.cfg
        check_bind(cfg.listen_host, cfg.allow_non_loopback, "the gateway")
        cert, key, ca, crl = tls_paths(self.paths, cfg)
        for p in (cert, key, ca, crl):
            if not p.exists():
                raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is missing; run 'uomp init' (or 'uomp ca init') first")
        self.reloader = TLSReloader(
            cert, key, ca, crl, crl_state=self.paths.crl_state, session_tickets=cfg.tls_session_tickets
        )
        if cfg.uplink_listen_port >= 0:  # the guard is at home, behind the uplink (docs/vps.md)
            from gateway.uplink.hub import uplink_hub
            from gateway.uplink.trust import TrustSink

            self.uplink = hub = uplink_hub(self.paths, cfg)
            # the CRL and the verification keys come from home over the uplink (gateway/uplink/trust.py)
            hub.trust = TrustSink(self.paths, self.reloader, on_keys=self.reload_keys)
            upstream = Upstream("uplink", f"{cfg.uplink_listen_host}:{cfg.uplink_listen_port}")
            forwarder = Forwarder(upstream, timeout_seconds=cfg.upstream_timeout_seconds, client=hub)
        else:
            upstream = Upstream.parse(cfg.upstream or f"unix:{self.paths.guard_sock}")
            forwarder = Forwarder(upstream, timeout_seconds=cfg.upstream_timeout_seconds)
        self.paths.gateway_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        access = AccessLog(
            self.paths.access_log,
            segment_bytes=cfg.access_log_segment_bytes,
            max_total_bytes=cfg.access_log_max_total_bytes,
            retention_days=cfg.access_log_retention_days,
            unauth_events_per_second=cfg.access_log_unauth_events_per_second,
            unauth_burst=cfg.access_log_unauth_burst,
            summary_interval_seconds=cfg.access_log_summary_interval_seconds,
        )
        metrics = Metrics()
        self.monitor = monitor = UpstreamMonitor(
            upstream,
            metrics=metrics,
            status_file=self.paths.gateway_status,
            interval=cfg.upstream_health_interval_seconds,
            timeout=cfg.upstream_health_timeout_seconds,
            log_seconds=cfg.upstream_failure_log_seconds,
            sources=self.status_sources,
            probe=self.uplink.probe if self.uplink is not None else None,
        )
        if self.uplink is not None:
            self.status_sources["uplink"] = self.uplink.snapshot
            self.uplink.on_change = monitor.wake
        forwarder.on_failure = monitor.request_failed
        # the spool's state, and the events counted instead of written (spool failures + rate limit)
        metrics.access_log_state = lambda: (
            access.failing is None,
            access.events_counted + (self.state.events.events_counted if self.state is not None else 0),
        )
        endpoints = list(cfg.endpoints) or [
            f"https://localhost:{cfg.listen_port}",
            f"https://127.0.0.1:{cfg.listen_port}",
        ]
        key_watch = keys.KeyWatch(self.paths)  # before the keys are read: no change goes unseen
        self.state = state = GatewayState(
            self.paths,
            cfg,
            forwarder=forwarder,
            access=access,
            metrics=metrics,
            endpoints=endpoints,
            tunnel_endpoints=list(cfg.tunnel_endpoints),
        )
        ev = state.events
        metrics.spool_state = lambda: (ev.backlog, ev.batches_refused, ev.events_set_aside, ev.events_replayed)
        reloader = self.reloader
        state.tls_trust = lambda: reloader.trust
        state.upstream_ok = lambda: monitor.up is not False
        agent_routes.install(state)
        enroll_routes.install(state)
        if self.uplink is not None and not self.paths.ca_key.exists():
            state.handlers["renew"] = _renewal_at_home  # a VPS gateway holds no CA key
            for route, _handler in enroll_routes.ROUTES:  # nor the home's enroll.db
                state.handlers[route.name] = _enrollment_at_home
        if cfg.shared_redis_url:  # replicas: the DPoP replay cache and rate in Redis
            from gateway.remote import shared_state

            self.shared = shared_state.SharedState(
                cfg.shared_redis_url, prefix=cfg.shared_key_prefix, timeout_seconds=cfg.shared_timeout_seconds
            )
            shared_state.install(state, self.shared)
        self.payloads = payload_routes.install(state)
        self.payloads.start()
        if self.uplink is not None:  # the sealed payloads go home over the uplink (gateway/uplink/relay.py)
            from gateway.uplink.relay import Outbox

            self.uplink.payloads = Outbox(self.payloads.store, self.payloads.worker)
        for hook in self.setup_hooks:
            hook(state)

        def rejected(status: int, code: ErrorCode, message: str) -> None:
            # the HTTP server answers these itself (synchronously): the event goes to the one log
            # (rate-limited per source), durable without waiting for a later request.
            done = state.events.append(
                {"action": "malformed", "allowed": False, "reason": message, "code": code, "status": status},
                source="malformed",
            )
            if done is not None:
                done.add_done_callback(_flush_done)

        registries = [self.registry]
        if cfg.tunnel_origin_port >= 0:
            registries.append(self.tunnel_registry)
        if cfg.metrics_port >= 0:
            registries.append(self.metrics_registry)
        self._fit_limits(registries)
        from gateway.remote.handshake_log import HandshakeLog
        from gateway.remote.identity import connection_refusal

        self.registry.on_handshake_failed = HandshakeLog(
            metrics, "mtls", per_second=cfg.handshake_log_per_second, burst=cfg.handshake_log_burst, events=state.events
        )
        self.registry.check_peer = lambda ssl_obj: connection_refusal(state, ssl_obj)
        for reg in (self.registry, self.tunnel_registry):
            reg.on_rejected = rejected
            reg.on_open = metrics.connection_opened
            reg.on_close = metrics.connection_closed
        backlog = transport.backlog_for(self.fd_limit or transport.MAX_BACKLOG * 16)

        srv = await transport.listen(
            self._http_server(create_gateway_app(state, listener="mtls"), "mtls"),
            cfg.listen_host,
            cfg.listen_port,
            ssl_context=self.reloader.context,
            registry=self.registry,
            backlog=backlog,
            reuse_port=cfg.listen_reuse_port,
        )
        self._servers.append(srv)
        self.port = httpd.bound_port(srv)
        if cfg.listen_port == 0:
            # the audience of a test gateway on an ephemeral port
            state.add_endpoint(f"https://localhost:{self.port}")
            state.add_endpoint(f"https://127.0.0.1:{self.port}")
        if cfg.tunnel_origin_port >= 0:
            if "tunnel" not in state.transport_auth:
                raise UompError(
                    ErrorCode.CONFIG_ERROR, "the tunnel-origin listener needs DPoP support, which is not loaded"
                )
            # cloudflared runs on this host: the origin listener is loopback-only, no override.
            check_bind(cfg.tunnel_origin_host, False, "the tunnel-origin listener")
            tsrv = await transport.listen(
                self._http_server(create_gateway_app(state, listener="tunnel"), "tunnel"),
                cfg.tunnel_origin_host,
                cfg.tunnel_origin_port,
                ssl_context=None,
                registry=self.tunnel_registry,
                backlog=backlog,
            )
            self._servers.append(tsrv)
            self.tunnel_port = httpd.bound_port(tsrv)
            if not state.listener_endpoints.get("tunnel"):
                log.warning(
                    "the tunnel-origin listener has no tunnel_endpoints: it refuses every request "
                    "until the tunnel's public URL is configured"
                )
        if cfg.metrics_port >= 0:
            mapp = create_metrics_app(metrics, middleware=transport.phase_middleware)
            msrv = await transport.listen(
                self._http_server(mapp, "metrics"),
                "127.0.0.1",
                cfg.metrics_port,
                ssl_context=None,
                registry=self.metrics_registry,
                backlog=backlog,
            )
            self._servers.append(msrv)
            self.metrics_port = httpd.bound_port(msrv)
        if self.uplink is not None:
            check_bind(cfg.uplink_listen_host, cfg.allow_non_loopback, "the uplink listener")
            self.uplink_port = await self.uplink.listen(cfg.uplink_listen_host, cfg.uplink_listen_port)
        loop = asyncio.get_running_loop()

        crl_watch = ca_store.CrlWatch(self.paths)  # the registry is opened only when a file changed

        def tick() -> None:  # in a worker thread, every TLS watch interval
            if key_watch.changed():  # `uomp keys rotate [--revoke-old]`: reload without a SIGHUP
                self.reload_keys()  # reads key files: here, in the thread (GatewayState swaps whole dicts)
            if self.paths.ca_key.exists():  # a VPS gateway has no CA key: its CRL comes from home
                crl_watch.tick()

        self._tasks.append(loop.create_task(self.reloader.watch(cfg.tls_watch_interval_seconds, tick=tick)))
        await monitor.check()  # /v1/health tells the truth from the first request on
        self._tasks.append(loop.create_task(monitor.run()))
        self._tasks.append(loop.create_task(state.events.run_replayer()))  # the spool, once the guard is back
        log.info(
            "gateway listening on https://%s:%s (TLS 1.3, mTLS), upstream %s", cfg.listen_host, self.port, upstream.kind
        )

    def guard_restarted(self, reason: str) -> None:
        """The supervisor restarted the guard child (counted; the monitor checks it at once)."""
        if self.state is not None:
            self.state.metrics.guard_restarted()
        if self.monitor is not None:
            self.monitor.wake()

    def guard_checked(self, why: str | None, next_check_in: float | None = None) -> None:
        """The supervisor health-checked its guard child on ``guard.sock`` (``why`` None: it
        passed; its next check in ``next_check_in`` seconds). When that is this gateway's upstream,
        a pass stands for the monitor's own probe until then
        (:meth:`UpstreamMonitor.passed_elsewhere`) and a failure makes it check at once."""
        monitor = self.monitor
        if monitor is None or monitor.upstream != Upstream("unix", str(self.paths.guard_sock)):
            return
        if why is None:
            monitor.passed_elsewhere(next_check_in)
        else:
            monitor.wake()

    def _fit_limits(self, registries: list[transport.ConnectionRegistry]) -> None:
        """Raise the soft file-descriptor limit to the hard one and shrink the budgets to fit under it."""
        self.fd_limit = fd_limit = transport.raise_fd_limit()
        wanted = [reg.limits for reg in registries]
        fitted = transport.fit_limits(wanted, fd_limit, self.cfg.fd_reserve)
        for reg, lim in zip(registries, fitted, strict=True):
            if lim != reg.limits:
                log.warning(
                    "%s listener: connection budgets lowered to %d verified / %d unverified to fit the "
                    "file descriptor limit %d (fd_reserve %d)",
                    reg.name,
                    lim.max_verified,
                    lim.max_unverified,
                    fd_limit,
                    self.cfg.fd_reserve,
                )
            reg.limits = lim

    def reload(self) -> None:
        """TLS files and keys again (SIGHUP). Blocking (file reads, an fsync): run it in a worker thread."""
        if self.reloader is not None:
            self.reloader.reload_logged()
        self.reload_keys()

    def reload_keys(self) -> None:
        if self.state is not None:
            try:
                self.state.reload_keys()
            except UompError as exc:
                log.error("key reload failed: %s", exc.message)

    async def stop(self) -> None:
        if self.uplink is not None:
            await self.uplink.close()
        await cancel_all(self._tasks)
        for srv in self._servers:
            srv.close()
        for reg in (self.registry, self.tunnel_registry, self.metrics_registry):
            reg.close_unverified_handshakes()  # the HTTP servers know nothing of these yet
        await asyncio.gather(*(server.close() for server in self._http))  # httpd.STOP_GRACE_SECONDS each
        self._http.clear()
        for reg in (self.registry, self.tunnel_registry, self.metrics_registry):
            reg.close_all()
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 5)
        if self.shared is not None:
            await self.shared.close()
            self.shared = None
        if self.payloads is not None:
            await self.payloads.close()
            self.payloads = None
        if self.state is not None:
            await self.state.close()
            self.state = None
        if self.monitor is not None:  # the status file says the gateway stopped
            self.monitor.running = False
            await self.monitor.write_status(force=True)
            self.monitor = None
