"""Agent reads of memory: by key, by tag, aggregates; the memory route that exists but never
serves an agent (semantic query). Agent writes are proposals: :mod:`gateway.guard.routes.writes`."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from typing import cast

from gateway import httpd, jsonio
from gateway.core import paging, policy
from gateway.core.capability import Capability
from gateway.db import Durable
from gateway.errors import ErrorCode, UompError
from gateway.guard.agent_call import AgentCall, answer_refusal
from gateway.guard.fieldname import aggregate_field
from gateway.guard.http import page_limit, query_param
from gateway.guard.items import MemoryItem
from gateway.guard.reads import TOO_MANY_GROUPS
from gateway.guard.storage import CURRENCY_MEMBER, AggregateRow, ItemMeta, MemoryStorage, ReadFilter, json_path

_KeyRead = tuple[ItemMeta | None, MemoryItem | None, bytes | None]

MIXED_CURRENCY = "amounts in more than one currency"  # the aggregate's own refusal marker (compared by identity)


def _key_verdict(
    cap: Capability, key: str, meta: ItemMeta | None, item: MemoryItem | None
) -> tuple[UompError | None, str | None, str]:
    """(refusal, detail, reason) of a read by key: the decision on the metadata, then again on what
    was loaded (the item may have changed or gone between the two reads). Pure: the worker and the
    event loop come to the same verdict on the same inputs."""
    if cap.aggregation_only:  # §10.4 step 5b, §19.2
        return UompError(ErrorCode.ACCESS_DENIED, policy.AGGREGATION_ONLY, session_id=cap.session_id), None, ""
    d = policy.key_decision(cap.read, key, list(meta.tags) if meta else None, meta.sensitivity if meta else None)
    if not d.allowed or meta is None:
        return UompError(ErrorCode.ACCESS_DENIED, d.reason, session_id=cap.session_id), d.detail, ""
    d = policy.key_decision(cap.read, key, list(item.tags) if item else None, item.sensitivity if item else None)
    if not d.allowed or item is None:
        return UompError(ErrorCode.ACCESS_DENIED, d.reason, session_id=cap.session_id), d.detail, ""
    return None, d.detail, d.reason


def _read_key_on_worker(cap: Capability, call: AgentCall, store: MemoryStorage, key: str) -> _KeyRead | Durable:
    """The store's part of a read by key, in the same worker job as the authentication (one thread
    trip per read): metadata first and the decision on it alone; the value only after an
    allow (a denied item and a missing key do the same work), both in one read transaction.

    For the guard's only read in flight (``call.context`` set), an allowed answer is made here too and its
    event submitted: the worker writes it (one commit, no hand-over to the writer thread and back)
    and hands the answer over once it is durable. Under load, the writer thread's group commit."""
    if cap.aggregation_only:
        return None, None, None
    meta, item = store.get_if(
        key,
        lambda meta: meta is not None and policy.key_decision(cap.read, key, list(meta.tags), meta.sensitivity).allowed,
    )
    if call.context is None:  # not alone: the event loop answers
        return meta, item, None
    refusal, detail, reason = _key_verdict(cap, key, meta, item)
    if refusal is not None or item is None:
        return meta, item, None  # the event loop refuses (and records it)
    call.tags = list(item.tags)
    call.allow(reason, detail)
    data = jsonio.dumps(policy.filter_fields(item.to_dict(), cap.allowed_fields))
    return Durable(call.record_on_worker(data), (meta, item, data))


async def get_key(request: httpd.Request) -> httpd.Response:
    """§10.2. The decision is made on metadata alone (:meth:`MemoryStore.get_meta`, never the value);
    the value is loaded only after an allow, so a denied item and a missing key do the same work."""
    key = request.match_info["key"]
    call = AgentCall(request, "read", key=key)
    svc = call.svc
    svc.reads_in_flight += 1
    try:
        # alone: no other read in flight and the audit writer idle (else its group commit pays more)
        if svc.reads_in_flight == 1 and svc.audit.writer.idle:
            call.context = call.event_context()
        failed: UompError | None = None
        try:
            cap, got = await call.authenticate_then(_read_key_on_worker, call, svc.store, key)
            meta, item, data = cast(_KeyRead, got)  # (the worker hands a Durable's value over)
        except UompError as exc:
            if call.event_id is not None:
                raise  # the answer's event could not be written: its batch's error, as a failed flush
            failed = exc
        if failed is not None:
            return await answer_refusal(call, failed)
        if data is not None:  # made (and its event submitted) on the worker
            return await call.answer(data)
        refusal, detail, reason = _key_verdict(cap, key, meta, item)
        if refusal is not None or item is None:
            assert refusal is not None
            return await call.refuse(refusal, detail)
        call.tags = list(item.tags)
        call.allow(reason, detail)
        return await call.respond(policy.filter_fields(item.to_dict(), cap.allowed_fields))
    finally:
        svc.reads_in_flight -= 1


def _exact_sum(parts: Iterable[int | float]) -> int | float:
    """Integers summed exactly; any float makes it a correctly rounded float sum."""
    values = list(parts)
    if all(isinstance(v, int) for v in values):
        return sum(values)
    return math.fsum(values)


def _read_filter(cap: Capability) -> ReadFilter:
    return ReadFilter(keys=cap.read.keys, deny_keys=cap.read.deny_keys, deny_tags=cap.read.deny_tags)


async def get_by_tag(request: httpd.Request) -> httpd.Response:
    """§10.3, paged: ``{"items": [...], "next": <cursor> | null}``. ``next`` is null only when the
    page holds the last authorized item; otherwise ``?tag=<tag>&cursor=<next>`` gives the next page.
    A page holds at most ``limit`` (default and maximum ``max_tag_results``) items and ends early
    once it reaches ``tag_page_max_bytes``. Cursors are sealed and bound to the session, the agent
    and the tag (:mod:`gateway.core.paging`)."""
    call = AgentCall(request, "read")
    svc = call.svc
    failed: UompError | None = None
    try:
        tag = query_param(request, "tag")
        assert tag is not None
        call.tags = [tag]
        cursor = query_param(request, "cursor", required=False, max_len=paging.MAX_CURSOR_CHARS)
        limit = page_limit(request, svc.cfg.max_tag_results)
        cap = await call.authenticate(read=True)
    except UompError as exc:
        failed = exc
    if failed is not None:
        return await answer_refusal(call, failed)
    assert tag is not None  # (query_param's required default refused a missing one)
    if cap.aggregation_only:
        return await call.refuse(UompError(ErrorCode.ACCESS_DENIED, policy.AGGREGATION_ONLY, session_id=cap.session_id))
    d = policy.tag_decision(cap.read, tag)
    if not d.allowed:
        return await call.refuse(UompError(ErrorCode.ACCESS_DENIED, d.reason, session_id=cap.session_id), d.detail)
    now = time.time()
    after: str | None = None
    if cursor is not None:
        try:
            state = paging.open_cursor(
                svc.reads.cursor_key, cursor, session_id=cap.session_id, agent_id=cap.agent_id, tag=tag, now=now
            )
        except UompError as exc:
            failed = exc
        if failed is not None:
            return await call.refuse(failed)
        after = state.after
        if limit is None:
            limit = min(state.limit, svc.cfg.max_tag_results)
    page_size = limit or svc.cfg.max_tag_results
    items, more = await asyncio.to_thread(
        svc.store.tag_page, tag, _read_filter(cap), after=after, limit=page_size, max_bytes=svc.cfg.tag_page_max_bytes
    )
    nxt = None
    if more and items:
        nxt = paging.seal(
            svc.reads.cursor_key,
            session_id=cap.session_id,
            agent_id=cap.agent_id,
            tag=tag,
            after=items[-1].key,
            limit=page_size,
            expires_at=int(now) + svc.cfg.tag_cursor_lifetime_seconds,
        )
    call.allow(d.reason, f"{len(items)} items after key rules" + ("; more follow" if nxt else ""))
    return await call.respond(
        {"items": [policy.filter_fields(it.to_dict(), cap.allowed_fields) for it in items], "next": nxt}
    )


async def aggregate(request: httpd.Request) -> httpd.Response:
    """§10.5 over every authorized item, computed in SQL. What may be answered (docs/aggregates.md):
    min/max only with the user's min/max grant; a field only within ``allowed_fields``; at least
    ``aggregate_min_items`` contributing items; and, unless the user granted exact aggregates, sums
    and averages only while no combination of this session's aggregates of the field isolates fewer
    than ``aggregate_min_group`` items (the history survives restarts, ``reads.db``)."""
    call = AgentCall(request, "aggregate")
    svc = call.svc
    failed: UompError | None = None
    try:
        tag = query_param(request, "tag")
        op = query_param(request, "op")
        field = aggregate_field(query_param(request, "field", required=False))
        assert tag is not None and op is not None
        call.tags = [tag]
        if op not in policy.OPS:
            raise UompError(ErrorCode.INVALID_REQUEST, "op must be one of sum, avg, count, min, max")
        path: str | None = None
        if op != "count":
            path = json_path(field) if field is not None else None
            if path is None:
                raise UompError(
                    ErrorCode.INVALID_REQUEST,
                    "field is required for numeric ops: value, value.<name>[.<name>...] or <name>[.<name>...] "
                    "(short for value.<name>...), with names of letters, digits, _ - : @",
                )
        cap = await call.authenticate(read=True)
    except UompError as exc:
        failed = exc
    if failed is not None:
        return await answer_refusal(call, failed)
    assert tag is not None and op is not None  # (query_param's required default refused a missing one)
    d = policy.tag_decision(cap.read, tag)
    if not d.allowed:
        return await call.refuse(UompError(ErrorCode.ACCESS_DENIED, d.reason, session_id=cap.session_id), d.detail)
    row = call.row
    assert row is not None
    grant = policy.AggregateGrant.from_options(row.options)
    refusal = policy.aggregate_refusal(op, field if op != "count" else None, cap.allowed_fields, grant)
    if refusal is not None:
        return await call.refuse(
            UompError(ErrorCode.ACCESS_DENIED, refusal.reason, session_id=cap.session_id), refusal.detail
        )
    flt = _read_filter(cap)
    min_items = svc.cfg.aggregate_min_items
    tracked = op in ("sum", "avg") and not grant.exact

    def mixed() -> bool:  # amounts in two currencies or more add up to nothing meaningful
        return path is not None and op != "count" and svc.store.currencies(tag, flt, path=path) > 1

    def compute() -> tuple[policy.AggregateResult, str | None, str | None]:
        store, reads = svc.store, svc.reads
        if not tracked:
            if mixed():
                return policy.AggregateResult(True, {}, 0, ""), MIXED_CURRENCY, "amounts in several currencies"
            agg: AggregateRow = store.aggregate(tag, flt, path=path)
            return (
                policy.aggregate_result(
                    op=op,
                    field_path=field,
                    tag=tag,
                    count=agg.count,
                    total=agg.total,
                    minimum=agg.minimum,
                    maximum=agg.maximum,
                    min_items=min_items,
                ),
                None,
                None,
            )
        assert path is not None and field is not None
        # One pass answers and checks: the overlap groups of the session's tags of this field (the new
        # tag last) carry their sums; the answer, the check and the record see the same items.
        with store.read_snapshot(), reads.history(cap.session_id, field) as history:
            if mixed():  # before anything is recorded: a refused sum adds nothing to the history
                return policy.AggregateResult(True, {}, 0, ""), MIXED_CURRENCY, "amounts in several currencies"
            full = history.full_for(tag, max_tags=62)
            if full is not None:
                return policy.AggregateResult(True, {}, 0, ""), full.reason, full.detail
            tags = history.tags_with(tag)
            atoms = store.atoms(tags, flt, path=path, keys=reads.keys4(), max_atoms=svc.cfg.aggregate_max_groups)
            if atoms is None:
                return policy.AggregateResult(True, {}, 0, ""), TOO_MANY_GROUPS, "too many overlap groups"
            bit = 1 << (len(tags) - 1)
            mine = [a for a in atoms if a.pattern & bit]
            res = policy.aggregate_result(
                op=op,
                field_path=field,
                tag=tag,
                count=sum(a.count for a in mine),
                total=_exact_sum(a.total for a in mine),
                min_items=min_items,
            )
            if not res.ok:
                return res, None, None
            verdict, check = history.check(tags, atoms, min_group=max(svc.cfg.aggregate_min_group, min_items))
            if not verdict.ok:
                return res, verdict.reason, verdict.detail
            saved = history.record(tag, check.fingerprints[tag], session_expires_at=row.expires_at)
            if not saved.ok:
                return res, saved.reason, saved.detail
            return res, None, verdict.detail

    try:
        res, refused, detail = await asyncio.to_thread(compute)
    except UompError as exc:
        if exc.code is not ErrorCode.AGGREGATE_HIGH_SENSITIVITY:
            raise
        failed = UompError(exc.code, exc.message, session_id=cap.session_id)
    if failed is not None:
        return await call.refuse(failed, "high-sensitivity items under the tag")
    if not res.ok:
        return await call.refuse(
            UompError(
                ErrorCode.ACCESS_DENIED,
                f"aggregation needs at least {min_items} contributing items",
                session_id=cap.session_id,
            ),
            res.detail,
        )
    if refused is MIXED_CURRENCY:
        message = (
            f"the items of tag {tag!r} hold {field} in more than one currency (their value's "
            f"{CURRENCY_MEMBER!r} differs, or is missing on some): a {op} across currencies means nothing; "
            "aggregate a tag whose items share one currency, or ask op=count"
        )
        return await call.refuse(
            UompError(ErrorCode.AGGREGATE_MIXED_CURRENCY, message, session_id=cap.session_id), detail
        )
    if refused is not None:
        return await call.refuse(UompError(ErrorCode.ACCESS_DENIED, refused, session_id=cap.session_id), detail)
    call.allow("aggregate over granted items", f"{res.contributing} items" + (f"; {detail}" if detail else ""))
    return await call.respond(res.body)


async def _refuse_authenticated(request: httpd.Request, action: str, code: ErrorCode, message: str) -> httpd.Response:
    """Routes that exist but never serve an agent: authenticate (so the refusal is audited with who
    asked), then refuse with ``code``."""
    call = AgentCall(request, action, key=request.match_info.get("key"))
    failed: UompError | None = None
    try:
        cap = await call.authenticate()
    except UompError as exc:
        failed = exc
    if failed is not None:
        return await answer_refusal(call, failed)
    return await call.refuse(UompError(code, message, session_id=cap.session_id))


async def query_refused(request: httpd.Request) -> httpd.Response:
    """``POST /v1/memory/query``: authenticated and audited, then NOT_IMPLEMENTED (§22)."""
    return await _refuse_authenticated(
        request, "query", ErrorCode.NOT_IMPLEMENTED, "semantic query is not implemented (spec §22)"
    )
