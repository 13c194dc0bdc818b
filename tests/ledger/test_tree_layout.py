"""The stored Merkle tree's layout: nodes keyed by the leaf that completes them, so a commit writes at
the end of one B-tree (few pages, each one encrypted and authenticated again in a sealed home), and a
log written in the older per-level layout is converted in one transaction, read as it is when it
cannot be, and survives a crash in the middle of the conversion."""

from __future__ import annotations

import os
import sqlite3
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from gateway.atrest import memdb
from gateway.ledger import tree
from gateway.ledger.log import EventLog
from gateway.ledger.verify import verify_log

ORIGIN = "uomp.test/audit"
KEY = Ed25519PrivateKey.generate()
SQLCIPHER_KEY = bytes(range(32))


def _conn(path: Path, sealed: bool = False) -> sqlite3.Connection:
    conn: sqlite3.Connection
    if sealed:
        conn = memdb.connect(str(path), SQLCIPHER_KEY, isolation_level=None)
    else:
        conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    return conn


def _event(i: int) -> dict[str, object]:
    return {
        "id": f"evt_{i:06d}",
        "ts": 1_790_000_000 + i,
        "action": "read",
        "session_id": f"sess_{i % 3}",
        "agent_id": "agent_a",
        "allowed": True,
        "reason": "granted",
        "key": f"k{i}",
    }


def _append(log: EventLog, start: int, n: int, checkpoint: bool = False) -> None:
    log.conn.execute("BEGIN IMMEDIATE")
    log.append([_event(i) for i in range(start, start + n)])
    if checkpoint:
        log.checkpoint(now=1_790_000_000 + start)
    log.conn.execute("COMMIT")


def build(path: Path, n: int, sealed: bool = False) -> EventLog:
    log = EventLog(_conn(path, sealed), origin=ORIGIN, key=KEY)
    for start in range(0, n, 250):
        _append(log, start, min(250, n - start), checkpoint=True)
    return log


def to_legacy(conn: sqlite3.Connection) -> None:
    """Rewrite the table as the older per-level layout wrote it."""
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "CREATE TABLE old_nodes (level INTEGER NOT NULL, idx INTEGER NOT NULL, hash BLOB NOT NULL, "
        "PRIMARY KEY (level, idx)) WITHOUT ROWID"
    )
    conn.execute("INSERT INTO old_nodes SELECT level, idx, hash FROM merkle_nodes")
    conn.execute("DROP TABLE merkle_nodes")
    conn.execute("ALTER TABLE old_nodes RENAME TO merkle_nodes")
    conn.execute("COMMIT")


def tree_pages_per_commit(path: Path, commits: int) -> float:
    """The tree's pages among the WAL frames the last ``commits`` commits wrote (frame headers name
    the page; ``dbstat`` names the table that owns it)."""
    raw = Path(str(path) + "-wal").read_bytes()
    page_size = struct.unpack(">I", raw[8:12])[0]
    conn = sqlite3.connect(path)
    owner = {int(r[1]): str(r[0]) for r in conn.execute("SELECT name, pageno FROM dbstat")}
    conn.close()
    per_commit: list[int] = []
    count, off = 0, 32
    while off + 24 + page_size <= len(raw):
        page, commit_size = struct.unpack(">II", raw[off : off + 8])
        count += owner.get(page) == "merkle_nodes"
        if commit_size:
            per_commit.append(count)
            count = 0
        off += 24 + page_size
    assert len(per_commit) == commits
    return sum(per_commit) / commits


def test_a_commit_writes_the_tree_at_its_end(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    log = build(path, 6000)
    log.conn.execute("PRAGMA wal_autocheckpoint = 0")
    log.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for c in range(20):
        _append(log, 6000 + 15 * c, 15)
    # keyed by (level, idx), every commit rewrote the right-most page of each level: ~13 pages here (3-4 now)
    assert tree_pages_per_commit(path, 20) <= 5
    assert verify_log(log.conn, origin=ORIGIN, public_key=KEY.public_key()).ok


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sqlcipher"])
def test_a_legacy_table_is_converted_once_with_the_same_roots(tmp_path: Path, sealed: bool) -> None:
    path = tmp_path / "a.db"
    log = build(path, 777, sealed)
    roots = {s: log.tree.root(s) for s in (1, 2, 3, 100, 511, 512, 777)}
    proof = log.tree.inclusion_proof(300, 777)
    to_legacy(log.conn)
    log.conn.close()

    conn = _conn(path, sealed)
    assert tree.layout(conn) == tree.LEGACY_LAYOUT
    reopened = EventLog(conn, origin=ORIGIN, key=KEY)
    assert tree.layout(conn) == tree.LAYOUT
    assert {s: reopened.tree.root(s) for s in roots} == roots
    assert reopened.tree.inclusion_proof(300, 777) == proof
    assert verify_log(conn, origin=ORIGIN, public_key=KEY.public_key()).ok
    assert tree.convert_layout(conn) is False  # once
    _append(reopened, 777, 30, checkpoint=True)
    assert verify_log(conn, origin=ORIGIN, public_key=KEY.public_key()).ok


def test_a_read_only_open_reads_a_legacy_table_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    log = build(path, 300)
    root = log.tree.root()
    to_legacy(log.conn)
    log.conn.close()
    ro = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, isolation_level=None)
    opened = EventLog(ro, origin=ORIGIN, key=KEY)
    assert tree.layout(ro) == tree.LEGACY_LAYOUT  # not converted
    assert opened.tree.root() == root and tree.leaf_count(ro) == 300
    assert verify_log(ro, origin=ORIGIN, public_key=KEY.public_key()).ok


def test_a_damaged_tree_is_still_named_in_both_layouts(tmp_path: Path) -> None:
    for legacy in (False, True):
        path = tmp_path / f"d{legacy}.db"
        log = build(path, 300)
        if legacy:
            to_legacy(log.conn)
        log.conn.execute("UPDATE merkle_nodes SET hash = zeroblob(32) WHERE level = 2 AND idx = 10")
        report = verify_log(log.conn, origin=ORIGIN, public_key=KEY.public_key())
        assert not report.ok, legacy
        log.conn.close()


KILLED_CONVERSION = textwrap.dedent(
    """
    import os, sqlite3, sys
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from gateway.ledger.log import EventLog
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    steps = 0
    def die():
        global steps
        steps += conn.in_transaction  # only the conversion opens a transaction in EventLog()
        if steps > int(sys.argv[2]):
            os._exit(9)  # the process ends here, inside the conversion's transaction
        return 0
    conn.set_progress_handler(die, 1000)
    EventLog(conn, origin="uomp.test/audit", key=load_pem_private_key(open(sys.argv[3], "rb").read(), None))
    os._exit(0)
    """
)


def test_a_crash_during_the_conversion_leaves_the_old_table(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    log = build(path, 3000)
    root = log.tree.root()
    to_legacy(log.conn)
    log.conn.close()
    key_file = tmp_path / "k.pem"
    key_file.write_bytes(KEY.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", KILLED_CONVERSION, str(path), "20", str(key_file)], env=env, timeout=60
    )
    assert done.returncode == 9
    conn = sqlite3.connect(path, isolation_level=None)
    assert tree.layout(conn) == tree.LEGACY_LAYOUT  # the old state, whole
    assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} >= {"merkle_nodes"}
    reopened = EventLog(conn, origin=ORIGIN, key=KEY)  # then the conversion, whole
    assert tree.layout(conn) == tree.LAYOUT
    assert reopened.tree.root() == root
    assert verify_log(conn, origin=ORIGIN, public_key=KEY.public_key()).ok
