"""The SQLite-backed Merkle tree agrees with the in-memory reference, survives reopening, and
rolls back with the transaction it was written in."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gateway.core import merkle
from gateway.core.merkle import MemoryTree
from gateway.ledger.tree import TreeStore


def _open(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    return conn


def _leaf(i: int) -> bytes:
    return merkle.leaf_hash(b"event-%d" % i)


def test_matches_memory_tree_across_batches_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    ref = MemoryTree()
    conn = _open(path)
    store = TreeStore(conn)
    n = 0
    for batch in (1, 2, 3, 5, 8, 13, 1, 1, 40, 7):
        conn.execute("BEGIN IMMEDIATE")
        first = store.append([_leaf(n + j) for j in range(batch)])
        conn.execute("COMMIT")
        assert first == n
        for j in range(batch):
            ref.append(_leaf(n + j))
        n += batch
        assert store.size == ref.size == n
        assert store.root() == ref.root()
        if n % 2:  # reopen now and then: the right edge is rebuilt from the table
            conn.close()
            conn = _open(path)
            store = TreeStore(conn)
    for size in range(1, n + 1):
        assert store.root(size) == ref.root(size)
        for index in (0, size // 2, size - 1):
            assert store.inclusion_proof(index, size) == ref.inclusion_proof(index, size)
        assert store.consistency_proof(size // 3, size) == ref.consistency_proof(size // 3, size)


def test_rollback_then_reload_keeps_the_committed_tree(tmp_path: Path) -> None:
    conn = _open(tmp_path / "t.db")
    store = TreeStore(conn)
    conn.execute("BEGIN IMMEDIATE")
    store.append([_leaf(i) for i in range(5)])
    conn.execute("COMMIT")
    good = store.root()
    conn.execute("BEGIN IMMEDIATE")
    store.append([_leaf(i) for i in range(100, 103)])
    conn.execute("ROLLBACK")
    store.reload()
    assert store.size == 5 and store.root() == good
    conn.execute("BEGIN IMMEDIATE")
    store.append([_leaf(5)])
    conn.execute("COMMIT")
    ref = MemoryTree()
    for i in range(6):
        ref.append(_leaf(i))
    assert store.root() == ref.root()


def test_sizes_beyond_the_log_are_refused(tmp_path: Path) -> None:
    store = TreeStore(_open(tmp_path / "t.db"))
    with pytest.raises(merkle.ProofError):
        store.root(1)
    assert store.root() == merkle.EMPTY_ROOT
