"""``uomp ca …`` and ``uomp agent …``: the user's CA and the agents' client certificates.

``uomp init`` makes the CA (:func:`gateway.cli.initsteps.init_ca`); ``uomp ca init`` the same, with more names.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from gateway import ca_store
from gateway.cli import home, initsteps, userlog
from gateway.cli.main import paths_from
from gateway.config import Paths
from gateway.core import ca
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write


def _lifetime(hours: float) -> dt.timedelta:
    try:
        return dt.timedelta(hours=hours)
    except OverflowError as exc:
        raise UompError(ErrorCode.CA_ERROR, "--lifetime-hours is out of range") from exc


def _ca_init(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    made = ca_store.init_all(paths, initsteps.cert_hostnames(paths, args.hostname), key_type=args.key_type)
    print(f"CA directory: {paths.ca_dir}")
    for what, new in made.items():
        print(f"  {what}: {'created' if new else 'kept'}")
    print(f"  agent CA certificate (give to agents): {ca_store.ca_cert_path(paths)}")
    print(f"  gateway certificate: {ca_store.server_cert_path(paths)}")
    print(f"  gateway key: {ca_store.server_key_path(paths)}")
    print(f"  CRL: {ca_store.crl_path(paths)}")
    return 0


def _read_input(name: str) -> bytes:
    if name == "-":
        return sys.stdin.buffer.read(ca.MAX_CSR_BYTES + 1)
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise UompError(ErrorCode.CA_ERROR, f"cannot read {name}: {exc.strerror}") from exc


def _issue(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    lifetime = _lifetime(args.lifetime_hours)
    if args.csr is not None:
        csr = _read_input(args.csr)
        with userlog.change(paths) as event:
            pem = ca_store.issue_from_csr(paths, args.agent_id, csr, lifetime)
            event.action, event.agent_id = "cert_issued", args.agent_id
            event.reason = "the user issued an agent certificate (from a CSR)"
            event.detail = f"serial {ca.serial_hex(ca.load_cert(pem).serial_number)}"
        if args.cert_out:
            atomic_write(Path(args.cert_out), pem, mode=0o644)
            cert = ca.load_cert(pem)
            print(f"certificate for agent {args.agent_id} written to {args.cert_out}")
            print(
                f"  serial {ca.serial_hex(cert.serial_number)}, valid until "
                f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S}Z"
            )
            print(f"  the agent also needs the CA certificate: {ca_store.ca_cert_path(paths)}")
        else:
            sys.stdout.write(pem.decode("ascii"))
        return 0
    if args.cert_out:
        raise UompError(ErrorCode.CA_ERROR, "--cert-out goes with --csr (--out writes agent.key and agent.crt)")
    with userlog.change(paths) as event:
        files = ca_store.issue_with_key(paths, args.agent_id, Path(args.out), lifetime, key_type=args.key_type)
        event.action, event.agent_id, event.detail = "cert_issued", args.agent_id, f"serial {files.serial}"
        event.reason = "the user issued an agent certificate"
    print(f"agent {args.agent_id}: {'new key' if files.new_key else 'existing key reused'}")
    print(f"  key:         {files.key_file} (0600)")
    print(
        f"  certificate: {files.cert_file} (0600, serial {files.serial}, valid until "
        f"{files.not_after:%Y-%m-%d %H:%M:%S}Z)"
    )
    print(f"  CA:          {files.ca_file} (0600)")
    return 0


def revoke_agent(
    paths: Paths, target: str, *, keep_sessions: bool = False, via: str = "uomp agent revoke"
) -> tuple[ca_store.Revocation, home.SessionSweep]:
    """Revoke certificates (an agent's, or a serial and its renewals), re-sign the CRL, and revoke
    the live sessions bound to them (unless ``keep_sessions``). Used by the CLI and the dashboard."""
    with userlog.change(paths, via="dashboard" if via.startswith("dashboard") else "cli") as event:
        done = ca_store.revoke_target(paths, target)
        if done.revoked:  # (nothing new revoked: no event)
            event.action, event.count = "cert_revoked", len(done.revoked)
            event.agent_id = done.agent_ids[0] if len(done.agent_ids) == 1 else userlog.USER_AGENT
            event.reason = f"the user revoked {len(done.revoked)} agent certificate(s)"
            event.detail = f"target {target[:120]}"
    if done.revoked:
        from gateway.reloads import notify_running

        notify_running(paths)  # the running gateway and guard reload the CRL now
    by_agent = [a for a in done.agent_ids if target in (a, f"agent:{a}")]
    sweep = home.revoke_sessions(
        paths,
        reason=f"agent certificate revoked ('{via} {target}')",
        agent_ids=by_agent,
        jkts=done.jkts,
        x5ts=done.x5ts,
        keep=keep_sessions,
    )
    return done, sweep


def _revoke(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    done, sweep = revoke_agent(paths, args.target, keep_sessions=args.keep_sessions)
    if done.revoked:
        for s in done.revoked:
            print(f"revoked {s}")
    else:
        print(f"nothing new to revoke for {args.target} (already revoked)")
    if len(done.serials) > 1 and not args.target.startswith("agent:") and args.target not in done.agent_ids:
        print(f"  (serial {args.target} and the {len(done.serials) - 1} certificate(s) renewed from it)")
    print(
        f"CRL re-signed: {ca_store.crl_path(paths)}; a running gateway and guard of this home were told to "
        "reload it and refuse these certificates at once, on open connections too"
    )
    if args.keep_sessions:
        print(
            f"{len(sweep.matched)} live session(s) bound to these certificates kept (--keep-sessions); none of "
            "their requests can succeed with a revoked certificate"
        )
    else:
        print(
            f"{len(sweep.matched)} live session(s) bound to these certificates revoked too (their tokens and "
            "refresh tokens stop working at once; --keep-sessions to keep them)"
        )
    for sid, agent in sweep.matched:
        print(f"  {sid}  {agent}")
    if sweep.unbound:
        print(
            f"{len(sweep.unbound)} Local Profile session(s) of this agent need no certificate and stay active "
            "('uomp sessions revoke SESSION' to end them):"
        )
        for sid, agent in sweep.unbound:
            print(f"  {sid}  {agent}")
    return 0


def _list(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    rows = ca_store.list_agents(paths)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "agent_id": r.agent_id,
                        "serial": r.serial,
                        "not_after": f"{r.not_after:%Y-%m-%dT%H:%M:%S}Z",
                        "status": r.status,
                        "renewed_from": r.renewed_from,
                        "revoked_at": f"{r.revoked_at:%Y-%m-%dT%H:%M:%S}Z" if r.revoked_at else None,
                    }
                    for r in rows
                ],
                indent=1,
            )
        )
        return 0
    if not rows:
        print("no agent certificates issued")
        return 0
    width = max(len("AGENT"), *(len(r.agent_id) for r in rows))
    print(f"{'AGENT':<{width}}  {'SERIAL':<32}  {'NOT AFTER (UTC)':<19}  STATUS")
    for r in rows:
        print(f"{r.agent_id:<{width}}  {r.serial:<32}  {r.not_after:%Y-%m-%d %H:%M:%S}  {r.status}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp ca`` and ``uomp agent`` to the command line."""
    c = sub.add_parser("ca", help="the certificate authority that issues agent client certificates")
    csub = c.add_subparsers(dest="ca_command", metavar="ACTION", required=True)
    ci = csub.add_parser(
        "init",
        help="create the CA, the gateway server certificate and an empty CRL if missing (never replaces "
        "an existing CA); re-issues the gateway certificate when it lacks a requested name or is near "
        "expiry, and re-signs the CRL when it is near its next update",
    )
    ci.add_argument(
        "--hostname",
        action="append",
        default=[],
        metavar="H",
        help="extra DNS name or IP address for the gateway certificate (repeatable); localhost, "
        "127.0.0.1, ::1, the configured listen host (unless a wildcard) and the hosts of the "
        "configured endpoints are always included",
    )
    ci.add_argument(
        "--key-type",
        choices=("p256", "ed25519"),
        default="p256",
        help="key type of a NEW CA (default p256); ignored when the CA exists",
    )
    ci.set_defaults(func=_ca_init)

    a = sub.add_parser("agent", help="issue, revoke and list agent client certificates")
    asub = a.add_subparsers(dest="agent_command", metavar="ACTION", required=True)
    ai = asub.add_parser(
        "issue",
        help="issue a client certificate (URI SAN uomp://agent/AGENT_ID, EKU clientAuth) from a CSR, "
        "or with a new key written to a directory",
    )
    ai.add_argument("agent_id", metavar="AGENT_ID", help="1-128 characters of A-Z a-z 0-9 . _ -")
    src = ai.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--csr",
        metavar="FILE",
        help="PEM or DER certificate signing request ('-' = stdin); its signature is "
        "checked and only its public key is used",
    )
    src.add_argument(
        "--out",
        metavar="DIR",
        help="write agent.key (an existing one is reused), agent.crt and ca.crt here, all 0600; "
        "DIR is created 0700, an existing DIR keeps its mode but must be yours and not "
        "group/other-writable",
    )
    ai.add_argument("--cert-out", metavar="FILE", help="with --csr: write the certificate here instead of stdout")
    ai.add_argument(
        "--lifetime-hours",
        type=float,
        default=24.0,
        metavar="N",
        help="certificate lifetime in hours (default 24, at most 2160 = 90 days)",
    )
    ai.add_argument(
        "--key-type",
        choices=("p256", "ed25519"),
        default="p256",
        help="with --out: type of a new agent key (default p256)",
    )
    ai.set_defaults(func=_issue)

    ar = asub.add_parser(
        "revoke",
        help="revoke every certificate of an agent, or one certificate by serial together with every "
        "certificate renewed from it, re-sign the CRL, and revoke the sessions bound to them",
    )
    ar.add_argument(
        "target",
        metavar="AGENT_ID|SERIAL",
        help="agent id or hex serial; prefix 'agent:' or 'serial:' if one could be read as the other",
    )
    ar.add_argument(
        "--keep-sessions",
        action="store_true",
        help="do not revoke the live sessions whose tokens are bound to these certificates (by "
        "default they are revoked: with the certificate gone none of their requests can succeed)",
    )
    ar.set_defaults(func=_revoke)

    al = asub.add_parser("list", help="certificates issued by the CA: agent, serial, expiry, status")
    al.add_argument("--json", action="store_true", help="machine-readable output")
    al.set_defaults(func=_list)

    from gateway.cli import enroll

    enroll.register_invite(asub)
