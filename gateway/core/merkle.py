"""RFC 9162 (Certificate Transparency v2) Merkle trees: hashes, proofs and their verifiers.

Pure: bytes in, bytes out, no I/O. The audit log stores, per level, the hash of every *complete*
aligned subtree (level ``L`` index ``i`` covers leaves ``[i * 2**L, (i + 1) * 2**L)``); every hash
this module needs for a tree of any size is one of those or is folded from O(log n) of them, so
building a proof over a million events reads about 20-40 stored nodes instead of rehashing the log.
The reader of those nodes is the :class:`NodeReader` seam; :class:`MemoryTree` is the in-memory
implementation (tests, small logs, and the reference the stored one is checked against).

Hashing (RFC 9162 §2.1.1), SHA-256 throughout:

* empty tree: ``SHA-256()``;
* leaf: ``SHA-256(0x00 || leaf)``;
* interior node: ``SHA-256(0x01 || left || right)``;
* a tree of ``n > 1`` leaves splits at ``k``, the largest power of two smaller than ``n``.

The verifiers follow RFC 9162 §2.1.3.2 (inclusion) and §2.1.4.2 (consistency) step by step; their
steps are numbered in the code as in the RFC.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from gateway.errors import caused_by

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()
_LEAF = b"\x00"
_NODE = b"\x01"


class ProofError(ValueError):
    """A proof or a request for one that cannot be right (bad index, size or hash length)."""


def leaf_hash(data: bytes) -> bytes:
    """RFC 9162 §2.1.1 leaf hash: SHA-256(0x00 || data)."""
    return hashlib.sha256(_LEAF + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162 §2.1.1 interior node hash: SHA-256(0x01 || left || right)."""
    return hashlib.sha256(_NODE + left + right).digest()


def split_point(n: int) -> int:
    """The largest power of two strictly smaller than ``n`` (``n >= 2``)."""
    if n < 2:
        raise ProofError(f"no split for a tree of {n} leaves")
    return 1 << ((n - 1).bit_length() - 1)


class NodeReader(Protocol):
    """Hash of the complete subtree at ``level`` and ``index`` (leaves are level 0)."""

    def __call__(self, level: int, index: int) -> bytes: ...


def subtree_hash(node: NodeReader, start: int, end: int) -> bytes:
    """MTH(D[start:end]) for a range that starts on a multiple of a power of two >= its length.

    Every range a proof or root needs has that shape. The left part of each split is a complete
    aligned subtree (one stored node); only the right edge recurses, so this costs O(log n) reads.
    """
    n = end - start
    if n <= 0:
        raise ProofError("empty range")
    # Fold from the right edge: collect the complete subtrees left to right, then hash right to left.
    parts: list[bytes] = []
    while True:
        if n & (n - 1) == 0:  # a power of two: one complete, aligned subtree
            level = n.bit_length() - 1
            parts.append(node(level, start >> level))
            break
        k = split_point(n)
        level = k.bit_length() - 1
        parts.append(node(level, start >> level))
        start += k
        n -= k
    acc = parts[-1]
    for left in reversed(parts[:-1]):
        acc = node_hash(left, acc)
    return acc


def root(node: NodeReader, size: int) -> bytes:
    """The tree head of the first ``size`` leaves."""
    if size < 0:
        raise ProofError("negative tree size")
    if size == 0:
        return EMPTY_ROOT
    return subtree_hash(node, 0, size)


def inclusion_proof(node: NodeReader, index: int, size: int) -> list[bytes]:
    """PATH(index, D[0:size]) of RFC 9162 §2.1.3.1, leaf-side first."""
    if not 0 <= index < size:
        raise ProofError(f"leaf {index} is not in a tree of {size}")
    path: list[bytes] = []
    start, end, m = 0, size, index
    while end - start > 1:
        k = split_point(end - start)
        if m < k:
            path.append(subtree_hash(node, start + k, end))
            end = start + k
        else:
            path.append(subtree_hash(node, start, start + k))
            start += k
            m -= k
    path.reverse()
    return path


def consistency_proof(node: NodeReader, old_size: int, new_size: int) -> list[bytes]:
    """PROOF(old_size, D[0:new_size]) of RFC 9162 §2.1.4.1, leaf-side first."""
    if not 0 <= old_size <= new_size:
        raise ProofError(f"no consistency proof from {old_size} to {new_size}")
    if old_size == 0 or old_size == new_size:
        return []
    path: list[bytes] = []
    start, end, m, whole = 0, new_size, old_size, True
    # SUBPROOF(m, D[start:end], whole)
    while True:
        n = end - start
        if m == n:
            if not whole:
                path.append(subtree_hash(node, start, end))
            break
        k = split_point(n)
        if m <= k:
            path.append(subtree_hash(node, start + k, end))
            end = start + k
        else:
            path.append(subtree_hash(node, start, start + k))
            start += k
            m -= k
            whole = False
    path.reverse()
    return path


def _check_hashes(*hashes: bytes) -> None:
    for h in hashes:
        if len(h) != HASH_SIZE:
            raise ProofError("a hash is not 32 bytes")


def root_from_inclusion(index: int, size: int, leaf: bytes, path: Sequence[bytes]) -> bytes:
    """The root an inclusion proof leads to (RFC 9162 §2.1.3.2 steps 1-4)."""
    _check_hashes(leaf, *path)
    # 1. leaf_index must be inside the tree.
    if not 0 <= index < size:
        raise ProofError(f"leaf {index} is not in a tree of {size}")
    # 2. fn = leaf_index, sn = tree_size - 1.
    fn, sn = index, size - 1
    # 3. r = hash.
    r = leaf
    # 4. fold in each path element.
    for p in path:
        # 4a. a path longer than the tree is high.
        if sn == 0:
            raise ProofError("inclusion proof is too long")
        # 4b. p is a left sibling when fn is a right child or the last node of its level.
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        # 4c.
        fn >>= 1
        sn >>= 1
    # 5. (first half) the path must reach the top.
    if sn != 0:
        raise ProofError("inclusion proof is too short")
    return r


def verify_inclusion(index: int, size: int, leaf: bytes, path: Sequence[bytes], root_hash: bytes) -> None:
    """Raise :class:`ProofError` unless ``leaf`` is leaf ``index`` of the tree ``(size, root_hash)``."""
    _check_hashes(root_hash)
    # 5. (second half) compare with the tree head.
    if root_from_inclusion(index, size, leaf, path) != root_hash:
        raise ProofError("inclusion proof does not lead to the tree head")


def verify_consistency(old_size: int, new_size: int, old_root: bytes, new_root: bytes, path: Sequence[bytes]) -> None:
    """Raise :class:`ProofError` unless tree ``(new_size, new_root)`` extends ``(old_size, old_root)``."""
    _check_hashes(old_root, new_root, *path)
    if not 0 <= old_size <= new_size:
        raise ProofError(f"tree size went from {old_size} to {new_size}")
    if old_size == new_size:
        if path or old_root != new_root:
            raise ProofError("same tree size with different heads or a non-empty proof")
        return
    if old_size == 0:
        if path:
            raise ProofError("a proof from the empty tree must be empty")
        return
    # 1. an empty proof proves nothing between two non-empty, different sizes.
    if not path:
        raise ProofError("consistency proof is empty")
    proof = list(path)
    # 2. when the old tree is a complete subtree, its head is the proof's implicit first node.
    if old_size & (old_size - 1) == 0:
        proof.insert(0, old_root)
    # 3.
    fn, sn = old_size - 1, new_size - 1
    # 4. skip the levels where the old tree's last node is a right child.
    while fn & 1:
        fn >>= 1
        sn >>= 1
    # 5.
    fr = sr = proof[0]
    # 6.
    for c in proof[1:]:
        # 6a.
        if sn == 0:
            raise ProofError("consistency proof is too long")
        # 6b.
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        # 6c.
        fn >>= 1
        sn >>= 1
    # 7.
    if sn != 0:
        raise ProofError("consistency proof is too short")
    if fr != old_root:
        raise ProofError("consistency proof does not lead to the old tree head")
    if sr != new_root:
        raise ProofError("consistency proof does not lead to the new tree head")


def complete_nodes_after_append(index: int, leaf: bytes, node: NodeReader) -> list[tuple[int, int, bytes]]:
    """The complete-subtree nodes that appending leaf ``index`` creates: ``(level, index, hash)``.

    Leaf ``index`` completes one subtree per trailing one-bit of ``index + 1``'s predecessor chain:
    level 0 always, and level ``L + 1`` whenever the node just made at level ``L`` is a right child.
    """
    out = [(0, index, leaf)]
    level, i, h = 0, index, leaf
    while i & 1:
        h = node_hash(node(level, i - 1), h)
        level += 1
        i >>= 1
        out.append((level, i, h))
    return out


class CompactRange:
    """The right edge of a growing tree: O(log n) memory, the root of every prefix on demand.

    What a verifier uses to recompute a million-event log's roots without keeping the tree.
    """

    def __init__(self) -> None:
        self.size = 0
        self._edge: list[tuple[int, bytes]] = []  # (level, hash), largest subtree first

    @classmethod
    def from_edge(cls, size: int, edge: list[tuple[int, bytes]]) -> CompactRange:
        """The range of a tree of ``size`` leaves from its right edge: the root of each complete
        subtree of the prefix, largest first (one per set bit of ``size``)."""
        if [lv for lv, _ in edge] != [b for b in range(size.bit_length() - 1, -1, -1) if size >> b & 1]:
            raise ProofError(f"not the right edge of a tree of {size} leaves")
        _check_hashes(*(h for _, h in edge))
        cr = cls()
        cr.size = size
        cr._edge = list(edge)
        return cr

    def append(self, leaf: bytes) -> None:
        _check_hashes(leaf)
        level, h = 0, leaf
        while self._edge and self._edge[-1][0] == level:
            _, left = self._edge.pop()
            h = node_hash(left, h)
            level += 1
        self._edge.append((level, h))
        self.size += 1

    def root(self) -> bytes:
        if not self._edge:
            return EMPTY_ROOT
        acc = self._edge[-1][1]
        for _, left in reversed(self._edge[:-1]):
            acc = node_hash(left, acc)
        return acc


class MemoryTree:
    """An in-memory append-only tree that keeps every complete subtree hash (level by level)."""

    def __init__(self) -> None:
        self.levels: list[list[bytes]] = [[]]

    @property
    def size(self) -> int:
        return len(self.levels[0])

    def node(self, level: int, index: int) -> bytes:
        try:
            return self.levels[level][index]
        except IndexError:
            raise caused_by(ProofError(f"no complete subtree at level {level} index {index}"), None)

    def append(self, leaf: bytes) -> int:
        """Append a leaf *hash*; return its index."""
        _check_hashes(leaf)
        index = self.size
        for level, i, h in complete_nodes_after_append(index, leaf, self.node):
            if level == len(self.levels):
                self.levels.append([])
            assert len(self.levels[level]) == i
            self.levels[level].append(h)
        return index

    def root(self, size: int | None = None) -> bytes:
        return root(self.node, self.size if size is None else self._size(size))

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        return inclusion_proof(self.node, index, self.size if size is None else self._size(size))

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> list[bytes]:
        return consistency_proof(self.node, old_size, self.size if new_size is None else self._size(new_size))

    def _size(self, size: int) -> int:
        if not 0 <= size <= self.size:
            raise ProofError(f"tree has {self.size} leaves, not {size}")
        return size
