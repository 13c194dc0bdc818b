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
Uses the private request helpers of :mod:`gateway.guard.app` (``_json_body``) until they have
public names.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from gateway.errors import ErrorCode, UompError
from gateway.guard.app import AgentCall, GuardRoute, GuardServices, _answer_refusal, _json_body, _via
from gateway.guard.history import set_retention
from gateway.guard.proposals import ProposalBook, WriteBudgets, WriteRefused, write_grant_problem
from gateway.guard.store import MemoryStore

_BOOKS: weakref.WeakKeyDictionary[MemoryStore, ProposalBook] = weakref.WeakKeyDictionary()
MAX_PROPOSAL_ID = 64


def book_for(svc: GuardServices) -> ProposalBook:
    """The guard's proposal book over its memory store (made on first use; sets the history
    retention of the store from ``[guard] history_max_versions``)."""
    store = svc.store
    if not isinstance(store, MemoryStore):
        raise UompError(ErrorCode.WRITE_NOT_AVAILABLE, "this memory store does not take proposals")
    book = _BOOKS.get(store)
    if book is None:
        set_retention(store, svc.cfg.history_max_versions)
        book = ProposalBook(store, WriteBudgets.from_config(svc.cfg))
        _BOOKS[store] = book
    return book


async def check_write_grant(svc: GuardServices, body: Mapping[str, Any]) -> None:
    """Called by the grant route before the Auth Service grants: see :func:`write_grant_problem`."""
    store = svc.store
    if not isinstance(store, MemoryStore):
        return
    problem = await asyncio.to_thread(write_grant_problem, store, body)
    if problem is not None:
        raise UompError(ErrorCode.ACCESS_DENIED, problem + "; leave that key out of the write grant")


async def propose(request: web.Request) -> web.Response:
    op = "put" if request.method == "PUT" else "delete"
    key = request.match_info["key"]
    call = AgentCall(request, "write" if op == "put" else "delete", key=key)
    svc = call.svc
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await _answer_refusal(call, exc)
    if cap.write.is_empty():
        return await call.refuse(
            UompError(
                ErrorCode.WRITE_NOT_AVAILABLE,
                "this session has no write scope; agent writes need the user's write grant (spec §20.4)",
                session_id=cap.session_id,
            )
        )
    try:
        body = await _json_body(request)
    except UompError as exc:
        return await call.refuse(UompError(exc.code, exc.message, session_id=cap.session_id))
    try:
        book = book_for(svc)
        proposal, detail = await asyncio.to_thread(
            lambda: book.propose(
                scope=cap.write,
                session_id=cap.session_id,
                agent_id=cap.agent_id,
                op=op,
                key=key,
                body=body if (body or op == "put") else None,
                if_match=request.headers.get("If-Match"),
                via=_via(request),
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
    resp.set_status(202)
    resp.headers["Location"] = f"/v1/proposals/{proposal.proposal_id}"
    return resp


async def own_proposals(request: web.Request) -> web.Response:
    call = AgentCall(request, "proposals")
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await _answer_refusal(call, exc)
    try:
        book = book_for(call.svc)
        found = await asyncio.to_thread(book.for_session, cap.session_id)
    except UompError as exc:
        return await call.refuse(exc)
    call.allow("own session's proposals", f"{len(found)} proposals")
    return await call.respond({"proposals": [p.summary() for p in found]})


async def withdraw(request: web.Request) -> web.Response:
    pid = request.match_info["pid"][:MAX_PROPOSAL_ID]
    call = AgentCall(request, "proposal_withdraw")
    call.fields["proposal_id"] = pid
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await _answer_refusal(call, exc)
    try:
        book = book_for(call.svc)
        done = await asyncio.to_thread(book.withdraw, pid, cap.session_id)
    except UompError as exc:
        return await call.refuse(exc)
    call.key = done.key
    call.allow("own pending proposal withdrawn", pid)
    return await call.respond(done.summary())


ROUTES = (
    GuardRoute("PUT", "/v1/memory/{key}", propose),
    GuardRoute("DELETE", "/v1/memory/{key}", propose),
    GuardRoute("GET", "/v1/proposals", own_proposals),
    GuardRoute("POST", "/v1/proposals/{pid}/withdraw", withdraw),
)
