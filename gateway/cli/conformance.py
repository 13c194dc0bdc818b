"""``uomp conformance run``: the black-box UOMP conformance suite against a guard or gateway URL."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from gateway.conformance import report, suite
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write


def _secret(path: str | None, env: str) -> str | None:
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as exc:
            raise UompError(ErrorCode.IO_ERROR, f"cannot read {path}: {exc.strerror}") from exc
    return os.environ.get(env) or None


def _run(args: argparse.Namespace) -> int:
    if args.mode == "gateway" and not args.target.startswith("https://"):
        raise UompError(ErrorCode.USAGE, "gateway mode needs an https:// target")
    target = suite.Target(
        url=args.target,
        mode=args.mode,
        admin_url=args.admin_url,
        admin_token=_secret(args.admin_token_file, "UOMP_CONFORMANCE_ADMIN_TOKEN"),
        token=_secret(args.token_file, "UOMP_CONFORMANCE_TOKEN"),
        ca_file=Path(args.ca) if args.ca else None,
        cert_file=Path(args.cert) if args.cert else None,
        key_file=Path(args.key) if args.key else None,
        agent_id=args.agent_id,
        timeout=args.timeout,
        payload_public_key=args.payload_public_key,
    )
    results = asyncio.run(suite.run(target, only=args.only))
    text = report.table(results, target=args.target, mode=args.mode)
    sys.stdout.write(text)
    if args.report:
        atomic_write(Path(args.report), text.encode(), mode=0o644)
    if args.junit:
        atomic_write(Path(args.junit), report.junit(results, target=args.target, mode=args.mode).encode(), mode=0o644)
    if args.json:
        atomic_write(Path(args.json), report.to_json(results, target=args.target, mode=args.mode).encode(), mode=0o644)
    return 1 if report.counts(results)["fail"] else 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp conformance`` to the command line."""
    c = sub.add_parser(
        "conformance",
        help="run the UOMP conformance suite against a guard or gateway",
        description="Black-box UOMP conformance suite over HTTP(S); see docs/conformance.md.",
    )
    csub = c.add_subparsers(dest="conformance_command", metavar="ACTION", required=True)
    r = csub.add_parser(
        "run",
        help="run every case for one target and print the verdicts",
        description="Exit status 0 when no case failed (skips are listed with their reason). "
        "Secrets come from files or the environment, never the command line: "
        "--admin-token-file or UOMP_CONFORMANCE_ADMIN_TOKEN; --token-file or "
        "UOMP_CONFORMANCE_TOKEN for a hand-made conf.pref token.",
    )
    r.add_argument(
        "--target",
        required=True,
        metavar="URL",
        help="the guard (http://127.0.0.1:8750) or gateway (https://host:port) base URL",
    )
    r.add_argument("--mode", choices=("guard", "gateway"), default="guard")
    r.add_argument(
        "--admin-url",
        metavar="URL",
        help="the management API for session create/grant in gateway "
        "mode: http://127.0.0.1:PORT or unix:/path/to/guard.sock (guard mode: the target)",
    )
    r.add_argument("--admin-token-file", metavar="FILE", help="file holding the user's admin credential")
    r.add_argument(
        "--token-file",
        metavar="FILE",
        help="without an admin credential: a hand-made token that reads tag conf.pref (see docs/conformance.md)",
    )
    r.add_argument("--ca", metavar="FILE", help="gateway mode: the user's CA certificate (PEM)")
    r.add_argument("--cert", metavar="FILE", help="gateway mode: an agent certificate from that CA (PEM)")
    r.add_argument("--key", metavar="FILE", help="gateway mode: that agent's private key (PEM)")
    r.add_argument("--agent-id", metavar="ID", help="the agent id in --cert (default conformance_agent)")
    r.add_argument(
        "--payload-public-key",
        metavar="B64",
        help="gateway mode: the user's payload public key (`uomp payload pubkey`), for the §15.6 upload cases",
    )
    r.add_argument("--timeout", type=float, default=15.0, metavar="SECONDS", help="per request (default 15)")
    r.add_argument("--only", action="append", metavar="PREFIX", help="run only cases whose id starts so")
    r.add_argument("--report", metavar="FILE", help="also write the readable table to FILE")
    r.add_argument("--junit", metavar="FILE", help="write JUnit XML to FILE")
    r.add_argument("--json", metavar="FILE", help="write the verdicts as JSON to FILE")
    r.set_defaults(func=_run)
