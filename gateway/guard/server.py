"""Serving the guard: the Unix socket (0600) and, for the Local Profile, 127.0.0.1:9374."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gateway import httpd
from gateway.atrest import vault
from gateway.config import GuardConfig, Paths
from gateway.errors import ErrorCode, UompError
from gateway.eventloop import cancel_all, release_free_heap
from gateway.guard.app import create_app
from gateway.guard.auth import PRUNE_BATCH_ROWS
from gateway.guard.services import GuardServices
from gateway.guard.sessions import MAX_DURATION_MINUTES_FLOOR
from gateway.keys import KeyWatch
from gateway.ledger import integrity
from gateway.netutil import check_bind, claim_socket_path

if TYPE_CHECKING:
    from gateway.ledger.anchorer import Anchorer

log = logging.getLogger("uomp.guard")
# The Unix socket's listen backlog. A non-blocking connect() to a Unix socket whose backlog is full
# fails at once (EAGAIN), where TCP would wait: the gateway, which opens a connection per
# concurrent request beyond its idle pool, would answer 503 for it. The kernel caps it at somaxconn.
UNIX_BACKLOG = 4096
# Connection budgets: ``[guard] unix_max_connections`` and ``tcp_max_connections`` (gateway/httpd.py:
# a newcomer takes the place of the longest-idle connection), both lowered to fit under the
# process's descriptor limit with FD_RESERVE to spare (connection_budgets).
FD_RESERVE = 64  # descriptors kept for the databases, the log, the key watch and the verify child
SHORTEST_SESSION_SECONDS = MAX_DURATION_MINUTES_FLOOR * 60.0  # the sweeper's longest sleep (_sweeper)
EXPIRY_SLACK_SECONDS = 0.05  # the sweeper wakes this long after an expiry (so it is past), never sooner than this

VERIFY_NICE = 10  # the background verify's niceness increment (its own process)
MAX_VERIFY_OUTPUT = 1 << 20  # bytes of its JSON report read
VERIFY_CHILD = (
    f"import os, sys; os.nice({VERIFY_NICE}); from gateway.cli.main import main; "
    "raise SystemExit(main(['--home', sys.argv[1], 'audit', 'verify', '--json', '--no-chain']))"
)


def connection_budgets(unix_ceiling: int, tcp_ceiling: int) -> tuple[int, int]:
    """The (Unix socket, Local Profile port) connection budgets under this process's descriptor
    limit: three quarters of what is left after :data:`FD_RESERVE` for the socket, a quarter for
    the port, each at most its ceiling (the ``[guard]`` settings)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    room = max(64, (65536 if soft == resource.RLIM_INFINITY else soft) - FD_RESERVE)
    return min(unix_ceiling, room * 3 // 4), min(tcp_ceiling, room // 4)


class GuardRunner:
    """Starts both listeners; ``stop()`` closes them and the databases."""

    def __init__(self, paths: Paths, cfg: GuardConfig, *, serve_tcp: bool | None = None) -> None:
        self.paths = paths
        self.cfg = cfg
        self.serve_tcp = cfg.serve_tcp if serve_tcp is None else serve_tcp
        self.services: GuardServices | None = None
        self._servers: list[httpd.Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.tcp_port: int | None = None
        self._claimed = False  # True once the socket path is ours (only then do we remove it)
        self.anchorer: Anchorer | None = None
        self._serving = False  # True once start() finished: only a guard that served signs at stop
        self._keys_signalled = asyncio.Event()  # set by SIGHUP (keys_changed): the key watch reloads at once

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # nothing half-started is left behind (databases, socket file)
            raise

    async def _start(self) -> None:
        if self.serve_tcp:
            check_bind(self.cfg.tcp_host, self.cfg.allow_non_loopback, "the guard's Local Profile listener")
        sock = self.paths.guard_sock
        claim_socket_path(sock)  # before opening anything: a second guard must not touch the databases
        self._claimed = True
        key_watch = KeyWatch(self.paths)  # before the keys are read: no change goes unseen
        self.services = GuardServices.open(self.paths, self.cfg)
        self.services.audit.purge()
        self.services.auth.prune()
        unix_budget, tcp_budget = connection_budgets(self.cfg.unix_max_connections, self.cfg.tcp_max_connections)
        unix = httpd.Server(create_app(self.services, listener="unix"), name="unix", max_connections=unix_budget)
        self._servers.append(unix)
        old = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            await unix.serve_unix(str(sock), backlog=UNIX_BACKLOG)
        finally:
            os.umask(old)
        os.chmod(sock, 0o600)
        if self.serve_tcp:
            tcp = httpd.Server(create_app(self.services, listener="tcp"), name="tcp", max_connections=tcp_budget)
            self._servers.append(tcp)
            self.tcp_port = await tcp.serve_tcp(self.cfg.tcp_host, self.cfg.tcp_port)
            self.services.add_local_port(self.tcp_port)
        self._tasks.append(asyncio.get_running_loop().create_task(self._sweeper()))
        self._tasks.append(asyncio.get_running_loop().create_task(self._key_watcher(key_watch)))
        self._tasks.append(asyncio.get_running_loop().create_task(self._checkpointer()))
        if self.cfg.audit_full_verify_at_start and self.services.audit.integrity is None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._verify_audit()))
        await self._start_anchoring()
        self._serving = True
        log.info(
            "guard listening on unix:%s%s",
            sock,
            f" and http://{self.cfg.tcp_host}:{self.tcp_port}" if self.serve_tcp else "",
        )

    async def _sweeper(self) -> None:
        """Closes each session at its expiry (its ``session_expired`` event then, not at the next
        tick), and runs retention and pruning every ``purge_interval_seconds``. Between two looks it
        sleeps until the next expiry it knows of, and at most ``sweep_interval_seconds`` and the
        shortest session's duration: a session granted meanwhile (by this guard, or by a command
        in another process) is seen before it can expire. An idle guard wakes once a minute."""
        svc = self.services
        assert svc is not None
        loop = asyncio.get_running_loop()
        cap = max(0.05, min(self.cfg.sweep_interval_seconds, SHORTEST_SESSION_SECONDS))
        purge_at = loop.time() + self.cfg.purge_interval_seconds
        while True:
            next_expiry: float | None = None
            try:  # both off the event loop: another process may hold a lock on either database
                next_expiry = await svc.authdb(svc.auth.sweep)
                if loop.time() >= purge_at:
                    purge_at = loop.time() + cap  # one that fails is tried again at the next look
                    await loop.run_in_executor(None, svc.audit.purge)
                    while max((await svc.authdb(svc.auth.prune)).values()) >= PRUNE_BATCH_ROWS:
                        pass  # a large backlog goes in slices, each its own trip to the auth.db worker
                    purge_at = loop.time() + self.cfg.purge_interval_seconds
            except UompError as exc:
                log.warning("sweeper: %s", exc.code)
            delay = cap if next_expiry is None else min(cap, next_expiry + EXPIRY_SLACK_SECONDS)
            await asyncio.sleep(max(0.0, min(delay, purge_at - loop.time())))

    async def _checkpointer(self) -> None:
        """A signed checkpoint within audit_checkpoint_seconds of the last event, even when idle."""
        svc = self.services
        assert svc is not None
        interval = max(0.1, self.cfg.audit_checkpoint_seconds)
        while True:
            await asyncio.sleep(interval)
            try:
                if await svc.audit.reader.run(svc.audit.checkpoint_due):
                    await svc.audit.writer.probe()
            except UompError as exc:
                log.warning("checkpoint: %s", exc.code)

    async def _verify_audit(self) -> None:
        """The whole audit log verified once (the bounded start-up check saw only its tail), by
        ``uomp audit verify --no-chain`` in a process of its own at a lower CPU priority: one pass over
        the log that never holds this process's GIL or event loop. A log that fails makes the guard
        refuse every request from then on; a verifier that cannot run is logged, not a finding."""
        svc = self.services
        assert svc is not None
        started = time.monotonic()
        # the child lowers its own priority (no preexec_fn: this process has threads)
        handover = vault.child_handover(self.paths)  # a sealed home: the audit key opens in the child too
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                VERIFY_CHILD,
                str(self.paths.home),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                env={**os.environ, **handover.env},
                pass_fds=handover.fds,
            )
        finally:
            handover.close()
        try:
            out, _ = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        try:
            report = json.loads(out[:MAX_VERIFY_OUTPUT])
        except ValueError:
            report = None
        if not isinstance(report, dict) or proc.returncode not in (0, 1):
            log.warning("audit log: the background verify did not run to its end (exit %s)", proc.returncode)
            return
        if report.get("ok") is True:
            log.info("audit log verified in full: %s events (%.1f s)", report.get("events"), time.monotonic() - started)
            return
        problems = report.get("problems") or ["it does not verify"]
        code = ErrorCode.AUDIT_LOG_INCONSISTENT if report.get("inconsistent") else ErrorCode.AUDIT_LOG_DAMAGED
        first = report.get("first_bad_seq")
        svc.audit.refuse(
            integrity.refusal(code, str(problems[0])[:500], first_bad_seq=first if isinstance(first, int) else None)
        )

    async def _start_anchoring(self) -> None:
        """The anchoring worker, when [anchor] names a chain: drains the checkpoint backlog."""
        from gateway.config import AnchorConfig, load_section

        acfg = load_section(AnchorConfig, "anchor", file=self.paths.config_file)
        if acfg.backend == "none":
            return
        from gateway.anchor.ops import make_backend
        from gateway.ledger.anchorer import Anchorer, AnchorPolicy

        backend = make_backend(
            acfg.backend,
            rpc_url=acfg.rpc_url or None,
            contract=acfg.contract or None,
            chain_id=acfg.chain_id or None,
            key_file=Path(acfg.key_file) if acfg.key_file else None,
            account=acfg.account or None,
            confirmations=acfg.confirmations,
            code_hash=acfg.code_hash or None,
        )
        self.anchorer = Anchorer(
            self.paths.audit_db,
            backend,
            policy=AnchorPolicy(
                poll_seconds=acfg.poll_seconds,
                backoff_max_seconds=acfg.backoff_max_seconds,
                recheck_seconds=acfg.recheck_seconds,
                recheck_count=acfg.recheck_count,
            ),
        )
        self.anchorer.start()
        log.info("anchoring checkpoints on %s", acfg.backend)

    def reload_keys(self) -> None:
        """Blocking (reads the key files); on a running guard use :meth:`reload_keys_async`."""
        if self.services is not None:
            self.services.auth.reload_keys()
            log.info("signing keys reloaded")

    async def reload_keys_async(self) -> None:
        """The keys again, on the auth.db worker: the thread that uses them, off the event loop."""
        if self.services is not None:
            await self.services.authdb(self.services.auth.reload_keys)
            log.info("signing keys reloaded")

    def keys_changed(self) -> None:
        """The key files changed (SIGHUP, sent by `uomp keys rotate` and the like): reload them now."""
        self._keys_signalled.set()

    async def _key_watcher(self, watch: KeyWatch) -> None:
        """Reload the keys when told (:meth:`keys_changed`) and when their files changed, looked at
        every ``key_watch_fallback_seconds`` (a file replaced by hand). The look is four ``stat``
        calls, on the loop; only a reload goes to the auth.db worker."""
        fallback = max(0.05, float(self.cfg.key_watch_fallback_seconds))
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._keys_signalled.wait(), fallback)
            signalled = self._keys_signalled.is_set()
            self._keys_signalled.clear()
            try:
                if watch.changed() or signalled:  # changed() first: its stamp is taken either way
                    await self.reload_keys_async()
            except UompError as exc:
                log.error("key reload failed, keeping the previous keys: %s", exc.message)

    async def stop(self) -> None:
        if self.anchorer is not None:
            await self.anchorer.stop()
            with contextlib.suppress(Exception):
                await self.anchorer.backend.close()
            self.anchorer = None
        await cancel_all(self._tasks)  # bounded: a task that lost its cancellation is cancelled again
        self._tasks.clear()
        for server in self._servers:
            await server.close()
        self._servers.clear()
        if self.services is not None and self._serving:
            self._serving = False
            # a clean stop leaves no event outside a signed checkpoint (queued for anchoring if configured)
            try:
                size = await asyncio.to_thread(self.services.audit.sign_now)
                if size is not None:
                    log.info("final audit checkpoint signed at tree size %d", size)
            except UompError as exc:
                log.warning("no final audit checkpoint at stop (%s): %s", exc.code, exc.message)
        if self.services is not None:
            self.services.close()
            self.services = None
        if self._claimed:
            with contextlib.suppress(FileNotFoundError):
                self.paths.guard_sock.unlink()
            self._claimed = False


def install_signals(
    loop: asyncio.AbstractEventLoop, stop_event: asyncio.Event, on_hup: list[object] | None = None
) -> None:
    """SIGINT/SIGTERM stop the server; SIGHUP runs each of ``on_hup``."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_event.set)
    if on_hup:

        def _hup() -> None:
            for cb in on_hup or []:
                try:
                    cb()  # type: ignore[operator]
                except UompError as exc:
                    log.error("reload failed: %s", exc.message)

        loop.add_signal_handler(signal.SIGHUP, _hup)


async def run_guard(paths: Paths, cfg: GuardConfig, *, serve_tcp: bool | None = None) -> None:
    """Runs the guard until a stop signal: its listeners, background workers, and a clean stop."""
    runner = GuardRunner(paths, cfg, serve_tcp=serve_tcp)
    loop = asyncio.get_running_loop()
    # SIGHUP before the socket exists: a command that finds this guard by its socket and signals
    # it (gateway/reloads.py) must never meet the default action (termination). The key watch
    # reloads on the auth.db worker, off the loop; one that arrives during start-up is kept.
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGHUP, runner.keys_changed)
    await runner.start()
    stop = asyncio.Event()
    install_signals(loop, stop)
    release_free_heap()  # what start-up freed goes back to the system (an idle guard keeps little)
    try:
        await stop.wait()
    finally:
        await runner.stop()
