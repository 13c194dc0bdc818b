"""Query quotas (spec §10.4 step 5, §15.4 "Quota enforcement"): durable without an fsync per query.

The ledger counts in memory and persists a *reservation*: before the n-th query of a session may
pass, the persisted high-water mark must be >= n. When it is not, the mark is raised by a block
in one durable write, ``min(limit, n + block - 1)``. After a crash the ledger restarts from the
persisted mark, so an unclean stop can cost an agent up to ``block - 1`` queries but can never
give it one more than its limit: the error is always on the refusing side. A clean shutdown
(:meth:`flush`) writes the exact count.

The block adapts to the session's limit (:func:`reservation_block`): ``limit // 64``, at least
:data:`MIN_BLOCK` (16) and at most :data:`MAX_BLOCK` (4096). A crash therefore costs an agent at
most 15 queries or 1/64 (1.6 %) of its limit, whichever is larger, and never more than 4095;
while a session with a large limit makes one durable write (an fdatasync, ~0.15-0.3 ms, on the
caller's thread) per 4096 queries instead of per 16. Sessions with a limit up to 1,024 keep the
block of 16. A fixed ``block`` can still be passed (tests, benchmarks).

Single-threaded by design (one asyncio loop owns it), which is what makes check-and-increment
atomic under any number of concurrent requests. ``persist`` is called synchronously and must be
durable when it returns; that is what lets a query pass.
"""

from __future__ import annotations

from collections.abc import Callable

MIN_BLOCK = 16
MAX_BLOCK = 4096
BLOCK_FRACTION = 64  # a crash may cost at most 1/64 of a session's limit (or MIN_BLOCK - 1 queries)


def reservation_block(limit: int) -> int:
    """Queries reserved by one durable write for a session with this limit."""
    return max(MIN_BLOCK, min(MAX_BLOCK, limit // BLOCK_FRACTION))


class QuotaLedger:
    """Read quotas counted in memory and persisted in reserved blocks, so most reads cost no write."""

    def __init__(
        self, load: Callable[[str], int], persist: Callable[[str, int], None], *, block: int | None = None
    ) -> None:
        self._load = load
        self._persist = persist
        self._block = None if block is None else max(1, block)  # None: adapt to each session's limit
        self._used: dict[str, int] = {}
        self._reserved: dict[str, int] = {}

    def block_for(self, limit: int) -> int:
        return reservation_block(limit) if self._block is None else self._block

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
            mark = min(limit, used + self.block_for(limit) - 1)
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
