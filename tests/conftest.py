"""Shared fixtures: a fresh data directory per test (real files, real keys)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import Paths
from gateway.keys import init_home

# The dashboard of every appliance a test starts takes a free port, never the default 9380 that an
# appliance the user runs beside the suite holds (tests that need a fixed one set it themselves).
os.environ.setdefault("UOMP_DASHBOARD_PORT", "0")


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
    import tempfile

    short = Path(tempfile.mkdtemp(prefix="uomp-", dir="/tmp"))
    paths = Paths(short)
    init_home(paths)
    monkeypatch.setenv("UOMP_HOME", str(short))
    yield paths
    import shutil

    shutil.rmtree(short, ignore_errors=True)
