"""``bench_gateway_ab.py`` says whether its paired rounds tell the two trees apart: the sign test it
prints is computed right, and a small run prints it for each measure (two real appliances)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from benchkit import ROOT, run_bench

sys.path.insert(0, str(ROOT / "benchmarks"))
import _common  # (benchmarks/ is not a package: its directory is put on the path above)


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([1.1] * 9 + [0.9] * 3, (9, 12, 0.146)),  # 2 * (1 + 12 + 66 + 220) / 4096
        ([1.1] * 6 + [0.9] * 14, (6, 20, 0.115)),
        ([1.1] * 10, (10, 10, 0.002)),  # 2 / 1024
        ([0.9] * 10, (0, 10, 0.002)),  # the other way round: as uneven
        ([1.1, 0.9, 1.0, 1.0], (1, 2, 1.0)),  # ties count for neither side
        ([], (0, 0, 1.0)),
    ],
)
def test_the_sign_test_of_paired_rounds(ratios: list[float], expected: tuple[int, int, float]) -> None:
    k, n, p = _common.sign_test(ratios)
    assert (k, n) == expected[:2]
    assert p == pytest.approx(expected[2], abs=0.0005)


def test_the_verdict_follows_the_sign_test() -> None:
    near = _common.paired_line("req/s", [1.1] * 9 + [0.9] * 3, "this faster")
    assert "9 of 12 pairs" in near and "inside this run's spread" in near
    far = _common.paired_line("req/s", [1.1] * 10, "this faster")
    assert "10 of 10 pairs" in far and "told apart in this run" in far
    cost = _common.paired_line("guard CPU", [0.9] * 10, "this cheaper", ahead_below_one=True)
    assert "x0.90" in cost and "this cheaper in 10 of 10 pairs" in cost


def test_a_small_run_prints_its_paired_rounds(tmp_path: Path) -> None:
    out = run_bench("bench_gateway_ab.py", "--base", "plain", "--rounds", "2", "--duration", "0.5", timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    start = lines.index(next(x for x in lines if x.startswith("PAIRED ROUNDS")))
    paired = lines[start + 1 : start + 4]
    for what, ahead in (
        ("req/s", "faster"),
        ("gateway CPU per request", "cheaper"),
        ("guard CPU per request", "cheaper"),
    ):
        line = next(x for x in paired if x.strip().startswith(what))
        assert re.search(rf"this {ahead} in [0-2] of [0-2] pairs \(sign test p = [01]\.\d\d: ", line), line
