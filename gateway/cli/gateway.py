"""``uomp gateway serve`` (the gateway alone) and ``uomp gateway start`` (the appliance)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

from gateway.cli.guard import guard_config
from gateway.cli.main import paths_from
from gateway.config import GatewayConfig, Paths, load_section
from gateway.errors import UompError

log = logging.getLogger("uomp.gateway")


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


async def _run(paths: Paths, gcfg: GatewayConfig, *, with_guard: bool, args: argparse.Namespace) -> None:
    from gateway.guard.server import GuardRunner
    from gateway.remote.server import GatewayRunner

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    guard: GuardRunner | None = None
    if with_guard:
        guard = GuardRunner(paths, guard_config(args, paths), serve_tcp=not args.no_local_port)
        await guard.start()
    gw = GatewayRunner(paths, gcfg)
    try:
        await gw.start()
    except BaseException:
        if guard is not None:
            await guard.stop()
        raise
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def _hup() -> None:
        gw.reload()
        if guard is not None:
            guard.reload_keys()
    loop.add_signal_handler(signal.SIGHUP, _hup)
    print(f"gateway: https://{gcfg.listen_host}:{gw.port} (TLS 1.3, client certificates from your agent CA)",
          flush=True)
    if guard is not None:
        print(f"guard:   unix:{paths.guard_sock}" + ("" if args.no_local_port else
                                                     f" and http://127.0.0.1:{guard.tcp_port} (Local Profile)"),
              flush=True)
    if gw.metrics_port:
        print(f"metrics: http://127.0.0.1:{gw.metrics_port}/metrics", flush=True)
    if gw.tunnel_port:
        print(f"tunnel origin: http://127.0.0.1:{gw.tunnel_port} (DPoP required)", flush=True)
    print("Ctrl-C stops; SIGHUP reloads certificates, CRL and keys.", flush=True)
    try:
        await stop.wait()
    finally:
        await gw.stop()
        if guard is not None:
            await guard.stop()


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
    st = gsub.add_parser("start", help="run the appliance: init if needed, then the guard and the gateway "
                         "in one process")
    _common(st)
    st.add_argument("--no-local-port", action="store_true",
                    help="do not serve the Local Profile on 127.0.0.1:9374 (Unix socket only)")
    st.set_defaults(func=_start)
