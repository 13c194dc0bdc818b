"""Query quotas (spec §10.4 step 5, §15.4 "Quota enforcement"): durable without an fsync per query.

The ledger counts in memory and persists a *reservation*: before the n-th query of a session may
pass, the persisted high-water mark must be >= n. When it is not, the mark is raised by a block
(``block`` queries) in one durable write. After a crash the ledger restarts from the persisted mark,
so an unclean stop can cost an agent up to ``block - 1`` queries but can never give it one more
than its limit: the error is always on the refusing side. A clean shutdown (:meth:`flush`) writes
the exact count.

Single-threaded by design (one asyncio loop owns it), which is what makes check-and-increment
atomic under any number of concurrent requests.
"""

from __future__ import annotations

from collections.abc import Callable


class QuotaLedger:
    def __init__(self, load: Callable[[str], int], persist: Callable[[str, int], None], *, block: int = 16) -> None:
        self._load = load
        self._persist = persist
        self._block = max(1, block)
        self._used: dict[str, int] = {}
        self._reserved: dict[str, int] = {}

    def used(self, key: str) -> int:
        if key not in self._used:
            mark = self._load(key)
            self._used[key] = mark
            self._reserved[key] = mark
        return self._used[key]

    def consume(self, key: str, limit: int | None) -> int | None:
        """Take one query. Returns the remaining count (None when unlimited), or -1 when exhausted."""
        used = self.used(key)
        if limit is None:
            self._used[key] = used + 1
            return None
        if used >= limit:
            return -1
        used += 1
        if used > self._reserved[key]:
            mark = min(limit, used + self._block - 1)
            self._persist(key, mark)  # durable before the query is allowed
            self._reserved[key] = mark
        self._used[key] = used
        return limit - used

    def remaining(self, key: str, limit: int | None) -> int | None:
        return None if limit is None else max(0, limit - self.used(key))

    def flush(self) -> None:
        """Persist exact counts (clean shutdown)."""
        for key, used in self._used.items():
            if used != self._reserved.get(key):
                self._persist(key, used)
                self._reserved[key] = used

    def forget(self, key: str) -> None:
        self._used.pop(key, None)
        self._reserved.pop(key, None)
