"""Listening sockets for the gateway, with the limits an HTTP server does not have on its own.

Longer than ~500 lines on purpose: the accept protocol, the per-connection record and the
registry share each connection's budget and timer bookkeeping, so they stay together.

The HTTP server (:mod:`gateway.httpd`, whose :class:`~gateway.httpd.Connection` is
:class:`GuardedConnection` here) bounds header sizes and idle keep-alive time, but asyncio only
hands a TLS connection to it after the handshake, so connections that never finish (or never
start) a handshake are invisible to it. Here every connection is counted and
timed from the moment it is **accepted**, before any TLS byte is read: the TLS listener accepts
plain TCP (:class:`TLSAcceptProtocol`) and, once the client's first bytes are in, hands the raw
transport to the event loop's own TLS protocol, neither subclassed nor wrapped: under uvloop (the
product's loop) that is uvloop's native one, so the handshake and every request's record layer
run outside Python (benchmarks/RUNS.md, "native TLS"):

* **Two budgets per listener.** A connection starts *unverified*. On the mTLS listener it becomes
  *verified* when its handshake completes with a client certificate OpenSSL verified against the
  agent CA that also passes the gateway's validity and CRL check (``check_peer``; one that fails
  it stays unverified, is answered a named 401 and closed: :func:`close_after_answer`); on the
  tunnel-origin listener when one of its requests passed token, DPoP and
  session checks (:func:`authenticated`). Unverified connections have their own small budget
  (``max_unverified``) and a per-source-address budget (``max_unverified_per_ip``); when either is
  full an older unverified connection is evicted (closed at once), never the new one: first those
  that sit still (a finished certificate-less handshake, a silent socket), then, among those
  receiving, the one whose last byte is oldest (:meth:`Conn.eviction_key`). So a flood cannot keep
  an agent from reaching the end of its handshake. Both budgets have a grace: a connection
  accepted within :data:`LIVE_SECONDS` that has sent nothing yet, or a handshake whose whole
  ClientHello arrived within it, is not closed for a newcomer (one client opening many
  connections at once: ``ab -c 200``, a pool warming up, agents behind one NAT address); the
  address and the listener may then hold more than their budgets, never more than
  :data:`GRACE_CEILING` times ``max_unverified`` (past that, eviction has no grace), and once the
  grace of their connections has passed they are cut back to their budgets
  (:meth:`ConnectionRegistry.trim`, :meth:`ConnectionRegistry.trim_all`). Verified connections have their own budget
  (``max_verified``) which unverified ones never touch; a verified connection over it is refused
  (closed) after its handshake.
* **Deadlines from accept.** The TLS handshake (``handshake_timeout``) and the first request byte
  (``first_byte_timeout``) count from accept; the first request's headers must be complete within
  ``header_timeout`` of accept, a keep-alive request's within ``header_timeout`` of its first byte;
  a request body must arrive whole within ``body_timeout`` of the end of its headers and keep an
  average of ``min_body_rate`` bytes/s once ``body_rate_grace`` has passed. An unverified
  connection may idle between requests for ``first_byte_timeout`` only (a verified one for
  the server's keep-alive time). A connection past a deadline is aborted (no TLS close_notify wait).
  One timer per connection: arming a phase's deadline cancels the previous one, and a timer that
  fires in another phase than its own ends nothing, so every keep-alive request has deadlines of
  its own. A connection older than ``max_lifetime`` is closed after the answer in progress
  (:func:`last_answer`), between requests, never during one.
* a request the server cannot parse (or past a size limit) gets the app's §8.4 JSON answer and
  an audit event (``on_rejected``), neither holding any of its bytes;
* plain HTTP sent to the TLS port gets a short plain-text answer saying "use https://" (and is a
  refused handshake for :mod:`gateway.remote.handshake_log`, as OpenSSL's own HTTP_REQUEST error);
* on asyncio's loop, its per-connection TLS read buffer is cut from 256 KiB to
  :data:`TLS_READ_BUFFER_BYTES` (see :func:`shrink_tls_read_buffer`); uvloop's native protocol
  reads into a 256 KiB malloc'd buffer of which only the pages a read touches become resident
  (measured per idle connection by ``benchmarks/bench_handshake.py --baseline``).

:func:`raise_fd_limit` and :func:`fit_limits` make the budgets fit under the process's file
descriptor limit, so the budgets (not EMFILE) decide who is refused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import fcntl
import logging
import math
import resource
import socket
import ssl
import sys
import termios
from asyncio import sslproto
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway import httpd
from gateway.config import GatewayConfig
from gateway.errors import ErrorCode, UompError

log = logging.getLogger("uomp.gateway")

# CPython's asyncio.sslproto.SSLProtocol allocates and zero-fills a read buffer of ``max_size`` bytes
# (256 KiB in 3.11) for every TLS connection: ~266 KiB of RSS per idle mTLS connection, ~270 MiB at
# the default max_connections. TLS records carry at most 16 KiB of plaintext, so 32 KiB costs
# nothing (measured: same new connections/s, 65-71 KiB per idle connection; benchmarks/README.md).
TLS_READ_BUFFER_BYTES = 32 * 1024
# How often a request body's progress is looked at (at most; shorter when the deadlines are).
BODY_CHECK_SECONDS = 1.0
# Which connection phase a deadline timer belongs to (others: the phase of the same name).
_TIMER_PHASE = {"first_byte": "accepted", "body_rate": "body"}
# The listen backlog never exceeds this; asyncio accepts up to a backlog's worth per wake-up.
MAX_BACKLOG = 1024
# Upper bound for the soft file-descriptor limit when the hard limit is "unlimited".
FD_SOFT_CEILING = 1 << 20
# The per-address budget's grace (seconds): a connection accepted this recently with no byte yet,
# or a handshake whose whole ClientHello arrived this recently, is not evicted for a newcomer from
# the same address (ConnectionRegistry.open); the address is cut back to its budget after it.
LIVE_SECONDS = 1.0
# While the unverified connections are fewer than this many times ``max_unverified``, one still in
# its grace is not evicted for a newcomer (ConnectionRegistry.trim_all); past it, the budget evicts
# without grace.
GRACE_CEILING = 2
# A connection whose client certificate was refused after its handshake (revoked, expired...) is
# closed if it sends no request within this many seconds: its holder gets one named 401, no more.
REFUSED_CERT_IDLE_SECONDS = 3.0


def shrink_tls_read_buffer(size: int | None = None) -> bool:
    """Lower ``asyncio.sslproto.SSLProtocol.max_size`` (never raise it); True if it was changed.

    ``max_size`` is a private class attribute, so: only if it exists and is an int. It is process
    wide: every TLS transport asyncio makes in this process (client ones too: the SDK, the chain
    clients) reads and decrypts at most this much per call, which only means more, smaller reads
    for a large body (tests/remote/test_forward.py checks a 900 KiB body over TLS both ways in one process).
    """
    want = TLS_READ_BUFFER_BYTES if size is None else size
    current = getattr(sslproto.SSLProtocol, "max_size", None)
    if not isinstance(current, int) or isinstance(current, bool) or current <= want or want < 16 * 1024 + 256:
        return False
    sslproto.SSLProtocol.max_size = want
    return True


# ------------------------------------------------------------------------------------ limits


@dataclass(frozen=True)
class Limits:
    """One listener's connection budgets (counts) and deadlines (seconds)."""

    max_verified: int
    max_unverified: int
    max_unverified_per_ip: int  # 0: no per-address budget (the tunnel origin: every peer is cloudflared)
    handshake_timeout: float
    shutdown_timeout: float
    first_byte_timeout: float
    header_timeout: float
    body_timeout: float
    min_body_rate: int  # bytes/s
    body_rate_grace: float
    max_lifetime: float = 6 * 3600.0  # seconds from accept; then closed after the answer in progress

    def __post_init__(self) -> None:
        if self.max_verified < 1 or self.max_unverified < 1 or self.max_unverified_per_ip < 0:
            raise UompError(ErrorCode.CONFIG_ERROR, "connection budgets must be positive")
        for name in (
            "handshake_timeout",
            "shutdown_timeout",
            "first_byte_timeout",
            "header_timeout",
            "body_timeout",
            "max_lifetime",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise UompError(ErrorCode.CONFIG_ERROR, f"{name} must be a positive number of seconds")
        if self.min_body_rate < 0 or not (math.isfinite(self.body_rate_grace) and self.body_rate_grace >= 0):
            raise UompError(
                ErrorCode.CONFIG_ERROR, "min_body_bytes_per_second and body_rate_grace_seconds must be >= 0"
            )

    @property
    def total(self) -> int:
        return self.max_verified + self.max_unverified

    @classmethod
    def for_listener(cls, cfg: GatewayConfig, listener: str) -> Limits:
        common: dict[str, Any] = {
            "handshake_timeout": cfg.tls_handshake_timeout_seconds,
            "shutdown_timeout": cfg.tls_shutdown_timeout_seconds,
            "first_byte_timeout": cfg.first_byte_timeout_seconds,
            "header_timeout": cfg.client_timeout_seconds,
            "body_timeout": cfg.body_timeout_seconds,
            "min_body_rate": cfg.min_body_bytes_per_second,
            "body_rate_grace": cfg.body_rate_grace_seconds,
            "max_lifetime": cfg.connection_max_lifetime_seconds,
        }
        if listener == "metrics":  # no authentication at all: one small budget
            return cls(max_verified=1, max_unverified=cfg.metrics_max_connections, max_unverified_per_ip=0, **common)
        if listener == "tunnel":
            return cls(
                max_verified=cfg.tunnel_max_connections,
                max_unverified=cfg.tunnel_max_unverified_connections,
                max_unverified_per_ip=0,
                **common,
            )
        return cls(
            max_verified=cfg.max_connections,
            max_unverified=cfg.max_unverified_connections,
            max_unverified_per_ip=cfg.max_unverified_connections_per_ip,
            **common,
        )


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (never lower it); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_SOFT_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # e.g. above fs.nr_open: keep what we have
            log.warning("could not raise the file descriptor limit from %d to %d: %s", soft, target, exc)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return FD_SOFT_CEILING if soft == resource.RLIM_INFINITY else soft


def backlog_for(fd_limit: int) -> int:
    """The listen backlog for a process allowed ``fd_limit`` descriptors."""
    return max(16, min(MAX_BACKLOG, fd_limit // 16))


def fit_limits(limits: Sequence[Limits], fd_limit: int, reserve: int) -> list[Limits]:
    """The budgets, scaled down (proportionally, each at least 1) so that every budget, a backlog's
    worth of just-accepted sockets per listener and ``reserve`` fit under ``fd_limit``.

    CONFIG_ERROR when not even one connection of each kind fits.
    """
    backlog = backlog_for(fd_limit)
    fixed = reserve + backlog * len(limits)
    wanted = sum(lim.total for lim in limits)
    if fixed + wanted <= fd_limit:
        return list(limits)
    room = fd_limit - fixed
    if room < 2 * len(limits):
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            f"the file descriptor limit ({fd_limit}) leaves no room for connections "
            f"after fd_reserve ({reserve}); raise 'ulimit -n' or lower fd_reserve",
        )
    scale = room / wanted
    out: list[Limits] = []
    for lim in limits:
        unverified = max(1, math.floor(lim.max_unverified * scale))
        per_ip = min(lim.max_unverified_per_ip, unverified)
        out.append(
            dataclasses.replace(
                lim,
                max_verified=max(1, math.floor(lim.max_verified * scale)),
                max_unverified=unverified,
                max_unverified_per_ip=per_ip,
            )
        )
    return out


# ---------------------------------------------------------------------------- accounting


class Conn:
    """One accepted connection's budget membership, phase and deadline timer."""

    __slots__ = (
        "accepted_at",
        "answered",
        "body_bytes",
        "body_started",
        "bytes_in",
        "cert_refused",
        "closed",
        "handler",
        "handshaken",
        "hello",
        "ip",
        "last_progress",
        "loop",
        "payload",
        "pending",
        "phase",
        "queued",
        "raw",
        "raw_bytes",
        "registry",
        "requests",
        "timer",
        "verified",
        "waiting",
    )

    def __init__(self, registry: ConnectionRegistry, handler: GuardedConnection) -> None:
        self.registry = registry
        self.handler = handler
        self.raw: asyncio.BaseTransport | None = None
        self.ip = ""
        self.accepted_at = 0.0
        self.verified = False
        self.closed = False
        self.handshaken = False
        # its client certificate was refused after the handshake (ConnectionRegistry.check_peer) or at a
        # request: it stays unverified, and the answer to its request is its last
        self.cert_refused = False
        self.hello = False  # the TLS protocol was handed a whole ClientHello record
        self.timer: asyncio.TimerHandle | None = None
        self.phase = "accepted"  # accepted, headers, body, handling, idle
        self.bytes_in = 0
        self.body_started = 0.0
        self.body_bytes = 0
        self.payload: Any = None
        self.pending = False  # bytes of a next request arrived while this one was handled
        self.answered = False  # the handler is done while the body still arrives (read and dropped)
        self.requests = 0
        # bytes received: on TLS, the first bytes (a ClientHello) before the loop's TLS protocol takes over,
        # then the decrypted ones (last_progress: the newest of either)
        self.raw_bytes = 0
        self.queued = False  # a whole request head has arrived and waits for its handler
        # what the kernel holds for us before asyncio has read anything (see peek_waiting):
        # 0 unknown/nothing, 2 part of a first message, 3 a whole ClientHello record / request head
        self.waiting = 0
        self.last_progress = 0.0  # loop time of the last bytes received (accept time before any)
        self.loop: asyncio.AbstractEventLoop | None = None

    def eviction_key(self) -> tuple[int, float]:
        """Lowest first: which unverified connection to close when a budget is full.

        Class 0: ready for a request and sending none (a finished handshake without a
        certificate, an idle plain connection); 1: a connection that has sent no byte yet;
        2: receiving (a partial ClientHello, headers or body); 3: a whole first message received
        (a ClientHello whose handshake is under way, a request waiting for or in its handler).
        Within a class, the connection whose last byte is oldest. A client that is getting
        somewhere (an agent's handshake, a request on its way) outlives ones that sit still,
        whatever their age.
        """
        phase = self.phase
        if phase == "handling" or self.queued or self.waiting == 3:
            cls = 3
        elif phase == "accepted" and self.hello and not self.handshaken:
            cls = 3
        elif phase in ("headers", "body"):
            cls = 2
        elif phase == "accepted" and not (self.handler.tls and self.handshaken):
            # TLS handshake under way, or a plain connection's first bytes
            cls = 2 if self.raw_bytes or self.waiting else 1
        else:
            cls = 0
        return cls, self.last_progress

    def grace_left(self) -> float:
        """Seconds of the per-address grace left (0: none): a TLS connection that has sent no byte
        since its accept, or whose whole ClientHello (read, or waiting in the kernel) is in and
        whose handshake is under way, counted from its last byte (:data:`LIVE_SECONDS`)."""
        loop = self.loop
        if loop is None or not self.handler.tls or self.phase != "accepted" or self.handshaken:
            return 0.0
        if not (self.hello or self.waiting == 3 or (self.raw_bytes == 0 and self.waiting == 0)):
            return 0.0
        return max(0.0, self.last_progress + LIVE_SECONDS - loop.time())

    def peek_waiting(self) -> int:
        """Classify what the kernel holds from this peer that asyncio has not read yet.

        Connections accepted in one burst are all silent to us until the loop gets round to
        reading them, but an agent's ClientHello or request is already in the socket buffer. 0:
        nothing; 2: part of a first message; 3: a whole TLS record (the ClientHello) on the TLS
        listener, a whole request head (up to the blank line) on a plain one. FIONREAD, then a
        MSG_PEEK read of at most 16 KiB, nothing consumed."""
        raw = self.raw
        tsock = raw.get_extra_info("socket") if raw is not None else None
        if tsock is None:
            return 0
        try:
            fd = tsock.fileno()
            avail = int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
            if avail <= 0:
                return 0
            peeker = socket.socket(fileno=fd)  # the same descriptor, detached again below (not closed)
            try:
                head = peeker.recv(min(avail, 16 * 1024), socket.MSG_PEEK | socket.MSG_DONTWAIT)
            finally:
                peeker.detach()
        except (OSError, ValueError):
            return 0
        if self.handler.tls:
            whole = len(head) >= 5 and head[0] == 0x16 and len(head) >= 5 + int.from_bytes(head[3:5], "big")
        else:
            whole = b"\r\n\r\n" in head
        return 3 if whole else 2

    def progress(self, n: int) -> None:
        self.raw_bytes += n
        self.waiting = 0
        if self.loop is not None:
            self.last_progress = self.loop.time()

    # -- timer

    def _arm(self, when: float, phase: str) -> None:
        self._cancel()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_at(when, self._expired, phase)

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self, phase: str) -> None:
        self.timer = None
        # Only the deadline of the phase the connection is in ends it (one timer at a time; a timer
        # of an earlier phase or request is cancelled when the next is armed, this is the backstop).
        if not self.closed and self.phase == _TIMER_PHASE.get(phase, phase):
            self.registry.deadline(self, phase)

    def abort(self) -> None:
        self._cancel()
        if self.raw is not None:
            self.raw.abort()  # type: ignore[attr-defined]  # at once, even if a graceful close had begun

    # -- events

    def opened(self, raw: asyncio.BaseTransport) -> None:
        self.raw = raw
        self.loop = asyncio.get_running_loop()
        self.accepted_at = self.last_progress = self.loop.time()
        peer = raw.get_extra_info("peername")
        self.ip = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self._arm(self.accepted_at + self.registry.limits.first_byte_timeout, "first_byte")
        self.registry.open(self)

    def refused_certificate(self) -> None:
        """The client certificate was refused after the handshake: the connection stays unverified
        (its address's budget, evicted first when sitting still) and is closed if it sends no
        request within :data:`REFUSED_CERT_IDLE_SECONDS` (or the first-byte deadline, if sooner)."""
        self.cert_refused = True
        loop = self.loop
        if self.phase == "accepted" and loop is not None and not self.closed:
            lim = self.registry.limits
            when = min(loop.time() + REFUSED_CERT_IDLE_SECONDS, self.accepted_at + lim.first_byte_timeout)
            self._arm(when, "first_byte")

    def lost(self, exc: BaseException | None) -> None:
        self._cancel()
        if self.closed:
            return
        self.closed = True
        self.registry.release(self, exc)

    def data(self, n: int) -> None:
        self.bytes_in += n
        self.progress(n)  # (on TLS: decrypted bytes; the loop's TLS protocol reads the records)
        if self.phase in ("accepted", "idle"):
            lim = self.registry.limits
            now = asyncio.get_running_loop().time()
            # The first request's headers count from accept; a keep-alive request's from its first byte.
            start = self.accepted_at if self.requests == 0 else now
            self.phase = "headers"
            self._arm(start + lim.header_timeout, "headers")
        elif self.phase == "handling":
            self.pending = True

    def request_started(self, payload: Any) -> None:
        self.requests += 1
        self.queued = False
        self.phase = "body"
        self.payload = payload
        self.pending = False
        self.answered = False
        self.body_started = asyncio.get_running_loop().time()
        self.body_bytes = self.bytes_in
        self._check_body()

    def _body_done(self) -> bool:
        p = self.payload
        return p is None or bool(p.ended)

    def _check_body(self) -> None:
        # Called at the request's start and then by its own timer: either way the connection's one
        # timer is replaced (the header deadline of this request ends here).
        self._cancel()
        if self.closed or self.phase != "body":
            return
        if self._body_done():
            self.payload = None
            self.phase = "handling"
            if self.answered:  # the body of an answered request has been drained: between requests now
                self.request_finished()
            return
        lim = self.registry.limits
        now = asyncio.get_running_loop().time()
        elapsed = now - self.body_started
        if elapsed >= lim.body_timeout:
            self.registry.deadline(self, "body")
            return
        if elapsed > lim.body_rate_grace and lim.min_body_rate > 0:
            got = self.bytes_in - self.body_bytes
            if got < lim.min_body_rate * (elapsed - lim.body_rate_grace):
                self.registry.deadline(self, "body_rate")
                return
        step = min(BODY_CHECK_SECONDS, lim.body_timeout / 4, max(lim.body_rate_grace, 0.05))
        self.timer = asyncio.get_running_loop().call_at(
            min(now + step, self.body_started + lim.body_timeout), self._check_body
        )

    def past_lifetime(self) -> bool:
        """The connection has lived longer than ``max_lifetime``: the answer being sent is its last
        (``Connection: close``), so it ends between requests, never during one."""
        loop = self.loop
        return loop is not None and loop.time() - self.accepted_at >= self.registry.limits.max_lifetime

    def request_finished(self) -> None:
        if self.phase == "body":
            if not self._body_done():
                self.answered = True
                return  # the server may still read (linger on) the body: the body deadline keeps running
            self.payload = None
        self._cancel()
        if self.pending:
            self.pending = False
            self.phase = "headers"
            self._arm(asyncio.get_running_loop().time() + self.registry.limits.header_timeout, "headers")
            return
        self.phase = "idle"
        if not self.verified:
            self._arm(asyncio.get_running_loop().time() + self.registry.limits.first_byte_timeout, "idle")


class ConnectionRegistry:
    """The connections of one listener: two budgets, eviction, deadlines, counters."""

    def __init__(self, limits: Limits, *, name: str = "mtls") -> None:
        self.limits = limits
        self.name = name
        self.verified: set[Conn] = set()
        # insertion order is accept order: the first key is the oldest connection
        self.unverified: dict[Conn, None] = {}
        self.per_ip: dict[str, dict[Conn, None]] = {}
        self.accepted = 0
        self.refused = 0  # verified connections over max_verified, closed after the handshake
        self.evicted = 0  # unverified connections closed to make room for a newer one
        # addresses over their budget while some of their connections are in their grace: the
        # timer that cuts them back when it ends (ConnectionRegistry.trim)
        self.trims: dict[str, asyncio.TimerHandle] = {}
        self._trim_all: asyncio.TimerHandle | None = None  # the listener cut back when a grace ends
        self.closed_by_deadline: collections.Counter[str] = collections.Counter()
        self.closed_before_handshake: collections.Counter[str] = collections.Counter()
        # called (exception, client address) for each handshake OpenSSL refused (remote/handshake_log.py)
        self.on_handshake_failed: Callable[[BaseException, str], None] | None = None
        # called (ssl object) when a TLS handshake with a client certificate completed: the
        # certificate's refusal (revoked, expired... : remote/identity.py), told to on_handshake_failed
        # like OpenSSL's, or None; a refused connection stays unverified (REFUSED_CERT_IDLE_SECONDS)
        self.check_peer: Callable[[Any], BaseException | None] | None = None
        # called (status, code, message) when the HTTP server itself rejects a request before routing
        self.on_rejected: Callable[[int, ErrorCode, str], None] | None = None
        # told about connections opening and closing (the metrics' open_connections gauge)
        self.on_open: Callable[[], None] | None = None
        self.on_close: Callable[[], None] | None = None

    @property
    def slow_closed(self) -> int:
        """Connections closed by a deadline, the TLS handshake's included."""
        return sum(self.closed_by_deadline.values()) + self.closed_before_handshake["timeout"]

    @property
    def active(self) -> int:
        return len(self.verified) + len(self.unverified)

    def stats(self) -> dict[str, Any]:
        return {
            "listener": self.name,
            "verified": len(self.verified),
            "unverified": len(self.unverified),
            "accepted": self.accepted,
            "refused": self.refused,
            "evicted": self.evicted,
            "closed_by_deadline": dict(self.closed_by_deadline),
            "closed_before_handshake": dict(self.closed_before_handshake),
        }

    def open(self, conn: Conn) -> None:
        self.accepted += 1
        self.unverified[conn] = None
        bucket = self.per_ip.setdefault(conn.ip, {})
        bucket[conn] = None
        if self.on_open is not None:
            self.on_open()
        lim = self.limits
        if lim.max_unverified_per_ip and len(bucket) > lim.max_unverified_per_ip:
            self.trim(conn.ip, newcomer=conn)
        self.trim_all(newcomer=conn)

    def trim_all(self, newcomer: Conn | None = None) -> None:
        """Cut the unverified connections back to ``max_unverified``: from the address holding the
        most (a flood from one address does not push out another address's clients), the one getting
        least far first, none still in its grace (:meth:`Conn.grace_left`) while the listener holds
        fewer than ``GRACE_CEILING`` times the budget; ``newcomer`` only when no other is left. A burst of fresh
        handshakes (a pool opening 200 connections at once) is thus served whole, and cut back
        when its grace ends, as :meth:`trim` does for one address."""
        lim = self.limits
        while len(self.unverified) > lim.max_unverified:
            largest = max(self.per_ip.values(), key=len)
            pool = largest if len(largest) > 1 else self.unverified
            if len(self.unverified) <= lim.max_unverified * GRACE_CEILING:
                pool = {c: None for c in pool if c.grace_left() <= 0}
                if not pool:
                    pool = {c: None for c in self.unverified if c.grace_left() <= 0}
                if not pool:  # all in their grace: cut back when the first grace ends
                    left = min((c.grace_left() for c in self.unverified if c is not newcomer), default=0.0)
                    if left > 0 and self._trim_all is None:
                        self._trim_all = asyncio.get_running_loop().call_later(left + 0.01, self._trim_all_later)
                    return
            victim = self._victim(pool, newcomer)
            assert victim is not None  # (the pool holds at least the newcomer)
            self._evict(victim)

    def _trim_all_later(self) -> None:
        self._trim_all = None
        self.trim_all()

    def trim(self, ip: str, newcomer: Conn | None = None) -> None:
        """Cut ``ip``'s unverified connections back to its budget, closing the ones getting least
        far first (:meth:`_victim`) but none still in its grace (:meth:`Conn.grace_left`) and never
        ``newcomer``: while only such are left, the address keeps more (bounded by
        ``max_unverified``) and this runs again when the first grace ends."""
        budget = self.limits.max_unverified_per_ip
        while True:
            bucket = self.per_ip.get(ip)
            if bucket is None or len(bucket) <= budget:
                return
            others = [c for c in bucket if c is not newcomer]
            pool = {c: None for c in others if c.grace_left() <= 0}
            if pool:
                victim = self._victim(pool, None)
                if victim is not None and victim.grace_left() <= 0:
                    self._evict(victim)
                    continue
                continue  # a peek found its first bytes waiting: in its grace now, choose again
            left = min((c.grace_left() for c in others), default=0.0)
            if left > 0 and ip not in self.trims:
                self.trims[ip] = asyncio.get_running_loop().call_later(left + 0.01, self._trim_later, ip)
            return

    def _trim_later(self, ip: str) -> None:
        self.trims.pop(ip, None)
        self.trim(ip)

    @staticmethod
    def _victim(pool: dict[Conn, None], newcomer: Conn | None) -> Conn | None:
        """The unverified connection to close (lowest :meth:`Conn.eviction_key`); never the one
        just accepted, which has had no chance to show progress yet. A silent candidate whose
        bytes are already waiting in the kernel counts as receiving, or as a whole request when
        they are one (:meth:`Conn.peek_waiting`). O(budget); budgets are small, and a connection is
        peeked at most once while its bytes wait."""
        while True:
            best: Conn | None = None
            best_key: tuple[int, float] | None = None
            for c in pool:
                if c is newcomer:
                    continue
                key = c.eviction_key()
                if best_key is None or key < best_key:
                    best, best_key = c, key
            if best is None:
                return newcomer
            if best_key is not None and best_key[0] == 1:
                waiting = best.peek_waiting()
                if waiting:  # its bytes are here: no longer silent
                    best.waiting = waiting
                    if best.loop is not None:
                        best.last_progress = best.loop.time()
                    continue
            return best

    def _forget_unverified(self, conn: Conn) -> bool:
        if conn not in self.unverified:
            return False
        del self.unverified[conn]
        bucket = self.per_ip.get(conn.ip)
        if bucket is not None:
            bucket.pop(conn, None)
            if not bucket:
                del self.per_ip[conn.ip]
        return True

    def _drop(self, conn: Conn) -> bool:
        was = self._forget_unverified(conn)
        if conn in self.verified:
            self.verified.discard(conn)
            was = True
        if was and self.on_close is not None:
            self.on_close()
        return was

    def _evict(self, conn: Conn) -> None:
        self.evicted += 1
        self._close(conn)

    def _close(self, conn: Conn) -> None:
        self._drop(conn)
        conn.closed = True
        conn.abort()

    def promote(self, conn: Conn) -> bool:
        """Move ``conn`` to the verified budget; False (it stays unverified) when that is full."""
        if conn.verified:
            return True
        if conn.closed or len(self.verified) >= self.limits.max_verified:
            return False
        self._forget_unverified(conn)
        self.verified.add(conn)
        conn.verified = True
        return True

    def refuse(self, conn: Conn) -> None:
        self.refused += 1
        self._close(conn)

    def deadline(self, conn: Conn, phase: str) -> None:
        self.closed_by_deadline[phase] += 1
        self._close(conn)

    def release(self, conn: Conn, exc: BaseException | None) -> None:
        if not conn.handshaken and conn.handler.tls:
            if isinstance(exc, ConnectionAbortedError):
                reason = "timeout"
            elif isinstance(exc, ssl.SSLError):
                reason = "failed"
                if self.on_handshake_failed is not None:
                    self.on_handshake_failed(exc, conn.ip)
            else:
                reason = "dropped"
            self.closed_before_handshake[reason] += 1
        self._drop(conn)

    def close_unverified_handshakes(self) -> None:
        """Close the connections still in their TLS handshake (no HTTP server knows of them yet)."""
        for conn in [*self.unverified, *self.verified]:
            if conn.handler.tls and not conn.handshaken:
                self._close(conn)

    def close_all(self) -> None:
        for timer in self.trims.values():
            timer.cancel()
        self.trims.clear()
        if self._trim_all is not None:
            self._trim_all.cancel()
            self._trim_all = None
        for conn in [*self.unverified, *self.verified]:
            self._close(conn)


# ------------------------------------------------------------------------------ protocols


class GuardedConnection(httpd.Connection):
    """An HTTP connection of :mod:`gateway.httpd` plus the budgets and deadlines of
    :class:`ConnectionRegistry` (``record``). ``tls``: a connection of the TLS listener (its HTTP
    starts once the handshake is done)."""

    def __init__(self, server: httpd.Server, registry: ConnectionRegistry, *, tls: bool) -> None:
        super().__init__(server)
        self.record = Conn(registry, self)
        self.tls = tls
        self._admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        conn = self.record
        if not self.tls:
            conn.opened(transport)
        else:
            # The handshake is done; a certificate here chains to the agent CA with the clientAuth
            # purpose (OpenSSL's verification) or the handshake would have failed. Its validity period
            # and the CRL are judged now (check_peer): only a certificate that passes is verified.
            conn.handshaken = True
            ssl_obj = transport.get_extra_info("ssl_object")
            der = ssl_obj.getpeercert(binary_form=True) if ssl_obj is not None else None
            if der:
                registry = conn.registry
                refusal = registry.check_peer(ssl_obj) if registry.check_peer is not None else None
                if refusal is not None:
                    conn.refused_certificate()
                    if registry.on_handshake_failed is not None:
                        registry.on_handshake_failed(refusal, conn.ip)
                elif not registry.promote(conn):
                    registry.refuse(conn)
        if conn.closed:
            self.closing = True
            return
        self._admitted = True
        with contextlib.suppress(OSError):  # dead peers are found by the kernel's keep-alive probes
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.record.lost(exc)  # (a TLS connection lost before its handshake ended: TLSAcceptProtocol)
        if self._admitted:
            self._admitted = False
            super().connection_lost(exc)

    def data_received(self, data: bytes | memoryview) -> None:
        conn = self.record
        conn.data(len(data))
        last = self.queue[-1] if self.queue else None
        super().data_received(data)
        if self.queue and self.queue[-1] is not last and not conn.verified:
            conn.queued = True  # a whole request head was parsed: it waits for its handler

    def refused(self, status: int) -> httpd.Response:
        # Bytes that could not be parsed, or past a limit: the app's answer (no request byte in it or
        # in the log) and an audit event that carries none either.
        registry = self.record.registry
        if registry.on_rejected is not None:
            err = parse_refusal(status)
            registry.on_rejected(status, err.code, err.message)
        return super().refused(status)


def parse_refusal(status: int) -> UompError:
    """The §8.4 error of a request the HTTP server refused with ``status`` before any handler."""
    if status < 500:
        return UompError(ErrorCode.INVALID_REQUEST, "malformed or oversized request")
    return UompError(ErrorCode.INTERNAL, "internal error")


USE_HTTPS = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: 73\r\n\r\nThis port speaks HTTPS (TLS 1.3 with a client certificate): use https://\n"
)
# The first bytes OpenSSL takes for plain HTTP (its HTTP_REQUEST / HTTPS_PROXY_REQUEST errors).
_PLAIN_HTTP = (b"GET ", b"POST ", b"HEAD ", b"PUT ", b"CONNE")


def _plain_http_error() -> ssl.SSLError:
    """The refusal :class:`HandshakeLog` is told of for plain HTTP on the TLS port (as OpenSSL says it)."""
    exc = ssl.SSLError(1, "[SSL: HTTP_REQUEST] http request")
    exc.reason = "HTTP_REQUEST"
    exc.library = "SSL"
    return exc


def _tls_protocol_class(loop: asyncio.AbstractEventLoop) -> Any:
    """The running loop's own TLS protocol: uvloop's native (Cython) one on uvloop, asyncio's otherwise."""
    mod = type(loop).__module__
    if mod.startswith("uvloop"):
        with contextlib.suppress(ImportError, AttributeError):
            import uvloop.loop

            return uvloop.loop.SSLProtocol  # type: ignore[attr-defined]  # (loop.pyi does not list it)
    return sslproto.SSLProtocol


class TLSAcceptProtocol(asyncio.Protocol):
    """The TLS listener's protocol from accept until the first bytes: counted at accept, deadlines armed.

    The client's first bytes decide: plain HTTP gets :data:`USE_HTTPS` and the close; anything else
    goes to the loop's own TLS protocol (uvloop's native one under uvloop; it is neither subclassed
    nor wrapped, so the handshake and every record of every request run outside Python), which is
    handed the raw transport and the bytes read so far; :class:`GuardedConnection` gets the TLS
    transport once the handshake is done. The handshake's outcome comes back through its waiter
    future (:meth:`_handshake_done`): a refusal (SSLError), the handshake deadline
    (ConnectionAbortedError) or a drop, for the registry's counters and the refusal log. The
    handshake deadline still counts from accept (what is left of it is the TLS protocol's timeout).
    """

    __slots__ = ("_head", "_plain_http", "_tls_class", "conn", "context", "handler", "loop")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, handler: GuardedConnection, context: ssl.SSLContext, tls_class: Any
    ) -> None:
        self.loop = loop
        self.handler = handler
        self.conn = handler.record
        self.context = context
        self._tls_class = tls_class
        self._head = b""
        self._plain_http: ssl.SSLError | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn.opened(transport)
        if self.conn.closed:  # pragma: no cover - only with a per-address budget of 0
            transport.close()

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        conn.progress(len(data))
        if conn.closed or self._plain_http is not None:
            return
        head = self._head + data if self._head else data
        if head[0] != 0x16 and len(head) < 5:
            self._head = head  # OpenSSL too waits for a record header's 5 bytes
            return
        raw = conn.raw
        assert raw is not None
        if head.startswith(_PLAIN_HTTP):
            # Plain HTTP sent to the TLS port: a short plain-text answer saying so, then the close.
            self._plain_http = _plain_http_error()
            with contextlib.suppress(Exception):
                raw.write(USE_HTTPS)  # type: ignore[attr-defined]
            raw.close()
            return
        self._head = b""
        conn.hello = len(head) >= 5 and len(head) >= 5 + int.from_bytes(head[3:5], "big")
        self._start_tls(raw, head)

    def _start_tls(self, raw: asyncio.BaseTransport, head: bytes) -> None:
        conn = self.conn
        limits = conn.registry.limits
        left = limits.handshake_timeout - (self.loop.time() - conn.accepted_at)
        waiter = self.loop.create_future()
        waiter.add_done_callback(self._handshake_done)
        tls = self._tls_class(
            self.loop,
            self.handler,
            self.context,
            waiter,
            server_side=True,
            ssl_handshake_timeout=max(left, 0.001),
            ssl_shutdown_timeout=limits.shutdown_timeout,
        )
        # as loop.start_tls does: no read while the protocols change (uvloop picks its read path then)
        raw.pause_reading()  # type: ignore[attr-defined]
        raw.set_protocol(tls)
        tls.connection_made(raw)
        get_buffer, buffer_updated = tls.get_buffer, tls.buffer_updated
        view = memoryview(head)
        while view and not conn.closed and raw.get_protocol() is tls:
            buf = get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            buffer_updated(n)
            view = view[n:]
        if not raw.is_closing():
            raw.resume_reading()  # type: ignore[attr-defined]

    def _handshake_done(self, waiter: asyncio.Future[None]) -> None:
        conn = self.conn
        exc = None if waiter.cancelled() else waiter.exception()
        if conn.handshaken and exc is None:
            return  # GuardedConnection has the connection (and is told when it is lost)
        # refused, past its deadline, or dropped during the handshake
        conn.lost(exc)

    def eof_received(self) -> bool | None:
        return None  # before any TLS byte: close (connection_lost follows)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.conn.lost(self._plain_http or exc)


def _record(request: httpd.Request) -> Conn | None:
    conn = request.conn
    return conn.record if isinstance(conn, GuardedConnection) else None


def request_started(request: httpd.Request) -> None:
    """Arms the connection's body deadline for the request now being read."""
    if (conn := _record(request)) is not None:
        conn.request_started(request.content)


def request_finished(request: httpd.Request) -> None:
    """Ends the request's deadlines; the idle timer runs again until the next one."""
    if (conn := _record(request)) is not None:
        conn.request_finished()


def last_answer(request: httpd.Request, resp: httpd.AnyResponse) -> None:
    """Close the connection after ``resp`` when it is past its lifetime (:meth:`Conn.past_lifetime`)
    or its client certificate was refused (:func:`close_after_answer`)."""
    if (conn := _record(request)) is not None and (conn.cert_refused or conn.past_lifetime()):
        resp.force_close()


def close_after_answer(request: httpd.Request) -> None:
    """The request's client certificate was refused: the answer now being made is the connection's last."""
    if (conn := _record(request)) is not None:
        conn.cert_refused = True


async def phase_middleware(request: httpd.Request, handler: httpd.Handler) -> httpd.AnyResponse:
    """For apps other than the gateway's (whose entry point calls these itself): tell the
    connection when a request's headers are in and when it has been handled."""
    request_started(request)
    try:
        resp = await handler(request)
        last_answer(request, resp)
        return resp
    finally:
        request_finished(request)


def authenticated(request: httpd.Request) -> None:
    """The request's connection carried an authenticated request: it leaves the unverified budget
    (if the verified one has room). For the tunnel-origin listener; a no-op where already verified."""
    if (conn := _record(request)) is not None:
        conn.registry.promote(conn)


async def listen(
    server: httpd.Server,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None,
    registry: ConnectionRegistry,
    backlog: int = MAX_BACKLOG,
    reuse_port: bool = False,
) -> asyncio.Server:
    """Serve ``server``'s app on host:port with the guarded protocols (the listener is added to
    ``server.listeners``, so its ``close`` stops it). ``reuse_port``: SO_REUSEPORT, so that several
    gateway processes can share the port (the kernel spreads accepts)."""
    loop = asyncio.get_running_loop()

    if ssl_context is None:

        def factory() -> asyncio.BaseProtocol:
            return GuardedConnection(server, registry, tls=False)
    else:
        shrink_tls_read_buffer()  # asyncio's TLS protocol (no uvloop); uvloop's reads in place
        ctx = ssl_context
        tls_class = _tls_protocol_class(loop)

        def factory() -> asyncio.BaseProtocol:
            return TLSAcceptProtocol(loop, GuardedConnection(server, registry, tls=True), ctx, tls_class)

    # TLS starts in the protocol, so the loop sees a plain server and calls connection_made at accept.
    srv = await loop.create_server(
        factory,
        host,
        port,
        backlog=backlog,
        reuse_address=True,
        reuse_port=reuse_port or None,
        family=socket.AF_INET6 if ":" in host else socket.AF_INET,
    )
    server.listeners.append(srv)
    return srv
