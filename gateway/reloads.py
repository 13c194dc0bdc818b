"""Telling the running processes of a home that files they hold in memory changed.

A command that changes the signing keys (``uomp keys rotate``), the CRL or the CA registry
(``uomp agent revoke``, an enrollment's clean-up) calls :func:`notify_running` after its files are
written. The running processes reload at once instead of at their next fallback look at the files
(the guard's key watch, :data:`gateway.keys.KEY_WATCH_FALLBACK_SECONDS`; the gateway's TLS watch,
``tls_watch_interval_seconds``), which stays for a file changed by hand:

* the appliance (``uomp gateway start`` / ``serve``): SIGHUP to the pid its run file names, read
  only while it holds the appliance lock (a run file left by a killed appliance names no live
  holder). Its handler reloads the gateway's certificates, CRL and keys and forwards the signal to
  its guard child; it is installed before the run file is written, so the signal never reaches a
  process that would die of it;
* a guard serving on its own (``uomp guard serve``): SIGHUP to the process listening on
  ``guard.sock``, found with ``SO_PEERCRED`` (Linux), only when it runs as this user and is not the
  appliance's own child (that one heard it from its parent), nor this process (a guard served in
  the caller's own event loop reloads by its own means). The guard installs its handler before it
  creates the socket.

Best effort by design: no process running, another user's process, or a platform without
``SO_PEERCRED`` is no error (the fallback looks still reload within their period). A process is
signalled only when it catches SIGHUP (:func:`handles_sighup`): a guard embedded in a process
that does not (a test's) is left to its fallback look.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
from pathlib import Path

from gateway import appliance
from gateway.config import Paths

CONNECT_TIMEOUT_SECONDS = 1.0


def socket_owner(path: Path) -> int | None:
    """The pid of the process listening on the Unix socket ``path`` when it runs as this user, else None."""
    so_peercred = getattr(socket, "SO_PEERCRED", None)
    if so_peercred is None:
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(CONNECT_TIMEOUT_SECONDS)
        s.connect(os.fspath(path))
        pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, so_peercred, struct.calcsize("3i")))
    except OSError:
        return None
    finally:
        s.close()
    return pid if pid > 1 and uid == os.getuid() else None


def parent_of(pid: int) -> int | None:
    """``pid``'s parent pid (Linux ``/proc``), None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        return int(stat[stat.rindex(")") + 2 :].split()[1])
    except (ValueError, IndexError):
        return None


def handles_sighup(pid: int) -> bool:
    """True when ``pid`` catches SIGHUP (Linux ``/proc/PID/status`` ``SigCgt``): only such a process
    is signalled, never one whose default action would end it (a test's process serving a guard,
    a program embedding one)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            try:
                return bool(int(line.split()[1], 16) >> (signal.SIGHUP - 1) & 1)
            except (ValueError, IndexError):
                return False
    return False


def _hup(pid: int) -> bool:
    if not handles_sighup(pid):
        return False
    try:
        os.kill(pid, signal.SIGHUP)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def notify_running(paths: Paths) -> list[int]:
    """SIGHUP the appliance and a guard serving on its own for this home (see the module
    docstring); the pids signalled."""
    done: list[int] = []
    app: int | None = None
    if appliance.is_running(paths):
        pid = (appliance.read_run(paths) or {}).get("pid")
        if isinstance(pid, int) and pid > 1:
            app = pid
            if _hup(pid):
                done.append(pid)
    with contextlib.suppress(OSError):
        if not paths.guard_sock.exists():
            return done
    guard = socket_owner(paths.guard_sock)
    if (
        guard is not None
        and guard not in (app, os.getpid())
        and (app is None or parent_of(guard) != app)
        and _hup(guard)
    ):
        done.append(guard)
    return done
