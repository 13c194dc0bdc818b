"""Running a script of ``benchmarks/`` small, as a test: the benchmarks build on the product's own
pieces, so a change to those breaks them, not the product; a small run finds it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(
    script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script>`` with ``args`` in this interpreter, from the project's root."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
