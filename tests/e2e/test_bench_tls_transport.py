"""``bench_tls_transport.py`` builds its servers on the gateway's own TLS context and the SDK's client
context: a change to either breaks the benchmark, not the product. Run it small and see it report
both servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_tls_transport.py"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


def test_both_protocols_run_and_report() -> None:
    out = _run("--rounds", "1", "--requests", "30", "--clients", "2", "--mib", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    for kind in ("copying", "buffered"):
        line = next(x for x in lines if x.startswith(f"{kind:8s} (median)"))
        assert "round trips/s" in line and "per GiB" in line and "page faults" in line
    assert any(x.startswith("RATIOS buffered/copying: CPU per round trip") for x in lines)
