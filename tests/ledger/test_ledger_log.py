"""The event log: append, checkpoint, proof bundles, retention, and `verify_log` naming the first
bad sequence number for every kind of tampering with the file."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway.core import merkle
from gateway.ledger.log import EventLog, LedgerError
from gateway.ledger.verify import ProofBundleError, verify_bundle, verify_log

ORIGIN = "uomp.test/audit"
KEY = Ed25519PrivateKey.generate()


def _conn(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    return conn


def _event(i: int, **extra: object) -> dict[str, object]:
    return {
        "id": f"evt_{i:04d}",
        "ts": 1_790_000_000 + i,
        "action": "read",
        "session_id": f"sess_{i % 3}",
        "agent_id": "agent_a",
        "allowed": i % 4 != 0,
        "reason": "granted",
        "key": f"k{i}",
        **extra,
    }


def build(path: Path, n: int = 40, every: int = 10) -> EventLog:
    log = EventLog(_conn(path), origin=ORIGIN, key=KEY)
    for start in range(0, n, every):
        log.conn.execute("BEGIN IMMEDIATE")
        log.append([_event(i) for i in range(start, min(start + every, n))])
        log.checkpoint(now=1_790_000_000 + start)
        log.conn.execute("COMMIT")
    return log


def test_append_assigns_gap_free_sequence_and_checkpoints_verify(tmp_path: Path) -> None:
    log = build(tmp_path / "a.db")
    assert log.size == 40
    seqs = [r[0] for r in log.conn.execute("SELECT seq FROM ledger_events ORDER BY seq")]
    assert seqs == list(range(1, 41))
    report = verify_log(log.conn, origin=ORIGIN, public_key=KEY.public_key())
    assert report.ok and report.events == 40 and report.checkpoints == 4, report.problems


def test_no_new_checkpoint_without_new_events(tmp_path: Path) -> None:
    log = build(tmp_path / "a.db", n=10)
    log.conn.execute("BEGIN IMMEDIATE")
    assert log.checkpoint(now=1) is None
    log.conn.execute("COMMIT")


def test_proof_bundle_verifies_alone_and_tampering_fails(tmp_path: Path) -> None:
    log = build(tmp_path / "a.db")
    bundle = json.loads(json.dumps(log.proof_bundle("evt_0017")))
    proof = verify_bundle(bundle, trusted_key=log.verifier_key())
    assert proof.seq == 18 and proof.event["key"] == "k17" and proof.checkpoint.size == 20
    bad: list[Callable[[dict], None]] = [
        lambda b: b["event"].__setitem__("allowed", not b["event"]["allowed"]),
        lambda b: b.__setitem__("leaf_index", b["leaf_index"] + 1),
        lambda b: b["inclusion_path"].reverse(),
        lambda b: b["inclusion_path"].pop(),
        lambda b: b.__setitem__("checkpoint", b["checkpoint"].replace("\n20\n", "\n21\n")),
        lambda b: b.__setitem__("version", 2),
        lambda b: b.pop("event"),
    ]
    for mutate in bad:
        copy = json.loads(json.dumps(bundle))
        mutate(copy)
        with pytest.raises(ProofBundleError):
            verify_bundle(copy, trusted_key=log.verifier_key())
    other = EventLog(_conn(tmp_path / "b.db"), origin=ORIGIN, key=Ed25519PrivateKey.generate())
    with pytest.raises(ProofBundleError):
        verify_bundle(bundle, trusted_key=other.verifier_key())


def test_proof_pending_and_unknown(tmp_path: Path) -> None:
    log = build(tmp_path / "a.db", n=10)
    log.conn.execute("BEGIN IMMEDIATE")
    log.append([_event(99)])
    log.conn.execute("COMMIT")
    with pytest.raises(LedgerError) as e:
        log.proof_bundle("evt_0099")
    assert e.value.code == "PROOF_PENDING"
    with pytest.raises(LedgerError) as e:
        log.proof_bundle("evt_nope")
    assert e.value.code == "NOT_FOUND"


def test_pruned_bodies_keep_old_proofs_and_verify(tmp_path: Path) -> None:
    log = build(tmp_path / "a.db")
    bundle = log.proof_bundle("evt_0003")
    log.conn.execute("BEGIN IMMEDIATE")
    assert log.prune_bodies(before_ts=1_790_000_000 + 15) == 15
    log.conn.execute("COMMIT")
    verify_bundle(bundle, trusted_key=log.verifier_key())
    report = verify_log(log.conn, origin=ORIGIN, public_key=KEY.public_key())
    assert report.ok and report.pruned == 15, report.problems
    with pytest.raises(LedgerError):
        log.proof_bundle("evt_0003")


def _sql(*stmts: str) -> Callable[[sqlite3.Connection], None]:
    def run(conn: sqlite3.Connection) -> None:
        for s in stmts:
            conn.execute(s)

    return run


def _edit_body(
    seq: int, field: str, value: object, *, fix_leaf: bool = False, fix_node: bool = False
) -> Callable[[sqlite3.Connection], None]:
    def run(conn: sqlite3.Connection) -> None:
        body = json.loads(conn.execute("SELECT body FROM ledger_events WHERE seq = ?", (seq,)).fetchone()[0])
        body[field] = value
        from gateway.ledger.log import event_leaf

        raw, leaf = event_leaf(body)
        conn.execute("UPDATE ledger_events SET body = ? WHERE seq = ?", (raw.decode(), seq))
        if fix_leaf:
            conn.execute("UPDATE ledger_events SET leaf = ? WHERE seq = ?", (leaf, seq))
        if fix_node:
            conn.execute("UPDATE merkle_nodes SET hash = ? WHERE level = 0 AND idx = ?", (leaf, seq - 1))

    return run


def _swap(a: int, b: int) -> Callable[[sqlite3.Connection], None]:
    def run(conn: sqlite3.Connection) -> None:
        ra = conn.execute("SELECT body, leaf FROM ledger_events WHERE seq = ?", (a,)).fetchone()
        rb = conn.execute("SELECT body, leaf FROM ledger_events WHERE seq = ?", (b,)).fetchone()
        conn.execute("UPDATE ledger_events SET body = ?, leaf = ? WHERE seq = ?", (rb[0], rb[1], a))
        conn.execute("UPDATE ledger_events SET body = ?, leaf = ? WHERE seq = ?", (ra[0], ra[1], b))

    return run


def _insert_after(seq: int) -> Callable[[sqlite3.Connection], None]:
    def run(conn: sqlite3.Connection) -> None:
        # Shift everything after `seq` up by one and slip a forged event in.
        conn.execute("UPDATE ledger_events SET seq = -seq WHERE seq > ?", (seq,))
        conn.execute("UPDATE ledger_events SET seq = -seq + 1 WHERE seq < 0")
        from gateway.ledger.log import event_leaf

        body = {**_event(500), "seq": seq + 1}
        raw, leaf = event_leaf(body)
        conn.execute(
            "INSERT INTO ledger_events (seq, id, ts, action, body, leaf) VALUES (?, ?, ?, ?, ?, ?)",
            (seq + 1, "evt_forged", 1.0, "read", raw.decode(), leaf),
        )

    return run


TAMPERING = [
    pytest.param(_edit_body(13, "allowed", True), 13, id="changed-body"),
    pytest.param(_edit_body(13, "allowed", True, fix_leaf=True), 13, id="changed-body-and-leaf"),
    pytest.param(_edit_body(13, "allowed", True, fix_leaf=True, fix_node=True), 13, id="changed-body-leaf-node"),
    pytest.param(_sql("DELETE FROM ledger_events WHERE seq = 22"), 22, id="deleted-event"),
    pytest.param(_swap(5, 6), 5, id="reordered"),
    pytest.param(_insert_after(30), 31, id="inserted-event"),
    pytest.param(
        _sql("DELETE FROM ledger_events WHERE seq > 35", "DELETE FROM merkle_nodes WHERE idx >= 35 AND level = 0"),
        36,
        id="truncated-tail",
    ),
    pytest.param(
        _sql("UPDATE ledger_checkpoints SET note = replace(note, 'timestamp', 'timestamq') WHERE size = 30"),
        21,
        id="checkpoint-edited",
    ),
]


@pytest.mark.parametrize(("tamper", "first_bad"), TAMPERING)
def test_tampering_is_found_with_its_first_bad_sequence(
    tmp_path: Path, tamper: Callable[[sqlite3.Connection], None], first_bad: int
) -> None:
    log = build(tmp_path / "a.db")
    tamper(log.conn)
    report = verify_log(log.conn, origin=ORIGIN, public_key=KEY.public_key())
    assert not report.ok
    assert report.first_bad_seq == first_bad, report.problems


def test_log_signed_by_another_key_fails(tmp_path: Path) -> None:
    log = build(tmp_path / "a.db", n=10)
    report = verify_log(log.conn, origin=ORIGIN, public_key=Ed25519PrivateKey.generate().public_key())
    assert not report.ok and report.first_bad_seq == 1


def test_reopen_continues_the_same_tree(tmp_path: Path) -> None:
    build(tmp_path / "a.db", n=25)
    log = EventLog(_conn(tmp_path / "a.db"), origin=ORIGIN, key=KEY)
    log.conn.execute("BEGIN IMMEDIATE")
    log.append([_event(i) for i in range(25, 31)])
    log.checkpoint(now=5)
    log.conn.execute("COMMIT")
    ref = merkle.MemoryTree()
    for (leaf,) in log.conn.execute("SELECT leaf FROM ledger_events ORDER BY seq"):
        ref.append(bytes(leaf))
    assert log.tree.root() == ref.root()
    assert verify_log(log.conn, origin=ORIGIN, public_key=KEY.public_key()).ok


@pytest.mark.parametrize("after", [0, 20])
def test_verify_reads_one_snapshot_while_the_log_grows(tmp_path: Path, after: int) -> None:
    """A verify of a live log (the guard's background verify, `uomp audit verify` beside a running
    guard) sees one state: another connection committing between any two of its statements must
    not show a longer tree, a newer checkpoint or more events than the rows it checked."""
    path = tmp_path / "live.db"
    writer = build(path, n=40, every=10)
    reader = _conn(path)
    grown = [40]

    def append_now(sql: str) -> None:  # runs as each statement of the verify starts
        start = grown[0]
        writer.conn.execute("BEGIN IMMEDIATE")
        writer.append([_event(i) for i in range(start, start + 3)])
        writer.checkpoint(now=1_790_000_000 + start)
        writer.conn.execute("COMMIT")
        grown[0] += 3

    reader.set_trace_callback(append_now)
    report = verify_log(reader, origin=ORIGIN, public_key=KEY.public_key(), after=after)
    reader.set_trace_callback(None)
    assert grown[0] > 40 + 3  # the writer did commit between the verify's statements
    assert report.ok, report.problems
    assert report.events + after in range(40, grown[0] + 1)
    final = verify_log(reader, origin=ORIGIN, public_key=KEY.public_key())
    assert final.ok and final.events == grown[0], final.problems


@pytest.mark.parametrize("after", [0, 5, 10, 20, 39, 40])
def test_a_tail_check_may_start_at_a_checkpoint_or_between_two(tmp_path: Path, after: int) -> None:
    """The start-up check verifies the events after ``after``; a checkpoint of exactly that many
    events (10, 20, 40 here) is checked against the stored edge, not reported as beyond the log."""
    log = build(tmp_path / "a.db", n=40, every=10)
    report = verify_log(log.conn, origin=ORIGIN, public_key=KEY.public_key(), after=after)
    assert report.ok and report.events == 40 - after, report.problems
    # the denied partner: that checkpoint's root replaced by another's is found
    if after in (10, 20):
        other = log.conn.execute("SELECT note FROM ledger_checkpoints WHERE size = 30").fetchone()[0]
        log.conn.execute("UPDATE ledger_checkpoints SET note = ? WHERE size = ?", (other, after))
        bad = verify_log(log.conn, origin=ORIGIN, public_key=KEY.public_key(), after=after)
        assert not bad.ok
