"""``uomp trust add DID [--name NAME] | rm DID | list [--json]``: the publishers you vouch for (spec §16.4).

``uomp authorize`` calls a manifest's publisher by the name given here only when the manifest is
signed by a key in this list; any other signature is shown as a key you have never trusted.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from gateway import trust
from gateway.cli.main import paths_from
from gateway.errors import ErrorCode, UompError


def _add(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    name = args.name if args.name is not None else args.did
    entry, old = trust.add(paths, args.did, name)
    if old is entry:
        print(f"already trusted: {entry.id} as {entry.name!r}")
    elif old is not None:
        print(f"renamed: {entry.id} is now trusted as {entry.name!r} (was {old.name!r})")
    else:
        print(f"trusted: {entry.id} as {entry.name!r} (key fingerprint {entry.fingerprint})")
    return 0


def _add_ca(args: argparse.Namespace) -> int:
    from gateway.identity.x509pub import ca_entry

    try:
        with Path(args.file).open("rb") as fh:
            pem = fh.read(64 * 1024)
    except OSError as exc:
        raise UompError(ErrorCode.IO_ERROR, f"cannot read {args.file}: {exc.strerror}; give the CA's PEM file") from exc
    entry, old = trust.add_entry(paths_from(args), ca_entry(pem, args.name))
    state = "already trusted" if old is entry else "trusted"
    print(f"{state}: the CA {entry.fingerprint} as {entry.name!r}: code-signing certificates it issues verify")
    return 0


def _add_openpgp(args: argparse.Namespace) -> int:
    from gateway.identity.openpgp import MAX_KEY_BYTES, is_revoked, key_entry

    try:
        with Path(args.file).open("rb") as fh:
            armored = fh.read(MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise UompError(
            ErrorCode.IO_ERROR, f"cannot read {args.file}: {exc.strerror}; give the public key file"
        ) from exc
    entry, old = trust.add_entry(paths_from(args), key_entry(armored, args.name))
    state = "already trusted" if old is entry else "trusted"
    print(f"{state}: the OpenPGP key {entry.id} as {entry.name!r}")
    if is_revoked(entry):
        print("!! this key is REVOKED: manifests it signed no longer verify")
    return 0


def _rm(args: argparse.Namespace) -> int:
    gone = trust.remove(paths_from(args), args.did)
    print(f"no longer trusted: {gone.id} ({gone.name!r}); manifests it signs show as signed by an untrusted key")
    return 0


def _list(args: argparse.Namespace) -> int:
    current = trust.load(paths_from(args))
    if args.json:
        print(json.dumps({"entries": [asdict(e) for e in current.entries]}, indent=2, ensure_ascii=False))
        return 0
    if not current.entries:
        print(
            "your trust list is empty: no publisher is shown as trusted (add one with uomp trust add DID --name NAME)"
        )
        return 0
    for e in current.entries:
        print(f"{e.name}\n  {e.kind} {e.id}\n  fingerprint {e.fingerprint or '-'}, added {e.added_at} ({e.how})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp trust`` to the command line."""
    p = sub.add_parser("trust", help="the publisher identities you trust, by the names you give them (spec §16.4)")
    tsub = p.add_subparsers(dest="trust_command", metavar="ACTION", required=True)
    a = tsub.add_parser("add", help="trust a publisher DID (did:key or did:web) under a name of your choosing")
    a.add_argument("did", help="the publisher's DID, as the publisher advertises it (did:key:z6Mk…, did:web:…)")
    a.add_argument("--name", help="what to call this publisher (default: the DID itself)")
    a.set_defaults(func=_add)
    c = tsub.add_parser("add-ca", help="trust a CA: manifests signed by code-signing certificates it issues verify")
    c.add_argument("file", help="the CA certificate (PEM)")
    c.add_argument("--name", required=True, help="what to call publishers certified by this CA")
    c.set_defaults(func=_add_ca)
    g = tsub.add_parser("add-openpgp", help="trust an OpenPGP public key: manifests it signs verify")
    g.add_argument("file", help="the public key (gpg --export -a FINGERPRINT); adding it again updates it")
    g.add_argument("--name", required=True, help="what to call the publisher of this key")
    g.set_defaults(func=_add_openpgp)
    r = tsub.add_parser("rm", help="stop trusting a publisher key")
    r.add_argument("did", help="the DID to remove")
    r.set_defaults(func=_rm)
    ls = tsub.add_parser("list", help="show the trust list")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=_list)
