#!/usr/bin/env python3
"""A small remote UOMP agent: read memory keys through the user's gateway and print them.

    python examples/remote_agent.py --bundle BUNDLE KEY [KEY ...]
    python examples/remote_agent.py --bundle BUNDLE --dpop [--url URL] KEY [KEY ...]
    python examples/remote_agent.py --bundle BUNDLE --tag preference

Each item is printed as one JSON line ``{"key": ..., "value": ...}`` on stdout; a refused key is
reported on stderr as ``KEY: CODE message`` and the exit status is 1. Configuration problems (bad
bundle, refused URL) exit with 2. The bundle is the file ``uomp authorize --remote`` wrote; the
SDK writes rotated tokens (and a renewed certificate) back into it, so keep it writable and do
not copy it to a second machine.

``--dpop`` talks to the Cloudflare tunnel URL (no client certificate; a DPoP proof per request).
``--url`` overrides the bundle's gateway URL; with ``--dpop`` it may be the tunnel origin on this
host (``http://127.0.0.1:PORT``), in which case requests are addressed to the bundle's URL exactly as
cloudflared would forward them. See examples/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from gateway.client import ConfigError, UompClient, UompClientError


async def run(args: argparse.Namespace) -> int:
    client = UompClient.from_bundle(args.bundle, mode="dpop" if args.dpop else "auto", base_url=args.url)
    failed = False
    async with client:
        for key in args.keys:
            try:
                item = await client.get(key)
            except UompClientError as exc:
                if isinstance(exc, ConfigError):
                    raise
                print(f"{key}: {exc.code} {exc.message}", file=sys.stderr)
                failed = True
                continue
            print(json.dumps({"key": item.get("key", key), "value": item.get("value")}), flush=True)
        for tag in args.tag or []:
            try:
                items = await client.by_tag(tag)
            except UompClientError as exc:
                if isinstance(exc, ConfigError):
                    raise
                print(f"tag {tag}: {exc.code} {exc.message}", file=sys.stderr)
                failed = True
                continue
            for item in items:
                print(json.dumps({"key": item.get("key"), "value": item.get("value")}), flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Read UOMP memory keys through the user's gateway.")
    p.add_argument("--bundle", required=True, help="the agent bundle from 'uomp authorize --remote' (mode 0600)")
    p.add_argument("--dpop", action="store_true", help="through the tunnel URL with DPoP instead of mTLS")
    p.add_argument("--url", help="gateway URL (default: the bundle's); with --dpop may be http://127.0.0.1:PORT")
    p.add_argument("--tag", action="append", help="also read every granted item with this tag (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="log refreshes and renewals on stderr")
    p.add_argument("keys", nargs="*", metavar="KEY", help="memory keys to read, e.g. preference.theme")
    args = p.parse_args(argv)
    if not args.keys and not args.tag:
        p.error("give at least one KEY or --tag")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return asyncio.run(run(args))
    except ConfigError as exc:
        print(f"{exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except UompClientError as exc:
        print(f"{exc.code}: {exc.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
