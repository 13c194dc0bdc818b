"""``uomp run AGENT_DIR [consent flags] -- COMMAND [ARG...]``: start a local agent with its token in its
environment (the reference CLI's ``agent run``).

The consent panel and rules of ``uomp authorize`` (Local Profile), then a session for the agent, then
COMMAND with ``UOM_TOKEN``, ``UOMP_BASE_URL`` (the Local Profile) and ``UOMP_SESSION_ID`` added to
this environment. The token is never on a command line (neither ours nor the agent's: ``ps`` and
``/proc/PID/cmdline`` show only what the user typed) and never printed. SIGINT, SIGTERM and SIGHUP
are passed on to the agent; when it exits, its session is closed and its exit status is ours.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

from gateway.cli import authorize
from gateway.cli.guard import guard_config, open_auth
from gateway.cli.main import paths_from
from gateway.config import Paths
from gateway.core import manifest
from gateway.errors import ErrorCode, UompError

HEALTH_TIMEOUT_SECONDS = 2.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _check_local_profile(base: str) -> None:
    try:
        with urllib.request.urlopen(base + "/v1/health", timeout=HEALTH_TIMEOUT_SECONDS) as r:  # noqa: S310
            if r.status == 200:
                return
    except (urllib.error.URLError, OSError, ValueError):
        pass
    raise UompError(
        ErrorCode.STORE_UNAVAILABLE,
        f"the Local Profile at {base} does not answer, so the agent could not read; start the appliance first "
        "(uomp gateway start, or uomp guard serve)",
    )


def _run(args: argparse.Namespace) -> int:
    command = list(args.command_rest)
    if not command:
        raise UompError(
            ErrorCode.INVALID_REQUEST, "give the agent's command after --, e.g. uomp run AGENT -- node index.js"
        )
    paths = paths_from(args)
    path = Path(args.agent_dir)
    path = path / "uom.json" if path.is_dir() else path
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UompError(ErrorCode.MANIFEST_INVALID, f"cannot read {path}: {exc.strerror}") from exc
    m = manifest.parse_manifest(raw)
    ident = authorize.verify_publisher(m, paths)
    cfg = guard_config(args, paths)
    base = f"http://127.0.0.1:{cfg.tcp_port}"
    _check_local_profile(base)
    args.remote = False
    plan, seconds = authorize.consent(args, paths, m, ident, cfg, source=(path, raw))
    auth = open_auth(paths, cfg)
    session_id: str | None = None
    try:
        session_id = str(auth.create_session(authorize.session_request(m, ident, seconds, remote=False))["session_id"])
        answer = auth.grant(session_id, authorize.grant_request(plan, args))
    except BaseException as exc:
        if session_id is not None:
            authorize.abandon(auth, session_id, exc)
        raise
    finally:
        auth.close_db()
        auth.audit.close()
    env = dict(os.environ, UOM_TOKEN=answer["token"], UOMP_BASE_URL=base, UOMP_SESSION_ID=session_id)
    print(f"Session {session_id} for {m.agent.id} until {answer['expires_at']}; starting: {' '.join(command)}")
    print("(the agent gets UOM_TOKEN, UOMP_BASE_URL and UOMP_SESSION_ID in its environment)", flush=True)
    try:
        child = subprocess.Popen(command, env=env, cwd=args.cwd)
    except OSError as exc:
        _close(paths, args, session_id, "the agent could not be started")
        raise UompError(ErrorCode.INVALID_REQUEST, f"cannot start {command[0]}: {exc.strerror}") from exc
    del env, answer

    def forward(signum: int, _frame: FrameType | None) -> None:
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        rc = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _close(paths, args, session_id, f"the agent's process ended (exit status {child.returncode})")
    print(f"Agent exited with status {rc}; session {session_id} closed.")
    return rc if rc >= 0 else 128 - rc


def _close(paths: Paths, args: argparse.Namespace, session_id: str, reason: str) -> None:
    auth = open_auth(paths, guard_config(args, paths))
    try:
        auth.close(session_id, reason=reason)
    except UompError as exc:
        if exc.code != ErrorCode.INVALID_STATE:  # already ended (revoked, expired): nothing to close
            raise
    finally:
        auth.close_db()
        auth.audit.close()


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp run`` to the command line."""
    p = sub.add_parser(
        "run",
        help="grant a local agent a session (the consent panel of uomp authorize) and start it with its "
        "token in its environment (UOM_TOKEN, UOMP_BASE_URL); the session closes when it exits",
    )
    p.add_argument("agent_dir", help="the agent's directory (with uom.json) or the uom.json file itself")
    authorize.add_grant_arguments(p)
    p.add_argument("--cwd", help="the agent's working directory (default: this one)")
    p.set_defaults(func=_run, remote=False, cert_hours=24.0, command_rest=[])
    p.epilog = "the agent's command follows --: uomp run AGENT_DIR [flags] -- COMMAND [ARG...]"
