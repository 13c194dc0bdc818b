"""Event ids: unique and unguessable, and ordered by time, so that the events of
one commit land side by side in the log's ``id`` index instead of one random index page each."""

from __future__ import annotations

import os
import re
import secrets
import sqlite3
import struct
import time
from pathlib import Path

from gateway.guard.audit import AuditLog, make_row
from gateway.guard.routes.internal import GATEWAY_EVENT_ID as GUARD_ACCEPTS_GATEWAY_ID
from gateway.remote.event_sink import new_event_id

LOG_ID = re.compile(r"log_([0-9a-f]{12})([0-9a-f]{16})")
GW_ID = re.compile(r"gw_([0-9a-f]{12})([0-9a-f]{20})")


def _row(now: float | None = None, event_id: str | None = None) -> tuple[object, ...]:
    return make_row(
        session_id="sess_ids",
        agent_id="agent-1",
        action="read",
        allowed=True,
        reason="scope matched",
        key="preference.theme",
        tags=["preference"],
        response_size=12,
        query_count_remaining=9,
        via="gateway:mtls:test",
        now=now,
        event_id=event_id,
        extra={"listener": "mtls", "client": "127.0.0.1:40001", "request_id": "req_0011223344556677"},
    )


def test_a_log_id_is_the_events_millisecond_then_64_random_bits() -> None:
    now = 1_764_639_600.123_456
    m = LOG_ID.fullmatch(str(_row(now)[0]))
    assert m is not None
    assert int(m.group(1), 16) == 1_764_639_600_123
    assert str(_row(now)[0]) != str(_row(now)[0])  # the same millisecond: the random part differs
    # an explicit id is kept as given (replays, tests)
    assert _row(now, event_id="log_given")[0] == "log_given"


def test_ids_made_later_sort_after_ids_made_earlier() -> None:
    """Across milliseconds, seconds and hours the ids sort in the order the events were made (within
    one millisecond, in any order: the random part decides). Random ids failed this."""
    base = time.time()
    times = [base, base + 0.001, base + 0.002, base + 1, base + 3600, base + 86_400 * 400]
    for _ in range(50):
        ids = [str(_row(t)[0]) for t in times]
        assert ids == sorted(ids)
        gw = [new_event_id(t) for t in times]
        assert gw == sorted(gw)


def test_ids_stay_unique_within_one_millisecond() -> None:
    now = time.time()
    ids = {str(_row(now)[0]) for _ in range(20_000)}
    assert len(ids) == 20_000
    randoms = {LOG_ID.fullmatch(i).group(2) for i in ids}  # type: ignore[union-attr]
    assert len(randoms) == 20_000


def test_a_forked_child_draws_its_own_random_parts() -> None:
    """The pool of random parts is dropped in a forked child: parent and child never make the same id
    in the same millisecond (they would, from a copied pool)."""
    now = time.time()
    str(_row(now)[0])  # the pool is filled
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        os.write(w, " ".join(str(_row(now)[0]) for _ in range(50)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = set(f.read().split())
    os.waitpid(pid, 0)
    parent = {str(_row(now)[0]) for _ in range(50)}
    assert len(child) == 50 and not child & parent


def test_a_gateway_id_keeps_its_length_and_the_guard_accepts_it() -> None:
    now = 1_764_639_600.5
    gid = new_event_id(now)
    m = GW_ID.fullmatch(gid)
    assert m is not None and int(m.group(1), 16) == 1_764_639_600_500
    assert GUARD_ACCEPTS_GATEWAY_ID.fullmatch(gid)
    assert len({new_event_id(now) for _ in range(10_000)}) == 10_000
    assert GUARD_ACCEPTS_GATEWAY_ID.fullmatch(new_event_id())


def _index_pages_of_one_commit(db: Path, rows: list[tuple[object, ...]]) -> int:
    """Pages of the ``id`` index that one commit of ``rows`` writes to the WAL (a real commit through
    ``AuditLog``; the WAL's frame headers name the pages, ``dbstat`` the b-tree each belongs to)."""
    log = AuditLog(db)
    try:
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert os.stat(str(db) + "-wal").st_size == 0
        log.write_now(rows)
    finally:
        log.close()
    data = Path(str(db) + "-wal").read_bytes()
    pages = {struct.unpack(">I", data[off : off + 4])[0] for off in range(32, len(data) - 23, 24 + 4096)}
    with sqlite3.connect(db) as conn:
        index = {
            p for (p,) in conn.execute("SELECT pageno FROM dbstat WHERE name = 'sqlite_autoindex_ledger_events_1'")
        }
    return len(pages & index)


def test_a_commit_of_many_events_dirties_few_id_index_pages(tmp_path: Path) -> None:
    """The mechanism behind the lever, on real audit.db files of 30,000 events each: one commit of 40
    events writes a handful of the ``id`` index's pages to the WAL with time-ordered ids, and about
    one page per event in a log whose ids are random (the scheme before: every id lands on its own
    page of the index, so the write grows with the batch and the log)."""
    t0 = time.time() - 3600
    frames = {}
    for scheme in ("ordered", "random"):
        db = tmp_path / f"{scheme}.db"

        def eid() -> str | None:
            return "log_" + secrets.token_hex(8) if scheme == "random" else None  # noqa: B023

        log = AuditLog(db)
        try:
            for b in range(60):  # 30,000 events over the last hour, in commits of 500
                log.write_now([_row(t0 + (b * 500 + i) * 0.1, eid()) for i in range(500)])
        finally:
            log.close()
        frames[scheme] = _index_pages_of_one_commit(db, [_row(None, eid()) for _ in range(40)])
    assert frames["ordered"] <= 6, frames
    assert frames["random"] >= 25, frames
