"""Our appliance beside the TypeScript reference (0xaicrypto/uomp-core), same machine, same run.

    .venv/bin/python benchmarks/bench_reference.py --reference /path/to/built/uomp-core
        [--duration S] [--clients N] [--rounds R]
    (or UOMP_REFERENCE_DIR=/path/to/built/uomp-core)

The reference is not part of this project: build a checkout yourself, as its README says
(``pnpm install && pnpm build``; Node >= 20 worked for its commit 93d1b1f with pnpm 9), e.g.::

    git clone https://github.com/0xaicrypto/uomp-core /tmp/uomp-core && cd /tmp/uomp-core
    npm install --prefix /tmp/pnpm9 pnpm@9 && export PATH=/tmp/pnpm9/node_modules/.bin:$PATH
    pnpm install && pnpm build

What runs (all on 127.0.0.1, throwaway homes under /tmp):

* ours: the appliance as ``uomp gateway start`` lays it out (gateway process + guard child,
  product defaults), 1,200 items, a remote-profile session bound to the agent certificate;
* the reference: ``apps/server`` (its Auth Service + guard, Hono on Node's HTTP server, its
  SQLite audit table written per read) and ``apps/gateway`` (Node ``https`` with client
  certificates required, forwarding with ``fetch`` to the server), with ``HOME`` pointing to a
  throwaway directory. Its ``memory.db`` gets the same 1,200 items (its table has our columns);
  its session is created and granted through its own API (``POST /v1/sessions``, ``/grant``)
  with its camelCase scope members (``denyKeys``/``denyTags``: the spec's names crash its guard,
  see README "Wire compatibility"). Both gateways use the same TLS material: our CA's gateway
  certificate (P-256) and the same agent certificate.

Load: ``_common.py``'s generator, 50 keep-alive TLS 1.3 clients cycling ``GET /v1/memory/<key>``
over 200 keys, every request audited by both; rounds alternate (ours, reference). Also each
implementation's guard directly (ours: Unix socket; the reference: its plain-HTTP port).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import _common as c
from bench_levers import App

from gateway import ca_store

SCOPE = {"tags": ["preference"], "keys": [], "denyKeys": [], "denyTags": []}
EMPTY = {"tags": [], "keys": [], "denyKeys": [], "denyTags": []}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def _wait_port(port: int, what: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited (rc={proc.returncode}); see its output above")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not listen on {port} within {timeout:.0f} s")


class Reference:
    def __init__(self, root: Path, ours: App) -> None:
        self.root = root
        self.home = Path(tempfile.mkdtemp(prefix="uomp-ref-"))
        data = self.home / ".uomp"
        data.mkdir(mode=0o700)
        self._seed(data / "memory.db", ours.paths.memory_db)
        self.port, self.gw_port = c.free_port(), c.free_port()
        env = {
            **os.environ,
            "HOME": str(self.home),
            "UOMP_HOST": "127.0.0.1",
            "UOMP_PORT": str(self.port),
            "NODE_ENV": "production",
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.server = self._spawn(["node", str(root / "apps/server/dist/index.js")], env)
        _wait_port(self.port, "the reference server", self.server)
        paths = ours.paths
        self.audience = f"https://localhost:{self.gw_port}"
        gw_env = {
            **env,
            "UOMP_DATA_DIR": str(data),
            "UOMP_GATEWAY_PORT": str(self.gw_port),
            "UOMP_GATEWAY_HOST": "127.0.0.1",
            "UOMP_GUARD_URL": f"http://127.0.0.1:{self.port}",
            "UOMP_GATEWAY_CERT": str(ca_store.server_cert_path(paths)),
            "UOMP_GATEWAY_KEY": str(ca_store.server_key_path(paths)),
            "UOMP_GATEWAY_CA": str(ca_store.ca_cert_path(paths)),
            "UOMP_GATEWAY_AUDIENCE": self.audience,
        }
        self.gateway = self._spawn(["node", str(root / "apps/gateway/dist/index.js")], gw_env)
        _wait_port(self.gw_port, "the reference gateway", self.gateway)
        base = f"http://127.0.0.1:{self.port}"
        sess = _post(
            f"{base}/v1/sessions",
            {
                "agent_id": c.AGENT_ID,
                "agent_name": "bench",
                "requested_scopes": {"read": SCOPE, "write": EMPTY},
                "duration_minutes": 120,
            },
        )
        g = _post(
            f"{base}/v1/sessions/{sess['session_id']}/grant",
            {"granted_scopes": {"read": SCOPE, "write": EMPTY}, "profile": "remote", "audience": self.audience},
        )
        self.token = g["token"]
        self.pids = {"ref gateway": self.gateway.pid, "ref server": self.server.pid}

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(cmd, cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    @staticmethod
    def _seed(dst: Path, ours: Path) -> None:
        """The same items in the reference's table (same columns; values and tags as JSON text)."""
        src = sqlite3.connect(ours)
        rows = src.execute(
            "SELECT key, value, tags, sensitivity, source, created_at, updated_at, description FROM items"
        ).fetchall()
        src.close()
        db = sqlite3.connect(dst)
        db.executescript("""CREATE TABLE IF NOT EXISTS memory_items (key TEXT PRIMARY KEY, value TEXT NOT NULL,
            tags TEXT NOT NULL, sensitivity TEXT NOT NULL, source TEXT NOT NULL, created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL, description TEXT);""")
        db.executemany("INSERT INTO memory_items VALUES (?,?,?,?,?,?,?,?)", rows)
        db.commit()
        db.close()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--reference",
        default=os.environ.get("UOMP_REFERENCE_DIR"),
        help="a built checkout of 0xaicrypto/uomp-core (or UOMP_REFERENCE_DIR)",
    )
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not args.reference:
        raise SystemExit("give --reference PATH (a built uomp-core checkout; see this script's docstring)")
    root = Path(args.reference).resolve()
    for f in ("apps/server/dist/index.js", "apps/gateway/dist/index.js"):
        if not (root / f).exists():
            raise SystemExit(f"{root / f} is missing: build the reference first (pnpm install && pnpm build)")
    if not (1 <= args.clients <= 1000 and 0 < args.duration <= 600 and 1 <= args.rounds <= 10):
        raise SystemExit("--clients 1..1000, --duration 0..600, --rounds 1..10")
    rev = (
        subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or "?"
    )
    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"bench_reference: {c.machine_line()}")
    print(
        f"reference {root} at {rev}, node {node}; {args.clients} clients, {args.rounds} rounds x "
        f"{args.duration:g} s per phase, alternated"
    )
    print(
        f"reproduce: .venv/bin/python benchmarks/bench_reference.py --reference {root} --duration "
        f"{args.duration:g} --clients {args.clients} --rounds {args.rounds}"
    )
    ours = App("ours", {})
    ref: Reference | None = None
    try:
        ref = Reference(root, ours)
        keys = [f"preference.item{i:04d}" for i in range(200)]
        agent = ours.agent  # the same agent certificate for both gateways
        hdrs = {"Authorization": f"Bearer {ref.token}", "X-UOMP-Agent-Id": c.AGENT_ID}
        ref_reqs = {
            "gateway": [c.http_get(f"/v1/memory/{k}", host=f"localhost:{ref.gw_port}", headers=hdrs) for k in keys],
            "direct": [
                c.http_get(
                    f"/v1/memory/{k}", host=f"127.0.0.1:{ref.port}", headers={"Authorization": hdrs["Authorization"]}
                )
                for k in keys
            ],
        }
        ref_targets = {
            "gateway": c.Target("tls", port=ref.gw_port, ca=agent["ca"], cert=agent["cert"], key=agent["key"]),
            "direct": c.Target("tcp", port=ref.port),
        }
        runs: dict[str, list[dict[str, Any]]] = {
            "ours gateway": [],
            "ref gateway": [],
            "ours direct": [],
            "ref direct": [],
        }
        for _ in range(args.rounds):
            for kind in ("gateway", "direct"):
                ours.load(kind, args)
                r = c.run_load(
                    ref_targets[kind],
                    ref_reqs[kind],
                    clients=args.clients,
                    duration=args.duration,
                    warmup=1.0,
                    max_requests=2_000_000,
                    server_pid=ref.pids,
                )
                c.check_ok(f"reference {kind}", r)
                runs[f"ref {kind}"].append(r)
        runs["ours gateway"], runs["ours direct"] = ours.runs["gateway"], ours.runs["direct"]
    finally:
        if ref is not None:
            ref.stop()
        ours.stop()
    m = {k: c.merge_results(v) for k, v in runs.items()}
    print()
    c.print_table(
        [
            ("ours: gateway (mTLS) -> guard, audited", m["ours gateway"]),
            ("reference: gateway (mTLS) -> server", m["ref gateway"]),
            ("ours: guard direct (Unix socket)", m["ours direct"]),
            ("reference: server direct (HTTP)", m["ref direct"]),
        ]
    )
    og, rg = m["ours gateway"]["rps"], m["ref gateway"]["rps"]
    print(
        f"\nRATIOS ours/reference through the gateway req/s {og / rg:.2f} (aim >= 5: "
        f"{'met' if og / rg >= 5 else 'NOT met'}); direct {m['ours direct']['rps'] / m['ref direct']['rps']:.2f}; "
        f"gateway/direct ours {og / m['ours direct']['rps']:.2f}, reference {rg / m['ref direct']['rps']:.2f}; "
        f"p50 ours {m['ours gateway']['p50_ms']:.1f} ms vs reference {m['ref gateway']['p50_ms']:.1f} ms"
    )
    # The load generator shares the cores with both: req/s is diluted by its own CPU per request,
    # the same for both. CPU per answered request of each side's own processes is not.
    per = {k: _cpu_per_request(m[k]) for k in ("ours gateway", "ref gateway")}
    if all(v is not None for v in per.values()):
        o_us, r_us = per["ours gateway"], per["ref gateway"]
        assert o_us is not None and r_us is not None
        cli = _cpu_per_request(m["ours gateway"], "client_cpu")
        print(
            f"CPU per answered request through the gateway (its processes, all threads): ours {o_us:.0f} µs, "
            f"reference {r_us:.0f} µs, reference/ours x{r_us / o_us:.2f}"
            + (f"; the load generator {cli:.0f} µs per request beside ours" if cli is not None else "")
        )


def _cpu_per_request(r: dict[str, Any], field: str = "server_cpu") -> float | None:
    share, rps = r.get(field), r.get("rps")
    return share / rps * 1e6 if share and rps else None


if __name__ == "__main__":
    main()
