"""Import benchmark: a generated 100,000-row CSV (and the same rows as JSON) into a fresh store.

Each import runs in a fresh child process. Prints wall-clock seconds, rows per second, the
tracemalloc peak (Python allocations, from a second, traced run because tracing slows everything
down), the peak RSS, and the ratios of the import time to a bare ``csv.reader`` pass and of the
memory peak to the file size, all measured in this one run. Nothing is asserted: numbers vary
with the machine.

Peak RSS is given twice: ``VmHWM`` (Linux ``/proc/self/status``: the high-water mark of the child's
own address space, which starts at exec) and ``ru_maxrss``. On Linux ``ru_maxrss`` survives fork and
exec, so a child's value is at least the parent's RSS when it was forked; the rows are therefore
generated lazily here (the parent stays small), and VmHWM is the figure to trust.

    .venv/bin/python benchmarks/bench_import.py [--rows N] [--keep DIR] [--only csv|json]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gateway.guard.importer import import_file
from gateway.guard.store import MemoryStore

TAGS = ["notes", "contacts", "finance", "health", "travel", "shopping"]


def make_rows(n: int) -> Iterator[list[str]]:
    """The same ``n`` rows on every call (fixed seed), made one at a time."""
    rnd = random.Random(1234)
    for i in range(n):
        amount = rnd.randint(1, 2_000_000) / 100
        yield [
            f"item-{i:06d}",
            f"{rnd.choice(TAGS)};{rnd.choice(TAGS)}",
            rnd.choice(("low", "medium", "high")),
            f"Title number {i}",
            f"${amount:,.2f}",
            str(rnd.randint(0, 500)),
            f"{rnd.randint(13, 28):02d}/{rnd.randint(1, 12):02d}/{rnd.randint(2000, 2026)}",
            "a free-text note with some words in it, " * rnd.randint(0, 3),
        ]


HEADER = ["key", "tags", "sensitivity", "value.title", "value.amount", "value.qty", "value.bought", "value.note"]


def write_csv(path: Path, rows: Iterator[list[str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(HEADER)
        w.writerows(rows)


def write_json(path: Path, rows: Iterator[list[str]]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        fh.write("[\n")
        for i, r in enumerate(rows):
            obj = {
                "key": r[0],
                "tags": r[1].split(";"),
                "sensitivity": r[2],
                "value": {"title": r[3], "amount": float(r[4][1:].replace(",", "")), "qty": int(r[5]), "note": r[7]},
            }
            fh.write(("," if i else "") + json.dumps(obj) + "\n")
        fh.write("]\n")


def bare_csv_pass(path: Path) -> float:
    t0 = time.perf_counter()
    with path.open(newline="", encoding="utf-8") as fh:
        for _ in csv.reader(fh):
            pass
    return time.perf_counter() - t0


def vm_hwm_kib() -> int | None:
    """Peak RSS of this process's own address space (Linux), in KiB; None elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def child(path: Path, db: Path, trace: bool) -> None:
    """One import in this (fresh) process; prints its figures as JSON."""
    with MemoryStore(db) as store:
        if trace:
            tracemalloc.start()
        t0 = time.perf_counter()
        report = import_file(store, path)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] if trace else 0
        tracemalloc.stop()
        assert store.count() == report.rows_written
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "rows": report.rows_written,
                "notices": report.notices,
                "tracemalloc_peak": peak,
                "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "vm_hwm_kib": vm_hwm_kib(),
            }
        )
    )


def run_child(path: Path, db: Path, trace: bool) -> dict[str, Any]:
    for p in db.parent.glob(db.name + "*"):
        p.unlink()
    argv = [sys.executable, __file__, "--child", str(path), str(db)] + (["--trace"] if trace else [])
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def baseline_rss() -> dict[str, Any]:
    """Peak RSS of a process that only imports the modules (to subtract the interpreter)."""
    code = (
        "import json, resource, sys, gateway.guard.importer, gateway.guard.store; "
        f"sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_import; "
        "print(json.dumps({'ru_maxrss_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
        "'vm_hwm_kib': bench_import.vm_hwm_kib()}))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def rss_text(figures: dict[str, Any], base: dict[str, Any]) -> str:
    mib = 1024
    out = []
    for name, label in (("vm_hwm_kib", "VmHWM"), ("ru_maxrss_kib", "ru_maxrss")):
        if figures.get(name) is None:
            continue
        extra = f" (+{(figures[name] - base[name]) / mib:.1f})" if base.get(name) is not None else ""
        out.append(f"{label} {figures[name] / mib:.1f} MiB{extra}")
    return ", ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--keep", help="write the files and stores here and keep them")
    ap.add_argument("--only", choices=("csv", "json"), help="run one format only")
    ap.add_argument("--child", nargs=2, metavar=("FILE", "DB"), help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), args.trace)
        return 0
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="uomp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        csv_path, json_path = work / "items.csv", work / "items.json"
        write_csv(csv_path, make_rows(args.rows))
        write_json(json_path, make_rows(args.rows))
        mib = 1024 * 1024
        print(
            f"rows: {args.rows}; CSV {csv_path.stat().st_size / mib:.1f} MiB, "
            f"JSON {json_path.stat().st_size / mib:.1f} MiB; python {sys.version.split()[0]}"
        )
        bare = bare_csv_pass(csv_path)
        base = baseline_rss()
        print(f"interpreter + modules alone: {rss_text(base, {})}")
        for label, path in (("csv", csv_path), ("json", json_path)):
            if args.only and label != args.only:
                continue
            timed = run_child(path, work / f"{label}.db", trace=False)
            traced = run_child(path, work / f"{label}.db", trace=True)
            secs = timed["seconds"]
            print(
                f"{label}: {timed['rows']} rows in {secs:.2f} s ({timed['rows'] / secs:,.0f} rows/s); "
                f"peak RSS {rss_text(timed, base)} (+ = over the bare interpreter); "
                f"tracemalloc peak {traced['tracemalloc_peak'] / mib:.1f} MiB "
                f"= {traced['tracemalloc_peak'] / path.stat().st_size:.1f}x the file"
            )
            if label == "csv":
                print(f"csv: import time / bare csv.reader pass = {secs / bare:.0f}x (bare pass {bare:.3f} s)")
                for n in timed["notices"]:
                    print(f"  note: {n}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
