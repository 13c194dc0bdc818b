"""The local side: guard read-by-key under concurrent keep-alive load, Unix socket vs Local Profile TCP.

    .venv/bin/python benchmarks/bench_guard.py [--duration S] [--clients N] [--rounds R] [--no-external]

What runs where (2 processes, so client and server never share an event loop or a GIL):

* the server: ``GuardRunner`` (Unix socket ``$UOMP_HOME/guard.sock`` + Local Profile listener on a free
  127.0.0.1 port) in a child process, on a throwaway UOMP_HOME under /tmp seeded with 1,200 items;
* the client: the raw-asyncio-streams load generator of ``_common.py`` in another child process:
  ``--clients`` workers, each with its own HTTP/1.1 keep-alive connection, cycling through 200
  granted keys with ``GET /v1/memory/<key>`` and a Local Profile token (granted through the admin
  API with ``max_read_queries`` 10,000,000, so the quota never answers 429).

Each phase: 1 s warm-up, then ``--duration`` seconds timed; ``--rounds`` alternate Unix and TCP
(A B A B ...) and are merged (total requests / total time; percentiles: median of the rounds).
When ``wrk`` (or else ``ab -k``) is installed the TCP phase is also run with it, as a check that
the Python client is not the bottleneck; neither tool speaks Unix sockets. Server and client CPU
(share of one core, from /proc and getrusage) are printed so the bottleneck is visible.

Every answer is counted by status; a phase with under 99 % of 200s stops the script.
"""

from __future__ import annotations

import argparse

import _common as c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=10.0, help="timed seconds per phase and round (default 10)")
    ap.add_argument("--clients", type=int, default=50, help="concurrent keep-alive connections (default 50)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per listener (default 2)")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--max-requests", type=int, default=2_000_000, help="cap per phase (default 2,000,000)")
    ap.add_argument("--no-external", action="store_true", help="do not use wrk / ab even when installed")
    ap.add_argument("--keep", action="store_true", help="keep the throwaway UOMP_HOME")
    args = ap.parse_args()
    if not (1 <= args.clients <= 1000 and 0 < args.duration <= 600 and 1 <= args.rounds <= 10):
        raise SystemExit("--clients 1..1000, --duration 0..600 s, --rounds 1..10")

    print(f"bench_guard: {c.machine_line()}")
    with c.bench_home(args.keep) as paths:
        keys = c.seed_store(paths)
        port = c.free_port()
        with c.start_server(paths, tcp_port=port, what="guard") as srv:
            g = c.grant(paths, profile="local", audience=f"http://127.0.0.1:{port}")
            hdrs = {"Authorization": f"Bearer {g['token']}"}
            reqs = [c.http_get(f"/v1/memory/{k}", host=f"127.0.0.1:{port}", headers=hdrs) for k in keys]
            targets = {
                "unix": c.Target("unix", path=srv.info["guard_sock"]),
                "tcp": c.Target("tcp", port=srv.info["tcp_port"]),
            }
            names = {"unix": "guard GET /v1/memory/{key}, Unix socket", "tcp": "guard GET /v1/memory/{key}, TCP"}
            print(
                f"server pid {srv.pid}, guard.sock + 127.0.0.1:{port}; {len(keys)} keys cycled; "
                f"{args.clients} clients; {args.rounds} x {args.duration:.0f} s per listener"
            )
            results: dict[str, list[dict]] = {"unix": [], "tcp": []}
            for _ in range(args.rounds):
                for kind in ("unix", "tcp"):
                    r = c.run_load(
                        targets[kind],
                        reqs,
                        clients=args.clients,
                        duration=args.duration,
                        warmup=args.warmup,
                        max_requests=args.max_requests,
                        server_pid=srv.pid,
                    )
                    c.check_ok(names[kind], r)
                    results[kind].append(r)
            merged = {k: c.merge_results(v) for k, v in results.items()}
            lat1 = {
                k: c.run_load(
                    targets[k], reqs, clients=1, duration=min(args.duration, 5), warmup=0.5, server_pid=srv.pid
                )
                for k in ("unix", "tcp")
            }
            for k, r in lat1.items():
                c.check_ok(names[k] + " (1 client)", r)
            ext = None
            tool = None if args.no_external else c.external_tool()
            if tool:
                ext = c.run_external(
                    tool,
                    srv.info["tcp_port"],
                    [f"/v1/memory/{k}" for k in keys],
                    hdrs,
                    clients=args.clients,
                    duration=args.duration,
                    workdir=paths.home,
                )
            rss = srv.rss_kib()

    rows = [(names["unix"], merged["unix"]), (names["tcp"], merged["tcp"])]
    if ext is not None:
        rows.append((names["tcp"] + f" ({ext['tool']})", ext))
    rows += [
        ("1 client, Unix socket (unloaded latency)", lat1["unix"]),
        ("1 client, TCP (unloaded latency)", lat1["tcp"]),
    ]
    print()
    c.print_table(rows)
    if args.no_external:
        ext_note = "wrk/ab: disabled (--no-external)"
    elif not tool:
        ext_note = "wrk/ab: not installed, Python generator only"
    elif ext is None:
        ext_note = f"{tool}: failed, Python generator only"
    else:
        ext_note = f"calibration on TCP: {ext['tool']} (1 thread, {args.clients} connections)"
    print(f"\nload generator: python raw asyncio streams in a separate process; {ext_note}")
    print(f"server RSS at the end: {rss / 1024:.1f} MiB")
    u, t = merged["unix"], merged["tcp"]
    line = (
        f"RATIOS unix/tcp req/s {u['rps'] / t['rps']:.2f}, p50 {u['p50_ms']:.2f} vs {t['p50_ms']:.2f} ms "
        f"(unix/tcp {u['p50_ms'] / t['p50_ms']:.2f}), 1-client p50 unix/tcp "
        f"{lat1['unix']['p50_ms'] / lat1['tcp']['p50_ms']:.2f}"
    )
    if ext is not None:
        line += f"; python-client/{ext['tool'].split()[0]} on TCP req/s {t['rps'] / ext['rps']:.2f}"
    print(line)


if __name__ == "__main__":
    main()
