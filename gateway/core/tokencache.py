"""A bounded map of things that expire: verified tokens by digest, token hashes known clean.

Rules (the gateway's and the Auth Service's caches of verified tokens, the guard's sets of token
hashes used and seen absent from the blacklist):

* An entry is kept only while it is alive: :meth:`get` never returns one past its expiry, and
  expired entries are swept out at least every ``sweep_seconds`` (on a write) and whenever the map
  is full. So the size follows the tokens alive now, not every token ever seen: a busy appliance
  whose agents refresh all day holds no more than one that just started.
* At most ``per_group`` entries per group (the token's session): a refresh leaves the superseded
  access token valid until its expiry, but the agent uses the new one, so the session's older
  entries go first. The size then follows the sessions in use, not the refresh rate times the
  token lifetime. An entry that went is only work to redo (verify, look up) when its token comes
  back, never a different answer: each cache remembers a check, and the check is the authority.
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
# Tokens of one session kept per cache: the newest and the one it superseded (requests sent with the
# old token while the refresh was under way).
PER_SESSION = 2


class ExpiringMap(Generic[V]):
    """``key -> (value, expires_at)``, bounded by ``max_entries``, by the entries still alive and by
    ``per_group`` entries per group."""

    __slots__ = ("_d", "_groups", "_next_sweep", "max_entries", "per_group", "sweep_seconds")

    def __init__(
        self, max_entries: int, *, sweep_seconds: float = DEFAULT_SWEEP_SECONDS, per_group: int = PER_SESSION
    ) -> None:
        if max_entries < 1 or per_group < 1:
            raise ValueError("max_entries and per_group must be >= 1")
        self.max_entries = max_entries
        self.per_group = per_group
        self.sweep_seconds = sweep_seconds
        self._d: dict[str, tuple[V, float, str | None]] = {}
        self._groups: dict[str, list[str]] = {}  # group -> its keys in _d, oldest written first
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
            self.discard(key)
            return None
        return hit[0]

    def put(self, key: str, value: V, expires_at: float, now: float, *, group: str | None = None) -> None:
        """Keep ``value`` until ``expires_at`` (not at all if that has passed), as the newest entry
        of ``group`` (whose oldest go beyond ``per_group``)."""
        d = self._d
        self.discard(key)  # re-written: now the newest
        if expires_at <= now:
            return
        if now >= self._next_sweep or len(d) >= self.max_entries:
            self.sweep(now)
        while len(d) >= self.max_entries:
            self.discard(next(iter(d)))  # all alive: the oldest written goes
        if group is not None:
            keys = self._groups.setdefault(group, [])
            while len(keys) >= self.per_group:
                d.pop(keys.pop(0), None)  # the group's oldest goes
            keys.append(key)
        d[key] = (value, expires_at, group)

    def sweep(self, now: float) -> int:
        """Drop every expired entry; how many went."""
        dead = [k for k, (_, exp, _) in self._d.items() if exp <= now]
        for k in dead:
            self.discard(k)
        self._next_sweep = now + self.sweep_seconds
        return len(dead)

    def discard(self, key: str) -> None:
        hit = self._d.pop(key, None)
        if hit is None or hit[2] is None:
            return
        keys = self._groups.get(hit[2])
        if keys is not None:
            if key in keys:
                keys.remove(key)
            if not keys:
                del self._groups[hit[2]]

    def clear(self) -> None:
        self._d.clear()
        self._groups.clear()

    @property
    def groups(self) -> int:
        """Groups with an entry now."""
        return len(self._groups)


def remember_verified(cache: ExpiringMap[Capability], key: str, cap: Capability, now: float) -> None:
    """Keep a verified access token until it expires (its ``exp`` or ``expires_at``, the sooner), as
    its session's newest. Refresh tokens are not kept: each is spent by its one use, so a kept one
    is only memory."""
    if cap.token_use != "access":
        return
    cache.put(key, cap, token_until(cap), now, group=cap.session_id)


def token_until(cap: Capability) -> float:
    """When a verified token stops being accepted: its ``exp`` or ``expires_at``, the sooner."""
    exp = cap.claims.get("exp", 0)
    return min(float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else 0.0, cap.expires_at)
