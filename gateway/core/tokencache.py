"""A bounded map of things that expire: verified tokens by digest, token hashes known clean.

Rules (the gateway's and the Auth Service's caches of verified tokens, the guard's set of token
hashes seen absent from the blacklist):

* An entry is kept only while it is alive: :meth:`get` never returns one past its expiry, and
  expired entries are swept out at least every ``sweep_seconds`` (on a write) and whenever the map
  is full. So the size follows the tokens alive now, not every token ever seen: a busy appliance
  whose agents refresh all day holds no more than one that just started.
* At most ``max_entries``: when every entry is alive and the map is full, the oldest written goes
  first (one per write), never the whole map at once.

Pure: the caller passes ``now``. Not thread-safe: each cache lives on one thread (the event loop,
or the auth.db worker).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from gateway.core.capability import Capability

V = TypeVar("V")

DEFAULT_SWEEP_SECONDS = 30.0


class ExpiringMap(Generic[V]):
    """``key -> (value, expires_at)``, bounded by ``max_entries`` and by the entries still alive."""

    __slots__ = ("_d", "_next_sweep", "max_entries", "sweep_seconds")

    def __init__(self, max_entries: int, *, sweep_seconds: float = DEFAULT_SWEEP_SECONDS) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self.sweep_seconds = sweep_seconds
        self._d: dict[str, tuple[V, float]] = {}
        self._next_sweep = float("-inf")

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def get(self, key: str, now: float) -> V | None:
        hit = self._d.get(key)
        if hit is None:
            return None
        if hit[1] <= now:
            del self._d[key]
            return None
        return hit[0]

    def put(self, key: str, value: V, expires_at: float, now: float) -> None:
        """Keep ``value`` until ``expires_at`` (not at all if that has passed)."""
        d = self._d
        d.pop(key, None)  # re-written: now the newest
        if expires_at <= now:
            return
        if now >= self._next_sweep or len(d) >= self.max_entries:
            self.sweep(now)
        while len(d) >= self.max_entries:
            del d[next(iter(d))]  # all alive: the oldest written goes
        d[key] = (value, expires_at)

    def sweep(self, now: float) -> int:
        """Drop every expired entry; how many went."""
        d = self._d
        dead = [k for k, (_, exp) in d.items() if exp <= now]
        for k in dead:
            del d[k]
        self._next_sweep = now + self.sweep_seconds
        return len(dead)

    def discard(self, key: str) -> None:
        self._d.pop(key, None)

    def clear(self) -> None:
        self._d.clear()


def remember_verified(cache: ExpiringMap[Capability], key: str, cap: Capability, now: float) -> None:
    """Keep a verified access token until it expires (its ``exp`` or ``expires_at``, the sooner).
    Refresh tokens are not kept: each is spent by its one use, so a kept one is only memory."""
    if cap.token_use != "access":
        return
    cache.put(key, cap, token_until(cap), now)


def token_until(cap: Capability) -> float:
    """When a verified token stops being accepted: its ``exp`` or ``expires_at``, the sooner."""
    exp = cap.claims.get("exp", 0)
    return min(float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else 0.0, cap.expires_at)
