"""``bench_payload.py --stream-cpu`` drives the relay's upload loop itself (``PayloadService._stream``
on a real TLS 1.3 listener, into a real payload store), so a change to that loop's
signature breaks the benchmark, not the product: run it small, and see it fail loudly when the
loop fails."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchkit import run_bench


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_bench("bench_payload.py", *args, env=env, timeout=120)


def test_the_upload_loop_alone_runs_and_reports_its_cpu() -> None:
    out = _run("--stream-cpu", "4", "--rounds", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.strip().startswith("this tree"))
    assert "CPU" in line and "MiB/s" in line


def test_a_failing_upload_loop_fails_the_benchmark(tmp_path: Path) -> None:
    """A baseline tree whose upload loop raises: the script names it and exits non-zero instead of
    printing figures for rounds that never ran."""
    broken = tmp_path / "tree" / "gateway" / "remote"
    broken.mkdir(parents=True)
    (broken / "payload_service.py").write_text(
        "class PayloadService:\n"
        "    async def _stream(self, request, upload):\n"
        "        raise RuntimeError('broken upload loop')\n"
    )
    out = _run("--stream-cpu", "4", "--rounds", "1", "--baseline", str(tmp_path / "tree"))
    assert out.returncode != 0
    assert "broken upload loop" in out.stderr + out.stdout
