"""The read-path cost of the encrypted memory store (SQLCipher, gateway/atrest/memdb.py) beside
the plain one, same items, same run: ``get_if`` by random key (what every GET /v1/memory/{key}
does in the guard), a tag page of 100, a sum aggregate over every item of a tag. Rounds alternate
plain / encrypted so drift on a shared machine falls on both. Prints ops/s and the ratio
encrypted / plain; asserts nothing.

    .venv/bin/python benchmarks/bench_atrest_reads.py [--items 20000] [--seconds 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway.guard.store import MemoryItem, MemoryStore, ReadFilter

TS = "2026-01-01T00:00:00Z"


def fill(store: MemoryStore, n: int) -> None:
    with store.bulk_writer() as w:
        for i in range(n):
            w.add(
                MemoryItem(
                    f"k{i:07}", {"shares": i % 100, "note": "x" * 64}, ("all", f"g{i % 10}"), "low", "user", TS, TS
                )
            )
        w.commit()


def rate(fn: Callable[[], object], seconds: float) -> float:
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()
        n += 1
    return n / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="uomp-bench-atrest-"))
    stores = {"plain": MemoryStore(d / "plain.db"), "encrypted": MemoryStore(d / "enc.db", key=os.urandom(32))}
    for s in stores.values():
        fill(s, a.items)
    rng = random.Random(7)
    keys = [f"k{rng.randrange(a.items):07}" for _ in range(10_000)]
    flt = ReadFilter()

    def ops(s: MemoryStore) -> dict[str, Callable[[], object]]:
        it = iter(range(10**12))
        return {
            "get_if by key": lambda: s.get_if(keys[next(it) % len(keys)], lambda m: m is not None),
            "tag page (100)": lambda: s.tag_page("g3", flt, after=None, limit=100, max_bytes=10**7),
            f"sum over {a.items // 10} items": lambda: s.aggregate("g3", flt, path='$."shares"'),
        }

    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(a.rounds):
        for name, s in stores.items():
            for op, fn in ops(s).items():
                fn()  # warm the page cache
                results.setdefault(op, {}).setdefault(name, []).append(rate(fn, a.seconds))
    print(f"items={a.items} rounds={a.rounds} seconds/op/round={a.seconds}")
    for op, by in results.items():
        plain = sorted(by["plain"])[len(by["plain"]) // 2]
        enc = sorted(by["encrypted"])[len(by["encrypted"]) // 2]
        print(f"{op:<24} plain {plain:>10.0f}/s  encrypted {enc:>10.0f}/s  ratio {enc / plain:.2f}")
    for s in stores.values():
        s.close()


if __name__ == "__main__":
    main()
