"""Refresh crash loop (issue 9 defect 1): N agents refresh continuously while the gateway and the
guard are killed with SIGKILL again and again; at the end, how many agents still work?

    .venv/bin/python benchmarks/refresh_crash_loop.py [--agents 20] [--kills 30] [--seed 1]

The appliance runs as a user runs it (``uomp gateway start`` in a subprocess: gateway + supervised
guard child). Kills alternate between the gateway process (the whole appliance dies; it is started
again on the same port, as systemd would) and the guard child (the supervisor restarts it), at
random moments, so some land between a rotation's commit and its answer. Each agent is the real SDK
(``UompClient.from_bundle``) with its default retries, calling ``refresh()`` then ``audit()`` (a call with
the new access token, no read quota) in a loop. After the last kill every agent gets one more. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.client import ClientOptions, UompClient, UompClientError

UOMP = [sys.executable, "-m", "gateway.cli.main"]


def run(home: Path, *args: str) -> str:
    return subprocess.run(
        [*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=120, check=True
    ).stdout


class Appliance:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        for _ in range(20):
            self.proc = subprocess.Popen(
                [
                    *UOMP,
                    "--home",
                    str(self.home),
                    "gateway",
                    "start",
                    "--listen",
                    f"127.0.0.1:{self.port}",
                    "--no-local-port",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            assert self.proc.stdout is not None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                line = self.proc.stdout.readline()
                m = re.search(r"https://127\.0\.0\.1:(\d+)", line) if line.startswith("gateway: ") else None
                if m:
                    self.port = int(m.group(1))
                    return
                if not line and self.proc.poll() is not None:
                    break
            time.sleep(0.5)  # e.g. the port not yet free after the kill
        raise SystemExit("the appliance does not start")

    def guard_pid(self) -> int | None:
        assert self.proc is not None
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def kill_gateway(self) -> None:
        assert self.proc is not None
        guard = self.guard_pid()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if guard is not None:  # it follows its parent (die_with_parent); make sure before restarting
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and Path(f"/proc/{guard}").exists():
                time.sleep(0.05)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def authorize(app: Appliance, work: Path, i: int) -> Path:
    d = work / f"agent{i}"
    d.mkdir()
    (d / "uom.json").write_text(
        json.dumps(
            {
                "uomp_version": "1.0",
                "agent": {"id": f"agent_{i}", "name": f"Agent {i}", "version": "1.0.0"},
                "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
                "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
            }
        )
    )
    bundle = work / f"bundle{i}.json"
    run(
        app.home,
        "authorize",
        str(d),
        "--yes",
        "--remote",
        "--gateway-url",
        f"https://localhost:{app.port}",
        "--out",
        str(work / f"files{i}"),
        "--bundle",
        str(bundle),
    )
    return bundle


async def agent_loop(bundle: Path, stop: asyncio.Event, stats: dict[str, Any]) -> None:
    async with UompClient.from_bundle(bundle, options=ClientOptions(timeout_seconds=15)) as c:
        while not stop.is_set():
            try:
                await c.refresh()
                stats["refreshes"] += 1
                await c.audit(limit=1)  # uses the new access token (no read quota spent)
            except UompClientError as exc:
                stats["errors"][exc.code] = stats["errors"].get(exc.code, 0) + 1
                if exc.code in ("REFRESH_REUSED", "SESSION_REVOKED"):
                    return  # a lost agent stays lost
                await asyncio.sleep(0.5)
            await asyncio.sleep(random.uniform(0.02, 0.2))


async def final_check(bundle: Path) -> str:
    try:
        async with UompClient.from_bundle(bundle) as c:
            await c.refresh()
            await c.audit(limit=1)
        return "ok"
    except UompClientError as exc:
        return exc.code


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=20)
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-gap", type=float, default=0.5, help="seconds between kills, at least")
    ap.add_argument("--max-gap", type=float, default=3.0)
    args = ap.parse_args()
    random.seed(args.seed)
    work = Path(tempfile.mkdtemp(prefix="uomp-crashloop-", dir="/tmp"))
    home = work / "home"
    run(home, "init")
    run(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    app = Appliance(home)
    app.start()
    bundles = [authorize(app, work, i) for i in range(args.agents)]
    stats: dict[str, Any] = {"refreshes": 0, "errors": {}}
    stop = asyncio.Event()
    tasks = [asyncio.create_task(agent_loop(b, stop, stats)) for b in bundles]
    kills = {"gateway": 0, "guard": 0}
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    try:
        for k in range(args.kills):
            await asyncio.sleep(random.uniform(args.min_gap, args.max_gap))
            if k % 2 == 0:
                await loop.run_in_executor(None, app.kill_gateway)
                kills["gateway"] += 1
                await asyncio.sleep(random.uniform(0.0, 2.0))  # down for a while: agents retry or give up
                await loop.run_in_executor(None, app.start)
            else:
                pid = app.guard_pid()
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    kills["guard"] += 1
        await asyncio.sleep(3)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    outcomes = [await final_check(b) for b in bundles]
    sessions = json.loads(run(home, "sessions", "list", "--json"))
    app.stop()
    import sqlite3

    db = sqlite3.connect(home / "audit.db")
    retried = db.execute(
        "SELECT count(*) FROM ledger_events WHERE action='refresh' AND json_extract(body, '$.reason')"
        " LIKE 'refresh retried%'"
    ).fetchone()[0]
    db.close()
    print(
        json.dumps(
            {
                "agents": args.agents,
                "kills": kills,
                "seconds": round(time.monotonic() - started, 1),
                "refreshes": stats["refreshes"],
                "errors_seen": stats["errors"],
                "agents_working_at_end": outcomes.count("ok"),
                "final_failures": {c: outcomes.count(c) for c in set(outcomes) if c != "ok"},
                "sessions_revoked": sum(1 for s in sessions if s["status"] == "revoked"),
                "answers_lost_then_retried": retried,  # rotations whose answer never arrived, retried by the agent
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
