"""The Merkle tree of the event log, kept in SQLite beside the events it covers.

One table holds the hash of every complete aligned subtree (level 0 = the leaf hashes), keyed by the
leaf whose append completes it, then its level: appends only ever write at the end of that B-tree.
Appending a leaf writes the one to ~log2(n) nodes it completes, in the caller's transaction, so the events and
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

from gateway import sqldriver
from gateway.core import merkle

SCHEMA = """
CREATE TABLE IF NOT EXISTS merkle_nodes (
  last INTEGER NOT NULL,
  level INTEGER NOT NULL,
  hash BLOB NOT NULL,
  idx INTEGER GENERATED ALWAYS AS (((last + 1) >> level) - 1) VIRTUAL,
  PRIMARY KEY (last, level)
) WITHOUT ROWID;
"""

# The layout before nodes were keyed by the leaf that completes them: one B-tree region per level, so
# every commit rewrote the right-most page of each level (about ten pages for fifteen events, each
# one encrypted and authenticated again in a sealed home). Opened read-only as it is; converted in
# one transaction by the first writable open (:func:`convert_layout`).
LEGACY_LAYOUT = "level_idx"
LAYOUT = "last_level"


def last_leaf(level: int, index: int) -> int:
    """The leaf whose append completes node ``index`` of ``level``: the key nodes are stored under,
    so appends only ever write at the end of one B-tree."""
    return ((index + 1) << level) - 1


def layout(conn: sqlite3.Connection) -> str:
    """:data:`LAYOUT`, or :data:`LEGACY_LAYOUT` for a table written by an older version."""
    cols = {str(r[1]) for r in conn.execute("PRAGMA table_xinfo(merkle_nodes)")}
    return LAYOUT if "last" in cols or not cols else LEGACY_LAYOUT


def convert_layout(conn: sqlite3.Connection) -> bool:
    """Rewrite a legacy-layout table into :data:`LAYOUT` in one ``BEGIN IMMEDIATE`` transaction
    (all of it or nothing, also when killed). Only outside a transaction, on a connection that may
    write; True when it converted. A read-only connection keeps reading the legacy layout."""
    if conn.in_transaction or layout(conn) == LAYOUT:
        return False
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqldriver.OPERATIONAL:  # read-only, or busy past the timeout: read the legacy layout
        return False
    try:
        if layout(conn) == LAYOUT:  # another process converted it while this one waited
            conn.execute("ROLLBACK")
            return False
        try:
            conn.execute("ALTER TABLE merkle_nodes RENAME TO merkle_nodes_legacy")
        except sqldriver.OPERATIONAL:  # a read-only file (mode=ro, or no write permission)
            conn.execute("ROLLBACK")
            return False
        conn.execute(SCHEMA.strip().rstrip(";"))
        conn.execute(
            "INSERT INTO merkle_nodes (last, level, hash) "
            "SELECT ((idx + 1) << level) - 1, level, hash FROM merkle_nodes_legacy ORDER BY 1, 2"
        )
        conn.execute("DROP TABLE merkle_nodes_legacy")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return True


def read_node(conn: sqlite3.Connection, level: int, index: int, kind: str = LAYOUT) -> bytes | None:
    """The stored hash of node ``index`` of ``level``, None when it is not stored."""
    if kind == LAYOUT:
        row = conn.execute(
            "SELECT hash FROM merkle_nodes WHERE last = ? AND level = ?", (last_leaf(level, index), level)
        ).fetchone()
    else:
        row = conn.execute("SELECT hash FROM merkle_nodes WHERE level = ? AND idx = ?", (level, index)).fetchone()
    return None if row is None else bytes(row[0])


def node_reader(conn: sqlite3.Connection) -> merkle.NodeReader:
    """A :class:`gateway.core.merkle.NodeReader` over the stored nodes; a missing node is a ProofError."""
    kind = layout(conn)

    def node(level: int, index: int) -> bytes:
        h = read_node(conn, level, index, kind)
        if h is None:
            raise merkle.ProofError(f"merkle node {level}/{index} is missing")
        return h

    return node


def leaf_count(conn: sqlite3.Connection, kind: str | None = None) -> int:
    """How many leaves the stored tree holds (the largest stored leaf index + 1)."""
    col = "last" if (kind or layout(conn)) == LAYOUT else "idx"
    row = conn.execute(f"SELECT MAX({col}) FROM merkle_nodes WHERE level = 0").fetchone()
    return 0 if row[0] is None else int(row[0]) + 1


def nodes_in_append_order(conn: sqlite3.Connection) -> sqlite3.Cursor:
    """Every stored node as (level, idx, hash), in the order appends create them (by the leaf that
    completes each, then level): the table's own order, one pass."""
    if layout(conn) == LAYOUT:
        return conn.execute("SELECT level, idx, hash FROM merkle_nodes ORDER BY last, level")
    return conn.execute("SELECT level, idx, hash FROM merkle_nodes ORDER BY ((idx + 1) << level), level")


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
        convert_layout(conn)
        self.kind = layout(conn)  # a legacy table is read (and, if never converted, written) as it is
        self._edge: dict[tuple[int, int], bytes] = {}
        self.size = 0
        self.reload()

    def reload(self) -> None:
        """Re-read the size and the right edge from the table (after open or a rollback)."""
        self.size = leaf_count(self.conn, self.kind)
        self._edge = {}
        n, level = self.size, 0
        while n >> level:
            i = (n >> level) - 1
            if i & 1 == 0:  # a left child on the edge: a later append pairs with it
                self._edge[(level, i)] = self._read(level, i)
            level += 1

    def _read(self, level: int, index: int) -> bytes:
        h = read_node(self.conn, level, index, self.kind)
        if h is None:
            raise merkle.ProofError(f"merkle node {level}/{index} is missing")
        return h

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
        if self.kind == LAYOUT:
            keyed = [(last_leaf(level, i), level, h) for level, i, h in rows]
            insert_rows(self.conn, "INSERT INTO merkle_nodes (last, level, hash) VALUES ", keyed)
        else:
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
