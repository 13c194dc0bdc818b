"""The agent's side of staged writes (docs/writes.md), on both guard listeners and, forwarded, the
gateway's (mTLS and tunnel):

* ``PUT /v1/memory/{key}`` (body ``{"value", "tags"?, "sensitivity"?, "description"?,
  "base_version"?}``, or ``If-Match: "N"``) and ``DELETE /v1/memory/{key}``: with a write scope in
  the token, a proposal is stored (202 ``{"proposal_id", "status": "pending", "base_version", ...}``)
  and nothing in the store changes until the user approves it; without one, 403
  WRITE_NOT_AVAILABLE as before writes existed;
* ``GET /v1/proposals``: this session's own proposals and their outcome;
* ``POST /v1/proposals/{proposal_id}/withdraw``: take back one of this session's pending proposals
  (another session's, or an unknown id: 404 NOT_FOUND, the same answer).

Every request, allowed or refused, is one audit event of the requesting session (``write``,
``delete``, ``proposals``, ``proposal_withdraw``) with the proposal id; the value is never logged.
The proposals themselves are :mod:`gateway.guard.proposals` (:meth:`GuardServices.proposal_book`).
"""

from __future__ import annotations

import asyncio

from gateway import httpd
from gateway.errors import ErrorCode, UompError
from gateway.guard.agent_call import AgentCall, answer_refusal
from gateway.guard.http import GuardRoute, event_via, json_body
from gateway.guard.proposal_rules import WriteRefused

MAX_PROPOSAL_ID = 64


async def propose(request: httpd.Request) -> httpd.Response:
    """``PUT``/``DELETE /v1/memory/{key}``: a proposal under the token's write scope (202), nothing applied."""
    op = "put" if request.method == "PUT" else "delete"
    key = request.match_info["key"]
    call = AgentCall(request, "write" if op == "put" else "delete", key=key)
    svc = call.svc
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await answer_refusal(call, exc)
    if cap.write.is_empty():
        return await call.refuse(
            UompError(
                ErrorCode.WRITE_NOT_AVAILABLE,
                "this session has no write scope; agent writes need the user's write grant (spec §20.4)",
                session_id=cap.session_id,
            )
        )
    try:
        body = await json_body(request)
    except UompError as exc:
        return await call.refuse(UompError(exc.code, exc.message, session_id=cap.session_id))
    try:
        via = event_via(request)
        proposal, detail = await asyncio.to_thread(
            lambda: svc.proposal_book().propose(
                scope=cap.write,
                session_id=cap.session_id,
                agent_id=cap.agent_id,
                op=op,
                key=key,
                body=body if (body or op == "put") else None,
                if_match=request.headers.get("If-Match"),
                via=via,
                max_per_session=cap.max_write_queries,
            )
        )
    except WriteRefused as exc:
        return await call.refuse(exc, exc.audit_detail)
    except UompError as exc:
        if exc.session_id is None:
            exc = UompError(exc.code, exc.message, session_id=cap.session_id, details=exc.details)
        return await call.refuse(exc)
    call.fields["proposal_id"] = proposal.proposal_id
    call.allow("change proposed; it waits for the user's decision", detail)
    resp = await call.respond(proposal.summary())
    resp.status = 202
    resp.headers["Location"] = f"/v1/proposals/{proposal.proposal_id}"
    return resp


async def own_proposals(request: httpd.Request) -> httpd.Response:
    """``GET /v1/proposals``: the requesting session's own proposals and their outcome."""
    call = AgentCall(request, "proposals")
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await answer_refusal(call, exc)
    try:
        found = await asyncio.to_thread(lambda: call.svc.proposal_book().for_session(cap.session_id))
    except UompError as exc:
        return await call.refuse(exc)
    call.allow("own session's proposals", f"{len(found)} proposals")
    return await call.respond({"proposals": [p.summary() for p in found]})


async def withdraw(request: httpd.Request) -> httpd.Response:
    """``POST /v1/proposals/{id}/withdraw``: take back one of the session's own pending proposals."""
    pid = request.match_info["pid"][:MAX_PROPOSAL_ID]
    call = AgentCall(request, "proposal_withdraw")
    call.fields["proposal_id"] = pid
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await answer_refusal(call, exc)
    try:
        done = await asyncio.to_thread(lambda: call.svc.proposal_book().withdraw(pid, cap.session_id))
    except UompError as exc:
        return await call.refuse(exc)
    call.key = done.key
    call.allow("own pending proposal withdrawn", pid)
    return await call.respond(done.summary())


ROUTES: tuple[GuardRoute, ...] = (
    GuardRoute("PUT", "/v1/memory/{key}", propose),
    GuardRoute("DELETE", "/v1/memory/{key}", propose),
    GuardRoute("GET", "/v1/proposals", own_proposals),
    GuardRoute("POST", "/v1/proposals/{pid}/withdraw", withdraw),
)
