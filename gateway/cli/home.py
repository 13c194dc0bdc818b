"""``uomp init`` and ``uomp keys rotate``; revoking the sessions a revoked credential leaves behind."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway import keys
from gateway.cli import userlog
from gateway.cli.main import paths_from
from gateway.config import GuardConfig, Paths, load_section


def _init(args: argparse.Namespace) -> int:
    from gateway import appliance
    from gateway.config import GatewayConfig

    paths = paths_from(args, needs_init=False)
    appliance.check_home_writable(paths.home)
    if sealed_and_locked(paths):
        return _init_locked(paths, bool(args.hostname))
    if args.hostname:
        gcfg = load_section(GatewayConfig, "gateway", file=paths.config_file)
        urls = [appliance.normalize_public_url(h, default_port=gcfg.listen_port) for h in args.hostname]
        from gateway.fsutil import ensure_private_dir

        ensure_private_dir(paths.home)
        for url in appliance.add_public_urls(paths, urls):
            print(
                f"public URL recorded: {url} (gateway certificate, accepted endpoints and authorize's default "
                "follow it)"
            )
    made = keys.init_home(paths)
    for hook in INIT_HOOKS:
        made.update(hook(paths))
    print(f"data directory: {paths.home}")
    for what, new in made.items():
        print(f"  {what}: {'created' if new else 'kept'}")
    return 0


def sealed_and_locked(paths: Paths) -> bool:
    """True for a sealed home that nothing unlocks for this command (no passphrase file, credential,
    keychain or terminal answer)."""
    from gateway.atrest import vault
    from gateway.errors import ErrorCode, UompError

    if not paths.secrets.exists() or not vault.is_sealed_home(paths):
        return False
    try:
        vault.master(paths)
    except UompError as exc:
        if exc.code is ErrorCode.SECRETS_LOCKED:
            return True
        raise
    return False


def _init_locked(paths: Paths, hostname: bool) -> int:
    """``uomp init`` again on a sealed home without its passphrase: nothing to make is fine (every
    file is there; none is opened), anything to make or a ``--hostname`` (a new gateway
    certificate) is SECRETS_LOCKED naming what needs the keys and how to give the passphrase."""
    from gateway import ca_store
    from gateway.atrest import itemseal, journal, vault
    from gateway.errors import ErrorCode, UompError

    give = (
        f"give the passphrase: run 'uomp init' in a terminal (it asks), or {vault.PASSPHRASE_FILE_ENV}=FILE uomp "
        f"init (systemd: LoadCredential={vault.CREDENTIAL_NAME}:FILE)"
    )
    if hostname:
        raise UompError(
            ErrorCode.SECRETS_LOCKED,
            f"the keys of {paths.home} are sealed and locked: --hostname re-issues the gateway certificate "
            f"with the sealed CA key; {give}",
        )
    wanted = [f for f, _role in journal.sealed_files(paths) if f != itemseal.items_key_path(paths)]
    wanted += [
        paths.public_jwk,
        ca_store.ca_cert_path(paths),
        ca_store.server_cert_path(paths),
        ca_store.crl_path(paths),
    ]
    wanted += [paths.memory_db, itemseal.items_key_path(paths)]
    missing = [f for f in wanted if not f.exists()]
    if missing:
        names = ", ".join(str(f.relative_to(paths.home)) for f in missing)
        raise UompError(
            ErrorCode.SECRETS_LOCKED,
            f"the keys of {paths.home} are sealed and locked, and uomp init must make {names} with them; {give}",
        )
    print(f"data directory: {paths.home}")
    for f in wanted:
        print(f"  {f.relative_to(paths.home)}: kept")
    print(
        "the keys are sealed and locked: nothing was made or opened; to check them and renew the gateway "
        f"certificate or CRL when due, {give}"
    )
    return 0


@dataclass
class SessionSweep:
    """Live sessions found by :func:`revoke_sessions`: revoked, or (``keep``) only listed."""

    matched: list[tuple[str, str]] = field(default_factory=list)  # (session id, agent id)
    unbound: list[tuple[str, str]] = field(default_factory=list)  # same agent, not certificate-bound: untouched


def revoke_sessions(
    paths: Paths,
    *,
    reason: str,
    agent_ids: Iterable[str] = (),
    jkts: Iterable[str] = (),
    x5ts: Iterable[str] = (),
    every_active: bool = False,
    keep: bool = False,
) -> SessionSweep:
    """Revoke (unless ``keep``) the live sessions whose tokens can no longer work.

    A session matches when its tokens are bound (``cnf``) to one of ``jkts`` / ``x5ts``, or it is a
    certificate-bound session of one of ``agent_ids``, or (``every_active``) it holds tokens at all.
    Sessions of those agents that are not certificate-bound (Local Profile) are reported in
    ``unbound`` and left alone. Revoking blacklists their tokens and refresh tokens at once.
    """
    sweep = SessionSweep()
    if not paths.auth_db.exists():
        return sweep
    from gateway.cli.guard import open_auth

    agents, jk, x5 = set(agent_ids), set(jkts), set(x5ts)
    auth = open_auth(paths, load_section(GuardConfig, "guard", file=paths.config_file))
    try:
        auth.expire_due()
        rows = auth.db.execute(
            "SELECT session_id, agent_id, status, grant_options FROM sessions "
            "WHERE status IN ('created', 'active') ORDER BY created_at"
        ).fetchall()
        for r in rows:
            options: dict[str, Any] = json.loads(r["grant_options"]) if r["grant_options"] else {}
            cnf = options.get("cnf") if isinstance(options.get("cnf"), dict) else None
            bound = cnf is not None and (cnf.get("jkt") in jk or cnf.get("x5t#S256") in x5)
            if bound or (every_active and r["status"] == "active") or (cnf is not None and r["agent_id"] in agents):
                sweep.matched.append((r["session_id"], r["agent_id"]))
            elif r["agent_id"] in agents:
                sweep.unbound.append((r["session_id"], r["agent_id"]))
        if not keep:
            for sid, _ in sweep.matched:
                auth.revoke(sid, reason=reason)
    finally:
        auth.close_db()
        auth.audit.close()
    return sweep


def _rotate(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    cfg = load_section(GuardConfig, "guard", file=paths.config_file)
    lifetime = max(cfg.token_lifetime_seconds, cfg.refresh_lifetime_seconds)
    before = set(keys.load_public_keys(paths))
    with userlog.change(paths) as event:
        kid = keys.rotate(paths, max_token_lifetime=lifetime, revoke_old=args.revoke_old)
        event.action, event.detail = "key_rotated", f"new kid {kid}"
        event.reason = "the user rotated the token signing key" + (
            " and revoked the old keys" if args.revoke_old else ""
        )
    from gateway.reloads import notify_running

    told = notify_running(paths)  # the running guard and gateway reload the keys now
    print(f"new signing key {kid}")
    if not args.revoke_old:
        print(
            f"old public keys stay trusted (retired) for {lifetime} s so live tokens keep working; "
            "'uomp keys rotate --revoke-old' distrusts them at once"
        )
        print(
            "the running guard and gateway of this home were told to pick the new key up"
            if told
            else "no running guard or gateway of this home was found to tell (one not found notices the key files "
            "within its fallback look, 30 s by default)"
        )
        return 0
    print(
        f"REVOKED: {', '.join(sorted(before))}; every token they signed is refused "
        + (
            "by the running guard and gateway at once (told to reload)"
            if told
            else "by a guard or gateway of this home when it starts, or within its fallback look (30 s by default)"
        )
    )
    sweep = revoke_sessions(
        paths,
        reason="signing key revoked ('uomp keys rotate --revoke-old')",
        every_active=True,
        keep=args.keep_sessions,
    )
    verb = "left active (--keep-sessions), though their tokens no longer work" if args.keep_sessions else "revoked"
    print(f"{len(sweep.matched)} active session(s) held only tokens signed by the revoked keys: {verb}")
    for sid, agent in sweep.matched:
        print(f"  {sid}  {agent}")
    if sweep.matched:
        print("authorize those agents again ('uomp authorize') to give them new tokens")
    return 0


# Other areas (the CA) add steps to ``uomp init`` here: callables Paths -> {what: created?}.
INIT_HOOKS: list = []  # type: ignore[type-arg]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp init`` to the command line."""
    p = sub.add_parser("init", help="create the data directory, signing key, admin credential and CA")
    p.add_argument(
        "--hostname",
        action="append",
        default=[],
        metavar="HOST|URL",
        help="the name (or https:// URL) agents use to reach this gateway, e.g. my-box.example "
        "(port: the listen port) or https://my-box.example:9443; repeatable. Recorded once for the "
        "gateway certificate, the accepted endpoints and authorize's default --gateway-url",
    )
    p.set_defaults(func=_init)
    k = sub.add_parser("keys", help="Auth Service signing keys")
    ksub = k.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    r = ksub.add_parser(
        "rotate",
        help="make a new signing key, keep old public keys until their tokens expire "
        "(or, with --revoke-old, distrust them at once)",
    )
    r.add_argument(
        "--revoke-old",
        action="store_true",
        help="revoke every earlier signing key now: tokens they signed stop working at once, and the "
        "sessions holding them are revoked (their agents must be authorized again)",
    )
    r.add_argument(
        "--keep-sessions",
        action="store_true",
        help="with --revoke-old: leave those sessions marked active (their tokens still fail)",
    )
    r.set_defaults(func=_rotate)
