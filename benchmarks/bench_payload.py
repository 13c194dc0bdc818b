"""The payload relay with a large payload, end to end, in one run (issue 11):

    .venv/bin/python benchmarks/bench_payload.py [--mib 1024] [--seal-mib 256]

* the appliance as users run it: ``uomp gateway start`` in a child process (gateway there, guard in
  its supervised child), on 127.0.0.1 with a throwaway ``UOMP_HOME``; the agent bundle from the real
  ``uomp authorize --remote``;
* upload: the SDK (``UompClient.upload_payload`` over mTLS, in its own process) seals a ``--mib``
  file of random bytes to the user's key and streams it to ``POST /v1/payload/upload`` while it
  seals (the hash after the bytes; nothing sealed is kept: a retry seals again); timed as a whole,
  and a seal alone into a temporary file after it, for scale;
* pull: ``uomp payload pull ID --out FILE`` (its own process): streams the ciphertext from the
  guard's socket, checks every chunk and the hash, writes and renames; timed; the output's SHA-256
  is compared with the input's;
* peak RSS (VmHWM / ``wait4`` ru_maxrss) of the gateway process, the guard process, the SDK
  process and the CLI process;
* the bare line in the same run: Python ``ssl``, TLS 1.3, the gateway's own certificate and key, over
  loopback, ``--mib`` bytes each way in 1 MiB writes (the SDK's and the CLI's read block), the
  receiver writing 1 MiB blocks to a file and fsyncing once (its own process each side); RATIOS
  upload/bare and pull+open/bare;
* before each timed step, ``2 x --mib`` of scratch file is written and removed
  (:func:`recycle_pages`), so every step writes into just-freed page cache, whatever its place
  in the round;
* ``--sizes 128,1024``: the whole round at each size in one run, so a peak RSS independent of the
  payload size shows as equal columns;
* then ``bench_sealing.py`` (seal and open beside raw AES-256-GCM over the same data) in the same run.

Nothing here asserts a timing; it prints what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = sys.executable
UOMP = [PYTHON, "-m", "gateway.cli.main"]
BLOCK = 16 << 20
WIRE_BLOCK = 1 << 20  # the SDK's, the CLI's and the guard's read block


def bare_server(cert: str, key: str, out_dir: str) -> None:
    """Runs in its own process: one TLS 1.3 listener on 127.0.0.1; per connection, the first line
    says ``PUT n`` (receive n bytes, write them in 1 MiB blocks to a file, fsync once, answer
    ``ok``) or ``GET path`` (send that file in 1 MiB writes)."""
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    lsock = socket.create_server(("127.0.0.1", 0))
    print(lsock.getsockname()[1], flush=True)
    while True:
        raw, _ = lsock.accept()
        with ctx.wrap_socket(raw, server_side=True) as conn:
            head = b""
            while not head.endswith(b"\n"):
                head += conn.recv(1)
            verb, arg = head.decode().split()
            if verb == "PUT":
                left = int(arg)
                fd = os.open(Path(out_dir, "bare.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                buf = bytearray(WIRE_BLOCK)
                view = memoryview(buf)
                while left > 0:
                    got = 0
                    while got < WIRE_BLOCK and left - got > 0:
                        n = conn.recv_into(view[got:], min(WIRE_BLOCK - got, left - got))
                        if n == 0:
                            raise SystemExit("bare: short PUT")
                        got += n
                    os.write(fd, view[:got])
                    left -= got
                os.fsync(fd)
                os.close(fd)
                conn.sendall(b"ok\n")
            elif verb == "GET":
                with open(arg, "rb") as fh:
                    while block := fh.read(WIRE_BLOCK):
                        conn.sendall(block)
            else:
                return


def bare_client(port: int, ca: str, verb: str, src: str, dst: str) -> None:
    """Runs in its own process: PUT ``src`` to the bare server, or GET ``src`` into ``dst`` (1 MiB
    writes, fsync once, rename), verifying the server's certificate against the user's CA."""
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=ca)
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="localhost") as conn:
        if verb == "PUT":
            size = os.path.getsize(src)
            conn.sendall(f"PUT {size}\n".encode())
            with open(src, "rb") as fh:
                while block := fh.read(WIRE_BLOCK):
                    conn.sendall(block)
            if conn.recv(3) != b"ok\n":
                raise SystemExit("bare: no ok")
        else:
            conn.sendall(f"GET {src}\n".encode())
            fd = os.open(dst + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            buf = bytearray(WIRE_BLOCK)
            view = memoryview(buf)
            got = -1
            while got:  # 1 MiB writes (a TLS recv brings one 16 KiB record at most)
                got = 0
                while got < WIRE_BLOCK and (n := conn.recv_into(view[got:])):
                    got += n
                os.write(fd, view[:got])
            os.fsync(fd)
            os.close(fd)
            os.replace(dst + ".part", dst)


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.extend(int(x) for x in text)
    return out


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS KiB of that process, stdout) via wait4 on the child itself."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = b"", b""
    assert proc.stdout is not None and proc.stderr is not None
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[3:6]} failed: {err.decode()[-2000:]}")
    return wall, usage.ru_maxrss, out.decode()


def upload_child(bundle: str, path: str) -> None:
    """Runs in its own process: the SDK seals and uploads; prints JSON timings."""
    sys.path.insert(0, str(ROOT))
    from gateway.client import UompClient
    from gateway.client import payloads as sdk_payloads

    async def go() -> dict[str, object]:
        async with UompClient.from_bundle(bundle) as c:
            t0 = time.perf_counter()
            # the same call the agent makes; the seal alone is timed apart below, for scale
            pid = await c.upload_payload(Path(path), format="application/octet-stream")
            total = time.perf_counter() - t0
        return {"payload_id": pid, "upload_total_s": total}

    res = asyncio.run(go())
    # the seal alone (to a temporary file, as upload_payload does while it sends), for scale
    from gateway.bundle import load_bundle
    from gateway.core import envelope, sealing

    b = load_bundle(Path(bundle))
    assert b.payload_public_key
    t0 = time.perf_counter()
    sealed = sdk_payloads.seal_to_file(
        envelope.parse_public_key(b.payload_public_key),
        sealing.Binding("pay_benchsealonly", b.session_id, b.agent_id, "application/octet-stream"),
        Path(path),
    )
    res["seal_to_file_s"] = time.perf_counter() - t0
    sealed.remove()
    print(json.dumps(res), flush=True)


def recycle_pages(top: Path, mib: int) -> None:
    """Write then remove ``2 * mib`` MiB of scratch file, so that the step timed next writes its
    files (the SDK's sealed copy and the gateway's blob; the CLI's or the bare receiver's output)
    into page-cache pages just freed, like every other step. On a virtual machine a page the guest
    has not touched lately costs far more to fill (writing 1 GiB on the 2-core VM of
    benchmarks/README.md: 0.5-1.0 s of system time into fresh pages, 0.27 s into just-freed ones),
    and without this the order of the steps decided who paid it: the upload ran first on fresh
    pages, the pull and the bare PUT reused the pages freed before them."""
    scratch = top / "recycle.bin"
    block = bytes(BLOCK)
    with open(scratch, "wb") as fh:
        for _ in range(max(1, 2 * mib * (1 << 20) // BLOCK)):
            fh.write(block)
    scratch.unlink()


def one_round(mib: int, top: Path, home: Path, env: dict[str, str], gw_pid: int, bundle: Path, port: int) -> None:
    """One size: upload, pull + open, the bare TLS 1.3 transfer of the same bytes each way; printed."""
    src = top / f"input-{mib}.bin"
    digest = hashlib.sha256()
    with open(src, "wb") as fh:
        for _ in range(max(1, mib * (1 << 20) // BLOCK)):
            block = os.urandom(min(BLOCK, mib << 20))
            digest.update(block)
            fh.write(block)
    guard_pid = children(gw_pid)[0]
    gw_before, guard_before = vm_kib(gw_pid, "VmRSS"), vm_kib(guard_pid, "VmRSS")

    recycle_pages(top, mib)
    cpu0 = (cpu_s(gw_pid), cpu_s(guard_pid))
    up_s, up_rss, out = run_measured(
        [PYTHON, str(HERE / "bench_payload.py"), "--upload-child", str(bundle), str(src)], env
    )
    cpu1 = (cpu_s(gw_pid), cpu_s(guard_pid))
    up = json.loads(out.strip().splitlines()[-1])
    pid = up["payload_id"]
    dst = top / f"output-{mib}.bin"
    recycle_pages(top, mib)
    cpu_pull0 = (cpu_s(gw_pid), cpu_s(guard_pid))
    pull_s, pull_rss, _ = run_measured([*UOMP, "--home", str(home), "payload", "pull", pid, "--out", str(dst)], env)
    cpu2 = (cpu_s(gw_pid), cpu_s(guard_pid))
    out_digest = hashlib.sha256()
    with open(dst, "rb") as fh:
        while block := fh.read(BLOCK):
            out_digest.update(block)
    dst.unlink()
    gw_peak, guard_peak = vm_kib(gw_pid, "VmHWM"), vm_kib(guard_pid, "VmHWM")

    # the bare line: same bytes, same certificate, same host, same run
    bare_in, bare_out = top / "bare-in", top / "bare-out.bin"
    bare_in.mkdir(exist_ok=True)
    recycle_pages(top, mib)
    put_s, _, _ = run_measured(
        [PYTHON, str(HERE / "bench_payload.py"), "--bare-client", str(port), "PUT", str(src), "-"], env
    )
    recycle_pages(top, mib)
    get_s, _, _ = run_measured(
        [PYTHON, str(HERE / "bench_payload.py"), "--bare-client", str(port), "GET", str(src), str(bare_out)], env
    )
    bare_out.unlink()
    src.unlink()
    print(f"payload relay, {mib} MiB of random bytes, gateway + guard + SDK + CLI on one 2-core host")
    print(
        f"  upload (SDK: sealed while streamed over mTLS):      {up['upload_total_s']:7.1f} s  "
        f"{mib / up['upload_total_s']:7.1f} MiB/s"
    )
    print(f"    (the seal alone, to a temporary file, afterwards: {up['seal_to_file_s']:.1f} s)")
    print(f"  pull + open (CLI over the guard's socket):          {pull_s:7.1f} s  {mib / pull_s:7.1f} MiB/s")
    print(f"  bare TLS 1.3 PUT (1 MiB writes, fsync once):        {put_s:7.1f} s  {mib / put_s:7.1f} MiB/s")
    print(f"  bare TLS 1.3 GET (1 MiB writes, fsync once):        {get_s:7.1f} s  {mib / get_s:7.1f} MiB/s")
    print(f"  RATIOS upload/bare PUT {put_s / up['upload_total_s']:.2f}, pull+open/bare GET {get_s / pull_s:.2f}")
    print(
        f"  CPU during upload: gateway {cpu1[0] - cpu0[0]:.1f} s, guard {cpu1[1] - cpu0[1]:.1f} s; "
        f"during pull: gateway {cpu2[0] - cpu_pull0[0]:.1f} s, guard {cpu2[1] - cpu_pull0[1]:.1f} s"
    )
    print(f"  plaintext identical: {out_digest.digest() == digest.digest()}")
    print(
        f"  peak RSS: gateway {gw_peak / 1024:6.1f} MiB (before {gw_before / 1024:.1f}), "
        f"guard {guard_peak / 1024:6.1f} MiB (before {guard_before / 1024:.1f}), "
        f"SDK process {up_rss / 1024:6.1f} MiB, CLI pull {pull_rss / 1024:6.1f} MiB "
        f"(whole upload child process {up_s:.1f} s)"
    )
    sys.stdout.flush()


def stream_client(port: int, nbytes: int) -> None:
    """Runs in its own process: one POST of ``nbytes`` random bytes (Content-Length) over TLS 1.3,
    in 1 MiB writes, to the stream-CPU server."""
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # a throwaway self-signed server on loopback: what is timed is the server
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port))) as sock:
        sock.sendall(b"POST /u HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % nbytes)
        block = os.urandom(WIRE_BLOCK)
        left = nbytes
        while left:
            k = min(left, len(block))
            sock.sendall(block[:k])
            left -= k
        sock.recv(4096)


def stream_cpu(mib: int, rounds: int, baseline: Path | None) -> None:
    """The gateway's upload loop alone (``PayloadService._stream`` into a real ``PayloadStore``
    upload, behind a real TLS 1.3 listener: ``gateway.httpd``'s, or aiohttp's for a tree whose loop
    reads an aiohttp request), CPU per GiB of this process split into the
    event loop's thread (TLS, HTTP parsing, the loop itself) and the others (hash and write), for
    this tree and, alternating, ``baseline``'s ``gateway/remote/payload_service.py``. On the
    product's event loop (``gateway.eventloop.run``: uvloop; ``UOMP_UVLOOP=0`` for asyncio's). CPU,
    not wall time: it stays comparable on a loaded machine. Its listener lives in this process, whose
    heap has done enough to raise glibc's mmap threshold: a cost that only a freshly started
    gateway pays (a read-sized allocation per TLS read; ``bench_tls_transport.py``) does not show
    here, only in the full run."""
    import importlib.util
    import inspect
    import resource
    import ssl
    import statistics
    import types

    from aiohttp import web

    sys.path.insert(0, str(ROOT))
    from gateway import eventloop, httpd
    from gateway.payloads.store import Limits, PayloadStore
    from gateway.remote import payload_service

    trees: dict[str, Any] = {"this tree": payload_service.PayloadService}
    # which server feeds each tree's loop: aiohttp's for one that reads an aiohttp StreamReader
    on_aiohttp = {"this tree": "set_read_chunk_size" in Path(payload_service.__file__).read_text()}
    if baseline is not None:
        on_aiohttp["baseline"] = "set_read_chunk_size" in (baseline / "gateway/remote/payload_service.py").read_text()
        spec = importlib.util.spec_from_file_location(
            "baseline_payload_service", baseline / "gateway" / "remote" / "payload_service.py"
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        trees["baseline"] = mod.PayloadService
    tmp = Path(tempfile.mkdtemp(prefix="uomp-bstream-", dir="/tmp"))
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
         str(tmp / "k.pem"), "-out", str(tmp / "c.pem"), "-subj", "/CN=127.0.0.1", "-days", "1"],
        check=True, capture_output=True,
    )  # fmt: skip
    store = PayloadStore(tmp / "store", limits=Limits(max_bytes=(mib + 1) << 20, max_bytes_per_session=1 << 40))
    fake = types.SimpleNamespace(cfg=types.SimpleNamespace(payload_body_idle_timeout_seconds=30.0))
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in trees}
    failures: list[str] = []
    current: list[Any] = []

    async def upload(request: Any) -> None:
        name, cls = current[0]
        up = store.begin(
            payload_id="pay_benchstream0001", session_id="s", agent_id="a", format="x", encryption={},
            max_bytes=(mib + 1) << 20,
        )  # fmt: skip
        # a tree from before the hash could follow the bytes has no ``trailer`` parameter
        extra = (None,) if "trailer" in inspect.signature(cls._stream).parameters else ()
        r0, m0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
        try:
            await cls._stream(fake, request, up, *extra)
        except BaseException as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            raise
        r1, m1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
        up.abort()
        cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        results[name].append((cpu, m1 - m0, t1 - t0))

    async def on_aiohttp_server(request: web.Request) -> web.Response:
        await upload(request)
        return web.Response(text="ok")

    async def on_httpd(request: httpd.Request) -> httpd.AnyResponse:
        await upload(request)
        return httpd.Response(b"ok")

    async def pass_through(request: httpd.Request, handler: httpd.Handler) -> httpd.AnyResponse:
        return await handler(request)

    async def run() -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(tmp / "c.pem", tmp / "k.pem")
        app = web.Application(client_max_size=(mib + 1) << 20)
        app.router.add_post("/u", on_aiohttp_server)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        happ = httpd.App(middleware=pass_through, refusal=lambda status: httpd.Response(b"", status))
        happ.router.add_route("POST", "/u", on_httpd)
        server = httpd.Server(happ, name="bench")
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(server.protocol, "127.0.0.1", 0, ssl=ctx)
        server.listeners.append(listener)
        ports = {True: runner.addresses[0][1], False: listener.sockets[0].getsockname()[1]}
        for _ in range(rounds):
            for item in trees.items():
                current[:] = [item]
                port = ports[on_aiohttp[item[0]]]
                proc = await asyncio.create_subprocess_exec(
                    PYTHON, __file__, "--stream-client", str(port), str(mib << 20)
                )
                await proc.wait()
        await runner.cleanup()
        await server.close(grace=1.0)

    try:
        eventloop.run(run())  # the product's loop (uvloop unless UOMP_UVLOOP=0)
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if failures or not all(results.values()):
        why = "; ".join(failures or ["no round ran"])
        raise SystemExit(f"bench_payload --stream-cpu: the upload loop failed: {why}")
    gib = mib / 1024
    print(f"upload loop alone, {mib} MiB per round, {rounds} round(s), medians (CPU s per GiB; wall MiB/s)")
    for name, got in results.items():
        cpu = statistics.median(g[0] for g in got) / gib
        loop = statistics.median(g[1] for g in got) / gib
        wall = statistics.median(g[2] for g in got)
        print(f"  {name:10s} CPU {cpu:5.2f}  event-loop thread {loop:5.2f}  other threads {cpu - loop:5.2f}"
              f"  wall {mib / wall:6.1f} MiB/s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument(
        "--sizes", default="", help="comma-separated MiB sizes, one round each in this run (default: --mib)"
    )
    ap.add_argument("--seal-mib", type=int, default=256, help="data size for the bench_sealing.py part (0: skip)")
    ap.add_argument("--keep", action="store_true", help="keep the throwaway home")
    ap.add_argument("--upload-child", nargs=2, metavar=("BUNDLE", "FILE"), help=argparse.SUPPRESS)
    ap.add_argument("--bare-server", nargs=3, metavar=("CERT", "KEY", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--bare-client", nargs=4, metavar=("PORT", "VERB", "SRC", "DST"), help=argparse.SUPPRESS)
    ap.add_argument("--stream-cpu", type=int, metavar="MIB", help="only the upload loop's CPU per GiB (see stream_cpu)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per tree for --stream-cpu")
    ap.add_argument("--baseline", type=Path, help="an older checkout measured beside this one (--stream-cpu)")
    ap.add_argument("--stream-client", nargs=2, metavar=("PORT", "BYTES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stream_client:
        stream_client(int(args.stream_client[0]), int(args.stream_client[1]))
        return
    if args.stream_cpu:
        stream_cpu(args.stream_cpu, args.rounds, args.baseline)
        return
    if args.upload_child:
        upload_child(*args.upload_child)
        return
    if args.bare_server:
        bare_server(*args.bare_server)
        return
    if args.bare_client:
        port_s, verb, src_s, dst_s = args.bare_client
        bare_client(int(port_s), os.environ["UOMP_BENCH_CA"], verb, src_s, dst_s)
        return
    sizes = [int(x) for x in args.sizes.split(",") if x] or [args.mib]

    top = Path(tempfile.mkdtemp(prefix="uomp-bpay-", dir="/tmp"))
    home = top / "home"
    env = {
        **os.environ,
        "UOMP_HOME": str(home),
        "PYTHONPATH": str(ROOT),
        "UOMP_GATEWAY_PAYLOAD_MAX_BYTES": str((max(sizes) + 64) << 20),
        "UOMP_GATEWAY_PAYLOAD_MAX_BYTES_PER_SESSION": str((sum(sizes) + 64) << 20),
    }
    gw: subprocess.Popen[str] | None = None
    bare: subprocess.Popen[str] | None = None
    try:
        subprocess.run([*UOMP, "--home", str(home), "init"], env=env, check=True, capture_output=True)
        gw = subprocess.Popen(
            [*UOMP, "--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert gw.stdout is not None
        port = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = gw.stdout.readline()
            if line.startswith("gateway: https://"):
                port = int(line.split()[1].rsplit(":", 1)[1])
            if line.startswith("guard:"):
                break
            if not line and gw.poll() is not None:
                raise SystemExit("the appliance did not start")
        agent_dir = top / "agent"
        agent_dir.mkdir()
        shutil.copy(ROOT / "examples" / "calendar_agent" / "uom.json", agent_dir / "uom.json")
        bundle = top / "bundle.json"
        subprocess.run(
            [
                *UOMP,
                "--home",
                str(home),
                "authorize",
                str(agent_dir),
                "--remote",
                "--gateway-url",
                f"https://localhost:{port}",
                "--out",
                str(top / "agent-files"),
                "--bundle",
                str(bundle),
                "--yes",
            ],
            env=env,
            check=True,
            capture_output=True,
        )
        sys.path.insert(0, str(ROOT))
        from gateway.config import Paths

        paths = Paths(home)
        (top / "bare-in").mkdir()
        bare = subprocess.Popen(
            [
                PYTHON,
                str(HERE / "bench_payload.py"),
                "--bare-server",
                str(paths.gateway_cert),
                str(paths.gateway_key),
                str(top / "bare-in"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert bare.stdout is not None
        env["UOMP_BENCH_CA"] = str(paths.ca_cert)
        bare_port = int(bare.stdout.readline())
        for mib in sizes:
            one_round(mib, top, home, env, gw.pid, bundle, bare_port)
    finally:
        if bare is not None and bare.poll() is None:
            bare.kill()
            bare.wait()
        if gw is not None and gw.poll() is None:
            gw.terminate()
            try:
                gw.wait(60)
            except subprocess.TimeoutExpired:
                gw.kill()
                gw.wait()
        if not args.keep:
            shutil.rmtree(top, ignore_errors=True)
    if args.seal_mib:
        print()
        subprocess.run(
            [
                PYTHON,
                str(HERE / "bench_payload.py").replace("bench_payload", "bench_sealing"),
                "--mib",
                str(args.seal_mib),
            ],
            check=True,
        )


if __name__ == "__main__":
    main()
