"""Enrollment without copying secrets (docs/enrollment.md).

The user's side:
* ``uomp agent invite MANIFEST_DIR [--expires 15m]``: a one-time code bound to that manifest, and the
  one line to give the agent (gateway URL, code, CA fingerprint);
* ``uomp requests list | approve REQUEST | deny REQUEST``: what agents asked for with their codes;
  ``approve`` shows the consent panel of ``uomp authorize --remote`` and grants only on the user's
  yes, with its rules, refusals and flags (``--widen``, ``--tag``, ``--require-verified``, ...).

The agent's side: ``uomp enroll LINE --manifest uom.json --out DIR`` (:mod:`gateway.client.enroll`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization

from gateway import ca_store, enrollment, eventloop
from gateway.cli import authorize, userlog
from gateway.cli.guard import guard_config, open_auth
from gateway.cli.main import paths_from
from gateway.core import ca, enrolment, manifest, tokens
from gateway.errors import ErrorCode, UompError
from gateway.guard.auth import minutes_text

DEFAULT_INVITE_SECONDS = 15 * 60


def _read_manifest(where: str) -> tuple[Path, bytes]:
    p = Path(where)
    path = p / "uom.json" if p.is_dir() else p
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UompError(ErrorCode.MANIFEST_INVALID, f"cannot read {path}: {exc.strerror}") from exc
    if len(raw) > enrolment.MAX_MANIFEST_BYTES:
        raise UompError(ErrorCode.MANIFEST_INVALID, f"{path} is larger than {enrolment.MAX_MANIFEST_BYTES} bytes")
    return path, raw


def _when(ts: float) -> str:
    return tokens.iso(ts)


# ------------------------------------------------------------------------------ invite


def _invite(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    path, raw = _read_manifest(args.manifest_dir)
    m = manifest.parse_manifest(raw)
    digest = enrolment.manifest_digest(raw)
    args.remote = True
    authorize.check_gateway_url(args, paths)
    url = args.gateway_url.rstrip("/")
    ca_der = ca_store.load_ca_cert(paths).public_bytes(serialization.Encoding.DER)
    with userlog.change(paths) as event:
        inv = enrollment.create_invite(
            paths, agent_id=m.agent.id, manifest_digest=digest, gateway_url=url, seconds=args.expires
        )
        event.action, event.agent_id = "enroll_invited", m.agent.id
        event.reason = "the user issued a one-time enrollment code"
        event.detail = f"{inv.invite_id}, until {_when(inv.expires_at)}, manifest {digest}"
    line = enrolment.Line(url, enrolment.normalize_code(inv.code) or "", enrolment.ca_fingerprint(ca_der)).text()
    print(f"Enrollment code for {m.agent.name} ({m.agent.id}): {inv.code}")
    print(
        f"  one use, until {_when(inv.expires_at)} ({minutes_text(args.expires / 60)}), "
        f"only with {path} ({digest[:19]}…)"
    )
    print("Give the agent this one line (the code alone grants nothing: you approve what the agent asks for):")
    print(f"  {line}")
    print("On the agent's machine:")
    print(f"  uomp enroll '{line}' --manifest uom.json --out agent-files")
    print("Then see and approve its request: uomp requests list; uomp requests approve REQUEST")
    return 0


# ---------------------------------------------------------------------------- requests


def _list(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    rows = enrollment.list_requests(paths, status=args.status)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no enrollment requests (agents make them with 'uomp enroll' and a code from 'uomp agent invite')")
        return 0
    print(f"{'REQUEST':<22} {'AGENT':<24} {'STATUS':<9} {'FROM':<16} {'KEY FINGERPRINT':<14} ASKED (UTC)")
    for r in rows:
        print(
            f"{r['request_id']:<22} {r['agent_id']:<24} {r['status']:<9} {r['client'] or '-'!s:<16} "
            f"{r['key_fingerprint'][:12]:<14} {_when(r['created_at'])}"
        )
    pending = [r for r in rows if r["status"] == enrollment.PENDING]
    if pending:
        print(f"approve: uomp requests approve {pending[0]['request_id']}   deny: uomp requests deny REQUEST")
    return 0


def _show_request(p: enrollment.Pending) -> None:
    print(f"Enrollment request {p.request_id}, made {_when(p.created_at)} from {p.client or 'an unknown address'}")
    print(
        f"Agent key: {p.key_fingerprint} (the agent printed this when it asked: compare them; "
        "the key stays on the agent's machine)"
    )


def _approve(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    p = enrollment.pending(paths, args.request_id)
    m = manifest.parse_manifest(p.manifest)
    if m.agent.id != p.agent_id:  # the manifest's digest was checked against the code's at redeem
        raise UompError(ErrorCode.MANIFEST_INVALID, "the request's manifest names another agent than its code")
    ident = authorize.verify_publisher(m, paths)
    cfg = guard_config(args, paths)
    args.remote = True
    args.allow_local = False
    _show_request(p)
    plan, seconds = authorize.consent(args, paths, m, ident, cfg)
    seal_to = enrolment.seal_public_key(p.seal_key)
    auth = open_auth(paths, cfg)
    session_id: str | None = None
    serial: str | None = None
    try:
        session_id = str(auth.create_session(authorize.session_request(m, ident, seconds, remote=True))["session_id"])
        with userlog.change(paths) as event:
            cert_pem = ca_store.issue_from_csr(paths, m.agent.id, p.csr.encode(), dt.timedelta(hours=args.cert_hours))
            cert = ca.load_cert(cert_pem)
            serial = ca.serial_hex(cert.serial_number)
            event.action, event.agent_id = "cert_issued", m.agent.id
            event.reason = "the user approved an enrollment request (certificate from the agent's CSR)"
            event.detail = f"serial {ca.serial_hex(cert.serial_number)}, request {p.request_id}"
        grant = authorize.grant_request(plan, args, m)
        authorize.bind_remote(grant, m, p.gateway_url, cert_pem)
        answer = auth.grant(session_id, grant)
        bundle = authorize.remote_bundle(paths, m, session_id, p.gateway_url, answer, cert_pem)
        sealed = enrolment.seal(seal_to, p.request_id, bundle.to_json())
        with userlog.change(paths) as event:
            enrollment.decide(
                paths, p.request_id, approved=True, reason="approved by the user", sealed=sealed, session_id=session_id
            )
            event.action, event.agent_id = "enroll_approved", m.agent.id
            event.reason = "the user approved an enrollment request"
            event.detail = f"request {p.request_id}, session {session_id}"
    except BaseException as exc:
        if session_id is not None:
            authorize.abandon(auth, session_id, exc)
        if serial is not None:  # issued for a grant that did not happen: never usable
            _revoke_unused(paths, serial)
        raise
    finally:
        auth.close_db()
        auth.audit.close()
    print(
        f"Approved: session {session_id} for {m.agent.id}, ends {answer.get('session_expires_at')}. The agent "
        "collects its certificate and tokens on its next poll (sealed to its key; nothing to hand over)."
    )
    return 0


def _revoke_unused(paths: Any, serial: str) -> None:
    try:
        with userlog.change(paths) as event:
            ca_store.revoke_target(paths, f"serial:{serial}")
            event.action, event.count = "cert_revoked", 1
            event.reason = "the approval did not finish; the certificate issued for it is revoked"
            event.detail = f"serial {serial}"
        from gateway.reloads import notify_running

        notify_running(paths)  # the running gateway and guard reload the CRL now
    except UompError as exc:
        print(f"error {exc.code}: certificate {serial} could not be revoked; run: uomp agent revoke serial:{serial}")


def _deny(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    p = enrollment.pending(paths, args.request_id)
    reason = (args.reason or "denied by the user").strip()[:200]
    with userlog.change(paths) as event:
        enrollment.decide(paths, p.request_id, approved=False, reason=reason)
        event.action, event.agent_id = "enroll_denied", p.agent_id
        event.reason = "the user denied an enrollment request"
        event.detail = f"request {p.request_id}: {reason}"
    print(f"Denied: request {p.request_id} of {p.agent_id}. The agent is told on its next poll; nothing was granted.")
    return 0


# ------------------------------------------------------------------------------ enroll


def _line(args: argparse.Namespace) -> enrolment.Line:
    if args.line:
        if args.url or args.code or args.ca_fingerprint:
            raise UompError(
                ErrorCode.INVALID_REQUEST, "give the enrollment line, or --url, --code and --ca-fingerprint"
            )
        return enrolment.parse_line(args.line)
    if not (args.url and args.code and args.ca_fingerprint):
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            "give the line 'uomp agent invite' printed (or all of --url, --code and --ca-fingerprint)",
        )
    fp = f"ca={args.ca_fingerprint}"
    return enrolment.parse_line(f"{args.url.rstrip('/')}/enroll#code={args.code}&{fp}")


def _enroll(args: argparse.Namespace) -> int:
    from gateway.client import enroll as agent_enroll

    line = _line(args)
    _path, raw = _read_manifest(args.manifest)
    out = Path(args.out)
    started = time.monotonic()

    def asked(r: agent_enroll.Requested) -> None:
        print(f"Request {r.request_id} sent to {line.url}; agent key {r.key_fingerprint}")
        print(f"Waiting for the user to approve it (uomp requests approve {r.request_id}) ...", flush=True)

    bundle = eventloop.run(agent_enroll.enroll(line, raw, out, wait_seconds=args.wait, on_request=asked))
    print(f"Approved after {time.monotonic() - started:.0f} s. Written to {out}:")
    print("  agent.key   your private key (0600; made here, never sent)")
    print("  agent.crt   your certificate from the user's CA")
    print(f"  ca.crt      the user's CA (pinned: {line.ca_fingerprint[:19]}…)")
    print(f"  bundle.json session, access and refresh tokens (0600): {bundle}")
    print(f"First read: python examples/remote_agent.py --bundle {bundle} KEY")
    return 0


def _duration(text: str) -> float:
    return authorize.duration_arg(text)


def register_invite(asub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``uomp agent invite`` (called by gateway.cli.agent's register)."""
    inv = asub.add_parser(
        "invite",
        help="a one-time enrollment code for the agent of MANIFEST_DIR, and the one line to give it "
        "(the agent makes its own key; you approve what it asks for: uomp requests)",
    )
    inv.add_argument("manifest_dir", metavar="MANIFEST_DIR", help="the agent's directory (with uom.json) or the file")
    inv.add_argument(
        "--remote", action="store_true", help="the agent enrolls through the gateway (the default and only way)"
    )
    inv.add_argument(
        "--expires",
        type=_duration,
        default=float(DEFAULT_INVITE_SECONDS),
        metavar="DURATION",
        help="how long the code can be used: 15m (default), 2h, 1d (at most 7d)",
    )
    inv.add_argument("--gateway-url", help="the gateway URL the agent uses (default: as for uomp authorize --remote)")
    inv.add_argument(
        "--any-gateway-url",
        action="store_true",
        help="accept a --gateway-url the running gateway does not list (a proxy in front answers for it)",
    )
    inv.set_defaults(func=_invite)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp requests`` (the user's side) and ``uomp enroll`` (the agent's side) to the command line."""
    r = sub.add_parser("requests", help="agents' enrollment requests: list, approve (the consent panel), deny")
    rsub = r.add_subparsers(dest="requests_command", metavar="ACTION", required=True)
    ls = rsub.add_parser("list", help="enrollment requests, newest first")
    ls.add_argument("--status", choices=["pending", "approved", "collected", "denied", "expired"])
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)
    ap = rsub.add_parser(
        "approve",
        help="show what the agent asked for (as uomp authorize --remote does) and grant it on your yes",
    )
    ap.add_argument("request_id", metavar="REQUEST")
    authorize.add_grant_arguments(ap)
    ap.add_argument("--cert-hours", type=float, default=24, help="agent certificate lifetime in hours (default 24)")
    ap.set_defaults(func=_approve)
    dn = rsub.add_parser("deny", help="refuse an enrollment request (the agent is told; nothing is granted)")
    dn.add_argument("request_id", metavar="REQUEST")
    dn.add_argument("--reason", help="a short reason the agent is told")
    dn.set_defaults(func=_deny)

    e = sub.add_parser(
        "enroll",
        help="(agent side) enroll with the line from 'uomp agent invite': make a key here, send a CSR, wait "
        "for the user's approval, write certificate and tokens to --out",
    )
    e.add_argument("line", nargs="?", help="the line: https://HOST:PORT/enroll#code=...&ca=sha256:...")
    e.add_argument("--url", help="instead of the line: the gateway URL")
    e.add_argument("--code", help="instead of the line: the one-time code")
    e.add_argument("--ca-fingerprint", help="instead of the line: the CA fingerprint (sha256:...)")
    e.add_argument("--manifest", default=".", help="this agent's uom.json (or its directory; default: .)")
    e.add_argument("--out", required=True, help="directory for agent.key, agent.crt, ca.crt, bundle.json (new)")
    e.add_argument(
        "--wait", type=_duration, default=900.0, metavar="DURATION", help="how long to wait for the user (default 15m)"
    )
    e.set_defaults(func=_enroll)
