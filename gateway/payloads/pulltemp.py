"""Where ``uomp payload pull`` keeps plaintext before it is the output file, and how a crash's
leftovers are found and removed.

The plaintext is decrypted into an *anonymous* file (``O_TMPFILE``, 0600) in the ``--out``
directory: it has no name, so no one can open it, a sync client or a backup never sees it, and
when the process dies, however it dies (SIGKILL included), the kernel frees it and nothing of it is
left in the tree. Only once the whole payload authenticated and the opening is audited does it get
its name: ``linkat`` through ``/proc/self/fd`` onto ``--out``, which fails if ``--out`` exists (so
an existing file is never replaced without ``--force``; with ``--force`` it is linked to a
recognisable name first, then renamed over ``--out``).

Where the file system cannot make anonymous files (no ``O_TMPFILE``, or no ``/proc``), the file is
named ``.uomp-pull-<32 hex>.part`` (``O_EXCL``, 0600) in the ``--out`` directory, and before it is
created a journal ``$UOMP_HOME/payloads/pulls/<the same hex>.pull`` (0600, naming the part file)
is written and locked (``flock``) for as long as the pull runs. The pull removes both on every exit
it lives through (an error, SIGTERM, SIGINT, SIGHUP: see the CLI). After a SIGKILL the lock is
gone with the process: :func:`sweep`, run by every pull and by the guard at start-up, removes the
part file named by each journal whose lock is free, and the journal.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
from pathlib import Path

from gateway.config import Paths
from gateway.fsutil import ensure_private_dir, fsync_dir

PART_NAME = re.compile(r"\.uomp-pull-([0-9a-f]{32})\.part")
JOURNAL_SUFFIX = ".pull"
DRAFT_SUFFIX = ".new"
MAX_JOURNAL_BYTES = 8192
ANONYMOUS = True  # use O_TMPFILE where the file system has it (tests turn it off to try the fallback)
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT)


def journal_dir(paths: Paths) -> Path:
    """Where a pull without O_TMPFILE keeps its locked journal of named temporary files."""
    return paths.payload_dir / "pulls"


def _part_name(token: str) -> str:
    return f".uomp-pull-{token}.part"


class PlainFile:
    """The plaintext of one pull until :meth:`publish`; :meth:`discard` leaves nothing of it."""

    def __init__(self, paths: Paths, directory: Path) -> None:
        self.paths = paths
        self.directory = directory
        self.fd = -1
        self.named: Path | None = None  # the part file, when it has a name
        self.journal: Path | None = None
        self._journal_fd = -1
        if ANONYMOUS and hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
            try:
                self.fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600)
                return
            except OSError as exc:
                if exc.errno not in _NO_TMPFILE:
                    raise
        self.named = self._register()
        self.fd = os.open(self.named, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)

    def _register(self) -> Path:
        """A new part file's name, recorded (durably, and locked while this process lives) in a journal."""
        token = secrets.token_hex(16)
        part = self.directory.absolute() / _part_name(token)
        jdir = ensure_private_dir(journal_dir(self.paths), "payload pull journal")
        journal = jdir / f"{token}{JOURNAL_SUFFIX}"
        draft = jdir / f"{token}{DRAFT_SUFFIX}"  # locked and written before it is a journal (sweep)
        fd = os.open(draft, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps({"part": str(part)}).encode())
            os.fsync(fd)
            os.rename(draft, journal)
            fsync_dir(jdir)
        except BaseException:
            os.close(fd)
            for name in (draft, journal):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
            raise
        if self.journal is not None:  # a second name (publish with --force): the first is done with
            self._drop_journal()
        self.journal, self._journal_fd = journal, fd
        return part

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def sync(self) -> None:
        os.fsync(self.fd)

    def publish(self, out: Path, *, force: bool) -> None:
        """Give the plaintext the name ``out`` at once (never a partial file there). Without ``force``
        FileExistsError when ``out`` exists; with it ``out`` is replaced atomically."""
        if self.named is None:
            if not force:
                _link_anonymous(self.fd, out)  # EEXIST if out exists
                fsync_dir(out.parent)
                return
            self.named = self._register()
            _link_anonymous(self.fd, self.named)
        if force:
            os.replace(self.named, out)
        else:
            os.link(self.named, out)
            os.unlink(self.named)
        self.named = None
        fsync_dir(out.parent)

    def _drop_journal(self) -> None:
        if self.journal is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.journal)
            self.journal = None
        if self._journal_fd >= 0:
            os.close(self._journal_fd)  # the lock goes with it
            self._journal_fd = -1

    def discard(self) -> None:
        """Close and remove what is not published (idempotent)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        if self.named is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.named)
            self.named = None
        self._drop_journal()


def _link_anonymous(fd: int, dest: Path) -> None:
    """``linkat`` of an O_TMPFILE file onto ``dest`` through ``/proc/self/fd`` (AT_SYMLINK_FOLLOW:
    an explicit directory fd makes os.link use linkat rather than link)."""
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), dest, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def sweep(paths: Paths) -> int:
    """Remove the part files of pulls that died (their journal's lock is free), and their journals.
    A journal whose part file is not of the recognisable name, not a regular file or not this
    user's is only dropped, never followed. How many part files were removed."""
    jdir = journal_dir(paths)
    if not jdir.is_dir():
        return 0
    removed = 0
    for draft in jdir.glob(f"*{DRAFT_SUFFIX}"):  # died before it named a part file: nothing else to remove
        with contextlib.suppress(OSError), open(draft, "rb") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            os.unlink(draft)
    for journal in jdir.glob(f"*{JOURNAL_SUFFIX}"):
        try:
            fd = os.open(journal, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a pull in progress
            try:
                part = Path(json.loads(os.read(fd, MAX_JOURNAL_BYTES))["part"])
            except (ValueError, KeyError, TypeError):
                part = None
            token = journal.name[: -len(JOURNAL_SUFFIX)]
            if part is not None and (m := PART_NAME.fullmatch(part.name)) and m.group(1) == token:
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(part)
                    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                        os.unlink(part)
                        removed += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(journal)
        finally:
            os.close(fd)
    return removed
