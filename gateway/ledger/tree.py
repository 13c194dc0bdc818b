"""The Merkle tree of the event log, kept in SQLite beside the events it covers.

One table holds the hash of every complete aligned subtree (level 0 = the leaf hashes). Appending
a leaf writes the one to ~log2(n) nodes it completes, in the caller's transaction, so the events and
their tree commit or roll back together. Roots and proofs for any size up to the current one are
computed by :mod:`gateway.core.merkle` from O(log n) stored nodes; nothing rehashes the log.

The right edge of the tree (at most one complete subtree per level, the nodes a future append may
pair with) is cached in memory; the cache is rebuilt from the table when the store is opened, and
dropped whenever a transaction the store took part in rolls back (:meth:`TreeStore.reload`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from gateway.core import merkle

SCHEMA = """
CREATE TABLE IF NOT EXISTS merkle_nodes (
  level INTEGER NOT NULL,
  idx INTEGER NOT NULL,
  hash BLOB NOT NULL,
  PRIMARY KEY (level, idx)
) WITHOUT ROWID;
"""


MAX_ROWS_PER_INSERT = 256  # x at most 10 columns: well under SQLite's 32,766 bound variables


def insert_rows(conn: sqlite3.Connection, head: str, rows: Sequence[tuple[Any, ...]]) -> None:
    """``head`` (``INSERT INTO t (a, b) VALUES ``) with ``rows`` as multi-row VALUES statements, up
    to :data:`MAX_ROWS_PER_INSERT` rows per statement. One statement step for a whole batch, where
    ``executemany`` steps (and lets go of the GIL) once per row: under load every such release hands
    the GIL to another thread of the guard and back."""
    if not rows:
        return
    width = len(rows[0])
    one = "(" + ", ".join("?" * width) + ")"
    for start in range(0, len(rows), MAX_ROWS_PER_INSERT):
        chunk = rows[start : start + MAX_ROWS_PER_INSERT]
        conn.execute(head + ", ".join([one] * len(chunk)), [v for row in chunk for v in row])


class TreeStore:
    """The log's Merkle tree as stored complete subtrees, with its right edge kept in memory."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        conn.executescript(SCHEMA)
        self._edge: dict[tuple[int, int], bytes] = {}
        self.size = 0
        self.reload()

    def reload(self) -> None:
        """Re-read the size and the right edge from the table (after open or a rollback)."""
        row = self.conn.execute("SELECT MAX(idx) FROM merkle_nodes WHERE level = 0").fetchone()
        self.size = 0 if row[0] is None else int(row[0]) + 1
        self._edge = {}
        n, level = self.size, 0
        while n >> level:
            i = (n >> level) - 1
            if i & 1 == 0:  # a left child on the edge: a later append pairs with it
                self._edge[(level, i)] = self._read(level, i)
            level += 1

    def _read(self, level: int, index: int) -> bytes:
        row = self.conn.execute("SELECT hash FROM merkle_nodes WHERE level = ? AND idx = ?", (level, index)).fetchone()
        if row is None:
            raise merkle.ProofError(f"merkle node {level}/{index} is missing")
        return bytes(row[0])

    def node(self, level: int, index: int) -> bytes:
        cached = self._edge.get((level, index))
        return cached if cached is not None else self._read(level, index)

    def append(self, leaves: list[bytes]) -> int:
        """Append leaf hashes (inside the caller's transaction); return the index of the first."""
        first = self.size
        rows: list[tuple[int, int, bytes]] = []
        for leaf in leaves:
            made = merkle.complete_nodes_after_append(self.size, leaf, self.node)
            rows.extend(made)
            for level, i, h in made:
                if i & 1 == 0:
                    self._edge[(level, i)] = h
                else:
                    self._edge.pop((level, i - 1), None)
            self.size += 1
        insert_rows(self.conn, "INSERT INTO merkle_nodes (level, idx, hash) VALUES ", rows)
        return first

    def _check(self, size: int) -> int:
        if not 0 <= size <= self.size:
            raise merkle.ProofError(f"the log has {self.size} events, not {size}")
        return size

    def root(self, size: int | None = None) -> bytes:
        return merkle.root(self.node, self._check(self.size if size is None else size))

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        return merkle.inclusion_proof(self.node, index, self._check(size))

    def consistency_proof(self, old_size: int, new_size: int) -> list[bytes]:
        return merkle.consistency_proof(self.node, old_size, self._check(new_size))
