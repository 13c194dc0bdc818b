"""``uomp gateway serve`` (the gateway alone) and ``uomp gateway start`` (the appliance).

``start`` runs the guard in a child process, supervised by :class:`gateway.supervisor.GuardProcess`
(health-checked over its socket, restarted with backoff if it dies or stops answering; see that
module), and the gateway in this one, so each gets its own core and event loop. Here:

* before anything starts: the gateway's (and tunnel origin's, and Local Profile's) bind address is
  checked, and a live server on ``guard.sock`` is refused (a stale socket file is removed);
* the gateway starts only once the child answers ``GET /v1/health``;
* SIGTERM / SIGINT: the gateway stops (in-flight requests finish), then the child;
  SIGHUP reloads the gateway's certificates, CRL and keys and is forwarded to the child;
* the child's output (its log lines) is relayed to this process's stderr; the supervisor's view
  of the child (pid, restarts, last reason) goes into the gateway's status file
  (``$UOMP_HOME/gateway/status.json``) and metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from gateway.cli.guard import guard_config
from gateway.cli.main import paths_from
from gateway.config import GatewayConfig, GuardConfig, Paths, load_section
from gateway.errors import UompError
from gateway.supervisor import GuardProcess, guard_command


def gateway_config(args: argparse.Namespace, paths: Paths) -> GatewayConfig:
    overrides: dict[str, Any] = {}
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        if not host or not port.isdigit():
            raise UompError("CONFIG_ERROR", "--listen takes HOST:PORT")
        overrides["listen_host"] = host.strip("[]")
        overrides["listen_port"] = int(port)
    if args.upstream:
        overrides["upstream"] = args.upstream
    if args.endpoint:
        overrides["endpoints"] = list(args.endpoint)
    if args.force_non_loopback:
        overrides["allow_non_loopback"] = True
    if args.metrics_port is not None:
        overrides["metrics_port"] = args.metrics_port
    if args.tunnel_origin_port is not None:
        overrides["tunnel_origin_port"] = args.tunnel_origin_port
    return load_section(GatewayConfig, "gateway", file=paths.config_file, overrides=overrides)


# ----------------------------------------------------------------------------- running


def preflight(paths: Paths, gcfg: GatewayConfig, guard_cfg: GuardConfig | None, *, serve_tcp: bool) -> None:
    """Everything that must be refused before any process or listener starts."""
    from gateway.guard.server import check_bind, claim_socket_path

    check_bind(gcfg.listen_host, gcfg.allow_non_loopback, "the gateway")
    if gcfg.tunnel_origin_port >= 0:
        check_bind(gcfg.tunnel_origin_host, False, "the tunnel-origin listener")
    if guard_cfg is not None:
        if serve_tcp:
            check_bind(guard_cfg.tcp_host, guard_cfg.allow_non_loopback, "the guard's Local Profile listener")
        claim_socket_path(paths.guard_sock)  # a live guard there: refuse; a stale file: removed


async def _run(paths: Paths, gcfg: GatewayConfig, *, with_guard: bool, args: argparse.Namespace) -> None:
    from gateway.remote.server import GatewayRunner

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    guard: GuardProcess | None = None
    serve_tcp = not getattr(args, "no_local_port", False)
    if with_guard:
        gcfg_guard = guard_config(args, paths)
        preflight(paths, gcfg, gcfg_guard, serve_tcp=serve_tcp)
        command = guard_command(paths, serve_tcp=serve_tcp, verbose=bool(getattr(args, "verbose", False)),
                                force_non_loopback=bool(args.force_non_loopback))
        guard = GuardProcess(paths, command, health_interval=gcfg.guard_health_interval_seconds,
                             health_timeout=gcfg.guard_health_timeout_seconds,
                             health_failures=gcfg.guard_health_failures, output=_relay_line)
        await guard.start()
    gw = GatewayRunner(paths, gcfg)
    if guard is not None:
        gw.status_sources["guard"] = guard.status  # into $UOMP_HOME/gateway/status.json
        guard.on_restart = gw.guard_restarted  # metrics and the status file
    try:
        await gw.start()
    except BaseException:
        if guard is not None:
            await guard.stop()
        raise

    def _stop() -> None:
        if guard is not None:
            guard.stopping = True  # at once: a child that exits from the same Ctrl-C is not restarted
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop)

    def _hup() -> None:
        gw.reload()
        if guard is not None:
            guard.send_hup()
    loop.add_signal_handler(signal.SIGHUP, _hup)
    print(f"gateway: https://{gcfg.listen_host}:{gw.port} (TLS 1.3, client certificates from your agent CA)",
          flush=True)
    if guard is not None:
        guard.supervise()
        local = ""
        if serve_tcp:
            local = f" and {guard.tcp_url or f'http://127.0.0.1:{gcfg_guard.tcp_port}'} (Local Profile)"
        print(f"guard:   unix:{paths.guard_sock}{local} (process {guard.pid}, restarted if it dies)", flush=True)
    if gw.metrics_port:
        print(f"metrics: http://127.0.0.1:{gw.metrics_port}/metrics", flush=True)
    if gw.tunnel_port:
        print(f"tunnel origin: http://127.0.0.1:{gw.tunnel_port} (DPoP required)", flush=True)
    print("Ctrl-C stops; SIGHUP reloads certificates, CRL and keys.", flush=True)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await gw.stop()
        if guard is not None:
            await guard.stop()


def _relay_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _serve(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    asyncio.run(_run(paths, gateway_config(args, paths), with_guard=False, args=args))
    return 0


def _start(args: argparse.Namespace) -> int:
    from gateway import keys

    paths = paths_from(args)
    keys.init_home(paths)
    from gateway.cli import home

    for hook in home.INIT_HOOKS:
        hook(paths)
    asyncio.run(_run(paths, gateway_config(args, paths), with_guard=True, args=args))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", metavar="HOST:PORT", help="mTLS listener (default 127.0.0.1:9443)")
    p.add_argument("--endpoint", action="append", metavar="URL",
                   help="a URL agents use to reach this gateway; tokens must name one as audience (repeatable)")
    p.add_argument("--upstream", help="guard to forward to: unix:/path/guard.sock (default $UOMP_HOME/guard.sock) "
                   "or http://127.0.0.1:PORT")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--tunnel-origin-port", type=int, metavar="PORT",
                   help="also listen on 127.0.0.1:PORT (plain HTTP) for a tunnel such as cloudflared; every request "
                   "there needs a DPoP proof; the tunnel's public URL must be an --endpoint")
    p.add_argument("--force-non-loopback", action="store_true",
                   help="allow --listen on a non-loopback address (needed to accept agents from other hosts)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    g = sub.add_parser("gateway", help="the remote gateway (TLS 1.3 + mTLS) for agents on other machines")
    gsub = g.add_subparsers(dest="gateway_command", metavar="ACTION", required=True)
    s = gsub.add_parser("serve", help="run the gateway alone, in front of an already running guard")
    _common(s)
    s.set_defaults(func=_serve)
    st = gsub.add_parser("start", help="run the appliance: init if needed, then the guard (in a child process, "
                         "restarted if it dies) and the gateway")
    _common(st)
    st.add_argument("--no-local-port", action="store_true",
                    help="do not serve the Local Profile on 127.0.0.1:9374 (Unix socket only)")
    st.set_defaults(func=_start)
