"""``uomp secrets seal`` / ``unseal``: every key file of a home changes form at once, or none does.

One journal, like a database's:

1. *prepare*: under ``.secrets/.atrest.lock``, every new file (each key file sealed, or opened,
   and the new ``master.json`` for a seal) is written and fsynced into a fresh
   ``.secrets/.atrest-stage-<tag>/`` with ``plan.json``, the list of moves to make;
2. *commit*: that directory is renamed ``.secrets/.atrest-journal`` (one ``rename``, then the
   directory is fsynced): from here on the change happens;
3. *apply*: each move is an ``os.replace`` onto its key file (the slot last for a seal; its
   removal last for an unseal), then the journal is removed.

A crash before 2 leaves the old files untouched and a stage that the next process removes; a crash
after it leaves a journal that the next process that opens the home (:func:`recover`, run before
any key is read) applies to the end. Applying is idempotent: a move whose source is gone was made.
A seal's stage holds sealed files only; an unseal's holds the plaintext it is about to put back,
and is removed if it is not committed.

Not undone: the plaintext key files a seal replaces are unlinked, not overwritten; their blocks
(and any copy made before, e.g. by a backup tool) may still be readable from the disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from gateway.atrest import journal, memdb, sealing, vault
from gateway.atrest.sealing import MasterKey
from gateway.config import Paths
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import fsync_dir


def _commit(paths: Paths, stage: Path, ops: list[dict[str, str]]) -> None:
    journal.write_synced(stage / journal.PLAN, json.dumps({"ops": ops}).encode())
    fsync_dir(stage)
    fault_point("atrest.before_commit")
    os.rename(stage, paths.atrest_journal)
    fsync_dir(paths.secrets)
    fault_point("atrest.after_commit")
    journal.apply(paths, paths.atrest_journal)


def _new_stage(paths: Paths) -> Path:
    stage = paths.atrest_stage(sealing.random_tag())
    os.mkdir(stage, 0o700)
    return stage


def present_key_files(paths: Paths) -> list[tuple[Path, str]]:
    """The home's key files that exist, with the role each is sealed under."""
    return [(f, role) for f, role in journal.sealed_files(paths) if f.exists()]


def seal(
    paths: Paths,
    *,
    passphrase: str | bytes | None = None,
    keyring: bool = False,
    kdf: dict[str, Any] | None = None,
    profile: memdb.Profile = memdb.CURRENT,
) -> MasterKey:
    """Seal every key file of the plain home ``paths`` under a new master key, itself sealed by
    ``passphrase`` or kept in the OS keychain (``keyring``). INVALID_STATE if already sealed.
    ``kdf``: Argon2id parameters (default :data:`gateway.atrest.sealing.DEFAULT_KDF`), within the
    bounds every slot is held to. ``profile``: the format the home's databases will be encrypted in,
    recorded in the slot (:data:`gateway.atrest.memdb.LEGACY`: no record, a home as sealed before
    formats were recorded)."""
    if (passphrase is None) == (not keyring):
        raise ValueError("a passphrase or the keychain, one of them")
    journal.recover(paths)
    master = MasterKey.generate()
    db = None if profile == memdb.LEGACY else profile.name
    slot = (
        sealing.wrap_with_passphrase(master, passphrase, kdf, db=db)
        if passphrase is not None
        else sealing.keyring_slot(master, db=db)
    )
    with journal.locked(paths):
        if paths.master_slot.exists():
            raise UompError(
                ErrorCode.INVALID_STATE, f"the keys of {paths.home} are sealed already; nothing was changed"
            )
        files = present_key_files(paths)
        if not files:
            raise UompError(ErrorCode.NOT_INITIALISED, f"{paths.home} holds no key to seal; run 'uomp init' first")
        plain = []
        for f, role in files:
            data = vault.read_bounded(f)
            if sealing.is_sealed(data):
                raise UompError(
                    ErrorCode.KEY_ERROR, f"{f} is sealed but {paths.master_slot} is missing; restore it from a backup"
                )
            plain.append((f, role, data))
        if keyring:
            _keyring_store(master)
        stage = _new_stage(paths)
        ops: list[dict[str, str]] = []
        for i, (_f, role, data) in enumerate(plain):
            journal.write_synced(stage / f"f{i}", sealing.seal_file(master, role, data))
            ops.append({"op": "put", "src": f"f{i}", "dst": role})
        journal.write_synced(stage / "slot", slot)
        ops.append({"op": "put", "src": "slot", "dst": journal.SLOT_DST})
        _commit(paths, stage, ops)
    vault.remember(paths, master)
    return master


def unseal(paths: Paths, master: MasterKey) -> None:
    """Put every key file of the sealed home back in plaintext and remove the master key slot."""
    journal.recover(paths)
    with journal.locked(paths):
        if not paths.master_slot.exists():
            raise UompError(ErrorCode.INVALID_STATE, f"the keys of {paths.home} are not sealed; nothing was changed")
        slot = vault.read_slot(paths)
        stage = _new_stage(paths)
        ops: list[dict[str, str]] = []
        try:
            for i, (f, role) in enumerate(present_key_files(paths)):
                journal.write_synced(stage / f"f{i}", sealing.open_file(master, role, vault.read_bounded(f), str(f)))
                ops.append({"op": "put", "src": f"f{i}", "dst": role})
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        ops.append({"op": "delete", "dst": journal.SLOT_DST})
        _commit(paths, stage, ops)
    vault.forget(paths)
    if slot["method"] == "keyring":
        with contextlib.suppress(Exception):
            import keyring as kr

            kr.delete_password(str(slot["service"]), str(slot["id"]))


def _keyring_store(master: MasterKey) -> None:
    try:
        import keyring as kr
        from keyring.errors import KeyringError
    except ImportError:
        raise UompError(
            ErrorCode.CONFIG_ERROR, "the keyring package is not installed; pip install 'uomp-gateway[keychain]'"
        ) from None
    name = keyring_backend_name()
    if name is None:
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            "no OS keychain here (keyring finds only backends that keep secrets in plain files, or none); "
            "seal with a passphrase instead, or name a backend you trust in PYTHON_KEYRING_BACKEND",
        )
    try:
        kr.set_password(sealing.KEYRING_SERVICE, master.home_id, master.key.hex())
        if kr.get_password(sealing.KEYRING_SERVICE, master.home_id) != master.key.hex():
            raise UompError(ErrorCode.CONFIG_ERROR, "the OS keychain did not keep the key; seal with a passphrase")
    except KeyringError as exc:
        raise UompError(
            ErrorCode.CONFIG_ERROR, f"the OS keychain refused the key ({type(exc).__name__}); seal with a passphrase"
        ) from None


# keyring backends that keep nothing (fail, null) or keep secrets in a file of their own
# (keyrings.alt): never chosen by default; a user who wants one names it in PYTHON_KEYRING_BACKEND.
_NOT_A_KEYCHAIN = ("keyring.backends.fail", "keyring.backends.null", "keyrings.alt")


def keyring_backend_name() -> str | None:
    """The keychain ``keyring`` would write to (``module.Class``); None when, without
    ``PYTHON_KEYRING_BACKEND``, any backend it would try is not a keychain (or there is none)."""
    import keyring as kr

    backend = kr.get_keyring()
    members = list(getattr(backend, "backends", [backend]))
    if not members:
        return None
    if not os.environ.get("PYTHON_KEYRING_BACKEND") and any(
        type(b).__module__.startswith(_NOT_A_KEYCHAIN) for b in members
    ):
        return None
    return f"{type(members[0]).__module__}.{type(members[0]).__name__}"
