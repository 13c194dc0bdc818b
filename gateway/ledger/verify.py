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
5. neither the newest checkpoint nor the stored tree may be larger than the log (a cut-off tail);
6. every index column of ``ledger_events`` (``id``, ``ts``, ``action``, ``session_id``,
   ``agent_id``, ``allowed``, ``code``: what the readers filter on) holds what the body says;
7. the log extends every *trusted* checkpoint, one known from outside ``audit.db``: the witness
   record (:mod:`gateway.ledger.integrity`), and whatever a caller adds (an anchor read from the
   chain, a checkpoint the user kept) through ``trusted``. A trusted size beyond the log's end is a
   rollback or truncation (the first missing event is reported); a different root at a trusted
   size is a fork or a replaced file;
8. checkpoint times (warnings, not failures: a clock is not part of the log's integrity): a
   checkpoint dated before the previous one (signers clamp to it), or more than
   :data:`CLOCK_JUMP_SECONDS` after both the previous checkpoint and the first event it is the
   first to cover (the clock jumped forward between them: a checkpoint is due within
   ``audit_checkpoint_seconds`` of that event; a long idle time before the event is not a jump).

A database that cannot be read (truncated, not SQLite, a damaged page) is a finding with the first
event that could not be read, never an exception.

Anchors are checked by the caller against the chain (see ``gateway.anchor``): an anchored root is
the one thing an attacker holding the appliance's disk and key cannot rewrite.
"""

from __future__ import annotations

import base64
import binascii
import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gateway import sqldriver
from gateway.core import merkle
from gateway.core.checkpoint import MAX_NOTE_BYTES, Checkpoint, NoteError, parse_verifier_key
from gateway.errors import UompError
from gateway.ledger import tree as stored_tree
from gateway.ledger.log import BUNDLE_VERSION, INDEX_COLUMNS, checkpoint_hash, event_leaf, index_values

CLOCK_JUMP_SECONDS = 600  # a checkpoint this far after the first event it is the first to cover: the clock jumped


def check_anchored_head(conn: sqlite3.Connection, size: int, root: bytes) -> str | None:
    """The stored log against a tree head read from the chain (its newest anchor): None when the
    log holds ``size`` events and its root at ``size`` is ``root``, else what is wrong. Run after
    :func:`verify_log` (which checks the stored tree against the leaves)."""
    from gateway.ledger.tree import TreeStore

    try:
        tree = TreeStore(conn)
        if tree.size < size:
            return (
                f"the chain anchors a checkpoint of {size} events but the log holds {tree.size}: rolled back or "
                f"truncated (first missing size {tree.size + 1})"
            )
        if tree.root(size) != root:
            return f"the log's root at size {size} is not the one anchored on chain: a second history"
    except sqldriver.errors(merkle.ProofError) as exc:
        return f"the log cannot be checked against the chain's anchor of size {size}: {exc}"
    return None


@dataclass
class Report:
    """What a verify found: counts, the first bad event, the problems and the warnings."""

    ok: bool = True
    events: int = 0
    pruned: int = 0
    checkpoints: int = 0
    signatures: int = 0  # checkpoint signatures verified (every checkpoint's, unless ``signed_from``)
    first_bad_seq: int | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # findings that do not make the log untrustworthy
    damaged: bool = False  # the log fails its own checks (as opposed to disagreeing with a trusted checkpoint)
    inconsistent: bool = False  # the log is not consistent with a trusted checkpoint (witness, anchor)

    def fail(self, seq: int | None, problem: str, *, upto: int | None = None, inconsistent: bool = False) -> None:
        """Record a problem at ``seq`` (or somewhere in ``seq..upto``).

        A range that already contains a more precise finding does not move ``first_bad_seq``: a
        changed event also changes every subtree and checkpoint above it.
        """
        self.ok = False
        if inconsistent:
            self.inconsistent = True
        else:
            self.damaged = True
        known = self.first_bad_seq
        if seq is not None and (known is None or (seq < known and (upto is None or upto < known))):
            self.first_bad_seq = seq
        if len(self.problems) < 20:
            self.problems.append(problem)

    def warn(self, text: str) -> None:
        if len(self.warnings) < 20:
            self.warnings.append(text)


@dataclass(frozen=True)
class TrustedCheckpoint:
    """A checkpoint known from outside ``audit.db`` (the witness record, an anchor read from a chain,
    a checkpoint an agent or the user kept): the log must extend it."""

    size: int
    root: bytes
    source: str  # what it is, for the report ("the witness record", "the anchor in block 12")


def index_mismatch(row: Sequence[Any], body: Mapping[str, Any]) -> str | None:
    """The first index column of ``row`` (in :data:`INDEX_COLUMNS` order) that does not hold what
    the event's canonical body says, or None."""
    try:
        want = index_values(body)
    except (KeyError, TypeError, ValueError):
        return "id"  # a body without its indexed fields
    for name, have, should in zip(INDEX_COLUMNS, row, want, strict=True):
        if have != should or type(have) is not type(should):
            return name
    return None


def verify_log(
    conn: sqlite3.Connection,
    *,
    origin: str,
    public_key: Ed25519PublicKey,
    trusted: Sequence[TrustedCheckpoint] = (),
    after: int = 0,
    signed_from: int = 0,
) -> Report:
    """Check the log; an unreadable database is a finding (the first event it cannot read), never an
    exception. ``trusted``: checkpoints from outside ``audit.db`` the log must be consistent with.
    ``after``: check only the events after that many (the start-up check): the O(log n) stored
    nodes of the prefix are taken as they are, and are proven by the newest checkpoint's root.
    ``signed_from``: the signatures of checkpoints of fewer events are not verified (the start-up
    check: their notes are parsed and their roots compared with the recomputed tree as every other's;
    the newest checkpoints' signatures vouch for the roots the tree ends in).

    The whole check reads one snapshot: the caller's transaction, or a read transaction of its own
    (WAL), so a log that grows meanwhile (a running guard, the CLI) is checked as it was when the
    check began, never its events from one moment and its tree or checkpoints from a later one."""
    report = Report()
    own = False
    try:
        if not conn.in_transaction:
            conn.execute("BEGIN")
            own = True
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # the snapshot starts here
        _verify(conn, report, origin, public_key, trusted, after, signed_from)
    except sqldriver.database_errors(merkle.ProofError) as exc:
        seq = report.first_bad_seq or (after + report.events + 1)
        report.fail(
            seq, f"audit.db cannot be read from event {seq} on ({type(exc).__name__}: {exc}): truncated or damaged"
        )
    finally:
        if own and conn.in_transaction:
            conn.execute("ROLLBACK")
    return report


def _verify(
    conn: sqlite3.Connection,
    report: Report,
    origin: str,
    public_key: Ed25519PublicKey,
    trusted: Sequence[TrustedCheckpoint],
    after: int,
    signed_from: int = 0,
) -> None:
    # 1. checkpoints, oldest first.
    cps: list[Checkpoint] = []
    prev_size = 0
    prev_cp: Checkpoint | None = None
    for size, note in conn.execute("SELECT size, note FROM ledger_checkpoints WHERE size >= ? ORDER BY size", (after,)):
        try:
            if int(size) < signed_from:  # the text up to the signature block, not its characters one by one
                text = str(note)
                cut = text.rfind("\n\n")
                if cut < 0 or len(text.encode()) > MAX_NOTE_BYTES:
                    raise NoteError("checkpoint note is malformed")
                cp = Checkpoint.parse(text[: cut + 1])
                if cp.origin != origin:
                    raise NoteError("checkpoint origin is not the signer's name")
            else:
                cp = Checkpoint.open(str(note), origin, public_key)
                report.signatures += 1
        except NoteError as exc:
            report.fail(prev_size + 1, f"checkpoint after event {prev_size}: {exc}")
            continue
        if cp.size != int(size):
            report.fail(prev_size + 1, f"the checkpoint stored at size {size} signs size {cp.size}")
            continue
        if prev_cp is not None and cp.timestamp < prev_cp.timestamp:
            report.warn(
                f"checkpoint at {cp.size} events is dated {cp.timestamp - prev_cp.timestamp} s before the "
                "previous one (the clock stepped back)"
            )
        cps.append(cp)
        prev_size, prev_cp = cp.size, cp
    report.checkpoints = len(cps)
    trust = sorted(trusted, key=lambda t: t.size)
    next_cp = 0
    next_trusted = 0
    last_good_cp = after
    first_ts: float | None = None  # time of the first event after the previous checkpoint
    prev_cp_size = after
    prev_stamp: int | None = None  # the previous checkpoint's timestamp

    # The events before ``after`` as the stored right edge of their tree (proven by the checkpoint roots below).
    edge: dict[tuple[int, int], bytes] = {}
    start_edge: list[tuple[int, bytes]] = []
    for level in range(after.bit_length() - 1, -1, -1):
        if after >> level & 1:
            i = (after >> level) - 1
            h = _stored_node(conn, level, i)
            if h is None:
                raise merkle.ProofError(f"merkle node {level}/{i} is missing")
            edge[(level, i)] = h
            start_edge.append((level, h))
    cr = merkle.CompactRange.from_edge(after, start_edge)
    # Stored nodes in the order appends create them (a node completes with leaf ((idx + 1) << level) - 1):
    # one sorted pass for the whole log; a tail (``after``) looks each node up by its key instead (the
    # sort would walk every node of the log).
    stored = stored_tree.nodes_in_append_order(conn) if after == 0 else conn.execute("SELECT 0, 0, x'' WHERE 0")
    ahead = stored.fetchone()
    while next_trusted < len(trust) and trust[next_trusted].size <= after:  # below ``after``: the caller's
        t = trust[next_trusted]
        if t.size == after and cr.root() != t.root:
            report.fail(
                after,
                f"the log's first {after} events are not the ones {t.source} signed (forked or replaced)",
                inconsistent=True,
            )
        next_trusted += 1
    # A checkpoint of exactly the first ``after`` events signs the stored edge itself.
    while next_cp < len(cps) and cps[next_cp].size == after:
        cp = cps[next_cp]
        if cr.root() != cp.root:
            report.fail(after, f"checkpoint at {after} events does not match the stored tree", upto=after)
        prev_cp_size, prev_stamp = cp.size, cp.timestamp
        next_cp += 1
    expected = after + 1
    rows = conn.execute(
        "SELECT seq, id, ts, action, session_id, agent_id, allowed, code, body, leaf"
        " FROM ledger_events WHERE seq > ? ORDER BY seq",
        (after,),
    )
    for seq, *index, body, leaf in rows:
        # 2. no gap, no reordering.
        if seq != expected:
            report.fail(expected, f"event {expected} is missing (next is {seq})")
            expected = seq
        leaf = bytes(leaf)
        if first_ts is None and isinstance(index[1], int | float):
            first_ts = float(index[1])
        if body is None:
            report.pruned += 1
        else:
            # 3. the stored body (canonical bytes as appended) hashes to its leaf, names its own
            # place, and every index column holds what the body says.
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
                elif (column := index_mismatch(index, parsed)) is not None:
                    report.fail(seq, f"event {seq}'s {column} column does not hold what its body says (edited index)")
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
            cp = cps[next_cp]
            if cr.root() != cp.root:
                report.fail(
                    last_good_cp + 1,
                    f"checkpoint at {cr.size} events does not match the log (changed in {last_good_cp + 1}-{cr.size})",
                    upto=cr.size,
                )
            else:
                last_good_cp = cr.size
            ref = max(first_ts if first_ts is not None else cp.timestamp, prev_stamp or 0)
            if cp.timestamp - ref > CLOCK_JUMP_SECONDS:
                report.warn(
                    f"checkpoint at {cp.size} events is dated {cp.timestamp - ref:.0f} s after both the "
                    f"previous checkpoint and the first event it covers since {prev_cp_size} (more than "
                    f"{CLOCK_JUMP_SECONDS} s: the clock jumped forward)"
                )
            first_ts, prev_cp_size, prev_stamp = None, cp.size, cp.timestamp
            next_cp += 1
        while next_trusted < len(trust) and trust[next_trusted].size <= cr.size:
            t = trust[next_trusted]
            if t.size == cr.size and cr.root() != t.root:
                report.fail(
                    t.size,
                    f"the log's first {t.size} events are not the ones {t.source} signed (forked or "
                    f"replaced at or before event {t.size})",
                    inconsistent=True,
                )
            next_trusted += 1
        expected = seq + 1
    # 5. a checkpoint or a stored tree beyond the end: the tail was cut off.
    leaves = stored_tree.leaf_count(conn)
    if leaves > cr.size:
        report.fail(cr.size + 1, f"the log ends at event {cr.size} but its tree has {leaves} leaves (truncated)")
    if next_cp < len(cps):
        report.fail(cr.size + 1, f"the log ends at event {cr.size} but a checkpoint covers {cps[-1].size} (truncated)")
    for t in trust[next_trusted:]:
        if t.size > cr.size:
            report.fail(
                cr.size + 1,
                f"the log ends at event {cr.size} but {t.source} signed {t.size} events: "
                f"events {cr.size + 1}-{t.size} are gone (rolled back, truncated or replaced)",
                inconsistent=True,
            )
            break
        if t.size == 0 and t.root != merkle.EMPTY_ROOT:
            report.fail(1, f"{t.source} is not a tree of 0 events", inconsistent=True)


def _stored_node(conn: sqlite3.Connection, level: int, index: int) -> bytes | None:
    return stored_tree.read_node(conn, level, index, stored_tree.layout(conn))


@dataclass(frozen=True)
class VerifiedProof:
    """A proof bundle that checked out: the event, its place, the checkpoint and anchor it rests on."""

    event: dict[str, Any]
    seq: int
    checkpoint: Checkpoint
    checkpoint_hash: bytes
    anchor: Mapping[str, Any] | None


class ProofBundleError(ValueError):
    """A proof bundle that does not check out (the message says which part)."""

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
