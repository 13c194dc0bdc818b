"""``uomp``: the user's command line. The only place that installs log handlers and catches UompError."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from gateway import __version__
from gateway.config import Paths, resolve_home
from gateway.errors import UompError
from gateway.keys import check_home

# Each module has ``register(subparsers)``; its commands set ``func(args) -> int``.
COMMAND_MODULES = (
    "gateway.cli.home",
    "gateway.cli.memory",
    "gateway.cli.guard",
    "gateway.cli.authorize",
    "gateway.cli.trust",
    "gateway.cli.agent",
    "gateway.cli.gateway",
    "gateway.cli.payload",
)


def paths_from(args: argparse.Namespace) -> Paths:
    """The data directory of this command, refused (UNSAFE_PERMISSIONS) when it, ``.secrets`` or
    ``ca/`` is another user's or group/other-writable, or a parent lets another user replace it."""
    paths = Paths(resolve_home(getattr(args, "home", None)))
    check_home(paths)
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uomp",
        description="User-Owned Memory Protocol appliance: your memory store, its guard, and the "
        "mTLS gateway that lets remote agents read exactly what you granted.",
    )
    parser.add_argument("--version", action="version", version=f"uomp {__version__}")
    parser.add_argument("--home", help="data directory (default: $UOMP_HOME or ~/.uomp)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    setup_logging(args.verbose)
    # Whatever the caller's umask, nothing this command creates is readable or writable by others
    # (files meant to be shared, like certificates, get their mode set explicitly).
    old_umask = os.umask(0o077)
    os.umask(old_umask | 0o077)
    try:
        rc: int = args.func(args)
        return rc
    except UompError as exc:
        print(f"error {exc.code}: {exc.message}", file=sys.stderr)
        details = exc.details or {}
        for line in details.get("lines", []):
            print(f"  {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        os.umask(old_umask)


if __name__ == "__main__":
    sys.exit(main())
