"""The enrollment store (``$UOMP_HOME/enroll.db``, WAL): one-time codes the user issued
(``uomp agent invite``) and the requests agents made with them (docs/enrollment.md).

Written by the user's CLI (invite, approve, deny) and by the gateway (a request, its pickup); no
secret is kept in the clear: a code is stored as its hash, a request's poll secret too, and an
approved answer only sealed to the agent's one-time key (:mod:`gateway.core.enrolment`), wiped at
pickup. Each function opens its own connection: callers run them off the event loop.

Rules:
* a code is redeemed once, before its expiry, with the manifest it was issued for; every other
  attempt fails alike (:class:`CodeRefused` carries the precise reason for the user's audit log,
  the agent sees one answer);
* a request waits at most :data:`REQUEST_TTL_SECONDS` for the user's decision and its pickup;
* ``approve`` and ``deny`` act only on a pending request, once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.config import Paths
from gateway.core import enrolment
from gateway.db import connect, transaction
from gateway.errors import ErrorCode, UompError

REQUEST_TTL_SECONDS = 3600.0
MAX_INVITE_SECONDS = 7 * 86_400
MAX_OPEN_INVITES = 1000  # unredeemed, unexpired codes at once (each is a way in: keep them few)

SCHEMA = """
CREATE TABLE IF NOT EXISTS invites (
  invite_id TEXT PRIMARY KEY,
  code_hash TEXT NOT NULL UNIQUE,
  agent_id TEXT NOT NULL,
  manifest_digest TEXT NOT NULL,
  gateway_url TEXT NOT NULL,
  created_at REAL NOT NULL,
  expires_at REAL NOT NULL,
  used_at REAL,
  request_id TEXT
);
CREATE TABLE IF NOT EXISTS requests (
  request_id TEXT PRIMARY KEY,
  poll_hash TEXT NOT NULL,
  invite_id TEXT NOT NULL REFERENCES invites(invite_id),
  agent_id TEXT NOT NULL,
  manifest BLOB NOT NULL,
  csr TEXT NOT NULL,
  seal_key TEXT NOT NULL,
  key_fingerprint TEXT NOT NULL,
  client TEXT,
  created_at REAL NOT NULL,
  expires_at REAL NOT NULL,
  status TEXT NOT NULL,
  decided_at REAL,
  reason TEXT,
  session_id TEXT,
  sealed TEXT
);
"""

PENDING, APPROVED, COLLECTED, DENIED, EXPIRED = "pending", "approved", "collected", "denied", "expired"


class CodeRefused(UompError):
    """The one answer to every code that does not open a request; ``why`` is for the audit log only."""

    def __init__(self, why: str) -> None:
        super().__init__(
            ErrorCode.ENROLL_CODE_INVALID,
            "this enrollment code is not valid (wrong, already used, expired, or issued for another "
            "manifest); ask the user for a new one (uomp agent invite)",
        )
        self.why = why


@contextlib.contextmanager
def _db(paths: Paths) -> Iterator[sqlite3.Connection]:
    conn = connect(paths.enroll_db, schema=SCHEMA, what="enrollment database")
    try:
        yield conn
    finally:
        conn.close()


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Invite:
    """A code just made: the code itself exists only here and in what the CLI prints."""

    invite_id: str
    code: str
    agent_id: str
    manifest_digest: str
    expires_at: float


def create_invite(
    paths: Paths, *, agent_id: str, manifest_digest: str, gateway_url: str, seconds: float, now: float | None = None
) -> Invite:
    """A one-time code for one manifest, lasting ``seconds`` (one minute to 7 days); the store keeps its hash."""
    if not 60 <= seconds <= MAX_INVITE_SECONDS:
        raise UompError(ErrorCode.INVALID_REQUEST, "--expires: a code lasts between one minute and 7 days")
    now = time.time() if now is None else now
    code = enrolment.new_code()
    invite_id = "inv_" + secrets.token_hex(6)
    with _db(paths) as conn, transaction(conn, what="enrollment database"):
        (open_count,) = conn.execute(
            "SELECT COUNT(*) FROM invites WHERE used_at IS NULL AND expires_at > ?", (now,)
        ).fetchone()
        if open_count >= MAX_OPEN_INVITES:
            raise UompError(
                ErrorCode.RATE_LIMITED,
                f"{open_count} enrollment codes are still open; let some expire or revoke them (uomp requests list)",
            )
        conn.execute(
            "INSERT INTO invites (invite_id, code_hash, agent_id, manifest_digest, gateway_url, created_at, "
            "expires_at) VALUES (?,?,?,?,?,?,?)",
            (
                invite_id,
                enrolment.code_hash(enrolment.normalize_code(code) or ""),
                agent_id,
                manifest_digest,
                gateway_url,
                now,
                now + seconds,
            ),
        )
    return Invite(invite_id, code, agent_id, manifest_digest, now + seconds)


@dataclass(frozen=True)
class Opened:
    """A request a code opened: its id and the poll secret the agent alone is told."""

    request_id: str
    poll_token: str
    agent_id: str
    invite_id: str


def redeem(
    paths: Paths,
    *,
    code: str | None,
    manifest_digest: str,
    manifest: bytes,
    csr: str,
    seal_key: str,
    key_fingerprint: str,
    client: str | None,
    now: float | None = None,
) -> Opened:
    """Spend a code on a request; :class:`CodeRefused` (one answer) for any code that cannot.

    The same statements run for every code: the lookup by hash, then the checks, then (only when
    all pass) the one write."""
    now = time.time() if now is None else now
    digest = enrolment.code_hash(code or "")
    with _db(paths) as conn, transaction(conn, what="enrollment database"):
        row = conn.execute(
            "SELECT invite_id, agent_id, manifest_digest, expires_at, used_at FROM invites WHERE code_hash=?",
            (digest,),
        ).fetchone()
        same_manifest = enrolment.digest_equal(row["manifest_digest"] if row else "", manifest_digest)
        if code is None or row is None:
            raise CodeRefused("unknown code")
        if row["used_at"] is not None:
            raise CodeRefused(f"code {row['invite_id']} already used")
        if row["expires_at"] <= now:
            raise CodeRefused(f"code {row['invite_id']} expired")
        if not same_manifest:
            raise CodeRefused(f"code {row['invite_id']} presented with another manifest than it was issued for")
        request_id = "enr_" + secrets.token_hex(8)
        poll_token = secrets.token_urlsafe(32)
        conn.execute(
            "UPDATE invites SET used_at=?, request_id=? WHERE invite_id=? AND used_at IS NULL",
            (now, request_id, row["invite_id"]),
        )
        conn.execute(
            "INSERT INTO requests (request_id, poll_hash, invite_id, agent_id, manifest, csr, seal_key, "
            "key_fingerprint, client, created_at, expires_at, status) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                request_id,
                _hash(poll_token),
                row["invite_id"],
                row["agent_id"],
                manifest,
                csr,
                seal_key,
                key_fingerprint,
                client,
                now,
                now + REQUEST_TTL_SECONDS,
                PENDING,
            ),
        )
    return Opened(request_id, poll_token, str(row["agent_id"]), str(row["invite_id"]))


def _status(row: sqlite3.Row, now: float) -> str:
    status = str(row["status"])
    if status in (PENDING, APPROVED) and row["expires_at"] <= now:
        return EXPIRED
    return status


def poll(paths: Paths, request_id: str, poll_token: str, *, now: float | None = None) -> dict[str, Any] | None:
    """The request's state for its agent, or None (unknown id or wrong poll secret: alike). An
    approved answer is handed over once: the sealed bytes are wiped in the same transaction."""
    now = time.time() if now is None else now
    with _db(paths) as conn, transaction(conn, what="enrollment database"):
        row = conn.execute("SELECT * FROM requests WHERE request_id=?", (request_id,)).fetchone()
        if not enrolment.digest_equal(row["poll_hash"] if row else "", _hash(poll_token)) or row is None:
            return None
        status = _status(row, now)
        out: dict[str, Any] = {"request_id": request_id, "status": status, "agent_id": row["agent_id"]}
        if status == APPROVED:
            out["sealed"] = json.loads(row["sealed"]) if row["sealed"] else None
            out["session_id"] = row["session_id"]
            conn.execute("UPDATE requests SET status=?, sealed=NULL WHERE request_id=?", (COLLECTED, request_id))
        elif status in (DENIED, EXPIRED):
            out["reason"] = row["reason"] or ("the user did not decide in time" if status == EXPIRED else "")
        return out


def list_requests(paths: Paths, *, status: str | None = None, now: float | None = None) -> list[dict[str, Any]]:
    """The newest 500 requests (no secrets), with their status as of ``now``; only ``status`` ones if given."""
    now = time.time() if now is None else now
    with _db(paths) as conn:
        rows = conn.execute("SELECT * FROM requests ORDER BY created_at DESC LIMIT 500").fetchall()
    out = [_public(r, now) for r in rows]
    return [r for r in out if status is None or r["status"] == status]


def _public(row: sqlite3.Row, now: float) -> dict[str, Any]:
    return {
        "request_id": row["request_id"],
        "agent_id": row["agent_id"],
        "invite_id": row["invite_id"],
        "status": _status(row, now),
        "client": row["client"],
        "key_fingerprint": row["key_fingerprint"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
        "decided_at": row["decided_at"],
        "reason": row["reason"],
        "session_id": row["session_id"],
    }


@dataclass(frozen=True)
class Pending:
    """A pending request as ``uomp requests approve`` needs it (manifest, CSR, sealing key)."""

    request_id: str
    agent_id: str
    manifest: bytes
    csr: str
    seal_key: str
    key_fingerprint: str
    client: str | None
    created_at: float
    gateway_url: str


def pending(paths: Paths, request_id: str, *, now: float | None = None) -> Pending:
    """A request still waiting for the user's decision; INVALID_STATE / NOT_FOUND otherwise."""
    now = time.time() if now is None else now
    with _db(paths) as conn:
        row = conn.execute(
            "SELECT r.*, i.gateway_url FROM requests r JOIN invites i USING (invite_id) WHERE r.request_id=?",
            (request_id,),
        ).fetchone()
    if row is None:
        raise UompError(ErrorCode.NOT_FOUND, f"no enrollment request {request_id}; see uomp requests list")
    status = _status(row, now)
    if status != PENDING:
        raise UompError(
            ErrorCode.INVALID_STATE,
            f"enrollment request {request_id} is {status}, not pending; the agent can enroll again with a new "
            "code (uomp agent invite)",
        )
    return Pending(
        row["request_id"],
        row["agent_id"],
        bytes(row["manifest"]),
        row["csr"],
        row["seal_key"],
        row["key_fingerprint"],
        row["client"],
        row["created_at"],
        row["gateway_url"],
    )


def decide(
    paths: Paths,
    request_id: str,
    *,
    approved: bool,
    reason: str,
    sealed: dict[str, str] | None = None,
    session_id: str | None = None,
    now: float | None = None,
) -> None:
    """Record the user's decision on a pending request (once; INVALID_STATE if it is no longer pending)."""
    now = time.time() if now is None else now
    with _db(paths) as conn, transaction(conn, what="enrollment database"):
        cur = conn.execute(
            "UPDATE requests SET status=?, decided_at=?, reason=?, sealed=?, session_id=? "
            "WHERE request_id=? AND status=? AND expires_at > ?",
            (
                APPROVED if approved else DENIED,
                now,
                reason[:300],
                json.dumps(sealed) if sealed is not None else None,
                session_id,
                request_id,
                PENDING,
                now,
            ),
        )
        if cur.rowcount != 1:
            raise UompError(
                ErrorCode.INVALID_STATE,
                f"enrollment request {request_id} is no longer pending (decided or expired meanwhile)",
            )
