"""The user's side of the payload relay, on the guard's Unix socket only (never the Local Profile port,
never reachable through the gateway, which has no forwarding route for ``/v1/payloads``).

Every route but the audit one needs the user's admin credential (``Authorization: Bearer``):

* ``GET /v1/payloads[?session_id=]``: the index (``{"payloads": [...]}``: ids, session, agent,
  format, size, hash, encryption header, created/expires, opened);
* ``GET /v1/payloads/{id}``: one entry;
* ``GET /v1/payloads/{id}/ciphertext``: the sealed bytes, streamed from disk in 1 MiB blocks read
  in a thread (``Content-Length`` = size, ``X-UOMP-Payload-Hash`` = hash). The guard never holds the
  private key: ``uomp payload pull`` opens the bytes in the CLI;
* ``POST /v1/payloads/{id}/opened``: the CLI opened it (audited ``payload_opened``);
* ``DELETE /v1/payloads/{id}``: remove it (audited ``payload_removed``).

``POST /v1/payload/audit`` is the gateway's: it records ``payload_uploaded`` / ``payload_refused``
in this guard's audit log and answers once the record is durable; and the home side of an uplink's
(:mod:`gateway.uplink.relay`): ``payload_arrived``, a payload uploaded at a VPS gateway now in this
home's store (``via`` names the uplink it came over; under an id derived from the payload, so kept
once), recorded only when this log holds the session's ``payload_uploaded`` of that id with the
same hash and size (else ``PAYLOAD_HASH_MISMATCH``). A ``payload_uploaded`` carries
the id the gateway gave the event (``gw_`` + 32 hex digits, kept with the pending payload): the log
keeps one event per id, so the gateway can send it again after a crash or a lost answer and the
payload still has exactly one ``payload_uploaded``. The ``payload_refused`` recording the removal of
an upload a crash cut short carries such an id too. Like the forwarded requests it
trusts what arrives on the 0600 socket (only the user's processes can connect); it accepts
nothing but those two actions, with bounded, typed fields.

The store is the one the gateway writes (``$UOMP_HOME/payloads``), opened here *without* the crash
recovery (which would remove an upload the gateway has in flight); its SQLite calls run on one
worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
from typing import Any

from gateway import httpd
from gateway.contract import EVENT_ID_HEADER, VERIFIED_AGENT_HEADER, VERIFIED_VIA_HEADER
from gateway.db import DbWorker
from gateway.errors import ErrorCode, UompError
from gateway.guard.audit import make_row
from gateway.guard.http import (
    SERVICES,
    UNIX_ONLY,
    GuardRoute,
    event_fields,
    json_body,
    json_response,
    query_param,
    require_admin,
)
from gateway.payloads import pulltemp
from gateway.payloads.store import PAYLOAD_ID, PayloadStorage, PayloadStore, fault_hold

log = logging.getLogger("uomp.guard.payloads")

READ_BLOCK = 1024 * 1024
HASH = re.compile(r"sha256:[0-9a-f]{64}")
CODE = re.compile(r"[A-Z_]{1,64}")
GATEWAY_EVENT_ID = re.compile(r"gw_[0-9a-f]{32}")
MAX_FIELD = 256


class GuardPayloads:
    """The payload store on its own worker thread, for the user's payload routes."""

    def __init__(self, store: PayloadStorage) -> None:
        self.store = store
        self.worker = DbWorker("guard-payloads", what="payload store")

    def close(self) -> None:
        self.worker.close()
        self.store.close()

    async def run(self, fn: Any, *args: Any) -> Any:
        return await self.worker.run(fn, *args)


PAYLOADS = httpd.AppKey("payloads", GuardPayloads)


def _pid(request: httpd.Request) -> str:
    pid = request.match_info["pid"]
    if not PAYLOAD_ID.fullmatch(pid):
        raise UompError(ErrorCode.NOT_FOUND, "no such payload")
    return pid


async def list_payloads(request: httpd.Request) -> httpd.Response:
    """``GET /v1/payloads`` (admin): the stored payloads' metadata, optionally of one session."""
    require_admin(request)
    sid = query_param(request, "session_id", required=False)
    metas = await request.app[PAYLOADS].run(functools.partial(request.app[PAYLOADS].store.list, session_id=sid))
    return json_response({"payloads": [m.public() for m in metas]})


async def get_payload(request: httpd.Request) -> httpd.Response:
    """``GET /v1/payloads/{id}`` (admin): one payload's metadata."""
    require_admin(request)
    meta = await request.app[PAYLOADS].run(request.app[PAYLOADS].store.get, _pid(request))
    return json_response(meta.public())


async def get_ciphertext(request: httpd.Request) -> httpd.StreamResponse:
    """``GET /v1/payloads/{id}/ciphertext`` (admin): the sealed bytes, streamed."""
    require_admin(request)
    p = request.app[PAYLOADS]
    pid = _pid(request)
    meta = await p.run(p.store.get, pid)
    fh = await asyncio.to_thread(p.store.open_blob, pid)
    try:
        if (await asyncio.to_thread(os.fstat, fh.fileno())).st_size != meta.size:
            raise UompError(
                ErrorCode.PAYLOAD_INVALID,
                "the stored ciphertext's length is not the one recorded at upload "
                "(changed on disk); it cannot be trusted",
            )
        remaining = meta.size
        resp = httpd.StreamResponse(
            headers={"Content-Type": "application/octet-stream", "X-UOMP-Payload-Hash": meta.hash}
        )
        resp.content_length = meta.size
        await resp.prepare(request)
        while remaining > 0 and (block := await asyncio.to_thread(fh.read, min(READ_BLOCK, remaining))):
            remaining -= len(block)
            await resp.write(block)
        await resp.write_eof()
        return resp
    finally:
        await asyncio.to_thread(fh.close)


async def opened(request: httpd.Request) -> httpd.Response:
    """``POST /v1/payloads/{id}/opened`` (admin): records that the user opened it (``payload_opened``)."""
    require_admin(request)
    p = request.app[PAYLOADS]
    pid = _pid(request)
    meta = await p.run(p.store.get, pid)
    fault_hold("payload_opened_received")
    # the event first: the index never says opened without the event
    _user_event(request, "payload_opened", meta.session_id, meta.agent_id, pid, meta.hash)
    await request.app[SERVICES].audit.flush()
    await p.run(p.store.mark_opened, pid)
    return json_response({"payload_id": pid, "opened": True})


async def remove(request: httpd.Request) -> httpd.Response:
    """``DELETE /v1/payloads/{id}`` (admin): removes it, and records that."""
    require_admin(request)
    p = request.app[PAYLOADS]
    pid = _pid(request)
    meta = await p.run(p.store.get, pid)
    await p.run(p.store.delete, pid)
    _user_event(request, "payload_removed", meta.session_id, meta.agent_id, pid, meta.hash)
    await request.app[SERVICES].audit.flush()
    return json_response({"payload_id": pid, "removed": True})


def _user_event(request: httpd.Request, action: str, sid: str, aid: str, pid: str, digest: str) -> None:
    request.app[SERVICES].audit.record(
        session_id=sid,
        agent_id=aid,
        action=action,
        key=pid,
        allowed=True,
        reason="by the user",
        detail=digest,
        via="cli",
    )


def _field(
    body: dict[str, Any], name: str, pattern: re.Pattern[str] | None = None, *, required: bool = True
) -> str | None:
    v = body.get(name)
    if v is None and not required:
        return None
    if (
        not isinstance(v, str)
        or not v
        or len(v) > MAX_FIELD
        or not v.isprintable()
        or (pattern is not None and not pattern.fullmatch(v))
    ):
        raise UompError(ErrorCode.INVALID_REQUEST, f"audit event field {name} is missing or malformed")
    return v


async def audit_event(request: httpd.Request) -> httpd.Response:
    """The gateway's payload events (see the module docstring)."""
    svc = request.app[SERVICES]
    body = await json_body(request)
    action = body.get("action")
    if action not in ("payload_uploaded", "payload_refused", "payload_arrived"):
        raise UompError(
            ErrorCode.INVALID_REQUEST, "action must be payload_uploaded, payload_refused or payload_arrived"
        )
    sid = _field(body, "session_id")
    aid = _field(body, "agent_id")
    if request.headers.get(VERIFIED_AGENT_HEADER) != aid:
        raise UompError(ErrorCode.AGENT_MISMATCH, "verified agent does not match the event")
    assert sid is not None and aid is not None
    via = request.headers.get(VERIFIED_VIA_HEADER)
    if action in ("payload_uploaded", "payload_arrived"):
        pid = _field(body, "payload_id", PAYLOAD_ID)
        digest = _field(body, "hash", HASH)
        size = body.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise UompError(ErrorCode.INVALID_REQUEST, "audit event field size is missing or malformed")
        event_id = _field(body, "event_id", GATEWAY_EVENT_ID, required=False)
        row = make_row(
            session_id=sid,
            agent_id=aid,
            action=action,
            key=pid,
            allowed=True,
            reason="sealed payload stored" if action == "payload_uploaded" else "sealed payload relayed home",
            detail=digest,
            request_size=size,
            via=via,
            extra=event_fields(request),
            event_id=event_id,
        )
    else:
        pid = _field(body, "payload_id", PAYLOAD_ID, required=False)
        code = _field(body, "code", CODE)
        reason = _field(body, "reason", required=False) or "payload refused"
        event_id = _field(body, "event_id", GATEWAY_EVENT_ID, required=False)
        row = make_row(
            session_id=sid,
            agent_id=aid,
            action="payload_refused",
            key=pid,
            allowed=False,
            reason=reason,
            detail=code,
            via=via,
            extra=event_fields(request, code=code),
            event_id=event_id,
        )
    if action == "payload_arrived":
        await svc.audit.reader.run(_as_uploaded, svc.audit, sid, aid, pid, digest, size)
    await svc.audit.flush(svc.audit.submit(row))
    fault_hold(f"{action}_recorded")
    # This is the upload request's (or the arrival's) one event: the gateway writes none of its own.
    return json_response({"recorded": True}, headers={EVENT_ID_HEADER: row[0]})


def _as_uploaded(audit: Any, sid: str, aid: str, pid: str | None, digest: str | None, size: int) -> None:
    """An arrival must be the bytes this log recorded when they were uploaded (the session's
    ``payload_uploaded`` of that id, its hash and size); else PAYLOAD_HASH_MISMATCH."""
    from gateway.ledger.query import MAX_LIMIT, AuditFilter

    after: int | None = None
    while True:
        page = audit.query(
            AuditFilter(session_id=sid, agent_id=aid, action=("payload_uploaded",), after_seq=after, limit=MAX_LIMIT)
        )
        for e in page.events:
            if e.get("key") == pid:
                if e.get("detail") == digest and e.get("request_size") == size:
                    return
                break
        else:
            if len(page.events) == MAX_LIMIT:
                after = page.cursor
                continue
        raise UompError(
            ErrorCode.PAYLOAD_HASH_MISMATCH,
            "the relayed payload is not the one recorded at its upload (no such upload, or other bytes); refused",
        )


async def _close(app: httpd.App) -> None:
    app[PAYLOADS].close()


ROUTES = (  # Unix socket only: the user's CLI and the gateway, never the Local Profile listener
    GuardRoute("POST", "/v1/payload/audit", audit_event, UNIX_ONLY),
    GuardRoute("GET", "/v1/payloads", list_payloads, UNIX_ONLY),
    GuardRoute("GET", "/v1/payloads/{pid}", get_payload, UNIX_ONLY),
    GuardRoute("GET", "/v1/payloads/{pid}/ciphertext", get_ciphertext, UNIX_ONLY),
    GuardRoute("POST", "/v1/payloads/{pid}/opened", opened, UNIX_ONLY),
    GuardRoute("DELETE", "/v1/payloads/{pid}", remove, UNIX_ONLY),
)


def open_store(app: httpd.App) -> None:
    """The payload store of the Unix-socket app (its routes are rows of :data:`ROUTES`); at start-up,
    the part files of ``uomp payload pull`` runs that were killed are removed."""
    paths = app[SERVICES].paths
    app[PAYLOADS] = GuardPayloads(PayloadStore(paths.payload_dir))
    try:
        removed = pulltemp.sweep(paths)
    except OSError as exc:
        log.warning("could not look for a killed payload pull's files (%s)", exc.strerror)
    else:
        if removed:
            log.info("removed %d plaintext file(s) a killed 'uomp payload pull' left", removed)
    app.on_cleanup.append(_close)
