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
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gateway.atrest import sealing, vault
from gateway.atrest.sealing import MasterKey
from gateway.config import Paths
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import ensure_private_dir, fsync_dir

STAGE_PREFIX = ".atrest-stage-"
PLAN = "plan.json"
SLOT_DST = ".secrets/master.json"
MAX_PLAN_BYTES = 16 * 1024

_held = 0  # this process holds the lock (a second flock on another fd of the same file would wait for us)


@contextlib.contextmanager
def _locked(paths: Paths) -> Iterator[None]:
    global _held
    if _held:
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    ensure_private_dir(paths.secrets, "secrets directory")
    fd = os.open(paths.atrest_lock, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _held = 1
        try:
            yield
        finally:
            _held = 0
    finally:
        os.close(fd)


def _allowed_destinations(paths: Paths) -> dict[str, Path]:
    out = {role: f for f, role in vault.sealed_files(paths)}
    out[SLOT_DST] = paths.master_slot
    return out


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _pending(paths: Paths) -> bool:
    try:
        names = os.listdir(paths.secrets)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any(n == paths.atrest_journal.name or n.startswith(STAGE_PREFIX) for n in names)


def recover(paths: Paths) -> None:
    """Finish a committed seal / unseal, remove a prepared one (see the module docstring)."""
    if not _pending(paths):
        return
    with _locked(paths):
        if paths.atrest_journal.exists():
            _apply(paths, paths.atrest_journal)
        for name in os.listdir(paths.secrets):
            if name.startswith(STAGE_PREFIX):
                shutil.rmtree(paths.secrets / name, ignore_errors=True)
        fsync_dir(paths.secrets)


def _read_plan(journal: Path) -> list[dict[str, Any]]:
    try:
        with open(journal / PLAN, "rb") as fh:
            raw = fh.read(MAX_PLAN_BYTES + 1)
        doc = json.loads(raw)
        ops = doc["ops"] if isinstance(doc, dict) and len(raw) <= MAX_PLAN_BYTES else None
        if not isinstance(ops, list) or not all(isinstance(o, dict) for o in ops):
            raise ValueError("no list of moves")
        return ops
    except (OSError, ValueError, KeyError) as exc:
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"the committed seal/unseal journal {journal} is unreadable ({type(exc).__name__}); "
            "restore the home from a backup",
        ) from None


def _apply(paths: Paths, journal: Path) -> None:
    allowed = _allowed_destinations(paths)
    ops = _read_plan(journal)
    for op in ops:
        dst = allowed.get(str(op.get("dst")))
        if dst is None:
            raise UompError(ErrorCode.KEY_ERROR, f"the journal {journal} names a file it may not change")
    for i, op in enumerate(ops):
        dst = allowed[str(op["dst"])]
        if op.get("op") == "put":
            src = journal / str(op.get("src"))
            if src.parent != journal:
                raise UompError(ErrorCode.KEY_ERROR, f"the journal {journal} names a file outside it")
            with contextlib.suppress(FileNotFoundError):
                os.replace(src, dst)
        elif op.get("op") == "delete":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dst)
        else:
            raise UompError(ErrorCode.KEY_ERROR, f"the journal {journal} has an unknown move")
        fsync_dir(dst.parent)
        if i == 0:
            fault_point("atrest.apply")
    for name in os.listdir(journal):
        if name != PLAN:
            os.unlink(journal / name)
    os.unlink(journal / PLAN)
    os.rmdir(journal)
    fsync_dir(paths.secrets)


def _commit(paths: Paths, stage: Path, ops: list[dict[str, str]]) -> None:
    _write_synced(stage / PLAN, json.dumps({"ops": ops}).encode())
    fsync_dir(stage)
    fault_point("atrest.before_commit")
    os.rename(stage, paths.atrest_journal)
    fsync_dir(paths.secrets)
    fault_point("atrest.after_commit")
    _apply(paths, paths.atrest_journal)


def _new_stage(paths: Paths) -> Path:
    stage = paths.atrest_stage(sealing.random_tag())
    os.mkdir(stage, 0o700)
    return stage


def present_key_files(paths: Paths) -> list[tuple[Path, str]]:
    return [(f, role) for f, role in vault.sealed_files(paths) if f.exists()]


def seal(
    paths: Paths, *, passphrase: str | bytes | None = None, keyring: bool = False, kdf: dict[str, Any] | None = None
) -> MasterKey:
    """Seal every key file of the plain home ``paths`` under a new master key, itself sealed by
    ``passphrase`` or kept in the OS keychain (``keyring``). INVALID_STATE if already sealed.
    ``kdf``: Argon2id parameters (default :data:`gateway.atrest.sealing.DEFAULT_KDF`), within the
    bounds every slot is held to."""
    if (passphrase is None) == (not keyring):
        raise ValueError("a passphrase or the keychain, one of them")
    recover(paths)
    master = MasterKey.generate()
    slot = (
        sealing.wrap_with_passphrase(master, passphrase, kdf)
        if passphrase is not None
        else sealing.keyring_slot(master)
    )
    with _locked(paths):
        if paths.master_slot.exists():
            raise UompError(
                ErrorCode.INVALID_STATE, f"the keys of {paths.home} are sealed already; nothing was changed"
            )
        files = present_key_files(paths)
        if not files:
            raise UompError(ErrorCode.NOT_INITIALISED, f"{paths.home} holds no key to seal; run 'uomp init' first")
        plain = []
        for f, role in files:
            data = vault._read_bounded(f)
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
            _write_synced(stage / f"f{i}", sealing.seal_file(master, role, data))
            ops.append({"op": "put", "src": f"f{i}", "dst": role})
        _write_synced(stage / "slot", slot)
        ops.append({"op": "put", "src": "slot", "dst": SLOT_DST})
        _commit(paths, stage, ops)
    vault.remember(paths, master)
    return master


def unseal(paths: Paths, master: MasterKey) -> None:
    """Put every key file of the sealed home back in plaintext and remove the master key slot."""
    recover(paths)
    with _locked(paths):
        if not paths.master_slot.exists():
            raise UompError(ErrorCode.INVALID_STATE, f"the keys of {paths.home} are not sealed; nothing was changed")
        slot = vault.read_slot(paths)
        stage = _new_stage(paths)
        ops: list[dict[str, str]] = []
        try:
            for i, (f, role) in enumerate(present_key_files(paths)):
                _write_synced(stage / f"f{i}", sealing.open_file(master, role, vault._read_bounded(f), str(f)))
                ops.append({"op": "put", "src": f"f{i}", "dst": role})
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        ops.append({"op": "delete", "dst": SLOT_DST})
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
