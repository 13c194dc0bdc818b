"""The Auth Service's session records (spec §9, §13): the ``auth.db`` schema, the session row and
its cache, and the small parsers the session endpoints share. :class:`gateway.guard.auth.AuthService`
is the service itself; :mod:`gateway.guard.refresh` its refresh-token rotation.

Session states (§13.1)::

    created --grant--> active --close / timeout / revoke / deletion proof--> closed | expired | revoked

:class:`SessionCache`: every authenticated request needs its session's row (status, agent, expiry,
grant options). Decoding it (a SELECT and five ``json.loads``) was three quarters of
``authenticate``; the decoded row is now kept per session id and dropped

* when this process changes the session (grant, close, revoke, expiry, deletion proof): the
  Auth Service calls :meth:`SessionCache.forget` in the same method that writes;
* when any other connection (another process: ``uomp sessions revoke`` opens ``auth.db`` itself)
  commits to ``auth.db``: SQLite's ``PRAGMA data_version`` (read on every lookup, about a
  microsecond) changes, and the whole cache is dropped;
* when the session's ``expires_at`` has passed (a cached row is never served past it).

So a revocation is effective on the very next request (§13.4), whichever process made it (and,
independently of the cache, a revocation also blacklists every token of the session, which
``authenticate`` checks on every request).
``UOMP_SESSION_CACHE=0`` turns the cache off (benchmarks compare both).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from gateway.config import switch_on
from gateway.contract import token_digest
from gateway.core import tokens
from gateway.core.capability import Scope
from gateway.core.tokencache import ExpiringMap
from gateway.errors import ErrorCode, UompError, caused_by

SESSION_CACHE_ENTRIES = 4096  # decoded session rows kept (cleared whole when full: refilled on demand)
SESSION_CACHE = switch_on("UOMP_SESSION_CACHE")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
  session_id TEXT PRIMARY KEY,
  agent_id TEXT NOT NULL,
  agent_name TEXT,
  status TEXT NOT NULL,
  created_at REAL NOT NULL,
  expires_at REAL NOT NULL,
  closed_at REAL,
  requested_scopes TEXT NOT NULL,
  granted_scopes TEXT,
  grant_options TEXT,
  token_hash TEXT,
  identity_jwk TEXT,
  retention TEXT,
  deletion_proof_id TEXT,
  missing_proof_recorded INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS idx_sessions_status ON sessions(status, expires_at);
CREATE TABLE IF NOT EXISTS issued_tokens (
  token_hash TEXT PRIMARY KEY,
  session_id TEXT NOT NULL,
  jti TEXT NOT NULL,
  kind TEXT NOT NULL,
  expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_issued_session ON issued_tokens(session_id);
CREATE TABLE IF NOT EXISTS token_blacklist (
  token_hash TEXT PRIMARY KEY,
  session_id TEXT NOT NULL,
  expires_at REAL NOT NULL,
  reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS quota (
  session_id TEXT PRIMARY KEY,
  reserved INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS refresh_tokens (
  jti TEXT PRIMARY KEY,
  family_id TEXT NOT NULL,
  session_id TEXT NOT NULL,
  status TEXT NOT NULL,
  expires_at REAL NOT NULL,
  spent_at REAL,
  successor TEXT
);
CREATE INDEX IF NOT EXISTS idx_refresh_family ON refresh_tokens(family_id);
CREATE TABLE IF NOT EXISTS audit_outbox (
  id TEXT PRIMARY KEY,
  row TEXT NOT NULL
);
"""

# Columns added after the first release: (table, column, declaration). Added on open if missing.
MIGRATIONS = (
    ("sessions", "status_reason", "TEXT"),
    ("issued_tokens", "used_at", "REAL"),
)
USED_CACHE_ENTRIES = 65536  # access tokens known to be used (saves a write per request)
PRUNE_BATCH_ROWS = 10_000  # rows per table per prune call
PRUNE_MARGIN_SECONDS = 3600  # kept this long past a token's exp (clock leeway, investigations)

REUSE_MESSAGE = (
    "the session was revoked because a spent refresh token was presented again after its "
    "successor had been used (two holders of one token chain: possibly a copy of the bundle)"
)
SUPERSEDED_MESSAGE = (
    "the session was revoked because a token replaced by a refresh retry was presented "
    "(two holders of one token chain: possibly a copy of the bundle)"
)

LIVE = ("created", "active")
PROFILES = ("local", "remote")
MAX_DURATION_MINUTES_FLOOR = 1
DEFAULT_SESSION_MINUTES = 30  # §9.1's example; the CLI picks its own defaults per profile
REMOTE_ACCESS_MAX_SECONDS = 600  # §15.2: remote access tokens SHOULD NOT exceed 10 minutes; a config cannot
MAX_SETTING = {"local": "session_max_minutes", "remote": "remote_session_max_minutes"}


def minutes_text(minutes: float) -> str:
    """``30 days``, ``1 day``, ``12 hours``, ``90 minutes``: a length as people say it."""
    for unit, size in (("day", 1440), ("hour", 60)):
        if minutes >= size and minutes % size == 0:
            n = int(minutes // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{minutes:g} minute{'s' if minutes != 1 else ''}"


ID_ALPHABET_MAX = 128


def ended_message(row: SessionRow) -> str:
    """What SESSION_REVOKED says for a session that is no longer active: its state and why."""
    return f"session is {row.status}: {row.status_reason}" if row.status_reason else f"session is {row.status}"


def token_hash(token: str) -> str:
    """How auth.db keys a token: :func:`gateway.contract.token_digest` with its algorithm named."""
    return "sha256:" + token_digest(token)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(12)}"


def req_str(body: Mapping[str, Any], name: str, *, max_len: int = ID_ALPHABET_MAX) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not v.strip() or len(v) > max_len:
        raise UompError(ErrorCode.INVALID_REQUEST, f"{name} must be a non-empty string of at most {max_len} characters")
    return v


def _scope_from_body(obj: Any, name: str) -> Scope:
    try:
        return tokens.parse_scope(obj, name)
    except UompError as exc:
        raise caused_by(UompError(ErrorCode.INVALID_REQUEST, exc.message.replace("claim ", "")), exc)


def scopes_from_body(obj: Any, name: str) -> tuple[Scope, Scope]:
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise UompError(ErrorCode.INVALID_REQUEST, f"{name} must be an object with read/write scopes")
    unknown = set(obj) - {"read", "write"}
    if unknown:
        raise UompError(ErrorCode.INVALID_REQUEST, f"{name} has unknown members: {', '.join(sorted(unknown))}")
    return _scope_from_body(obj.get("read"), f"{name}.read"), _scope_from_body(obj.get("write"), f"{name}.write")


def scopes_json(read: Scope, write: Scope) -> str:
    return json.dumps({"read": read.to_claim(), "write": write.to_claim()})


def opt_bool(body: Mapping[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if not isinstance(v, bool):
        raise UompError(ErrorCode.INVALID_REQUEST, f"{name} must be a boolean")
    return v


def opt_str_list(body: Mapping[str, Any], name: str) -> list[str] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > 256 or not all(isinstance(x, str) and 0 < len(x) <= 512 for x in v):
        raise UompError(ErrorCode.INVALID_REQUEST, f"{name} must be a list of non-empty strings")
    return list(v)


@dataclass(frozen=True)
class Minted:
    """A freshly signed token, before it is recorded (hash, jti) in the same transaction as its use."""

    token: str = dataclass_field(repr=False)
    exp: float = 0.0
    jti: str = ""
    kind: str = "access"
    family_id: str | None = None


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    agent_id: str
    agent_name: str | None
    status: str
    created_at: float
    expires_at: float
    closed_at: float | None
    requested: dict[str, Any]
    granted: dict[str, Any] | None
    options: dict[str, Any]
    identity_jwk: dict[str, Any] | None
    retention: dict[str, Any] | None
    deletion_proof_id: str | None
    status_reason: str | None = None

    @property
    def abnormal(self) -> bool:
        """§19.5: the session ended although its agent owed a deletion proof (proof_required) and gave none."""
        return (
            self.status not in LIVE
            and bool((self.retention or {}).get("proof_required"))
            and not self.deletion_proof_id
        )

    def public(self) -> dict[str, Any]:
        """§13.2 view for the user (never token material)."""
        out: dict[str, Any] = {
            "session_id": self.session_id,
            "agent_id": self.agent_id,
            "agent_name": self.agent_name,
            "status": self.status,
            "created_at": tokens.iso(self.created_at),
            "expires_at": tokens.iso(self.expires_at),
            "closed_at": tokens.iso(self.closed_at) if self.closed_at else None,
            "requested_scopes": self.requested,
            "granted_scopes": self.granted,
        }
        if self.options:
            out["profile"] = self.options.get("profile", "local")
            if self.options.get("audience"):
                out["audience"] = self.options["audience"]
            out["aggregates"] = {
                "min_max": self.options.get("aggregate_min_max") is True,
                "exact": self.options.get("aggregate_exact") is True,
            }
        if self.retention:
            out["data_retention_policy"] = self.retention
        if self.deletion_proof_id:
            out["deletion_proof_id"] = self.deletion_proof_id
        if self.status_reason:
            out["status_reason"] = self.status_reason
        out["abnormal"] = self.abnormal
        if self.abnormal:
            out["abnormal_reason"] = "ended without the deletion proof its agent owed (spec §19.5)"
        return out


class SessionCache:
    """Decoded :class:`SessionRow` per session id, valid while ``auth.db`` is unchanged by others.

    Used from the one thread that owns the connection (the auth.db worker). ``lookup`` returns a
    cached row or None (then the caller reads the database and calls ``keep``)."""

    def __init__(
        self, db: sqlite3.Connection, *, enabled: bool = SESSION_CACHE, max_entries: int = SESSION_CACHE_ENTRIES
    ) -> None:
        self.db = db
        self.enabled = enabled
        self.max_entries = max_entries
        self._rows: dict[str, SessionRow] = {}
        # token hashes seen absent from token_blacklist at self._version (one SELECT saved per read)
        self._clean: ExpiringMap[bool] = ExpiringMap(max_entries * 4)
        self._version = self._data_version()
        self.hits = 0
        self.misses = 0

    def _data_version(self) -> int:
        # Changes whenever another connection commits to this database file (any process).
        return int(self.db.execute("PRAGMA data_version").fetchone()[0])

    def lookup(self, session_id: str, now: float) -> SessionRow | None:
        if not self.enabled:
            return None
        version = self._data_version()
        if version != self._version:
            self._rows.clear()
            self._clean.clear()
            self._version = version
        row = self._rows.get(session_id)
        if row is None or (row.status in LIVE and now >= row.expires_at):
            self.misses += 1
            return None
        self.hits += 1
        return row

    def keep(self, row: SessionRow) -> None:
        if not self.enabled:
            return
        if len(self._rows) >= self.max_entries:
            self._rows.clear()
        self._rows[row.session_id] = row

    def not_blacklisted(self, th: str) -> bool:
        """True when ``th`` was absent from ``token_blacklist`` at the version :meth:`lookup` just
        checked (call it right after ``lookup``, as :meth:`AuthService.authenticate` does)."""
        return self.enabled and th in self._clean

    def keep_not_blacklisted(self, th: str, until: float, now: float, *, session_id: str) -> None:
        """Remember ``th`` as absent from the blacklist until the token expires, or until newer tokens
        of ``session_id`` push it out (gateway/core/tokencache.py)."""
        if not self.enabled:
            return
        self._clean.put(th, True, until, now, group=session_id)

    @property
    def clean_count(self) -> int:
        return len(self._clean)

    def blacklist_changed(self) -> None:
        """This process wrote to ``token_blacklist`` (its own commits leave data_version alone)."""
        self._clean.clear()

    def forget(self, session_id: str | None = None) -> None:
        """Drop one session's row (this process changed it), or all of them."""
        if session_id is None:
            self._rows.clear()
        else:
            self._rows.pop(session_id, None)


def decode_row(r: sqlite3.Row) -> SessionRow:
    """A ``sessions`` row as a :class:`SessionRow` (the JSON columns decoded)."""
    return SessionRow(
        session_id=r["session_id"],
        agent_id=r["agent_id"],
        agent_name=r["agent_name"],
        status=r["status"],
        created_at=r["created_at"],
        expires_at=r["expires_at"],
        closed_at=r["closed_at"],
        requested=json.loads(r["requested_scopes"]),
        granted=json.loads(r["granted_scopes"]) if r["granted_scopes"] else None,
        options=json.loads(r["grant_options"]) if r["grant_options"] else {},
        identity_jwk=json.loads(r["identity_jwk"]) if r["identity_jwk"] else None,
        retention=json.loads(r["retention"]) if r["retention"] else None,
        deletion_proof_id=r["deletion_proof_id"],
        status_reason=r["status_reason"],
    )
