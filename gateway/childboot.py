"""The first code of the guard child of ``uomp gateway start`` (:mod:`gateway.supervisor` spawns it).

Kept apart from the supervisor on purpose: the child imports this module and then the ordinary CLI
(``uomp ... guard serve``), never the supervisor's own code (its health-check client is the
gateway's, :mod:`gateway.remote.upstream`), so the guard process holds none of the gateway's modules.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def die_with_parent(parent: int) -> bool:
    """Ask the kernel for SIGTERM when the parent dies, however it dies (Linux ``PR_SET_PDEATHSIG``;
    elsewhere a no-op). False if the parent is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    return os.getppid() == parent  # checked after: the parent may have died before the call


def guard_child_main(argv: list[str]) -> int:
    """Entry of the guard child process: ``argv`` = [parent pid, uomp arguments...]. SIGHUP (the
    parent forwards it to reload the keys) is ignored until the guard's own handler replaces it:
    one that comes while the child still imports must not kill it (its keys are read after)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if not die_with_parent(int(argv[0])):
        return 1
    from gateway.cli.main import main

    return main(argv[1:])
