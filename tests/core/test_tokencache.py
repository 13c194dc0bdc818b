"""The expiring map behind the token caches: bounded by the entries alive, and by a hard limit."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.core.capability import Capability, Scope
from gateway.core.tokencache import ExpiringMap, remember_verified, token_until

NOW = 1_800_000_000.0


def cap(use: str = "access", exp: float = NOW + 600, expires_at: float = NOW + 86400) -> Capability:
    empty = Scope(tags=(), keys=(), deny_tags=(), deny_keys=(), allowed_fields=None)
    return Capability(
        session_id="s",
        agent_id="a",
        issued_at=NOW,
        expires_at=expires_at,
        read=empty,
        write=empty,
        max_read_queries=None,
        max_write_queries=None,
        profile="remote",
        audience=None,
        allowed_endpoints=None,
        allowed_fields=None,
        aggregation_only=False,
        task_bound=False,
        jti="j",
        kid="k",
        token_use=use,
        claims={"exp": exp},
    )


def test_size_follows_the_live_entries_not_every_entry_seen() -> None:
    m: ExpiringMap[int] = ExpiringMap(10_000, sweep_seconds=30)
    t = NOW
    for i in range(5_000):  # one new 60-second entry a second, for 5000 seconds
        m.put(f"k{i}", i, t + 60, t)
        t += 1
    assert len(m) <= 60 + 30 + 1  # alive, plus at most one sweep interval of dead ones
    assert m.get("k4999", t) == 4999 and m.get("k0", t) is None


def test_an_entry_is_never_returned_past_its_expiry() -> None:
    m: ExpiringMap[str] = ExpiringMap(8)
    m.put("a", "x", NOW + 10, NOW)
    assert m.get("a", NOW + 9.9) == "x"
    assert m.get("a", NOW + 10) is None and "a" not in m  # and it went
    m.put("b", "y", NOW - 1, NOW)  # dead already: not kept
    assert len(m) == 0


def test_full_of_live_entries_the_oldest_written_goes_first() -> None:
    m: ExpiringMap[int] = ExpiringMap(3)
    for i in range(3):
        m.put(f"k{i}", i, NOW + 100, NOW)
    m.put("k0", 0, NOW + 100, NOW)  # re-written: the newest now
    m.put("k3", 3, NOW + 100, NOW)
    assert sorted(m) == ["k0", "k2", "k3"]  # k1 went, not the whole map
    assert len(m) == 3


def test_a_full_map_drops_the_dead_before_the_living() -> None:
    m: ExpiringMap[int] = ExpiringMap(3, sweep_seconds=1e9)
    m.put("dead1", 1, NOW + 1, NOW)
    m.put("dead2", 2, NOW + 1, NOW)
    m.put("live", 3, NOW + 100, NOW)
    m.put("new", 4, NOW + 100, NOW + 5)
    assert sorted(m) == ["live", "new"]


def test_only_access_tokens_are_kept_until_the_sooner_expiry() -> None:
    m: ExpiringMap[Capability] = ExpiringMap(16)
    remember_verified(m, "rt", cap("refresh", exp=NOW + 7 * 86400), NOW)
    assert len(m) == 0  # a refresh token is spent by its one use
    c = cap(exp=NOW + 600, expires_at=NOW + 300)  # the session ends before the token
    assert token_until(c) == NOW + 300
    remember_verified(m, "at", c, NOW)
    assert m.get("at", NOW + 299) is c and m.get("at", NOW + 300) is None
    bogus = dataclasses.replace(c, claims={"exp": True})
    assert token_until(bogus) == 0.0


def test_max_entries_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ExpiringMap(0)


def test_a_group_keeps_its_newest_entries_and_leaves_other_groups_alone() -> None:
    m: ExpiringMap[int] = ExpiringMap(1000, per_group=2)
    m.put("other", 0, NOW + 600, NOW, group="s2")
    for i in range(50):  # one session's rotations: every token still alive
        m.put(f"t{i}", i, NOW + 600, NOW + i, group="s1")
    assert len(m) == 3 and m.groups == 2
    assert m.get("t49", NOW + 50) == 49 and m.get("t48", NOW + 50) == 48
    assert m.get("t47", NOW + 50) is None  # pushed out by the newer ones, though alive
    assert m.get("other", NOW + 50) == 0  # another session's entry stays
    m.put("t48", 48, NOW + 600, NOW + 51, group="s1")  # written again: now the newest of s1
    m.put("t50", 50, NOW + 600, NOW + 52, group="s1")
    assert m.get("t48", NOW + 53) == 48 and m.get("t49", NOW + 53) is None
    m.put("free", 1, NOW + 600, NOW + 53)  # no group: only the other bounds apply
    assert len(m) == 4


def test_groups_follow_the_entries_through_expiry_discard_and_clear() -> None:
    m: ExpiringMap[int] = ExpiringMap(1000, per_group=2, sweep_seconds=1e9)
    m.put("a", 1, NOW + 10, NOW, group="s1")
    m.put("b", 2, NOW + 600, NOW, group="s2")
    assert m.get("a", NOW + 11) is None and m.groups == 1  # expired on read
    m.discard("b")
    assert len(m) == 0 and m.groups == 0
    m.put("c", 3, NOW + 10, NOW, group="s3")
    assert m.sweep(NOW + 20) == 1 and m.groups == 0
    m.put("d", 4, NOW + 600, NOW, group="s4")
    m.clear()
    assert len(m) == 0 and m.groups == 0
    with pytest.raises(ValueError):
        ExpiringMap(10, per_group=0)
