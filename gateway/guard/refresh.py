"""Refresh-token rotation of the Auth Service: :class:`RefreshRotation`, which the Auth Service
(:class:`gateway.guard.auth.AuthService`) makes once and hands only what :class:`TokenIssuer` names
(its session database, clock and audit log; authenticate, mint, record, revoke).

Refresh tokens (§15.5, RFC 9700 §4.14.2): each refresh spends the presented refresh token and
returns a new pair (access + refresh) of the same family. The rotation commits before the answer
reaches the agent, so a crash (gateway, guard, network) can lose the answer. The rule:

* a spent refresh token whose successor pair has *never been used* (neither the successor access
  token nor the successor refresh token was ever presented) may be retried, by the same bound key,
  for as long as it is valid: each retry revokes the never-used successor pair (``superseded``)
  and issues a fresh one. No token is stored at rest to be handed out twice;
* once the successor has been used, any presentation of the old token is **reuse**
  (``REFRESH_REUSED``): the family and the session are revoked. Presenting a ``superseded`` token
  is reuse too: two holders of one chain exist (a copied bundle), so the chain stops there;
* the session then shows ``revoked`` with the reason in ``uomp sessions list``, and every later
  ``SESSION_REVOKED`` says why.

The first use of every access token is recorded (``issued_tokens.used_at``, durable before the
request is answered), which is what "used" means above.

The rotation and its audit row are durable together: the row is written into ``audit_outbox``
in the rotation's own transaction, then queued to the audit log as usual (the request is answered
after it is durable); on the next open, outbox rows are replayed into ``audit.db`` (idempotent on
the row id) and dropped. A crash between the two commits loses nothing.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gateway.core import checks, tokens
from gateway.core.capability import Capability
from gateway.db import transaction
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.guard.audit import AuditLog, make_row
from gateway.guard.sessions import LIVE, REUSE_MESSAGE, SUPERSEDED_MESSAGE, Minted, SessionCache, SessionRow


class TokenIssuer(Protocol):
    """What the rotation needs of the Auth Service: its session database (``db``, ``rows``: the
    rotation writes there in its own transactions), its clock and audit log, and the token steps."""

    db: sqlite3.Connection
    rows: SessionCache
    audit: AuditLog
    clock: Callable[[], float]

    def authenticate(self, token: str, *, allow_refresh: bool = ...) -> tuple[Capability, SessionRow]: ...

    def mint_access(self, row: SessionRow) -> Minted: ...

    def mint_refresh(self, row: SessionRow, *, family_id: str) -> Minted: ...

    def record_minted(self, row: SessionRow, minted: list[Minted]) -> None: ...

    def revoke(self, session_id: str, *, reason: str = ...) -> dict[str, Any]: ...


class RefreshRotation:
    """§15.5 rotation and reuse detection (the rule in the module docstring) over a :class:`TokenIssuer`."""

    def __init__(self, issuer: TokenIssuer) -> None:
        self.issuer = issuer

    def rotate(
        self,
        refresh_token: str,
        *,
        session_id: str,
        presented_x5t: str | None,
        presented_jkt: str | None,
        extra: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], int]:
        """§15.5 with rotation and reuse detection (the rule in the module docstring). Returns the
        answer and the audit ticket to wait for before answering. The caller has checked the transport
        binding inputs."""
        cap, row = self.issuer.authenticate(refresh_token, allow_refresh=True)
        if cap.session_id != session_id:
            raise UompError(ErrorCode.INVALID_TOKEN, "refresh token is for another session", session_id=session_id)
        checks.check_possession(cap, presented_x5t, presented_jkt)
        now = self.issuer.clock()
        r = self.issuer.db.execute("SELECT * FROM refresh_tokens WHERE jti=?", (cap.jti,)).fetchone()
        if r is None:
            raise UompError(ErrorCode.INVALID_TOKEN, "refresh token is unknown", session_id=session_id)
        retry = False
        if r["status"] == "spent":
            if not r["successor"] or self.successor_used(json.loads(r["successor"])):
                self.revoke_family(row, r["family_id"], REUSE_MESSAGE)
                raise UompError(ErrorCode.REFRESH_REUSED, REUSE_MESSAGE, session_id=session_id)
            # Same key (the binding was checked above) and the successor pair was never used: the
            # client never got our answer. Issue a fresh pair and kill the pair it never received
            # (not stored, so it cannot be handed out again).
            retry = True
        elif r["status"] != "active":
            raise UompError(ErrorCode.SESSION_REVOKED, "refresh token has been revoked", session_id=session_id)
        access = self.issuer.mint_access(row)
        new_rt = self.issuer.mint_refresh(row, family_id=r["family_id"])
        answer = {
            "access_token": access.token,
            "token": access.token,
            "token_type": "Bearer",
            "expires_at": tokens.iso(access.exp),
            "refresh_token": new_rt.token,
            "refresh_expires_at": tokens.iso(new_rt.exp),
            "session_id": session_id,
        }
        successor = json.dumps({"access_jti": access.jti, "refresh_jti": new_rt.jti})
        audit_row = make_row(
            session_id=session_id,
            agent_id=row.agent_id,
            action="refresh",
            allowed=True,
            reason="refresh retried: the never-used successor pair was replaced" if retry else "refresh token rotated",
            now=now,
            extra=extra,
        )
        with transaction(self.issuer.db, what="session database"):  # one durable write for the whole rotation
            if retry:
                lost = json.loads(r["successor"])
                # the successor must still be unused at commit (nothing else runs between, but say so)
                cur = self.issuer.db.execute(
                    "UPDATE refresh_tokens SET successor=? WHERE jti=? AND status='spent' AND successor=?",
                    (successor, cap.jti, r["successor"]),
                )
                used = (
                    self.issuer.db.execute(
                        "UPDATE refresh_tokens SET status='revoked' WHERE jti=? AND status='active'",
                        (lost["refresh_jti"],),
                    ).rowcount
                    != 1
                )
                self.issuer.db.execute(
                    "INSERT OR IGNORE INTO token_blacklist (token_hash, session_id, expires_at, reason) "
                    "SELECT token_hash, session_id, expires_at, 'superseded' FROM issued_tokens "
                    "WHERE jti IN (?, ?)",
                    (lost["access_jti"], lost["refresh_jti"]),
                )
                self.issuer.rows.blacklist_changed()
                if used:
                    raise UompError(
                        ErrorCode.REFRESH_REUSED, "refresh token was spent concurrently", session_id=session_id
                    )
            else:
                cur = self.issuer.db.execute(
                    "UPDATE refresh_tokens SET status='spent', spent_at=?, successor=? WHERE jti=? AND status='active'",
                    (now, successor, cap.jti),
                )
            if cur.rowcount != 1:
                raise UompError(ErrorCode.REFRESH_REUSED, "refresh token was spent concurrently", session_id=session_id)
            self.issuer.record_minted(row, [access, new_rt])
            # the audit row is durable with the rotation (replayed on open if audit.db missed it)
            self.issuer.db.execute(
                "INSERT INTO audit_outbox (id, row) VALUES (?, ?)", (audit_row[0], json.dumps(audit_row))
            )
        ticket = self.issuer.audit.submit(audit_row)
        fault_point("refresh_committed")
        return answer, ticket

    def successor_used(self, succ: Mapping[str, Any]) -> bool:
        """Was either token of a successor pair ever presented (or is it dead)?"""
        rt = self.issuer.db.execute(
            "SELECT status FROM refresh_tokens WHERE jti=?", (succ.get("refresh_jti"),)
        ).fetchone()
        if rt is None or rt["status"] != "active":
            return True
        at = self.issuer.db.execute(
            "SELECT used_at FROM issued_tokens WHERE jti=? AND kind='access'", (succ.get("access_jti"),)
        ).fetchone()
        return at is None or at["used_at"] is not None

    def chain_forked(self, row: SessionRow) -> None:
        """A superseded token came back: revoke the session and say why (raises REFRESH_REUSED)."""
        self.issuer.audit.record(
            session_id=row.session_id,
            agent_id=row.agent_id,
            action="refresh_reuse",
            allowed=False,
            reason="a superseded token was presented: session revoked",
        )
        if row.status in LIVE:
            self.issuer.revoke(row.session_id, reason=SUPERSEDED_MESSAGE)
        else:
            self.issuer.audit.flush_sync()
        raise UompError(ErrorCode.REFRESH_REUSED, SUPERSEDED_MESSAGE, session_id=row.session_id)

    def revoke_family(self, row: SessionRow, family_id: str, reason: str) -> None:
        with transaction(self.issuer.db, what="session database"):
            self.issuer.db.execute("UPDATE refresh_tokens SET status='revoked' WHERE family_id=?", (family_id,))
        self.issuer.audit.record(
            session_id=row.session_id,
            agent_id=row.agent_id,
            action="refresh_reuse",
            allowed=False,
            reason="spent refresh token reused: family and session revoked",
        )
        if row.status in LIVE:
            self.issuer.revoke(row.session_id, reason=reason)
        else:
            self.issuer.audit.flush_sync()
