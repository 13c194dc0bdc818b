"""What anchoring costs: gas per anchor transaction, and the audit log's appends/s with the chain on vs off.

    .venv/bin/python benchmarks/bench_anchor.py [--seconds 5] [--batch 20] [--checkpoint-every 100]

Needs anvil (scripts/setup-anvil.sh). Two parts:

* **gas**: UompAnchor deployed on a fresh anvil; ``gasUsed`` of the receipts of anchors with no
  §18.4.1 events (a ``CheckpointAnchored`` alone), with one event of each kind, and with one of
  every kind (six events), as the appliance sends them (``EvmBackend.submit``); the difference to
  the checkpoint alone is the marginal cost of that event.
* **appends/s**: the ledger's writer path (``EventLog.append`` in commits of ``--batch`` events, a
  signed checkpoint every ``--checkpoint-every`` events, WAL, in a worker thread as in the guard)
  for ``--seconds``, once with ``[anchor] backend = none`` and once with the anchoring worker
  draining the same log into anvil in the same process (every checkpoint queued, sent, verified on
  chain before it counts, confirmed anchors re-read), alternating in rounds. Prints the ratio.
  The writer pauses 0.5 ms after each commit in both modes (see PAUSE_S).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from anchorkit import ANVIL, ANVIL_MISSING, Anvil, included, sample_anchor
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway.ledger.anchorer import Anchorer, AnchorPolicy
from gateway.ledger.log import EventLog

KEY = Ed25519PrivateKey.generate()
# Between two commits, in both modes: a writer that re-takes the write lock the microsecond it let go
# starves every other connection (SQLite's busy handler sleeps in steps of milliseconds), which the
# guard's group-commit writer, waiting for requests, does not do.
PAUSE_S = 0.0005


async def gas(anvil: Anvil) -> dict[str, int]:
    from eth_account import Account

    from gateway.anchor.evm import EvmBackend, EvmSettings, deploy

    owner = Account.create()
    anvil.fund(owner.address)
    contract = await deploy(anvil.url, owner)
    b = EvmBackend(EvmSettings(rpc_url=anvil.url, contract=contract, chain_id=31337, confirmations=1), owner)
    full = sample_anchor(2, events=True)
    cases = [
        ("checkpoint only", sample_anchor(1, events=False)),
        ("checkpoint + 6 events (one per kind, 2 access)", full),
    ]
    for n, kind in enumerate(("granted", "revoked", "access", "payloads", "deletions")):
        one = sample_anchor(10 + n, events=False)
        cases.append((f"checkpoint + 1 {kind}", dataclasses.replace(one, **{kind: getattr(full, kind)[:1]})))
    out: dict[str, int] = {}
    try:
        for name, anchor in cases:
            sub = await b.submit(anchor)
            await included(b, sub)
            out[name] = int(anvil.rpc("eth_getTransactionReceipt", sub.ref)["gasUsed"], 16)
    finally:
        await b.close()
    return out


def writer(path: Path, backend: str, seconds: float, batch: int, every: int) -> int:
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    log = EventLog(conn, origin="bench/anchor", key=KEY, anchor_backend=backend)
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        conn.execute("BEGIN IMMEDIATE")
        log.append(
            [
                {
                    "id": f"evt_{n + i}",
                    "ts": time.time(),
                    "action": "read",
                    "session_id": "sess_bench",
                    "agent_id": "bench_agent",
                    "allowed": True,
                    "key": "preference.theme",
                }
                for i in range(batch)
            ]
        )
        n += batch
        if n % every < batch:
            log.checkpoint(now=time.time())
        conn.execute("COMMIT")
        time.sleep(PAUSE_S)
    conn.close()
    return n


async def round_(
    anvil: Anvil, backend_obj: object, workdir: Path, on: bool, seconds: float, batch: int, every: int
) -> tuple[float, int]:
    path = workdir / f"audit-{'on' if on else 'off'}-{time.monotonic_ns()}.db"
    anchorer = None
    stop = threading.Event()
    if on:
        import sqlite3

        EventLog(sqlite3.connect(path, isolation_level=None), origin="bench/anchor", key=KEY, anchor_backend="evm")
        anchorer = Anchorer(path, backend_obj, policy=AnchorPolicy(poll_seconds=0.2, recheck_seconds=2.0))  # type: ignore[arg-type]
        anchorer.start()

        def miner() -> None:  # anvil mines on each transaction; one more block per 0.2 s makes anchors final
            while not stop.wait(0.2):
                anvil.mine(1)

        threading.Thread(target=miner, daemon=True).start()
    t0 = time.perf_counter()
    n = await asyncio.to_thread(writer, path, "evm" if on else "none", seconds, batch, every)
    rate = n / (time.perf_counter() - t0)
    stop.set()
    confirmed = 0
    if anchorer is not None:
        await asyncio.sleep(1.0)  # the worker's last round
        await anchorer.stop()
        import sqlite3

        conn = sqlite3.connect(path)
        confirmed = conn.execute("SELECT COUNT(*) FROM ledger_anchors WHERE state = 'confirmed'").fetchone()[0]
        conn.close()
    return rate, confirmed


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not ANVIL.exists():
        raise SystemExit(ANVIL_MISSING)
    from eth_account import Account

    from gateway.anchor.evm import EvmBackend, EvmSettings, deploy

    with tempfile.TemporaryDirectory(prefix="bench-anchor-") as tmp:
        anvil = Anvil(Path(tmp))
        anvil.start()
        try:
            used = await gas(anvil)
            base = used["checkpoint only"]
            for name, g in used.items():
                print(f"gas per anchor transaction, {name}: {g}" + (f" (+{g - base})" if g != base else ""))
            owner = Account.create()
            anvil.fund(owner.address)
            contract = await deploy(anvil.url, owner)
            backend = EvmBackend(
                EvmSettings(rpc_url=anvil.url, contract=contract, chain_id=31337, confirmations=2), owner
            )
            off: list[float] = []
            on: list[float] = []
            anchored = 0
            for _ in range(args.rounds):
                off.append(
                    (await round_(anvil, backend, Path(tmp), False, args.seconds, args.batch, args.checkpoint_every))[0]
                )
                rate, confirmed = await round_(
                    anvil, backend, Path(tmp), True, args.seconds, args.batch, args.checkpoint_every
                )
                on.append(rate)
                anchored += confirmed
            await backend.close()
            m_off, m_on = statistics.median(off), statistics.median(on)
            print(f"appends/s, chain off: {m_off:.0f} (rounds {', '.join(f'{x:.0f}' for x in off)})")
            print(f"appends/s, chain on:  {m_on:.0f} (rounds {', '.join(f'{x:.0f}' for x in on)})")
            print(f"anchors confirmed (checked on chain) during the chain-on rounds: {anchored}")
            print(f"ratio on/off: {m_on / m_off:.3f}")
        finally:
            anvil.stop()


if __name__ == "__main__":
    asyncio.run(main())
