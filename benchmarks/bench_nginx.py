"""Our gateway beside nginx in front of the same guard, and the guard direct, one run.

    .venv/bin/python benchmarks/bench_nginx.py [--duration S] [--clients N] [--rounds R]
        [--nginx-workers N] [--reference PATH] [--baseline TREE | --baseline-plain]

nginx comes from Debian (``bash scripts/setup-bench.sh`` installs it; nothing else is needed).

One appliance is started as ``bench_gateway.py`` does (``GatewayRunner`` in a child process, the
guard in a supervised child of that one on ``$UOMP_HOME/guard.sock``, 1,200 items, one agent
certificate, a remote-profile session bound to it). The same guard is then reached three ways:

(1) ours: TLS 1.3 mTLS to the gateway (Bearer token, ``X-UOMP-Agent-Id``), which verifies
    certificate, CRL and token and forwards over the guard's Unix socket;
(2) nginx: ``ssl_protocols TLSv1.3``, ``ssl_verify_client on`` against the user's CA with its CRL
    (the gateway's own certificate and key), ``proxy_pass`` to an ``upstream`` block on the guard's
    Unix socket with ``keepalive`` (HTTP/1.1, ``Connection ""``). nginx does no token work: it
    passes the client's ``Authorization`` and ``X-UOMP-Agent-Id`` and sets the gateway's
    verified-identity assertion (``gateway/contract.py`` ``assertion_headers``). For this benchmark
    the identity headers are FIXED VALUES for the one benchmark agent (agent id, certificate and
    key thumbprints, the SHA-256 of the one token), since nginx cannot hash the token or compute
    ``x5t#S256``; the audit-only ones come from nginx's variables (``$ssl_client_serial``,
    ``$remote_addr``, ``$request_id``). Every ``X-UOMP-Verified-*`` name is set by nginx, so none
    sent by a client passes. The guard still checks the token (signature, session, ``cnf``
    binding against the asserted thumbprints) and audits every request, as for (1);
(3) direct: plain HTTP on the guard's Unix socket with the same assertion.

Load: ``_common.py``'s generator (another process), ``--clients`` keep-alive connections cycling
``GET /v1/memory/<key>`` over 200 keys; the rounds interleave (1) (2) (3), odd rounds in the
reverse order (ABBA: no path is always first after a pause or last in a round). Then unloaded latency
(1 client) of each. ``srv cpu`` counts the front's processes and the guard's. RATIOS: ours/nginx,
nginx/direct, ours/direct (req/s), p50 and p99 of each, unloaded p50 overhead over direct. MACHINE
PROBES, at the start and at the end: the CPU a fixed workload takes (``_common.speed_probe``) and a
wake-up round trip between two processes (``_common.wakeup_probe``): the state of a shared machine
during the run, beside which its ratios are read.

``--reference PATH`` (or UOMP_REFERENCE_DIR): also the TypeScript reference's gateway, in the same
rounds (``bench_reference.py``'s ``Reference``); without it the command to run is printed.

``--baseline TREE``: a second appliance served by another checkout's code (``bench_gateway.py``'s
``--baseline``: e.g. ``git worktree add --detach /tmp/base main``), its gateway loaded in the same
rounds as (1) (2) (3); the RATIOS line then adds this/baseline through the gateways and the
baseline's own ours/nginx, so a change to the gateway is compared with nginx and with the code before
it on the same noisy machine at the same time. ``--baseline-plain``: the baseline is this checkout run
as plain Python (``UOMP_NATIVE=0``: gateway/native.py), the compiled request path against itself
uncompiled.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as c
from bench_gateway import Appliance

from gateway import ca_store, contract

AIM_OURS_NGINX = 0.8  # issue 34
AIM_P50_OVERHEAD_MS = 0.5  # unloaded, over direct


def _nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


class Nginx:
    """nginx in the foreground (``daemon off``), its own prefix, config and logs under /tmp."""

    def __init__(self, app: Appliance, workers: int) -> None:
        binary = _nginx_binary()
        if binary is None:
            raise SystemExit("nginx is not installed: bash scripts/setup-bench.sh")
        self.dir = Path(tempfile.mkdtemp(prefix="uomp-nginx-", dir="/tmp"))
        self.port = c.free_port()
        paths, agent = app.paths, app.agent
        token = app.token
        asserted = contract.assertion_headers(
            token=token,
            agent_id=agent["agent_id"],
            listener="mtls",
            via="gateway:mtls:nginx",
            x5t=agent["x5t"],
            jkt=agent["jkt"],
        )
        fixed = {k: v for k, v in asserted.items() if k.lower().startswith(contract.VERIFIED_PREFIX)}
        fixed[contract.VERIFIED_SERIAL_HEADER] = "$ssl_client_serial"
        fixed[contract.VERIFIED_CLIENT_HEADER] = "$remote_addr"
        fixed[contract.VERIFIED_REQUEST_ID_HEADER] = "$request_id"
        missing = contract.VERIFIED_HEADERS - {k.lower() for k in fixed}
        assert not missing, missing  # every verified name set here: none from a client passes
        sets = "\n".join(f'            proxy_set_header {k} "{v}";' for k, v in fixed.items())
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
        d = self.dir
        conf = f"""
{user}
worker_processes {workers};
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_timeout 75s;
    keepalive_requests 10000000;
    upstream guard {{
        server unix:{app.srv.info["guard_sock"]};
        keepalive 256;
        keepalive_requests 10000000;
    }}
    server {{
        listen 127.0.0.1:{self.port} ssl;
        ssl_protocols TLSv1.3;
        ssl_certificate {ca_store.server_cert_path(paths)};
        ssl_certificate_key {ca_store.server_key_path(paths)};
        ssl_client_certificate {ca_store.ca_cert_path(paths)};
        ssl_crl {ca_store.crl_path(paths)};
        ssl_verify_client on;
        location / {{
            proxy_pass http://guard;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host localhost;
{sets}
        }}
    }}
}}
"""
        (d / "nginx.conf").write_text(conf)
        self.proc = subprocess.Popen(
            [binary, "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")],
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"nginx exited (rc={self.proc.returncode}): {(d / 'error.log').read_text()[-2000:]}")
            try:
                socket.create_connection((c.LOOPBACK, self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit("nginx did not listen within 20 s") from None
                time.sleep(0.1)
        self.target = c.Target("tls", port=self.port, ca=agent["ca"], cert=agent["cert"], key=agent["key"])
        self.reqs = app.reqs["gateway"]  # the agent's requests: token + agent header, as to ours

    def pids(self, guard_pid: int) -> dict[str, int]:
        """nginx's master and workers (children of the master) and the guard."""
        out = {"nginx master": self.proc.pid}
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            kids = []
        for i, k in enumerate(kids):
            out[f"nginx worker {i}"] = int(k)
        out["guard"] = guard_pid
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: workers finish, then the master
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _cpu_ratio(this: dict[str, Any], base: dict[str, Any]) -> str:
    """The gateway process's CPU per request, this tree / the baseline's (``x0.90 (300/333 µs)``)."""

    def per_request(r: dict[str, Any]) -> float | None:
        share = (r.get("server_cpu_parts") or {}).get("gateway")
        return share / r["rps"] * 1e6 if share is not None and r.get("rps") else None

    a, b = per_request(this), per_request(base)
    return f"x{a / b:.2f} ({a:.0f}/{b:.0f} µs)" if a is not None and b else "-"


def _cpu_per_request(r: dict[str, Any] | None) -> tuple[float, float, float] | None:
    """(total, front, guard) CPU µs per request of a phase: the front is the gateway or nginx's processes."""
    if r is None or not r.get("rps"):
        return None
    parts = r.get("server_cpu_parts") or {}
    guard = parts.get("guard", 0.0)
    front = sum(v for k, v in parts.items() if k != "guard")
    return (front + guard) / r["rps"] * 1e6, front / r["rps"] * 1e6, guard / r["rps"] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=8.0, help="timed seconds per phase and round (default 8)")
    ap.add_argument("--clients", type=int, default=50, help="concurrent keep-alive connections (default 50)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="interleaved rounds (default 4: with 2, a slow hour of a shared VM hides a 10%% change)",
    )
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--max-requests", type=int, default=2_000_000)
    ap.add_argument("--nginx-workers", type=int, default=1, help="nginx worker_processes (default 1, like ours)")
    ap.add_argument("--reference", default=os.environ.get("UOMP_REFERENCE_DIR"), help="a built uomp-core checkout")
    ap.add_argument("--keep", action="store_true", help="keep the throwaway UOMP_HOME")
    ap.add_argument("--baseline", type=Path, help="another checkout whose gateway runs in the same rounds")
    ap.add_argument(
        "--baseline-plain",
        action="store_true",
        help="the baseline is this checkout as plain Python (UOMP_NATIVE=0): compiled against not compiled",
    )
    args = ap.parse_args()
    if args.baseline is not None and not (args.baseline / "benchmarks" / "_common.py").exists():
        raise SystemExit(f"--baseline {args.baseline}: not a checkout of this project")
    if args.baseline_plain:
        if args.baseline is not None:
            raise SystemExit("--baseline and --baseline-plain: one or the other")
        args.baseline = Path(__file__).resolve().parent.parent
    if not (1 <= args.clients <= 1000 and 0 < args.duration <= 600 and 1 <= args.rounds <= 10):
        raise SystemExit("--clients 1..1000, --duration 0..600, --rounds 1..10")
    if not 1 <= args.nginx_workers <= 8:
        raise SystemExit("--nginx-workers 1..8")
    if _nginx_binary() is None:
        raise SystemExit("nginx is not installed: bash scripts/setup-bench.sh")
    nginx_v = subprocess.run([_nginx_binary() or "nginx", "-v"], capture_output=True, text=True).stderr.strip()
    print(f"bench_nginx: {c.machine_line()}")
    probe_start = (c.speed_probe(), c.wakeup_probe())
    print(
        f"{nginx_v}, {args.nginx_workers} worker(s); {args.clients} clients; {args.rounds} rounds x "
        f"{args.duration:g} s per path, interleaved"
    )
    app: Appliance | None = None
    base: Appliance | None = None
    ngx: Nginx | None = None
    ref: Any = None
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "nginx": [], "direct": [], "reference": [], "baseline": []}
    unloaded: dict[str, dict[str, Any]] = {}
    try:
        app = Appliance(label="appliance", max_connections=None, keep=args.keep)
        hdr = app.reqs["gateway"][0].decode("latin-1")
        app.token = hdr.split("Authorization: Bearer ", 1)[1].split("\r\n", 1)[0]  # type: ignore[attr-defined]
        ngx = Nginx(app, args.nginx_workers)
        if args.baseline is not None:
            base = Appliance(
                label=f"baseline {args.baseline}",
                max_connections=None,
                keep=args.keep,
                tree=None if args.baseline_plain else args.baseline.resolve(),
                **({"env": {"UOMP_NATIVE": "0"}} if args.baseline_plain else {}),
            )
        guard_pid = int(app.srv.info["guard_pid"])
        ref_load = None
        if args.reference:
            from bench_reference import Reference

            ref = Reference(Path(args.reference).resolve(), app)  # type: ignore[arg-type]
            agent = app.agent
            rh = {"Authorization": f"Bearer {ref.token}", "X-UOMP-Agent-Id": c.AGENT_ID}
            ref_reqs = [c.http_get(f"/v1/memory/{k}", host=f"localhost:{ref.gw_port}", headers=rh) for k in app.keys]
            ref_target = c.Target("tls", port=ref.gw_port, ca=agent["ca"], cert=agent["cert"], key=agent["key"])
            ref_load = (ref_target, ref_reqs)

        def nginx_load(clients: int, duration: float, warmup: float) -> dict[str, Any]:
            assert ngx is not None
            r = c.run_load(
                ngx.target,
                ngx.reqs,
                clients=clients,
                duration=duration,
                warmup=warmup,
                max_requests=args.max_requests,
                server_pid=ngx.pids(guard_pid),
            )
            c.check_ok(f"nginx GET by key ({clients} clients)", r)
            return r

        def reference_load() -> dict[str, Any]:
            assert ref_load is not None
            r = c.run_load(
                ref_load[0],
                ref_load[1],
                clients=args.clients,
                duration=args.duration,
                warmup=args.warmup,
                max_requests=args.max_requests,
                server_pid=ref.pids,
            )
            c.check_ok("reference gateway", r)
            return r

        phases: list[tuple[str, Any]] = [
            ("ours", lambda: app.keepalive("gateway", args)),
            ("nginx", lambda: nginx_load(args.clients, args.duration, args.warmup)),
            ("direct", lambda: app.keepalive("direct", args)),
        ]
        if base is not None:
            phases.append(("baseline", lambda: base.keepalive("gateway", args)))
        if ref_load is not None:
            phases.append(("reference", reference_load))
        for i in range(args.rounds):
            # odd rounds in the reverse order (A B C D, D C B A, ...): a drift of the machine within a
            # round, or a phase warming the next, favours no path
            for name, phase in phases if i % 2 == 0 else phases[::-1]:
                runs[name].append(phase())
        one = min(args.duration, 5)
        unloaded["ours"] = app.keepalive("gateway", args, clients=1, duration=one, warmup=0.5)
        unloaded["nginx"] = nginx_load(1, one, 0.5)
        unloaded["direct"] = app.keepalive("direct", args, clients=1, duration=one, warmup=0.5)
        if base is not None:
            unloaded["baseline"] = base.keepalive("gateway", args, clients=1, duration=one, warmup=0.5)
            unloaded["baseline direct"] = base.keepalive("direct", args, clients=1, duration=one, warmup=0.5)
    finally:
        if ref is not None:
            ref.stop()
        if ngx is not None:
            ngx.stop()
        if base is not None:
            base.stop()
        if app is not None:
            app.stop()

    m = {k: c.merge_results(v) for k, v in runs.items() if v}
    print()
    rows = [
        (f"(1) ours: gateway TLS 1.3 mTLS, {args.clients} cl.", m["ours"]),
        (f"(2) nginx: TLS 1.3 mTLS, keepalive unix, {args.clients} cl.", m["nginx"]),
        (f"(3) direct: guard Unix socket, {args.clients} cl.", m["direct"]),
    ]
    if "reference" in m:
        rows.append((f"reference gateway (mTLS), {args.clients} cl.", m["reference"]))
    if "baseline" in m:
        rows.append((f"baseline tree's gateway, {args.clients} cl.", m["baseline"]))
    rows += [
        ("(1) ours, 1 client (unloaded)", unloaded["ours"]),
        ("(2) nginx, 1 client (unloaded)", unloaded["nginx"]),
        ("(3) direct, 1 client (unloaded)", unloaded["direct"]),
    ]
    if "baseline" in unloaded:
        rows += [
            ("baseline gateway, 1 client (unloaded)", unloaded["baseline"]),
            ("baseline direct, 1 client (unloaded)", unloaded["baseline direct"]),
        ]
    c.print_table(rows)
    print(
        f"\nMACHINE PROBES (lower is faster; _common.py): CPU of a fixed workload {probe_start[0]:.0f} ms at "
        f"the start, {c.speed_probe():.0f} at the end; a wake-up round trip {probe_start[1]:.0f} µs at the "
        f"start, {c.wakeup_probe():.0f} at the end"
    )
    o, n, d = m["ours"], m["nginx"], m["direct"]
    over_ours = unloaded["ours"]["p50_ms"] - unloaded["direct"]["p50_ms"]
    over_nginx = unloaded["nginx"]["p50_ms"] - unloaded["direct"]["p50_ms"]
    print(
        f"AIMS (issue 34): ours/nginx req/s {_ratio(o['rps'], n['rps'])} (aim >= {AIM_OURS_NGINX}: "
        f"{'met' if o['rps'] >= AIM_OURS_NGINX * n['rps'] else 'NOT met'}); unloaded p50 overhead over direct "
        f"{over_ours:+.2f} ms (aim <= {AIM_P50_OVERHEAD_MS} ms: "
        f"{'met' if over_ours <= AIM_P50_OVERHEAD_MS else 'NOT met'}; nginx {over_nginx:+.2f} ms)"
    )
    line = (
        f"RATIOS req/s ours/nginx {_ratio(o['rps'], n['rps'])}, nginx/direct {_ratio(n['rps'], d['rps'])}, "
        f"ours/direct {_ratio(o['rps'], d['rps'])}; p50 ours/nginx/direct {o['p50_ms']:.2f}/{n['p50_ms']:.2f}/"
        f"{d['p50_ms']:.2f} ms, p99 {o['p99_ms']:.2f}/{n['p99_ms']:.2f}/{d['p99_ms']:.2f} ms; unloaded p50 "
        f"{unloaded['ours']['p50_ms']:.2f}/{unloaded['nginx']['p50_ms']:.2f}/{unloaded['direct']['p50_ms']:.2f} ms"
    )
    if "baseline" in m:
        b, ub = m["baseline"], unloaded["baseline"]
        line += (
            f"; BASELINE {'plain Python (UOMP_NATIVE=0)' if args.baseline_plain else args.baseline}: "
            f"gateway req/s this/baseline x{o['rps'] / b['rps']:.2f} "
            f"(baseline/nginx {_ratio(b['rps'], n['rps'])}), gateway cpu/request this/baseline "
            f"{_cpu_ratio(o, b)}, unloaded p50 overhead over its own direct this {over_ours:+.2f} / baseline "
            f"{ub['p50_ms'] - unloaded['baseline direct']['p50_ms']:+.2f} ms"
        )
    if "reference" in m:
        line += f"; ours/reference {_ratio(o['rps'], m['reference']['rps'])} (aim >= 5)"
    print(line)
    cpu = {
        k: _cpu_per_request(r) for k, r in (("ours", o), ("nginx", n), ("direct", d), ("baseline", m.get("baseline")))
    }
    if cpu["ours"] is not None and cpu["nginx"] is not None:
        # On a machine whose cores are the limit (2 shared cores), req/s go as 1 / (all the CPU a request costs).
        parts = ", ".join(
            f"{k} {v[0]:.0f} µs (front {v[1]:.0f} + guard {v[2]:.0f})" for k, v in cpu.items() if v is not None
        )
        print(
            f"CPU per request (front + guard, 50 clients): {parts}; nginx/ours {cpu['nginx'][0] / cpu['ours'][0]:.2f} "
            "(the req/s ratio a CPU-bound machine would give)"
        )
    if "reference" not in m:
        print(
            "reference: not in this run (no --reference); build uomp-core as bench_reference.py's docstring says, "
            f"then: .venv/bin/python benchmarks/bench_nginx.py --reference /tmp/uomp-core --duration "
            f"{args.duration:g} --rounds {args.rounds}"
        )


if __name__ == "__main__":
    main()
