"""The gateway's internal routes (Unix socket only): token refresh after the gateway checked the
transport, and the events of requests the gateway answered alone; and the health check."""

from __future__ import annotations

import functools
import re
from typing import Any

from gateway import contract, httpd
from gateway.contract import (
    VERIFIED_AGENT_HEADER,
    VERIFIED_JKT_HEADER,
    VERIFIED_X5T_HEADER,
)
from gateway.errors import ErrorCode, UompError
from gateway.guard.audit import (
    EXTRA_FIELDS,
    GATEWAY_ID_PREFIX,
    Row,
    make_row,
)
from gateway.guard.http import (
    MAX_AUDIT_FIELD,
    SERVICES,
    event_fields,
    event_via,
    is_asserted,
    json_body,
    json_response,
    prepare,
)


async def refresh_internal(request: httpd.Request) -> httpd.Response:
    """Only on the Unix socket, called by the gateway after it checked the transport (cert or DPoP)."""
    svc = request.app[SERVICES]
    sid = request.match_info["sid"]
    try:
        if not is_asserted(request):
            raise UompError(ErrorCode.INVALID_REQUEST, "refresh is reached through the gateway only")
        token, th, presented = prepare(request, use="refresh")  # the gateway's assertion, checked
        await svc.authdb(
            functools.partial(svc.auth.authenticate, token, allow_refresh=True, presented=presented, th=th)
        )
        answer, ticket = await svc.authdb(
            functools.partial(
                svc.auth.refresh_audited,
                token,
                session_id=sid,
                presented_x5t=request.headers.get(VERIFIED_X5T_HEADER),
                presented_jkt=request.headers.get(VERIFIED_JKT_HEADER),
                extra=event_fields(request),
            )
        )
    except UompError as exc:
        ticket = svc.audit.record(
            session_id=exc.session_id or sid,
            agent_id=request.headers.get(VERIFIED_AGENT_HEADER, "unknown"),
            action="refresh",
            allowed=False,
            reason=exc.message,
            detail=exc.code,
            via=event_via(request),
            extra=event_fields(request, code=exc.code),
        )
        await svc.audit.flush(ticket)
        raise
    await svc.audit.flush(ticket)  # the rotation's row (also in auth.db's outbox: see AuthService)
    return json_response(answer)


async def openapi_document(request: httpd.Request) -> httpd.Response:
    """``GET /v1/openapi.json``: the OpenAPI document of gateway/openapi.py (imported at the first
    ask: a guard nobody asks holds none of its ~1 MiB of tables)."""
    from gateway import openapi

    return httpd.Response(openapi.render().encode(), content_type="application/json; charset=utf-8")


async def health(request: httpd.Request) -> httpd.Response:
    """200 while the process runs (the supervisor's check); ``audit`` names a log that is refused."""
    refused = request.app[SERVICES].audit.integrity
    if refused is not None:
        return json_response({"status": "refusing", "audit": refused.body()})
    return json_response({"status": "ok"})


GATEWAY_EVENT_ID = re.compile(r"gw_[0-9a-f]{16,40}")
_CORE_STR = ("session_id", "agent_id", "action", "reason", "key", "via", "detail")
MAX_REASON = 500


def _gateway_row(ev: Any) -> Row:
    """One event of ``POST /v1/internal/events`` as an audit row: typed, bounded, only known fields."""
    if not isinstance(ev, dict):
        raise UompError(ErrorCode.INVALID_REQUEST, "each event must be a JSON object")
    eid = ev.get("id")
    if not isinstance(eid, str) or not GATEWAY_EVENT_ID.fullmatch(eid):
        raise UompError(ErrorCode.INVALID_REQUEST, "event id must be gw_ and 16-40 hex digits")
    ts = ev.get("ts")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not 0 < ts < 1e11:
        raise UompError(ErrorCode.INVALID_REQUEST, "event ts must be seconds since the epoch")
    allowed = ev.get("allowed", False)
    if not isinstance(allowed, bool):
        raise UompError(ErrorCode.INVALID_REQUEST, "event allowed must be a boolean")
    core: dict[str, str | None] = {}
    for name in _CORE_STR:
        v = ev.get(name)
        if v is not None and not isinstance(v, str):
            raise UompError(ErrorCode.INVALID_REQUEST, f"event {name} must be a string")
        core[name] = v[:MAX_REASON] if isinstance(v, str) else None
    extra: dict[str, Any] = {}
    for name, v in ev.items():
        if name in EXTRA_FIELDS:
            if isinstance(v, str):
                extra[name] = v[:MAX_AUDIT_FIELD]
            elif isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**53:
                extra[name] = v
            elif (
                name == "by"
                and isinstance(v, dict)
                and len(v) <= 100
                and all(
                    isinstance(k, str) and len(k) <= MAX_AUDIT_FIELD and isinstance(n, int) and not isinstance(n, bool)
                    for k, n in v.items()
                )
            ):
                extra[name] = v
            elif v is not None:
                raise UompError(ErrorCode.INVALID_REQUEST, f"event {name} has an unexpected type")
        elif name not in _CORE_STR and name not in ("id", "ts", "allowed", "tags"):
            raise UompError(ErrorCode.INVALID_REQUEST, f"unknown event field {name[:40]}")
    extra["origin"] = "gateway"
    return make_row(
        session_id=core["session_id"] or "unknown",
        agent_id=core["agent_id"] or "unknown",
        action=(core["action"] or "unknown")[:64],
        allowed=allowed,
        reason=core["reason"] or "",
        key=core["key"],
        detail=core["detail"],
        via=core["via"],
        now=float(ts),
        extra=extra,
        event_id=eid,
    )


async def internal_events(request: httpd.Request) -> httpd.Response:
    """``POST /v1/internal/events`` (Unix socket only): the events of requests the remote gateway
    answered alone (its refusals, rejected TLS handshakes, its spool when replayed), written into the
    one log in one group commit, answered once durable. Idempotent by event id (``gw_...``): an event
    sent twice is one event. A body over :data:`gateway.contract.MAX_INTERNAL_EVENTS_BYTES` is 413, a
    malformed one (or one bad event) 400 for the whole batch: the gateway splits it and sets aside
    the one event that stays refused. Trusted like every gateway call here: the socket is 0600, only the
    user's processes reach it; the gateway has no route to it."""
    svc = request.app[SERVICES]
    body = await json_body(request, contract.MAX_INTERNAL_EVENTS_BYTES)
    events = body.get("events")
    if not isinstance(events, list) or len(events) > contract.MAX_INTERNAL_EVENTS:
        raise UompError(ErrorCode.INVALID_REQUEST, f"events must be a list of at most {contract.MAX_INTERNAL_EVENTS}")
    rows = [_gateway_row(ev) for ev in events]
    ticket = 0
    for row in rows:
        assert str(row[0]).startswith(GATEWAY_ID_PREFIX)
        ticket = svc.audit.submit(row)
    if rows:
        await svc.audit.flush(ticket)
    return json_response({"accepted": len(rows)})
