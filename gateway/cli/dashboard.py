"""``uomp dashboard [--port P] [--open]``: a one-time login link to the local dashboard.

While ``uomp gateway start`` runs on this data directory it serves the dashboard itself; this
command then only hands it a fresh one-time link (``gateway.dashboard.security.hand_over_link``)
and prints it. Otherwise it serves the dashboard here, on loopback, until Ctrl-C (the pages for
payloads need the appliance's guard and say so when it is not running).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import webbrowser

from gateway import appliance
from gateway.cli.main import paths_from
from gateway.config import DashboardConfig, Paths, load_section
from gateway.errors import ErrorCode, UompError


def _open(url: str) -> None:
    try:
        opened = webbrowser.open(url, new=2)
    except webbrowser.Error:
        opened = False
    if not opened:
        print("(no browser could be opened here: copy the link into a browser on this machine)")


def _running_dashboard(paths: Paths) -> str | None:
    if not appliance.is_running(paths):
        return None
    url = ((appliance.read_run(paths) or {}).get("listeners") or {}).get("dashboard")
    return str(url) if isinstance(url, str) else None


async def _serve(paths: Paths, cfg: DashboardConfig, open_browser: bool) -> None:
    from gateway.dashboard.server import Dashboard

    dash = Dashboard(paths, cfg)
    try:
        await dash.start()
    except OSError as exc:
        raise appliance.port_error(cfg.host, cfg.port, "the dashboard", "--port P", exc) from None
    link = dash.login_link()
    print(f"dashboard: {dash.base_url} (loopback only; Ctrl-C stops it)")
    print(f"one-time login link (works once, for {cfg.login_ttl_seconds:g} s): {link}", flush=True)
    if open_browser:
        _open(link)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        await dash.stop()


def _dashboard(args: argparse.Namespace) -> int:
    from gateway.dashboard.security import hand_over_link

    paths = paths_from(args)
    cfg = load_section(
        DashboardConfig,
        "dashboard",
        file=paths.config_file,
        overrides={"port": args.port} if args.port is not None else None,
    )
    running = _running_dashboard(paths)
    if running is not None:
        if args.port is not None and not running.endswith(f":{args.port}"):
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                f"the running appliance serves the dashboard at {running}; "
                "leave out --port (or stop the appliance to serve it elsewhere)",
            )
        link = f"{running}/login?t={hand_over_link(paths, cfg.login_ttl_seconds)}"
        print(f"one-time login link (works once, for {cfg.login_ttl_seconds:g} s): {link}")
        if args.open:
            _open(link)
        return 0
    if appliance.is_running(paths):
        print(
            "the running appliance does not serve the dashboard ([dashboard] enabled = false, or its port was "
            "taken); serving it here"
        )
    asyncio.run(_serve(paths, cfg, args.open))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp dashboard`` to the command line."""
    d = sub.add_parser(
        "dashboard",
        help="the local dashboard: print (and --open) a one-time login link; serves "
        "it here unless 'uomp gateway start' already does (docs/dashboard.md)",
    )
    d.add_argument("--port", type=int, help="port on 127.0.0.1 (default [dashboard] port, 9380; 0: any free port)")
    d.add_argument("--open", action="store_true", help="also open the link in this machine's browser")
    d.set_defaults(func=_dashboard, service=True)
