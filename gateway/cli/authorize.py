"""``uomp authorize AGENT_DIR``: read the agent's uom.json, show the user what it asks for, and
(only on the user's yes) create and grant a session and hand the agent its token (spec §5.2, §14.2,
§15.5, §16.3).

Local Profile: the token goes into a 0600 env file (``UOM_TOKEN``, ``UOMP_BASE_URL``) or is printed.
Remote Profile (``--remote``): a short access token (<= 10 min) bound to the agent's certificate key
(``cnf.x5t#S256`` and ``cnf.jkt``), a refresh token bound to the same key, and one 0600 bundle
file with everything the remote agent needs (see :mod:`gateway.bundle`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gateway import ca_store
from gateway.bundle import AgentBundle, write_bundle
from gateway.cli.guard import guard_config, open_auth
from gateway.cli.main import paths_from
from gateway.core import jose, manifest
from gateway.core.tokens import Scope
from gateway.errors import UompError
from gateway.fsutil import atomic_write

RED = "\033[1;31m"
RESET = "\033[0m"


def _warn(text: str) -> None:
    color = sys.stdout.isatty()
    print(f"{RED if color else ''}!! {text}{RESET if color else ''}")


def _scope_line(name: str, scope: Scope) -> str:
    parts = [f"tags={list(scope.tags)}", f"keys={list(scope.keys)}"]
    if scope.deny_tags:
        parts.append(f"deny_tags={list(scope.deny_tags)}")
    if scope.deny_keys:
        parts.append(f"deny_keys={list(scope.deny_keys)}")
    return f"  {name:<5} " + " ".join(parts)


def _show(m: manifest.Manifest, ident: manifest.IdentityResult) -> None:
    a = m.agent
    print(f"Agent:     {a.name} ({a.id}) version {a.version}" + (f", publisher {a.publisher}" if a.publisher else ""))
    if a.description:
        print(f"           {a.description}")
    if ident.verified:
        print(f"Identity:  verified ({ident.method} {ident.did})")
    else:
        _warn(f"UNVERIFIED PUBLISHER: {ident.reason}")
    print("Requests:")
    print(_scope_line("read", m.read) + (f"  - {m.read_description}" if m.read_description else ""))
    if not m.write.is_empty():
        print(_scope_line("write", m.write) + "  (writes are not available; they will not be granted)")
    level = manifest.retention_level(m.retention)
    r = m.retention
    if r is None:
        _warn("NO DATA RETENTION POLICY: the agent makes no promise about deleting your data")
    else:
        print(f"Retention: keeps data up to {r.max_retention_seconds:g} s after the task, deletion by "
              f"{r.deletion_method}" + (", deletion proof required" if r.proof_required else ""))
        if r.third_party_sharing:
            _warn("the agent says it SHARES your data with third parties")
    if level == "no_guarantee":
        _warn("NO RETENTION GUARANTEE: this agent may keep what it reads indefinitely")


def _confirm(args: argparse.Namespace) -> None:
    if args.yes:
        return
    if not sys.stdin.isatty():
        raise UompError("INVALID_REQUEST", "no terminal to ask for confirmation; pass --yes to authorize "
                        "non-interactively")
    answer = input("Grant this access? [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise UompError("ACCESS_DENIED", "authorization declined by the user")


def _granted_scope(m: manifest.Manifest, args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """The read scope to grant: the request, optionally narrowed (or, with --widen, widened)."""
    tags = list(args.tag) if args.tag else list(m.read.tags)
    keys = list(args.key) if args.key else list(m.read.keys)
    scope = {"tags": tags, "keys": keys,
             "deny_tags": sorted(set(m.read.deny_tags) | set(args.deny_tag or [])),
             "deny_keys": sorted(set(m.read.deny_keys) | set(args.deny_key or []))}
    widen = not (set(tags) <= set(m.read.tags) and set(keys) <= set(m.read.keys))
    if widen and not args.widen:
        raise UompError("INVALID_REQUEST", "--tag/--key grant more than the agent requested; add --widen to "
                        "confirm you want that")
    return scope, widen


def _cert_binding(cert_pem: bytes) -> dict[str, str]:
    cert = x509.load_pem_x509_certificate(cert_pem)
    der = cert.public_bytes(serialization.Encoding.DER)
    pub = cert.public_key()
    return {"x5t#S256": jose.cert_thumbprint(der), "jkt": jose.key_thumbprint(pub)}  # type: ignore[arg-type]


def _authorize(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    agent_dir = Path(args.agent_dir)
    path = agent_dir / "uom.json" if agent_dir.is_dir() else agent_dir
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UompError("MANIFEST_INVALID", f"cannot read {path}: {exc.strerror}") from exc
    m = manifest.parse_manifest(raw)
    ident = manifest.verify_identity(m.raw)
    _show(m, ident)
    if args.require_verified and not ident.verified:
        raise UompError("ACCESS_DENIED", "the publisher's identity could not be verified and --require-verified "
                        "is set")
    scope, widen = _granted_scope(m, args)
    _confirm(args)

    cfg = guard_config(args, paths)
    auth = open_auth(paths, cfg)
    try:
        create: dict[str, Any] = {"agent_id": m.agent.id, "agent_name": m.agent.name,
                                  "requested_scopes": {"read": m.read.to_claim()},
                                  "duration_minutes": args.duration}
        if ident.verified and ident.public_key is not None:
            create["identity_public_jwk"] = jose.public_jwk(ident.public_key)
        if m.retention is not None:
            create["data_retention_policy"] = {"max_retention_seconds": m.retention.max_retention_seconds,
                                               "deletion_method": m.retention.deletion_method,
                                               "proof_required": m.retention.proof_required}
        session = auth.create_session(create)
        grant: dict[str, Any] = {"granted_scopes": {"read": scope}, "widen": widen,
                                 "aggregation_only": args.aggregation_only, "task_bound": args.task_bound}
        if args.allowed_field:
            grant["allowed_fields"] = list(args.allowed_field)
        if args.max_reads is not None:
            grant["limits"] = {"max_read_queries": args.max_reads}
        if args.remote:
            return _remote(args, paths, auth, session["session_id"], m, grant)
        answer = auth.grant(session["session_id"], grant)
    finally:
        auth.close_db()
        auth.audit.close()
    base = f"http://127.0.0.1:{cfg.tcp_port}"
    print(f"Session {answer['session_id']} active until {answer['expires_at']}.")
    if args.print_token:
        print(f"export UOM_TOKEN={answer['token']}")
        print(f"export UOMP_BASE_URL={base}")
    else:
        env = Path(args.env_file or (paths.agents_dir / m.agent.id / "uomp.env"))
        env.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(env, f"UOM_TOKEN={answer['token']}\nUOMP_BASE_URL={base}\n".encode(), mode=0o600)
        print(f"Token written to {env} (mode 0600). Start the agent with its variables, e.g.:")
        print(f"  env $(cat {env}) <agent command>")
    return 0


def _remote(args: argparse.Namespace, paths: Any, auth: Any, session_id: str, m: manifest.Manifest,
            grant: dict[str, Any]) -> int:
    url = args.gateway_url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise UompError("INVALID_REQUEST", "--gateway-url must be an https:// URL")
    agent_key: str | None = None
    agent_key_file: str | None = None
    lifetime = dt.timedelta(hours=args.cert_hours)
    if args.cert or args.csr:
        if args.cert:
            cert_pem = Path(args.cert).read_bytes()
        else:
            cert_pem = ca_store.issue_from_csr(paths, m.agent.id, Path(args.csr).read_bytes(), lifetime)
        # the agent keeps its own key; the bundle only says where (never the key itself)
        if args.key_file:
            agent_key_file = str(Path(args.key_file).resolve())
    else:
        out = Path(args.out or (paths.agents_dir / m.agent.id))
        files = ca_store.issue_with_key(paths, m.agent.id, out, lifetime)
        cert_pem = files.cert_file.read_bytes()
        agent_key = files.key_file.read_text()
    cert = x509.load_pem_x509_certificate(cert_pem)
    from gateway.core import ca

    if ca.agent_id_from_cert(cert) != m.agent.id:
        raise UompError("INVALID_REQUEST", "the agent certificate names another agent than the manifest")
    host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    grant.update({"profile": "remote", "audience": url, "allowed_endpoints": [host],
                  "cnf": _cert_binding(cert_pem), "refresh": True})
    answer = auth.grant(session_id, grant)
    bundle = AgentBundle(
        agent_id=m.agent.id, session_id=session_id, gateway_url=url, access_token=answer["token"],
        access_expires_at=answer["expires_at"], refresh_token=answer.get("refresh_token"),
        refresh_expires_at=answer.get("refresh_expires_at"),
        ca_cert=ca_store.ca_cert_path(paths).read_text(), agent_cert=cert_pem.decode(), agent_key=agent_key,
        agent_key_file=agent_key_file)
    out_path = Path(args.bundle or (paths.agents_dir / m.agent.id / "bundle.json"))
    out_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_bundle(out_path, bundle)
    print(f"Remote session {session_id} active until {answer['expires_at']} (access token), refresh token "
          f"until {answer.get('refresh_expires_at')}.")
    print(f"Agent bundle written to {out_path} (mode 0600): hand it to the agent over a private channel.")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("authorize", help="grant an agent access to your memory after showing what it asks for")
    p.add_argument("agent_dir", help="the agent's directory (with uom.json) or the uom.json file itself")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask; grant what is shown (for scripts)")
    p.add_argument("--duration", type=float, default=30, help="session length in minutes (default 30)")
    p.add_argument("--tag", action="append", help="grant only these tags (repeatable; default: as requested)")
    p.add_argument("--key", action="append", help="grant only these keys (repeatable; default: as requested)")
    p.add_argument("--deny-tag", action="append", help="add a denied tag (repeatable)")
    p.add_argument("--deny-key", action="append", help="add a denied key (repeatable)")
    p.add_argument("--widen", action="store_true", help="allow --tag/--key beyond what the agent requested")
    p.add_argument("--allowed-field", action="append", help="return only these item fields (repeatable)")
    p.add_argument("--aggregation-only", action="store_true", help="only sum/avg/count/min/max, never items")
    p.add_argument("--task-bound", action="store_true", help="one task; the session closes on its deletion proof")
    p.add_argument("--max-reads", type=int, help="read query quota (default 100)")
    p.add_argument("--require-verified", action="store_true", help="refuse agents whose publisher is unverified")
    p.add_argument("--env-file", help="local profile: where to write UOM_TOKEN/UOMP_BASE_URL "
                   "(default $UOMP_HOME/agents/<id>/uomp.env, mode 0600)")
    p.add_argument("--print", dest="print_token", action="store_true",
                   help="local profile: print export lines instead of writing the env file")
    r = p.add_argument_group("remote profile")
    r.add_argument("--remote", action="store_true", help="authorize an agent on another machine (via the gateway)")
    r.add_argument("--gateway-url", default="https://localhost:9443", help="the gateway URL the agent uses "
                   "(becomes the token audience)")
    r.add_argument("--cert", help="the agent's certificate, already issued (uomp agent issue)")
    r.add_argument("--csr", help="sign this CSR from the agent (its private key never leaves the agent)")
    r.add_argument("--key-file", help="with --csr or --cert: where the agent keeps its key (path recorded in "
                   "the bundle)")
    r.add_argument("--out", help="make key and certificate for the agent in this directory (key in the bundle)")
    r.add_argument("--cert-hours", type=float, default=24, help="agent certificate lifetime in hours (default 24)")
    r.add_argument("--bundle", help="where to write the agent bundle (default $UOMP_HOME/agents/<id>/bundle.json)")
    p.set_defaults(func=_authorize)
