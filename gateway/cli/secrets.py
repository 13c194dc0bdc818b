"""``uomp secrets seal | unseal | status``: the home's private keys sealed at rest (gateway/atrest/).

``seal`` puts every private key of the home (token signing key, audit key, payload key, CA key,
gateway TLS key, admin credential) under one new master key, itself sealed by a passphrase (Argon2id) or kept in the
OS keychain (``--keyring``). From then on every command and the appliance unlock it at start: from
the terminal, ``UOMP_PASSPHRASE_FILE``, a systemd credential or the keychain. ``unseal`` puts the
keys back in plaintext. Both are atomic: a crash at any point leaves the old state or the new one.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from pathlib import Path

from gateway import appliance
from gateway.atrest import auditdb, journal, memdb, migrate, vault, writers
from gateway.cli.main import paths_from
from gateway.config import Paths, resolve_home
from gateway.errors import ErrorCode, UompError
from gateway.keys import check_home
from gateway.netutil import socket_is_live


def _refuse_running(paths: Paths) -> None:
    """ALREADY_RUNNING while the appliance, or a guard on its own (``uomp guard serve``, which holds
    no appliance lock), serves this home: both keep memory.db and audit.db open."""
    if appliance.is_running(paths):
        raise UompError(
            ErrorCode.ALREADY_RUNNING,
            f"the appliance is running on {paths.home}; stop it first ('uomp gateway stop'), then run this again",
        )
    if socket_is_live(paths.guard_sock):
        raise UompError(
            ErrorCode.ALREADY_RUNNING,
            f"a guard is serving {paths.home} (its socket answers); stop it first, then run this again",
        )


def _new_passphrase(args: argparse.Namespace) -> bytes:
    source = args.passphrase_file or os.environ.get(vault.PASSPHRASE_FILE_ENV)
    if source:
        return vault.read_passphrase_file(Path(source))
    if not sys.stdin.isatty():
        raise UompError(
            ErrorCode.USAGE,
            "no passphrase: run this in a terminal, or give --passphrase-file FILE (or set UOMP_PASSPHRASE_FILE)",
        )
    first = getpass.getpass("new passphrase for the keys: ")
    if getpass.getpass("the same passphrase again: ") != first:
        raise UompError(ErrorCode.USAGE, "the two passphrases differ; nothing was changed, run it again")
    return first.encode()


def _seal(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    _refuse_running(paths)
    passphrase = None if args.keyring else _new_passphrase(args)  # asked before the lock: no tool waits on it
    with writers.sealing(paths):  # no tool writes memory.db or audit.db until both are converted
        if passphrase is None:
            master = migrate.seal(paths, keyring=True)
            how = f"the OS keychain ({migrate.keyring_backend_name()})"
        else:
            master = migrate.seal(paths, passphrase=passphrase)
            how = "your passphrase (Argon2id)"
        if memdb.ensure_encrypted(paths, memdb.memory_key(paths)):
            print(f"encrypted: {paths.memory_db} (SQLCipher, a key derived from the master key)")
        if auditdb.ensure_encrypted(paths, auditdb.audit_key(paths)):
            print(f"encrypted: {paths.audit_db} (SQLCipher, its own key derived from the master key)")
    files = ", ".join(role for _f, role in migrate.present_key_files(paths))
    print(f"sealed: {files}")
    print(f"master key {master.home_id} protected by {how}, in {paths.master_slot}")
    print("every command and 'uomp gateway start' now ask for it (terminal), or read UOMP_PASSPHRASE_FILE")
    print("back up master.json with the keys: without it (and the passphrase) the sealed keys cannot be opened")
    return 0


def _unseal(args: argparse.Namespace) -> int:
    if args.passphrase_file:
        os.environ[vault.PASSPHRASE_FILE_ENV] = args.passphrase_file
    paths = paths_from(args)
    _refuse_running(paths)
    if not vault.is_sealed_home(paths):
        raise UompError(ErrorCode.INVALID_STATE, f"the keys of {paths.home} are not sealed; nothing was changed")
    master = vault.master(paths)  # unlocked (a prompt, maybe) before the lock: no tool waits on it
    with writers.sealing(paths):  # no tool writes memory.db or audit.db while they are rewritten
        if memdb.ensure_plaintext(paths, memdb.memory_key(paths)):  # first: the keys still open it after a crash
            print(f"decrypted: {paths.memory_db} is a plain SQLite file again")
        if auditdb.ensure_plaintext(paths, auditdb.audit_key(paths)):
            print(f"decrypted: {paths.audit_db} is a plain SQLite file again")
        migrate.unseal(paths, master)
    print(f"unsealed: the keys of {paths.home} are plaintext files (0600) again; {paths.master_slot} removed")
    return 0


def _status(args: argparse.Namespace) -> int:
    paths = Paths(resolve_home(getattr(args, "home", None)))  # no unlock: it only reads the slot
    check_home(paths)
    journal.recover(paths)
    sealed = paths.master_slot.exists()
    doc: dict[str, object] = {"home": str(paths.home), "sealed": sealed}
    if sealed:
        slot = vault.read_slot(paths)
        doc.update({"method": slot["method"], "master_key_id": slot["id"]})
        doc["db_format"] = str(slot.get("db", memdb.LEGACY.name))  # memory.db's and audit.db's (memdb.PROFILES)
        if slot["method"] == "passphrase":
            kdf = slot["kdf"]
            assert isinstance(kdf, dict)
            doc["kdf"] = {k: v for k, v in kdf.items() if k != "salt"}
    files = [role for _f, role in migrate.present_key_files(paths)]
    doc["files"] = files
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    if sealed:
        print(f"sealed: the keys of {paths.home} ({', '.join(files)}) by {doc['method']}")
        print(f"databases: memory.db and audit.db in SQLCipher format {doc['db_format']}")
    else:
        print(f"not sealed: the keys of {paths.home} are plaintext files (0600); 'uomp secrets seal' protects them")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``uomp secrets`` to the command line."""
    p = sub.add_parser("secrets", help="seal the home's private keys at rest (passphrase or OS keychain)")
    s = p.add_subparsers(dest="secrets_command", metavar="SUBCOMMAND", required=True)
    seal = s.add_parser("seal", help="seal every private key under a master key protected by a passphrase")
    seal.add_argument("--passphrase-file", help="read the new passphrase from FILE (default: ask in the terminal)")
    seal.add_argument("--keyring", action="store_true", help="keep the master key in the OS keychain instead")
    seal.set_defaults(func=_seal)
    unseal = s.add_parser("unseal", help="put the private keys back as plaintext files")
    unseal.add_argument("--passphrase-file", help="read the passphrase from FILE (default: ask in the terminal)")
    unseal.set_defaults(func=_unseal)
    status = s.add_parser("status", help="whether the keys are sealed, and how")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_status)
