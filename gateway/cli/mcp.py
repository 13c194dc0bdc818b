"""``uomp mcp serve --bundle FILE``: the agent's MCP server (gateway/mcp/, docs/mcp.md).

Runs on the agent's side, with the agent's bundle (``uomp authorize --remote``); it needs no
``$UOMP_HOME``. stdio by default (what Claude Desktop / Claude Code start), or streamable HTTP on a
loopback address with ``--http 127.0.0.1:PORT`` (``/mcp``). Its log is stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core.manifest import DELETION_METHODS
from gateway.errors import ErrorCode, UompError

MAX_KEY_FILE = 16 * 1024


def _identity_key(path: str | None) -> ed25519.Ed25519PrivateKey | None:
    if path is None:
        return None
    p = Path(path)
    try:
        if p.stat().st_mode & 0o077:
            raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is a private key readable by others; chmod 600 it")
        raw = p.read_bytes()[: MAX_KEY_FILE + 1]
    except FileNotFoundError:
        raise UompError(
            ErrorCode.CONFIG_ERROR, f"no identity key at {p}; pass the Ed25519 key that signed uom.json"
        ) from None
    try:
        if len(raw) > MAX_KEY_FILE:
            raise ValueError
        key = serialization.load_pem_private_key(raw, password=None)
    except (ValueError, TypeError):
        raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is not an unencrypted PEM private key") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is not an Ed25519 key (the did:key that signed uom.json)")
    return key


MIN_HTTP_TOKEN = 32


def _http_token(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    try:
        if p.stat().st_mode & 0o077:
            raise UompError(
                ErrorCode.CONFIG_ERROR, f"{p} holds the HTTP token and must not be readable by others; chmod 600 it"
            )
        token = p.read_text(errors="strict")[:4096].strip()
    except FileNotFoundError:
        raise UompError(
            ErrorCode.CONFIG_ERROR, f"no HTTP token file at {p}; make one: head -c 32 /dev/urandom | base64 > {p}"
        ) from None
    except UnicodeDecodeError:
        raise UompError(
            ErrorCode.CONFIG_ERROR, f"{p} is not text; make one: head -c 32 /dev/urandom | base64 > {p}"
        ) from None
    if len(token) < MIN_HTTP_TOKEN or not token.isascii() or any(c.isspace() for c in token):
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            f"{p} must hold one word of at least {MIN_HTTP_TOKEN} characters: head -c 32 /dev/urandom | base64 > {p}",
        )
    return token


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise UompError(ErrorCode.CONFIG_ERROR, f"--http takes HOST:PORT, e.g. 127.0.0.1:8765, not {text!r}")
    return host, int(port)


def _serve(args: argparse.Namespace) -> int:
    try:
        from gateway.mcp import server, tools
    except ImportError:
        raise UompError(
            ErrorCode.CONFIG_ERROR, "the MCP server needs the mcp package: pip install 'uomp-gateway[mcp]'"
        ) from None
    from gateway.client import UompClient, UompClientError

    http = _address(args.http) if args.http else None
    if http is not None:
        try:
            server.loopback_host(http[0])
        except ValueError as exc:
            raise UompError(ErrorCode.CONFIG_ERROR, str(exc)) from None
    if args.http_token_file and http is None:
        raise UompError(ErrorCode.CONFIG_ERROR, "--http-token-file is for --http; stdio needs no token")
    token = _http_token(args.http_token_file)
    key = _identity_key(args.identity_key)
    kwargs: dict[str, Any] = {"mode": "dpop" if args.dpop else "auto"}
    if args.base_url:
        kwargs["base_url"] = args.base_url
    try:
        client = UompClient.from_bundle(os.path.expanduser(args.bundle), **kwargs)
    except UompClientError as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, exc.message) from None
    agent = tools.Agent(client, identity_key=key, deletion_method=args.deletion_method)
    try:
        if http is None:
            asyncio.run(server.serve_stdio(agent))
        else:
            asyncio.run(server.serve_http(agent, *http, token=token))
    except UompClientError as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{exc.code}: {exc.message}") from None
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp mcp`` to the command line."""
    p = sub.add_parser("mcp", help="the agent's MCP server: any MCP client reads what the user granted")
    msub = p.add_subparsers(dest="mcp_command", metavar="ACTION", required=True)
    s = msub.add_parser(
        "serve",
        help="serve MCP tools over this agent's bundle (stdio, or --http on loopback)",
        description="An MCP server over the agent SDK: read by key, list by tag, aggregate, the grant in "
        "words, this session's audit events and proofs, sealed result upload, deletion proof, end the "
        "session. Refusals are tool errors 'CODE: reason'. Logs on stderr, never a token, key or value.",
    )
    s.add_argument("--bundle", required=True, metavar="FILE", help="the agent bundle (uomp authorize --remote)")
    s.add_argument("--http", metavar="HOST:PORT", help="streamable HTTP at http://HOST:PORT/mcp (loopback only)")
    s.add_argument(
        "--http-token-file",
        metavar="FILE",
        help="with --http: every request needs Authorization: Bearer <this file's word> (0600, >= 32 chars)",
    )
    s.add_argument("--dpop", action="store_true", help="DPoP through the tunnel URL instead of mTLS")
    s.add_argument("--base-url", metavar="URL", help="connect here instead of the bundle's gateway_url")
    s.add_argument(
        "--identity-key", metavar="FILE", help="Ed25519 PEM key that signed uom.json (0600), for deletion proofs"
    )
    s.add_argument(
        "--deletion-method",
        default="process_termination",
        choices=DELETION_METHODS,
        help="the manifest's deletion_method (default process_termination)",
    )
    s.set_defaults(func=_serve, service=True)
