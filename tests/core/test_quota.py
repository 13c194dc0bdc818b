"""QuotaLedger math: reservations, the adaptive block, and crashes (a crash = a new ledger loaded
from the persisted mark, with no flush)."""

from __future__ import annotations

import random

import pytest

from gateway.core.quota import MAX_BLOCK, MIN_BLOCK, QuotaLedger, reservation_block


class Disk:
    """The persisted marks; every write is checked against the ledger's promise."""

    def __init__(self) -> None:
        self.marks: dict[str, int] = {}
        self.writes = 0

    def load(self, key: str) -> int:
        return self.marks.get(key, 0)

    def persist(self, key: str, mark: int) -> None:
        self.writes += 1
        self.marks[key] = mark

    def ledger(self, **kw: int) -> QuotaLedger:
        return QuotaLedger(self.load, self.persist, **kw)


@pytest.mark.parametrize(
    ("limit", "block"),
    [
        (0, MIN_BLOCK),
        (1, MIN_BLOCK),
        (100, MIN_BLOCK),
        (1024, MIN_BLOCK),
        (1087, MIN_BLOCK),
        (1088, 17),
        (6400, 100),
        (64 * 4096, MAX_BLOCK),
        (10_000_000, MAX_BLOCK),
    ],
)
def test_block_adapts_to_the_limit(limit: int, block: int) -> None:
    assert reservation_block(limit) == block
    assert QuotaLedger(lambda k: 0, lambda k, m: None).block_for(limit) == block
    assert QuotaLedger(lambda k: 0, lambda k, m: None, block=7).block_for(limit) == 7


@pytest.mark.parametrize("limit", [1, 3, 16, 100, 1000, 5000, 100_000, 10_000_000])
def test_every_query_is_covered_by_a_durable_reservation(limit: int) -> None:
    disk = Disk()
    q = disk.ledger()
    n = min(limit, 20_000)
    for i in range(1, n + 1):
        assert q.consume("s", limit) == limit - i
        assert disk.marks["s"] >= i  # durable before the query passed
        assert disk.marks["s"] <= limit  # never reserves past the limit
    block = reservation_block(limit)
    assert disk.writes == -(-n // block)  # one durable write per block
    if n == limit:
        assert q.consume("s", limit) == -1 and q.consume("s", limit) == -1
        assert q.remaining("s", limit) == 0


def test_large_limit_needs_few_writes() -> None:
    disk = Disk()
    q = disk.ledger()
    for _ in range(10_000):
        q.consume("s", 10_000_000)
    assert disk.writes == 3  # 4096 per write (was 625 writes with a block of 16)


@pytest.mark.parametrize("limit", [1, 5, 17, 100, 1500, 70_000, 10_000_000])
def test_a_crash_never_grants_more_than_the_limit(limit: int) -> None:
    """Random runs cut by crashes: across all lives of the ledger, at most ``limit`` queries pass,
    and each crash costs at most ``block - 1`` queries."""
    rng = random.Random(limit)
    for _ in range(20):
        disk = Disk()
        granted = 0
        lost = 0
        block = reservation_block(limit)
        for _life in range(6):
            q = disk.ledger()
            before = q.used("s")
            for _ in range(rng.randrange(0, min(limit, 5000) + 2)):
                if q.consume("s", limit) == -1:
                    break
                granted += 1
            used = q.used("s")
            if rng.random() < 0.3:
                q.flush()  # a clean stop: exact count
            else:
                lost += disk.marks.get("s", 0) - used  # a crash: the unused part of the reservation
                assert disk.marks.get("s", 0) - used <= block - 1
            assert used >= before
        assert granted <= limit
        assert granted + lost == disk.marks.get("s", 0)  # every reserved query was granted or lost


def test_crash_restarts_from_the_persisted_mark() -> None:
    disk = Disk()
    q = disk.ledger()
    for _ in range(3):
        q.consume("s", 100)
    assert disk.marks["s"] == 16  # reserved 1..16 with the first query
    q2 = disk.ledger()  # crash: no flush
    assert q2.remaining("s", 100) == 84  # queries 4..16 are lost, none is gained
    q2.consume("s", 100)
    assert disk.marks["s"] == 32
    q2.flush()  # clean stop: the exact count
    assert disk.marks["s"] == 17 and disk.ledger().remaining("s", 100) == 83


def test_reservation_is_capped_at_the_limit_and_exhaustion_is_stable() -> None:
    disk = Disk()
    q = disk.ledger()
    assert [q.consume("s", 5) for _ in range(7)] == [4, 3, 2, 1, 0, -1, -1]
    assert disk.marks["s"] == 5 and disk.writes == 1
    assert disk.ledger().consume("s", 5) == -1  # after a crash, still exhausted


def test_unlimited_sessions_are_not_persisted_and_sessions_are_separate() -> None:
    disk = Disk()
    q = disk.ledger()
    assert [q.consume("a", None) for _ in range(3)] == [None] * 3
    assert disk.writes == 0 and q.remaining("a", None) is None
    q.consume("b", 2)
    q.consume("c", 2)
    assert disk.marks == {"b": 2, "c": 2}
    q.forget("b")
    disk.marks.pop("b")
    assert q.remaining("b", 2) == 2


def test_failed_persist_lets_nothing_pass() -> None:
    class Full(Disk):
        def persist(self, key: str, mark: int) -> None:
            raise OSError("disk full")

    disk = Full()
    q = disk.ledger()
    with pytest.raises(OSError):
        q.consume("s", 100)
    assert q.used("s") == 0  # not counted as passed, and nothing was reserved
    with pytest.raises(OSError):
        q.consume("s", 100)
