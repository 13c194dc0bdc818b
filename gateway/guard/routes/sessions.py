"""Session management (the user's admin credential), token validation, and the agent's deletion
proof (§19).

An agent's calls about its OWN session (spec §9.3, §9.5): close it, read its status, validate its
token. The reference SDK's ``session.close``, ``session.isActive`` and ``auth.validate`` use them.

The three paths are shared with the management API, so each handler first decides who is asking:

* anything but an agent token (the user's admin credential, a wrong one, none): the management
  call (any session with the admin credential, 401 UNAUTHORIZED without it);
* the gateway's internal status check (``POST /v1/tokens/validate`` on the Unix socket with neither
  an ``Authorization`` header nor the gateway's assertion): ``{valid, code ...}`` for any token;
* an agent token (the gateway's assertion, or a compact JWS): authenticated exactly as on a read
  (§10.4 steps 1-4: the gateway's assertion on the socket, the Local Profile's checks on the TCP
  listener), without the read quota, and the call is refused unless it names the token's own session:

  ``POST /v1/sessions/{id}/close``  ``{"session_id", "status": "closed"}``; another id: 403
  ACCESS_DENIED. The session ends as when the user closes it (its tokens blacklisted at once).
  ``GET /v1/sessions/{id}``  the session's own view (:meth:`SessionRow.public`); another id: 403.
  ``POST /v1/tokens/validate``  body ``{"token": T}`` with T the token of the ``Authorization``
  header (or no body): ``{"valid": true, "session_id", "agent_id", "expires_at", "status"}``.
  Another token in the body: 403 ACCESS_DENIED (an agent validates only itself).

A token whose session ended, expired or is unknown fails its own authentication, so these answer
401 with that code (SESSION_REVOKED, TOKEN_EXPIRED, ...): ``isActive`` is false on any non-2xx.
Every agent call is one audit event (``session_close``, ``session_status``, ``token_validate``),
allowed or refused. No other management call accepts an agent token: they stay admin-only (401).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time

from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway import httpd
from gateway.core import deletion, jose
from gateway.core.tokens import iso
from gateway.errors import ErrorCode, UompError
from gateway.guard.agent_call import AgentCall, answer_refusal
from gateway.guard.http import LISTENER, SERVICES, is_asserted, json_body, json_response, query_param, require_admin
from gateway.guard.proposal_rules import write_grant_problem

# ---------------------------------------------------------------------------- sessions


async def create_session(request: httpd.Request) -> httpd.Response:
    """``POST /v1/sessions`` (admin): a session in state ``created`` for an agent's request."""
    require_admin(request)
    svc = request.app[SERVICES]
    return json_response(await svc.authdb(svc.auth.create_session, await json_body(request)), 201)


async def grant_session(request: httpd.Request) -> httpd.Response:
    """``POST /v1/sessions/{id}/grant`` (admin): the user's grant, and the session's tokens."""
    require_admin(request)
    body = await json_body(request)
    svc = request.app[SERVICES]
    problem = await asyncio.to_thread(write_grant_problem, svc.store, body)
    if problem is not None:
        raise UompError(ErrorCode.ACCESS_DENIED, problem + "; leave that key out of the write grant")
    return json_response(await svc.authdb(svc.auth.grant, request.match_info["sid"], body))


async def close_session(request: httpd.Request) -> httpd.Response:
    """``POST /v1/sessions/{id}/close`` for the user (admin)."""
    require_admin(request)
    svc = request.app[SERVICES]
    return json_response(await svc.authdb(svc.auth.close, request.match_info["sid"]))


async def revoke_session(request: httpd.Request) -> httpd.Response:
    """``POST /v1/sessions/{id}/revoke`` (admin): the session ends and its tokens are blacklisted."""
    require_admin(request)
    svc = request.app[SERVICES]
    return json_response(await svc.authdb(svc.auth.revoke, request.match_info["sid"]))


async def list_sessions(request: httpd.Request) -> httpd.Response:
    """``GET /v1/sessions`` (admin), optionally of one status."""
    require_admin(request)
    status = query_param(request, "status", required=False)
    svc = request.app[SERVICES]
    return json_response({"sessions": await svc.authdb(functools.partial(svc.auth.list_sessions, status=status))})


async def get_session(request: httpd.Request) -> httpd.Response:
    """``GET /v1/sessions/{id}`` for the user (admin)."""
    require_admin(request)
    svc = request.app[SERVICES]
    return json_response((await svc.authdb(svc.auth.session, request.match_info["sid"])).public())


async def validate_token(request: httpd.Request) -> httpd.Response:
    """``POST /v1/tokens/validate`` for the user or the gateway's status check: ``{valid, ...}`` for any token."""
    body = await json_body(request)
    svc = request.app[SERVICES]
    return json_response(await svc.authdb(svc.auth.validate, body.get("token")))


async def deletion_proof(request: httpd.Request) -> httpd.Response:
    """``POST /v1/sessions/{id}/deletion-proof``: the agent's signed §19 deletion proof, checked and recorded."""
    svc = request.app[SERVICES]
    sid = request.match_info["sid"]
    call = AgentCall(request, "deletion_proof")
    try:
        cap = await call.authenticate()
        if cap.session_id != sid:
            raise UompError(ErrorCode.ACCESS_DENIED, "token is for another session", session_id=cap.session_id)
        body = await json_body(request)
        proof = deletion.parse_deletion_proof(body)
        row = call.row
        assert row is not None
        key = None
        if row.identity_jwk:
            loaded = jose.load_public_jwk(row.identity_jwk)
            key = loaded if isinstance(loaded, ed25519.Ed25519PublicKey) else None
        deletion.verify_deletion_proof(
            proof,
            path_session_id=sid,
            token_session_id=cap.session_id,
            token_agent_id=cap.agent_id,
            token_expires_at=cap.expires_at,
            agent_public_key=key,
            declared_method=(row.retention or {}).get("deletion_method"),
            now=time.time(),
        )
    except UompError as exc:
        if call.cap is not None:
            call.record(False, exc.message, exc.code)
        await svc.audit.flush(call.ticket)
        raise
    await svc.authdb(svc.auth.record_deletion_proof, sid, proof.deletion_proof_id)
    call.allow("deletion proof verified", proof.deletion_proof_id)
    call.fields["memory_hash"] = proof.memory_hash  # what its deletionProofHash (§19.6) is made of
    if cap.task_bound and row.status == "active":
        await svc.authdb(
            functools.partial(svc.auth.close, sid, reason="task-bound session closed after its deletion proof")
        )
    return await call.respond({"status": "accepted", "deletion_proof_id": proof.deletion_proof_id})


# ----------------------------------------------------- an agent's calls about its own session


def _is_agent(request: httpd.Request) -> bool:
    """An agent's request: the gateway's assertion on the socket, or a token that has the form of a
    capability token (a compact JWS). Anything else (the admin credential, a wrong one, none) is
    for the management handler, which answers 401 UNAUTHORIZED unless it is the admin credential."""
    if is_asserted(request):
        return True
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    value = value.strip()
    return scheme.lower() in ("bearer", "dpop") and value.count(".") == 2 and not value.startswith("uadm_")


def _own(call: AgentCall, session_id: str, what: str) -> None:
    cap = call.cap
    assert cap is not None
    if not hmac.compare_digest(cap.session_id.encode(), session_id.encode()):
        raise UompError(
            ErrorCode.ACCESS_DENIED,
            f"an agent token may {what} only its own session; use this token's session_id",
            session_id=cap.session_id,
        )


async def session_close(request: httpd.Request) -> httpd.Response:
    """``POST /v1/sessions/{sid}/close``: the user's (admin) or the agent's own."""
    if not _is_agent(request):
        return await close_session(request)
    svc = request.app[SERVICES]
    sid = request.match_info["sid"]
    call = AgentCall(request, "session_close")
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await answer_refusal(call, exc)
    try:
        _own(call, sid, "close")
        answer = await svc.authdb(functools.partial(svc.auth.close, sid, reason="closed by the agent"))
    except UompError as exc:
        return await call.refuse(exc)
    call.allow("own session closed", cap.session_id)
    return await call.respond(answer)


async def session_status(request: httpd.Request) -> httpd.Response:
    """``GET /v1/sessions/{sid}``: the user's (admin) view of any session, or the agent's own."""
    if not _is_agent(request):
        return await get_session(request)
    svc = request.app[SERVICES]
    sid = request.match_info["sid"]
    call = AgentCall(request, "session_status")
    try:
        await call.authenticate()
    except UompError as exc:
        return await answer_refusal(call, exc)
    try:
        _own(call, sid, "read the status of")
        row = await svc.authdb(svc.auth.session, sid)
    except UompError as exc:
        return await call.refuse(exc)
    call.allow("own session", row.status)
    return await call.respond(row.public())


async def token_validate(request: httpd.Request) -> httpd.Response:
    """``POST /v1/tokens/validate``: the gateway's status check and the user's (any token), or an
    agent validating its own token."""
    if not _is_agent(request):
        if request.app[LISTENER] != "unix" or "Authorization" in request.headers:
            require_admin(request)  # off the socket, or with a credential: the user's only
        return await validate_token(request)
    call = AgentCall(request, "token_validate")
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await answer_refusal(call, exc)
    try:
        body = await json_body(request)
        presented = request.headers["Authorization"].partition(" ")[2].strip()
        token = body.get("token", presented)
        if not isinstance(token, str):
            raise UompError(ErrorCode.INVALID_REQUEST, "token must be a string", session_id=cap.session_id)
        if not hmac.compare_digest(token.encode(), presented.encode()):
            raise UompError(
                ErrorCode.ACCESS_DENIED,
                "an agent may validate only the token it presents; send the same token in the body "
                "as in the Authorization header (or no body)",
                session_id=cap.session_id,
            )
        row = call.row
        assert row is not None
    except UompError as exc:
        return await call.refuse(exc)
    call.allow("own token", cap.session_id)
    return await call.respond(
        {
            "valid": True,
            "session_id": cap.session_id,
            "agent_id": cap.agent_id,
            "expires_at": iso(cap.expires_at),
            "status": row.status,
        }
    )
