"""State the Memory Guard keeps about agents' reads, in ``$UOMP_HOME/reads.db`` (0600, WAL):

* the key that seals tag-read cursors (:mod:`gateway.core.paging`), made once, so cursors outlive a
  restart of the guard;
* the secret multipliers of the keyed sums that fingerprint aggregated item sets;
* each session's aggregate history (docs/aggregates.md): per session and field, the tags already
  aggregated with their set's fingerprint, so that a later aggregate can be checked against all of
  them (:func:`gateway.core.policy.check_atoms`), across restarts.

Bounded: at most ``aggregate_max_sets_per_session`` recorded sets per session (a new one past that
is refused, never an old one forgotten: forgetting would reopen the differencing it guards against),
rows of sessions past their expiry are pruned, and at most ``aggregate_history_max_rows`` rows in
all (then new records are refused until sessions expire). A check and its record happen under one
lock, in one transaction: two concurrent aggregates of a session cannot both pass against a
history that lacks the other.
"""

from __future__ import annotations

import contextlib
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.core import paging
from gateway.core.policy import AtomCheck, Fingerprint, check_atoms
from gateway.db import connect, transaction
from gateway.errors import ErrorCode, UompError
from gateway.guard.storage import HASH_PRIME, Atom

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS aggregate_sets (
  session_id TEXT NOT NULL,
  field TEXT NOT NULL,
  tag TEXT NOT NULL,
  n INTEGER NOT NULL,
  h1 INTEGER NOT NULL,
  h2 INTEGER NOT NULL,
  recorded_at REAL NOT NULL,
  session_expires_at REAL NOT NULL,
  PRIMARY KEY (session_id, field, tag)
);
CREATE INDEX IF NOT EXISTS aggregate_sets_expiry ON aggregate_sets(session_expires_at);
"""

WHAT = "read-state database"


@dataclass(frozen=True)
class HistoryDecision:
    """Whether an aggregate may be answered given what this session already aggregated, and why."""

    ok: bool
    reason: str  # for the agent
    detail: str  # for the user's audit view


HISTORY_FULL = "this session has aggregated too many different item sets; ask the user for a new session"
HISTORY_STORE_FULL = "the guard's aggregate history is full; try again later"
WOULD_ISOLATE = "aggregate refused: together with this session's earlier aggregates it would isolate too few items"
CHANGED = (
    "aggregate refused: the items behind an earlier aggregate of this field have changed since; "
    "ask the user for a new session"
)
TOO_MANY_GROUPS = "aggregate refused: the tags aggregated in this session overlap in too many ways"


@dataclass
class History:
    """One session's recorded sets for one field (see :meth:`ReadState.history`)."""

    state: ReadState
    session_id: str
    field: str
    recorded: dict[str, Fingerprint]
    in_session: int  # recorded sets of the session, all fields

    def tags_with(self, tag: str) -> list[str]:
        """The recorded tags and ``tag``, ``tag`` last (bit j of an atom's pattern = j-th tag)."""
        return [t for t in self.recorded if t != tag] + [tag]

    def full_for(self, tag: str, *, max_tags: int) -> HistoryDecision | None:
        """A refusal when recording one more set would pass a bound; None otherwise."""
        if tag in self.recorded:
            return None
        if self.in_session >= self.state.max_sets_per_session or len(self.recorded) + 1 > max_tags:
            return HistoryDecision(False, HISTORY_FULL, f"{self.in_session} sets already recorded")
        return None

    def check(self, tags: Sequence[str], atoms: Sequence[Atom], *, min_group: int) -> tuple[HistoryDecision, AtomCheck]:
        check = check_atoms(self.recorded, tags, ((a.pattern, a.count, a.h1, a.h2) for a in atoms), min_group=min_group)
        if check.ok:
            return HistoryDecision(True, "ok", f"{len(tags)} set(s) in this session's history of the field"), check
        reason = CHANGED if "changed" in check.detail else WOULD_ISOLATE
        return HistoryDecision(False, reason, check.detail), check

    def record(self, tag: str, fp: Fingerprint, *, session_expires_at: float) -> HistoryDecision:
        """Durably record ``tag``'s set (no-op when already recorded: its fingerprint was checked)."""
        if tag in self.recorded:
            return HistoryDecision(True, "ok", "already recorded")
        out = self.state._record(self, tag, fp, session_expires_at)
        if out.ok:
            self.recorded[tag] = fp
            self.in_session += 1
        return out


class ReadState:
    """What each session aggregated before (``reads.db``), so no two answers together isolate one item."""

    def __init__(
        self, path: Path, *, max_sets_per_session: int, max_rows: int, clock: Callable[[], float] = time.time
    ) -> None:
        self.max_sets_per_session = max_sets_per_session
        self.max_rows = max_rows
        self.clock = clock
        self._lock = threading.Lock()
        self.db = connect(path, schema=SCHEMA, what=WHAT)
        self.cursor_key = self._secret("cursor_key", paging.KEY_BYTES)
        raw = self._secret("fingerprint_keys", 16)
        # four multipliers in [1, HASH_PRIME): keyed, so nobody can arrange collisions
        self.fingerprint_keys = tuple(
            1 + int.from_bytes(raw[i : i + 4], "big") % (HASH_PRIME - 1) for i in range(0, 16, 4)
        )

    def _secret(self, name: str, size: int) -> bytes:
        with self._tx() as db:
            row = db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
            if row is not None and isinstance(row[0], bytes) and len(row[0]) == size:
                return bytes(row[0])
            value = secrets.token_bytes(size)
            db.execute("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)", (name, value))
            return value

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with transaction(self.db, what=WHAT) as db:
            yield db

    def keys4(self) -> tuple[int, int, int, int]:
        a, b, c, d = self.fingerprint_keys
        return a, b, c, d

    @contextlib.contextmanager
    def history(self, session_id: str, field: str) -> Iterator[History]:
        """The session's aggregate history of ``field``, held under the lock until the block ends:
        check against it, then :meth:`History.record`, with no other aggregate in between."""
        with self._lock:
            try:
                rows = self.db.execute(
                    "SELECT tag, n, h1, h2 FROM aggregate_sets WHERE session_id = ? AND field = ?", (session_id, field)
                ).fetchall()
                in_session = int(
                    self.db.execute(
                        "SELECT count(*) FROM aggregate_sets WHERE session_id = ?", (session_id,)
                    ).fetchone()[0]
                )
            except sqlite3.Error as exc:
                raise UompError(ErrorCode.STORE_UNAVAILABLE, f"the {WHAT} is unavailable") from exc
            recorded = {str(r[0]): Fingerprint(int(r[1]), int(r[2]), int(r[3])) for r in rows}
            yield History(self, session_id, field, recorded, in_session)

    def _record(self, h: History, tag: str, fp: Fingerprint, session_expires_at: float) -> HistoryDecision:
        now = self.clock()
        with self._tx() as db:
            db.execute("DELETE FROM aggregate_sets WHERE session_expires_at < ?", (now,))
            total = int(db.execute("SELECT count(*) FROM aggregate_sets").fetchone()[0])
            if total >= self.max_rows:
                return HistoryDecision(False, HISTORY_STORE_FULL, f"{total} rows recorded")
            db.execute(
                "INSERT INTO aggregate_sets (session_id, field, tag, n, h1, h2, recorded_at, "
                "session_expires_at) VALUES (?,?,?,?,?,?,?,?)",
                (h.session_id, h.field, tag, fp.count, fp.h1, fp.h2, now, session_expires_at),
            )
        return HistoryDecision(True, "ok", "recorded")

    def recorded(self, session_id: str) -> list[tuple[str, str, int]]:
        """(field, tag, items) recorded for a session (for tests and the user's view)."""
        return [
            (str(r[0]), str(r[1]), int(r[2]))
            for r in self.db.execute(
                "SELECT field, tag, n FROM aggregate_sets WHERE session_id = ? ORDER BY recorded_at", (session_id,)
            )
        ]

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.db.close()
