"""``uomp backup create FILE [--to-recipient PUBKEY]`` / ``restore FILE [--identity ID] [--force]`` /
``verify FILE`` / ``keygen IDENTITY``: the whole home in one file encrypted to a passphrase or to an
X25519 recipient (gateway/atrest/backup.py), checked without restoring, restored only whole and verified."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path

from gateway import appliance
from gateway.atrest import auditdb, backup, recipient, vault
from gateway.cli.main import passphrase_prompt, paths_from
from gateway.config import Paths, resolve_home
from gateway.errors import ErrorCode, UompError
from gateway.keys import check_home
from gateway.ledger import auditkey, integrity
from gateway.ledger.verify import verify_log

PASSPHRASE_ENV = "UOMP_BACKUP_PASSPHRASE_FILE"


def _passphrase(args: argparse.Namespace, *, confirm: bool) -> bytes:
    source = args.passphrase_file or os.environ.get(PASSPHRASE_ENV)
    if source:
        return vault.read_passphrase_file(Path(source))
    if not sys.stdin.isatty():
        raise UompError(
            ErrorCode.USAGE,
            f"no backup passphrase: run this in a terminal, or give --passphrase-file FILE ({PASSPHRASE_ENV})",
        )
    first = getpass.getpass("backup passphrase: ")
    if confirm and getpass.getpass("the same passphrase again: ") != first:
        raise UompError(ErrorCode.USAGE, "the two passphrases differ; nothing was written")
    return first.encode()


def _create(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    out = Path(args.file).absolute()
    if out.exists():
        raise UompError(ErrorCode.IO_ERROR, f"{out} exists; choose a new file name (a backup never overwrites one)")
    if out.is_relative_to(paths.home.absolute()):
        raise UompError(ErrorCode.USAGE, f"{out} is inside the data directory; write the backup elsewhere")
    if args.to_recipient:
        manifest = backup.create(paths, out, to=recipient.parse_recipient(args.to_recipient))
    else:
        manifest = backup.create(paths, out, _passphrase(args, confirm=True))
    size = sum(f["size"] for f in manifest["files"])
    print(
        f"backup: {out} ({len(manifest['files'])} files, {size} bytes before encryption; keys "
        f"{'sealed' if manifest['sealed'] else 'plaintext'} inside)"
    )
    print(f"check it with: uomp backup verify {out}")
    return 0


def _secret(args: argparse.Namespace) -> dict[str, object]:
    """The keyword arguments that open a backup: the identity file given, else the passphrase."""
    if getattr(args, "identity", None):
        return {"identity": recipient.load_identity(Path(args.identity))}
    return {"passphrase": _passphrase(args, confirm=False)}


def _verify(args: argparse.Namespace) -> int:
    manifest = backup.verify(Path(args.file), **_secret(args))  # type: ignore[arg-type]
    size = sum(f["size"] for f in manifest["files"])
    print(f"backup verified: {args.file} ({len(manifest['files'])} files, {size} bytes, every chunk and hash checked)")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    path = Path(args.identity)
    if path.exists():
        raise UompError(ErrorCode.IO_ERROR, f"{path} exists; choose a new file name (an identity is never overwritten)")
    print(recipient.recipient_text(recipient.new_identity(path)))
    print(f"identity written to {path} (0600): keep it apart from the backups; restore with --identity {path}")
    return 0


def verify_restored(paths: Paths) -> str:
    """The restored audit log against its own witness record (as ``uomp audit verify``)."""
    key = auditkey.load(paths)
    origin = auditkey.origin_for(key.public_key())
    witness = integrity.read_witness(paths.audit_witness, origin=origin, public_key=key.public_key())
    if not paths.audit_db.exists():
        return "no audit log in the backup"
    conn = auditdb.connect(paths.audit_db, readonly=True)
    try:
        report = verify_log(
            conn, origin=origin, public_key=key.public_key(), trusted=[witness.trusted()] if witness else []
        )
    finally:
        conn.close()
    if not report.ok:
        raise UompError(
            ErrorCode.AUDIT_LOG_DAMAGED,
            f"the restored audit log does not verify ({'; '.join(report.problems)[:300]}); use another backup",
        )
    return f"audit log verified: {report.events} events, {report.checkpoints} checkpoints" + (
        ", consistent with its witness record" if witness else ""
    )


def _restore(args: argparse.Namespace) -> int:
    paths = Paths(resolve_home(getattr(args, "home", None)))
    if paths.home.exists():
        check_home(paths)
        if appliance.is_running(paths):
            raise UompError(ErrorCode.ALREADY_RUNNING, f"the appliance is running on {paths.home}; stop it first")
    manifest = backup.restore(Path(args.file), paths.home, force=args.force, **_secret(args))  # type: ignore[arg-type]
    vault.set_prompt(passphrase_prompt(paths))  # a sealed home's keys, to verify its audit log
    print(f"restored: {len(manifest['files'])} files into {paths.home}, every hash checked")
    if manifest.get("moved_aside"):
        print(f"the data directory that was there is now {manifest['moved_aside']}")
    print(verify_restored(paths))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``uomp backup`` to the command line."""
    p = sub.add_parser("backup", help="the whole home in one encrypted file, and back")
    s = p.add_subparsers(dest="backup_command", metavar="SUBCOMMAND", required=True)
    c = s.add_parser("create", help="write an encrypted, consistent backup of the home (while it runs, too)")
    c.add_argument("file")
    c.add_argument("--passphrase-file", help=f"the backup passphrase from FILE (or {PASSPHRASE_ENV}; default: ask)")
    c.add_argument("--to-recipient", metavar="PUBKEY", help="encrypt to this public key ('uomp backup keygen')")
    c.set_defaults(func=_create)
    r = s.add_parser("restore", help="restore a backup into an empty data directory, checked and verified")
    r.add_argument("file")
    r.add_argument("--passphrase-file", help=f"the backup passphrase from FILE (or {PASSPHRASE_ENV}; default: ask)")
    r.add_argument("--force", action="store_true", help="move a non-empty data directory aside first")
    r.add_argument("--identity", metavar="FILE", help="the identity file of the backup's recipient")
    r.set_defaults(func=_restore)
    v = s.add_parser("verify", help="check every chunk and hash of a backup without restoring (exit 1 on damage)")
    v.add_argument("file")
    v.add_argument("--passphrase-file", help=f"the backup passphrase from FILE (or {PASSPHRASE_ENV}; default: ask)")
    v.add_argument("--identity", metavar="FILE", help="the identity file of the backup's recipient")
    v.set_defaults(func=_verify)
    k = s.add_parser("keygen", help="make an X25519 identity file for backups; prints its public key")
    k.add_argument("identity")
    k.set_defaults(func=_keygen)
