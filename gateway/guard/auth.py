"""Auth Service (spec §9, §13, §15.5, §19.4): sessions, tokens, blacklist, quotas, refresh families.

Longer than ~500 lines on purpose: one class, every Auth Service transaction on ``auth.db``
(authenticate, consume a read, create/grant/close/revoke, prune), each an atomic unit of its own.

State lives in ``auth.db`` (WAL, synchronous=FULL): a revocation is durable before it is
acknowledged. The session records, their states and the decoded-row cache are in
:mod:`gateway.guard.sessions`; refresh-token rotation (§15.5) is :mod:`gateway.guard.refresh`.

Every token this service issues is recorded by hash; closing or revoking a session copies all of
them into the persistent blacklist (§13.4), and the session status itself is checked on every
request, so a revoked session's tokens fail on the very next request.

Pruning (:meth:`AuthService.prune`): rows of tokens past their ``exp`` (issued, refresh,
blacklist: a blacklisted token past its exp fails on its own) are deleted periodically.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Mapping
from typing import Any

from gateway import keys as keyfiles
from gateway.config import GuardConfig, Paths
from gateway.core import checks, jose, restrictions, tokens
from gateway.core.capability import Capability
from gateway.core.quota import QuotaLedger
from gateway.core.tokencache import ExpiringMap, remember_verified, token_until
from gateway.db import connect, transaction
from gateway.errors import ErrorCode, UompError
from gateway.guard.audit import AuditLog, make_row
from gateway.guard.refresh import RefreshRotation
from gateway.guard.sessions import (  # re-exported: the public names stay importable from here
    DEFAULT_SESSION_MINUTES,
    LIVE,
    MAX_DURATION_MINUTES_FLOOR,
    MAX_SETTING,
    MIGRATIONS,
    PROFILES,
    PRUNE_BATCH_ROWS,
    PRUNE_MARGIN_SECONDS,
    REMOTE_ACCESS_MAX_SECONDS,
    REUSE_MESSAGE,
    SCHEMA,
    SUPERSEDED_MESSAGE,
    USED_CACHE_ENTRIES,
    Minted,
    SessionCache,
    SessionRow,
    decode_row,
    ended_message,
    minutes_text,
    new_id,
    opt_bool,
    opt_str_list,
    req_str,
    scopes_from_body,
    scopes_json,
    token_hash,
)

__all__ = [
    "DEFAULT_SESSION_MINUTES",
    "LIVE",
    "PROFILES",
    "PRUNE_BATCH_ROWS",
    "PRUNE_MARGIN_SECONDS",
    "REMOTE_ACCESS_MAX_SECONDS",
    "REUSE_MESSAGE",
    "SCHEMA",
    "SUPERSEDED_MESSAGE",
    "AuthService",
    "Minted",
    "SessionRow",
    "ended_message",
    "minutes_text",
    "token_hash",
]

log = logging.getLogger("uomp.auth")


class AuthService:
    def __init__(
        self, paths: Paths, cfg: GuardConfig, audit: AuditLog, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.paths = paths
        self.cfg = cfg
        self.audit = audit
        self.clock = clock
        self.db = connect(
            paths.auth_db, schema=SCHEMA, what="session database", busy_timeout=cfg.db_busy_timeout_seconds
        )
        self._migrate()
        self.rows = SessionCache(self.db)  # decoded session rows (forget() wherever this class writes one)
        self.refreshes = RefreshRotation(self)  # §15.5 rotation, on this service's database and clock
        self._used: ExpiringMap[bool] = ExpiringMap(USED_CACHE_ENTRIES)  # token hash -> until its expiry
        self._verified: ExpiringMap[Capability] = ExpiringMap(self.cfg.token_cache_entries)
        try:
            self.replay_outbox()
        except UompError as exc:  # audit.db unwritable (full disk): start anyway, the rows stay in the outbox
            log.warning("auth: audit outbox not replayed yet (%s)", exc.message)
        self.reload_keys()
        self.quota = QuotaLedger(self._quota_load, self._quota_persist)

    def _migrate(self) -> None:
        for table, column, decl in MIGRATIONS:
            cols = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if column not in cols:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    def replay_outbox(self) -> int:
        """Write audit rows whose rotation committed but whose audit write may not have (a crash)."""
        rows = self.db.execute("SELECT id, row FROM audit_outbox").fetchall()
        if not rows:
            return 0
        self.audit.write_now([tuple(json.loads(r["row"])) for r in rows])
        with transaction(self.db, what="session database"):
            self.db.executemany("DELETE FROM audit_outbox WHERE id=?", [(r["id"],) for r in rows])
        log.info("auth: %d audit row(s) replayed from the outbox", len(rows))
        return len(rows)

    # ------------------------------------------------------------------------------ keys

    def reload_keys(self) -> None:
        lifetime = max(self.cfg.token_lifetime_seconds, self.cfg.refresh_lifetime_seconds)
        self.signing = keyfiles.load_signing_key(self.paths)
        self.public_keys = keyfiles.load_public_keys(self.paths, now=self.clock(), max_token_lifetime=lifetime)
        self._verified.clear()

    # ------------------------------------------------------------------------- sessions

    def _row(self, session_id: str) -> SessionRow | None:
        """The session's row: from :attr:`rows` (see :class:`gateway.guard.sessions.SessionCache` for
        when it is dropped) or read and decoded; a live session past its expiry is expired first."""
        now = self.clock()
        row = self.rows.lookup(session_id, now)
        if row is not None:
            return row
        try:
            r = self.db.execute("SELECT * FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        except sqlite3.Error as exc:
            raise UompError(ErrorCode.STORE_UNAVAILABLE, "the session database is unavailable") from exc
        if r is None:
            return None
        row = decode_row(r)
        if row.status in LIVE and now >= row.expires_at:
            self._expire(row)
            return self._row(session_id)
        self.rows.keep(row)
        return row

    def session(self, session_id: str) -> SessionRow:
        row = self._row(session_id)
        if row is None:
            raise UompError(ErrorCode.SESSION_NOT_FOUND, "session does not exist", session_id=session_id)
        return row

    def _expire(self, row: SessionRow) -> None:
        """Expire a live session past its ``expires_at``, and write its ``session_expired`` event once:
        whichever sees the expiry first (a read, the sweep, a list, another process) makes the
        transition, and only that one writes the event. The event goes into ``audit_outbox`` in the
        transition's own transaction, so a crash before audit.db has it replays it on the next open
        (idempotent on its id)."""
        now = self.clock()
        event = make_row(
            session_id=row.session_id,
            agent_id=row.agent_id,
            action="session_expired",
            allowed=True,
            reason="the session reached its expiry",
            now=now,
        )
        with transaction(self.db, what="session database"):
            cur = self.db.execute(
                "UPDATE sessions SET status='expired', closed_at=?, status_reason=? WHERE "
                "session_id=? AND status IN ('created','active')",
                (now, "the session reached its expiry", row.session_id),
            )
            ended_here = cur.rowcount == 1
            if ended_here:
                self.db.execute("INSERT INTO audit_outbox (id, row) VALUES (?, ?)", (event[0], json.dumps(event)))
            self._blacklist_session(row.session_id, "expired")
        self.rows.forget(row.session_id)
        if ended_here:
            self.audit.submit(event)
            try:
                self.audit.flush_sync()
            except UompError as exc:  # audit.db unwritable now: the outbox keeps the event for the next open
                log.warning("auth: session_expired event kept in the outbox (%s)", exc.message)
        self._record_missing_proof(row)

    def _record_missing_proof(self, row: SessionRow) -> None:
        if not (row.retention or {}).get("proof_required") or row.deletion_proof_id:
            return
        cur = self.db.execute(
            "UPDATE sessions SET missing_proof_recorded=1 WHERE session_id=? AND missing_proof_recorded=0",
            (row.session_id,),
        )
        if cur.rowcount:
            self.audit.record(
                session_id=row.session_id,
                agent_id=row.agent_id,
                action="deletion_proof_missing",
                allowed=False,
                reason="session ended without the required deletion proof",
            )
            self.audit.flush_sync()

    def expire_due(self) -> int:
        """Sweep sessions past their expiry (called periodically by the server)."""
        now = self.clock()
        ids = [
            r[0]
            for r in self.db.execute(
                "SELECT session_id FROM sessions WHERE status IN ('created','active') AND expires_at <= ?", (now,)
            )
        ]
        for sid in ids:
            self._row(sid)
        return len(ids)

    def sweep(self) -> float | None:
        """:meth:`expire_due`, then the seconds until the next live session expires (None: none is
        live): the guard's sweeper sleeps that long."""
        self.expire_due()
        row = self.db.execute("SELECT MIN(expires_at) FROM sessions WHERE status IN ('created','active')").fetchone()
        return None if row[0] is None else max(0.0, float(row[0]) - self.clock())

    def create_session(self, body: Mapping[str, Any]) -> dict[str, Any]:
        agent_id = req_str(body, "agent_id")
        agent_name = body.get("agent_name")
        if agent_name is not None and (not isinstance(agent_name, str) or len(agent_name) > 256):
            raise UompError(ErrorCode.INVALID_REQUEST, "agent_name must be a string of at most 256 characters")
        read, write = scopes_from_body(body.get("requested_scopes"), "requested_scopes")
        profile = body.get("profile", "local")
        if profile not in PROFILES:
            raise UompError(ErrorCode.INVALID_REQUEST, "profile must be local or remote")
        most = self._session_max_minutes(profile)
        minutes = body.get("duration_minutes", DEFAULT_SESSION_MINUTES)
        if (
            isinstance(minutes, bool)
            or not isinstance(minutes, int | float)
            or not (MAX_DURATION_MINUTES_FLOOR <= minutes <= most)
        ):
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                f"duration_minutes must be a number from 1 to {most} for a {profile} "
                f"session ({minutes_text(most)}; the {MAX_SETTING[profile]} setting)",
            )
        identity = body.get("identity_public_jwk")
        if identity is not None:
            try:
                key = jose.load_public_jwk(identity)
            except ValueError as exc:
                raise UompError(ErrorCode.INVALID_REQUEST, f"identity_public_jwk is invalid: {exc}") from exc
            identity = jose.public_jwk(key)
        retention = body.get("data_retention_policy")
        if retention is not None and not isinstance(retention, dict):
            raise UompError(ErrorCode.INVALID_REQUEST, "data_retention_policy must be an object")
        now = self.clock()
        sid = new_id("sess")
        expires = now + float(minutes) * 60
        with transaction(self.db, what="session database"):
            self.db.execute(
                "INSERT INTO sessions (session_id, agent_id, agent_name, status, created_at, expires_at, "
                "requested_scopes, identity_jwk, retention) VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    sid,
                    agent_id,
                    agent_name,
                    "created",
                    now,
                    expires,
                    scopes_json(read, write),
                    json.dumps(identity) if identity else None,
                    json.dumps(retention) if retention else None,
                ),
            )
        self.audit.record(
            session_id=sid, agent_id=agent_id, action="session_created", allowed=True, reason="created by the user"
        )
        self.audit.flush_sync()
        return {
            "session_id": sid,
            "status": "created",
            "agent_id": agent_id,
            "requested_scopes": json.loads(scopes_json(read, write)),
            "expires_at": tokens.iso(expires),
        }

    def grant(self, session_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        row = self.session(session_id)
        if row.status != "created":
            raise UompError(
                ErrorCode.INVALID_STATE,
                f"session is {row.status}; only a created session can be granted",
                session_id=session_id,
            )
        read, write = scopes_from_body(body.get("granted_scopes"), "granted_scopes")
        req_read = tokens.parse_scope(row.requested.get("read"), "read")
        req_write = tokens.parse_scope(row.requested.get("write"), "write")
        widen = opt_bool(body, "widen")
        # The fields a token returns: the narrower of the scope's and the top-level claim's, written
        # into both so that every reader of the token sees the same limit.
        fields = restrictions.effective_fields(read.allowed_fields, opt_str_list(body, "allowed_fields"))
        read = dataclasses.replace(read, allowed_fields=fields)
        wider = restrictions.widenings(read, req_read) + [
            "write " + w for w in restrictions.widenings(write, req_write)
        ]
        if wider and not widen:
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                "the grant is wider than the agent asked for ("
                + "; ".join(wider)
                + '); pass "widen": true to grant that',
                session_id=session_id,
            )
        # A write scope lets the agent propose changes only; each waits for the user's approval
        # (§20.4, gateway/guard/proposals.py). High-sensitivity items are refused at request time
        # (and a grant naming one by key, by the grant route).
        profile = body.get("profile", "local")
        if profile not in PROFILES:
            raise UompError(ErrorCode.INVALID_REQUEST, "profile must be local or remote")
        most = self._session_max_minutes(profile)
        if row.expires_at - row.created_at > most * 60 + 1e-3:
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                f"this session lasts longer than a {profile} session may "
                f"({minutes_text(most)}); create it with a shorter duration_minutes"
                + (' or "profile": "remote"' if profile == "local" else ""),
                session_id=session_id,
            )
        audience = body.get("audience")
        if audience is not None and (not isinstance(audience, str) or not audience or len(audience) > 512):
            raise UompError(ErrorCode.INVALID_REQUEST, "audience must be a URL string")
        if profile == "remote" and not audience:
            raise UompError(ErrorCode.INVALID_REQUEST, "a remote-profile grant needs the gateway endpoint as audience")
        if profile == "local" and audience is None:
            audience = f"http://127.0.0.1:{self.cfg.tcp_port}"
        limits = body.get("limits") or {}
        if not isinstance(limits, dict):
            raise UompError(ErrorCode.INVALID_REQUEST, "limits must be an object")
        mrq = limits.get("max_read_queries", limits.get("maxReadQueries", self.cfg.default_max_read_queries))
        if isinstance(mrq, bool) or not isinstance(mrq, int) or mrq < 0:
            raise UompError(ErrorCode.INVALID_REQUEST, "limits.max_read_queries must be a non-negative integer")
        cnf = body.get("cnf")
        if cnf is not None:
            if (
                not isinstance(cnf, dict)
                or not set(cnf) <= {"x5t#S256", "jkt"}
                or not all(isinstance(v, str) and len(v) == 43 for v in cnf.values())
            ):
                raise UompError(ErrorCode.INVALID_REQUEST, "cnf must hold x5t#S256 and/or jkt SHA-256 thumbprints")
        issue_refresh = opt_bool(body, "refresh")
        if issue_refresh and (profile != "remote" or not cnf):
            raise UompError(ErrorCode.INVALID_REQUEST, "refresh tokens are issued only for remote, key-bound grants")
        options: dict[str, Any] = {
            "profile": profile,
            "audience": audience,
            "allowed_endpoints": opt_str_list(body, "allowed_endpoints"),
            "allowed_fields": None if fields is None else list(fields),
            "aggregation_only": opt_bool(body, "aggregation_only"),
            "task_bound": opt_bool(body, "task_bound"),
            # docs/aggregates.md: both off unless the user grants them knowingly
            "aggregate_min_max": opt_bool(body, "aggregate_min_max"),
            "aggregate_exact": opt_bool(body, "aggregate_exact"),
            "max_read_queries": mrq,
            "max_write_queries": 0 if write.is_empty() else self._max_write(limits),
            "cnf": cnf,
            "lifetime": self._lifetime(profile, body.get("token_lifetime_seconds")),
        }
        granted = scopes_json(read, write)
        with transaction(self.db, what="session database"):
            cur = self.db.execute(
                "UPDATE sessions SET status='active', granted_scopes=?, grant_options=? "
                "WHERE session_id=? AND status='created'",
                (granted, json.dumps(options), session_id),
            )
            if cur.rowcount != 1:
                raise UompError(
                    ErrorCode.INVALID_STATE, "session changed state during the grant", session_id=session_id
                )
        self.rows.forget(session_id)
        row = self.session(session_id)
        access = self.mint_access(row)
        out: dict[str, Any] = {
            "token": access.token,
            "token_type": "Bearer",
            "expires_at": tokens.iso(access.exp),
            "session_id": session_id,
            "session_expires_at": tokens.iso(row.expires_at),
        }
        minted = [access]
        if issue_refresh:
            rt = self.mint_refresh(row, family_id=new_id("fam"))
            minted.append(rt)
            out["refresh_token"] = rt.token
            out["refresh_expires_at"] = tokens.iso(rt.exp)
        with transaction(self.db, what="session database"):
            self.record_minted(row, minted)
        self.audit.record(
            session_id=session_id,
            agent_id=row.agent_id,
            action="session_granted",
            allowed=True,
            reason="granted by the user",
            tags=list(read.tags),
            extra={"expires_at": int(row.expires_at)},
        )  # SessionGranted's expiresAt (§18.4.1)
        self.audit.flush_sync()
        return out

    def _max_write(self, limits: Mapping[str, Any]) -> int:
        """The proposals a write grant may make in all: the grant's ``max_write_queries``, never
        more than ``[guard] write_max_per_session``."""
        mwq = limits.get("max_write_queries", limits.get("maxWriteQueries", self.cfg.write_max_per_session))
        if isinstance(mwq, bool) or not isinstance(mwq, int) or mwq < 0:
            raise UompError(ErrorCode.INVALID_REQUEST, "limits.max_write_queries must be a non-negative integer")
        return min(mwq, self.cfg.write_max_per_session)

    def _session_max_minutes(self, profile: str) -> int:
        return self.cfg.remote_session_max_minutes if profile == "remote" else self.cfg.session_max_minutes

    def _lifetime(self, profile: str, requested: Any) -> int:
        """Access token lifetime: the config's, or shorter on request; remote never over 10 minutes (§15.2)."""
        if profile == "remote":
            cap = min(self.cfg.remote_token_lifetime_seconds, REMOTE_ACCESS_MAX_SECONDS)
        else:
            cap = self.cfg.token_lifetime_seconds
        if requested is None:
            return cap
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 10:
            raise UompError(ErrorCode.INVALID_REQUEST, "token_lifetime_seconds must be an integer >= 10")
        return min(requested, cap)

    def mint_access(self, row: SessionRow) -> Minted:
        """Sign an access token for an active session (not yet recorded: see _record_minted)."""
        now = self.clock()
        o = row.options
        exp = min(now + o["lifetime"], row.expires_at)  # never past the session's expiry
        assert row.granted is not None
        claims = tokens.capability_claims(
            session_id=row.session_id,
            agent_id=row.agent_id,
            now=now,
            expires=exp,
            read=tokens.parse_scope(row.granted.get("read"), "read"),
            write=tokens.parse_scope(row.granted.get("write"), "write"),
            max_read_queries=o["max_read_queries"],
            max_write_queries=int(o.get("max_write_queries", 0)),
            profile=o["profile"],
            audience=o["audience"],
            allowed_endpoints=o["allowed_endpoints"],
            allowed_fields=o["allowed_fields"],
            aggregation_only=o["aggregation_only"],
            task_bound=o["task_bound"],
            cnf=o["cnf"],
        )
        tok = tokens.sign_token(claims, self.signing.key, self.signing.kid)
        return Minted(tok, exp, claims["jti"], "access", None)

    def mint_refresh(self, row: SessionRow, *, family_id: str) -> Minted:
        now = self.clock()
        exp = min(now + self.cfg.refresh_lifetime_seconds, row.expires_at)
        claims = tokens.refresh_claims(
            session_id=row.session_id,
            agent_id=row.agent_id,
            now=now,
            expires=exp,
            family_id=family_id,
            audience=row.options.get("audience"),
            cnf=row.options.get("cnf"),
        )
        tok = tokens.sign_token(claims, self.signing.key, self.signing.kid, refresh=True)
        return Minted(tok, exp, claims["jti"], "refresh", family_id)

    def record_minted(self, row: SessionRow, minted: list[Minted]) -> None:
        """Record tokens by hash (for the blacklist) and refresh tokens by jti. Inside a transaction.

        Only hashes and ids are stored: no token is ever kept at rest."""
        for m in minted:
            th = token_hash(m.token)
            self.db.execute(
                "INSERT INTO issued_tokens (token_hash, session_id, jti, kind, expires_at) VALUES (?,?,?,?,?)",
                (th, row.session_id, m.jti, m.kind, m.exp),
            )
            if m.kind == "access":
                self.db.execute("UPDATE sessions SET token_hash=? WHERE session_id=?", (th, row.session_id))
            else:
                self.db.execute(
                    "INSERT INTO refresh_tokens (jti, family_id, session_id, status, expires_at) VALUES (?,?,?,?,?)",
                    (m.jti, m.family_id, row.session_id, "active", m.exp),
                )

    def _blacklist_session(self, session_id: str, reason: str) -> None:
        """Copy every token issued for the session into the persistent blacklist (§13.4). In a transaction."""
        self.db.execute(
            "INSERT OR IGNORE INTO token_blacklist (token_hash, session_id, expires_at, reason) "
            "SELECT token_hash, session_id, expires_at, ? FROM issued_tokens WHERE session_id=?",
            (reason, session_id),
        )
        self.rows.blacklist_changed()
        self.db.execute(
            "UPDATE refresh_tokens SET status='revoked' WHERE session_id=? AND status!='revoked'", (session_id,)
        )

    def _end(self, session_id: str, status: str, *, reason: str) -> dict[str, Any]:
        row = self.session(session_id)
        if row.status not in LIVE:
            if row.status == status:
                return {"session_id": session_id, "status": status}
            raise UompError(ErrorCode.INVALID_STATE, f"session is already {row.status}", session_id=session_id)
        now = self.clock()
        with transaction(self.db, what="session database"):
            self.db.execute(
                "UPDATE sessions SET status=?, closed_at=?, status_reason=? WHERE session_id=?",
                (status, now, reason, session_id),
            )
            self._blacklist_session(session_id, status)
        self.rows.forget(session_id)
        self._verified.clear()
        self.quota.forget(session_id)
        self.audit.record(
            session_id=session_id,
            agent_id=row.agent_id,
            action="session_revoked" if status == "revoked" else "session_closed",
            allowed=True,
            reason=reason,
        )
        self.audit.flush_sync()
        self._record_missing_proof(row)
        return {"session_id": session_id, "status": status}

    def close(self, session_id: str, *, reason: str = "closed by the user") -> dict[str, Any]:
        return self._end(session_id, "closed", reason=reason)

    def revoke(self, session_id: str, *, reason: str = "revoked by the user") -> dict[str, Any]:
        return self._end(session_id, "revoked", reason=reason)

    def list_sessions(self, *, status: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        self.expire_due()
        sql = "SELECT session_id FROM sessions"
        args: tuple[Any, ...] = ()
        if status:
            sql += " WHERE status = ?"
            args = (status,)
        sql += " ORDER BY created_at DESC LIMIT ?"
        args += (max(1, min(limit, 1000)),)
        return [self.session(r[0]).public() for r in self.db.execute(sql, args).fetchall()]

    # --------------------------------------------------------------------------- tokens

    def cache_sizes(self) -> dict[str, int]:
        """Entries in the per-token caches (each holds live tokens only, gateway/core/tokencache.py)."""
        return {"verified": len(self._verified), "used": len(self._used), "not_blacklisted": self.rows.clean_count}

    def verify(self, token: str, th: str | None = None) -> Capability:
        """Signature + exp/expires_at, cached by token hash (``th``, computed if not given).
        Session status is NOT checked here."""
        now = self.clock()
        th = th or token_hash(token)
        cap = self._verified.get(th, now)
        if cap is not None:
            return cap
        cap = tokens.verify_token(token, self.public_keys, now=now)
        remember_verified(self._verified, th, cap, now)
        return cap

    def authenticate(
        self,
        token: str,
        *,
        allow_refresh: bool = False,
        presented: checks.Presented | None = None,
        th: str | None = None,
    ) -> tuple[Capability, SessionRow]:
        """§10.4 steps 1-4: signature, expiry, then (given what the listener ``presented``) the shared
        checks of :mod:`gateway.core.checks` in their order, then session status (every request) and
        the blacklist. ``th`` is :func:`token_hash` of ``token`` when the caller has it already."""
        th = th or token_hash(token)
        cap = self.verify(token, th)
        if presented is not None:
            checks.run_checks(cap, presented)
        if cap.is_refresh and not allow_refresh:
            raise UompError(ErrorCode.INVALID_TOKEN, "a refresh token cannot be used here", session_id=cap.session_id)
        if not cap.is_refresh and allow_refresh:
            raise UompError(
                ErrorCode.INVALID_TOKEN, "an access token cannot be used to refresh", session_id=cap.session_id
            )
        row = self._row(cap.session_id)
        if row is None:
            raise UompError(ErrorCode.SESSION_NOT_FOUND, "session does not exist", session_id=cap.session_id)
        if row.agent_id != cap.agent_id:
            raise UompError(
                ErrorCode.INVALID_TOKEN, "token agent does not match the session", session_id=cap.session_id
            )
        if row.status == "expired":
            raise UompError(ErrorCode.TOKEN_EXPIRED, "session has expired", session_id=cap.session_id)
        if row.status != "active":
            raise UompError(ErrorCode.SESSION_REVOKED, ended_message(row), session_id=cap.session_id)
        # the blacklist, unless this token was seen absent from it with auth.db unchanged since
        now = self.clock()
        hit = (
            None
            if self.rows.not_blacklisted(th)
            else self.db.execute("SELECT reason FROM token_blacklist WHERE token_hash=?", (th,)).fetchone()
        )
        if hit is None:
            if not cap.is_refresh:  # a refresh token is spent by its one use: not worth keeping
                self.rows.keep_not_blacklisted(th, token_until(cap), now, session_id=cap.session_id)
        else:
            if hit[0] == "superseded":
                self.refreshes.chain_forked(row)
            raise UompError(ErrorCode.SESSION_REVOKED, "token has been revoked", session_id=cap.session_id)
        if not cap.is_refresh:
            self._note_use(th, token_until(cap), now, session_id=cap.session_id)
        return cap, row

    def _note_use(self, th: str, until: float, now: float, *, session_id: str) -> None:
        """Record an access token's first use, durably, before the request is answered (refresh rule).
        Remembered per session (the newest tokens): a token that went from the set is looked up again,
        and the UPDATE only ever sets a first use."""
        if self._used.get(th, now):
            return
        try:
            self.db.execute(
                "UPDATE issued_tokens SET used_at=? WHERE token_hash=? AND used_at IS NULL", (self.clock(), th)
            )
        except sqlite3.Error as exc:
            raise UompError(ErrorCode.STORE_UNAVAILABLE, "the session database is unavailable") from exc
        self._used.put(th, True, until, now, group=session_id)  # gateway/core/tokencache.py

    def validate(self, token: Any) -> dict[str, Any]:
        """POST /v1/tokens/validate: {valid, session_id, expires_at, status?, code?}. Never raises for a
        bad token; raises when the Auth Service could not decide (any 5xx: STORE_UNAVAILABLE, STORE_BUSY,
        ...), which is not a verdict about the token and must not be cached or passed on as one."""
        if not isinstance(token, str):
            raise UompError(ErrorCode.INVALID_REQUEST, "token must be a string")
        try:
            cap, row = self.authenticate(token, allow_refresh=False)
        except UompError as exc:
            if exc.status >= 500:
                raise
            out: dict[str, Any] = {"valid": False, "code": exc.code, "message": exc.message}
            if exc.session_id:
                out["session_id"] = exc.session_id
            return out
        return {
            "valid": True,
            "session_id": cap.session_id,
            "agent_id": cap.agent_id,
            "expires_at": tokens.iso(cap.expires_at),
            "status": row.status,
        }

    def record_deletion_proof(self, session_id: str, deletion_proof_id: str) -> None:
        """Remember the accepted proof (§19.4); a session with one records no deletion_proof_missing."""
        with transaction(self.db, what="session database"):
            self.db.execute(
                "UPDATE sessions SET deletion_proof_id=? WHERE session_id=?", (deletion_proof_id, session_id)
            )
        self.rows.forget(session_id)

    # ---------------------------------------------------------------------------- quota

    def _quota_load(self, session_id: str) -> int:
        r = self.db.execute("SELECT reserved FROM quota WHERE session_id=?", (session_id,)).fetchone()
        return int(r[0]) if r else 0

    def _quota_persist(self, session_id: str, mark: int) -> None:
        with transaction(self.db, what="session database"):
            self.db.execute(
                "INSERT INTO quota (session_id, reserved) VALUES (?,?) ON CONFLICT(session_id) "
                "DO UPDATE SET reserved=excluded.reserved",
                (session_id, mark),
            )

    def consume_read(self, cap: Capability, row: SessionRow) -> int | None:
        """§10.4 step 5 (enforced here, though the draft leaves it optional). Returns the remaining count.

        The limit is the session's grant (``max_read_queries`` as the user granted it), never the
        token's own ``limits`` claim: §7.2 makes that claim OPTIONAL, and a token another issuer
        signed with the user's key may carry any number there."""
        remaining = self.quota.consume(cap.session_id, row.options.get("max_read_queries"))
        if remaining == -1:
            raise UompError(ErrorCode.QUOTA_EXCEEDED, "read query quota is exhausted", session_id=cap.session_id)
        return remaining

    # ------------------------------------------------------------------------- refresh

    def refresh(
        self, refresh_token: str, *, session_id: str, presented_x5t: str | None, presented_jkt: str | None
    ) -> dict[str, Any]:
        answer, _ = self.refresh_audited(
            refresh_token, session_id=session_id, presented_x5t=presented_x5t, presented_jkt=presented_jkt
        )
        return answer

    def refresh_audited(
        self,
        refresh_token: str,
        *,
        session_id: str,
        presented_x5t: str | None,
        presented_jkt: str | None,
        extra: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], int]:
        """§15.5 rotation with reuse detection (:class:`gateway.guard.refresh.RefreshRotation`): the answer and the
        audit ticket to wait for before answering."""
        return self.refreshes.rotate(
            refresh_token,
            session_id=session_id,
            presented_x5t=presented_x5t,
            presented_jkt=presented_jkt,
            extra=extra,
        )

    def prune(self, *, now: float | None = None, batch: int = PRUNE_BATCH_ROWS) -> dict[str, int]:
        """Drop rows nothing can need any more (called periodically by the guard and at open).

        A token past its ``exp`` (plus :data:`PRUNE_MARGIN_SECONDS` of clock leeway) fails signature
        verification on its own, so its issued/refresh/blacklist rows can go; outbox rows are replayed
        (idempotent) and dropped. At most ``batch`` rows per table per call, so a sweep never stalls."""
        cutoff = (self.clock() if now is None else now) - PRUNE_MARGIN_SECONDS
        out = {"audit_outbox": self.replay_outbox()}
        with transaction(self.db, what="session database"):
            for table in ("token_blacklist", "issued_tokens", "refresh_tokens"):
                cur = self.db.execute(
                    f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} WHERE expires_at < ? LIMIT ?)",
                    (cutoff, batch),
                )
                out[table] = int(cur.rowcount)
        if any(out.values()):
            log.info("auth: pruned %s", ", ".join(f"{n} {t}" for t, n in out.items() if n))
        return out

    def close_db(self) -> None:
        self.quota.flush()
        self.db.close()
