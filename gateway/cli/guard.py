"""``uomp guard serve``, ``uomp sessions …``: the local side, for the user (``uomp audit``: cli/audit.py)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from gateway.cli.main import paths_from
from gateway.config import GuardConfig, Paths, load_section

if TYPE_CHECKING:  # (`gateway start` imports guard_config from here, and never the guard's code)
    from gateway.guard.auth import AuthService


def guard_config(args: argparse.Namespace, paths: Paths) -> GuardConfig:
    """The guard settings from the config file with the command's flags on top."""
    overrides: dict[str, Any] = {}
    for name in ("tcp_host", "tcp_port"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    if getattr(args, "force_non_loopback", False):
        overrides["allow_non_loopback"] = True
    return load_section(GuardConfig, "guard", file=paths.config_file, overrides=overrides)


def open_auth(paths: Paths, cfg: GuardConfig, *, audit_tail: int | None = None) -> AuthService:
    """The Auth Service on this home, with its audit log; the home's writers' lock
    (:func:`gateway.atrest.writers.writing`) held from before the log opens until it closes
    (``auth.audit.close()``, else the process's end), so no seal rewrites audit.db under it.
    ``audit_tail``: the events before the newest checkpoint the log's check at open reads in full
    (default: the guard's own)."""
    from gateway.guard.audit import open_audit_writing
    from gateway.guard.auth import AuthService

    audit = open_audit_writing(paths, cfg) if audit_tail is None else open_audit_writing(paths, cfg, tail=audit_tail)
    return AuthService(paths, cfg, audit)


def _serve(args: argparse.Namespace) -> int:
    from gateway import eventloop, memtrace
    from gateway.guard.server import run_guard

    paths = paths_from(args)
    cfg = guard_config(args, paths)
    memtrace.start_if_enabled(paths, "guard")  # UOMP_TRACEMALLOC=1 only
    eventloop.run(run_guard(paths, cfg, serve_tcp=not args.no_tcp))
    return 0


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def _sessions(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    auth = open_auth(paths, guard_config(args, paths))
    try:
        if args.sessions_command == "list":
            rows = auth.list_sessions(status=args.status)
            if args.json:
                _print(rows)
            else:
                print(f"{'SESSION':<24} {'AGENT':<24} {'STATUS':<8} {'PROFILE':<7} {'EXPIRES':<20} REASON")
                for r in rows:
                    print(
                        f"{r['session_id']:<24} {r['agent_id']:<24} {r['status']:<8} "
                        f"{r.get('profile', '-'):<7} {r['expires_at']:<20} {r.get('status_reason', '')}"
                        + ("  ABNORMAL: no deletion proof" if r.get("abnormal") else "")
                    )
        elif args.sessions_command == "show":
            _print(auth.session(args.session_id).public())
        elif args.sessions_command == "revoke":
            _print(auth.revoke(args.session_id))
        elif args.sessions_command == "close":
            _print(auth.close(args.session_id))
    finally:
        auth.close_db()
        auth.audit.close()
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp guard`` to the command line."""
    g = sub.add_parser("guard", help="the local Auth Service + Memory Guard")
    gsub = g.add_subparsers(dest="guard_command", metavar="ACTION", required=True)
    s = gsub.add_parser(
        "serve", help="serve on $UOMP_HOME/guard.sock (0600) and, for the Local Profile, http://127.0.0.1:9374"
    )
    s.add_argument("--no-tcp", action="store_true", help="serve only the Unix socket (no Local Profile port)")
    s.add_argument("--tcp-host", help="Local Profile listen address (default 127.0.0.1)")
    s.add_argument("--tcp-port", type=int, help="Local Profile port (default 9374; 0 picks a free port)")
    s.add_argument(
        "--force-non-loopback",
        action="store_true",
        help="allow a non-loopback --tcp-host (exposes the guard beyond this machine)",
    )
    s.set_defaults(func=_serve, service=True)
    from gateway.cli import uplink

    uplink.register_guard(gsub)

    ss = sub.add_parser("sessions", help="see, close and revoke sessions (spec §21)")
    ssub = ss.add_subparsers(dest="sessions_command", metavar="ACTION", required=True)
    ls = ssub.add_parser("list", help="list sessions, newest first")
    ls.add_argument("--status", choices=["created", "active", "closed", "expired", "revoked"])
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_sessions)
    for name, helptext in (
        ("show", "show one session"),
        ("revoke", "revoke a session: its tokens stop working at once and are blacklisted"),
        ("close", "close a session normally"),
    ):
        p = ssub.add_parser(name, help=helptext)
        p.add_argument("session_id")
        p.set_defaults(func=_sessions)
