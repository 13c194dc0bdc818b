"""Short temporary directories for the tests' homes, removed when the test session ends.

Unix socket paths are limited to 108 bytes, so homes that hold sockets live directly under /tmp
rather than under pytest's deep ``tmp_path``. They hold the tests' keys, tokens and memory values,
none of which may outlive the run: every such directory is made here, recorded, and removed by
``tests/conftest.py`` at the end of the session (a test that removes its own earlier loses nothing).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

PREFIX = "uomp-"  # every directory made here starts with it (the leftover check looks for it)
_made: list[Path] = []


def short_dir(prefix: str = PREFIX) -> Path:
    """A new empty directory ``/tmp/<prefix>XXXXXXXX``, removed at the end of the session."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"a short test directory's prefix starts with {PREFIX!r}: {prefix!r}")
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    _made.append(d)
    return d


def remove_all() -> None:
    """Remove every directory :func:`short_dir` made in this process."""
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)
