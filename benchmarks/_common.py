"""Shared helpers for the load benchmarks (bench_guard, bench_gateway, bench_tokens).

Nothing here is a test and nothing asserts a timing: the scripts print what they measured in one
run and the ratios between figures of that same run.

* a throwaway ``UOMP_HOME`` under /tmp (:func:`make_home`), seeded with memory items
  (:func:`seed_store`) and, for the gateway, the user CA and an agent certificate;
* the server under test in a **child process** (:class:`ServerProc`: ``python _common.py serve``),
  so the load generator never shares its event loop or GIL, and its RSS and CPU time can be read
  from ``/proc/<pid>``. With the gateway it is laid out like ``uomp gateway start``: the gateway in
  that process and the guard in a supervised child of it (``GuardProcess``), both processes'
  CPU time counted; ``--layout one-process`` runs both in one asyncio loop instead (the layout
  before the guard got its own process);
* session create + grant through the real admin API on the guard's Unix socket (:func:`grant`);
* a load generator in **another child process** (``python _common.py load``): N workers, each with
  its own keep-alive HTTP/1.1 connection over raw asyncio streams (Unix socket, TCP or TLS 1.3 with a
  client certificate), a warm-up, then a timed phase bounded in time *and* request count, with
  per-request latencies; it also reads the server's CPU time from /proc around the timed phase.
  Other modes: new TLS connections per second (handshake + one request + close) and holding N idle
  keep-alive TLS connections (for an RSS reading);
* ``wrk`` / ``ab -k`` when installed (loopback TCP only: neither speaks Unix sockets or presents
  client certificates), as a calibration of the Python client.

Only loopback addresses are used. Every loop is bounded in count and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
LOOPBACK = "127.0.0.1"
SNI = "localhost"  # the gateway certificate names localhost and 127.0.0.1
HOST_HEADER = "localhost"
NOW_ISO = "2026-07-12T10:00:00Z"
AGENT_ID = "bench_agent"
MAX_RECONNECTS_PER_WORKER = 50
HARD_CAP_REQUESTS = 5_000_000  # per load run, whatever the options say


# ----------------------------------------------------------------------------- home + data


def make_home(prefix: str = "uomp-lb-") -> Any:
    """A fresh, initialised UOMP_HOME under /tmp (short path: Unix socket paths max 108 bytes)."""
    from gateway.config import Paths
    from gateway.keys import init_home

    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    paths = Paths(home)
    init_home(paths)
    return paths


# A seal as ``uomp secrets seal`` did before the database formats were recorded (SQLCipher's defaults).
_SEAL_OLD_FORMAT = """
import sys
from pathlib import Path
from gateway.atrest import auditdb, memdb, migrate
from gateway.config import Paths
paths = Paths(Path(sys.argv[1]))
migrate.seal(paths, passphrase=Path(sys.argv[2]).read_text().rstrip("\\n"), profile=memdb.LEGACY)
memdb.ensure_encrypted(paths, memdb.memory_key(paths))
auditdb.ensure_encrypted(paths, auditdb.audit_key(paths))
"""


def seal_home(paths: Any, passphrase: str = "bench passphrase, not a secret", *, old_format: bool = False) -> str:
    """Seal ``paths``'s keys by a passphrase (``uomp secrets seal``: memory.db and audit.db become
    SQLCipher files); return the passphrase file, also set as UOMP_PASSPHRASE_FILE in this process
    (its admin calls unlock the sealed admin credential with it; plain homes ignore it).
    ``old_format``: the databases in SQLCipher's default format (HMAC-SHA512), as a home sealed
    before the formats were recorded (gateway/atrest/memdb.py)."""
    pf = paths.home / "bench-passphrase"
    pf.write_text(passphrase + "\n")
    pf.chmod(0o600)
    cmd = [PYTHON, "-m", "gateway.cli.main", "--home", str(paths.home), "secrets", "seal", "--passphrase-file", str(pf)]
    if old_format:
        cmd = [PYTHON, "-c", _SEAL_OLD_FORMAT, str(paths.home), str(pf)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=120)
    os.environ["UOMP_PASSPHRASE_FILE"] = str(pf)
    return str(pf)


def remove_home(paths: Any, keep: bool = False) -> None:
    if keep:
        print(f"(kept {paths.home})")
    else:
        shutil.rmtree(paths.home, ignore_errors=True)


@contextlib.contextmanager
def bench_home(keep: bool = False, prefix: str = "uomp-lb-") -> Iterator[Any]:
    paths = make_home(prefix)
    try:
        yield paths
    finally:
        remove_home(paths, keep)


def seed_store(paths: Any, n_keys: int = 200, n_other: int = 1000) -> list[str]:
    """``n_keys`` readable items (tag ``preference``) plus ``n_other`` items under other tags.

    Returns the readable keys (the workload cycles through them)."""
    from gateway.guard.items import MemoryItem
    from gateway.guard.store import MemoryStore

    items = []
    keys = []
    for i in range(n_keys):
        k = f"preference.item{i:04d}"
        keys.append(k)
        items.append(
            MemoryItem(
                k,
                {"value": f"setting number {i}", "n": i, "on": i % 2 == 0},
                ("preference", "ui"),
                "low",
                "user",
                NOW_ISO,
                NOW_ISO,
                f"bench item {i}",
            )
        )
    for i in range(n_other):
        items.append(MemoryItem(f"notes.n{i:05d}", f"note {i} " * 8, ("notes",), "medium", "user", NOW_ISO, NOW_ISO))
    store = MemoryStore(paths.memory_db)
    try:
        store.put_many(items, replace=True)
    finally:
        store.close()
    return keys


def issue_agent(paths: Any, agent_id: str = AGENT_ID) -> dict[str, str]:
    """User CA (+ gateway cert + CRL) if missing, then an agent key + certificate. Paths and thumbprints."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from gateway import ca_store
    from gateway.core import jose

    ca_store.init_all(paths)
    files = ca_store.issue_with_key(paths, agent_id, paths.home / "agents-bench" / agent_id)
    cert = x509.load_pem_x509_certificate(files.cert_file.read_bytes())
    return {
        "agent_id": agent_id,
        "cert": str(files.cert_file),
        "key": str(files.key_file),
        "ca": str(files.ca_file),
        "x5t": jose.cert_thumbprint(cert.public_bytes(serialization.Encoding.DER)),
        "jkt": jose.key_thumbprint(cert.public_key()),
    }  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- admin API


async def _admin_call(paths: Any, method: str, path: str, body: Any) -> tuple[int, Any]:
    import aiohttp

    from gateway import keys

    headers = {"Authorization": f"Bearer {keys.load_admin(paths)}"}
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(paths.guard_sock)), timeout=timeout) as s,
        s.request(method, "http://guard" + path, headers=headers, json=body) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


def grant(
    paths: Any,
    *,
    agent_id: str = AGENT_ID,
    read: dict[str, Any] | None = None,
    max_read_queries: int = 10_000_000,
    duration_minutes: int = 120,
    **extra: Any,
) -> dict[str, Any]:
    """Create + grant a session through the running guard's admin API; returns the grant answer."""
    read = read or {"tags": ["preference"], "keys": []}
    body = {
        "agent_id": agent_id,
        "agent_name": "benchmark agent",
        "requested_scopes": {"read": read},
        "duration_minutes": duration_minutes,
    }

    async def go() -> dict[str, Any]:
        status, created = await _admin_call(paths, "POST", "/v1/sessions", body)
        if status != 201:
            raise SystemExit(f"session create failed: {status} {created}")
        gbody = {"granted_scopes": {"read": read}, "limits": {"max_read_queries": max_read_queries}, **extra}
        status, granted = await _admin_call(paths, "POST", f"/v1/sessions/{created['session_id']}/grant", gbody)
        if status != 200:
            raise SystemExit(f"grant failed: {status} {granted}")
        return dict(granted)

    return asyncio.run(go())


# ----------------------------------------------------------------------------- /proc


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all threads), seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_by_role(pids: dict[str, int] | None) -> dict[str, float] | None:
    return {role: proc_cpu_seconds(pid) for role, pid in pids.items()} if pids else None


def cpu_shares(
    cpu0: dict[str, float] | None, cpu1: dict[str, float] | None, elapsed: float
) -> tuple[float | None, dict[str, float]]:
    """(total share of one core, share per role) between two :func:`cpu_by_role` readings."""
    if cpu0 is None or cpu1 is None or elapsed <= 0:
        return None, {}
    parts = {role: (cpu1[role] - cpu0[role]) / elapsed for role in cpu0}
    return sum(parts.values()), parts


def proc_status_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


# ----------------------------------------------------------------------------- server child


@dataclasses.dataclass
class ServerProc:
    """The guard (optionally + gateway) running in a child process of this script."""

    proc: subprocess.Popen[str]
    info: dict[str, Any]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> dict[str, int]:
        """Every process of the server under test, by role (their CPU time is summed)."""
        if self.info.get("guard_pid"):
            return {"gateway": self.pid, "guard": int(self.info["guard_pid"])}
        return {"server": self.pid}

    def rss_kib(self) -> int:
        return proc_status_kib(self.pid)

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.pid)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> ServerProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_json_line(proc: subprocess.Popen[str], timeout: float, what: str) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"{what}: no answer within {timeout:.0f} s")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"{what}: child exited (rc={proc.wait()})")
        line = line.strip()
        if line.startswith("{"):
            return dict(json.loads(line))


def start_server(
    paths: Any,
    *,
    gateway: bool = False,
    tcp_port: int | None = None,
    max_connections: int | None = None,
    ssl_read_buffer_kib: int | None = None,
    quota_block: int | None = None,
    profile: str | None = None,
    what: str = "server",
    layout: str = "split",
    gateway_config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    tree: Path | None = None,
) -> ServerProc:
    """Start the guard alone (``GuardRunner``), or the appliance, in a child process.

    The appliance (``gateway=True``) is laid out like ``uomp gateway start``: ``GatewayRunner`` in the
    child and the guard in a supervised grandchild (``layout="split"``), or, for comparison, both in
    one asyncio loop (``layout="one-process"``). ``tcp_port``: also serve the Local Profile on
    127.0.0.1:tcp_port. ``ssl_read_buffer_kib`` (asyncio's per-connection TLS read buffer; the
    product sets 32) and ``quota_block`` (a fixed QuotaLedger reservation block instead of the
    product's adaptive one) are experiment knobs of the benchmark, never set by default.
    ``gateway_config``: GatewayConfig fields to set (e.g. ``tunnel_origin_port=0``); the info line
    then also carries ``tunnel_port``. ``env``: variables set for the server and its guard child
    (e.g. ``UOMP_UVLOOP=0``: the levers' switches, bench_levers.py). ``tree``: another checkout of
    this project whose code serves (its own ``benchmarks/_common.py serve``, the tree first on
    ``PYTHONPATH`` for the server and its guard child); the home is made by this tree's code."""
    script = (tree / "benchmarks" / "_common.py") if tree is not None else Path(__file__).resolve()
    cmd = [PYTHON, str(script), "serve", "--home", str(paths.home)]
    if gateway:
        cmd += ["--gateway", "--layout", layout]
    if tcp_port is not None:
        cmd += ["--tcp-port", str(tcp_port)]
    if max_connections is not None:
        cmd += ["--max-connections", str(max_connections)]
    if ssl_read_buffer_kib is not None:
        cmd += ["--ssl-read-buffer-kib", str(ssl_read_buffer_kib)]
    if quota_block is not None:
        cmd += ["--quota-block", str(quota_block)]
    if profile:
        cmd += ["--profile", profile]
    if gateway_config:
        cmd += ["--gateway-config", json.dumps(gateway_config)]
    child_env = {**os.environ, **env} if env else None
    if tree is not None:
        child_env = {**(child_env or os.environ), "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=child_env)
    try:
        info = _read_json_line(proc, 60, what)
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise
    return ServerProc(proc, info)


async def _serve(args: argparse.Namespace) -> None:
    import logging

    from gateway.config import GatewayConfig, GuardConfig, Paths
    from gateway.guard.server import GuardRunner
    from gateway.remote.server import GatewayRunner
    from gateway.supervisor import GuardProcess

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.ssl_read_buffer_kib:
        # Experiment only (bench_gateway --experiments): asyncio's SSLProtocol allocates and zero-fills
        # a read buffer of max_size bytes per connection (256 KiB in CPython 3.11; the gateway lowers
        # it to transport.TLS_READ_BUFFER_BYTES, and never raises it: so set both).
        from asyncio import sslproto

        from gateway.remote import transport

        transport.TLS_READ_BUFFER_BYTES = args.ssl_read_buffer_kib * 1024
        sslproto.SSLProtocol.max_size = args.ssl_read_buffer_kib * 1024
    _quota_knob(args.quota_block)
    paths = Paths(Path(args.home))
    serve_tcp = args.tcp_port is not None
    info: dict[str, Any] = {"pid": os.getpid(), "guard_sock": str(paths.guard_sock)}
    guard: GuardRunner | None = None
    child: GuardProcess | None = None
    if args.gateway and args.layout == "split":
        # like `uomp gateway start`: the guard in a supervised child process (see _guard_child)
        cmd = [
            PYTHON,
            str(Path(__file__).resolve()),
            "guard-child",
            "--parent",
            str(os.getpid()),
            "--home",
            str(paths.home),
        ]
        if serve_tcp:
            cmd += ["--tcp-port", str(args.tcp_port)]
        if args.quota_block:
            cmd += ["--quota-block", str(args.quota_block)]
        child = GuardProcess(paths, cmd, output=lambda line: print(line, file=sys.stderr, flush=True))
        await child.start()
        child.supervise()
        info.update(guard_pid=child.pid, tcp_port=args.tcp_port)
    elif args.gateway and args.layout == "gateway-only":
        pass  # a second gateway worker: its upstream (another appliance's guard) is in --gateway-config
    else:
        gcfg = GuardConfig(tcp_port=args.tcp_port if serve_tcp else 0, serve_tcp=serve_tcp)
        guard = GuardRunner(paths, gcfg, serve_tcp=serve_tcp)
        await guard.start()
        info["tcp_port"] = guard.tcp_port
    info["layout"] = args.layout if args.gateway else "guard"
    gw: GatewayRunner | None = None
    try:
        if args.gateway:
            cfg = GatewayConfig(listen_port=0)
            if args.max_connections:
                cfg = dataclasses.replace(cfg, max_connections=args.max_connections)
            if args.gateway_config:
                cfg = dataclasses.replace(cfg, **json.loads(args.gateway_config))
            gw = GatewayRunner(paths, cfg)
            await gw.start()
            info.update(
                gateway_port=gw.port,
                max_connections=cfg.max_connections,
                keepalive_timeout_seconds=cfg.keepalive_timeout_seconds,
                tunnel_port=gw.tunnel_port,
                metrics_port=gw.metrics_port,
                fd_limit=getattr(gw, "fd_limit", None),
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(json.dumps(info), flush=True)
        parent = os.getppid()

        async def orphan_watch() -> None:  # stop within a second if the benchmark script went away
            while os.getppid() == parent:
                await asyncio.sleep(1.0)
            stop.set()

        watch = loop.create_task(orphan_watch())
        # bounded: a benchmark server never lives longer than this
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.max_lifetime)
        watch.cancel()
    finally:
        if gw is not None:
            await gw.stop()
        if guard is not None:
            await guard.stop()
        if child is not None:
            await child.stop()


def _quota_knob(block: int | None) -> None:
    if block:
        # Experiment only: a fixed reservation block (the product adapts it to each session's limit).
        from gateway.core.quota import QuotaLedger

        kwdefaults = QuotaLedger.__init__.__kwdefaults__
        assert kwdefaults is not None
        kwdefaults["block"] = block


def _guard_child(args: argparse.Namespace) -> None:
    """The guard as the appliance's child process: what ``uomp guard serve`` runs (``run_guard``), with
    the benchmark's knob applied first and logging at WARNING like the rest of the benchmark."""
    import logging

    from gateway import eventloop
    from gateway.childboot import die_with_parent
    from gateway.config import GuardConfig, Paths
    from gateway.guard.server import run_guard

    if not die_with_parent(args.parent):
        raise SystemExit(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _quota_knob(args.quota_block)
    serve_tcp = args.tcp_port is not None
    cfg = GuardConfig(tcp_port=args.tcp_port if serve_tcp else 0, serve_tcp=serve_tcp)
    eventloop.run(run_guard(Paths(Path(args.home)), cfg, serve_tcp=serve_tcp))


# ----------------------------------------------------------------------------- HTTP over streams


def http_get(
    path: str, *, host: str = HOST_HEADER, headers: dict[str, str] | None = None, close: bool = False
) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


_CL = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """One HTTP/1.1 response: (status, body, server_will_close)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    m = _CL.search(head)
    if m is not None:
        body = await reader.readexactly(int(m.group(1)))
    elif _CHUNKED.search(head):
        parts = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(parts)
    else:
        body = await reader.read(-1)
        return status, body, True
    return status, body, bool(_CLOSE.search(head))


@dataclasses.dataclass
class Target:
    """Where the load goes: ``unix`` (path), ``tcp`` or ``tls`` (port on 127.0.0.1)."""

    kind: str
    path: str | None = None
    port: int | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def client_context(self) -> ssl.SSLContext | None:
        if self.kind != "tls":
            return None
        from gateway.client.tls import build_client_context

        assert self.ca is not None
        return build_client_context(self.ca, self.cert, self.key)

    async def open(self, ctx: ssl.SSLContext | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.kind == "unix":
            assert self.path is not None
            return await asyncio.open_unix_connection(self.path)
        if self.kind == "tcp":
            return await asyncio.open_connection(LOOPBACK, self.port)
        return await asyncio.open_connection(
            LOOPBACK, self.port, ssl=ctx, server_hostname=SNI, ssl_handshake_timeout=10
        )


def summarize(lat: Sequence[float], count: int, elapsed: float) -> dict[str, float]:
    s = sorted(lat)
    n = len(s)

    def pct(p: float) -> float:
        return s[min(n - 1, max(0, round(p / 100 * n) - 1))] * 1000 if n else float("nan")

    return {
        "rps": count / elapsed if elapsed > 0 else 0.0,
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "max_ms": s[-1] * 1000 if n else float("nan"),
        "mean_ms": statistics.fmean(s) * 1000 if n else float("nan"),
    }


async def _close(writer: asyncio.StreamWriter, timeout: float = 2.0) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), timeout)


async def _load(spec: dict[str, Any]) -> dict[str, Any]:
    """Keep-alive load: ``clients`` connections, warm-up, then a timed phase bounded in time and count."""
    target = Target(**spec["target"])
    ctx = target.client_context()
    reqs = [r.encode("latin-1") for r in spec["requests"]]
    clients, duration, warmup = int(spec["clients"]), float(spec["duration"]), float(spec["warmup"])
    max_requests = min(int(spec.get("max_requests") or HARD_CAP_REQUESTS), HARD_CAP_REQUESTS)
    server_pids = spec.get("server_pids")
    statuses: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    lat: list[float] = []
    state = {"count": 0, "phase": "warmup", "reconnects": 0}
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None] = [None] * clients

    sem = asyncio.Semaphore(32)

    async def connect(i: int) -> None:
        async with sem:
            try:
                conns[i] = await target.open(ctx)
            except (OSError, ssl.SSLError, TimeoutError) as exc:
                errors[f"connect:{type(exc).__name__}"] += 1

    await asyncio.wait_for(asyncio.gather(*(connect(i) for i in range(clients))), 120)
    t_end = [0.0]

    async def worker(i: int) -> None:
        conn = conns[i]
        if conn is None:
            return
        reader, writer = conn
        k = i
        reconnects = 0
        perf = time.perf_counter
        while True:
            timed = state["phase"] == "timed"
            if timed:
                if perf() >= t_end[0] or state["count"] >= max_requests:
                    break
                state["count"] += 1
            elif state["phase"] == "done":
                break
            req = reqs[k % len(reqs)]
            k += 1
            t0 = perf()
            try:
                writer.write(req)
                status, _body, will_close = await read_response(reader)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError, ValueError) as exc:
                if timed:
                    errors[f"io:{type(exc).__name__}"] += 1
                    state["count"] -= 1
                reconnects += 1
                writer.transport.abort()
                if reconnects > MAX_RECONNECTS_PER_WORKER:
                    errors["worker_gave_up"] += 1
                    return
                try:
                    reader, writer = await target.open(ctx)
                except (OSError, ssl.SSLError, TimeoutError):
                    errors["reconnect_failed"] += 1
                    return
                state["reconnects"] += 1
                continue
            if timed:
                lat.append(perf() - t0)
                statuses[status] += 1
            if will_close:
                writer.transport.abort()
                try:
                    reader, writer = await target.open(ctx)
                except (OSError, ssl.SSLError, TimeoutError):
                    errors["reconnect_failed"] += 1
                    return
                state["reconnects"] += 1
        conns[i] = (reader, writer)

    tasks = [asyncio.ensure_future(worker(i)) for i in range(clients)]
    await asyncio.sleep(warmup)
    cpu0 = cpu_by_role(server_pids)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    t_end[0] = t0 + duration
    state["phase"] = "timed"
    done, pending = await asyncio.wait(tasks, timeout=duration + 30)
    elapsed = time.perf_counter() - t0
    cpu1 = cpu_by_role(server_pids)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    state["phase"] = "done"
    for t in pending:
        t.cancel()
        errors["worker_timed_out"] += 1
    for t in done:
        if t.exception() is not None:
            errors[f"worker:{type(t.exception()).__name__}"] += 1
    for c in conns:
        if c is not None:
            c[1].transport.abort()
    out = summarize(lat, len(lat), elapsed)
    server_cpu, parts = cpu_shares(cpu0, cpu1, elapsed)
    out.update(
        count=len(lat),
        elapsed=elapsed,
        statuses={str(k): v for k, v in sorted(statuses.items())},
        non200=sum(v for k, v in statuses.items() if k != 200),
        errors=dict(errors),
        reconnects=state["reconnects"],
        clients=clients,
        client_cpu=((ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)) / elapsed,
        server_cpu=server_cpu,
        server_cpu_parts=parts,
    )
    return out


async def _handshakes(spec: dict[str, Any]) -> dict[str, Any]:
    """New connections per second: connect + TLS handshake + one request (Connection: close) + close."""
    target = Target(**spec["target"])
    ctx = target.client_context()
    req = spec["requests"][0].encode("latin-1")
    clients, duration, warmup = int(spec["clients"]), float(spec["duration"]), float(spec["warmup"])
    max_requests = min(int(spec.get("max_requests") or HARD_CAP_REQUESTS), HARD_CAP_REQUESTS)
    server_pids = spec.get("server_pids")
    statuses: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    lat: list[float] = []
    state = {"count": 0, "timed": False}
    t_end = [time.perf_counter() + warmup + duration + 60]

    async def worker() -> None:
        perf = time.perf_counter
        failures = 0
        while perf() < t_end[0]:
            timed = state["timed"]
            if timed:
                if state["count"] >= max_requests:
                    break
                state["count"] += 1
            t0 = perf()
            try:
                reader, writer = await target.open(ctx)
            except (OSError, ssl.SSLError, TimeoutError) as exc:
                failures += 1
                if timed:
                    errors[f"connect:{type(exc).__name__}"] += 1
                if failures > MAX_RECONNECTS_PER_WORKER:
                    return
                continue
            try:
                writer.write(req)
                status, _b, _c = await read_response(reader)
                t1 = perf()
                if timed and t1 <= t_end[0]:
                    lat.append(t1 - t0)
                    statuses[status] += 1
            except (OSError, asyncio.IncompleteReadError, ssl.SSLError, ValueError) as exc:
                if timed:
                    errors[f"io:{type(exc).__name__}"] += 1
            finally:
                await _close(writer)

    tasks = [asyncio.ensure_future(worker()) for _ in range(clients)]
    await asyncio.sleep(warmup)
    cpu0 = cpu_by_role(server_pids)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    t_end[0] = t0 + duration
    state["timed"] = True
    _done, pending = await asyncio.wait(tasks, timeout=duration + 30)
    elapsed = time.perf_counter() - t0
    cpu1 = cpu_by_role(server_pids)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    for t in pending:
        t.cancel()
        errors["worker_timed_out"] += 1
    elapsed = min(elapsed, duration) if lat else elapsed
    out = summarize(lat, len(lat), elapsed)
    server_cpu, parts = cpu_shares(cpu0, cpu1, elapsed)
    out.update(
        count=len(lat),
        elapsed=elapsed,
        statuses={str(k): v for k, v in sorted(statuses.items())},
        non200=sum(v for k, v in statuses.items() if k != 200),
        errors=dict(errors),
        clients=clients,
        client_cpu=((ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)) / elapsed,
        server_cpu=server_cpu,
        server_cpu_parts=parts,
    )
    return out


async def _hold(spec: dict[str, Any]) -> None:
    """Open ``clients`` keep-alive connections, one request each, report, hold until told (bounded)."""
    target = Target(**spec["target"])
    ctx = target.client_context()
    req = spec["requests"][0].encode("latin-1")
    n = int(spec["clients"])
    held: list[asyncio.StreamWriter] = []
    errors: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    sem = asyncio.Semaphore(16)

    async def one() -> None:
        async with sem:
            try:
                reader, writer = await target.open(ctx)
                writer.write(req)
                status, _b, _c = await read_response(reader)
                statuses[status] += 1
                held.append(writer)
            except (OSError, asyncio.IncompleteReadError, ssl.SSLError, ValueError, TimeoutError) as exc:
                errors[type(exc).__name__] += 1

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n))), 120)
    print(
        json.dumps(
            {
                "event": "held",
                "opened": len(held),
                "errors": dict(errors),
                "statuses": {str(k): v for k, v in statuses.items()},
                "seconds": time.perf_counter() - t0,
                "client_rss_kib": proc_status_kib(os.getpid()),
            }
        ),
        flush=True,
    )
    loop = asyncio.get_running_loop()
    with contextlib.suppress(TimeoutError):  # wait for the parent's go-ahead, at most hold_seconds
        await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), float(spec.get("hold_seconds", 60)))
    still_open = sum(1 for w in held if not w.transport.is_closing())
    for w in held:
        w.transport.abort()
    print(json.dumps({"event": "released", "still_open": still_open}), flush=True)


def _load_main() -> None:
    spec = json.loads(sys.stdin.readline())
    mode = spec.get("mode", "keepalive")
    if mode == "hold":
        asyncio.run(_hold(spec))
        return
    fn = _handshakes if mode == "handshakes" else _load
    result = asyncio.run(fn(spec))
    print(json.dumps({"event": "result", **result}), flush=True)


# ----------------------------------------------------------------------------- parent side


def run_load(
    target: Target,
    requests: Sequence[bytes],
    *,
    clients: int,
    duration: float,
    warmup: float = 1.0,
    max_requests: int | None = None,
    server_pid: int | dict[str, int] | None = None,
    mode: str = "keepalive",
) -> dict[str, Any]:
    """Run one load phase in a separate Python process; returns its result dict.

    ``server_pid``: the server's pid, or {role: pid} of all its processes (``ServerProc.pids``):
    ``server_cpu`` is their sum, ``server_cpu_parts`` each one's share."""
    pids = {"server": server_pid} if isinstance(server_pid, int) else server_pid
    spec = {
        "mode": mode,
        "target": dataclasses.asdict(target),
        "requests": [r.decode("latin-1") for r in requests],
        "clients": clients,
        "duration": duration,
        "warmup": warmup,
        "max_requests": max_requests,
        "server_pids": pids,
    }
    proc = subprocess.Popen(
        [PYTHON, str(Path(__file__).resolve()), "load"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec) + "\n")
    proc.stdin.flush()
    try:
        res = _read_json_line(proc, warmup + duration + 180, f"load generator ({mode})")
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    res.pop("event", None)
    res["tool"] = "python"
    return res


class Holder:
    """``n`` idle keep-alive connections held by a child process until :meth:`release`."""

    def __init__(self, target: Target, request: bytes, n: int, hold_seconds: float = 90) -> None:
        spec = {
            "mode": "hold",
            "target": dataclasses.asdict(target),
            "requests": [request.decode("latin-1")],
            "clients": n,
            "hold_seconds": hold_seconds,
        }
        self.proc = subprocess.Popen(
            [PYTHON, str(Path(__file__).resolve()), "load"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        self.info = _read_json_line(self.proc, 180, "connection holder")

    def release(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
            out = _read_json_line(self.proc, 60, "connection holder release")
        finally:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return out


def merge_results(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several rounds of the same phase: total count / total time; percentiles as the median of rounds."""
    if len(results) == 1:
        return dict(results[0])
    out = dict(results[-1])
    count = sum(r["count"] for r in results)
    elapsed = sum(r["elapsed"] for r in results)
    out.update(count=count, elapsed=elapsed, rps=count / elapsed, non200=sum(r["non200"] for r in results))
    for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "client_cpu"):
        out[k] = statistics.median(r[k] for r in results)
    out["max_ms"] = max(r["max_ms"] for r in results)
    cpus = [r["server_cpu"] for r in results if r.get("server_cpu") is not None]
    out["server_cpu"] = statistics.median(cpus) if cpus else None
    roles = {role for r in results for role in r.get("server_cpu_parts", {})}
    out["server_cpu_parts"] = {
        role: statistics.median(r["server_cpu_parts"][role] for r in results if role in r.get("server_cpu_parts", {}))
        for role in sorted(roles)
    }
    st: Counter[str] = Counter()
    er: Counter[str] = Counter()
    for r in results:
        st.update(r["statuses"])
        er.update(r["errors"])
    out["statuses"], out["errors"] = dict(st), dict(er)
    out["rounds"] = [round(r["rps"]) for r in results]
    return out


def check_ok(name: str, res: dict[str, Any], *, min_ok_fraction: float = 0.99) -> None:
    """Fail loudly when a phase is mostly errors (a benchmark of 429s measures nothing)."""
    total = res["count"] + sum(res["errors"].values())
    ok = res["statuses"].get("200", 0)
    if total == 0 or ok < min_ok_fraction * total:
        raise SystemExit(
            f"{name}: only {ok} of {total} answers were 200 (statuses {res['statuses']}, "
            f"errors {res['errors']}); the figures would be meaningless"
        )


# ----------------------------------------------------------------------------- wrk / ab


def external_tool() -> str | None:
    for tool in ("wrk", "ab"):
        if shutil.which(tool):
            return tool
    return None


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def run_external(
    tool: str,
    port: int,
    paths_: Sequence[str],
    headers: dict[str, str],
    *,
    clients: int,
    duration: float,
    workdir: Path,
) -> dict[str, Any] | None:
    """wrk (cycling through ``paths_`` with a Lua script) or ab -k (first path only), loopback TCP."""
    url = f"http://{LOOPBACK}:{port}"
    timeout = duration + 60
    if tool == "wrk":
        script = workdir / "bench.lua"
        lua_paths = ", ".join(json.dumps(p) for p in paths_)
        lua_headers = "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items())
        script.write_text(
            f"local paths = {{{lua_paths}}}\nlocal i = 0\n{lua_headers}\n"
            "request = function()\n  i = i + 1\n"
            '  return wrk.format("GET", paths[(i % #paths) + 1])\nend\n'
        )
        cmd = ["wrk", "-t1", f"-c{clients}", f"-d{max(1, round(duration))}s", "--latency", "-s", str(script), url]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
        except subprocess.TimeoutExpired:
            return None
        rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
        p50 = re.search(r"\s50%\s+([\d.]+)(us|ms|s|m)\b", out)
        p99 = re.search(r"\s99%\s+([\d.]+)(us|ms|s|m)\b", out)
        total = re.search(r"(\d+) requests in", out)
        non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
        errs = re.search(r"Socket errors:(.*)", out)
        if not (rps and p50 and p99 and total):
            print(f"(could not parse wrk output)\n{out}", file=sys.stderr)
            return None
        return {
            "tool": "wrk -t1",
            "rps": float(rps.group(1)),
            "p50_ms": _ms(*p50.groups()),
            "p99_ms": _ms(*p99.groups()),
            "count": int(total.group(1)),
            "non200": int(non2xx.group(1)) if non2xx else 0,
            "errors": errs.group(1).strip() if errs else "",
            "server_cpu": None,
            "client_cpu": None,
        }
    cmd = ["ab", "-k", "-q", "-c", str(clients), "-t", str(max(1, round(duration))), "-n", "1000000"]
    for k, v in headers.items():
        cmd += ["-H", f"{k}: {v}"]
    cmd.append(url + paths_[0])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
    except subprocess.TimeoutExpired:
        return None
    rps = re.search(r"Requests per second:\s+([\d.]+)", out)
    p50 = re.search(r"\n\s+50%\s+(\d+)", out)
    p99 = re.search(r"\n\s+99%\s+(\d+)", out)
    total = re.search(r"Complete requests:\s+(\d+)", out)
    non2xx = re.search(r"Non-2xx responses:\s+(\d+)", out)
    if not (rps and p50 and p99 and total):
        print(f"(could not parse ab output)\n{out}", file=sys.stderr)
        return None
    return {
        "tool": "ab -k",
        "rps": float(rps.group(1)),
        "p50_ms": float(p50.group(1)),
        "p99_ms": float(p99.group(1)),
        "count": int(total.group(1)),
        "non200": int(non2xx.group(1)) if non2xx else 0,
        "errors": "",
        "server_cpu": None,
        "client_cpu": None,
    }


# ----------------------------------------------------------------------------- printing


def pct_or_dash(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def print_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> None:
    head = (
        f"{'phase':<44} {'tool':<8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'count':>8} {'non200':>6} "
        f"{'srv cpu':>7} {'cli cpu':>7}"
    )
    print(head)
    print("-" * len(head))
    for name, r in rows:
        print(
            f"{name:<44} {r.get('tool', 'python'):<8} {r['rps']:>8.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r['count']:>8} {r['non200']:>6} {pct_or_dash(r.get('server_cpu')):>7} "
            f"{pct_or_dash(r.get('client_cpu')):>7}"
        )
        extra = []
        if r.get("rounds") and len(r["rounds"]) > 1:
            extra.append(f"rounds req/s {r['rounds']}")
        parts = r.get("server_cpu_parts") or {}
        if len(parts) > 1:
            extra.append("srv cpu " + " + ".join(f"{role} {share * 100:.0f}%" for role, share in parts.items()))
            if r.get("rps"):
                extra.append(
                    "cpu/request "
                    + " + ".join(f"{role} {share / r['rps'] * 1e6:.0f} µs" for role, share in parts.items())
                )
        if r.get("errors"):
            extra.append(f"errors {r['errors']}")
        if r.get("non200"):
            extra.append(f"statuses {r['statuses']}")
        if extra:
            print(f"    {'; '.join(str(e) for e in extra)}")


def loadavg() -> str:
    """The 1-minute load average: above ~0.3 before a run, something else is using the machine."""
    try:
        with open("/proc/loadavg", encoding="ascii") as fh:
            return fh.read().split()[0]
    except OSError:
        return "?"


def other_busy_processes(min_cpu_share: float = 0.2, window: float = 0.5) -> list[str]:
    """Processes not in this process tree using more than ``min_cpu_share`` of a core right now."""
    mine = {os.getpid()}

    def snapshot() -> dict[int, tuple[float, int, str]]:
        out = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat", encoding="latin-1") as fh:
                    raw = fh.read()
            except OSError:
                continue
            name = raw[raw.find("(") + 1 : raw.rfind(")")]
            f = raw.rsplit(")", 1)[1].split()
            out[int(d)] = ((int(f[11]) + int(f[12])) / CLK_TCK, int(f[1]), name)
        return out

    a = snapshot()
    time.sleep(window)
    b = snapshot()
    busy = []
    for pid, (cpu, ppid, name) in b.items():
        if pid in mine or ppid in mine or pid not in a:
            continue
        share = (cpu - a[pid][0]) / window
        if share >= min_cpu_share:
            busy.append(f"{name}[{pid}] {share * 100:.0f}%")
    return busy


def sign_test(ratios: Sequence[float]) -> tuple[int, int, float]:
    """(pairs above 1, pairs that differ, two-sided sign-test p) of paired rounds' ratios this/base:
    how often the pairs favour one side, and how likely a split at least that uneven is when the two
    sides do not differ at all (each pair then a coin toss). Ties count for neither side."""
    n = sum(1 for r in ratios if r != 1)
    k = sum(1 for r in ratios if r > 1)
    if n == 0:
        return 0, 0, 1.0
    import math

    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return k, n, min(1.0, 2 * tail)


def paired_line(what: str, ratios: Sequence[float], ahead: str, *, ahead_below_one: bool = False) -> str:
    """One line on paired rounds this/base: the median ratio, in how many pairs this side was
    ``ahead`` (the ratio above 1, or below it with ``ahead_below_one``: a cost), the sign test's p,
    and whether this run tells the two sides apart (p < 0.05)."""
    k, n, p = sign_test([1 / r for r in ratios] if ahead_below_one else ratios)
    verdict = "told apart in this run" if p < 0.05 else "inside this run's spread"
    return (
        f"{what} this/base median x{statistics.median(ratios):.2f}, {ahead} in {k} of {n} pairs "
        f"(sign test p = {p:.2f}: {verdict})"
    )


SPEED_PROBE_ROWS = 20_000


def speed_probe() -> float:
    """The CPU milliseconds this process spends on a fixed piece of work of the request path's kind:
    small dicts and strings made and dropped, JSON both ways, SHA-256 of short inputs, SQLite rows
    inserted and read by key in memory. It measures the machine at this moment, not the code: on a
    shared VM the same work costs more in some hours than in others, and a run's ratios between a
    CPU-bound path (ours) and one that waits on fsync (the reference) move with it. Lower is faster.
    The median of three runs (the first pays for warming up)."""
    import hashlib
    import sqlite3

    spent = []
    for _ in range(3):
        conn = sqlite3.connect(":memory:")
        conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v TEXT)")
        start = time.process_time()
        rows = []
        for i in range(SPEED_PROBE_ROWS):
            item = {"key": f"preference.k{i}", "tags": ["preference"], "n": i}
            text = json.dumps(item, sort_keys=True)
            rows.append((item["key"], hashlib.sha256(text.encode()).hexdigest()))
            json.loads(text)
        conn.executemany("INSERT INTO t VALUES (?, ?)", rows)
        for k, _ in rows:
            conn.execute("SELECT v FROM t WHERE k = ?", (k,)).fetchone()
        spent.append(time.process_time() - start)
        conn.close()
    return statistics.median(spent) * 1000


WAKEUP_PROBE_TRIPS = 2_000


def wakeup_probe() -> float:
    """Microseconds per round trip of one byte between this process and a child over a Unix socket
    pair, each side blocked in ``recv`` in between: two wake-ups of a sleeping process per trip, the
    thing a request through the gateway and the guard does several times. On a VM its cost depends
    on the host (a sleeping virtual CPU is woken by it). Lower is faster. Median of ten batches."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: echo until the parent closes its end
        a.close()
        try:
            while data := b.recv(1):
                b.sendall(data)
        finally:
            os._exit(0)
    b.close()
    try:
        batches = []
        for _ in range(10):
            start = time.perf_counter()
            for _ in range(WAKEUP_PROBE_TRIPS // 10):
                a.sendall(b"x")
                a.recv(1)
            batches.append((time.perf_counter() - start) / (WAKEUP_PROBE_TRIPS // 10) * 1e6)
        return statistics.median(batches)
    finally:
        a.close()
        os.waitpid(pid, 0)


def machine_line() -> str:
    import platform

    return (
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {os.cpu_count()} cores  Python {platform.python_version()}  "
        f"{platform.system()} {platform.release()}  loadavg(1m) {loadavg()} at start"
        + "".join(
            f"\nWARNING: another process is busy, figures will be low and noisy: {b}" for b in other_busy_processes()
        )
    )


# ----------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="benchmark child processes (used by the bench_*.py scripts)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the guard (+ gateway) until SIGTERM")
    s.add_argument("--home", required=True)
    s.add_argument("--gateway", action="store_true")
    s.add_argument(
        "--layout",
        choices=["split", "one-process", "gateway-only"],
        default="split",
        help="with --gateway: the guard in a child process (like uomp gateway start) or in the same loop, "
        "or no guard (a second gateway worker; upstream given in --gateway-config)",
    )
    s.add_argument("--tcp-port", type=int)
    s.add_argument("--max-connections", type=int)
    s.add_argument("--ssl-read-buffer-kib", type=int)
    s.add_argument("--quota-block", type=int)
    s.add_argument("--max-lifetime", type=float, default=1800.0)
    s.add_argument("--gateway-config", metavar="JSON", help="GatewayConfig fields to set, as a JSON object")
    s.add_argument("--profile", metavar="FILE", help="cProfile the server, dump stats to FILE on exit")
    sub.add_parser("load", help="a load generator; JSON spec on stdin, JSON result on stdout")
    gc = sub.add_parser("guard-child", help="the guard as the appliance's child process (started by serve)")
    gc.add_argument("--parent", type=int, required=True)
    gc.add_argument("--home", required=True)
    gc.add_argument("--tcp-port", type=int)
    gc.add_argument("--quota-block", type=int)
    args = p.parse_args(argv)
    if args.cmd == "guard-child":
        _guard_child(args)
    elif args.cmd == "serve":
        from gateway import eventloop  # uvloop unless UOMP_UVLOOP=0, like the product's servers

        if args.profile:  # diagnostics: cProfile the whole server process, stats written on SIGTERM
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
            try:
                eventloop.run(_serve(args))
            finally:
                prof.disable()
                prof.dump_stats(args.profile)
        else:
            eventloop.run(_serve(args))
    else:
        _load_main()


if __name__ == "__main__":
    main()
