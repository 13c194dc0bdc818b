"""``uomp init`` and ``uomp keys rotate``."""

from __future__ import annotations

import argparse

from gateway import keys
from gateway.cli.main import paths_from
from gateway.config import GuardConfig, load_section


def _init(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    made = keys.init_home(paths)
    for hook in INIT_HOOKS:
        made.update(hook(paths))
    print(f"data directory: {paths.home}")
    for what, new in made.items():
        print(f"  {what}: {'created' if new else 'kept'}")
    return 0


def _rotate(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    cfg = load_section(GuardConfig, "guard", file=paths.config_file)
    lifetime = max(cfg.token_lifetime_seconds, cfg.refresh_lifetime_seconds)
    kid = keys.rotate(paths, max_token_lifetime=lifetime)
    print(f"new signing key {kid}; old public keys stay trusted for {lifetime} s so live tokens keep working")
    print("a running guard and gateway pick the new key up on their next key reload (SIGHUP) or restart")
    return 0


# Other areas (the CA) add steps to ``uomp init`` here: callables Paths -> {what: created?}.
INIT_HOOKS: list = []  # type: ignore[type-arg]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("init", help="create the data directory, signing key, admin credential and CA")
    p.set_defaults(func=_init)
    k = sub.add_parser("keys", help="Auth Service signing keys")
    ksub = k.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    r = ksub.add_parser("rotate", help="make a new signing key, keep old public keys until their tokens expire")
    r.set_defaults(func=_rotate)
