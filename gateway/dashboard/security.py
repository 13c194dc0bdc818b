"""The dashboard's gate: one-time login links, server-side sessions, CSRF, Host and peer checks.

Threat model (docs/dashboard.md): the dashboard listens on loopback only, so the attackers are
web pages in the user's own browser (cross-site requests, DNS rebinding, framing) and other local
users or processes that see URLs (shell history, process lists, ``Referer``). Hence:

- The login link carries a random one-time token, stored only as its SHA-256, valid for
  ``login_ttl_seconds`` and spent on first use. The admin credential never appears in a URL.
- Using it sets a random session cookie (HttpOnly, SameSite=Strict, Path=/), kept server-side
  (hashed) with an idle and an absolute timeout, and redirects (303) to ``/`` so the token leaves
  the address bar.
- Every POST carries the session's synchronizer token (compared with ``hmac.compare_digest``) and
  is refused when ``Origin`` or ``Sec-Fetch-Site`` say the request comes from another site.
- The ``Host`` header must name this listener (127.0.0.1:PORT, localhost:PORT, [::1]:PORT):
  a rebound DNS name is refused (421) before anything else.
- A peer that is not a loopback address is refused (403), whatever the bind address.

``uomp dashboard`` run while the appliance serves the dashboard hands a fresh link to it through
``$UOMP_HOME/gateway/dashboard-links`` (0600, hashes and expiry only, under ``flock``); the
server consumes an entry on first use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config import Paths
from gateway.fsutil import atomic_write

COOKIE_NAME = "uomp_dashboard"
CSRF_FIELD = "csrf"
MAX_SESSIONS = 64  # dashboard sessions kept at once (oldest dropped beyond)
MAX_PENDING_LINKS = 32


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def links_path(paths: Paths) -> Path:
    return paths.dashboard_links


@contextlib.contextmanager
def _links_locked(paths: Paths) -> Iterator[Path]:
    paths.gateway_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = os.open(paths.dashboard_links_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield links_path(paths)
    finally:
        os.close(lock)


def _read_links(path: Path, now: float) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines()[:MAX_PENDING_LINKS]:
        parts = line.split()
        if len(parts) == 2 and len(parts[0]) == 64:
            try:
                expires = float(parts[1])
            except ValueError:
                continue
            if expires > now:
                out[parts[0]] = expires
    return out


def _write_links(path: Path, links: dict[str, float]) -> None:
    atomic_write(path, "".join(f"{h} {e:.3f}\n" for h, e in links.items()).encode(), mode=0o600)


def hand_over_link(paths: Paths, ttl: float, *, now: float | None = None) -> str:
    """A one-time token for a dashboard running in another process (the appliance); only its hash
    and expiry are written. Returns the token for the link."""
    now = time.time() if now is None else now
    token = secrets.token_urlsafe(32)
    with _links_locked(paths) as path:
        links = _read_links(path, now)
        links[_hash(token)] = now + ttl
        while len(links) > MAX_PENDING_LINKS:
            links.pop(next(iter(links)))
        _write_links(path, links)
    return token


class LoginLinks:
    """One-time login tokens minted in this process, plus those handed over through the file."""

    def __init__(self, ttl: float, *, paths: Paths | None = None, clock: Callable[[], float] = time.time) -> None:
        self.ttl = ttl
        self.paths = paths
        self.clock = clock
        self._pending: dict[str, float] = {}

    def mint(self) -> str:
        now = self.clock()
        self._pending = {h: e for h, e in self._pending.items() if e > now}
        while len(self._pending) >= MAX_PENDING_LINKS:
            self._pending.pop(next(iter(self._pending)))
        token = secrets.token_urlsafe(32)
        self._pending[_hash(token)] = now + self.ttl
        return token

    def redeem(self, token: str) -> bool:
        """True once for a good, unexpired token; the token is spent either way it was found."""
        if not token or len(token) > 200:
            return False
        h = _hash(token)
        now = self.clock()
        expires = self._pending.pop(h, None)
        if expires is not None:
            return expires > now
        if self.paths is None:
            return False
        with _links_locked(self.paths) as path:
            links = _read_links(path, now)
            if h not in links:
                return False
            del links[h]
            _write_links(path, links)
        return True


@dataclass
class DashSession:
    csrf: str
    created: float
    last_seen: float
    flash: list[str] = field(default_factory=list)


class Sessions:
    """Server-side dashboard sessions, keyed by the SHA-256 of the cookie value."""

    def __init__(self, *, idle: float, max_age: float, clock: Callable[[], float] = time.time) -> None:
        self.idle = idle
        self.max_age = max_age
        self.clock = clock
        self._by_hash: dict[str, DashSession] = {}

    def create(self) -> tuple[str, DashSession]:
        now = self.clock()
        self._sweep(now)
        while len(self._by_hash) >= MAX_SESSIONS:
            self._by_hash.pop(next(iter(self._by_hash)))
        cookie = secrets.token_urlsafe(32)
        s = DashSession(csrf=secrets.token_urlsafe(32), created=now, last_seen=now)
        self._by_hash[_hash(cookie)] = s
        return cookie, s

    def get(self, cookie: str | None) -> DashSession | None:
        if not cookie or len(cookie) > 200:
            return None
        h = _hash(cookie)
        s = self._by_hash.get(h)
        if s is None:
            return None
        now = self.clock()
        if now - s.last_seen > self.idle or now - s.created > self.max_age:
            del self._by_hash[h]
            return None
        s.last_seen = now
        return s

    def end(self, cookie: str | None) -> None:
        if cookie:
            self._by_hash.pop(_hash(cookie), None)

    def _sweep(self, now: float) -> None:
        for h, s in list(self._by_hash.items()):
            if now - s.last_seen > self.idle or now - s.created > self.max_age:
                del self._by_hash[h]


def peer_is_loopback(peer: object) -> bool:
    """True for a TCP peer address on loopback (127.0.0.0/8, ::1, v4-mapped loopback)."""
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return False
    try:
        ip = ipaddress.ip_address(peer[0].split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def allowed_hosts(port: int) -> frozenset[str]:
    return frozenset({f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"})


def host_ok(host: str | None, port: int) -> bool:
    return host is not None and host.lower() in allowed_hosts(port)


def origin_ok(origin: str | None, sec_fetch_site: str | None, port: int) -> bool:
    """A POST from our own pages. A browser that sends ``Sec-Fetch-Site`` (a header no page can
    set) must say ``same-origin``; it then sends ``Origin: null`` under our ``Referrer-Policy:
    no-referrer``, which is fine. Without ``Sec-Fetch-Site``, an ``Origin`` (when sent) must be
    this listener; ``null`` (an opaque origin: a sandboxed frame, a data: page) is refused."""
    ours = {f"http://{h}" for h in allowed_hosts(port)}
    if sec_fetch_site is not None:
        return sec_fetch_site.lower() == "same-origin" and (origin is None or origin.lower() in ours | {"null"})
    return origin is None or origin.lower() in ours


def csrf_ok(session: DashSession, presented: str | None) -> bool:
    if not presented:
        return False
    return hmac.compare_digest(session.csrf.encode(), presented.encode())
