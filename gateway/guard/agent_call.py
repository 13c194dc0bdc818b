"""One authenticated agent request (:class:`AgentCall`): §10.4 steps 1-4 (and the read quota)
on the auth.db worker, and the audit event of its answer or refusal."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from mypy_extensions import mypyc_attr

from gateway import httpd, jsonio
from gateway.contract import (
    QUOTA_HEADER,
)
from gateway.core import checks
from gateway.core.capability import Capability
from gateway.db import Durable
from gateway.errors import UompError
from gateway.guard.audit import (
    Row,
    make_row,
)
from gateway.guard.auth import SessionRow
from gateway.guard.http import EVENT_KEY, SERVICES, error_response, event_fields, event_via, prepare

T = TypeVar("T")


@mypyc_attr(native_class=False)  # compiled (gateway/native.py): a generic native class does not load
@dataclass(frozen=True, slots=True)
class AuthOutcome(Generic[T]):
    """What one authentication job on the auth.db worker found: the capability and session row
    (None when authentication failed), the read quota left (reads only), the refusal if any, and
    the result of the job's follow-up work (:meth:`AgentCall.authenticate_then`)."""

    cap: Capability | None
    row: SessionRow | None
    remaining: int | None
    refusal: UompError | None
    result: T | None = None


class AgentCall:
    """One authenticated agent request: runs §10.4 steps 1-4 and records the audit event."""

    def __init__(
        self, request: httpd.Request, action: str, *, key: str | None = None, tags: list[str] | None = None
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
    ) -> AuthOutcome[None]:
        """Runs on the auth.db worker: steps 1-4 with the listener's checks, then (``read``) step 5.
        A refusal with no cap failed authentication; with a cap, the quota."""
        try:
            cap, row = self.svc.auth.authenticate(token, presented=presented, th=th)
        except UompError as exc:
            return AuthOutcome(None, None, None, exc)
        if not read:
            return AuthOutcome(cap, row, None, None)
        try:
            return AuthOutcome(cap, row, self.svc.auth.consume_read(cap, row), None)
        except UompError as exc:
            return AuthOutcome(cap, row, 0, exc)

    def _authenticate_then_on_worker(
        self, token: str, th: str, presented: checks.Presented, then: Callable[..., T], args: tuple[Any, ...]
    ) -> AuthOutcome[T] | Durable:
        auth = self._authenticate_on_worker(token, th, presented, True)
        if auth.cap is None or auth.refusal is not None:
            return AuthOutcome(auth.cap, auth.row, auth.remaining, auth.refusal)
        cap = auth.cap
        self.cap, self.row, self.remaining = cap, auth.row, auth.remaining  # (for an event made on the worker)
        try:
            result = then(cap, *args)
        except UompError as exc:  # the store failed: refused (and audited) with the session known
            return AuthOutcome(cap, auth.row, auth.remaining, exc)
        if isinstance(result, Durable):  # the worker hands it over once its event is durable
            return Durable(result.ticket, AuthOutcome(cap, auth.row, auth.remaining, None, result.value))
        return AuthOutcome(cap, auth.row, auth.remaining, None, result)

    async def _on_worker(self, job: Callable[..., AuthOutcome[T] | Durable], *args: Any) -> AuthOutcome[T]:
        """``job(token, th, presented, *args)`` on the auth.db worker. A refusal with no cap
        (authentication failed) is audited (``deny``) and raised here; the caller handles the rest."""
        presented: checks.Presented | None = None
        try:
            token, th, presented = prepare(self.request)
            # the worker hands over a Durable's value once its event is durable (DbWorker)
            out = cast(AuthOutcome[T], await self.svc.authdb(job, token, th, presented, *args))
            if out.cap is None:
                assert out.refusal is not None
                raise out.refusal
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
        out: AuthOutcome[T] = await self._on_worker(self._authenticate_then_on_worker, then, args)
        self.cap, self.row, self.remaining = out.cap, out.row, out.remaining
        if out.refusal is not None:
            self.deny(out.refusal)
            raise out.refusal
        assert out.cap is not None
        return out.cap, cast(T, out.result)  # set whenever there is no refusal

    async def authenticate(self, *, read: bool = False) -> Capability:
        """§10.4 steps 1-4 (with the checks of :func:`presented_for`) and, with ``read``, step 5 (the
        read quota): one trip to the auth.db worker. A refusal is audited (``deny``) and raised."""
        out: AuthOutcome[None] = await self._on_worker(self._authenticate_on_worker, read)
        self.cap, self.row = out.cap, out.row
        if read:
            self.remaining = out.remaining
        if out.refusal is not None:
            self.deny(out.refusal)
            raise out.refusal
        assert out.cap is not None
        return out.cap

    def _submit(self, row: Row) -> None:
        self.ticket = self.svc.audit.submit(row)
        self.request[EVENT_KEY] = row[0]  # the gateway writes nothing of its own for this request

    def event_context(self, code: str | None = None) -> tuple[int, str, dict[str, Any]]:
        """What the request's event takes from the request itself: body size, ``via``, and the
        gateway's audit fields (:func:`event_fields`). On the event loop."""
        request = self.request
        return request.content_length or 0, event_via(request), {**event_fields(request, code=code), **self.fields}

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
                via=event_via(self.request),
                extra=event_fields(self.request, code=exc.code),
            )
        )

    async def respond(self, body: Any) -> httpd.Response:
        data = jsonio.dumps(body)  # orjson where it gives json's answer
        self.record(True, self._reason, self._detail, response_size=len(data))
        await self.svc.audit.flush(self.ticket)
        return self._response(data)

    async def answer(self, data: bytes) -> httpd.Response:
        """The answer made on the worker (:meth:`record_on_worker`), once its event is durable."""
        assert self.event_id is not None
        self.request[EVENT_KEY] = self.event_id
        await self.svc.audit.flush(self.ticket)  # returns at once when the worker wrote it
        return self._response(data)

    def _response(self, data: bytes) -> httpd.Response:
        headers = {QUOTA_HEADER: str(self.remaining)} if self.remaining is not None else None
        return httpd.Response(data, 200, headers, "application/json; charset=utf-8")

    async def refuse(self, exc: UompError, detail: str | None = None) -> httpd.Response:
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


async def answer_refusal(call: AgentCall, exc: UompError) -> httpd.Response:
    """The refusal was audited by AgentCall; make it durable, then answer (with the quota header)."""
    await call.svc.audit.flush(call.ticket)
    resp = error_response(exc)
    if call.remaining is not None:
        resp.headers[QUOTA_HEADER] = str(call.remaining)
    return resp


# ------------------------------------------------------------------------------ memory
