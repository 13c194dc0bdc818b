"""The seal/unseal journal: a change of the home's key files is staged, committed by one rename,
then applied move by move; :func:`recover` finishes a committed one and removes a staged one, so a
crash at any point leaves the old files or the new ones. Free of the unlocked-key state
(:mod:`gateway.atrest.vault` calls :func:`recover` before it reads a home)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
def locked(paths: Paths) -> Iterator[None]:
    """The home's seal/unseal lock (re-entrant within this process)."""
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


def allowed_destinations(paths: Paths) -> dict[str, Path]:
    """The only files a journal may replace or delete: the sealed key files and the master slot."""
    out = {role: f for f, role in sealed_files(paths)}
    out[SLOT_DST] = paths.master_slot
    return out


def write_synced(path: Path, data: bytes) -> None:
    """A new private file with ``data``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def pending(paths: Paths) -> bool:
    """Whether a committed journal or a staged change waits in the secrets directory."""
    try:
        names = os.listdir(paths.secrets)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any(n == paths.atrest_journal.name or n.startswith(STAGE_PREFIX) for n in names)


def recover(paths: Paths) -> None:
    """Finish a committed seal / unseal, remove a prepared one (see the module docstring)."""
    if not pending(paths):
        return
    with locked(paths):
        if paths.atrest_journal.exists():
            apply(paths, paths.atrest_journal)
        for name in os.listdir(paths.secrets):
            if name.startswith(STAGE_PREFIX):
                shutil.rmtree(paths.secrets / name, ignore_errors=True)
        fsync_dir(paths.secrets)


def read_plan(journal: Path) -> list[dict[str, Any]]:
    """A committed journal's moves; KEY_ERROR for an unreadable or oversized plan."""
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


def apply(paths: Paths, journal: Path) -> None:
    """Carries out a committed journal's moves (each idempotent), then removes it."""
    allowed = allowed_destinations(paths)
    ops = read_plan(journal)
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


def sealed_files(paths: Paths) -> list[tuple[Path, str]]:
    """Every key file that a sealed home keeps sealed, with its role (its place in the home)."""
    files = [
        paths.private_jwk,
        paths.audit_key,
        paths.payload_private_key,
        paths.ca_key,
        paths.gateway_key,
        paths.admin_credential,
        paths.items_key,  # gateway.atrest.itemseal's root
    ]
    return [(f, f"{f.parent.name}/{f.name}") for f in files]
