"""``bench_tls_transport.py`` builds its servers on the gateway's own TLS context and the SDK's client
context: a change to either breaks the benchmark, not the product. Run it small and see it report
both servers."""

from __future__ import annotations

from benchkit import run_bench


def test_both_protocols_run_and_report() -> None:
    out = run_bench("bench_tls_transport.py", "--rounds", "1", "--requests", "30", "--clients", "2", "--mib", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    for kind in ("copying", "buffered"):
        line = next(x for x in lines if x.startswith(f"{kind:8s} (median)"))
        assert "round trips/s" in line and "per GiB" in line and "page faults" in line
    assert any(x.startswith("RATIOS buffered/copying: CPU per round trip") for x in lines)
