"""``uomp authorize AGENT_DIR``: read the agent's uom.json, show the user what it asks for, and
(only on the user's yes) create and grant a session and hand the agent its token (spec §5.2, §14.2,
§15.5, §16.3).

Local Profile: the token goes into a 0600 env file (``UOM_TOKEN``, ``UOMP_BASE_URL``) or is printed.
Remote Profile (``--remote``): a short access token (<= 10 min) bound to the agent's certificate key
(``cnf.x5t#S256`` and ``cnf.jkt``), a refresh token bound to the same key, and one 0600 bundle
file with everything the remote agent needs (see :mod:`gateway.bundle`).

Publisher identity (§16.4) is shown in one of three states: signed by a key in the user's trust
list (named by the name the user gave it), signed by a key the user has never trusted (its DID and
fingerprint shown, the manifest's publisher name marked as its own claim), or not verified at all.
``--require-verified`` accepts only the first. Trusting a new key is offered, never assumed: an
explicit question on a terminal, or ``--trust-publisher NAME``.

Every limit the manifest asks for reaches the grant (see :mod:`gateway.core.restrictions`); the
user may narrow further, widening needs ``--widen``. ``requires_remote: true`` is refused on the
Local Profile unless ``--allow-local``.

Session length (``--session-ttl``/``--duration``, e.g. ``90m``, ``12h``, ``7d``; a bare number is
minutes): local sessions default to 30 minutes (at most ``session_max_minutes``); remote sessions
default to ``remote_session_max_minutes`` (30 days) and live on refresh tokens of
``refresh_lifetime_seconds`` (7 days, never past the session end) and access tokens of at most 10
minutes.

Longer than ~500 lines on purpose: one consent flow, all or nothing: inputs checked, the screen
shown, the session granted and its files written, or nothing left behind.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import re
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from gateway import ca_store, trust
from gateway.bundle import AgentBundle, write_bundle
from gateway.cli import layout
from gateway.cli.guard import guard_config, open_auth
from gateway.cli.main import paths_from
from gateway.config import GuardConfig, Paths
from gateway.core import didkey, jose, manifest, restrictions, tokens
from gateway.core.capability import Scope
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write
from gateway.guard.auth import REMOTE_ACCESS_MAX_SECONDS, minutes_text
from gateway.identity.verify import PublisherResult
from gateway.ledger import auditkey
from gateway.payloads import userkey

RED = "\033[1;31m"
RESET = "\033[0m"


LOCAL_DEFAULT_SESSION_SECONDS = 30 * 60  # §20.1's 30 minutes
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", re.ASCII | re.IGNORECASE)
_UNIT_SECONDS = {"s": 1, "m": 60, "": 60, "h": 3600, "d": 86_400}
MAX_DURATION_SECONDS = 10 * 365 * 86_400  # parsing bound only; the config's maxima decide


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``7d`` (a bare number is minutes) -> seconds; ValueError otherwise."""
    match = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError("a duration is a number with an optional unit s, m, h or d (a bare number is minutes)")
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2).lower()]
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_DURATION_SECONDS:
        raise ValueError("a duration must be more than zero and at most ten years")
    return seconds


def duration_arg(text: str) -> float:
    """argparse type for a duration (90m, 12h, 7d; a bare number is minutes): its seconds."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _warn(text: str) -> None:
    color = sys.stdout.isatty()
    print(f"{RED if color else ''}!! {text}{RESET if color else ''}")


def _scope_line(name: str, scope: Scope) -> str:
    parts = [f"tags={list(scope.tags)}", f"keys={list(scope.keys)}"]
    if scope.deny_tags:
        parts.append(f"deny_tags={list(scope.deny_tags)}")
    if scope.deny_keys:
        parts.append(f"deny_keys={list(scope.deny_keys)}")
    if scope.allowed_fields is not None:
        parts.append(f"allowed_fields={list(scope.allowed_fields)}")
    return f"  {name:<5} " + " ".join(parts)


# ------------------------------------------------------------------------------ identity


def _identity_state(ident: manifest.IdentityResult, trusted: trust.TrustList) -> trust.TrustEntry | None:
    """The trust entry that names this manifest's publisher: only for a verified signature by a key in the list."""
    if not ident.verified:
        return None
    if isinstance(ident, PublisherResult):
        return ident.trust_entry or trusted.find_did(ident.did)
    return trusted.find_did(ident.did)


def _show_identity(m: manifest.Manifest, ident: manifest.IdentityResult, trusted: trust.TrustList) -> None:
    claim = m.agent.publisher
    entry = _identity_state(ident, trusted)
    if entry is not None:
        if ident.did:
            print(f"Publisher: {entry.name} (signed by a key in your trust list: {ident.did})")
        else:
            print(f"Publisher: {entry.name} (verified, {ident.method}: {ident.reason})")
        if claim and claim != entry.name:
            print(f'           "{claim}" (the manifest\'s own claim)')
        return
    if ident.verified and ident.public_key is not None:
        _warn(f"SIGNED BY A KEY YOU HAVE NEVER TRUSTED: {ident.did}")
        print(f"           key fingerprint {didkey.fingerprint(ident.public_key)}")
        print("           anyone can make such a key: compare the DID with the one the publisher gives you, then")
        print("           trust it with --trust-publisher NAME (or uomp trust add DID --name NAME)")
    else:
        _warn(f"UNVERIFIED PUBLISHER: {ident.reason}")
        named = trusted.find_did(ident.did)
        if named is not None:
            _warn(
                f"this manifest names the key you trust as {named.name!r}, but that key did NOT sign it: "
                f"it is not from {named.name!r}"
            )
    print(f'Publisher: "{claim}" (the manifest\'s own claim, not verified)' if claim else "Publisher: (none named)")


def _offer_trust(
    args: argparse.Namespace, paths: Any, ident: manifest.IdentityResult, trusted: trust.TrustList
) -> trust.TrustList:
    """Trust-on-first-use, only on the user's explicit word: --trust-publisher NAME or a typed name."""
    if args.trust_publisher is not None:
        if not ident.verified or not ident.did:
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                "--trust-publisher: the manifest has no verified signature, so there is no key to trust",
            )
        name = args.trust_publisher
    elif ident.verified and ident.did and _identity_state(ident, trusted) is None and _interactive(args):
        name = input(
            "Trust this key as a publisher from now on? Type the name to remember it by (empty: do not trust): "
        ).strip()
        if not name:
            return trusted
    else:
        return trusted
    entry, old = trust.add(paths, ident.did, name, how="authorize")
    if old is None:
        done = f"added to your trust list as {entry.name!r}"
    elif old is entry:
        done = "already in your trust list under that name"
    else:
        done = f"renamed in your trust list from {old.name!r} to {entry.name!r}"
    print(f"Publisher: {entry.name} (signed by {entry.id}, {done})")
    return trust.load(paths)


def _interactive(args: argparse.Namespace) -> bool:
    return not args.yes and sys.stdin.isatty()


# ------------------------------------------------------------------------------ the panel


def _quoted(text: str) -> str:
    """The agent's own multi-line text, every line indented and marked, so that none of it can
    pass for one of the panel's lines (a description saying "Publisher: … trust list")."""
    return "\n".join(f"           > {line}" for line in text.splitlines() or [""])


def _show_capabilities(m: manifest.Manifest) -> None:
    def described(names: tuple[str, ...]) -> str:
        return ", ".join(f"{n} ({restrictions.CAPABILITIES.get(n, 'unknown to this gateway')})" for n in names)

    parts = []
    if m.required_capabilities:
        parts.append("required " + described(m.required_capabilities))
    if m.optional_capabilities:
        parts.append("optional " + described(m.optional_capabilities))
    print("Capabilities: " + ("; ".join(parts) if parts else "none declared"))
    if "memory.write" in m.required_capabilities:
        _warn("the agent REQUIRES memory.write, which this gateway does not provide: it may not work")


def _show(m: manifest.Manifest, ident: manifest.IdentityResult, trusted: trust.TrustList) -> None:
    a = m.agent
    print(f"Agent:     {a.name} ({a.id}) version {a.version}")
    if a.description:
        print(_quoted(a.description))
    _show_identity(m, ident, trusted)
    print("Requests:")
    print(_scope_line("read", m.read))
    if m.read_description:
        print(_quoted(m.read_description))
    if not m.write.is_empty():
        print(_scope_line("write", m.write) + "  (writes are not available; they will not be granted)")
    _show_capabilities(m)
    print(
        f"Remote:    requires_remote: {'true' if m.requires_remote else 'false'}"
        + (" (the agent runs on another machine, through the gateway)" if m.requires_remote else "")
    )
    level = manifest.retention_level(m.retention)
    r = m.retention
    if r is None:
        _warn("NO DATA RETENTION POLICY: the agent makes no promise about deleting your data")
    else:
        print(
            f"Retention: keeps data up to {r.max_retention_seconds:g} s after the task, deletion by "
            f"{r.deletion_method}" + (", deletion proof required" if r.proof_required else "")
        )
        if r.third_party_sharing:
            _warn("the agent says it SHARES your data with third parties")
    if level == "no_guarantee":
        _warn("NO RETENTION GUARANTEE: this agent may keep what it reads indefinitely")


def verify_publisher(m: manifest.Manifest, paths: Paths) -> PublisherResult:
    """The publisher, checked by the method the manifest names (did:key, did:web, X.509, OpenPGP);
    did:web documents are fetched under the [registry] fetch rules."""
    from gateway.config import RegistryConfig, load_section
    from gateway.identity.verify import verify_publisher as verify
    from gateway.registry.ops import policy

    cfg = load_section(RegistryConfig, "registry", file=paths.config_file)
    return verify(m.raw, trust.load(paths), policy(cfg))


def _enforce_policy(paths: Paths, ident: manifest.IdentityResult, trusted: trust.TrustList) -> None:
    """``[trust] require`` (spec §16.4 MUST): an agent whose publisher fails it gets no session and no token."""
    from gateway.config import TrustConfig, load_section

    policy = load_section(TrustConfig, "trust", file=paths.config_file)
    if not policy.require:
        return
    entry = _identity_state(ident, trusted)
    if entry is None or ident.method not in policy.require:
        state = f"verified by {ident.method}" if entry is not None else "not verified against your trust list"
        raise UompError(
            ErrorCode.ACCESS_DENIED,
            f"your [trust] require = {policy.require} admits only publishers verified by those methods; this one is "
            f"{state}: no session is created (change [trust] in {paths.config_file} only if that is your policy)",
        )


def _show_listing(paths: Paths, path: Path, raw: bytes) -> None:
    """Where ``uomp registry install`` got this manifest from (nothing when it did not install it)."""
    from gateway.registry.ops import provenance

    found = provenance(paths, path, raw)
    if found is None:
        return
    for line in found.lines:
        print(line)
    for text in found.warnings:
        _warn(text)


def _show_grant(plan: restrictions.ReadGrant, args: argparse.Namespace, cfg: GuardConfig) -> None:
    reads = args.max_reads if args.max_reads is not None else cfg.default_max_read_queries
    extras = [f"at most {reads} reads in the session (--max-reads)"]
    if plan.aggregation_only:
        extras.append("aggregates only (sum/avg/count/min/max), never items")
    if args.task_bound:
        extras.append("one task")
    print(
        "Grant:     "
        + _scope_line("read", plan.scope).strip()[len("read") :].strip()
        + (f"; {'; '.join(extras)}" if extras else "")
    )
    if plan.widened:
        _warn("WIDER THAN REQUESTED (--widen): " + "; ".join(plan.widened))


def _session_seconds(args: argparse.Namespace, cfg: GuardConfig) -> float:
    most_minutes = cfg.remote_session_max_minutes if args.remote else cfg.session_max_minutes
    if args.duration is None:
        return most_minutes * 60.0 if args.remote else float(min(LOCAL_DEFAULT_SESSION_SECONDS, most_minutes * 60))
    if args.duration > most_minutes * 60:
        setting = "remote_session_max_minutes" if args.remote else "session_max_minutes"
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"--session-ttl: a {'remote' if args.remote else 'local'} session lasts "
            f"at most {minutes_text(most_minutes)} (the {setting} setting in [guard])",
        )
    if args.duration < 60:
        raise UompError(ErrorCode.INVALID_REQUEST, "--session-ttl: a session lasts at least one minute")
    return float(args.duration)


def _show_session(seconds: float, args: argparse.Namespace, cfg: GuardConfig) -> None:
    until = tokens.iso(time.time() + seconds)
    print(f"Session:   {minutes_text(seconds / 60)}, until about {until} (shorten with --session-ttl, e.g. 7d or 12h)")
    if args.remote:
        access = min(cfg.remote_token_lifetime_seconds, REMOTE_ACCESS_MAX_SECONDS, seconds)
        refresh = min(cfg.refresh_lifetime_seconds, seconds)
        if refresh <= access:
            print(f"           access tokens last {minutes_text(access / 60)}, the whole session")
        else:
            print(
                f"           access tokens last {minutes_text(access / 60)}; the agent renews them with a refresh "
                f"token of {minutes_text(refresh / 60)}, itself renewed on each use, never past the session end"
            )
        if seconds > args.cert_hours * 3600:
            print(
                f"           the agent's certificate lasts {args.cert_hours:g} h (--cert-hours), less than the "
                "session: the SDK renews it by itself (POST /v1/certificates/renew); an agent using curl must "
                "renew it before it expires"
            )


def _show_aggregates(args: argparse.Namespace) -> None:
    """The aggregate grants (docs/aggregates.md), said plainly before the user confirms."""
    if args.aggregate_min_max:
        _warn("MIN/MAX GRANTED: each min or max answer is the exact value of one of your items")
    if args.aggregate_exact:
        _warn("EXACT AGGREGATES GRANTED: comparing sums over overlapping tags, or over time, can reveal single values")
    if not (args.aggregate_min_max or args.aggregate_exact):
        print("Aggregates: sum/avg/count protected against isolating single values; no min/max")


def _confirm(args: argparse.Namespace) -> None:
    if args.yes:
        return
    if not sys.stdin.isatty():
        raise UompError(
            ErrorCode.INVALID_REQUEST, "no terminal to ask for confirmation; pass --yes to authorize non-interactively"
        )
    answer = input("Grant this access? [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise UompError(ErrorCode.ACCESS_DENIED, "authorization declined by the user")


def _plan(m: manifest.Manifest, args: argparse.Namespace) -> restrictions.ReadGrant:
    """The read grant: every limit the manifest asks for, narrowed by the user (widening needs --widen)."""
    plan = restrictions.plan_read_grant(
        m.read,
        capabilities=(*m.required_capabilities, *m.optional_capabilities),
        tags=args.tag,
        keys=args.key,
        deny_tags=args.deny_tag or (),
        deny_keys=args.deny_key or (),
        allowed_fields=args.allowed_field,
        aggregation_only=args.aggregation_only,
    )
    if plan.widened and not args.widen:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            "this grants more than the agent requested ("
            + "; ".join(plan.widened)
            + "); add --widen to confirm you want that",
        )
    return plan


def _cert_binding(cert_pem: bytes) -> dict[str, str]:
    cert = x509.load_pem_x509_certificate(cert_pem)
    der = cert.public_bytes(serialization.Encoding.DER)
    pub = cert.public_key()
    return {"x5t#S256": jose.cert_thumbprint(der), "jkt": jose.key_thumbprint(pub)}  # type: ignore[arg-type]


def consent(
    args: argparse.Namespace,
    paths: Paths,
    m: manifest.Manifest,
    ident: manifest.IdentityResult,
    cfg: GuardConfig,
    *,
    source: tuple[Path, bytes] | None = None,
) -> tuple[restrictions.ReadGrant, float]:
    """The consent panel and every refusal of ``uomp authorize`` before anything is made: what the
    agent asks for (scopes, retention, publisher, where ``uomp registry install`` found the manifest
    at ``source``: its path and bytes), the grant (narrowed by the user; wider only with
    ``--widen``), the session, the aggregates, the ``[trust] require`` policy; then the user's yes.
    Returns the read grant and the session length. Used by ``uomp authorize``, ``uomp run`` and
    ``uomp requests approve``."""
    trusted = trust.load(paths)
    _show(m, ident, trusted)
    if source is not None:
        _show_listing(paths, *source)
    plan = _plan(m, args)
    _show_grant(plan, args, cfg)
    seconds = _session_seconds(args, cfg)
    _show_session(seconds, args, cfg)
    _show_aggregates(args)
    if m.requires_remote and not args.remote:
        if not args.allow_local:
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                "this agent declares requires_remote: true (it runs on another "
                "machine); authorize it with --remote, or pass --allow-local to run it on this one",
            )
        _warn("the agent runs on this machine although it declares requires_remote: true (--allow-local)")
    trusted = _offer_trust(args, paths, ident, trusted)
    _enforce_policy(paths, ident, trusted)
    if args.require_verified and _identity_state(ident, trusted) is None:
        raise UompError(
            ErrorCode.ACCESS_DENIED,
            "the publisher could not be verified against your trust list (§16.4) and "
            "--require-verified is set; see uomp trust",
        )
    _confirm(args)
    return plan, seconds


def session_request(
    m: manifest.Manifest, ident: manifest.IdentityResult, seconds: float, *, remote: bool
) -> dict[str, Any]:
    """The Auth Service's create-session body for this manifest (what the agent asked for)."""
    create: dict[str, Any] = {
        "agent_id": m.agent.id,
        "agent_name": m.agent.name,
        "requested_scopes": {"read": m.read.to_claim()},
        "duration_minutes": seconds / 60,
        "profile": "remote" if remote else "local",
    }
    if ident.verified and ident.public_key is not None:
        create["identity_public_jwk"] = jose.public_jwk(ident.public_key)
    if m.retention is not None:
        create["data_retention_policy"] = {
            "max_retention_seconds": m.retention.max_retention_seconds,
            "deletion_method": m.retention.deletion_method,
            "proof_required": m.retention.proof_required,
        }
    return create


def grant_request(plan: restrictions.ReadGrant, args: argparse.Namespace) -> dict[str, Any]:
    """The Auth Service's grant body: the read grant the user consented to and the grant flags."""
    grant: dict[str, Any] = {
        "granted_scopes": {"read": plan.scope.to_claim()},
        "widen": bool(plan.widened),
        "aggregation_only": plan.aggregation_only,
        "task_bound": args.task_bound,
        "aggregate_min_max": args.aggregate_min_max,
        "aggregate_exact": args.aggregate_exact,
    }
    if plan.allowed_fields is not None:
        grant["allowed_fields"] = list(plan.allowed_fields)
    if args.max_reads is not None:
        grant["limits"] = {"max_read_queries": args.max_reads}
    return grant


def bind_remote(grant: dict[str, Any], m: manifest.Manifest, url: str, cert_pem: bytes) -> None:
    """Make ``grant`` a Remote Profile grant for ``url``, bound to the agent certificate's key."""
    from gateway.core import ca

    cert = x509.load_pem_x509_certificate(cert_pem)
    if ca.agent_id_from_cert(cert) != m.agent.id:
        raise UompError(ErrorCode.INVALID_REQUEST, "the agent certificate names another agent than the manifest")
    parts = urlsplit(url)
    host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    grant.update(
        {
            "profile": "remote",
            "audience": url,
            "allowed_endpoints": [host],
            "cnf": _cert_binding(cert_pem),
            "refresh": True,
        }
    )


def remote_bundle(
    paths: Paths,
    m: manifest.Manifest,
    session_id: str,
    url: str,
    answer: dict[str, Any],
    cert_pem: bytes,
    *,
    agent_key: str | None = None,
    agent_key_file: str | None = None,
) -> AgentBundle:
    """What a remote agent needs after a grant (its key only when this side made it)."""
    return AgentBundle(
        agent_id=m.agent.id,
        session_id=session_id,
        gateway_url=url,
        access_token=answer["token"],
        access_expires_at=answer["expires_at"],
        refresh_token=answer.get("refresh_token"),
        refresh_expires_at=answer.get("refresh_expires_at"),
        session_expires_at=answer.get("session_expires_at"),
        ca_cert=ca_store.ca_cert_path(paths).read_text(),
        agent_cert=cert_pem.decode(),
        agent_key=agent_key,
        agent_key_file=agent_key_file,
        payload_public_key=userkey.public_b64(paths),
        audit_verifier_key=_audit_verifier_key(paths),
    )


def _authorize(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    agent_dir = Path(args.agent_dir)
    path = agent_dir / "uom.json" if agent_dir.is_dir() else agent_dir
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UompError(ErrorCode.MANIFEST_INVALID, f"cannot read {path}: {exc.strerror}") from exc
    m = manifest.parse_manifest(raw)
    ident = verify_publisher(m, paths)
    cfg = guard_config(args, paths)
    if args.layout != "uomp" and not args.remote:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"--layout {args.layout} is for a remote agent's files: add --remote --out DIR (a local agent "
            "gets UOM_TOKEN/UOMP_BASE_URL in its env file already, or run it with uomp run)",
        )
    if args.layout == "uomp-core" and (not args.out or args.cert or args.csr or args.bundle):
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            "--layout uomp-core writes the reference SDK's files into --out DIR (the agent's ~/.uomp): give --out, "
            "without --cert, --csr or --bundle",
        )
    if args.remote:
        check_gateway_url(args, paths)
    plan, seconds = consent(args, paths, m, ident, cfg, source=(path, raw))
    # Everything that can be checked is checked before anything is made: a refused authorize leaves
    # no session, no certificate and no file behind.
    given = _remote_inputs(args, paths, m) if args.remote else None
    auth = open_auth(paths, cfg)
    session_id: str | None = None
    try:
        session_id = str(auth.create_session(session_request(m, ident, seconds, remote=args.remote))["session_id"])
        grant = grant_request(plan, args)
        if given is not None:
            return _remote(args, paths, auth, session_id, m, grant, given)
        _local(args, paths, cfg, m, auth.grant(session_id, grant))
        return 0
    except BaseException as exc:
        if session_id is not None:
            abandon(auth, session_id, exc)
        raise
    finally:
        auth.close_db()
        auth.audit.close()


def _local(
    args: argparse.Namespace, paths: Any, cfg: GuardConfig, m: manifest.Manifest, answer: dict[str, Any]
) -> None:
    base = f"http://127.0.0.1:{cfg.tcp_port}"
    if args.print_token:
        print(f"Session {answer['session_id']} active until {answer['expires_at']}.")
        print(f"export UOM_TOKEN={answer['token']}")
        print(f"export UOMP_BASE_URL={base}")
        return
    env = Path(args.env_file or (paths.agents_dir / m.agent.id / "uomp.env"))
    env.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(env, f"UOM_TOKEN={answer['token']}\nUOMP_BASE_URL={base}\n".encode(), mode=0o600)
    print(f"Session {answer['session_id']} active until {answer['expires_at']}.")
    print(f"Token written to {env} (mode 0600). Start the agent with its variables, e.g.:")
    print(f"  (set -a; . {env}; exec <agent command>)   # the shell reads the file: no token on a command line")
    print(f"or let uomp start it with a session of its own: uomp run {args.agent_dir} -- <agent command>")


def abandon(auth: Any, session_id: str, exc: BaseException) -> None:
    """A session whose authorize failed after it was created ends at once, and the audit says why
    (its creation is already in the log, so it is ended, not erased)."""
    why = exc.code if isinstance(exc, UompError) else type(exc).__name__
    try:
        auth.revoke(session_id, reason=f"authorize did not finish ({why}); nothing was handed to the agent")
    except UompError as inner:
        _warn(
            f"session {session_id} could not be ended after the failure ({inner.code}); "
            f"run: uomp sessions revoke {session_id}"
        )


class _RemoteInputs:
    """What ``--remote`` was given, read and checked before anything is created."""

    def __init__(self, url: str, cert_pem: bytes | None, csr_pem: bytes | None) -> None:
        self.url, self.cert_pem, self.csr_pem = url, cert_pem, csr_pem


def _read_input(flag: str, name: str) -> bytes:
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise UompError(ErrorCode.INVALID_REQUEST, f"cannot read {flag} {name}: {exc.strerror}") from exc


def _remote_inputs(args: argparse.Namespace, paths: Any, m: manifest.Manifest) -> _RemoteInputs:
    from gateway.core import ca

    url = args.gateway_url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise UompError(ErrorCode.INVALID_REQUEST, "--gateway-url must be an https:// URL")
    if not ca_store.ca_cert_path(paths).exists() or not paths.ca_key.exists():
        raise UompError(ErrorCode.CA_ERROR, f"no CA in {paths.ca_dir}; run 'uomp ca init' (or 'uomp init')")
    cert_pem = csr_pem = None
    if args.cert:
        raw = _read_input("--cert", args.cert)
        try:
            cert = ca.load_cert(raw)
        except UompError as exc:
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                f"--cert {args.cert} is not a certificate (PEM or DER): "
                f"{exc.message}; give the file 'uomp agent issue' wrote",
            ) from exc
        ours = ca.load_cert(ca_store.ca_cert_path(paths).read_bytes())
        try:
            cert.verify_directly_issued_by(ours)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                f"--cert {args.cert} was not issued by your CA "
                f"({ca_store.ca_cert_path(paths)}); issue one with: uomp agent issue {m.agent.id}",
            ) from exc
        if ca.agent_id_from_cert(cert) != m.agent.id:
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                f"--cert {args.cert} names agent {ca.agent_id_from_cert(cert)!r}, the manifest {m.agent.id!r}",
            )
        if cert.not_valid_after_utc <= dt.datetime.now(dt.UTC):
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                f"--cert {args.cert} expired on "
                f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z; issue a new one: uomp agent issue "
                f"{m.agent.id}",
            )
        cert_pem = ca.cert_pem(cert)
    elif args.csr:
        raw = _read_input("--csr", args.csr)
        try:
            ca.load_csr(raw)
        except UompError as exc:
            raise UompError(ErrorCode.INVALID_REQUEST, f"--csr {args.csr}: {exc.message}") from exc
        csr_pem = raw
    elif args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UompError(ErrorCode.INVALID_REQUEST, f"--out {args.out} exists and is not a directory")
    return _RemoteInputs(url, cert_pem, csr_pem)


def check_gateway_url(args: argparse.Namespace, paths: Any) -> None:
    """The one source of truth for where the gateway is (gateway/appliance.py): the default
    --gateway-url comes from it; another URL is refused while the appliance runs and warned about
    otherwise when the gateway would not accept it or its certificate does not name it."""
    from gateway import appliance
    from gateway.config import GatewayConfig, load_section

    gcfg = load_section(GatewayConfig, "gateway", file=paths.config_file)
    if not args.gateway_url:
        args.gateway_url = appliance.default_gateway_url(paths, gcfg)
        return
    problems = appliance.check_gateway_url(paths, gcfg, args.gateway_url)
    if problems and appliance.is_running(paths) and not args.any_gateway_url:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            " ".join(problems) + " (or pass --any-gateway-url if a proxy in front answers for it)",
        )
    for p in problems:
        _warn(p)


def _remote(
    args: argparse.Namespace,
    paths: Any,
    auth: Any,
    session_id: str,
    m: manifest.Manifest,
    grant: dict[str, Any],
    given: _RemoteInputs,
) -> int:
    url = given.url
    parts = urlsplit(url)
    agent_key: str | None = None
    agent_key_file: str | None = None
    lifetime = dt.timedelta(hours=args.cert_hours)
    made: list[Path] = []  # files this command created, removed again if it fails
    key_dir: Path | None = None  # where the key this command made for the agent is
    try:
        if given.cert_pem is not None or given.csr_pem is not None:
            cert_pem = given.cert_pem or ca_store.issue_from_csr(paths, m.agent.id, given.csr_pem or b"", lifetime)
            # the agent keeps its own key; the bundle only says where (never the key itself)
            if args.key_file:
                agent_key_file = str(Path(args.key_file).resolve())
        else:
            out = Path(args.out or (paths.agents_dir / m.agent.id))
            if args.layout == "uomp-core":
                # a new key each time, under the names the reference SDK reads
                files = layout.rename_for_reference(
                    ca_store.issue_with_key(paths, m.agent.id, layout.certs_dir(out), lifetime, reuse=False)
                )
            else:
                # the agent's certificate there is reused while it is good (not revoked, not yet due for renewal)
                files = ca_store.issue_with_key(paths, m.agent.id, out, lifetime, reuse=not args.new_cert)
            if files.new_key:
                made.append(files.key_file)
            if not files.reused_cert:
                made.append(files.cert_file)
            print(
                f"Agent certificate {files.serial} ({'reused' if files.reused_cert else 'new'}), valid until "
                f"{files.not_after:%Y-%m-%d %H:%M:%S}Z" + ("; --new-cert to issue another" if files.reused_cert else "")
            )
            cert_pem = files.cert_file.read_bytes()
            agent_key = files.key_file.read_text()
            key_dir = files.out_dir if args.layout == "uomp" else None  # (the curl hint names agent.*)
        return _remote_grant(
            args, paths, auth, session_id, m, grant, url, parts, cert_pem, agent_key, agent_key_file, key_dir
        )
    except BaseException:
        for f in made:
            f.unlink(missing_ok=True)
        raise


def _remote_grant(
    args: argparse.Namespace,
    paths: Any,
    auth: Any,
    session_id: str,
    m: manifest.Manifest,
    grant: dict[str, Any],
    url: str,
    parts: Any,
    cert_pem: bytes,
    agent_key: str | None,
    agent_key_file: str | None,
    key_dir: Path | None,
) -> int:
    bind_remote(grant, m, url, cert_pem)
    answer = auth.grant(session_id, grant)
    bundle = remote_bundle(
        paths, m, session_id, url, answer, cert_pem, agent_key=agent_key, agent_key_file=agent_key_file
    )
    # with --out, everything for the agent (key, certificate, CA, bundle) is in that one directory
    out_path = Path(
        args.bundle
        or (
            Path(args.out) / "bundle.json"
            if args.out and not (args.cert or args.csr)
            else paths.agents_dir / m.agent.id / "bundle.json"
        )
    )
    out_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_bundle(out_path, bundle)
    if args.layout == "uomp-core":
        env = layout.write_env(Path(args.out), token=answer["token"], base_url=url, session_id=session_id)
        print(f"For the reference SDK (@uomp/sdk): {Path(args.out)} is the agent's ~/.uomp")
        print(f"  {layout.certs_dir(Path(args.out))}/client.crt, client.key (0600), ca.crt: its mTLS files")
        print(f"  {env} (0600): UOM_TOKEN, UOMP_BASE_URL, UOMP_SESSION_ID")
        print(
            "  on the agent's machine: copy it to ~/.uomp, then: (set -a; . ~/.uomp/uomp.env; exec node index.js) "
            "(the reference does not refresh tokens: its access token lasts the access lifetime above)"
        )
    print(
        f"Remote session {session_id}. Session ends {answer.get('session_expires_at')}; access token until "
        f"{answer['expires_at']}, refresh token until {answer.get('refresh_expires_at')} (renewed on each refresh)."
    )
    print(f"Agent bundle written to {out_path} (mode 0600): hand it to the agent over a private channel.")
    print(f"The agent's gateway URL (its tokens are for this address): {url}")
    if _dpop_url(paths, url):
        # TLS ends at Cloudflare's edge: through the tunnel an agent proves its key with a DPoP proof
        # per request (RFC 9449), which curl cannot make; an mTLS curl line would only be refused
        print("Through the tunnel the agent uses DPoP (a signed proof per request, so no curl line): with the SDK,")
        print(f'  UompClient.from_bundle("{out_path}", mode="dpop"); in a checkout of this project:')
        print(f"  python examples/remote_agent.py --bundle {out_path} --dpop KEY")
    elif key_dir is not None:
        d = key_dir
        print("A first read from the agent's side, with these files (any key it may read):")
        print(
            f"  curl --cacert {d}/ca.crt --cert {d}/agent.crt --key {d}/agent.key "
            f'-H "X-UOMP-Agent-Id: {m.agent.id}" -H "Authorization: Bearer $(python3 -c '
            f"'import json,sys; print(json.load(open(sys.argv[1]))"
            f'["access_token"])\' {out_path})" {url}/v1/memory/KEY'
        )
    return 0


def _dpop_url(paths: Paths, url: str) -> bool:
    """Is ``url`` the recorded quick or named tunnel's (where agents use DPoP, never mTLS)?"""
    from gateway import appliance

    recorded = appliance.load_addresses(paths)["tunnel"] or {}
    return recorded.get("mode") in ("quick", "named") and str(recorded.get("url", "")).rstrip("/") == url.rstrip("/")


def add_grant_arguments(p: argparse.ArgumentParser) -> None:
    """The consent flags (what to grant, how long, which publishers), shared with ``uomp requests approve``."""
    p.add_argument("-y", "--yes", action="store_true", help="do not ask; grant what is shown (for scripts)")
    p.add_argument(
        "--session-ttl",
        "--duration",
        dest="duration",
        type=duration_arg,
        metavar="DURATION",
        help="session length: 90m, 12h, 7d (a bare number is minutes); default 30m locally, "
        "remote_session_max_minutes (30 days) with --remote",
    )
    p.add_argument("--tag", action="append", help="grant only these tags (repeatable; default: as requested)")
    p.add_argument("--key", action="append", help="grant only these keys (repeatable; default: as requested)")
    p.add_argument("--deny-tag", action="append", help="add a denied tag (repeatable)")
    p.add_argument("--deny-key", action="append", help="add a denied key (repeatable)")
    p.add_argument("--widen", action="store_true", help="allow --tag/--key beyond what the agent requested")
    p.add_argument("--allowed-field", action="append", help="return only these item fields (repeatable)")
    p.add_argument("--aggregation-only", action="store_true", help="only sum/avg/count/min/max, never items")
    p.add_argument(
        "--aggregate-min-max",
        action="store_true",
        help="also answer min/max aggregates (each reveals one item's value)",
    )
    p.add_argument(
        "--aggregate-exact",
        action="store_true",
        help="answer sums/averages without the check that "
        "stops comparing aggregates from isolating single values (docs/aggregates.md)",
    )
    p.add_argument("--task-bound", action="store_true", help="one task; the session closes on its deletion proof")
    p.add_argument("--max-reads", type=int, help="read query quota (default 100)")
    p.add_argument(
        "--require-verified",
        action="store_true",
        help="refuse agents not signed by a key in your trust list (uomp trust)",
    )
    p.add_argument(
        "--trust-publisher",
        metavar="NAME",
        help="trust the key that signed this manifest from now on, under NAME (add it to your trust list)",
    )
    p.add_argument(
        "--allow-local",
        action="store_true",
        help="authorize on this machine an agent that declares requires_remote: true",
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp authorize`` to the command line."""
    p = sub.add_parser("authorize", help="grant an agent access to your memory after showing what it asks for")
    p.add_argument("agent_dir", help="the agent's directory (with uom.json) or the uom.json file itself")
    add_grant_arguments(p)
    p.add_argument(
        "--env-file",
        help="local profile: where to write UOM_TOKEN/UOMP_BASE_URL "
        "(default $UOMP_HOME/agents/<id>/uomp.env, mode 0600)",
    )
    p.add_argument(
        "--print",
        dest="print_token",
        action="store_true",
        help="local profile: print export lines instead of writing the env file",
    )
    r = p.add_argument_group("remote profile")
    r.add_argument("--remote", action="store_true", help="authorize an agent on another machine (via the gateway)")
    r.add_argument(
        "--gateway-url",
        help="the gateway URL the agent uses (becomes the token audience); default: "
        "the recorded public URL (uomp init --hostname / gateway start --public-url), else "
        "https://localhost:<listen port>",
    )
    r.add_argument(
        "--any-gateway-url",
        action="store_true",
        help="accept a --gateway-url the running gateway does not list (a proxy in front answers for it)",
    )
    r.add_argument("--cert", help="the agent's certificate, already issued (uomp agent issue)")
    r.add_argument("--csr", help="sign this CSR from the agent (its private key never leaves the agent)")
    r.add_argument(
        "--key-file", help="with --csr or --cert: where the agent keeps its key (path recorded in the bundle)"
    )
    r.add_argument("--out", help="make key and certificate for the agent in this directory (key in the bundle)")
    r.add_argument(
        "--layout",
        choices=layout.LAYOUTS,
        default="uomp",
        help="with --out: uomp (agent.key, agent.crt, ca.crt, bundle.json) or uomp-core (the reference SDK's "
        "~/.uomp layout: .gateway-certs/client.crt, client.key, ca.crt and uomp.env with UOM_TOKEN, UOMP_BASE_URL)",
    )
    r.add_argument("--cert-hours", type=float, default=24, help="agent certificate lifetime in hours (default 24)")
    r.add_argument(
        "--new-cert",
        action="store_true",
        help="issue a new agent certificate even if the one in the "
        "output directory is still good (by default it is reused)",
    )
    r.add_argument(
        "--bundle",
        help="where to write the agent bundle (default: DIR/bundle.json with --out DIR, "
        "else $UOMP_HOME/agents/<id>/bundle.json)",
    )
    p.set_defaults(func=_authorize)


def _audit_verifier_key(paths: Paths) -> str:
    """The audit log's public verifier key (C2SP note format), for the agent to check checkpoints."""
    from gateway.core.checkpoint import verifier_key

    auditkey.ensure(paths)
    pub = auditkey.load(paths).public_key()
    return verifier_key(auditkey.origin_for(pub), pub)
