"""What a TLS read costs the gateway's listener with a copying protocol and with a buffered one,
in one run:

    .venv/bin/python benchmarks/bench_tls_transport.py [--rounds 3] [--requests 4000] [--clients 4]
        [--mib 256]

Two servers with the same trivial application (answer a request head with a fixed 320-byte answer;
count and drop a bulk body), each a freshly started interpreter (``spawn``: the heap of a process
that has just started, as the gateway's is), on the product's event loop (``gateway.eventloop.run``:
uvloop), TLS 1.3 with a required client certificate, the gateway's own server context
(``gateway.remote.tls.build_server_context``), the SDK's client context:

* ``copying``: an ``asyncio.Protocol``: the loop's TLS protocol reads each batch of records into a
  new bytes object of its read size (256 KiB on uvloop) and trims it. glibc serves a block that
  large with mmap (its default threshold is 128 KiB), so each read is an mmap, a mremap, a munmap
  and page faults for every page the records fill;
* ``buffered``: an ``asyncio.BufferedProtocol`` handing out one buffer, as ``gateway.httpd.Connection``
  does: the records are decrypted into it.

Phases, alternated per round so drift hits both: ``--clients`` keep-alive connections (threads of
one client process) doing ``--requests`` round trips each; then one connection sending ``--mib`` MiB
in 1 MiB writes. Printed per server: round trips per second, the server's CPU (µs) and minor page
faults per round trip; bulk MiB/s, CPU (s) per GiB and page faults per MiB; then the medians and the
ratios buffered/copying. CPU, not wall time, is the figure that carries to a busy machine. Nothing
here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 240\r\n\r\n" + b"x" * 240
REQUEST = (
    b"GET /v1/memory/profile.name HTTP/1.1\r\nHost: 127.0.0.1\r\nX-UOMP-Agent-Id: agent:bench\r\n"
    b"Authorization: Bearer " + b"t" * 420 + b"\r\n\r\n"
)
BLOCK = 1 << 20
READ_BUFFER = 256 * 1024  # gateway.httpd.READ_BUFFER
KINDS = ("copying", "buffered")


def _usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


class _App:
    """The application: a request head gets the answer; a bulk body is counted and dropped."""

    def __init__(self, bulk: int) -> None:
        self.bulk = bulk
        self.got = 0
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def on_data(self, data: bytes | memoryview) -> None:
        if self.bulk:
            self.got += len(data)
            if self.got >= self.bulk:
                self.transport.write(b"ok")
        elif bytes(data[-4:]) == b"\r\n\r\n":
            self.transport.write(ANSWER)


class _Copying(_App, asyncio.Protocol):
    def data_received(self, data: bytes) -> None:
        self.on_data(data)


class _Buffered(_App, asyncio.BufferedProtocol):
    buffer = memoryview(bytearray(READ_BUFFER))  # one for the process, as one per httpd.Server

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.on_data(self.buffer[:nbytes])


def _serve(kind: str, certs: dict[str, str], bulk: int, ready: Any) -> None:
    from gateway import eventloop
    from gateway.remote.tls import build_server_context

    ctx = build_server_context(certs["cert"], certs["key"], certs["ca"], certs["crl"], require_client_cert=True)
    cls = _Copying if kind == "copying" else _Buffered

    async def main() -> None:
        srv = await asyncio.get_running_loop().create_server(lambda: cls(bulk), "127.0.0.1", 0, ssl=ctx)
        ready.put(srv.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    eventloop.run(main())


def _client_context(certs: dict[str, str]) -> ssl.SSLContext:
    from gateway.client.tls import build_client_context

    return build_client_context(certs["ca"], certs["agent_cert"], certs["agent_key"])


def _round_trips(port: int, certs: dict[str, str], clients: int, requests: int) -> None:
    ctx = _client_context(certs)

    def one() -> None:
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="localhost") as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(requests):
                s.sendall(REQUEST)
                got = 0
                while got < len(ANSWER):
                    chunk = s.recv(65536)
                    if not chunk:
                        raise SystemExit("the server closed the connection")
                    got += len(chunk)

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _bulk(port: int, certs: dict[str, str], mib: int) -> None:
    ctx = _client_context(certs)
    block = os.urandom(BLOCK)
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="localhost") as s:
        for _ in range(mib):
            s.sendall(block)
        if s.recv(2) != b"ok":
            raise SystemExit("the server did not confirm the bulk body")


def _phase(kind: str, certs: dict[str, str], bulk_mib: int, client: Any, args: tuple[Any, ...]) -> tuple[float, ...]:
    """(wall seconds, server CPU seconds, server minor faults) of one client process against a
    freshly started server."""
    spawn = mp.get_context("spawn")
    ready: Any = spawn.Queue()
    server = spawn.Process(target=_serve, args=(kind, certs, bulk_mib * BLOCK, ready), daemon=True)
    server.start()
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None:
            try:
                port = ready.get(timeout=0.5)
            except queue.Empty:
                if not server.is_alive() or time.monotonic() > deadline:
                    raise SystemExit(f"the {kind} server did not start (exit {server.exitcode})") from None
        assert server.pid is not None
        (cpu0, flt0), t0 = _usage(server.pid), time.perf_counter()
        proc = spawn.Process(target=client, args=(port, certs, *args))
        proc.start()
        proc.join(600)
        wall = time.perf_counter() - t0
        cpu1, flt1 = _usage(server.pid)
        if proc.exitcode != 0:
            raise SystemExit(f"the {kind} phase's client failed (exit {proc.exitcode})")
        return wall, cpu1 - cpu0, flt1 - flt0
    finally:
        server.kill()
        server.join(10)


def _certs(work: Path) -> dict[str, str]:
    from bench_handshake import Setup

    d = Setup(work, "p256", "p256", 0).dir
    return {
        "ca": str(d / "ca.crt"),
        "cert": str(d / "gw.crt"),
        "key": str(d / "gw.key"),
        "crl": str(d / "crl.pem"),
        "agent_cert": str(d / "agent.crt"),
        "agent_key": str(d / "agent.key"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4000, help="round trips per connection")
    ap.add_argument("--clients", type=int, default=4, help="keep-alive connections")
    ap.add_argument("--mib", type=int, default=256, help="bulk body size")
    args = ap.parse_args()
    import _common as c

    print(f"bench_tls_transport: {c.machine_line()}")
    print(
        f"{args.clients} connections x {args.requests} round trips; {args.mib} MiB bulk; "
        f"{args.rounds} rounds, servers alternated"
    )
    trips = args.clients * args.requests
    rows: dict[str, dict[str, list[float]]] = {k: {} for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="uomp-tlsbench-") as tmp:
        certs = _certs(Path(tmp))
        for r in range(args.rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                wall, cpu, faults = _phase(kind, certs, 0, _round_trips, (args.clients, args.requests))
                row = {"rt": trips / wall, "us": 1e6 * cpu / trips, "flt": faults / trips}
                wall, cpu, faults = _phase(kind, certs, args.mib, _bulk, (args.mib,))
                row |= {"mibs": args.mib / wall, "s_gib": cpu * 1024 / args.mib, "flt_mib": faults / args.mib}
                for k, v in row.items():
                    rows[kind].setdefault(k, []).append(v)
                print(
                    f"  round {r + 1} {kind:8s}: {row['rt']:7.0f} round trips/s, {row['us']:5.1f} µs CPU and "
                    f"{row['flt']:4.1f} page faults each; bulk {row['mibs']:5.0f} MiB/s, {row['s_gib']:4.2f} s CPU "
                    f"per GiB, {row['flt_mib']:5.0f} faults per MiB"
                )
    med = {k: {m: statistics.median(v) for m, v in row.items()} for k, row in rows.items()}
    for kind in KINDS:
        m = med[kind]
        print(
            f"{kind:8s} (median): {m['rt']:7.0f} round trips/s, {m['us']:5.1f} µs server CPU and {m['flt']:4.1f} "
            f"page faults per round trip; bulk {m['mibs']:5.0f} MiB/s, {m['s_gib']:4.2f} s server CPU per GiB"
        )
    cp, bf = med["copying"], med["buffered"]

    def ratio(m: str) -> str:  # a phase too short for the clock's ticks measures no CPU
        return f"{bf[m] / cp[m]:.2f}" if cp[m] else "n/a"

    print(
        f"RATIOS buffered/copying: CPU per round trip {ratio('us')}, round trips/s {ratio('rt')}; "
        f"CPU per GiB {ratio('s_gib')}, MiB/s {ratio('mibs')}"
    )


if __name__ == "__main__":
    main()
