"""Session management (the user's admin credential), token validation, and the agent's deletion
proof (§19)."""

from __future__ import annotations

import functools
import time

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import deletion, jose
from gateway.errors import ErrorCode, UompError
from gateway.guard.agent_call import AgentCall
from gateway.guard.http import SERVICES, json_body, json_response, query_param, require_admin

# ---------------------------------------------------------------------------- sessions


async def create_session(request: web.Request) -> web.Response:
    require_admin(request)
    svc = request.app[SERVICES]
    return json_response(await svc.authdb(svc.auth.create_session, await json_body(request)), 201)


async def grant_session(request: web.Request) -> web.Response:
    require_admin(request)
    body = await json_body(request)
    svc = request.app[SERVICES]
    return json_response(await svc.authdb(svc.auth.grant, request.match_info["sid"], body))


async def close_session(request: web.Request) -> web.Response:
    require_admin(request)
    svc = request.app[SERVICES]
    return json_response(await svc.authdb(svc.auth.close, request.match_info["sid"]))


async def revoke_session(request: web.Request) -> web.Response:
    require_admin(request)
    svc = request.app[SERVICES]
    return json_response(await svc.authdb(svc.auth.revoke, request.match_info["sid"]))


async def list_sessions(request: web.Request) -> web.Response:
    require_admin(request)
    status = query_param(request, "status", required=False)
    svc = request.app[SERVICES]
    return json_response({"sessions": await svc.authdb(functools.partial(svc.auth.list_sessions, status=status))})


async def get_session(request: web.Request) -> web.Response:
    require_admin(request)
    svc = request.app[SERVICES]
    return json_response((await svc.authdb(svc.auth.session, request.match_info["sid"])).public())


async def validate_token(request: web.Request) -> web.Response:
    body = await json_body(request)
    svc = request.app[SERVICES]
    return json_response(await svc.authdb(svc.auth.validate, body.get("token")))


async def deletion_proof(request: web.Request) -> web.Response:
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
