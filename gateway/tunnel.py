"""Supervising `cloudflared`: the appliance's way onto the internet without opening a port.

Modes (``--tunnel``):

* ``quick``: ``cloudflared tunnel --no-autoupdate --url http://127.0.0.1:<tunnel-origin-port>``.
  Cloudflare ends TLS at its edge and forwards plain HTTP to the DPoP-only origin listener, so
  tunnel traffic never counts as mTLS. The public ``https://<words>.trycloudflare.com`` URL is
  parsed from cloudflared's log and changes on every restart.
* ``named``: ``cloudflared tunnel --no-autoupdate run`` with the tunnel token in the
  ``TUNNEL_TOKEN`` environment variable (never on the command line, where ``ps`` shows it); the
  public host name is the one configured for the tunnel, stable across restarts.
* ``tcp``: the same named tunnel, its ingress pointing at the mTLS port, for agents that run
  ``cloudflared access tcp``: end-to-end mTLS, Cloudflare sees only TLS records.
* ``none``: no tunnel.

The supervisor never downloads anything: it runs the ``cloudflared`` found on ``PATH`` or at a
configured path, and when there is none it says so once, with install instructions, and the
gateway keeps serving locally. It restarts a dead tunnel with exponential backoff (a much longer
one when Cloudflare rate-limits quick tunnels: HTTP 429 / error 1015), gives up waiting for a URL
after a time-out and tries again, and reports each new public URL through ``on_url`` so the
gateway accepts it at once.

Nothing here is run against the real Cloudflare service in this project's tests (it cannot be
reached from where they run); ``tests/fake_cloudflared.py`` stands in for the binary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("uomp.tunnel")

QUICK_URL = re.compile(r"https://[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.trycloudflare\.com\b")
RATE_LIMITED = re.compile(r"429 Too Many Requests|error code: 1015")
CONNECTED = re.compile(r"Registered tunnel connection")
MAX_LINE = 4096
CONFIG_PLACES = (
    "~/.cloudflared",
    "~/.cloudflare-warp",
    "~/cloudflare-warp",
    "/etc/cloudflared",
    "/usr/local/etc/cloudflared",
)
INSTALL_HINT = (
    "install cloudflared from Cloudflare's package repository (e.g. `apt-get install cloudflared` "
    "after adding pkg.cloudflare.com) or set [tunnel] cloudflared = /path/to/cloudflared"
)

OnUrl = Callable[[str, str | None], Awaitable[None] | None]


@dataclass(frozen=True)
class TunnelConfig:
    """How to run the Cloudflare tunnel: its mode, origin, cloudflared binary and named-tunnel settings."""

    mode: str = "none"  # quick | named | tcp | none
    origin_url: str = ""  # quick: http://127.0.0.1:<tunnel-origin-port>
    cloudflared: str | None = None  # explicit path; None: look on PATH
    token: str | None = None  # named / tcp
    hostname: str | None = None  # named / tcp: the public host name of the tunnel
    url_timeout_seconds: float = 45.0
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    rate_limit_backoff_seconds: float = 300.0
    stable_after_seconds: float = 60.0  # a run this long resets the backoff
    stop_timeout_seconds: float = 5.0
    private_home: Path | None = None  # an empty HOME for the child when a user config breaks quick tunnels

    def __post_init__(self) -> None:
        if self.mode not in ("quick", "named", "tcp", "none"):
            raise ValueError(f"tunnel mode must be quick, named, tcp or none, not {self.mode!r}")
        if self.mode == "quick" and not self.origin_url.startswith("http://127.0.0.1:"):
            raise ValueError("a quick tunnel forwards to the loopback tunnel-origin listener (http://127.0.0.1:PORT)")
        if self.mode in ("named", "tcp") and not (self.token and self.hostname):
            raise ValueError(f"a {self.mode} tunnel needs a token and its public host name")


@dataclass
class TunnelState:
    """What the tunnel is doing now: its status, public URL, process and restarts."""

    mode: str
    status: str = "stopped"  # stopped | missing | starting | running | restarting | rate-limited
    public_url: str | None = None
    pid: int | None = None
    restarts: int = 0
    last_error: str | None = None
    since: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "status": self.status,
            "public_url": self.public_url,
            "pid": self.pid,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "since": self.since,
        }


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the appliance dies, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``); its own session means no SIGINT from the terminal reaches it."""
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)


def find_cloudflared(configured: str | None) -> str | None:
    """The cloudflared binary to run: the configured path if executable, else the one on PATH."""
    if configured:
        p = Path(configured).expanduser()
        return str(p) if p.is_file() and os.access(p, os.X_OK) else None
    return shutil.which("cloudflared")


def user_configs() -> list[Path]:
    """cloudflared's default config files that make it ignore ``--url`` quick tunnels."""
    found = []
    for place in CONFIG_PLACES:
        for name in ("config.yml", "config.yaml"):
            p = Path(place).expanduser() / name
            if p.is_file():
                found.append(p)
    return found


class TunnelSupervisor:
    """Runs cloudflared, reads its public URL, and restarts it with backoff when it dies."""

    def __init__(
        self, cfg: TunnelConfig, *, on_url: OnUrl | None = None, on_state: Callable[[TunnelState], None] | None = None
    ) -> None:
        self.cfg = cfg
        self.state = TunnelState(cfg.mode)
        self._on_url = on_url
        self._on_state = on_state
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._url_seen = asyncio.Event()

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        if self.cfg.mode == "none" or self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tunnel-supervisor")

    async def wait_for_url(self, timeout: float) -> str | None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._url_seen.wait(), timeout)
        return self.state.public_url

    async def stop(self) -> None:
        self._stopping = True
        await self._kill()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._set(status="stopped", pid=None)

    # ------------------------------------------------------------------ internals

    def _set(self, **changes: object) -> None:
        for k, v in changes.items():
            setattr(self.state, k, v)
        self.state.since = time.time()
        if self._on_state is not None:
            self._on_state(self.state)

    def _argv(self, binary: str) -> list[str]:
        if self.cfg.mode == "quick":
            return [binary, "tunnel", "--no-autoupdate", "--url", self.cfg.origin_url]
        return [binary, "tunnel", "--no-autoupdate", "run"]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("TUNNEL_TOKEN",)}
        if self.cfg.mode in ("named", "tcp") and self.cfg.token:
            env["TUNNEL_TOKEN"] = self.cfg.token
        if self.cfg.mode == "quick":
            homes = [p for p in user_configs() if str(p).startswith(str(Path("~").expanduser()))]
            if homes and self.cfg.private_home is not None:
                # A config.yml in the user's home makes cloudflared run that tunnel instead of a quick
                # one: give the child an empty private HOME so it does not see it.
                self.cfg.private_home.mkdir(mode=0o700, parents=True, exist_ok=True)
                env["HOME"] = str(self.cfg.private_home)
                log.warning(
                    "tunnel: %s would stop a quick tunnel; running cloudflared with a private HOME",
                    ", ".join(str(p) for p in homes),
                )
        return env

    async def _run(self) -> None:
        binary = find_cloudflared(self.cfg.cloudflared)
        if binary is None:
            where = self.cfg.cloudflared or "PATH"
            self._set(status="missing", last_error=f"cloudflared not found on {where}")
            log.error(
                "tunnel: cloudflared not found on %s; %s. The gateway keeps serving locally.", where, INSTALL_HINT
            )
            return
        if self.cfg.mode == "quick":
            etc = [p for p in user_configs() if not str(p).startswith(str(Path("~").expanduser()))]
            if etc:
                log.warning(
                    "tunnel: %s may stop a quick tunnel; move it aside if no URL appears", ", ".join(map(str, etc))
                )
        backoff = self.cfg.backoff_initial_seconds
        while not self._stopping:
            started = time.monotonic()
            reason = await self._run_once(binary)
            if self._stopping:
                return
            ran = time.monotonic() - started
            if ran >= self.cfg.stable_after_seconds:
                backoff = self.cfg.backoff_initial_seconds
            if reason == "rate-limited":
                wait = max(backoff, self.cfg.rate_limit_backoff_seconds)
                self._set(
                    status="rate-limited",
                    pid=None,
                    last_error="Cloudflare is rate-limiting quick tunnels (HTTP 429 / error 1015)",
                )
                log.error(
                    "tunnel: Cloudflare rate-limited the quick tunnel request; retrying in %.0f s "
                    "(a named tunnel avoids this)",
                    wait,
                )
            else:
                wait = backoff
                self._set(status="restarting", pid=None, last_error=reason)
                log.warning("tunnel: cloudflared stopped (%s); restarting in %.1f s", reason, wait)
            self.state.restarts += 1
            await asyncio.sleep(wait)
            backoff = min(backoff * 2, self.cfg.backoff_max_seconds)

    async def _run_once(self, binary: str) -> str:
        self._set(status="starting")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv(binary),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,
                limit=MAX_LINE * 4,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            return f"could not start cloudflared ({exc.strerror})"
        self._set(pid=self._proc.pid)
        if self.cfg.mode in ("named", "tcp"):
            await self._new_url(f"https://{self.cfg.hostname}")
        assert self._proc.stdout is not None
        rate_limited = False
        deadline = time.monotonic() + self.cfg.url_timeout_seconds
        got_url = self.cfg.mode != "quick"
        tail: list[str] = []
        while True:
            timeout = None if got_url else max(0.05, deadline - time.monotonic())
            try:
                raw = await asyncio.wait_for(self._proc.stdout.readline(), timeout)
            except TimeoutError:
                await self._kill()
                return f"no public URL within {self.cfg.url_timeout_seconds:.0f} s"
            except ValueError:  # a line longer than the stream limit: skip it
                continue
            if not raw:
                break
            line = raw[:MAX_LINE].decode(errors="replace").rstrip()
            tail = [*tail[-4:], line]
            if RATE_LIMITED.search(line):
                rate_limited = True
            if not got_url and (m := QUICK_URL.search(line)):
                got_url = True
                await self._new_url(m.group(0))
            if CONNECTED.search(line) and got_url:
                self._set(status="running", last_error=None)
        code = await self._proc.wait()
        self._proc = None
        if rate_limited:
            return "rate-limited"
        last = next((t for t in reversed(tail) if "ERR" in t or "failed" in t), tail[-1] if tail else "")
        return f"exit status {code}: {last[-200:]}" if last else f"exit status {code}"

    async def _new_url(self, url: str) -> None:
        old = self.state.public_url
        self._set(public_url=url, status="running")
        self._url_seen.set()
        if url != old:
            log.info(
                "tunnel: public URL %s%s", url, f" (was {old}: agents must be re-authorized with it)" if old else ""
            )
            if self._on_url is not None:
                res = self._on_url(url, old)
                if asyncio.iscoroutine(res):
                    await res

    async def _kill(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.cfg.stop_timeout_seconds)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
