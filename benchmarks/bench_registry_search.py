"""`uomp registry search` over N agents registered on a local anvil: the cold search (reading every
Registered event and every registration file) beside the cached one (no new block, nothing to
fetch), in one run, and their ratio. Registration files are data: URIs (read in place, as on-chain
files are), so the figure is the chain and index cost, not HTTP.

    .venv/bin/python benchmarks/bench_registry_search.py --agents 10000

Loopback only (anvil on 127.0.0.1, a throwaway UOMP_HOME under /tmp); bounded by --agents.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from anchorkit import ANVIL, Anvil  # noqa: E402
from registrykit import Registry, registration  # noqa: E402

from gateway.config import Paths, RegistryConfig  # noqa: E402
from gateway.keys import init_home  # noqa: E402
from gateway.registry import ops  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=2000)
    args = ap.parse_args()
    if not ANVIL.exists():
        print("anvil not installed: bash scripts/setup-anvil.sh")
        return 1
    work = Path(tempfile.mkdtemp(prefix="uomp-bench-reg-", dir="/tmp"))
    node = Anvil(work)
    node.start()
    try:
        reg = Registry.deploy(node)
        fn = reg.contract.get_function_by_signature("register(string)")
        sender = reg.accounts[1]
        nonce = reg.w3.eth.get_transaction_count(sender)
        reg.anvil.rpc("evm_setAutomine", False)
        t0 = time.perf_counter()
        for i in range(args.agents):
            agent_id = i + 1
            body = registration(f"Agent {agent_id} {'calendar' if i % 10 == 0 else 'other'}", agent_id, reg.id)
            uri = "data:application/json;base64," + base64.b64encode(body).decode()
            fn(uri).transact({"from": sender, "nonce": nonce + i, "gas": 1_500_000})
            if i % 15 == 14:
                reg.anvil.mine()
        for _ in range(args.agents):  # until every transaction is in a block (the block gas limit spreads them)
            if reg.w3.eth.get_transaction_count(sender, "latest") == nonce + args.agents:
                break
            reg.anvil.mine()
        reg.anvil.rpc("evm_setAutomine", True)
        print(f"registered {args.agents} agents in {time.perf_counter() - t0:.1f} s")
        paths = Paths(work / "home")
        init_home(paths)
        cfg = RegistryConfig(allow_internal=True)
        ops.add_registry(paths, cfg, reg.spec, node.url)
        t1 = time.perf_counter()
        cold = ops.search(paths, cfg, "calendar")
        cold_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        warm = ops.search(paths, cfg, "calendar")
        warm_s = time.perf_counter() - t2
        print(
            f"cold: {len(cold.results)} matches, {cold.indexed} indexed, {cold.failed} failed, {cold.pending} pending"
        )
        assert len(cold.results) == len(warm.results) == (args.agents + 9) // 10
        print(
            json.dumps(
                {
                    "agents": args.agents,
                    "matches": len(cold.results),
                    "cold_search_s": round(cold_s, 3),
                    "cached_search_s": round(warm_s, 3),
                    "cold_over_cached": round(cold_s / warm_s, 1),
                }
            )
        )
    finally:
        node.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
