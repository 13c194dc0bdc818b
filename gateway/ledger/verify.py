"""Checking the event log as its user would: the whole log, or one proof bundle on its own.

:func:`verify_log` streams the log once, in sequence order, and reports the first bad sequence
number it can pin down:

1. every checkpoint's signature (the appliance's audit key) and body;
2. sequence numbers start at 1 and have no gap, no duplicate and no reordering (a body's own
   ``seq`` must equal its row's);
3. every event body still kept hashes to its stored leaf (a changed event);
4. the tree is recomputed from the leaves; every complete subtree must equal the stored node
   (pins an edit down to the smallest subtree that changed) and every checkpoint's root must equal
   the recomputed root at its size (so successive checkpoints are consistent by construction);
5. neither the newest checkpoint nor the stored tree may be larger than the log (a cut-off tail;
   a tail cut together with its tree nodes and after the last checkpoint is what the checkpoint
   interval and the anchors bound).

Anchors are checked by the caller against the chain (see ``gateway.anchor``): an anchored root is
the one thing an attacker holding the appliance's disk and key cannot rewrite.
"""

from __future__ import annotations

import base64
import binascii
import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gateway.core import merkle
from gateway.core.checkpoint import Checkpoint, NoteError, parse_verifier_key
from gateway.errors import UompError
from gateway.ledger.log import BUNDLE_VERSION, checkpoint_hash, event_leaf


def check_anchored_head(conn: sqlite3.Connection, size: int, root: bytes) -> str | None:
    """The stored log against a tree head read from the chain (its newest anchor): None when the
    log holds ``size`` events and its root at ``size`` is ``root``, else what is wrong. Run after
    :func:`verify_log` (which checks the stored tree against the leaves)."""
    from gateway.ledger.tree import TreeStore

    try:
        tree = TreeStore(conn)
        if tree.size < size:
            return (f"the chain anchors a checkpoint of {size} events but the log holds {tree.size}: rolled back or "
                    f"truncated (first missing size {tree.size + 1})")
        if tree.root(size) != root:
            return f"the log's root at size {size} is not the one anchored on chain: a second history"
    except (sqlite3.Error, merkle.ProofError) as exc:
        return f"the log cannot be checked against the chain's anchor of size {size}: {exc}"
    return None


@dataclass
class Report:
    ok: bool = True
    events: int = 0
    pruned: int = 0
    checkpoints: int = 0
    first_bad_seq: int | None = None
    problems: list[str] = field(default_factory=list)

    def fail(self, seq: int | None, problem: str, *, upto: int | None = None) -> None:
        """Record a problem at ``seq`` (or somewhere in ``seq..upto``).

        A range that already contains a more precise finding does not move ``first_bad_seq``: a
        changed event also changes every subtree and checkpoint above it.
        """
        self.ok = False
        known = self.first_bad_seq
        if seq is not None and (known is None or (seq < known and (upto is None or upto < known))):
            self.first_bad_seq = seq
        if len(self.problems) < 20:
            self.problems.append(problem)


def verify_log(conn: sqlite3.Connection, *, origin: str, public_key: Ed25519PublicKey) -> Report:
    report = Report()
    # 1. checkpoints, oldest first.
    cps: list[Checkpoint] = []
    prev_size = 0
    for (note,) in conn.execute("SELECT note FROM ledger_checkpoints ORDER BY size"):
        try:
            cp = Checkpoint.open(str(note), origin, public_key)
        except NoteError as exc:
            report.fail(prev_size + 1, f"checkpoint after event {prev_size}: {exc}")
            continue
        cps.append(cp)
        prev_size = cp.size
    report.checkpoints = len(cps)
    next_cp = 0
    last_good_cp = 0

    edge: dict[tuple[int, int], bytes] = {}
    # Stored nodes in the order appends create them (a node completes with leaf ((idx + 1) << level) - 1).
    stored = conn.execute("SELECT level, idx, hash FROM merkle_nodes ORDER BY ((idx + 1) << level), level")
    ahead = stored.fetchone()
    cr = merkle.CompactRange()
    expected = 1
    for seq, body, leaf in conn.execute("SELECT seq, body, leaf FROM ledger_events ORDER BY seq"):
        # 2. no gap, no reordering.
        if seq != expected:
            report.fail(expected, f"event {expected} is missing (next is {seq})")
            expected = seq
        leaf = bytes(leaf)
        if body is None:
            report.pruned += 1
        else:
            # 3. the stored body (canonical bytes as appended) hashes to its leaf and names its own place.
            if merkle.leaf_hash(str(body).encode()) != leaf:
                report.fail(seq, f"event {seq} does not match its leaf hash (changed)")
            else:
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = None
                if not isinstance(parsed, dict) or parsed.get("seq") != seq:
                    where = parsed.get("seq") if isinstance(parsed, dict) else "?"
                    report.fail(seq, f"event {seq} says it is event {where} (moved)")
        # 4. recompute the tree and compare with the stored nodes.
        if len(leaf) != merkle.HASH_SIZE:
            report.fail(seq, f"event {seq} has a malformed leaf")
            leaf = bytes(merkle.HASH_SIZE)
        for level, i, h in merkle.complete_nodes_after_append(cr.size, leaf, lambda lv, i: edge[(lv, i)]):
            if i & 1 == 0:
                edge[(level, i)] = h
            else:
                edge.pop((level, i - 1), None)
            if ahead is not None and (int(ahead[0]), int(ahead[1])) == (level, i):
                want: bytes | None = bytes(ahead[2])
                ahead = stored.fetchone()
            else:
                want = _stored_node(conn, level, i)
            if want != h:
                first = (i << level) + 1
                last = (i + 1) << level
                report.fail(first, f"tree node {level}/{i} (events {first}-{last}) does not match", upto=last)
        cr.append(leaf)
        report.events += 1
        while next_cp < len(cps) and cps[next_cp].size == cr.size:
            if cr.root() != cps[next_cp].root:
                report.fail(last_good_cp + 1,
                            f"checkpoint at {cr.size} events does not match the log (changed in {last_good_cp + 1}"
                            f"-{cr.size})", upto=cr.size)
            else:
                last_good_cp = cr.size
            next_cp += 1
        expected = seq + 1
    # 5. a checkpoint or a stored tree beyond the end: the tail was cut off.
    row = conn.execute("SELECT MAX(idx) FROM merkle_nodes WHERE level = 0").fetchone()
    leaves = 0 if row[0] is None else int(row[0]) + 1
    if leaves > cr.size:
        report.fail(cr.size + 1, f"the log ends at event {cr.size} but its tree has {leaves} leaves (truncated)")
    if next_cp < len(cps):
        report.fail(cr.size + 1, f"the log ends at event {cr.size} but a checkpoint covers {cps[-1].size} (truncated)")
    return report


def _stored_node(conn: sqlite3.Connection, level: int, index: int) -> bytes | None:
    row = conn.execute("SELECT hash FROM merkle_nodes WHERE level = ? AND idx = ?", (level, index)).fetchone()
    return None if row is None else bytes(row[0])


@dataclass(frozen=True)
class VerifiedProof:
    event: dict[str, Any]
    seq: int
    checkpoint: Checkpoint
    checkpoint_hash: bytes
    anchor: Mapping[str, Any] | None


class ProofBundleError(ValueError):
    pass


def verify_bundle(bundle: Mapping[str, Any], *, trusted_key: str | None = None) -> VerifiedProof:
    """Check a proof bundle with nothing else: leaf, inclusion path, checkpoint signature.

    ``trusted_key`` is the appliance's verifier key as the user knows it; without it the bundle's
    own key is used, which proves internal consistency only (said by the CLI).
    """
    if not isinstance(bundle, Mapping) or bundle.get("version") != BUNDLE_VERSION:
        raise ProofBundleError("not a version 1 proof bundle")
    try:
        event = bundle["event"]
        index = bundle["leaf_index"]
        path = [base64.b64decode(h, validate=True) for h in bundle["inclusion_path"]]
        note = bundle["checkpoint"]
        vkey = trusted_key or bundle["verifier_key"]
    except (KeyError, TypeError, binascii.Error) as exc:
        raise ProofBundleError(f"malformed bundle ({type(exc).__name__})") from None
    if not isinstance(event, dict) or not isinstance(index, int) or not isinstance(note, str):
        raise ProofBundleError("malformed bundle")
    if trusted_key and bundle.get("verifier_key") not in (None, trusted_key):
        raise ProofBundleError("the bundle was signed by another key than the one you trust")
    try:
        name, pub = parse_verifier_key(str(vkey))
        cp = Checkpoint.open(note, name, pub)
    except NoteError as exc:
        raise ProofBundleError(f"checkpoint: {exc}") from None
    if event.get("seq") != index + 1:
        raise ProofBundleError("the event's sequence number is not its leaf index + 1")
    try:
        _, leaf = event_leaf(event)
        merkle.verify_inclusion(index, cp.size, leaf, path, cp.root)
    except merkle.ProofError as exc:
        raise ProofBundleError(f"inclusion: {exc}") from None
    except UompError:
        raise ProofBundleError("the event cannot be canonicalised (RFC 8785)") from None
    anchor = bundle.get("anchor")
    if anchor is not None and not isinstance(anchor, Mapping):
        raise ProofBundleError("malformed anchor")
    return VerifiedProof(event, index + 1, cp, checkpoint_hash(note), anchor)
