"""The home's writers' lock: ``uomp secrets seal`` / ``unseal`` against the user's tools.

A seal or unseal rewrites ``memory.db`` and ``audit.db`` whole (a converted copy renamed over the
file, :func:`gateway.atrest.memdb.convert_file`): a connection opened before the rename still
writes the old file, and what it writes is lost. So every tool that opens either file to change it
(:func:`gateway.guard.stores.open_user_store`, :func:`gateway.cli.userlog.change`) holds this lock
shared from before it opens the file (and decides its key) until it closes it; the seal and the
unseal hold it exclusive for their whole run.

A tool that arrives during a seal waits for it (at most :data:`WAIT_SECONDS`, then STORE_BUSY); a
seal that finds a tool writing is refused at once (STORE_BUSY): it has nothing written yet, and
the user runs it again when the tool has finished. The lock is an ``flock`` on
``.secrets/.writers.lock``, taken once per process and home (re-entrant; a process that holds it
exclusive, the seal itself, is not stopped by its own shared uses).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from gateway.config import Paths
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import ensure_private_dir

LOCK_NAME = ".writers.lock"
WAIT_SECONDS = 30.0  # how long a writer waits for a seal or unseal to finish
POLL_SECONDS = 0.05

_mutex = threading.Lock()
_held: dict[str, list[int]] = {}  # home -> [fd, shared uses, exclusive uses]


def lock_path(paths: Paths) -> Path:
    """The lock file (beside the seal/unseal journal's lock)."""
    return paths.secrets / LOCK_NAME


def _open(paths: Paths) -> int:
    ensure_private_dir(paths.secrets, "secrets directory")
    return os.open(lock_path(paths), os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)


def _release(name: str, slot: int) -> None:
    with _mutex:
        entry = _held[name]
        entry[slot] -= 1
        if entry[1] == 0 and entry[2] == 0:
            del _held[name]
            os.close(entry[0])  # drops the flock


@contextlib.contextmanager
def writing(paths: Paths) -> Iterator[None]:
    """Held around a tool's change of memory.db or audit.db (shared with other tools)."""
    name = str(Path(os.path.abspath(paths.home)))
    with _mutex:
        entry = _held.get(name)
        if entry is not None:
            entry[1] += 1
    if entry is None:
        fd = _open(paths)
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise UompError(
                        ErrorCode.STORE_BUSY,
                        f"the keys of {paths.home} are being sealed or unsealed ('uomp secrets seal' or 'unseal' is "
                        "running); run this again when it has finished",
                    ) from None
                time.sleep(POLL_SECONDS)
        with _mutex:
            entry = _held.get(name)
            if entry is None:
                _held[name] = [fd, 1, 0]
            else:  # another thread of this process took it meanwhile
                entry[1] += 1
                os.close(fd)
    try:
        yield
    finally:
        _release(name, 1)


@contextlib.contextmanager
def sealing(paths: Paths) -> Iterator[None]:
    """Held by ``uomp secrets seal`` / ``unseal`` for their whole run: STORE_BUSY at once while a
    tool of another process writes memory.db or audit.db."""
    name = str(Path(os.path.abspath(paths.home)))
    with _mutex:
        if name in _held:
            raise UompError(
                ErrorCode.STORE_BUSY, "this process has the home's databases open; a seal must run on its own"
            )
        fd = _open(paths)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UompError(
                ErrorCode.STORE_BUSY,
                f"another uomp command is writing the memory store or audit log of {paths.home}; "
                "run this again when it has finished",
            ) from None
        _held[name] = [fd, 0, 1]
    try:
        yield
    finally:
        _release(name, 2)
