"""The allocation sites that grew most between two snapshots of one process (gateway/memtrace.py).

    .venv/bin/python benchmarks/memtrace_diff.py BEFORE.snap AFTER.snap [--top 25] [--key lineno|filename|traceback]

With ``--native DIR``: also the process's VmRSS, traced bytes, SQLite's and glibc's counts at each
snapshot (the ``<role>-<pid>.jsonl`` files in DIR), in MiB. glibc's counts of a traced process
include tracemalloc's own tables and each snapshot's transient copy (``malloc_free`` grows with
them): judge native growth on an untraced run (benchmarks/README.md, bench_soak.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gateway.memtrace import diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--key", default="lineno", choices=("lineno", "filename", "traceback"))
    ap.add_argument("--native", type=Path)
    args = ap.parse_args()
    for row in diff(args.before, args.after, top=args.top, key=args.key):
        print(row)
    if args.native:
        for f in sorted(args.native.glob("*.jsonl")):
            print(f"\n{f.name}")
            for line in f.read_text().splitlines():
                d = json.loads(line)
                cols = " ".join(f"{k}={v / 1048576:.1f}" for k, v in d.items() if k not in ("n", "time"))
                print(f"  #{d['n']} {cols}")


if __name__ == "__main__":
    main()
