"""An agent's view of the audit log: its events, an event's inclusion proof, checkpoints."""

from __future__ import annotations

import functools

from gateway import httpd
from gateway.errors import ErrorCode, UompError
from gateway.guard.agent_call import AgentCall, answer_refusal
from gateway.guard.audit import (
    MAX_AUDIT_PAGE,
    anchor_chain,
)
from gateway.guard.http import SERVICES, json_response, page_limit, query_param


async def get_audit(request: httpd.Request) -> httpd.Response:
    """``GET /v1/audit``: the agent's own session's events, paged."""
    svc = request.app[SERVICES]
    call = AgentCall(request, "audit")
    try:
        cap = await call.authenticate()  # the same checks as every agent route (refusals are audited)
    except UompError as exc:
        return await answer_refusal(call, exc)
    sid = query_param(request, "session_id", required=False)
    if sid is not None and sid != cap.session_id:
        raise UompError(
            ErrorCode.ACCESS_DENIED, "an agent may read only its own session's audit log", session_id=cap.session_id
        )
    # ASCII digits only, like every other limit: int() would also take "+5", " 5", "1_0" and "٥"
    limit = page_limit(request, MAX_AUDIT_PAGE) or 100
    await svc.audit.flush()
    return json_response(
        {"logs": await svc.audit.reader.run(functools.partial(svc.audit.for_session, cap.session_id, limit=limit))}
    )


async def get_audit_proof(request: httpd.Request) -> httpd.Response:
    """``GET /v1/audit/{event_id}/proof``: the proof bundle of one of the agent's *own
    session's* events, as ``uomp audit proof`` writes it. Another session's event and an unknown id
    answer the same 404 NOT_FOUND (spec §21); see :meth:`AuditLog.proof_for_session`."""
    svc = request.app[SERVICES]
    event_id = request.match_info["event_id"]
    call = AgentCall(request, "audit_proof", key=event_id[:128])
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await answer_refusal(call, exc)
    try:
        since = _since(request, cap.session_id)
        bundle = await svc.audit.reader.run(
            lambda: svc.audit.proof_for_session(event_id, cap.session_id, chain=anchor_chain(svc.paths), since=since)
        )  # config read off the loop too
    except UompError as exc:
        return await call.refuse(exc)
    call.allow("own session's event", f"proof at tree size {bundle['tree_size']}")
    return await call.respond(bundle)


MAX_SINCE_DIGITS = 20  # a tree size (checkpoint.MAX_TREE_SIZE) in ASCII digits


def _since(request: httpd.Request, session_id: str) -> int | None:
    """``since=SIZE``: a tree size the agent saw signed, ASCII digits only; absent: None."""
    raw = query_param(request, "since", required=False, max_len=MAX_SINCE_DIGITS)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise UompError(ErrorCode.INVALID_REQUEST, "since must be a tree size (ASCII digits)", session_id=session_id)
    return int(raw)


async def get_audit_checkpoint(request: httpd.Request) -> httpd.Response:
    """``GET /v1/audit/checkpoint?since=SIZE``: the log's newest signed checkpoint, and the RFC 9162
    consistency proof from ``SIZE`` (the last size the agent verified) to it, so an agent can check
    that the log it is shown extends the one it saw (docs/audit.md "Agents as witnesses"). Same
    authentication as the other audit routes; not a read (no quota); an ``audit_checkpoint`` event."""
    svc = request.app[SERVICES]
    call = AgentCall(request, "audit_checkpoint")
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await answer_refusal(call, exc)
    try:
        since = _since(request, cap.session_id)
        answer = await svc.audit.reader.run(lambda: svc.audit.checkpoint_since(since, cap.session_id))
    except UompError as exc:
        return await call.refuse(exc)
    call.allow("checkpoint", f"tree size {answer['tree_size']}" + ("" if since is None else f" since {since}"))
    return await call.respond(answer)
