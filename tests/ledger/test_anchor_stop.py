"""Stopping the anchoring worker while a round's statement still runs in its thread: the connection is
closed only once that statement is done. Closed under it, the process died with SIGSEGV (seen in CI as a
crash of the whole test run when a guard stopped mid-round)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import asyncio, sys
from pathlib import Path
from gateway.ledger import anchorer

def long_derivation(conn, now=None):  # a derivation over a large backlog: many statements in the thread
    for i in range(200_000):
        conn.execute("SELECT ?", (i,)).fetchone()
    return 0

async def main() -> None:
    worker = anchorer.Anchorer(Path(sys.argv[1]), backend=None)
    anchorer.derive_facts = long_derivation
    for _ in range(20):
        round_ = asyncio.ensure_future(worker.step())
        await asyncio.sleep(0.05)  # the derivation is running in its thread
        round_.cancel()
        await worker.stop()  # closes the connection
    print("stopped cleanly")

asyncio.run(main())
"""


def test_stop_waits_for_the_running_statement_before_closing(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "audit.db")], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert res.stdout.strip() == "stopped cleanly"
