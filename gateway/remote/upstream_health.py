"""The gateway's view of the guard behind it: reachable or not, logged, counted and reported.

Pooled keep-alive connections can hide a lost guard: if ``guard.sock`` is removed, or replaced by a
socket nobody listens on, while the guard process lives, the pool keeps working until its
connections idle out, and then every request fails. So :class:`UpstreamMonitor`

* checks the guard on a *new* connection (``GET /v1/health``, within ``timeout`` seconds): the
  first ``interval`` seconds after the last check, each check that passes doubling the wait up
  to ``max_interval`` (a failed one back to ``interval``); no check of its own while another
  check of the same kind vouches for the guard (:meth:`UpstreamMonitor.passed_elsewhere`: the
  appliance's guard supervisor probes the same socket file and says when its next check comes,
  so one probe serves both, one timer backing off for both); and at once (at most every
  :data:`MIN_PROBE_GAP_SECONDS`) after a request could not reach it, telling :attr:`on_suspect`
  (the supervisor checks at once too). The last check decides :attr:`UpstreamMonitor.up`, which
  the gateway's own ``GET /v1/health`` reports (503 STORE_UNAVAILABLE while the guard is
  unreachable);
* hears of every failed exchange with the guard (``STORE_UNAVAILABLE``, ``UPSTREAM_ERROR``,
  ``UPSTREAM_TIMEOUT``) from the forwarder, counts it in the metrics
  (``uomp_gateway_upstream_failures_total{code}``, ``uomp_gateway_upstream_up``) and logs it, at most
  once per ``log_seconds`` with a count of the ones not logged; going down and coming back are
  always logged, once each;
* writes the status file (``$UOMP_HOME/gateway/status.json``, atomic, 0600) when anything changes and
  at least every :data:`STATUS_REFRESH_SECONDS` (``updated_at`` shows the gateway is alive); a
  look for a check rewrites a file :data:`STATUS_RIDE_SECONDS` old, so the two share a wake-up: the upstream
  state plus whatever the registered ``sources`` add (the appliance's guard supervisor adds
  ``"guard"``). Nothing secret is in it: codes, counts, pids, times. The file's shape::

      {"pid": 1234, "running": true, "updated_at": "2026-...Z",
       "upstream": {"kind": "unix", "up": true, "since": "...", "last_error": null,
                    "failed_checks": 0, "request_failures_total": 0, "last_ok_at": "...",
                    "last_failure_at": null},
       "guard": {"pid": 1240, "running": true, "restarts": 0, "failed_health_checks": 0,
                 "last_restart_reason": null, "last_restart_at": null}}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway.core.tokens import iso
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write
from gateway.remote.metrics import Metrics
from gateway.remote.upstream import Upstream, UpstreamClient

log = logging.getLogger("uomp.gateway")

UPSTREAM_FAILURE_CODES = frozenset({ErrorCode.STORE_UNAVAILABLE, ErrorCode.UPSTREAM_ERROR, ErrorCode.UPSTREAM_TIMEOUT})
MIN_PROBE_GAP_SECONDS = 0.25  # checks triggered by failing requests are at least this far apart
STATUS_REFRESH_SECONDS = 15.0  # the status file is never older than this (cli/status.py: stale after 30 s)
STATUS_RIDE_SECONDS = 5.0  # ... and rewritten at any look once it is this old (riding on a check's wake-up)
MAX_INTERVAL_SECONDS = 10.0  # the wait between checks that pass doubles up to this (or ``interval``, if longer)
VOUCH_SLACK_SECONDS = 1.0  # a check elsewhere vouches until its next one is due, plus this, plus ``timeout``


def _iso(ts: float | None) -> str | None:
    return iso(ts) if ts is not None else None


class UpstreamMonitor:
    """Checks the guard's health in the background, so the gateway answers 503 at once while it is down."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        metrics: Metrics,
        status_file: Path | None = None,
        interval: float = 2.0,
        timeout: float = 2.0,
        log_seconds: float = 30.0,
        sources: dict[str, Callable[[], dict[str, Any]]] | None = None,
        probe: Callable[[float], Awaitable[str | None]] | None = None,
        max_interval: float = MAX_INTERVAL_SECONDS,
    ) -> None:
        self.upstream = upstream
        # the check itself when the guard is not behind a socket (the uplink): None = healthy, else why not
        self.probe = probe
        self.metrics = metrics
        self.status_file = status_file
        self.interval = max(0.05, float(interval))
        self.max_interval = max(self.interval, float(max_interval))
        self.next_check_in = self.interval  # the wait after the last own check (backs off while they pass)
        # told when a request or an own check failed (the appliance: its supervisor checks at once)
        self.on_suspect: Callable[[], None] | None = None
        self.timeout = max(0.05, float(timeout))
        self.log_seconds = max(0.0, float(log_seconds))
        self.sources = sources if sources is not None else {}
        self.up: bool | None = None  # None until the first check
        self.since = time.time()
        self.last_error: str | None = None
        self.failed_checks = 0  # checks failed in a row
        self.request_failures = 0  # exchanges that failed, in total
        self.last_ok_at: float | None = None
        self.last_failure_at: float | None = None
        self._down_at: float | None = None
        self._last_log = -float("inf")
        self._unlogged = 0
        self._wake = asyncio.Event()  # set: look again now (the wait is recomputed; a check if wanted)
        self._check_wanted = False  # wake() / a failed request: the next look checks
        self._vouched_until = -float("inf")  # monotonic: a check passed elsewhere stands for ours until then
        self._next_own = -float("inf")  # monotonic: our own next check is due
        self._dirty = True
        self._written = -float("inf")
        self.running = True

    # ------------------------------------------------------------------ what the gateway reports

    def request_failed(self, code: ErrorCode) -> None:
        """An exchange with the guard failed with ``code`` (called by the forwarder)."""
        if code not in UPSTREAM_FAILURE_CODES:
            return
        self.metrics.upstream_failure(code)
        self.request_failures += 1
        self.last_failure_at = time.time()
        self.last_error = code
        self._dirty = True
        now = time.monotonic()
        if now - self._last_log >= self.log_seconds:
            more = f" ({self._unlogged} more since the last report)" if self._unlogged else ""
            log.warning("a request to the memory guard failed: %s%s", code, more)
            self._last_log, self._unlogged = now, 0
        else:
            self._unlogged += 1
        self.wake()  # check now: is it down, or was that one exchange?
        if self.on_suspect is not None:
            self.on_suspect()

    def passed_elsewhere(self, next_check_in: float | None = None) -> None:
        """Another part of this process checked the same upstream the same way (a new connection
        through the socket file, ``GET /v1/health`` answered 200) and it passed: taken as this
        monitor's own check until that other check's next one is due (``next_check_in`` seconds,
        ``interval`` when not said) plus its time-out and :data:`VOUCH_SLACK_SECONDS`; :meth:`run`
        makes no probe of its own meanwhile. A failed check elsewhere is not taken: call
        :meth:`wake` (this monitor checks itself)."""
        valid = max(self.interval, float(next_check_in)) if next_check_in is not None else self.interval
        self._vouched_until = time.monotonic() + valid + self.timeout + VOUCH_SLACK_SECONDS
        self._ok()
        self._wake.set()  # the wait is recomputed (same loop tick: no wake-up of its own)

    def report_changed(self) -> None:
        """Something the status file reports (a source such as the tunnel's state) changed: the file
        is rewritten at once, without a check of the guard."""
        self._dirty = True
        self._wake.set()

    def wake(self) -> None:
        """Check now, the waits from the first interval again (e.g. the supervisor restarted the guard)."""
        self._dirty = True
        self.next_check_in = self.interval
        self._vouched_until = -float("inf")  # whatever vouched before, this monitor looks for itself
        self._check_wanted = True
        self._wake.set()

    def _set(self, up: bool, why: str | None) -> None:
        if up == self.up:
            return
        before, now = self.up, time.time()
        self.up, self.since, self._dirty = up, now, True
        self.metrics.set_upstream_up(up)
        if up:
            if before is False and self._down_at is not None:
                log.warning(
                    "the memory guard is reachable again (unreachable for %.1f s, %d requests failed meanwhile)",
                    now - self._down_at,
                    self._unlogged,
                )
                self._unlogged = 0
            self._down_at = None
        else:
            self._down_at = now
            log.error(
                "the memory guard at %s:%s is unreachable (%s): requests that need it are answered 503 "
                "until it is back",
                self.upstream.kind,
                self.upstream.target,
                why,
            )
            self._last_log = time.monotonic()

    async def check(self) -> bool:
        """One health check on a new connection (or the probe); updates :attr:`up`."""
        why: str | None = None
        if self.probe is not None:
            why = await self.probe(self.timeout)
        else:
            client = UpstreamClient(self.upstream, timeout_seconds=self.timeout, max_idle=0)
            try:
                resp = await client.request("GET", "/v1/health", {})
                if resp.status != 200:
                    why = f"HTTP {resp.status}"
                resp.release()
            except UompError as exc:
                why = exc.code
            finally:
                await client.close()
        if why is None:
            self._ok()
            self.next_check_in = min(self.next_check_in * 2, self.max_interval)
        else:
            self.failed_checks += 1
            self.last_error = why
            self._dirty = True
            self._set(False, why)
            self.next_check_in = self.interval
            self._vouched_until = -float("inf")  # a failed check of ours outweighs a pass elsewhere
            if self.on_suspect is not None:
                self.on_suspect()
        self._next_own = time.monotonic() + self.next_check_in
        return why is None

    def _ok(self) -> None:
        self.failed_checks = 0
        self.last_ok_at = time.time()
        self._set(True, None)

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Check when a check is wanted, or when our own is due and nothing vouches for the guard;
        report; wait (until the next of those, or woken); until cancelled."""
        while True:
            self._wake.clear()
            now = time.monotonic()
            wanted, self._check_wanted = self._check_wanted, False
            if wanted or (now >= self._next_own and now >= self._vouched_until):
                await self.check()
            await self.write_status(slack=STATUS_REFRESH_SECONDS - STATUS_RIDE_SECONDS)
            if wanted:
                await asyncio.sleep(MIN_PROBE_GAP_SECONDS)  # checks that failing requests ask for, spaced
            now = time.monotonic()
            due = max(self._next_own, self._vouched_until)
            if self.status_file is not None:
                due = min(due, self._written + STATUS_REFRESH_SECONDS)
            if self._wake.is_set():
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, due - now))

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "running": self.running,
            "updated_at": iso(time.time()),
            "upstream": {
                "kind": self.upstream.kind,
                "up": self.up,
                "since": _iso(self.since),
                "last_error": self.last_error,
                "failed_checks": self.failed_checks,
                "request_failures_total": self.request_failures,
                "last_ok_at": _iso(self.last_ok_at),
                "last_failure_at": _iso(self.last_failure_at),
            },
        }
        for name, source in self.sources.items():
            try:
                out[name] = source()
            except Exception as exc:  # a report must never take the gateway down
                out[name] = {"error": type(exc).__name__}
        return out

    async def write_status(self, *, force: bool = False, slack: float = 0.0) -> None:
        """Write the status file (in a worker thread) if something changed or it is getting old
        (due within ``slack`` seconds)."""
        if self.status_file is None:
            return
        now = time.monotonic()
        if not (force or self._dirty or now - self._written >= STATUS_REFRESH_SECONDS - slack):
            return
        self._dirty, self._written = False, now
        data = json.dumps(self.snapshot(), indent=1).encode() + b"\n"
        try:
            await asyncio.to_thread(atomic_write, self.status_file, data, mode=0o600)
        except OSError as exc:
            log.warning("cannot write the status file %s: %s", self.status_file, exc.strerror)
