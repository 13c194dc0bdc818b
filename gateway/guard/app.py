"""HTTP face of the Auth Service and the Memory Guard (spec §9, §10, §18, §19).

Two listeners share one set of services:

* ``unix`` — ``$UOMP_HOME/guard.sock`` (0600): the CLI, and the remote gateway forwarding verified
  remote-profile requests; the only place the internal routes (refresh, token validation) exist.
  A request that carries the gateway's assertion (:mod:`gateway.contract`) is served as a remote
  request: the token must hash to what the gateway verified, name the agent it verified, be of the
  remote profile and be bound to the certificate or key the gateway saw. A request without the
  assertion is treated exactly like one on the Local Profile listener;
* ``tcp`` — ``127.0.0.1:9374``, the Local Profile: local-profile tokens only, on every route
  (§14.1, §7.3); a client-sent ``X-UOMP-Verified-*`` header is refused.

Every agent route authenticates through :func:`presented_for` + :meth:`AuthService.authenticate`,
which runs the shared checks of :mod:`gateway.core.checks`.

Management routes (create/grant/close/revoke/list) need the user's admin credential; a capability
token never suffices. Every response to an agent is either data it was granted or a §8.4 error.

SQLite is never waited for on the event loop: every call into the Auth Service (``auth.db``) runs
on its worker thread through :meth:`GuardServices.authdb`, audit-log reads on the audit log's
reader thread, and audit writes are group-committed on the audit writer thread (see
:mod:`gateway.db`); a database locked by another process past the bounded wait is 503
STORE_BUSY while other requests keep being served.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError
from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway import contract, jsonio, openapi
from gateway import keys as keyfiles
from gateway.config import GuardConfig, Paths
from gateway.contract import (
    AGENT_HEADER,
    QUOTA_HEADER,
    REQUIRED_VERIFIED,
    VERIFIED_AGENT_HEADER,
    VERIFIED_JKT_HEADER,
    VERIFIED_TOKEN_HEADER,
    VERIFIED_VIA_HEADER,
    VERIFIED_X5T_HEADER,
)
from gateway.core import checks, deletion, jose, paging, policy
from gateway.core.tokens import Capability
from gateway.db import DbWorker, Durable
from gateway.errors import ErrorCode, UompError
from gateway.guard.audit import (
    EXTRA_FIELDS,
    GATEWAY_ID_PREFIX,
    MAX_AUDIT_PAGE,
    AuditLog,
    Row,
    anchor_chain,
    make_row,
    open_audit,
)
from gateway.guard.auth import AuthService, SessionRow, token_hash
from gateway.guard.fieldname import aggregate_field
from gateway.guard.items import MemoryItem
from gateway.guard.reads import TOO_MANY_GROUPS, ReadState
from gateway.guard.store import AggregateRow, ItemMeta, MemoryStorage, MemoryStore, ReadFilter, json_path

log = logging.getLogger("uomp.guard")
T = TypeVar("T")

MAX_QUERY_PARAM = 256


@dataclass
class GuardServices:
    paths: Paths
    cfg: GuardConfig
    audit: AuditLog
    auth: AuthService
    store: MemoryStorage
    admin_credential: str
    # the one thread that runs every Auth Service call (auth.db), off the event loop
    auth_worker: DbWorker
    reads: ReadState
    # Local Profile audiences this guard answers to (the configured port, and the bound one)
    local_audiences: set[str] = dataclasses.field(default_factory=set)
    reads_in_flight: int = 0  # reads by key being answered (see get_key)

    def add_local_port(self, port: int) -> None:
        self.local_audiences.update(
            checks.norm_endpoint(u) for u in (f"http://127.0.0.1:{port}", f"http://localhost:{port}")
        )

    @classmethod
    def open(cls, paths: Paths, cfg: GuardConfig) -> GuardServices:
        audit = open_audit(paths, cfg, strict=False)  # a refused log: served as refusals (errors_middleware)
        auth = AuthService(paths, cfg, audit)
        store = MemoryStore(paths.memory_db, busy_timeout=cfg.db_busy_timeout_seconds)
        # a read that is the guard's only one has its event written by this worker (get_key)
        worker = DbWorker(
            "auth",
            what="session database",
            queue_timeout=cfg.db_queue_timeout_seconds,
            durable=audit.writer.write_here_if_idle,
        )
        reads = ReadState(
            paths.reads_db,
            max_sets_per_session=cfg.aggregate_max_sets_per_session,
            max_rows=cfg.aggregate_history_max_rows,
        )
        svc = cls(paths, cfg, audit, auth, store, keyfiles.load_admin(paths), worker, reads)
        svc.add_local_port(cfg.tcp_port)
        return svc

    async def authdb(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (an Auth Service method) on the auth.db worker thread: the event loop never
        waits for a lock on auth.db (or for the audit flush the Auth Service does itself)."""
        return await self.auth_worker.run(fn, *args)

    def close(self) -> None:
        self.auth_worker.close()
        self.auth.close_db()
        self.store.close()
        self.reads.close()
        self.audit.close()


SERVICES = web.AppKey("services", GuardServices)
LISTENER = web.AppKey("listener", str)


def _json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=jsonio.dumps(body), status=status, content_type="application/json", charset="utf-8", headers=headers
    )


def error_response(exc: UompError, *, transport_status: int | None = None) -> web.Response:
    """The §8.4 answer for ``exc``, with its code's status. ``transport_status``: the status aiohttp
    chose for a request it refused before any handler (400, 411, 431, ...), kept on the wire as it was;
    the body's code is then INVALID_REQUEST (or INTERNAL for a 5xx)."""
    status = exc.status if transport_status is None else transport_status
    headers = {"WWW-Authenticate": 'Bearer realm="uomp"'} if status == 401 else None
    return _json_response(exc.body(), status, headers)


_HTTP_CODES = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED, 413: ErrorCode.PAYLOAD_TOO_LARGE}


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        # Single-valued headers once; identity headers only as the gateway's assertion on the socket.
        problem = contract.header_problem(request.raw_headers, verified_allowed=request.app[LISTENER] == "unix")
        if problem is not None:
            raise UompError(ErrorCode.INVALID_REQUEST, problem)
        refused = request.app[SERVICES].audit.integrity  # a damaged or rolled-back log: nothing is served
        if refused is not None and request.path != "/v1/health":
            raise refused
        return await handler(request)
    except UompError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, ErrorCode.INVALID_REQUEST)
        msg = {
            ErrorCode.NOT_FOUND: "no such endpoint",
            ErrorCode.METHOD_NOT_ALLOWED: "method not allowed on this endpoint",
            ErrorCode.PAYLOAD_TOO_LARGE: "request body too large",
        }.get(code, "invalid request")
        return error_response(
            UompError(code, msg), transport_status=exc.status if code == ErrorCode.INVALID_REQUEST else None
        )
    except Exception as exc:  # never leak internals; never 500 with a stack trace to a client
        log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.path)
        return error_response(UompError(ErrorCode.INTERNAL, "internal error"))


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() not in ("bearer", "dpop") or not value.strip():
        raise UompError(ErrorCode.INVALID_TOKEN, "missing Authorization: Bearer token")
    return value.strip()


def _admin(request: web.Request) -> None:
    svc = request.app[SERVICES]
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not keyfiles.admin_matches(value.strip(), svc.admin_credential):
        raise UompError(ErrorCode.UNAUTHORIZED, "the management API needs the user's admin credential")


BODY_READ_SECONDS = 30.0  # a request body arrives whole within this, or the request is refused (400)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body, at most ``limit`` bytes: read until its end (one ``read()`` returns
    only what has arrived so far, so a body that comes in pieces is joined here). Larger is 413
    PAYLOAD_TOO_LARGE (from the declared length, before anything is read, or once the bytes read pass
    it); a body that does not arrive whole within :data:`BODY_READ_SECONDS`, or breaks off, is 400."""
    too_large = UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"request body exceeds {limit} bytes; send less per request")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(BODY_READ_SECONDS):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise too_large
                parts.append(chunk)
    except TimeoutError:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"the request body did not arrive whole within {BODY_READ_SECONDS:g} s; send it at once",
        ) from None
    except (OSError, HttpProcessingError, ClientPayloadError) as exc:
        raise UompError(
            ErrorCode.INVALID_REQUEST, f"the request body broke off ({type(exc).__name__}); send it again"
        ) from None
    return b"".join(parts)


async def _json_body(request: web.Request, limit: int | None = None) -> dict[str, Any]:
    svc = request.app[SERVICES]
    raw = await read_body(request, svc.cfg.max_body_bytes if limit is None else limit)
    if not raw.strip():
        return {}
    try:
        body = jsonio.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise UompError(ErrorCode.INVALID_REQUEST, "request body is not valid JSON") from exc
    if not isinstance(body, dict):
        raise UompError(ErrorCode.INVALID_REQUEST, "request body must be a JSON object")
    return body


def _param(request: web.Request, name: str, *, required: bool = True, max_len: int = MAX_QUERY_PARAM) -> str | None:
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise UompError(ErrorCode.INVALID_REQUEST, f"query parameter {name} given more than once")
    if not values or not values[0]:
        if required:
            raise UompError(ErrorCode.INVALID_REQUEST, f"query parameter {name} is required")
        return None
    if len(values[0]) > max_len:
        raise UompError(ErrorCode.INVALID_REQUEST, f"query parameter {name} is too long")
    return values[0]


_ASSERTED = web.RequestKey("uomp_asserted", bool)


def _asserted(request: web.Request) -> bool:
    """True when the request carries the gateway's verified-identity headers (Unix socket only);
    worked out once per request."""
    known = request.get(_ASSERTED)
    if known is None:
        known = request.app[LISTENER] == "unix" and any(
            name.lower().startswith(contract.VERIFIED_PREFIX) for name in request.headers
        )
        request[_ASSERTED] = known
    return known


def presented_for(request: web.Request, th: str, *, use: str = "access") -> checks.Presented:
    """What this listener knows about the request, for :func:`gateway.core.checks.run_checks`.

    On the Unix socket with the gateway's assertion: the token must be exactly the one the gateway
    verified (hash compared in constant time), and the agent and binding are the gateway's. Else
    (the Local Profile listener, or the socket without an assertion): local-profile tokens only.
    """
    svc = request.app[SERVICES]
    h = request.headers
    if _asserted(request):
        if any(not h.get(name) for name in REQUIRED_VERIFIED):
            raise UompError(ErrorCode.INVALID_REQUEST, "incomplete gateway assertion")
        if not hmac.compare_digest(th.removeprefix("sha256:").encode(), h[VERIFIED_TOKEN_HEADER].encode()):
            raise UompError(ErrorCode.INVALID_TOKEN, "the token is not the one the gateway verified")
        return checks.Presented(
            token_use=use,
            profile="remote",
            audiences=None,
            audience_required=True,
            endpoint=None,
            check_endpoint=False,
            header_agent=h.get(AGENT_HEADER) or None,
            require_header_agent=False,
            proven_agent=h[VERIFIED_AGENT_HEADER],
            x5t=h.get(VERIFIED_X5T_HEADER) or None,
            jkt=h.get(VERIFIED_JKT_HEADER) or None,
            binding=checks.BIND_EITHER,
        )
    # The socket has no URL of its own: a local token's audience is compared on the TCP listener only.
    audiences = svc.local_audiences if request.app[LISTENER] == "tcp" else None
    return checks.Presented(
        token_use=use,
        profile="local",
        audiences=audiences,
        audience_required=False,
        endpoint=None,
        check_endpoint=False,
        header_agent=h.get(AGENT_HEADER) or None,
        require_header_agent=False,
        proven_agent=None,
        x5t=None,
        jkt=None,
        binding=checks.BIND_NONE,
    )


def prepare(request: web.Request, *, use: str = "access") -> tuple[str, str, checks.Presented]:
    """The token, its hash and what the listener presents, for :meth:`AuthService.authenticate` (on
    the event loop: headers and one SHA-256, no I/O)."""
    token = _bearer(request)
    th = token_hash(token)
    return token, th, presented_for(request, th, use=use)


EVENT_KEY = web.RequestKey("uomp_event_id", str)  # the id of the event written for this request
MAX_AUDIT_FIELD = 200


def _via(request: web.Request) -> str:
    return request.headers.get(VERIFIED_VIA_HEADER, "local") if request.app[LISTENER] == "unix" else "local"


def event_fields(request: web.Request, *, code: str | None = None) -> dict[str, Any]:
    """The one-log fields of a request's event: the listener it came in on and, for a request the
    gateway forwarded (its assertion, on the Unix socket only), the gateway's audit headers
    (:data:`gateway.contract.AUDIT_HEADERS`): listener, client address, certificate serial and
    fingerprint, request id. A refusal's stable ``code`` too."""
    out: dict[str, Any] = {"code": code}
    if _asserted(request):
        h = request.headers
        for header, name in contract.AUDIT_HEADERS:
            value = h.get(header)
            if value:
                out[name] = value[:MAX_AUDIT_FIELD]
        out.setdefault("listener", "gateway")
    else:
        out["listener"] = request.app[LISTENER]
    return out


class AgentCall:
    """One authenticated agent request: runs §10.4 steps 1-4 and records the audit event."""

    def __init__(
        self, request: web.Request, action: str, *, key: str | None = None, tags: list[str] | None = None
    ) -> None:
        self.request = request
        self.svc = request.app[SERVICES]
        self.action = action
        self.key = key
        self.tags = tags
        self.fields: dict[str, Any] = {}  # event fields of this action (audit.EXTRA_FIELDS), e.g. memory_hash
        self.cap: Capability | None = None
        self.row: SessionRow | None = None
        self.remaining: int | None = None
        self.ticket: int | None = None  # the audit row to wait for before answering
        self.event_id: str | None = None
        # set by get_key only for the guard's only read in flight: what the event loop took from the
        # request (event_context) for the event the worker then makes
        self.context: tuple[int, str, dict[str, Any]] | None = None

    def _authenticate_on_worker(
        self, token: str, th: str, presented: checks.Presented, read: bool
    ) -> tuple[Capability | None, SessionRow | None, int | None, UompError | None]:
        """Runs on the auth.db worker: steps 1-4 with the listener's checks, then (``read``) step 5.
        Returns (cap, row, remaining, refusal): a refusal with no cap failed authentication; with a
        cap, the quota."""
        try:
            cap, row = self.svc.auth.authenticate(token, presented=presented, th=th)
        except UompError as exc:
            return None, None, None, exc
        if not read:
            return cap, row, None, None
        try:
            return cap, row, self.svc.auth.consume_read(cap, row), None
        except UompError as exc:
            return cap, row, 0, exc

    def _authenticate_then_on_worker(
        self, token: str, th: str, presented: checks.Presented, then: Callable[..., T], args: tuple[Any, ...]
    ) -> tuple[Capability | None, SessionRow | None, int | None, UompError | None, T | None]:
        cap, row, remaining, refusal = self._authenticate_on_worker(token, th, presented, True)
        if cap is None or refusal is not None:
            return cap, row, remaining, refusal, None
        self.cap, self.row, self.remaining = cap, row, remaining  # (for an event made on the worker)
        try:
            result = then(cap, *args)
        except UompError as exc:  # the store failed: refused (and audited) with the session known
            return cap, row, remaining, exc, None
        if isinstance(result, Durable):  # the worker hands it over once its event is durable
            return Durable(result.ticket, (cap, row, remaining, None, result.value))  # type: ignore[return-value]
        return cap, row, remaining, None, result

    async def _on_worker(self, job: Callable[..., tuple[Any, ...]], *args: Any) -> tuple[Any, ...]:
        """``job(token, th, presented, *args)`` on the auth.db worker; its answer starts with (cap,
        row, remaining, refusal). A refusal with no cap (authentication failed) is audited (``deny``)
        and raised here; the caller handles the rest."""
        presented: checks.Presented | None = None
        try:
            token, th, presented = prepare(self.request)
            out = await self.svc.authdb(job, token, th, presented, *args)
            if out[0] is None:
                assert out[3] is not None
                raise out[3]
        except UompError as exc:
            if self.event_id is not None:
                # the answer's event, made on the worker, could not be written: the request is refused
                # (503) as when the event loop's flush fails, and the log counts it (audit_gap); the
                # answer names that event, so the gateway does not write one of its own either
                self.request[EVENT_KEY] = self.event_id
                raise
            # A forwarded request's agent is known even when its session is not usable (revoked,
            # closed, expired): the gateway verified certificate, token and header and asserted it.
            self.deny(exc, agent_id=(presented.proven_agent if presented is not None else None) or "unknown")
            raise
        return out

    async def authenticate_then(self, then: Callable[..., T], *args: Any) -> tuple[Capability, T]:
        """:meth:`authenticate` (``read=True``), then ``then(cap, *args)`` in the same job on the
        auth.db worker: a read's store work rides the thread trip its authentication makes."""
        cap, row, remaining, refusal, result = await self._on_worker(self._authenticate_then_on_worker, then, args)
        self.cap, self.row, self.remaining = cap, row, remaining
        if refusal is not None:
            self.deny(refusal)
            raise refusal
        return cap, result

    async def authenticate(self, *, read: bool = False) -> Capability:
        """§10.4 steps 1-4 (with the checks of :func:`presented_for`) and, with ``read``, step 5 (the
        read quota): one trip to the auth.db worker. A refusal is audited (``deny``) and raised."""
        cap, row, remaining, refusal = await self._on_worker(self._authenticate_on_worker, read)
        self.cap, self.row = cap, row
        if read:
            self.remaining = remaining
        if refusal is not None:
            self.deny(refusal)
            raise refusal
        return cap  # type: ignore[no-any-return]

    def _submit(self, row: Row) -> None:
        self.ticket = self.svc.audit.submit(row)
        self.request[EVENT_KEY] = row[0]  # the gateway writes nothing of its own for this request

    def event_context(self, code: str | None = None) -> tuple[int, str, dict[str, Any]]:
        """What the request's event takes from the request itself: body size, ``via``, and the
        gateway's audit fields (:func:`event_fields`). On the event loop."""
        request = self.request
        return request.content_length or 0, _via(request), {**event_fields(request, code=code), **self.fields}

    def event_row(
        self,
        allowed: bool,
        reason: str,
        detail: str | None = None,
        response_size: int | None = None,
        code: str | None = None,
        context: tuple[int, str, dict[str, Any]] | None = None,
    ) -> Row:
        size, via, extra = context if context is not None else self.event_context(code)
        cap = self.cap
        return make_row(
            session_id=cap.session_id if cap else "unknown",
            agent_id=cap.agent_id if cap else "unknown",
            action=self.action,
            key=self.key,
            tags=self.tags,
            allowed=allowed,
            reason=reason,
            detail=detail,
            request_size=size,
            response_size=response_size,
            query_count_remaining=self.remaining,
            via=via,
            extra=extra,
        )

    def record(
        self,
        allowed: bool,
        reason: str,
        detail: str | None = None,
        response_size: int | None = None,
        code: str | None = None,
    ) -> None:
        self._submit(self.event_row(allowed, reason, detail, response_size, code))

    def record_on_worker(self, data: bytes) -> int:
        """On the worker: submit the allowed answer's event (with :attr:`context`, taken on the
        loop); its ticket, for a :class:`gateway.db.Durable` result."""
        row = self.event_row(True, self._reason, self._detail, len(data), context=self.context)
        self.ticket = self.svc.audit.submit(row)
        self.event_id = row[0]
        return self.ticket

    def deny(self, exc: UompError, *, agent_id: str | None = None) -> None:
        cap = self.cap
        self._submit(
            make_row(
                session_id=cap.session_id if cap else (exc.session_id or "unknown"),
                agent_id=cap.agent_id if cap else (agent_id or "unknown"),
                action=self.action,
                key=self.key,
                tags=self.tags,
                allowed=False,
                reason=exc.message,
                detail=exc.code,
                query_count_remaining=self.remaining,
                via=_via(self.request),
                extra=event_fields(self.request, code=exc.code),
            )
        )

    async def respond(self, body: Any) -> web.Response:
        data = jsonio.dumps(body)  # orjson where it gives json's answer (issue 13)
        self.record(True, self._reason, self._detail, response_size=len(data))
        await self.svc.audit.flush(self.ticket)
        return self._response(data)

    async def answer(self, data: bytes) -> web.Response:
        """The answer made on the worker (:meth:`record_on_worker`), once its event is durable."""
        assert self.event_id is not None
        self.request[EVENT_KEY] = self.event_id
        await self.svc.audit.flush(self.ticket)  # returns at once when the worker wrote it
        return self._response(data)

    def _response(self, data: bytes) -> web.Response:
        headers = {QUOTA_HEADER: str(self.remaining)} if self.remaining is not None else None
        return web.Response(body=data, content_type="application/json", charset="utf-8", headers=headers)

    async def refuse(self, exc: UompError, detail: str | None = None) -> web.Response:
        self.record(False, exc.message, detail or exc.code, code=exc.code)
        await self.svc.audit.flush(self.ticket)
        resp = error_response(exc)
        if self.remaining is not None:
            resp.headers[QUOTA_HEADER] = str(self.remaining)
        return resp

    _reason = "scope matched"
    _detail: str | None = None

    def allow(self, reason: str, detail: str | None = None) -> None:
        self._reason, self._detail = reason, detail


async def _answer_refusal(call: AgentCall, exc: UompError) -> web.Response:
    """The refusal was audited by AgentCall; make it durable, then answer (with the quota header)."""
    await call.svc.audit.flush(call.ticket)
    resp = error_response(exc)
    if call.remaining is not None:
        resp.headers[QUOTA_HEADER] = str(call.remaining)
    return resp


# ------------------------------------------------------------------------------ memory


_KeyRead = tuple[ItemMeta | None, MemoryItem | None, bytes | None]


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
    trip per read, issue 13): metadata first and the decision on it alone; the value only after an
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


async def get_key(request: web.Request) -> web.Response:
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
        try:
            cap, got = await call.authenticate_then(_read_key_on_worker, call, svc.store, key)
            meta, item, data = cast(_KeyRead, got)  # (the worker hands a Durable's value over)
        except UompError as exc:
            if call.event_id is not None:
                raise  # the answer's event could not be written: its batch's error, as a failed flush
            return await _answer_refusal(call, exc)
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


def _page_limit(request: web.Request, maximum: int) -> int | None:
    raw = _param(request, "limit", required=False)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= maximum:
        raise UompError(ErrorCode.INVALID_REQUEST, f"limit must be an integer from 1 to {maximum}")
    return int(raw)


async def get_by_tag(request: web.Request) -> web.Response:
    """§10.3, paged: ``{"items": [...], "next": <cursor> | null}``. ``next`` is null only when the
    page holds the last authorized item; otherwise ``?tag=<tag>&cursor=<next>`` gives the next page.
    A page holds at most ``limit`` (default and maximum ``max_tag_results``) items and ends early
    once it reaches ``tag_page_max_bytes``. Cursors are sealed and bound to the session, the agent
    and the tag (:mod:`gateway.core.paging`)."""
    call = AgentCall(request, "read")
    svc = call.svc
    try:
        tag = _param(request, "tag")
        assert tag is not None
        call.tags = [tag]
        cursor = _param(request, "cursor", required=False, max_len=paging.MAX_CURSOR_CHARS)
        limit = _page_limit(request, svc.cfg.max_tag_results)
        cap = await call.authenticate(read=True)
    except UompError as exc:
        return await _answer_refusal(call, exc)
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
            return await call.refuse(exc)
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


async def aggregate(request: web.Request) -> web.Response:
    """§10.5 over every authorized item, computed in SQL. What may be answered (docs/aggregates.md):
    min/max only with the user's min/max grant; a field only within ``allowed_fields``; at least
    ``aggregate_min_items`` contributing items; and, unless the user granted exact aggregates, sums
    and averages only while no combination of this session's aggregates of the field isolates fewer
    than ``aggregate_min_group`` items (the history survives restarts, ``reads.db``)."""
    call = AgentCall(request, "aggregate")
    svc = call.svc
    try:
        tag = _param(request, "tag")
        op = _param(request, "op")
        field = aggregate_field(_param(request, "field", required=False))
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
        return await _answer_refusal(call, exc)
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

    def compute() -> tuple[policy.AggregateResult, str | None, str | None]:
        store, reads = svc.store, svc.reads
        if not tracked:
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

    res, refused, detail = await asyncio.to_thread(compute)
    if not res.ok:
        return await call.refuse(
            UompError(
                ErrorCode.ACCESS_DENIED,
                f"aggregation needs at least {min_items} contributing items",
                session_id=cap.session_id,
            ),
            res.detail,
        )
    if refused is not None:
        return await call.refuse(UompError(ErrorCode.ACCESS_DENIED, refused, session_id=cap.session_id), detail)
    call.allow("aggregate over granted items", f"{res.contributing} items" + (f"; {detail}" if detail else ""))
    return await call.respond(res.body)


async def _refuse_authenticated(request: web.Request, action: str, code: ErrorCode, message: str) -> web.Response:
    """Routes that exist but never serve an agent: authenticate (so the refusal is audited with who
    asked), then refuse with ``code``."""
    call = AgentCall(request, action, key=request.match_info.get("key"))
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await _answer_refusal(call, exc)
    return await call.refuse(UompError(code, message, session_id=cap.session_id))


async def write_refused(request: web.Request) -> web.Response:
    return await _refuse_authenticated(
        request,
        "write" if request.method == "PUT" else "delete",
        ErrorCode.WRITE_NOT_AVAILABLE,
        "agent writes are not available (spec §20.4)",
    )


async def query_refused(request: web.Request) -> web.Response:
    return await _refuse_authenticated(
        request, "query", ErrorCode.NOT_IMPLEMENTED, "semantic query is not implemented (spec §22)"
    )


async def get_audit(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    call = AgentCall(request, "audit")
    try:
        cap = await call.authenticate()  # the same checks as every agent route (refusals are audited)
    except UompError as exc:
        return await _answer_refusal(call, exc)
    sid = _param(request, "session_id", required=False)
    if sid is not None and sid != cap.session_id:
        raise UompError(
            ErrorCode.ACCESS_DENIED, "an agent may read only its own session's audit log", session_id=cap.session_id
        )
    # ASCII digits only, like every other limit: int() would also take "+5", " 5", "1_0" and "٥"
    limit = _page_limit(request, MAX_AUDIT_PAGE) or 100
    await svc.audit.flush()
    return _json_response(
        {"logs": await svc.audit.reader.run(functools.partial(svc.audit.for_session, cap.session_id, limit=limit))}
    )


async def get_audit_proof(request: web.Request) -> web.Response:
    """``GET /v1/audit/{event_id}/proof`` (issue 10): the proof bundle of one of the agent's *own
    session's* events, as ``uomp audit proof`` writes it. Another session's event and an unknown id
    answer the same 404 NOT_FOUND (spec §21); see :meth:`AuditLog.proof_for_session`."""
    svc = request.app[SERVICES]
    event_id = request.match_info["event_id"]
    call = AgentCall(request, "audit_proof", key=event_id[:128])
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await _answer_refusal(call, exc)
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


def _since(request: web.Request, session_id: str) -> int | None:
    """``since=SIZE``: a tree size the agent saw signed, ASCII digits only; absent: None."""
    raw = _param(request, "since", required=False, max_len=MAX_SINCE_DIGITS)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise UompError(ErrorCode.INVALID_REQUEST, "since must be a tree size (ASCII digits)", session_id=session_id)
    return int(raw)


async def get_audit_checkpoint(request: web.Request) -> web.Response:
    """``GET /v1/audit/checkpoint?since=SIZE``: the log's newest signed checkpoint, and the RFC 9162
    consistency proof from ``SIZE`` (the last size the agent verified) to it, so an agent can check
    that the log it is shown extends the one it saw (docs/audit.md "Agents as witnesses"). Same
    authentication as the other audit routes; not a read (no quota); an ``audit_checkpoint`` event."""
    svc = request.app[SERVICES]
    call = AgentCall(request, "audit_checkpoint")
    try:
        cap = await call.authenticate()
    except UompError as exc:
        return await _answer_refusal(call, exc)
    try:
        since = _since(request, cap.session_id)
        answer = await svc.audit.reader.run(lambda: svc.audit.checkpoint_since(since, cap.session_id))
    except UompError as exc:
        return await call.refuse(exc)
    call.allow("checkpoint", f"tree size {answer['tree_size']}" + ("" if since is None else f" since {since}"))
    return await call.respond(answer)


# ---------------------------------------------------------------------------- sessions


async def create_session(request: web.Request) -> web.Response:
    _admin(request)
    svc = request.app[SERVICES]
    return _json_response(await svc.authdb(svc.auth.create_session, await _json_body(request)), 201)


async def grant_session(request: web.Request) -> web.Response:
    _admin(request)
    body = await _json_body(request)
    svc = request.app[SERVICES]
    return _json_response(await svc.authdb(svc.auth.grant, request.match_info["sid"], body))


async def close_session(request: web.Request) -> web.Response:
    _admin(request)
    svc = request.app[SERVICES]
    return _json_response(await svc.authdb(svc.auth.close, request.match_info["sid"]))


async def revoke_session(request: web.Request) -> web.Response:
    _admin(request)
    svc = request.app[SERVICES]
    return _json_response(await svc.authdb(svc.auth.revoke, request.match_info["sid"]))


async def list_sessions(request: web.Request) -> web.Response:
    _admin(request)
    status = _param(request, "status", required=False)
    svc = request.app[SERVICES]
    return _json_response({"sessions": await svc.authdb(functools.partial(svc.auth.list_sessions, status=status))})


async def get_session(request: web.Request) -> web.Response:
    _admin(request)
    svc = request.app[SERVICES]
    return _json_response((await svc.authdb(svc.auth.session, request.match_info["sid"])).public())


async def validate_token(request: web.Request) -> web.Response:
    body = await _json_body(request)
    svc = request.app[SERVICES]
    return _json_response(await svc.authdb(svc.auth.validate, body.get("token")))


async def deletion_proof(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    sid = request.match_info["sid"]
    call = AgentCall(request, "deletion_proof")
    try:
        cap = await call.authenticate()
        if cap.session_id != sid:
            raise UompError(ErrorCode.ACCESS_DENIED, "token is for another session", session_id=cap.session_id)
        body = await _json_body(request)
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


async def refresh_internal(request: web.Request) -> web.Response:
    """Only on the Unix socket, called by the gateway after it checked the transport (cert or DPoP)."""
    svc = request.app[SERVICES]
    sid = request.match_info["sid"]
    try:
        if not _asserted(request):
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
            via=_via(request),
            extra=event_fields(request, code=exc.code),
        )
        await svc.audit.flush(ticket)
        raise
    await svc.audit.flush(ticket)  # the rotation's row (also in auth.db's outbox: see AuthService)
    return _json_response(answer)


async def health(request: web.Request) -> web.Response:
    """200 while the process runs (the supervisor's check); ``audit`` names a log that is refused."""
    refused = request.app[SERVICES].audit.integrity
    if refused is not None:
        return _json_response({"status": "refusing", "audit": refused.body()})
    return _json_response({"status": "ok"})


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "uomp-guard"
    if request.app[LISTENER] == "unix":
        event_id = request.get(EVENT_KEY)
        if event_id is not None:
            response.headers[contract.EVENT_ID_HEADER] = event_id


# ------------------------------------------------------------------- the gateway's own events

_EVENT_ID = re.compile(r"gw_[0-9a-f]{16,40}")
_CORE_STR = ("session_id", "agent_id", "action", "reason", "key", "via", "detail")
MAX_REASON = 500


def _gateway_row(ev: Any) -> Row:
    """One event of ``POST /v1/internal/events`` as an audit row: typed, bounded, only known fields."""
    if not isinstance(ev, dict):
        raise UompError(ErrorCode.INVALID_REQUEST, "each event must be a JSON object")
    eid = ev.get("id")
    if not isinstance(eid, str) or not _EVENT_ID.fullmatch(eid):
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


async def internal_events(request: web.Request) -> web.Response:
    """``POST /v1/internal/events`` (Unix socket only): the events of requests the remote gateway
    answered alone (its refusals, rejected TLS handshakes, its spool when replayed), written into the
    one log in one group commit, answered once durable. Idempotent by event id (``gw_...``): an event
    sent twice is one event. A body over :data:`gateway.contract.MAX_INTERNAL_EVENTS_BYTES` is 413, a
    malformed one (or one bad event) 400 for the whole batch: the gateway splits it and sets aside
    the one event that stays refused. Trusted like every gateway call here: the socket is 0600, only the
    user's processes reach it; the gateway has no route to it."""
    svc = request.app[SERVICES]
    body = await _json_body(request, contract.MAX_INTERNAL_EVENTS_BYTES)
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
    return _json_response({"accepted": len(rows)})


GuardListener = Literal["unix", "tcp"]
BOTH: tuple[GuardListener, ...] = ("unix", "tcp")
UNIX_ONLY: tuple[GuardListener, ...] = ("unix",)


@dataclass(frozen=True)
class GuardRoute:
    """One row of the guard's route table: adding a route is one row plus its handler."""

    method: str
    path: str  # aiohttp pattern
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    listeners: tuple[GuardListener, ...] = BOTH  # UNIX_ONLY: the gateway's (and the CLI's) internal routes


ROUTES: tuple[GuardRoute, ...] = (
    GuardRoute("GET", "/v1/health", health),
    GuardRoute("GET", "/v1/openapi.json", openapi.serve),  # issue 14: the OpenAPI document (gateway/openapi.py)
    GuardRoute("GET", "/v1/memory/aggregate", aggregate),
    GuardRoute("POST", "/v1/memory/query", query_refused),
    GuardRoute("GET", "/v1/memory/{key}", get_key),
    GuardRoute("PUT", "/v1/memory/{key}", write_refused),
    GuardRoute("DELETE", "/v1/memory/{key}", write_refused),
    GuardRoute("GET", "/v1/memory", get_by_tag),
    GuardRoute("GET", "/v1/audit", get_audit),
    GuardRoute("GET", "/v1/audit/checkpoint", get_audit_checkpoint),
    GuardRoute("GET", "/v1/audit/{event_id}/proof", get_audit_proof),
    GuardRoute("POST", "/v1/sessions", create_session),
    GuardRoute("GET", "/v1/sessions", list_sessions),
    GuardRoute("GET", "/v1/sessions/{sid}", get_session),
    GuardRoute("POST", "/v1/sessions/{sid}/grant", grant_session),
    GuardRoute("POST", "/v1/sessions/{sid}/close", close_session),
    GuardRoute("POST", "/v1/sessions/{sid}/revoke", revoke_session),
    GuardRoute("POST", "/v1/sessions/{sid}/deletion-proof", deletion_proof),
    GuardRoute("POST", "/v1/tokens/validate", validate_token, UNIX_ONLY),
    GuardRoute("POST", contract.INTERNAL_EVENTS_PATH, internal_events, UNIX_ONLY),
    GuardRoute("POST", "/v1/sessions/{sid}/refresh", refresh_internal, UNIX_ONLY),
)


def create_app(services: GuardServices, *, listener: str) -> web.Application:
    if listener not in BOTH:
        raise ValueError("listener must be unix or tcp")
    app = web.Application(middlewares=[errors_middleware], client_max_size=services.cfg.max_body_bytes)
    app[SERVICES] = services
    app[LISTENER] = listener
    app.on_response_prepare.append(_server_header)
    from gateway.guard import payload_routes  # imported here: it imports this module

    for row in (*ROUTES, *payload_routes.ROUTES):
        if listener in row.listeners:
            app.router.add_route(row.method, row.path, row.handler)
    if listener == "unix":
        payload_routes.open_store(app)
    return app
