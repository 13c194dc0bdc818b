"""``uomp gateway serve`` (the gateway alone) and ``uomp gateway start`` (the appliance).

``start`` runs the guard in a child process (``uomp --home H guard serve [--no-tcp]``) and the
gateway in this one, so each gets its own core and event loop (in one loop, every forwarded read
paid for the guard's work and the gateway's on the same core). The parent supervises the child:

* before anything starts: the gateway's (and tunnel origin's, and Local Profile's) bind address is
  checked, and a live server on ``guard.sock`` is refused (a stale socket file is removed);
* the gateway starts only once the child answers ``GET /v1/health`` on ``guard.sock``, within
  :data:`GUARD_START_SECONDS`; a child that dies first, or does not answer in time, is a clear
  error carrying the child's own output;
* SIGTERM / SIGINT: the gateway stops (in-flight requests finish), then the child gets SIGTERM,
  and SIGKILL after :data:`GUARD_STOP_SECONDS` (a socket file it leaves behind is removed);
  SIGHUP reloads the gateway's certificates, CRL and keys and is forwarded to the child;
* if the child dies while the appliance runs, the gateway keeps answering (503
  STORE_UNAVAILABLE for anything that needs the guard) and the child is restarted with
  exponential backoff (:data:`RESTART_FIRST_SECONDS` doubling to :data:`RESTART_MAX_SECONDS`,
  back to the first delay once a child has run :data:`RESTART_STABLE_SECONDS`), each step logged;
* the child dies with the parent even if the parent is SIGKILLed (Linux ``PR_SET_PDEATHSIG``).

The child's output (stdout and stderr: its log lines) is relayed to this process's stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.cli.guard import guard_config
from gateway.cli.main import paths_from
from gateway.config import GatewayConfig, GuardConfig, Paths, load_section
from gateway.errors import UompError
from gateway.guard.server import remove_dead_socket

if TYPE_CHECKING:
    from gateway.remote.upstream import UpstreamClient

log = logging.getLogger("uomp.gateway")

GUARD_START_SECONDS = 30.0  # the child must answer /v1/health within this
GUARD_STOP_SECONDS = 10.0  # SIGTERM, then SIGKILL after this
HEALTH_POLL_SECONDS = 0.05
RESTART_FIRST_SECONDS = 0.5
RESTART_MAX_SECONDS = 30.0
RESTART_STABLE_SECONDS = 60.0
OUTPUT_TAIL_LINES = 40  # the child's last lines kept for an error message
OUTPUT_LINE_CHARS = 2000
_LISTENING = re.compile(r"guard listening on unix:\S+ and http://(\S+):(\d+)")

# The child's entry point: die with the parent, then the ordinary CLI (``uomp ... guard serve``).
_CHILD_BOOT = "import sys; from gateway.cli.gateway import guard_child_main; sys.exit(guard_child_main(sys.argv[1:]))"


def gateway_config(args: argparse.Namespace, paths: Paths) -> GatewayConfig:
    overrides: dict[str, Any] = {}
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        if not host or not port.isdigit():
            raise UompError("CONFIG_ERROR", "--listen takes HOST:PORT")
        overrides["listen_host"] = host.strip("[]")
        overrides["listen_port"] = int(port)
    if args.upstream:
        overrides["upstream"] = args.upstream
    if args.endpoint:
        overrides["endpoints"] = list(args.endpoint)
    if args.force_non_loopback:
        overrides["allow_non_loopback"] = True
    if args.metrics_port is not None:
        overrides["metrics_port"] = args.metrics_port
    if args.tunnel_origin_port is not None:
        overrides["tunnel_origin_port"] = args.tunnel_origin_port
    return load_section(GatewayConfig, "gateway", file=paths.config_file, overrides=overrides)


# ----------------------------------------------------------------------------- the guard child


def die_with_parent(parent: int) -> bool:
    """Ask the kernel for SIGTERM when the parent dies, however it dies (Linux ``PR_SET_PDEATHSIG``;
    elsewhere a no-op). False if the parent is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    return os.getppid() == parent  # checked after: the parent may have died before the call


def guard_child_main(argv: list[str]) -> int:
    """Entry of the guard child process: ``argv`` = [parent pid, uomp arguments...]."""
    if not die_with_parent(int(argv[0])):
        return 1
    from gateway.cli.main import main

    return main(argv[1:])


def guard_command(paths: Paths, *, serve_tcp: bool, verbose: bool = False, force_non_loopback: bool = False,
                  parent_pid: int | None = None) -> list[str]:
    """The child's command line: ``uomp --home H [-v] guard serve [--no-tcp] [--force-non-loopback]``."""
    cmd = [sys.executable, "-P", "-c", _CHILD_BOOT, str(parent_pid or os.getpid()), "--home", str(paths.home)]
    if verbose:
        cmd.append("-v")
    cmd += ["guard", "serve"]
    if not serve_tcp:
        cmd.append("--no-tcp")
    if force_non_loopback:
        cmd.append("--force-non-loopback")
    return cmd


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


class GuardProcess:
    """The guard as a supervised child process (see the module docstring)."""

    def __init__(self, paths: Paths, command: list[str], *, start_seconds: float = GUARD_START_SECONDS,
                 stop_seconds: float = GUARD_STOP_SECONDS, env: dict[str, str] | None = None) -> None:
        self.paths = paths
        self.command = command
        self.start_seconds = start_seconds
        self.stop_seconds = stop_seconds
        self.env = env if env is not None else _child_env()
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False
        self.restarts = 0
        self.tcp_url: str | None = None  # the Local Profile URL, once the child has logged it
        self._tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        self._held: list[str] | None = None  # output held back while a child starts (shown on success)
        self._relay: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._wake = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    # -- output

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        pending = b""
        while True:
            data = await stream.read(65536)
            if not data:
                if pending:
                    self._line(pending)
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                self._line(raw)
            if len(pending) > OUTPUT_LINE_CHARS:
                self._line(pending)
                pending = b""

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")[:OUTPUT_LINE_CHARS]
        self._tail.append(line)
        m = _LISTENING.search(line)
        if m:
            self.tcp_url = f"http://{m.group(1)}:{m.group(2)}"
        if self._held is not None:
            self._held.append(line)
        else:
            print(line, file=sys.stderr, flush=True)

    # -- lifecycle

    async def start(self) -> None:
        """Spawn the child and wait until it answers /v1/health; UompError (child gone) if it does not."""
        self.stopping = False
        try:
            await self._spawn_and_wait()
        except BaseException:
            await self._terminate()
            raise

    async def _spawn_and_wait(self) -> None:
        from gateway.remote.upstream import Upstream, UpstreamClient

        loop = asyncio.get_running_loop()
        self._tail.clear()
        self._held = []
        self.proc = proc = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=self.env)
        assert proc.stdout is not None
        self._relay = loop.create_task(self._pump(proc.stdout))
        self._started_at = loop.time()
        deadline = self._started_at + self.start_seconds
        probe = UpstreamClient(Upstream("unix", str(self.paths.guard_sock)), timeout_seconds=1.0, max_idle=0)
        try:
            while True:
                if proc.returncode is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(self._relay), 2.0)  # its last words
                    raise self._failed(f"the guard process exited during startup ({_describe_exit(proc.returncode)})")
                if await self._healthy(probe):
                    break
                if loop.time() >= deadline:
                    raise self._failed(f"the guard process did not answer on {self.paths.guard_sock} within "
                                       f"{self.start_seconds:.0f} s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), HEALTH_POLL_SECONDS)
        finally:
            await probe.close()
        held, self._held = self._held or [], None
        for line in held:
            print(line, file=sys.stderr, flush=True)

    def _failed(self, message: str) -> UompError:
        lines = list(self._tail) or ["(the guard process wrote nothing)"]
        self._held = None
        return UompError("STORE_UNAVAILABLE", message + "; its output:", details={"lines": lines})

    @staticmethod
    async def _healthy(probe: UpstreamClient) -> bool:
        try:
            resp = await probe.request("GET", "/v1/health", {})
        except UompError:
            return False
        try:
            return bool(resp.status == 200)
        finally:
            resp.release()

    def supervise(self) -> None:
        """Restart the child whenever it dies (until :meth:`stop`)."""
        if self._supervisor is None:
            self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        delay = RESTART_FIRST_SECONDS
        while not self.stopping:
            proc = self.proc
            if proc is None:
                return
            await proc.wait()
            if self.stopping:
                return
            if loop.time() - self._started_at >= RESTART_STABLE_SECONDS:
                delay = RESTART_FIRST_SECONDS
            log.error("guard process %s exited unexpectedly (%s); the gateway answers 503 STORE_UNAVAILABLE "
                      "until it is back; restarting it in %.1f s", proc.pid, _describe_exit(proc.returncode), delay)
            remove_dead_socket(self.paths.guard_sock)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)  # woken early by stop()
            delay = min(delay * 2, RESTART_MAX_SECONDS)
            if self.stopping:
                return
            try:
                await self._spawn_and_wait()
            except UompError as exc:
                log.error("guard restart failed: %s", exc.message)
                for line in (exc.details or {}).get("lines", [])[-10:]:
                    log.error("  guard: %s", line)
                await self._terminate()
                continue
            self.restarts += 1
            log.warning("guard process restarted (pid %s, restart #%d)", self.pid, self.restarts)

    def send_hup(self) -> None:
        if self.running and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGHUP)

    async def stop(self) -> None:
        """No more restarts; SIGTERM the child, SIGKILL it after ``stop_seconds``."""
        self.stopping = True
        self._wake.set()
        sup, self._supervisor = self._supervisor, None
        if sup is not None:
            sup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sup
        await self._terminate()

    async def _terminate(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.stop_seconds)
            except TimeoutError:
                log.warning("guard process %s did not stop within %.0f s of SIGTERM; killing it", proc.pid,
                            self.stop_seconds)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if proc is not None and proc.returncode is not None and proc.returncode < 0:
            remove_dead_socket(self.paths.guard_sock)  # a killed guard cannot remove its own
        relay, self._relay = self._relay, None
        if relay is not None:
            try:
                await asyncio.wait_for(relay, 2.0)
            except (TimeoutError, asyncio.CancelledError, OSError):
                relay.cancel()
        if self._held is not None:  # output held back during a start that did not finish
            held, self._held = self._held, None
            for line in held:
                print(line, file=sys.stderr, flush=True)


def _child_env() -> dict[str, str]:
    """This environment, with the directory this ``gateway`` package came from first on the path
    (the child runs the same code as the parent, installed or not)."""
    import gateway

    env = dict(os.environ)
    root = str(Path(gateway.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ----------------------------------------------------------------------------- running


def preflight(paths: Paths, gcfg: GatewayConfig, guard_cfg: GuardConfig | None, *, serve_tcp: bool) -> None:
    """Everything that must be refused before any process or listener starts."""
    from gateway.guard.server import check_bind, claim_socket_path

    check_bind(gcfg.listen_host, gcfg.allow_non_loopback, "the gateway")
    if gcfg.tunnel_origin_port >= 0:
        check_bind(gcfg.tunnel_origin_host, False, "the tunnel-origin listener")
    if guard_cfg is not None:
        if serve_tcp:
            check_bind(guard_cfg.tcp_host, guard_cfg.allow_non_loopback, "the guard's Local Profile listener")
        claim_socket_path(paths.guard_sock)  # a live guard there: refuse; a stale file: removed


async def _run(paths: Paths, gcfg: GatewayConfig, *, with_guard: bool, args: argparse.Namespace) -> None:
    from gateway.remote.server import GatewayRunner

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    guard: GuardProcess | None = None
    serve_tcp = not getattr(args, "no_local_port", False)
    if with_guard:
        gcfg_guard = guard_config(args, paths)
        preflight(paths, gcfg, gcfg_guard, serve_tcp=serve_tcp)
        command = guard_command(paths, serve_tcp=serve_tcp, verbose=bool(getattr(args, "verbose", False)),
                                force_non_loopback=bool(args.force_non_loopback))
        guard = GuardProcess(paths, command)
        await guard.start()
    gw = GatewayRunner(paths, gcfg)
    try:
        await gw.start()
    except BaseException:
        if guard is not None:
            await guard.stop()
        raise

    def _stop() -> None:
        if guard is not None:
            guard.stopping = True  # at once: a child that exits from the same Ctrl-C is not restarted
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop)

    def _hup() -> None:
        gw.reload()
        if guard is not None:
            guard.send_hup()
    loop.add_signal_handler(signal.SIGHUP, _hup)
    print(f"gateway: https://{gcfg.listen_host}:{gw.port} (TLS 1.3, client certificates from your agent CA)",
          flush=True)
    if guard is not None:
        guard.supervise()
        local = ""
        if serve_tcp:
            local = f" and {guard.tcp_url or f'http://127.0.0.1:{gcfg_guard.tcp_port}'} (Local Profile)"
        print(f"guard:   unix:{paths.guard_sock}{local} (process {guard.pid}, restarted if it dies)", flush=True)
    if gw.metrics_port:
        print(f"metrics: http://127.0.0.1:{gw.metrics_port}/metrics", flush=True)
    if gw.tunnel_port:
        print(f"tunnel origin: http://127.0.0.1:{gw.tunnel_port} (DPoP required)", flush=True)
    print("Ctrl-C stops; SIGHUP reloads certificates, CRL and keys.", flush=True)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await gw.stop()
        if guard is not None:
            await guard.stop()


def _serve(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    asyncio.run(_run(paths, gateway_config(args, paths), with_guard=False, args=args))
    return 0


def _start(args: argparse.Namespace) -> int:
    from gateway import keys

    paths = paths_from(args)
    keys.init_home(paths)
    from gateway.cli import home

    for hook in home.INIT_HOOKS:
        hook(paths)
    asyncio.run(_run(paths, gateway_config(args, paths), with_guard=True, args=args))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", metavar="HOST:PORT", help="mTLS listener (default 127.0.0.1:9443)")
    p.add_argument("--endpoint", action="append", metavar="URL",
                   help="a URL agents use to reach this gateway; tokens must name one as audience (repeatable)")
    p.add_argument("--upstream", help="guard to forward to: unix:/path/guard.sock (default $UOMP_HOME/guard.sock) "
                   "or http://127.0.0.1:PORT")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--tunnel-origin-port", type=int, metavar="PORT",
                   help="also listen on 127.0.0.1:PORT (plain HTTP) for a tunnel such as cloudflared; every request "
                   "there needs a DPoP proof; the tunnel's public URL must be an --endpoint")
    p.add_argument("--force-non-loopback", action="store_true",
                   help="allow --listen on a non-loopback address (needed to accept agents from other hosts)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    g = sub.add_parser("gateway", help="the remote gateway (TLS 1.3 + mTLS) for agents on other machines")
    gsub = g.add_subparsers(dest="gateway_command", metavar="ACTION", required=True)
    s = gsub.add_parser("serve", help="run the gateway alone, in front of an already running guard")
    _common(s)
    s.set_defaults(func=_serve)
    st = gsub.add_parser("start", help="run the appliance: init if needed, then the guard (in a child process, "
                         "restarted if it dies) and the gateway")
    _common(st)
    st.add_argument("--no-local-port", action="store_true",
                    help="do not serve the Local Profile on 127.0.0.1:9374 (Unix socket only)")
    st.set_defaults(func=_start)
