"""Anchoring signed checkpoints on a chain: a durable backlog and the worker that drains it.

* The backlog is a table beside the checkpoints (``ledger_anchors``). A checkpoint is queued in
  the same transaction that stores it, so a crash can never lose one, and a chain RPC that is down
  for an hour only makes the queue longer: the worker catches up when it returns.
* Only the newest open checkpoint is sent: a later root covers every earlier event (each
  checkpoint is proven consistent with the one before it), so older open ones (``queued`` or
  ``rejected``) are marked ``superseded`` instead of costing a transaction each.
* ``confirmed`` means checked, never "the node said so": the worker sets it only after the
  backend's ``verify`` read the chain itself (chain id, contract code hash, the receipt's target
  and status, the exact event sequence emitted by the contract, the event log, ``anchoredBlock``,
  the confirmation depth). The same check runs for an anchor ``submit`` found already on chain and
  for every row left ``submitted`` by a restart.
* A chain that does not show what it claims makes the row ``rejected`` with the reason (durable,
  counted, logged at error level). A rejected row is retried by a fresh ``submit`` after a backoff
  (doubling up to the cap) once ``check_contract`` passes again, and is superseded like a queued
  one by a newer checkpoint: a cause that persists keeps the newest checkpoint rejected.
* Confirmed anchors are read from the chain again at start and every ``recheck_seconds``: the
  newest ``recheck_count`` of them, and all of them once one is found gone. One the chain no longer
  shows (a reorg past the depth, a fresh node, a chain reset or revert) goes back to ``queued``
  (re-anchored) with the reason kept in ``rejected_reason``; until then nothing shows or bundles it.
* Errors the chain may get over (unreachable, not final yet) are retried with exponential backoff;
  a refusal that will not change (reverted, not the owner, out of funds) is ``failed`` and
  reported, and the next checkpoint is tried on its own.
* The worker runs in its own task with its own connection; nothing on a request path waits for it.

The §18.4.1 events ride on the checkpoint anchors (the contract's ``anchor`` takes both in one
transaction):

* Facts are derived from the audit log, idempotently: ``session_granted``, ``session_revoked``,
  ``deletion_proof`` (accepted) and ``payload_uploaded`` events become rows of
  ``ledger_anchor_events`` (keyed by the audit event's ``seq``, a cursor in ``ledger_anchor_scan``
  moved in the same transaction), with the hashes of :mod:`gateway.anchor.encoding` computed from
  the event bodies. A crash re-derives what was not committed; ``INSERT OR IGNORE`` never doubles.
* Before the newest open checkpoint is first sent, the unassigned facts it covers (audit ``seq`` <=
  its size, at most MAX_EVENTS_PER_ANCHOR) are bound to it and the row is marked ``events_fixed``, in
  one transaction: from then on that anchor always means the same transaction content (``find``,
  ``verify``, the recheck and a re-anchor rebuild it from the table). A checkpoint that carries
  facts is never superseded: it is sent itself. A ``failed`` one gives its facts back to the next.
* A fact's state is its anchor's: ``confirmed`` only once that anchor was checked on chain,
  ``rejected`` with the anchor's reason, ``queued`` while unbound.

The worker that sends anchors and checks them (:class:`gateway.ledger.anchorer.Anchorer`) lives
beside this module: what is here is synchronous and loads no asyncio (``uomp status`` reads the
backlog through it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway import sqldriver
from gateway.anchor.base import Anchor, DataDeletionProofSubmitted, PayloadAnchored, SessionGranted, SessionRevoked
from gateway.atrest import auditdb
from gateway.durable import fault_point
from gateway.errors import UompError
from gateway.ledger.log import ANCHOR_SCHEMA

log = logging.getLogger("uomp.anchor")

STATES = ("queued", "submitted", "confirmed", "rejected", "superseded", "failed")
OPEN_STATES = ("queued", "submitted", "rejected")  # the backlog: not anchored yet, still to do
MAX_RECHECK_ALL = 1000  # confirmed anchors read again in one round once one was found gone
MAX_REASON = 300  # characters of an error kept in the table

# Columns this module adds to ledger_anchors (older databases get them on the worker's first open).
_EXTRA_COLUMNS = (
    ("verified_at", "REAL"),  # when verify() last passed for this row's transaction
    ("checked_at", "REAL"),  # when the chain was last read for it (submit, verify or recheck)
    ("rejections", "INTEGER NOT NULL DEFAULT 0"),  # how often the chain did not show it
    ("rejected_reason", "TEXT"),  # the newest reason (kept after a retry or re-anchor)
    ("rejected_at", "REAL"),
    ("events_fixed", "INTEGER NOT NULL DEFAULT 0"),  # 1: the §18.4.1 facts this anchor carries are fixed
)

# The §18.4.1 facts to anchor, derived from the audit log (see the module docstring).
EVENTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_anchor_events (
  seq INTEGER PRIMARY KEY,      -- the audit event (ledger_events.seq) that records the fact
  event_id TEXT NOT NULL,
  kind TEXT NOT NULL,           -- SessionGranted | SessionRevoked | PayloadAnchored | DataDeletionProofSubmitted
  session_hash BLOB,
  agent_hash BLOB,
  item_hash BLOB,               -- payloadHash or deletionProofHash
  expires_at INTEGER,           -- SessionGranted
  anchor_size INTEGER,          -- the ledger_anchors row whose transaction carries it; NULL: not bound yet
  skipped TEXT,                 -- why it cannot be anchored (the log lacks an input): never sent
  queued_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_anchor_events_size ON ledger_anchor_events(anchor_size);
CREATE TABLE IF NOT EXISTS ledger_anchor_scan (
  one INTEGER PRIMARY KEY CHECK (one = 1),
  seq INTEGER NOT NULL          -- every audit event up to here was looked at
);
"""
# audit action -> the §18.4.1 event it is anchored as (allowed events only)
ANCHORED_ACTIONS = {
    "session_granted": "SessionGranted",
    "session_revoked": "SessionRevoked",
    "deletion_proof": "DataDeletionProofSubmitted",
    "payload_uploaded": "PayloadAnchored",
}
KIND_ORDER = ("SessionGranted", "SessionRevoked", "PayloadAnchored", "DataDeletionProofSubmitted")
GATEWAY_EVENT_PREFIX = "gw_"  # ids of events the remote gateway sent (gateway.guard.audit.GATEWAY_ID_PREFIX)
DERIVE_BATCH = 2000  # audit events looked at per derivation transaction
MAX_DERIVE_BATCHES = 50  # per worker round (the rest next round)


def _columns(conn: sqlite3.Connection) -> set[str]:
    return {str(r[1]) for r in conn.execute("PRAGMA table_info(ledger_anchors)")}


def ensure_schema(conn: sqlite3.Connection) -> None:
    """The backlog table with this module's columns; a row ``confirmed`` by an earlier version
    without a recorded check goes back to ``submitted`` (checked before it counts again)."""
    have = _columns(conn)
    if not have:
        conn.executescript(ANCHOR_SCHEMA)
        have = _columns(conn)
    for name, decl in _EXTRA_COLUMNS:
        if name not in have:
            try:
                conn.execute(f"ALTER TABLE ledger_anchors ADD COLUMN {name} {decl}")
                if name == "events_fixed":  # rows from before may have been sent without facts: keep them so
                    conn.execute("UPDATE ledger_anchors SET events_fixed = 1")
            except sqldriver.OPERATIONAL as exc:
                if "duplicate column" not in str(exc):  # another process added it first: fine
                    raise  # busy (the writer holds the lock): the caller tries again next round
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ledger_anchor_scan'").fetchone() is None:
        conn.executescript(EVENTS_SCHEMA)
    unchecked = (
        "FROM ledger_anchors WHERE state = 'confirmed' AND verified_at IS NULL AND ref IS NOT NULL AND ref != ''"
    )
    if conn.execute(f"SELECT 1 {unchecked} LIMIT 1").fetchone() is not None:  # nothing written otherwise
        conn.execute(
            f"UPDATE ledger_anchors SET state = 'submitted', next_at = 0 WHERE rowid IN (SELECT rowid {unchecked})"
        )


# ------------------------------------------------------------------ §18.4.1 facts from the audit log


@dataclass(frozen=True)
class Fact:
    """One §18.4.1 event as the audit log says it happened (hashes per gateway.anchor.encoding)."""

    seq: int
    event_id: str
    kind: str
    session_hash: bytes | None = None
    agent_hash: bytes | None = None
    item_hash: bytes | None = None
    expires_at: int | None = None
    skipped: str | None = None  # why it cannot be anchored

    def key(self) -> tuple[Any, ...]:
        return (self.kind, self.session_hash, self.agent_hash, self.item_hash, self.expires_at)


def _grant_tags(conn: sqlite3.Connection, session_id: str) -> list[str] | None:
    """The tags of the session's ``session_granted`` event (what its sessionHash is made of)."""
    row = conn.execute(
        "SELECT body FROM ledger_events WHERE session_id = ? AND action = 'session_granted'"
        " AND body IS NOT NULL ORDER BY seq LIMIT 1",
        (session_id,),
    ).fetchone()
    if row is None:
        return None
    tags = json.loads(row[0]).get("tags")
    return [str(t) for t in tags] if isinstance(tags, list) else []


def fact_of(conn: sqlite3.Connection, seq: int, event_id: str, action: str, body: str | None) -> Fact | None:
    """The §18.4.1 fact an audit event records (None: it records none), computed from the event
    body and, for the session hash of a revocation, deletion proof or payload, the tags of the
    session's grant event. A fact the log lacks an input for is returned ``skipped`` with why."""
    from gateway.anchor import encoding as enc

    kind = ANCHORED_ACTIONS.get(action)
    if kind is None or event_id.startswith(GATEWAY_EVENT_PREFIX):  # the gateway's events state no such fact
        return None
    if body is None:
        return Fact(seq, event_id, kind, skipped="event body pruned by retention before it was anchored")
    ev = json.loads(body)
    if ev.get("allowed") is not True:
        return None
    sid, aid = ev.get("session_id"), ev.get("agent_id")
    if not isinstance(sid, str) or not isinstance(aid, str):
        return Fact(seq, event_id, kind, skipped="event has no session or agent")
    try:
        tags = ev.get("tags") if kind == "SessionGranted" else _grant_tags(conn, sid)
        if kind == "SessionGranted" and not isinstance(tags, list):
            tags = []
        if tags is None:
            return Fact(seq, event_id, kind, skipped="the session's grant event is not in the log")
        s_hash, a_hash = enc.session_hash(sid, aid, [str(t) for t in tags]), enc.agent_hash(aid)
        if kind == "SessionGranted":
            exp = ev.get("expires_at")
            if not isinstance(exp, int) or isinstance(exp, bool) or exp < 0:
                return Fact(seq, event_id, kind, skipped="grant event has no expires_at (recorded by an older version)")
            return Fact(seq, event_id, kind, s_hash, a_hash, expires_at=exp)
        if kind == "SessionRevoked":
            return Fact(seq, event_id, kind, s_hash, a_hash)
        if kind == "PayloadAnchored":
            digest = ev.get("detail")
            if not isinstance(digest, str) or not digest.startswith("sha256:") or len(digest) != 71:
                return Fact(seq, event_id, kind, skipped="payload event has no sha256 hash")
            return Fact(seq, event_id, kind, s_hash, a_hash, item_hash=bytes.fromhex(digest[7:]))
        proof_id, memory_hash = ev.get("detail"), ev.get("memory_hash")
        if not isinstance(proof_id, str) or not isinstance(memory_hash, str):
            return Fact(seq, event_id, kind, skipped="deletion proof event has no id or memory_hash")
        return Fact(seq, event_id, kind, s_hash, a_hash, item_hash=enc.deletion_proof_hash(proof_id, sid, memory_hash))
    except ValueError as exc:
        return Fact(seq, event_id, kind, skipped=f"cannot hash the event ({exc})"[:MAX_REASON])


def derive_facts(conn: sqlite3.Connection, *, now: float | None = None, batch: int = DERIVE_BATCH) -> int:
    """Move the scan cursor over the next ``batch`` audit events, adding their §18.4.1 facts to
    ``ledger_anchor_events`` in the same transaction (idempotent). Returns how many audit events
    the cursor moved over (0: it is at the end of the log)."""
    now = time.time() if now is None else now
    moved = 0
    row = conn.execute(
        "SELECT (SELECT seq FROM ledger_anchor_scan WHERE one = 1), (SELECT MAX(seq) FROM ledger_events)"
    ).fetchone()
    if row[1] is None or (row[0] is not None and int(row[0]) >= int(row[1])):
        return 0  # nothing new: no write lock taken
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute("SELECT seq FROM ledger_anchor_scan WHERE one = 1").fetchone()
        cursor = 0 if row is None else int(row[0])
        top = conn.execute("SELECT MAX(seq) FROM ledger_events WHERE seq <= ?", (cursor + batch,)).fetchone()[0]
        if top is not None and int(top) > cursor:
            actions = tuple(ANCHORED_ACTIONS)
            marks = ",".join("?" * len(actions))
            for seq, eid, action, body in conn.execute(
                f"SELECT seq, id, action, body FROM ledger_events WHERE seq > ? AND seq <= ?"
                f" AND action IN ({marks}) ORDER BY seq",
                (cursor, int(top), *actions),
            ).fetchall():
                fact = fact_of(conn, int(seq), str(eid), str(action), body)
                if fact is None:
                    continue
                cur = conn.execute(
                    "INSERT OR IGNORE INTO ledger_anchor_events (seq, event_id, kind, session_hash, agent_hash,"
                    " item_hash, expires_at, skipped, queued_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        fact.seq,
                        fact.event_id,
                        fact.kind,
                        fact.session_hash,
                        fact.agent_hash,
                        fact.item_hash,
                        fact.expires_at,
                        fact.skipped,
                        now,
                    ),
                )
                if cur.rowcount and fact.skipped:
                    log.error("audit event #%d (%s) cannot be anchored: %s", fact.seq, fact.kind, fact.skipped)
            fault_point("anchor.facts_derived")  # (before the commit: the derivation is redone)
            conn.execute(
                "INSERT INTO ledger_anchor_scan (one, seq) VALUES (1, ?) ON CONFLICT(one) DO UPDATE"
                " SET seq = excluded.seq",
                (int(top),),
            )
            moved = int(top) - cursor
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(*sqldriver.ERRORS):
            conn.execute("ROLLBACK")
        raise
    return moved


def stored_facts(
    conn: sqlite3.Connection, where: str = "1", args: tuple[Any, ...] = ()
) -> list[tuple[Fact, int | None]]:
    """(fact, anchor size) rows of ``ledger_anchor_events``."""
    return [
        (Fact(int(r[0]), str(r[1]), str(r[2]), _b(r[3]), _b(r[4]), _b(r[5]), r[6], r[7]), r[8])
        for r in conn.execute(
            "SELECT seq, event_id, kind, session_hash, agent_hash, item_hash, expires_at,"
            f" skipped, anchor_size FROM ledger_anchor_events WHERE {where} ORDER BY seq",
            args,
        )
    ]


def _b(v: Any) -> bytes | None:
    return None if v is None else bytes(v)


def anchor_events(facts: list[Fact]) -> dict[str, Any]:
    """The keyword fields of :class:`Anchor` for these facts (grouped by kind, each in seq order)."""
    out: dict[str, list[Any]] = {"granted": [], "revoked": [], "payloads": [], "deletions": []}
    for f in sorted(facts, key=lambda f: f.seq):
        assert f.session_hash is not None and f.agent_hash is not None
        if f.kind == "SessionGranted":
            assert f.expires_at is not None
            out["granted"].append(SessionGranted(f.session_hash, f.agent_hash, int(f.expires_at)))
        elif f.kind == "SessionRevoked":
            out["revoked"].append(SessionRevoked(f.session_hash, f.agent_hash))
        elif f.kind == "PayloadAnchored":
            assert f.item_hash is not None
            out["payloads"].append(PayloadAnchored(f.item_hash, f.session_hash, f.agent_hash))
        else:
            assert f.item_hash is not None
            out["deletions"].append(DataDeletionProofSubmitted(f.session_hash, f.agent_hash, f.item_hash))
    return {k: tuple(v) for k, v in out.items()}


def anchor_for(conn: sqlite3.Connection, size: int, note: str) -> Anchor:
    """The anchor of checkpoint ``size`` as its transaction carries it: the checkpoint and the
    §18.4.1 facts bound to it (``uomp audit verify``, the worker)."""
    facts = [f for f, _ in stored_facts(conn, "anchor_size = ?", (size,))] if _has_events(conn) else []
    return Anchor.for_checkpoint(note, **anchor_events(facts))


def _has_events(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ledger_anchor_events'").fetchone() is not None


def _chain_key(ev: dict[str, Any]) -> tuple[Any, ...]:
    a = ev["args"]
    kind = ev["kind"]
    item = a.get("payloadHash") if kind == "PayloadAnchored" else a.get("deletionProofHash")
    exp = a.get("expiresAt") if kind == "SessionGranted" else None
    return (
        kind,
        bytes(a["sessionHash"]),
        bytes(a["agentHash"]),
        None if item is None else bytes(item),
        None if exp is None else int(exp),
    )


def check_facts(conn: sqlite3.Connection, chain_events: list[dict[str, Any]] | None) -> list[str]:
    """``uomp audit verify``: every stored fact is what its audit event says (recomputed from the
    log), every fact the scan passed is stored, every confirmed fact is on chain in its anchor's
    transaction, and every §18.4.1 event on chain (``chain_events``, None: chain not read) is a
    stored fact (counted: a doubled event is found). Problems, worded for the user."""
    if not _has_events(conn):
        return []
    problems: list[str] = []
    row = conn.execute("SELECT seq FROM ledger_anchor_scan WHERE one = 1").fetchone()
    cursor = 0 if row is None else int(row[0])
    stored = {f.seq: (f, size) for f, size in stored_facts(conn)}
    actions = tuple(ANCHORED_ACTIONS)
    marks = ",".join("?" * len(actions))
    for seq, eid, action, body in conn.execute(
        f"SELECT seq, id, action, body FROM ledger_events WHERE seq <= ? AND action IN ({marks}) ORDER BY seq",
        (cursor, *actions),
    ).fetchall():
        have = stored.get(int(seq))
        if body is None:
            continue  # pruned: the stored fact is what is left of it
        want = fact_of(conn, int(seq), str(eid), str(action), body)
        if want is None:
            if have is not None:
                problems.append(f"anchored fact #{seq} has no such fact in its audit event")
            continue
        if have is None:
            problems.append(f"audit event #{seq} ({want.kind}) is missing from the anchoring backlog")
        elif want.skipped and not have[0].skipped:
            continue  # an input is gone from the log now (the grant's body pruned): the stored fact is what is left
        elif have[0].key() != want.key() or have[0].event_id != want.event_id:
            problems.append(f"anchored fact #{seq} ({want.kind}) does not match its audit event")
    confirmed = {
        int(s): str(ref)
        for s, ref in conn.execute(
            "SELECT size, ref FROM ledger_anchors WHERE state = 'confirmed' AND ref IS NOT NULL AND ref != ''"
        )
    }
    if chain_events is None:
        return problems
    on_chain: dict[tuple[Any, ...], list[str]] = {}
    for ev in chain_events:
        on_chain.setdefault(_chain_key(ev), []).append(str(ev["tx"]).lower())
    known: dict[tuple[Any, ...], int] = {}
    for fact, size in stored.values():
        if fact.skipped:
            continue
        known[fact.key()] = known.get(fact.key(), 0) + 1
        if size is not None and int(size) in confirmed:
            if confirmed[int(size)].lower() not in on_chain.get(fact.key(), []):
                problems.append(
                    f"{fact.kind} of audit event #{fact.seq} is confirmed but not on chain in tx {confirmed[int(size)]}"
                )
    for key, txs in on_chain.items():
        if len(txs) > known.get(key, 0):
            problems.append(
                f"{key[0]} on chain in tx {txs[-1]} matches no audit event (or is there "
                f"{len(txs)} times for {known.get(key, 0)} in the log)"
            )
    return problems


def backlog(conn: sqlite3.Connection, *, now: float | None = None) -> dict[str, Any]:
    """Counts per state, the open backlog (size, oldest, last error), the newest confirmed anchor
    and the newest rejection (for `uomp status`, `uomp anchor status`, the dashboard, metrics)."""
    now = time.time() if now is None else now
    cols = _columns(conn)
    counts = {s: 0 for s in STATES}
    for state, n in conn.execute("SELECT state, COUNT(*) FROM ledger_anchors GROUP BY state"):
        counts[str(state)] = int(n)
    open_in = "('queued', 'submitted', 'rejected')"
    row = conn.execute(f"SELECT MIN(queued_at), MIN(size) FROM ledger_anchors WHERE state IN {open_in}").fetchone()
    last = conn.execute(
        "SELECT size, ref, block_number, done_at FROM ledger_anchors WHERE state = 'confirmed'"
        " ORDER BY size DESC LIMIT 1"
    ).fetchone()
    err = conn.execute(
        "SELECT last_error FROM ledger_anchors WHERE last_error IS NOT NULL"
        " AND state IN ('queued', 'submitted', 'rejected', 'failed') ORDER BY size DESC LIMIT 1"
    ).fetchone()
    rejection = None
    checked = None
    if "rejected_reason" in cols:
        r = conn.execute(
            "SELECT size, state, rejected_reason, rejected_at, rejections FROM ledger_anchors"
            " WHERE rejected_reason IS NOT NULL ORDER BY rejected_at DESC, size DESC LIMIT 1"
        ).fetchone()
        if r is not None:
            rejection = {"tree_size": int(r[0]), "state": r[1], "reason": r[2], "at": r[3], "rejections": int(r[4])}
        checked = conn.execute("SELECT MAX(checked_at) FROM ledger_anchors WHERE state = 'confirmed'").fetchone()[0]
    events: dict[str, dict[str, int]] = {}
    if _has_events(conn):
        for kind, state, n in conn.execute(
            "SELECT e.kind, CASE WHEN e.skipped IS NOT NULL THEN 'skipped' WHEN a.state IS NULL THEN 'queued'"
            " ELSE a.state END, COUNT(*) FROM ledger_anchor_events e LEFT JOIN ledger_anchors a"
            " ON a.size = e.anchor_size GROUP BY 1, 2"
        ):
            events.setdefault(str(kind), {})[str(state)] = int(n)
    return {
        "counts": counts,
        "events": events,  # the §18.4.1 facts per kind and state (their anchor's state)
        "backlog_size": sum(counts[s] for s in OPEN_STATES),
        "oldest_pending_seconds": None if row[0] is None else max(0.0, now - float(row[0])),
        "oldest_pending_tree_size": None if row[1] is None else int(row[1]),
        "last_confirmed": None
        if last is None
        else {"tree_size": int(last[0]), "tx": last[1], "block": last[2], "at": last[3]},
        "last_checked_at": checked,
        "last_error": None if err is None else err[0],
        "last_rejection": rejection,
    }


def counts_of(db_path: Path) -> dict[str, int] | None:
    """The backlog's counts per state, read-only (metrics); None while there is no readable table."""
    try:
        conn = auditdb.connect(db_path, readonly=True, timeout=0.5)
        try:
            counts = {s: 0 for s in STATES}
            for state, n in conn.execute("SELECT state, COUNT(*) FROM ledger_anchors GROUP BY state"):
                counts[str(state)] = int(n)
            return counts
        finally:
            conn.close()
    except sqldriver.errors(UompError):  # no table yet, locked, or a sealed home not unlocked here
        return None


def summary(b: dict[str, Any] | None) -> str:
    """One line for `uomp status`, `uomp anchor status` and the dashboard."""
    if not b:
        return "no anchoring backlog (the audit log is not open yet)"
    c = b["counts"]
    last = b.get("last_confirmed")
    text = (
        f"{c.get('confirmed', 0)} anchored (checked on chain), {b.get('backlog_size', 0)} in the backlog"
        + (f" ({c['rejected']} REJECTED)" if c.get("rejected") else "")
        + (f", oldest {b['oldest_pending_seconds']:.0f} s" if b.get("oldest_pending_seconds") is not None else "")
        + (f", last in tx {last['tx']}" if last else "")
    )
    facts: dict[str, int] = {}
    for per_state in (b.get("events") or {}).values():
        for state, n in per_state.items():
            facts[state] = facts.get(state, 0) + n
    if facts:
        open_n = sum(facts.get(st, 0) for st in ("queued", "submitted"))
        text += (
            f"; §18.4.1 events: {facts.get('confirmed', 0)} on chain (checked), {open_n} pending"
            + (f", {facts['rejected']} REJECTED" if facts.get("rejected") else "")
            + (f", {facts['skipped']} not anchorable" if facts.get("skipped") else "")
        )
    rej = b.get("last_rejection")
    if rej and rej.get("state") in OPEN_STATES:
        text += f"; !! the chain did not show checkpoint {rej['tree_size']}: {rej['reason']}"
    if b.get("last_error") and (not rej or b["last_error"] != rej.get("reason")):
        text += f"; last error: {b['last_error']}"
    return text
