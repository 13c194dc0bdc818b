"""File-system helpers: private directories and atomic, durable writes.

A write is: temp file in the same directory (created with the final mode, so a secret is never
world-readable even for an instant), write, fsync, ``os.replace``, fsync the directory. A crash at
any point leaves either the old file or the new one, never a torn one.

Directories that hold keys or trust anchors (the data directory, ``.secrets``, ``ca/``) are checked
like ssh's ``StrictModes``: owned by the user running ``uomp`` and not writable by group or others,
else ``UNSAFE_PERMISSIONS`` with the fix. A directory someone else can write to could hold a planted
``jwks.json`` or CA certificate, so nothing in it is trusted. Missing directories (parents included)
are created 0700 whatever the umask.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from gateway.errors import ErrorCode, UompError


def _mkdirs_private(path: Path) -> bool:
    """Create ``path`` and every missing parent, each 0700 whatever the umask. True when ``path`` was made."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    made = False
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            made = False  # made by someone else in between: checked like any existing directory
            continue
        os.chmod(d, 0o700)  # the umask may have taken bits away; it never adds any, but be exact
        made = True
    return made


def check_private_dir(path: Path, what: str) -> None:
    """UNSAFE_PERMISSIONS unless ``path`` is a directory owned by this user and not group/other-writable."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UompError(
            ErrorCode.UNSAFE_PERMISSIONS,
            f"cannot inspect {what} {path}: {exc.strerror}; it must be a "
            "directory you own: choose another data directory with --home or UOMP_HOME",
        ) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise UompError(ErrorCode.UNSAFE_PERMISSIONS, f"{what} {path} is not a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise UompError(
            ErrorCode.UNSAFE_PERMISSIONS,
            f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {me}): whoever owns it could have "
            f"planted keys there. Move it aside and run 'uomp init' again, or, if you trust its contents, "
            f"'chown -R {me} {path}'",
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UompError(
            ErrorCode.UNSAFE_PERMISSIONS,
            f"{what} {path} is writable by group or others (mode {mode:o}): anyone who could write there "
            f"could have planted keys. Check its contents, then 'chmod 700 {path}'",
        )


def check_parents(path: Path) -> None:
    """UNSAFE_PERMISSIONS when a parent of ``path`` lets another user replace it.

    A parent must be owned by root or this user, and not writable by group/others unless it has
    the sticky bit (``/tmp``), where others can create entries but not rename ours.
    """
    me = os.geteuid()
    for parent in Path(path).absolute().parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue
        if st.st_uid not in (0, me):
            raise UompError(
                ErrorCode.UNSAFE_PERMISSIONS,
                f"{parent} (a parent of {path}) is owned by uid {st.st_uid}, who could replace the data "
                f"directory; move the data directory (--home, UOMP_HOME) under a directory only you or root "
                f"control, or 'chown {me} {parent}'",
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022 and not mode & stat.S_ISVTX:
            raise UompError(
                ErrorCode.UNSAFE_PERMISSIONS,
                f"{parent} (a parent of {path}) is writable by group or others without the sticky bit "
                f"(mode {mode:o}); 'chmod go-w {parent}' or move the data directory",
            )


def ensure_private_dir(path: Path, what: str = "directory") -> Path:
    """Create ``path`` (and missing parents) 0700; an existing one must pass :func:`check_private_dir`
    and is then tightened to 0700 (it is ours)."""
    path = Path(path)
    if not _mkdirs_private(path):
        check_private_dir(path, what)
        if stat.S_IMODE(os.stat(path).st_mode) != 0o700:
            os.chmod(path, 0o700)
    return path


def ensure_output_dir(path: Path, what: str = "output directory") -> Path:
    """A directory to write private files into, given by the user: created 0700 when missing; an
    existing one is used as it is (its mode is never changed) if it is the user's and not
    group/other-writable, else UNSAFE_PERMISSIONS."""
    path = Path(path)
    if not _mkdirs_private(path):
        check_private_dir(path, what)
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def create_private_file(path: Path, data: bytes) -> bool:
    """Write ``data`` to a new 0600 file at ``path`` unless one exists; True when this call made it.

    Temp file (0600, fsync) then ``os.link`` to the final name: atomic, and it refuses to replace a
    file another process made meanwhile (for keys that must never be regenerated under a reader).
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
            made = True
        except FileExistsError:
            made = False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(path.parent)
    return made


Stamp = tuple[int, int, int] | None  # (inode, mtime ns, size) of one file; None: missing or unreadable
Stamps = tuple[Stamp, ...]


def stamps(paths: Iterable[str | os.PathLike[str]]) -> Stamps:
    """One ``os.stat`` per file: (inode, mtime in ns, size), None for a file that cannot be stat'ed.

    Two results differ when any file was written, replaced (``os.replace`` gives a new inode even
    within one mtime tick), created or removed in between: what a watcher compares to decide
    whether to read the files again. Cheap (no file is opened): fine on an event loop."""
    out: list[Stamp] = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)
