"""RFC 9162 Merkle trees: the RFC 6962 reference vectors, and properties over many tree shapes."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import merkle
from gateway.core.merkle import MemoryTree, ProofError

# The reference leaves and tree heads published with RFC 6962 implementations (Certificate
# Transparency, transparency-dev/merkle): data only.
LEAVES = [
    bytes.fromhex(h)
    for h in ("", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f")
]
ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
INCLUSION = [  # (leaf index, tree size, path)
    (0, 1, []),
    (
        0,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        5,
        8,
        [
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (
        1,
        5,
        [
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
]
CONSISTENCY = [  # (old size, new size, path)
    (1, 1, []),
    (
        1,
        8,
        [
            "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
        ],
    ),
    (
        6,
        8,
        [
            "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        ],
    ),
    (
        2,
        5,
        [
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
        ],
    ),
]
SOME_HASH = bytes.fromhex("abacaba000000000000000000000000000000000000000000060061e00123456")


def reference_tree() -> MemoryTree:
    tree = MemoryTree()
    for data in LEAVES:
        tree.append(merkle.leaf_hash(data))
    return tree


def tree_of(n: int) -> MemoryTree:
    tree = MemoryTree()
    for i in range(n):
        tree.append(merkle.leaf_hash(i.to_bytes(4, "big")))
    return tree


@pytest.mark.parametrize("size", range(len(ROOTS)), ids=lambda s: f"size{s}")
def test_roots_match_rfc6962_vectors(size: int) -> None:
    assert reference_tree().root(size).hex() == ROOTS[size]


def test_hash_domain_separation() -> None:
    assert merkle.leaf_hash(b"").hex() == ROOTS[1]
    assert merkle.leaf_hash(b"x") == hashlib.sha256(b"\x00x").digest()
    assert merkle.node_hash(b"a" * 32, b"b" * 32) == hashlib.sha256(b"\x01" + b"a" * 32 + b"b" * 32).digest()
    assert merkle.EMPTY_ROOT.hex() == ROOTS[0]


@pytest.mark.parametrize(("index", "size", "path"), INCLUSION, ids=lambda v: str(v)[:12])
def test_inclusion_vectors(index: int, size: int, path: list[str]) -> None:
    tree = reference_tree()
    assert [h.hex() for h in tree.inclusion_proof(index, size)] == path
    merkle.verify_inclusion(
        index, size, merkle.leaf_hash(LEAVES[index]), [bytes.fromhex(h) for h in path], bytes.fromhex(ROOTS[size])
    )


@pytest.mark.parametrize(("old", "new", "path"), CONSISTENCY, ids=lambda v: str(v)[:12])
def test_consistency_vectors(old: int, new: int, path: list[str]) -> None:
    tree = reference_tree()
    assert [h.hex() for h in tree.consistency_proof(old, new)] == path
    merkle.verify_consistency(
        old, new, bytes.fromhex(ROOTS[old]), bytes.fromhex(ROOTS[new]), [bytes.fromhex(h) for h in path]
    )


def _flip(h: bytes, bit: int = 3) -> bytes:
    return bytes([h[0] ^ (1 << bit)]) + h[1:]


def inclusion_mutations(index: int, size: int, leaf: bytes, path: list[bytes], root: bytes):
    """Every way a proof can be wrong that the verifier must catch (named)."""
    yield "index-1", (index - 1, size, leaf, path, root)
    yield "index+1", (index + 1, size, leaf, path, root)
    yield "index^2", (index ^ 2, size, leaf, path, root)
    yield "size*2", (index, size * 2, leaf, path, root)
    yield "size/2", (index, size // 2, leaf, path, root)
    yield "wrong leaf", (index, size, merkle.leaf_hash(b"WrongLeaf"), path, root)
    yield "empty root", (index, size, leaf, path, merkle.EMPTY_ROOT)
    yield "random root", (index, size, leaf, path, SOME_HASH)
    yield "trailing root", (index, size, leaf, [*path, root], root)
    yield "preceding root", (index, size, leaf, [root, *path], root)
    for i in range(len(path)):
        yield f"flip proof[{i}]", (index, size, leaf, [*path[:i], _flip(path[i]), *path[i + 1 :]], root)
    if path:
        yield "removed component", (index, size, leaf, path[:-1], root)
    if len(path) > 1:
        yield "inserted component", (index, size, leaf, [path[0], SOME_HASH, *path[1:]], root)


@pytest.mark.parametrize("size", [*range(1, 34), 64, 65, 100, 257])
def test_every_leaf_proves_and_every_mutation_fails(size: int) -> None:
    tree = tree_of(size)
    root = tree.root()
    for index in range(size):
        leaf = tree.node(0, index)
        path = tree.inclusion_proof(index)
        merkle.verify_inclusion(index, size, leaf, path, root)
        for name, args in inclusion_mutations(index, size, leaf, path, root):
            if args[0] == index and args[1] == size and args[3] == path and args[2] == leaf and args[4] == root:
                continue
            with pytest.raises(ProofError):
                merkle.verify_inclusion(*args)
            assert name


def test_consistency_every_pair_and_mutations() -> None:
    tree = tree_of(70)
    roots = [tree.root(n) for n in range(71)]
    for old in range(0, 71):
        for new in range(old, 71):
            proof = tree.consistency_proof(old, new)
            merkle.verify_consistency(old, new, roots[old], roots[new], proof)
            if not proof:
                continue
            bad = [
                (old - 1, new, roots[old], roots[new], proof),
                (old + 1, new, roots[old], roots[new], proof),
                (old, new * 2, roots[old], roots[new], proof),
                (old, new, SOME_HASH, roots[new], proof),
                (old, new, roots[old], SOME_HASH, proof),
                (old, new, roots[new], roots[old], proof),
                (old, new, roots[old], roots[new], []),
                (old, new, roots[old], roots[new], [*proof, roots[old]]),
                (old, new, roots[old], roots[new], [roots[new], *proof]),
                (old, new, roots[old], roots[new], proof[:-1]),
                *[
                    (old, new, roots[old], roots[new], [*proof[:i], _flip(proof[i], 4), *proof[i + 1 :]])
                    for i in range(len(proof))
                ],
            ]
            for args in bad:
                if args[0] < 0:
                    continue
                with pytest.raises(ProofError):
                    merkle.verify_consistency(*args)


@pytest.mark.parametrize(
    ("old", "new", "r1", "r2", "proof", "ok"),
    [
        (0, 0, merkle.EMPTY_ROOT, merkle.EMPTY_ROOT, [], True),
        (0, 1, merkle.EMPTY_ROOT, SOME_HASH, [], True),
        (1, 1, SOME_HASH, SOME_HASH, [], True),
        (1, 0, SOME_HASH, SOME_HASH, [], False),
        (2, 1, SOME_HASH, SOME_HASH, [], False),
        (1, 2, SOME_HASH, merkle.EMPTY_ROOT, [], False),
        (1, 1, merkle.EMPTY_ROOT, SOME_HASH, [], False),
        (1, 1, SOME_HASH, SOME_HASH, [SOME_HASH], False),
        (0, 1, merkle.EMPTY_ROOT, SOME_HASH, [SOME_HASH], False),
    ],
    ids=[
        "0-0",
        "0-1",
        "1-1",
        "back-in-time",
        "back-in-time-2",
        "empty-proof",
        "same-size-diff-root",
        "same-size-nonempty-proof",
        "from-empty-nonempty-proof",
    ],
)
def test_consistency_edge_cases(old: int, new: int, r1: bytes, r2: bytes, proof: list[bytes], ok: bool) -> None:
    if ok:
        merkle.verify_consistency(old, new, r1, r2, proof)
    else:
        with pytest.raises(ProofError):
            merkle.verify_consistency(old, new, r1, r2, proof)


@pytest.mark.parametrize(("index", "size"), [(0, 0), (1, 1), (2, 1), (-1, 3)])
def test_inclusion_out_of_range(index: int, size: int) -> None:
    with pytest.raises(ProofError):
        merkle.verify_inclusion(index, size, SOME_HASH, [], SOME_HASH)
    with pytest.raises(ProofError):
        tree_of(max(size, 0)).inclusion_proof(index, size)


def test_wrong_hash_lengths_refused() -> None:
    with pytest.raises(ProofError):
        merkle.verify_inclusion(0, 1, b"short", [], SOME_HASH)
    with pytest.raises(ProofError):
        merkle.verify_inclusion(0, 2, SOME_HASH, [b""], SOME_HASH)
    with pytest.raises(ProofError):
        MemoryTree().append(b"x")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=16), min_size=1, max_size=90), st.data())
def test_property_any_tree(leaves: list[bytes], data: st.DataObject) -> None:
    tree = MemoryTree()
    for leaf in leaves:
        tree.append(merkle.leaf_hash(leaf))
    n = len(leaves)
    # The stored-node root equals the recursive definition.
    assert tree.root() == _mth([merkle.leaf_hash(x) for x in leaves])
    index = data.draw(st.integers(0, n - 1))
    size = data.draw(st.integers(index + 1, n))
    path = tree.inclusion_proof(index, size)
    merkle.verify_inclusion(index, size, merkle.leaf_hash(leaves[index]), path, tree.root(size))
    other = data.draw(st.binary(max_size=16))
    if other != leaves[index]:
        with pytest.raises(ProofError):
            merkle.verify_inclusion(index, size, merkle.leaf_hash(other), path, tree.root(size))
    old = data.draw(st.integers(0, n))
    proof = tree.consistency_proof(old)
    merkle.verify_consistency(old, n, tree.root(old), tree.root(), proof)
    if proof:
        i = data.draw(st.integers(0, len(proof) - 1))
        byte = data.draw(st.integers(0, 31))
        bad = bytearray(proof[i])
        bad[byte] ^= 1
        with pytest.raises(ProofError):
            merkle.verify_consistency(old, n, tree.root(old), tree.root(), [*proof[:i], bytes(bad), *proof[i + 1 :]])


def _mth(hashes: list[bytes]) -> bytes:
    """RFC 9162 §2.1.1 written as the recursion, to check the stored-node version against."""
    if not hashes:
        return merkle.EMPTY_ROOT
    if len(hashes) == 1:
        return hashes[0]
    k = merkle.split_point(len(hashes))
    return merkle.node_hash(_mth(hashes[:k]), _mth(hashes[k:]))


def test_compact_range_roots_match_every_prefix() -> None:
    tree = tree_of(140)
    cr = merkle.CompactRange()
    assert cr.root() == merkle.EMPTY_ROOT
    for i in range(140):
        cr.append(tree.node(0, i))
        assert cr.root() == tree.root(i + 1)
