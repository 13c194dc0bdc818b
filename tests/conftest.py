"""Shared fixtures: a fresh data directory per test (real files, real keys)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import Paths
from gateway.keys import init_home


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
