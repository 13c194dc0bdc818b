"""The verifiable event log: append-only events, their Merkle tree and signed checkpoints, in one
SQLite file so that an event, its tree nodes and its checkpoint commit together.

* Every event gets the next sequence number (1, 2, 3, ... without gaps); its leaf is
  ``SHA-256(0x00 || JCS(event))`` (RFC 8785 canonical JSON of the event *including* ``seq``), its
  leaf index is ``seq - 1``.
* A checkpoint is a C2SP signed note (``gateway.core.checkpoint``) over ``(origin, size, root,
  timestamp)``, signed with the appliance's audit key; each new one is checked consistent with the
  previous one before it is stored.
* Retention prunes an event's *body* (set to NULL) and keeps its leaf hash and tree nodes, so every
  proof issued before still verifies and the tree never changes shape.

This class does no locking and no asyncio: the caller owns the connection, runs each method
inside its own transaction (``append`` and ``checkpoint`` must be inside ``BEGIN IMMEDIATE``), and
calls :meth:`EventLog.reload` after a rollback. Verification lives in :mod:`gateway.ledger.verify`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sqlite3
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gateway.core import merkle
from gateway.core.canonical import canonical_json
from gateway.core.checkpoint import Checkpoint, verifier_key
from gateway.errors import ErrorCode, UompError
from gateway.ledger.tree import TreeStore, insert_rows

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_events (
  seq INTEGER PRIMARY KEY,
  id TEXT NOT NULL UNIQUE,
  ts REAL NOT NULL,
  action TEXT NOT NULL,
  session_id TEXT,
  agent_id TEXT,
  allowed INTEGER,
  code TEXT,
  body TEXT,
  leaf BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_ledger_session ON ledger_events(session_id, seq);
CREATE INDEX IF NOT EXISTS idx_ledger_ts ON ledger_events(ts);
CREATE TABLE IF NOT EXISTS ledger_checkpoints (
  size INTEGER PRIMARY KEY,
  ts REAL NOT NULL,
  note TEXT NOT NULL
);
"""

# The anchoring backlog (gateway.ledger.anchoring drains it): a checkpoint is queued in the same
# transaction that stores it, so none is ever lost between signing and anchoring.
ANCHOR_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_anchors (
  size INTEGER PRIMARY KEY,
  checkpoint_hash BLOB NOT NULL,
  backend TEXT NOT NULL,
  state TEXT NOT NULL,
  ref TEXT,
  nonce INTEGER,
  block_number INTEGER,
  confirmations INTEGER NOT NULL DEFAULT 0,
  attempts INTEGER NOT NULL DEFAULT 0,
  next_at REAL NOT NULL,
  last_error TEXT,
  queued_at REAL NOT NULL,
  done_at REAL,
  events_fixed INTEGER NOT NULL DEFAULT 0  -- 1: the §18.4.1 facts it carries are fixed (gateway.ledger.anchoring)
);
CREATE INDEX IF NOT EXISTS idx_anchor_state ON ledger_anchors(state, next_at);
"""

BUNDLE_VERSION = 1
MAX_PRUNE_PARAMS = 500  # events per UPDATE of a retention slice (bound variables)


class LedgerError(UompError):
    """A request the log cannot answer (unknown event, event not yet in a checkpoint, no key, a
    log whose events and tree disagree). A :class:`UompError`: ``message`` is the sentence alone;
    the guard maps it to the code a reader or writer answers (``guard.audit.ledger_refusal``)."""


@dataclass(frozen=True)
class Appended:
    """One appended event: its sequence number, id and leaf hash."""

    seq: int
    id: str
    leaf: bytes


def event_leaf(body: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """(canonical bytes, leaf hash) of an event body that already carries its ``seq``."""
    raw = canonical_json(dict(body))
    return raw, merkle.leaf_hash(raw)


INDEX_COLUMNS = ("id", "ts", "action", "session_id", "agent_id", "allowed", "code")


def index_values(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """What each of :data:`INDEX_COLUMNS` of ``ledger_events`` holds for an event body: the columns
    the readers filter on are copies of the body, checked by verify and on every read."""
    allowed = body.get("allowed")
    return (
        str(body["id"]),
        float(body["ts"]),
        str(body["action"]),
        body.get("session_id"),
        body.get("agent_id"),
        None if allowed is None else int(bool(allowed)),
        body.get("code"),
    )


def oldest_body_ts(conn: sqlite3.Connection) -> float | None:
    """The time of the oldest event that still has its body (None: none has)."""
    row = conn.execute("SELECT MIN(ts) FROM ledger_events WHERE body IS NOT NULL").fetchone()
    return None if row[0] is None else float(row[0])


def checkpoint_hash(note: str) -> bytes:
    """What an anchor commits to: SHA-256 of the signed note's UTF-8 bytes."""
    return hashlib.sha256(note.encode()).digest()


class EventLog:
    """The Merkle event log in ``audit.db``: gap-free appends, signed checkpoints, proofs."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        origin: str,
        key: Ed25519PrivateKey | None,
        anchor_backend: str | None = None,
        check: bool = True,
    ) -> None:
        self.conn = conn
        self.origin = origin
        self.key = key
        self.anchor_backend = anchor_backend  # None or "none": checkpoints are not queued for a chain
        conn.executescript(SCHEMA)
        conn.executescript(ANCHOR_SCHEMA)
        self.tree = TreeStore(conn)
        self._seen_version: int | None = None  # PRAGMA data_version when the state was last read
        self._last_cp: tuple[Checkpoint, str] | bool | None = False  # False: not read yet
        self.reload(check=check)

    # --------------------------------------------------------------------------- state

    def reload(self, *, check: bool = True) -> None:
        """``check=False``: a log whose events and tree disagree is opened all the same (for the
        caller's own check, :mod:`gateway.ledger.integrity`, to name what is wrong)."""
        self._seen_version = None
        self._last_cp = False
        version = self._data_version()
        self.tree.reload()
        row = self.conn.execute("SELECT MAX(seq) FROM ledger_events").fetchone()
        events = 0 if row[0] is None else int(row[0])
        if check and events != self.tree.size:
            raise LedgerError(
                ErrorCode.LOG_CORRUPT, f"the log has {events} events but its tree has {self.tree.size} leaves"
            )
        self._seen_version = version

    def _data_version(self) -> int:
        return int(self.conn.execute("PRAGMA data_version").fetchone()[0])

    def refresh(self) -> None:
        """:meth:`reload` if another connection (the CLI, another process) committed since this one
        last read its state; call it inside the write transaction (nobody else can commit then).
        ``PRAGMA data_version`` changes with every commit of *another* connection, never this one's,
        so a writer that is alone does not re-read the tree's edge for every batch."""
        if self._seen_version is None or self._data_version() != self._seen_version:
            self.reload()

    @property
    def size(self) -> int:
        return self.tree.size

    @property
    def public_key(self) -> Ed25519PublicKey | None:
        return None if self.key is None else self.key.public_key()

    def verifier_key(self) -> str:
        if self.key is None:
            raise LedgerError(ErrorCode.KEY_ERROR, "no audit signing key")
        return verifier_key(self.origin, self.key.public_key())

    # --------------------------------------------------------------------------- writing

    def append(self, events: list[Mapping[str, Any]]) -> list[Appended]:
        """Append events (each with at least ``id``, ``ts`` and ``action``) in the caller's transaction."""
        out: list[Appended] = []
        rows: list[tuple[Any, ...]] = []
        seq = self.tree.size
        for event in events:
            seq += 1
            body = {**event, "seq": seq}
            raw, leaf = event_leaf(body)
            rows.append((seq, *index_values(body), raw.decode(), leaf))
            out.append(Appended(seq, str(body["id"]), leaf))
        insert_rows(
            self.conn,
            "INSERT INTO ledger_events (seq, id, ts, action, session_id, agent_id, allowed, code, body, leaf) VALUES ",
            rows,
        )
        self.tree.append([a.leaf for a in out])
        return out

    def checkpoint(self, now: float) -> str | None:
        """Sign and store a checkpoint of the current size (in the caller's transaction).

        ``None`` when nothing was appended since the last one. The new tree is proven consistent
        with the last checkpoint before anything is signed. Its timestamp never goes backwards: a
        wall clock behind the last checkpoint's time (stepped back) gives that time again.
        """
        if self.key is None:
            raise LedgerError(ErrorCode.KEY_ERROR, "no audit signing key")
        last = self.latest_checkpoint()
        size = self.tree.size
        if last is not None and last[0].size >= size:
            return None
        root = self.tree.root(size)
        if last is not None:
            merkle.verify_consistency(
                last[0].size, size, last[0].root, root, self.tree.consistency_proof(last[0].size, size)
            )
        stamp = max(int(now), last[0].timestamp) if last is not None else int(now)
        note = Checkpoint(self.origin, size, root, stamp).sign(self.origin, self.key)
        self.store_checkpoint(note, max(now, float(stamp)))
        return note

    def store_checkpoint(self, note: str, now: float) -> None:
        """Store a signed checkpoint (and queue it for anchoring) in the caller's transaction."""
        size = Checkpoint.parse(note.split("\n\n")[0] + "\n").size
        self.conn.execute("INSERT INTO ledger_checkpoints (size, ts, note) VALUES (?, ?, ?)", (size, now, note))
        self._last_cp = False  # read again (the caller's transaction may still roll back: reload then)
        if self.anchor_backend and self.anchor_backend != "none":
            self.conn.execute(
                "INSERT OR IGNORE INTO ledger_anchors (size, checkpoint_hash, backend, state, next_at, queued_at)"
                " VALUES (?, ?, ?, 'queued', ?, ?)",
                (size, checkpoint_hash(note), self.anchor_backend, now, now),
            )

    def prune_bodies(self, before_ts: float) -> int:
        """Retention: forget event bodies older than ``before_ts``; leaves and nodes stay."""
        cur = self.conn.execute("UPDATE ledger_events SET body = NULL WHERE ts < ? AND body IS NOT NULL", (before_ts,))
        return int(cur.rowcount)

    def prune_slice(self, since_ts: float, before_ts: float, limit: int) -> tuple[int, float]:
        """:meth:`prune_bodies` for at most ``limit`` events with ``since_ts <= ts < before_ts``, oldest
        first (in the caller's transaction). Returns how many, and the ``since_ts`` of the next slice:
        the last pruned event's time, so a run of slices never walks the pruned ones again."""
        rows = self.conn.execute(
            "SELECT seq, ts FROM ledger_events WHERE ts >= ? AND ts < ? AND body IS NOT NULL ORDER BY ts LIMIT ?",
            (since_ts, before_ts, limit),
        ).fetchall()
        if not rows:
            return 0, since_ts
        for start in range(0, len(rows), MAX_PRUNE_PARAMS):
            chunk = rows[start : start + MAX_PRUNE_PARAMS]
            self.conn.execute(
                "UPDATE ledger_events SET body = NULL WHERE seq IN (" + ", ".join("?" * len(chunk)) + ")",
                [r[0] for r in chunk],
            )
        return len(rows), float(rows[-1][1])

    # --------------------------------------------------------------------------- reading

    def latest_checkpoint(self) -> tuple[Checkpoint, str] | None:
        """The newest checkpoint (cached until this log writes one or reloads)."""
        if self._last_cp is not False:
            return self._last_cp  # type: ignore[return-value]
        row = self.conn.execute("SELECT note FROM ledger_checkpoints ORDER BY size DESC LIMIT 1").fetchone()
        found = None
        if row is not None:
            note = str(row[0])
            found = Checkpoint.parse(note.split("\n\n")[0] + "\n"), note
        self._last_cp = found
        return found

    def checkpoint_covering(self, seq: int) -> tuple[Checkpoint, str] | None:
        row = self.conn.execute(
            "SELECT note FROM ledger_checkpoints WHERE size >= ? ORDER BY size LIMIT 1", (seq,)
        ).fetchone()
        if row is None:
            return None
        note = str(row[0])
        return Checkpoint.parse(note.split("\n\n")[0] + "\n"), note

    def checkpoints(self) -> Iterator[str]:
        for row in self.conn.execute("SELECT note FROM ledger_checkpoints ORDER BY size"):
            yield str(row[0])

    def event(self, event_id: str) -> tuple[int, dict[str, Any] | None]:
        row = self.conn.execute("SELECT seq, body FROM ledger_events WHERE id = ?", (event_id,)).fetchone()
        if row is None:
            raise LedgerError(ErrorCode.NOT_FOUND, "no such event")
        return int(row[0]), (None if row[1] is None else json.loads(row[1]))

    def anchor_covering(self, seq: int) -> dict[str, Any] | None:
        """The smallest confirmed anchor whose checkpoint covers event ``seq``."""
        row = self.conn.execute(
            "SELECT size, backend, ref, block_number FROM ledger_anchors WHERE state = 'confirmed'"
            " AND ref IS NOT NULL AND size >= ? ORDER BY size LIMIT 1",
            (seq,),
        ).fetchone()
        if row is None:
            return None
        return {"tree_size": int(row[0]), "backend": row[1], "tx": row[2], "block": row[3]}

    def proof_bundle(self, event_id: str, *, chain: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A self-contained proof that the event is in the log: event, path, signed checkpoint, and
        the anchor of that checkpoint when one is final (``chain``: the backend's describe())."""
        seq, body = self.event(event_id)
        if body is None:
            raise LedgerError(ErrorCode.NOT_FOUND, "the event's body is past retention; its leaf is still in the tree")
        anchored = self.anchor_covering(seq)
        found = None
        if anchored is not None:
            row = self.conn.execute(
                "SELECT note FROM ledger_checkpoints WHERE size = ?", (anchored["tree_size"],)
            ).fetchone()
            if row is not None:
                found = Checkpoint.parse(str(row[0]).split("\n\n")[0] + "\n"), str(row[0])
        if found is None:
            anchored = None
            found = self.checkpoint_covering(seq)
        if found is None:
            raise LedgerError(ErrorCode.PROOF_PENDING, "the event is not in a signed checkpoint yet; try again shortly")
        cp, note = found
        path = self.tree.inclusion_proof(seq - 1, cp.size)
        return {
            "version": BUNDLE_VERSION,
            "event": body,
            "leaf_index": seq - 1,
            "tree_size": cp.size,
            "inclusion_path": [base64.b64encode(h).decode() for h in path],
            "checkpoint": note,
            "verifier_key": self.verifier_key(),
            "checkpoint_hash": checkpoint_hash(note).hex(),
            "anchor": None if anchored is None else {**anchored, **dict(chain or {})},
        }
