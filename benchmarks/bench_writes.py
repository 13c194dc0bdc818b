"""Agent writes (docs/writes.md): proposal latency, approval latency and history growth, one run.

    .venv/bin/python benchmarks/bench_writes.py [--calls 150] [--rounds 2] [--cli 5]
        [--changes 10000] [--skip-history]

(a) proposals. The appliance (guard on its Unix socket + gateway with TLS 1.3 mTLS on loopback)
runs in this process on a throwaway home under /tmp, budgets of ``[guard] write_*`` raised so that
no proposal of the run is refused. One agent certificate, one remote-profile session granted
through the admin API with a read scope and a write scope (tag ``preference``, as ``uomp
authorize --grant-writes`` puts it in ``granted_scopes.write``). One request at a time on one
keep-alive connection per path, ``--rounds`` alternations of four phases of ``--calls`` requests:
``GET /v1/memory/{key}`` and ``PUT /v1/memory/{key}`` (a ~60-byte value, answer 202 with a
``proposal_id``) through the gateway (mTLS, Bearer + ``X-UOMP-Agent-Id``) and direct on the
guard's socket (the same token with the gateway's verified-identity headers). Each PUT names
another key, so every proposal can be approved later. Printed: p50/p99/mean and PUT/GET per path.

(b) approvals, the user's way, with the guard running: ``ProposalBook.show`` (the change and its
hash) then ``gateway.cli.proposals.approve_shown`` with that hash (the item change, its version,
the proposal's status in one transaction, then the ``proposal_approved`` audit event), for every
proposal of (a) but ``--cli``; those last ones by ``uomp proposals approve ID --hash H`` as a
subprocess (wall time, Python start-up included).

(c) history growth: a fresh ``memory.db`` per case, ``--changes`` changes (value replaced, the
store's triggers keep the replaced version) to one item or spread round-robin over 1,000 items,
values of ~60 B and ~1 KiB, with ``history_max_versions`` 0 (keep all) and at its default (50).
Changes are committed 100 per transaction (the triggers do the same work per row whatever the
batching). After each tenth of the changes, ``PRAGMA wal_checkpoint(TRUNCATE)`` and the size of
``memory.db`` + ``memory.db-wal``: printed, growth over the seeded file per kept version and per
change; with the default retention the one-item file stops growing once 50 versions are kept
(free pages are reused).

Every phase is bounded (``--calls`` <= 2,000 per phase, ``--changes`` <= 100,000); loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as c

MAX_CALLS = 2000
MAX_CHANGES = 100_000
MAX_CLI = 20
SPREAD_ITEMS = 1000
BATCH = 100
VALUE_60 = 60
VALUE_1K = 1024


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def _row(name: str, lat: list[float]) -> str:
    return (
        f"{name:<22} n={len(lat):<5} p50={_pct(lat, 50) * 1000:7.2f} ms  p99={_pct(lat, 99) * 1000:7.2f} ms"
        f"  mean={statistics.fmean(lat) * 1000:7.2f} ms"
    )


def _ratio(name: str, num: list[float], den: list[float]) -> str:
    return f"ratio {name}: p50 {_pct(num, 50) / _pct(den, 50):.2f}x  p99 {_pct(num, 99) / _pct(den, 99):.2f}x"


def _value(size: int, j: int) -> str:
    """A JSON string value of about ``size`` bytes, different for every ``j``."""
    head = f"change {j:09d} "
    return head + "x" * max(0, size - len(head) - 2)  # the two quotes of the JSON text


# ----------------------------------------------------------------------------- (a) + (b)


async def _grant(paths: Any, base: str, agent: dict[str, str], calls: int) -> dict[str, Any]:
    scope = {"tags": ["preference"], "keys": []}
    body = {"agent_id": agent["agent_id"], "requested_scopes": {"read": scope, "write": scope}, "duration_minutes": 60}
    status, created = await c._admin_call(paths, "POST", "/v1/sessions", body)
    if status != 201:
        raise SystemExit(f"session create failed: {status} {created}")
    gbody = {
        "granted_scopes": {"read": scope, "write": scope},
        "profile": "remote",
        "audience": base,
        "cnf": {"x5t#S256": agent["x5t"], "jkt": agent["jkt"]},
        "limits": {"max_read_queries": 10_000_000, "max_write_queries": calls},
    }
    status, g = await c._admin_call(paths, "POST", f"/v1/sessions/{created['session_id']}/grant", gbody)
    if status != 200:
        raise SystemExit(f"grant failed: {status} {g}")
    return dict(g)


async def _timed(session: Any, method: str, url: str, headers: dict[str, str], body: Any, want: int) -> float:
    t = time.perf_counter()
    async with session.request(method, url, headers=headers, json=body) as resp:
        data = await resp.read()
        if resp.status != want:
            raise SystemExit(f"{method} {url}: {resp.status} {data[:300]!r}")
    return time.perf_counter() - t


async def proposals_and_approvals(args: argparse.Namespace) -> None:
    import aiohttp

    from gateway import contract
    from gateway.cli.proposals import approve_shown
    from gateway.client.tls import build_client_context
    from gateway.config import GatewayConfig, GuardConfig
    from gateway.guard.proposal_rules import WriteBudgets
    from gateway.guard.proposals import ProposalBook
    from gateway.guard.server import GuardRunner
    from gateway.guard.stores import open_user_store
    from gateway.remote.server import GatewayRunner

    calls = max(1, min(args.calls, MAX_CALLS))
    rounds = max(1, args.rounds)
    total = 2 * calls * rounds  # proposals: one per key, both paths
    with c.bench_home(prefix="uomp-wr-") as paths:
        keys = c.seed_store(paths, n_keys=total + 10, n_other=100)
        agent = c.issue_agent(paths)
        big = 10 * total + 1000
        cfg = dataclasses.replace(
            GuardConfig(),
            audit_full_verify_at_start=False,
            write_max_pending_per_session=big,
            write_max_per_session=big,
            write_max_per_agent_hour=big,
            write_max_pending_total=big,
        )
        guard = GuardRunner(paths, cfg, serve_tcp=False)
        await guard.start()
        gw = GatewayRunner(paths, GatewayConfig(listen_port=0))
        await gw.start()
        lat: dict[str, list[float]] = {"gw_get": [], "gw_put": [], "direct_get": [], "direct_put": []}
        pids: list[str] = []
        approve: list[float] = []
        show: list[float] = []
        cli: list[float] = []
        try:
            base = f"https://localhost:{gw.port}"
            g = await _grant(paths, base, agent, big)
            gw_hdrs = {"Authorization": f"Bearer {g['token']}", "X-UOMP-Agent-Id": agent["agent_id"]}
            direct_hdrs = contract.assertion_headers(
                token=g["token"],
                agent_id=agent["agent_id"],
                listener="mtls",
                via="gateway:mtls:bench",
                x5t=agent["x5t"],
                jkt=agent["jkt"],
            )
            ctx = build_client_context(agent["ca"], agent["cert"], agent["key"])
            timeout = aiohttp.ClientTimeout(total=30)
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=1), timeout=timeout) as gs,
                aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=str(paths.guard_sock), limit=1), timeout=timeout
                ) as ds,
            ):
                paths_under_test = (("gw", gs, base, gw_hdrs), ("direct", ds, "http://guard", direct_hdrs))
                for _, s, url, h in paths_under_test:  # warm-up: connections, caches (reads only)
                    for i in range(10):
                        await _timed(s, "GET", f"{url}/v1/memory/{keys[-1 - i]}", h, None, 200)
                nxt = 0
                for _ in range(rounds):
                    for name, s, url, h in paths_under_test:
                        for i in range(calls):
                            key = keys[(nxt + i) % (total + 10)]
                            lat[f"{name}_get"].append(await _timed(s, "GET", f"{url}/v1/memory/{key}", h, None, 200))
                        for i in range(calls):
                            key = keys[nxt + i]
                            body = {"value": _value(VALUE_60, nxt + i)}
                            t = time.perf_counter()
                            async with s.put(f"{url}/v1/memory/{key}", headers=h, json=body) as resp:
                                answer = await resp.json(content_type=None)
                                if resp.status != 202:
                                    raise SystemExit(f"PUT {key}: {resp.status} {answer}")
                            lat[f"{name}_put"].append(time.perf_counter() - t)
                            pids.append(answer["proposal_id"])
                        nxt += calls

            # (b) the user's decision, guard still running
            n_cli = max(0, min(args.cli, MAX_CLI, len(pids) - 1))
            in_process, by_cli = pids[: len(pids) - n_cli], pids[len(pids) - n_cli :]
            ucfg = GuardConfig()
            store = open_user_store(paths, ucfg)
            try:
                book = ProposalBook(store, WriteBudgets.from_config(ucfg))
                for pid in in_process:
                    t = time.perf_counter()
                    view = book.show(pid)
                    t_shown = time.perf_counter()
                    approve_shown(paths, book, pid, view["change_hash"])
                    done = time.perf_counter()
                    show.append(t_shown - t)
                    approve.append(done - t)
                hashes = {pid: book.show(pid)["change_hash"] for pid in by_cli}
            finally:
                store.close()
            uomp = str(Path(sys.executable).parent / "uomp")
            env = {**os.environ, "UOMP_HOME": str(paths.home)}
            for pid in by_cli:
                t = time.perf_counter()
                proc = subprocess.run(
                    [uomp, "proposals", "approve", pid, "--hash", hashes[pid]],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                cli.append(time.perf_counter() - t)
                if proc.returncode != 0:
                    raise SystemExit(f"uomp proposals approve: {proc.returncode} {proc.stderr[-300:]}")
            with store_view(paths) as conn:
                approved = conn.execute("SELECT count(*) FROM proposals WHERE status = 'approved'").fetchone()[0]
        finally:
            await gw.stop()
            await guard.stop()
    print("(a) one request at a time, one keep-alive connection per path; PUT = a proposal (202)")
    for name in ("gw_get", "gw_put", "direct_get", "direct_put"):
        print(_row(name.replace("gw", "gateway").replace("_", " "), lat[name]))
    print(_ratio("PUT/GET gateway", lat["gw_put"], lat["gw_get"]))
    print(_ratio("PUT/GET direct ", lat["direct_put"], lat["direct_get"]))
    print(_ratio("gateway/direct PUT", lat["gw_put"], lat["direct_put"]))
    print("(b) approvals, the guard running")
    print(_row("show", show) + "   (ProposalBook.show: the change and its hash)")
    print(_row("show + approve_shown", approve) + "   (the item changed, the proposal_approved event durable)")
    tenth = max(1, len(approve) // 10)
    first, last = approve[:tenth], approve[-tenth:]
    print(
        f"approve p50, first tenth {_pct(first, 50) * 1000:.2f} ms, last tenth {_pct(last, 50) * 1000:.2f} ms"
        "   (each approval opens the audit log, checked at open, as the CLI does)"
    )
    if cli:
        print(_row("uomp proposals approve", cli) + "   (subprocess wall time, start-up included)")
    print(f"approved: {approved} of {len(pids)} proposals")


class store_view:  # a context manager used like a function
    """A read-only sqlite3 connection to the home's memory.db (the counts after the run)."""

    def __init__(self, paths: Any) -> None:
        self.path = paths.memory_db

    def __enter__(self) -> sqlite3.Connection:
        self.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


# ----------------------------------------------------------------------------- (c)


def _size(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        conn.close()
    wal = Path(str(db) + "-wal")
    return db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def history_case(n_items: int, value_size: int, keep: int, changes: int) -> dict[str, Any]:
    from gateway.guard.history import set_retention
    from gateway.guard.items import MemoryItem
    from gateway.guard.store import MemoryStore

    with tempfile.TemporaryDirectory(prefix="uomp-wh-", dir="/tmp") as tmp:
        db = Path(tmp) / "memory.db"
        store = MemoryStore(db)
        try:
            set_retention(store, keep)
            keys = [f"hist.k{i:05d}" for i in range(n_items)]
            store.put_many(
                [MemoryItem(k, _value(value_size, 0), ("bench",), "low", "user", c.NOW_ISO, c.NOW_ISO) for k in keys]
            )
            seeded = _size(db)
            samples: list[tuple[int, int, int]] = []
            step = max(BATCH, changes // 10)
            t = time.perf_counter()
            done = 0
            while done < changes:
                with store.writing() as conn:
                    for j in range(done, min(changes, done + BATCH)):
                        conn.execute(
                            "UPDATE items SET value = ?, updated_at = ? WHERE key = ?",
                            (f'"{_value(value_size, j + 1)}"', c.NOW_ISO, keys[j % n_items]),
                        )
                done = min(changes, done + BATCH)
                if done % step == 0 or done == changes:
                    with store.reading() as conn:
                        kept = int(conn.execute("SELECT count(*) FROM item_versions").fetchone()[0])
                    samples.append((done, kept, _size(db)))
            elapsed = time.perf_counter() - t
        finally:
            store.close()
    return {"seeded": seeded, "samples": samples, "elapsed": elapsed}


def history_growth(args: argparse.Namespace) -> None:
    changes = max(BATCH, min(args.changes, MAX_CHANGES))
    print(f"(c) history growth: {changes:,} changes, memory.db + -wal after wal_checkpoint(TRUNCATE)")
    print(f"{'case':<34} {'kept':>7} {'file':>11} {'growth':>11} {'B/version':>10} {'B/change':>9}  ch/s")
    for value_size in (VALUE_60, VALUE_1K):
        for n_items in (1, SPREAD_ITEMS):
            for keep in (0, 50):
                r = history_case(n_items, value_size, keep, changes)
                done, kept, size = r["samples"][-1]
                growth = size - r["seeded"]
                name = f"{value_size} B, {n_items} item{'s' if n_items > 1 else ''}, keep {keep or 'all'}"
                per_version = growth / kept if kept else float("nan")
                print(
                    f"{name:<34} {kept:>7,} {size:>11,} {growth:>11,} {per_version:>10.0f} {growth / done:>9.1f}"
                    f"  {done / r['elapsed']:,.0f}"
                )
                if n_items == 1 and keep:
                    trail = "  ".join(f"{d:,}:{s // 1024}" for d, _, s in r["samples"])
                    print(f"{'':<4}KiB after N changes: {trail}")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--calls", type=int, default=150, help=f"sequential requests per phase and round (max {MAX_CALLS})")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the four request phases")
    p.add_argument("--cli", type=int, default=5, help=f"approvals by 'uomp proposals approve' (max {MAX_CLI})")
    p.add_argument("--changes", type=int, default=10_000, help=f"changes per history case (max {MAX_CHANGES:,})")
    p.add_argument("--skip-history", action="store_true", help="only (a) and (b)")
    args = p.parse_args()
    print(c.machine_line())
    asyncio.run(proposals_and_approvals(args))
    if not args.skip_history:
        history_growth(args)


if __name__ == "__main__":
    main()
