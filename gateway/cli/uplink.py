"""``uomp uplink init`` (at home: the uplink identities and the VPS's data directory) and
``uomp guard uplink URL`` (at home: dial the gateway on the VPS and serve the guard over it).
docs/vps.md walks through both."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from gateway import eventloop
from gateway.cli.main import paths_from
from gateway.config import Paths


def _say(text: str) -> None:
    print(text, flush=True)


def _init(args: argparse.Namespace) -> int:
    from gateway.uplink import certs

    paths = paths_from(args)
    out = Path(args.out).expanduser().resolve()
    if out == paths.home or paths.home in out.parents:
        from gateway.errors import ErrorCode, UompError

        raise UompError(ErrorCode.USAGE, "--out must be outside the data directory; e.g. --out ./vps-home")
    made = certs.init(paths, args.vps_host, out, force=args.force)
    _say(f"uplink identities in {paths.uplink_dir} (the uplink CA key stays here)")
    _say(f"the VPS's data directory: {made.vps_dir} (copy it whole, e.g. rsync -a, to the VPS's UOMP_HOME)")
    _say(f"home pin {made.home_pin}; VPS pin {made.server_pin}")
    _say("on the VPS: uomp gateway start --listen 0.0.0.0:9443 --uplink-listen 0.0.0.0:9444 --force-non-loopback")
    _say(f"here:       uomp guard uplink https://{args.vps_host[0]}:9444")
    return 0


async def _dial(paths: Paths, url: str, max_streams: int) -> None:
    from gateway.config import GatewayConfig, load_section
    from gateway.payloads.store import Limits
    from gateway.remote.upstream import Upstream
    from gateway.uplink.home import HomeUplink

    gcfg = load_section(GatewayConfig, "gateway", file=paths.config_file)  # the payload limits of this home

    home = HomeUplink(
        url,
        cert_file=paths.uplink_home_cert,
        key_file=paths.uplink_home_key,
        ca_file=paths.uplink_ca_cert,
        pins_file=paths.uplink_pins,
        guard=Upstream("unix", str(paths.guard_sock)),
        paths=paths,
        max_streams=max_streams,
        payload_limits=Limits(
            max_bytes=gcfg.payload_max_bytes,
            max_per_session=gcfg.payload_max_per_session,
            max_bytes_per_session=gcfg.payload_max_bytes_per_session,
            ttl_seconds=gcfg.payload_ttl_seconds,
        ),
    )
    loop = asyncio.get_running_loop()
    task = loop.create_task(home.run())
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass


def _guard_uplink(args: argparse.Namespace) -> int:
    from gateway.errors import ErrorCode, UompError

    paths = paths_from(args)
    for p in (paths.uplink_home_cert, paths.uplink_home_key, paths.uplink_ca_cert, paths.uplink_pins):
        if not p.exists():
            raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is missing; run 'uomp uplink init --vps-host HOST' first")
    _say(f"uplink: dialling {args.url}; the guard is served through it (Ctrl-C stops)")
    eventloop.run(_dial(paths, args.url, args.max_streams))
    return 0


def register_guard(gsub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``uomp guard uplink URL`` (under ``uomp guard``)."""
    u = gsub.add_parser("uplink", help="dial the gateway on a VPS (outbound mTLS) and serve this guard through it")
    u.add_argument("url", help="the VPS gateway's uplink listener: https://HOST:PORT")
    u.add_argument("--max-streams", type=int, default=128, help="requests at once over the uplink (default 128)")
    u.set_defaults(func=_guard_uplink, service=True)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``uomp uplink init``."""
    u = sub.add_parser("uplink", help="the outbound uplink: a gateway on a VPS, the guard here (docs/vps.md)")
    usub = u.add_subparsers(dest="uplink_command", metavar="ACTION", required=True)
    i = usub.add_parser("init", help="make the uplink identities and the VPS's data directory")
    i.add_argument("--vps-host", action="append", required=True, metavar="HOST", help="the VPS's DNS name or IP")
    i.add_argument("--out", required=True, metavar="DIR", help="where to write the VPS's data directory")
    i.add_argument("--force", action="store_true", help="a new uplink CA and home identity (re-pairs every VPS)")
    i.set_defaults(func=_init)
