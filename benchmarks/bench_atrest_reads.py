"""The read-path cost of the encrypted memory store (SQLCipher, gateway/atrest/memdb.py) beside
the plain one, same items, same run: ``get_if`` by random key (what every GET /v1/memory/{key}
does in the guard), a tag page of 100, a sum aggregate over every item of a tag. Rounds alternate
plain / encrypted so drift on a shared machine falls on both. A third store runs SQLCipher's
engine without a key, so the cost of the encryption itself shows apart from the engine's version.
Then the cost of a high-sensitivity read: in an encrypted store whose high items are also sealed one
by one (gateway/atrest/itemseal.py), ``get_if`` of a high item beside one of a low item, same rounds.
Prints ops/s and the ratios; asserts nothing.

    .venv/bin/python benchmarks/bench_atrest_reads.py [--items 20000] [--seconds 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway import sqldriver
from gateway.atrest.itemseal import ItemSealer
from gateway.guard.store import MemoryItem, MemoryStore, ReadFilter

TS = "2026-01-01T00:00:00Z"


class SameEngine(MemoryStore):
    """SQLCipher's own SQLite without a key: separates the cost of encryption from the engine's
    version (sqlcipher3 bundles a newer SQLite than the standard library's)."""

    def _connect(self, uri: str) -> sqlite3.Connection:
        conn: sqlite3.Connection = sqldriver.cipher().connect(
            uri, uri=True, timeout=5.0, isolation_level=None, check_same_thread=False
        )
        return conn


def fill(store: MemoryStore, n: int, *, high_every: int = 0) -> None:
    """``n`` items; with ``high_every`` N, every N-th one is of sensitivity high."""
    with store.bulk_writer() as w:
        for i in range(n):
            sens = "high" if high_every and i % high_every == 0 else "low"
            w.add(
                MemoryItem(
                    f"k{i:07}", {"shares": i % 100, "note": "x" * 64}, ("all", f"g{i % 10}"), sens, "user", TS, TS
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
    stores = {
        "plain": MemoryStore(d / "plain.db"),
        "sqlcipher-nokey": SameEngine(d / "same.db"),
        "encrypted": MemoryStore(d / "enc.db", key=os.urandom(32)),
    }
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
    print("ratio: encrypted / plain (stdlib SQLite); encryption alone: encrypted / SQLCipher's engine without a key")
    for op, by in results.items():
        med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
        plain, same, enc = med["plain"], med["sqlcipher-nokey"], med["encrypted"]
        print(
            f"{op:<24} plain {plain:>8.0f}/s  engine-only {same:>8.0f}/s  encrypted {enc:>8.0f}/s  "
            f"ratio {enc / plain:.2f}  encryption alone {enc / same:.2f}"
        )
    for s in stores.values():
        s.close()
    high_read(d, a)


def high_read(d: Path, a: argparse.Namespace) -> None:
    """get_if of a high item (opened: one HKDF and one AES-GCM) beside a low one, same sealed store."""
    store = MemoryStore(d / "sealed.db", key=os.urandom(32), sealer=ItemSealer(os.urandom(32)))
    fill(store, a.items, high_every=2)
    rng = random.Random(11)
    high = [f"k{2 * rng.randrange(a.items // 2):07}" for _ in range(10_000)]
    low = [f"k{2 * rng.randrange(a.items // 2) + 1:07}" for _ in range(10_000)]
    allowed = lambda m: m is not None  # noqa: E731

    def reader(keys: list[str]) -> Callable[[], object]:
        it = iter(range(10**12))
        return lambda: store.get_if(keys[next(it) % len(keys)], allowed)

    by: dict[str, list[float]] = {"high": [], "low": []}
    for _ in range(a.rounds):
        for name, keys in (("low", low), ("high", high)):
            fn = reader(keys)
            fn()
            by[name].append(rate(fn, a.seconds))
    med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
    print(
        f"{'get_if, sealed store':<24} low {med['low']:>8.0f}/s  high {med['high']:>8.0f}/s  "
        f"time per read high / low {med['low'] / med['high']:.2f}"
    )
    store.close()


if __name__ == "__main__":
    main()
