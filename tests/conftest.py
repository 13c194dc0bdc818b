"""Shared fixtures: a fresh data directory per test (real files, real keys)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from shortdir import PREFIX, remove_all, short_dir

from gateway.config import Paths
from gateway.keys import init_home

# The dashboard of every appliance a test starts takes a free port, never the default 9380 that an
# appliance the user runs beside the suite holds (tests that need a fixed one set it themselves).
os.environ.setdefault("UOMP_DASHBOARD_PORT", "0")

_TMP = Path("/tmp")
_before: set[str] = set()


def _ours() -> set[str]:
    return {p.name for p in _TMP.glob(PREFIX + "*")}


def pytest_sessionstart(session: pytest.Session) -> None:
    _before.update(_ours())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The tests' short directories (their homes: keys, tokens, values) go with the session. Under CI,
    where nothing else writes /tmp, any ``/tmp/uomp-*`` made during the run and still there is a
    failure: it is a test (or an appliance it ran) that leaves secrets behind."""
    remove_all()
    left = sorted(_ours() - _before)
    if left:  # (outside CI another process may have made some of these meanwhile: said, not failed)
        print(f"\nleft behind in /tmp during this run: {', '.join(left[:20])}{' ...' if len(left) > 20 else ''}")
        if os.environ.get("CI"):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """``uomp`` commands run in-process (``gateway.cli.main.main``) point the root logger at the
    ``sys.stderr`` of the moment, which is a capture stream that closes with the test; put the
    root logger back, so that later tests do not log into a closed file."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Paths:
    """An initialised UOMP_HOME under a short path (Unix socket paths are limited to 108 bytes)."""
    short = short_dir("uomp-")
    paths = Paths(short)
    init_home(paths)
    monkeypatch.setenv("UOMP_HOME", str(short))
    yield paths
    import shutil

    shutil.rmtree(short, ignore_errors=True)
