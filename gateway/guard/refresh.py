"""Refresh-token rotation of the Auth Service (:class:`gateway.guard.auth.AuthService`).

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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.core import checks, tokens
from gateway.db import transaction
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.guard.audit import make_row
from gateway.guard.sessions import LIVE, REUSE_MESSAGE, SUPERSEDED_MESSAGE, SessionRow

if TYPE_CHECKING:
    from gateway.guard.auth import AuthService


def refresh_audited(
    auth: AuthService,
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
    cap, row = auth.authenticate(refresh_token, allow_refresh=True)
    if cap.session_id != session_id:
        raise UompError(ErrorCode.INVALID_TOKEN, "refresh token is for another session", session_id=session_id)
    checks.check_possession(cap, presented_x5t, presented_jkt)
    now = auth.clock()
    r = auth.db.execute("SELECT * FROM refresh_tokens WHERE jti=?", (cap.jti,)).fetchone()
    if r is None:
        raise UompError(ErrorCode.INVALID_TOKEN, "refresh token is unknown", session_id=session_id)
    retry = False
    if r["status"] == "spent":
        if not r["successor"] or successor_used(auth, json.loads(r["successor"])):
            revoke_family(auth, row, r["family_id"], REUSE_MESSAGE)
            raise UompError(ErrorCode.REFRESH_REUSED, REUSE_MESSAGE, session_id=session_id)
        # Same key (the binding was checked above) and the successor pair was never used: the
        # client never got our answer. Issue a fresh pair and kill the pair it never received
        # (not stored, so it cannot be handed out again).
        retry = True
    elif r["status"] != "active":
        raise UompError(ErrorCode.SESSION_REVOKED, "refresh token has been revoked", session_id=session_id)
    access = auth.mint_access(row)
    new_rt = auth.mint_refresh(row, family_id=r["family_id"])
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
    with transaction(auth.db, what="session database"):  # one durable write for the whole rotation
        if retry:
            lost = json.loads(r["successor"])
            # the successor must still be unused at commit (nothing else runs between, but say so)
            cur = auth.db.execute(
                "UPDATE refresh_tokens SET successor=? WHERE jti=? AND status='spent' AND successor=?",
                (successor, cap.jti, r["successor"]),
            )
            used = (
                auth.db.execute(
                    "UPDATE refresh_tokens SET status='revoked' WHERE jti=? AND status='active'", (lost["refresh_jti"],)
                ).rowcount
                != 1
            )
            auth.db.execute(
                "INSERT OR IGNORE INTO token_blacklist (token_hash, session_id, expires_at, reason) "
                "SELECT token_hash, session_id, expires_at, 'superseded' FROM issued_tokens "
                "WHERE jti IN (?, ?)",
                (lost["access_jti"], lost["refresh_jti"]),
            )
            auth.rows.blacklist_changed()
            if used:
                raise UompError(ErrorCode.REFRESH_REUSED, "refresh token was spent concurrently", session_id=session_id)
        else:
            cur = auth.db.execute(
                "UPDATE refresh_tokens SET status='spent', spent_at=?, successor=? WHERE jti=? AND status='active'",
                (now, successor, cap.jti),
            )
        if cur.rowcount != 1:
            raise UompError(ErrorCode.REFRESH_REUSED, "refresh token was spent concurrently", session_id=session_id)
        auth.record_minted(row, [access, new_rt])
        # the audit row is durable with the rotation (replayed on open if audit.db missed it)
        auth.db.execute("INSERT INTO audit_outbox (id, row) VALUES (?, ?)", (audit_row[0], json.dumps(audit_row)))
    ticket = auth.audit.submit(audit_row)
    fault_point("refresh_committed")
    return answer, ticket


def successor_used(auth: AuthService, succ: Mapping[str, Any]) -> bool:
    """Was either token of a successor pair ever presented (or is it dead)?"""
    rt = auth.db.execute("SELECT status FROM refresh_tokens WHERE jti=?", (succ.get("refresh_jti"),)).fetchone()
    if rt is None or rt["status"] != "active":
        return True
    at = auth.db.execute(
        "SELECT used_at FROM issued_tokens WHERE jti=? AND kind='access'", (succ.get("access_jti"),)
    ).fetchone()
    return at is None or at["used_at"] is not None


def chain_forked(auth: AuthService, row: SessionRow) -> None:
    """A superseded token came back: revoke the session and say why (raises REFRESH_REUSED)."""
    auth.audit.record(
        session_id=row.session_id,
        agent_id=row.agent_id,
        action="refresh_reuse",
        allowed=False,
        reason="a superseded token was presented: session revoked",
    )
    if row.status in LIVE:
        auth.revoke(row.session_id, reason=SUPERSEDED_MESSAGE)
    else:
        auth.audit.flush_sync()
    raise UompError(ErrorCode.REFRESH_REUSED, SUPERSEDED_MESSAGE, session_id=row.session_id)


def revoke_family(auth: AuthService, row: SessionRow, family_id: str, reason: str) -> None:
    with transaction(auth.db, what="session database"):
        auth.db.execute("UPDATE refresh_tokens SET status='revoked' WHERE family_id=?", (family_id,))
    auth.audit.record(
        session_id=row.session_id,
        agent_id=row.agent_id,
        action="refresh_reuse",
        allowed=False,
        reason="spent refresh token reused: family and session revoked",
    )
    if row.status in LIVE:
        auth.revoke(row.session_id, reason=reason)
    else:
        auth.audit.flush_sync()


# --------------------------------------------------------------------------- pruning
