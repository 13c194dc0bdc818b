"""Enrollment routes (docs/enrollment.md), served by the gateway on the mTLS listener to agents that
have no certificate yet (the listener asks for a client certificate but does not require one):

* ``GET /v1/enroll/ca``: the user's CA certificate, which the agent checks against the fingerprint
  in its enrollment line before it sends anything (public data: not in the log);
* ``POST /v1/enroll``: a one-time code, the agent's manifest, a CSR and a one-time X25519 key; a
  code that opens a request answers 202 with the request id and a poll secret, every other code
  the one ``ENROLL_CODE_INVALID`` answer;
* ``POST /v1/enroll/{request_id}/status``: the poll (body ``{"poll_token"}``): pending (202),
  approved (200, the answer sealed to the agent's key, handed over once), denied or expired
  (``ENROLL_DENIED``); an unknown id and a wrong secret answer alike (404).

Refused attempts count per client address and in all (``enroll_max_failures*`` in [gateway]);
past either limit every attempt is refused with ``RATE_LIMITED`` before any code is looked at.
Every decision is an event in the guard's one log (``action`` = the route name); a refused code's
event says why (unknown, used, expired, other manifest), its answer does not. The store is
:mod:`gateway.enrollment`; its calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
import weakref
from typing import Any

from cryptography.hazmat.primitives import serialization

from gateway import ca_store, enrollment, httpd
from gateway.core import ca, enrolment, jose
from gateway.errors import ErrorCode, UompError
from gateway.remote.call import record
from gateway.remote.request import Call, Route
from gateway.remote.state import STATE, GatewayState, register_route

MAX_BODY_BYTES = 128 * 1024
POLL_AFTER_SECONDS = 1
MAX_SOURCES = 10_000


class FailureLimiter:
    """Refused attempts in a sliding window, per source and in all (bounded memory)."""

    def __init__(self, per_source: int, total: int, window: float) -> None:
        self.per_source, self.total, self.window = per_source, total, window
        self._by_source: dict[str, collections.deque[float]] = {}
        self._all: collections.deque[float] = collections.deque()

    def _trim(self, q: collections.deque[float], now: float) -> None:
        while q and q[0] <= now - self.window:
            q.popleft()

    def check(self, source: str) -> None:
        now = time.monotonic()
        self._trim(self._all, now)
        q = self._by_source.get(source)
        if q is not None:
            self._trim(q, now)
        if len(self._all) >= self.total or (q is not None and len(q) >= self.per_source):
            raise UompError(
                ErrorCode.RATE_LIMITED,
                "too many refused enrollment attempts; wait a few minutes, then try again with the line the "
                "user gave you (a new one from 'uomp agent invite' if in doubt)",
            )

    def note(self, source: str) -> None:
        now = time.monotonic()
        if len(self._by_source) >= MAX_SOURCES and source not in self._by_source:
            self._by_source.clear()
        q = self._by_source.setdefault(source, collections.deque())
        q.append(now)
        self._all.append(now)
        while len(q) > self.per_source:
            q.popleft()
        while len(self._all) > self.total:
            self._all.popleft()


_LIMITERS: weakref.WeakKeyDictionary[GatewayState, FailureLimiter] = weakref.WeakKeyDictionary()


def _limiter(state: GatewayState) -> FailureLimiter:
    lim = _LIMITERS.get(state)
    if lim is None:
        cfg = state.cfg
        lim = FailureLimiter(
            cfg.enroll_max_failures_per_source, cfg.enroll_max_failures, cfg.enroll_failure_window_seconds
        )
        _LIMITERS[state] = lim
    return lim


async def _read_json(request: httpd.Request) -> dict[str, Any]:
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"an enrollment request is at most {MAX_BODY_BYTES} bytes")
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, f"an enrollment request is at most {MAX_BODY_BYTES} bytes")
        parts.append(chunk)
    try:
        body = json.loads(b"".join(parts))
    except (ValueError, RecursionError) as exc:
        raise UompError(ErrorCode.INVALID_REQUEST, "the body must be a JSON object (docs/enrollment.md)") from exc
    if not isinstance(body, dict):
        raise UompError(ErrorCode.INVALID_REQUEST, "the body must be a JSON object (docs/enrollment.md)")
    return body


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise UompError(ErrorCode.INVALID_REQUEST, f"{name} is required (a string; docs/enrollment.md)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (\ud800) parses as JSON but is no text
        raise UompError(ErrorCode.INVALID_REQUEST, f"{name} must be valid Unicode text") from exc
    return value


async def ca_certificate(call: Call) -> httpd.AnyResponse:
    """``GET /v1/enroll/ca``: the CA certificate and its fingerprint."""
    state = call.request.app[STATE]
    pem = await asyncio.to_thread(ca_store.ca_cert_path(state.paths).read_bytes)
    der = ca.load_cert(pem).public_bytes(serialization.Encoding.DER)
    return httpd.json_response({"ca_cert": pem.decode("ascii"), "fingerprint": enrolment.ca_fingerprint(der)})


def _source(call: Call) -> str:
    return call.request.remote or "unknown"


async def enroll(call: Call) -> httpd.AnyResponse:
    """``POST /v1/enroll``: a code, manifest, CSR and sealing key open a request (202), or the one refusal."""
    state = call.request.app[STATE]
    limiter = _limiter(state)
    source = _source(call)
    limiter.check(source)
    try:
        body = await _read_json(call.request)
        code = enrolment.normalize_code(body.get("code"))
        manifest = _text(body, "manifest").encode()
        digest = enrolment.manifest_digest(manifest)
        csr_pem = _text(body, "csr")
        try:
            csr = ca.load_csr(csr_pem.encode())
        except UompError as exc:
            raise UompError(ErrorCode.INVALID_REQUEST, f"csr: {exc.message}") from exc
        fingerprint = jose.key_thumbprint(csr.public_key())  # type: ignore[arg-type]
        seal_key = _text(body, "seal_key")
        enrolment.seal_public_key(seal_key)
        opened = await asyncio.to_thread(
            enrollment.redeem,
            state.paths,
            code=code,
            manifest_digest=digest,
            manifest=manifest,
            csr=csr_pem,
            seal_key=seal_key,
            key_fingerprint=fingerprint,
            client=call.request.remote,
        )
    except enrollment.CodeRefused as exc:
        limiter.note(source)
        await record(call, status=exc.status, allowed=False, reason=f"enrollment refused: {exc.why}", code=exc.code)
        raise
    except UompError as exc:
        if exc.status < 500:
            limiter.note(source)
        raise
    call.key = opened.request_id
    await record(
        call,
        status=202,
        allowed=True,
        code=None,
        reason=f"enrollment request {opened.request_id} for agent {opened.agent_id} (code {opened.invite_id}); "
        "waiting for the user's decision",
    )
    return httpd.json_response(
        {
            "request_id": opened.request_id,
            "poll_token": opened.poll_token,
            "status": enrollment.PENDING,
            "agent_id": opened.agent_id,
            "key_fingerprint": fingerprint,
            "poll_after_seconds": POLL_AFTER_SECONDS,
        },
        status=202,
    )


async def status(call: Call) -> httpd.AnyResponse:
    """``POST /v1/enroll/{request_id}/status``: the poll (pending, the sealed answer once, denied)."""
    state = call.request.app[STATE]
    limiter = _limiter(state)
    source = _source(call)
    limiter.check(source)
    request_id = call.params.get("rid", "")
    call.key = request_id[:64]
    try:
        body = await _read_json(call.request)
        poll_token = _text(body, "poll_token")
        if len(poll_token) > 128 or len(request_id) > 64:
            raise UompError(ErrorCode.NOT_FOUND, "no such enrollment request")
        answer = await asyncio.to_thread(enrollment.poll, state.paths, request_id, poll_token)
        if answer is None:
            raise UompError(ErrorCode.NOT_FOUND, "no such enrollment request")
    except UompError as exc:
        if exc.status < 500:
            limiter.note(source)
        raise
    st = answer["status"]
    if st == enrollment.PENDING:  # nothing decided: not an event (an agent polls every few seconds)
        return httpd.json_response(
            {"request_id": request_id, "status": st, "poll_after_seconds": POLL_AFTER_SECONDS}, status=202
        )
    if st == enrollment.APPROVED:
        await record(
            call,
            status=200,
            allowed=True,
            code=None,
            reason=f"enrollment {request_id}: the approved answer (session {answer['session_id']}) handed to agent "
            f"{answer['agent_id']}",
        )
        return httpd.json_response(
            {"request_id": request_id, "status": st, "session_id": answer["session_id"], "sealed": answer["sealed"]}
        )
    if st == enrollment.COLLECTED:
        raise UompError(
            ErrorCode.INVALID_STATE,
            "this request's answer was already handed over; if it was lost, ask the user for a new code",
        )
    raise UompError(
        ErrorCode.ENROLL_DENIED,
        f"enrollment {st}: {answer.get('reason') or 'no reason given'}; ask the user (uomp requests list)",
    )


ROUTES = (
    (Route("GET", re.compile(r"/v1/enroll/ca"), "enroll_ca", auth=False, transports=("mtls",)), ca_certificate),
    (Route("POST", re.compile(r"/v1/enroll"), "enroll", auth=False, transports=("mtls",)), enroll),
    (
        Route(
            "POST", re.compile(r"/v1/enroll/(?P<rid>[^/]+)/status"), "enroll_status", auth=False, transports=("mtls",)
        ),
        status,
    ),
)


def install(state: GatewayState) -> None:
    """Registers the enrollment routes (answered without an agent credential: the agent has none yet)."""
    for route, handler in ROUTES:
        register_route(state, route, handler)
