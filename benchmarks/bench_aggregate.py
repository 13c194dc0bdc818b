"""Aggregates and paged tag reads over a million items; denied vs missing for a large item.

    .venv/bin/python benchmarks/bench_aggregate.py [--items 1000000] [--page 1000] [--existence-rounds 200]

What it does, on a throwaway UOMP_HOME under /tmp:

1. seeds ``--items`` items under the tag ``bulk`` (``{"mv": i % 1000, "qty": 2}``; every other item
   also carries ``odd``) through the store's bulk writer, one transaction;
2. **in this process, the store alone**: ``MemoryStore.aggregate`` (count, sum) and the history
   check's overlap query, which also answers tracked sums (``MemoryStore.atoms``, one and two
   tags), then a walk through every item with ``MemoryStore.tag_page`` (``--page`` items per page),
   each under ``tracemalloc`` (peak of Python allocations) with the process RSS before and after;
3. **end to end**: the guard (``GuardRunner``) in a child process, a session granted through the
   admin API, then over its Unix socket ``GET /v1/memory/aggregate`` count, sum (protected: the
   session's aggregate history is checked and recorded), sum again, and every page of
   ``GET /v1/memory?tag=bulk`` following ``next``; the guard's RSS (VmRSS) and peak RSS (VmHWM)
   from /proc before and after;
4. **existence through timing** (issue 15 defect 8): alternating ``GET /v1/memory/<key>`` for a
   denied 900 KB item and for a missing key, ``--existence-rounds`` each; prints the ratio of their
   medians (1.0 = indistinguishable).

Nothing asserts a timing: it prints what one run measured. Loopback / Unix socket only; every loop
is bounded by the item count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any, TypeVar

import _common as c

T = TypeVar("T")


def rss_kib() -> int:
    return c.proc_status_kib(os.getpid())


def measured(name: str, fn: Callable[[], T]) -> T:
    r0 = rss_kib()
    tracemalloc.start()
    t0 = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(
        f"  {name:<44} {elapsed:8.2f} s   tracemalloc peak {peak / 1024:9.1f} KiB   "
        f"RSS {r0 / 1024:7.1f} -> {rss_kib() / 1024:7.1f} MiB"
    )
    return out


def seed(paths: Any, n: int) -> None:
    from gateway.guard.items import MemoryItem
    from gateway.guard.store import MemoryStore

    store = MemoryStore(paths.memory_db)
    t0 = time.perf_counter()
    try:
        with store.bulk_writer() as w:
            for i in range(n):
                tags = ("bulk", "odd") if i % 2 else ("bulk",)
                w.add(MemoryItem(f"k{i:08d}", {"mv": i % 1000, "qty": 2}, tags, "medium", "user", c.NOW_ISO, c.NOW_ISO))
            w.add(MemoryItem("vault.big", {"blob": "x" * 900_000}, ("vault",), "medium", "user", c.NOW_ISO, c.NOW_ISO))
            w.commit()
    finally:
        store.close()
    print(f"seeded {n:,} items in {time.perf_counter() - t0:.1f} s")


def store_alone(paths: Any, n: int, page: int) -> None:
    from gateway.guard.storage import ReadFilter
    from gateway.guard.store import MemoryStore

    print("store alone (this process):")
    store = MemoryStore(paths.memory_db, create=False)
    flt = ReadFilter()
    try:
        row = measured("count (SQL)", lambda: store.aggregate("bulk", flt, path=None))
        assert row.count == n, row
        row = measured("sum of value.mv (SQL)", lambda: store.aggregate("bulk", flt, path='$."mv"'))
        print(f"    count {row.count:,}, sum {row.total:,}")
        keys = (12345, 678, 91011, 1213)
        atoms = measured(
            "sum + history check, 1 tag (one pass)",
            lambda: store.atoms(["bulk"], flt, path='$."mv"', keys=keys, max_atoms=4096),
        )
        assert atoms is not None and len(atoms) == 1
        atoms = measured(
            "sum + history check, 2 tags (one pass)",
            lambda: store.atoms(["bulk", "odd"], flt, path='$."mv"', keys=keys, max_atoms=4096),
        )
        assert atoms is not None and len(atoms) == 2

        def walk() -> int:
            after: str | None = None
            seen = 0
            while True:
                items, more = store.tag_page("bulk", flt, after=after, limit=page, max_bytes=4 << 20)
                seen += len(items)
                if not more:
                    return seen
                after = items[-1].key

        seen = measured(f"every page of {page} items (tag_page)", walk)
        assert seen == n, seen
    finally:
        store.close()


async def end_to_end(paths: Any, srv: c.ServerProc, token: str, n: int, page: int, rounds: int) -> None:
    import aiohttp

    hdrs = {"Authorization": f"Bearer {token}"}
    pid = int(srv.info.get("guard_pid") or srv.pid)

    def mem() -> str:
        return (
            f"guard RSS {c.proc_status_kib(pid) / 1024:7.1f} MiB, peak "
            f"{c.proc_status_kib(pid, 'VmHWM') / 1024:7.1f} MiB"
        )

    async with aiohttp.ClientSession(
        connector=aiohttp.UnixConnector(path=str(paths.guard_sock)), timeout=aiohttp.ClientTimeout(total=600)
    ) as s:

        async def get(path: str) -> tuple[int, Any]:
            async with s.get("http://guard" + path, headers=hdrs) as resp:
                return resp.status, await resp.json(content_type=None)

        print(f"end to end (guard in a child process, Unix socket); at start: {mem()}")
        for name, path in (
            ("aggregate count", "/v1/memory/aggregate?tag=bulk&op=count"),
            ("aggregate sum (history checked + recorded)", "/v1/memory/aggregate?tag=bulk&op=sum&field=value.mv"),
            ("aggregate sum again (same set)", "/v1/memory/aggregate?tag=bulk&op=sum&field=value.mv"),
            ("aggregate sum over odd (2-tag history)", "/v1/memory/aggregate?tag=odd&op=sum&field=value.mv"),
        ):
            t0 = time.perf_counter()
            status, body = await get(path)
            print(f"  {name:<44} {time.perf_counter() - t0:8.2f} s   {status} {body}   {mem()}")
        t0 = time.perf_counter()
        seen = pages = 0
        cursor: str | None = None
        while True:
            status, body = await get(f"/v1/memory?tag=bulk&limit={page}" + (f"&cursor={cursor}" if cursor else ""))
            if status != 200:
                raise SystemExit(f"page {pages}: {status} {body}")
            pages += 1
            seen += len(body["items"])
            cursor = body["next"]
            if cursor is None:
                break
        elapsed = time.perf_counter() - t0
        print(
            f"  {'every page of GET /v1/memory?tag=bulk':<44} {elapsed:8.2f} s   {seen:,} items, {pages:,} pages "
            f"({elapsed / pages * 1000:.1f} ms/page)   {mem()}"
        )
        if seen != n:
            raise SystemExit(f"paging saw {seen} items, expected {n}")

        denied: list[float] = []
        missing: list[float] = []
        for _ in range(rounds):
            for key, sink in (("vault.big", denied), ("no.such.key", missing)):
                t0 = time.perf_counter()
                status, _ = await get(f"/v1/memory/{key}")
                sink.append(time.perf_counter() - t0)
                if status != 403:
                    raise SystemExit(f"{key}: {status}")
        md, mm = statistics.median(denied), statistics.median(missing)
        print(
            f"existence: denied 900 KB item median {md * 1000:.2f} ms, missing key median {mm * 1000:.2f} ms, "
            f"ratio denied/missing {md / mm:.2f} ({rounds} each, alternating)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--page", type=int, default=1000, help="items per page (at most max_tag_results, 1000)")
    ap.add_argument("--existence-rounds", type=int, default=200)
    ap.add_argument("--keep", action="store_true", help="keep the throwaway UOMP_HOME")
    args = ap.parse_args()
    if not (10 <= args.items <= 5_000_000 and 1 <= args.page <= 1000 and 1 <= args.existence_rounds <= 10_000):
        raise SystemExit("--items 10..5,000,000, --page 1..1000, --existence-rounds 1..10,000")
    print(f"bench_aggregate: {c.machine_line()}")
    with c.bench_home(args.keep, prefix="uomp-agg-") as paths:
        seed(paths, args.items)
        store_alone(paths, args.items, args.page)
        with c.start_server(paths, what="guard") as srv:
            g = c.grant(paths, read={"tags": ["bulk", "odd"], "keys": []}, max_read_queries=10_000_000)
            asyncio.run(end_to_end(paths, srv, g["token"], args.items, args.page, args.existence_rounds))


if __name__ == "__main__":
    main()
