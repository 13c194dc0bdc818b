"""The guard as a supervised child process of ``uomp gateway start`` (the appliance).

``start`` runs the guard in a child process (``uomp --home H guard serve [--no-tcp]``) and the
gateway in the parent, so each gets its own core and event loop. :class:`GuardProcess` is the
parent's side:

* the gateway starts only once the child answers ``GET /v1/health`` on ``guard.sock``, within
  :data:`GUARD_START_SECONDS`; a child that dies first, or does not answer in time, is a clear
  error carrying the child's own output;
* while it runs, the child is health-checked over the socket: ``GET /v1/health`` on a *new*
  connection (so a removed or replaced socket file is noticed, not hidden by pooled connections),
  each with a ``health_timeout``. The first check comes ``health_interval`` seconds after the
  start; each check that passes doubles the wait before the next, up to ``health_max_interval``
  (an idle appliance wakes for it every 10 s, not every second); a failed check, a restart, or
  :meth:`GuardProcess.check_soon` (the gateway saw a request to the guard fail) brings it back to
  ``health_interval``. After ``health_failures`` failures in a row (socket file gone, replaced by a
  dead socket, the guard hung or stopped) the child is stopped (SIGTERM and SIGCONT, SIGKILL after
  :data:`UNHEALTHY_KILL_SECONDS`) and restarted like a child that died. A hung child is so stopped
  at the latest ``health_max_interval + health_failures * health_timeout + (health_failures - 1) *
  health_interval`` seconds after it hung (18 s with the defaults), sooner under traffic;
* a child that *exits* is not waited for by a check: its exit is an event (the child watcher), and
  the restart begins at once;
* if the child dies (or is stopped as unhealthy), the gateway keeps answering (503
  STORE_UNAVAILABLE for anything that needs the guard) and the child is restarted with
  exponential backoff (:data:`RESTART_FIRST_SECONDS` doubling to :data:`RESTART_MAX_SECONDS`,
  back to the first delay once a child has run :data:`RESTART_STABLE_SECONDS`), each step logged;
* :meth:`GuardProcess.stop`: SIGTERM, then SIGKILL after :data:`GUARD_STOP_SECONDS` (a socket file
  a killed child leaves behind is removed);
* the child dies with the parent even if the parent is SIGKILLed (Linux ``PR_SET_PDEATHSIG``).

The child's output (stdout and stderr: its log lines) is handed, line by line, to the ``output``
callable (the CLI prints it to stderr). :meth:`GuardProcess.status` is what the gateway's status
file and metrics report about the child.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.atrest import vault
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError
from gateway.netutil import remove_dead_socket
from gateway.remote.upstream import Upstream, UpstreamClient

log = logging.getLogger("uomp.gateway")

GUARD_START_SECONDS = 30.0  # the child must answer /v1/health within this
GUARD_STOP_SECONDS = 10.0  # SIGTERM, then SIGKILL after this
UNHEALTHY_KILL_SECONDS = 3.0  # a child that failed its health checks: SIGTERM, then SIGKILL after this
HEALTH_POLL_SECONDS = 0.05  # during start-up
HEALTH_INTERVAL_SECONDS = 1.0  # defaults of GatewayConfig.guard_health_*
HEALTH_MAX_INTERVAL_SECONDS = 10.0  # the wait between checks doubles up to this while they pass
HEALTH_TIMEOUT_SECONDS = 2.0
HEALTH_FAILURES = 3
RESTART_FIRST_SECONDS = 0.5
RESTART_MAX_SECONDS = 30.0
RESTART_STABLE_SECONDS = 60.0
OUTPUT_TAIL_LINES = 40  # the child's last lines kept for an error message
OUTPUT_LINE_CHARS = 2000
_LISTENING = re.compile(r"guard listening on unix:\S+ and http://(\S+):(\d+)")

# The child's entry point (:mod:`gateway.childboot`): die with the parent, then the ordinary CLI
# (``uomp ... guard serve``); it imports neither this module nor the gateway's code.
_CHILD_BOOT = "import sys; from gateway.childboot import guard_child_main; sys.exit(guard_child_main(sys.argv[1:]))"


def guard_command(
    paths: Paths,
    *,
    serve_tcp: bool,
    verbose: bool = False,
    force_non_loopback: bool = False,
    parent_pid: int | None = None,
) -> list[str]:
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


def describe_exit(rc: int | None) -> str:
    """A child's exit status in words (its code, or the signal that killed it)."""
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _log_output(line: str) -> None:
    log.info("guard: %s", line)


class GuardProcess:
    """The guard as a supervised child process (see the module docstring)."""

    def __init__(
        self,
        paths: Paths,
        command: list[str],
        *,
        start_seconds: float = GUARD_START_SECONDS,
        stop_seconds: float = GUARD_STOP_SECONDS,
        env: dict[str, str] | None = None,
        health_interval: float = HEALTH_INTERVAL_SECONDS,
        health_timeout: float = HEALTH_TIMEOUT_SECONDS,
        health_failures: int = HEALTH_FAILURES,
        health_max_interval: float = HEALTH_MAX_INTERVAL_SECONDS,
        output: Callable[[str], None] = _log_output,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self.paths = paths
        self.command = command
        self.start_seconds = start_seconds
        self.stop_seconds = stop_seconds
        self.env = env if env is not None else child_env()
        self.health_interval = max(0.05, float(health_interval))
        self.health_timeout = max(0.05, float(health_timeout))
        self.health_failures = max(1, int(health_failures))
        self.health_max_interval = max(self.health_interval, float(health_max_interval))
        self.next_check_in = self.health_interval  # the wait before the next check (backs off while they pass)
        self.output = output
        self.on_restart = on_restart  # called with the reason once a restarted child is healthy
        # called after each health check of a running child: None when it passed, else why not;
        # and the seconds until the next check (what a pass vouches for, to whoever shares it)
        self.on_health: Callable[[str | None, float], None] | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False
        self.restarts = 0
        self.failed_checks = 0  # health checks failed in a row (0 while healthy)
        self.last_restart_reason: str | None = None
        self.last_restart_at: float | None = None  # wall clock
        self.tcp_url: str | None = None  # the Local Profile URL, once the child has logged it
        self._tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        self._held: list[str] | None = None  # output held back while a child starts (shown on success)
        self._relay: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._wake = asyncio.Event()
        self._check_soon = asyncio.Event()  # check_soon(): the next check now, the wait back to its first

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def status(self) -> dict[str, Any]:
        """What the status file reports about the child (no secrets: pids, counts, reasons)."""
        return {
            "pid": self.pid if self.running else None,
            "running": self.running,
            "restarts": self.restarts,
            "failed_health_checks": self.failed_checks,
            "last_restart_reason": self.last_restart_reason,
            "last_restart_at": self.last_restart_at,
        }

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
            self.output(line)

    # -- lifecycle

    async def start(self) -> None:
        """Spawn the child and wait until it answers /v1/health; UompError (child gone) if it does not."""
        self.stopping = False
        try:
            await self._spawn_and_wait()
        except BaseException:
            await self._terminate()
            raise

    def _probe_client(self, timeout: float) -> UpstreamClient:
        # max_idle=0: every check opens a new connection through the socket *file*
        return UpstreamClient(Upstream("unix", str(self.paths.guard_sock)), timeout_seconds=timeout, max_idle=0)

    async def _spawn_and_wait(self) -> None:
        loop = asyncio.get_running_loop()
        self._tail.clear()
        self._held = []
        handover = vault.child_handover(self.paths)  # a sealed home's master key, on a pipe
        try:
            self.proc = proc = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**self.env, **handover.env},
                pass_fds=handover.fds,
            )
        finally:
            handover.close()
        assert proc.stdout is not None
        self._relay = loop.create_task(self._pump(proc.stdout))
        self._started_at = loop.time()
        deadline = self._started_at + self.start_seconds
        probe = self._probe_client(1.0)
        try:
            while True:
                if proc.returncode is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(self._relay), 2.0)  # its last words
                    raise self._failed(f"the guard process exited during startup ({describe_exit(proc.returncode)})")
                if (await self._check(probe)) is None:
                    break
                if loop.time() >= deadline:
                    raise self._failed(
                        f"the guard process did not answer on {self.paths.guard_sock} within {self.start_seconds:.0f} s"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), HEALTH_POLL_SECONDS)
        finally:
            await probe.close()
        self.failed_checks = 0
        held, self._held = self._held or [], None
        for line in held:
            self.output(line)

    def _failed(self, message: str) -> UompError:
        lines = list(self._tail) or ["(the guard process wrote nothing)"]
        self._held = None
        return UompError(ErrorCode.STORE_UNAVAILABLE, message + "; its output:", details={"lines": lines})

    @staticmethod
    async def _check(probe: UpstreamClient) -> str | None:
        """None when the guard answers ``GET /v1/health`` with 200, else why not (a stable code)."""
        try:
            resp = await probe.request("GET", "/v1/health", {})
        except UompError as exc:
            return exc.code
        try:
            return None if resp.status == 200 else f"HTTP {resp.status}"
        finally:
            resp.release()

    def check_soon(self) -> None:
        """Check the child now and come back to the first interval (e.g. a request to it failed)."""
        self._check_soon.set()

    async def _watch(self, proc: asyncio.subprocess.Process) -> str | None:
        """Until ``proc`` exits: None when it exited by itself; the reason when it was stopped here
        because it failed ``health_failures`` health checks in a row."""
        waiter = asyncio.ensure_future(proc.wait())
        soon = asyncio.ensure_future(self._check_soon.wait())
        probe = self._probe_client(self.health_timeout)
        self.next_check_in = self.health_interval
        try:
            while True:
                done, _ = await asyncio.wait({waiter, soon}, timeout=self.next_check_in, return_when="FIRST_COMPLETED")
                if waiter in done or self.stopping:
                    return None
                if soon in done:
                    self.next_check_in = self.health_interval  # doubled from the first again if it passes
                    self._check_soon.clear()
                    soon = asyncio.ensure_future(self._check_soon.wait())
                why = await self._check(probe)
                if proc.returncode is not None or self.stopping:
                    return None
                if why is None:
                    self.next_check_in = min(self.next_check_in * 2, self.health_max_interval)
                else:
                    self.next_check_in = self.health_interval
                if self.on_health is not None:
                    self.on_health(why, self.next_check_in)
                if why is None:
                    if self.failed_checks:
                        log.warning("guard process %s answers its health check again", proc.pid)
                    self.failed_checks = 0
                    continue
                self.failed_checks += 1
                if self.failed_checks == 1:
                    log.warning(
                        "guard process %s failed a health check on %s (%s)", proc.pid, self.paths.guard_sock, why
                    )
                if self.failed_checks >= self.health_failures:
                    reason = (
                        f"failed {self.failed_checks} health checks in a row on {self.paths.guard_sock} (last: {why})"
                    )
                    log.error("guard process %s %s; stopping it to restart it", proc.pid, reason)
                    await self._stop_unhealthy(proc)
                    return reason
        finally:
            for fut in (waiter, soon):
                fut.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fut
            await probe.close()

    @staticmethod
    async def _stop_unhealthy(proc: asyncio.subprocess.Process) -> None:
        """SIGTERM (and SIGCONT: a stopped process handles it at once), SIGKILL if it lingers."""
        for sig in (signal.SIGTERM, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        try:
            await asyncio.wait_for(proc.wait(), UNHEALTHY_KILL_SECONDS)
        except TimeoutError:
            log.warning(
                "guard process %s did not stop within %.0f s of SIGTERM; killing it", proc.pid, UNHEALTHY_KILL_SECONDS
            )
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    def supervise(self) -> None:
        """Health-check the child and restart it whenever it dies or fails its checks (until :meth:`stop`)."""
        if self._supervisor is None:
            self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        delay = RESTART_FIRST_SECONDS
        while not self.stopping:
            proc = self.proc
            if proc is None:
                return
            unhealthy = await self._watch(proc)
            await proc.wait()
            if self.stopping:
                return
            if loop.time() - self._started_at >= RESTART_STABLE_SECONDS:
                delay = RESTART_FIRST_SECONDS
            reason = unhealthy or f"exited unexpectedly ({describe_exit(proc.returncode)})"
            self.last_restart_reason = reason
            self.last_restart_at = time.time()
            log.error(
                "guard process %s %s; the gateway answers 503 STORE_UNAVAILABLE until it is back; "
                "restarting it in %.1f s",
                proc.pid,
                reason,
                delay,
            )
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
            if self.on_restart is not None:
                self.on_restart(reason)

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
            for sig in (signal.SIGTERM, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
            try:
                await asyncio.wait_for(proc.wait(), self.stop_seconds)
            except TimeoutError:
                log.warning(
                    "guard process %s did not stop within %.0f s of SIGTERM; killing it", proc.pid, self.stop_seconds
                )
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
                self.output(line)


def child_env() -> dict[str, str]:
    """This environment, with the directory this ``gateway`` package came from first on the path
    (the child runs the same code as the parent, installed or not)."""
    import gateway

    env = dict(os.environ)
    root = str(Path(gateway.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
