"""The OpenAPI 3.1 document of the guard, Auth Service and gateway endpoints.

:func:`document` builds it; ``docs/openapi.json`` is its committed rendering and the guard serves it
at ``GET /v1/openapi.json`` on both local listeners (``gateway.guard.routes.internal``).
``tests/e2e/test_openapi.py`` keeps it true: the committed file equals :func:`document`, and each operation's
``x-uomp-served-by`` (``guard-tcp``: the Local Profile listener; ``guard-unix``: the guard's Unix
socket; ``gateway``: the mTLS gateway) matches the running apps' route tables exactly.
``tests/e2e/test_schemathesis.py`` runs Schemathesis against the running guard and gateway with it.

What the document promises, and the tests hold the running apps to:

* every status an operation can answer is listed (there is no ``default``), each refusal with the
  §8.4 body whose ``code`` is one of the codes of that status (:data:`gateway.errors.STATUS`);
* success bodies are closed (``additionalProperties: false``) wherever the wire shape is fixed;
  a Memory Item's ``value`` is whatever the user stored;
* ``X-UOMP-Quota-Remaining`` (reads, once the quota was counted), ``WWW-Authenticate`` (every 401)
  and ``X-UOMP-Payload-Hash`` (the sealed bytes) are declared headers.

The wire names are the TypeScript reference's where we are compatible with it (snake_case
``session_id``, ``expires_at``, ``token``, ``token_type``; the §11.1 item; the §8.4 error).

Longer than ~500 lines on purpose: one document, written as data, one operation per endpoint;
splitting it would only scatter the schemas the operations share.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from gateway.core.manifest import DELETION_METHODS
from gateway.errors import STATUS

# Why a client certificate of the user's CA was refused (the error's ``reason``); the same tuple as
# gateway.remote.tls.REFUSAL_REASONS (tests/remote/test_cert_refusal.py compares them).
CERT_REFUSAL_REASONS = ("revoked", "expired", "not_yet_valid", "ca_invalid", "crl_expired")

TCP, UNIX, GW = "guard-tcp", "guard-unix", "gateway"
LOCAL = (TCP, UNIX)
ALL = (TCP, UNIX, GW)

JSON = "application/json"
STR: dict[str, Any] = {"type": "string"}
INT: dict[str, Any] = {"type": "integer", "minimum": 0}
TIME: dict[str, Any] = {
    "type": "string",
    "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$",
    "description": "UTC, ISO 8601, second resolution",
}
STR_LIST: dict[str, Any] = {"type": "array", "items": STR}
ID: dict[str, Any] = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"}


def _closed(required: list[str], props: dict[str, Any], description: str = "") -> dict[str, Any]:
    """An object whose properties are exactly ``props`` (``required`` of them always present)."""
    out: dict[str, Any] = {"type": "object", "required": required, "properties": props, "additionalProperties": False}
    if description:
        out["description"] = description
    return out


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


SCHEMAS: dict[str, Any] = {
    "Item": _closed(
        [],
        {
            "key": STR,
            "value": {"description": "the value the user stored (any JSON)"},
            "tags": STR_LIST,
            "sensitivity": {"enum": ["low", "medium", "high"]},
            "source": STR,
            "description": STR,
            "created_at": STR,
            "updated_at": STR,
        },
        "A Memory Item (§11.1), filtered by allowed_fields (§7.2); sensitivity and source are left out of "
        "high-sensitivity items",
    ),
    "TagPage": _closed(
        ["items", "next"],
        {
            "items": {"type": "array", "items": _ref("Item")},
            "next": {"type": ["string", "null"], "description": "cursor of the next page; null on the last"},
        },
    ),
    "Aggregate": {
        "oneOf": [
            _closed(["op", "tag", "result"], {"op": {"const": "count"}, "tag": STR, "result": INT}),
            _closed(
                ["op", "field", "result"],
                {"op": {"enum": ["sum", "avg", "min", "max"]}, "field": STR, "result": {"type": "number"}},
            ),
        ],
        "description": "§10.5: one number, never a single item's value",
    },
    "AuditRecord": _closed(
        ["id", "timestamp", "session_id", "agent_id", "action", "allowed", "reason"],
        {
            "id": STR,
            "timestamp": STR,
            "session_id": STR,
            "agent_id": STR,
            "action": STR,
            "key": STR,
            "tags": STR_LIST,
            "allowed": {"type": "boolean"},
            "reason": STR,
            "request_size": INT,
            "response_size": INT,
            "query_count_remaining": INT,
            "code": STR,
        },
        "one audit event (§18), as an agent sees it",
    ),
    "AuditPage": _closed(["logs"], {"logs": {"type": "array", "items": _ref("AuditRecord")}}),
    "Scope": _closed(
        ["tags", "keys", "deny_tags", "deny_keys"],
        {"tags": STR_LIST, "keys": STR_LIST, "deny_tags": STR_LIST, "deny_keys": STR_LIST, "allowed_fields": STR_LIST},
    ),
    "Scopes": _closed(["read", "write"], {"read": _ref("Scope"), "write": _ref("Scope")}),
    "SessionCreated": _closed(
        ["session_id", "status", "agent_id", "requested_scopes", "expires_at"],
        {
            "session_id": STR,
            "status": {"const": "created"},
            "agent_id": STR,
            "requested_scopes": _ref("Scopes"),
            "expires_at": TIME,
        },
    ),
    "Session": _closed(
        [
            "session_id",
            "agent_id",
            "agent_name",
            "status",
            "created_at",
            "expires_at",
            "closed_at",
            "requested_scopes",
            "granted_scopes",
        ],
        {
            "session_id": STR,
            "agent_id": STR,
            "agent_name": {"type": ["string", "null"]},
            "status": {"enum": ["created", "active", "closed", "revoked", "expired"]},
            "created_at": TIME,
            "expires_at": TIME,
            "closed_at": {"oneOf": [TIME, {"type": "null"}]},
            "requested_scopes": _ref("Scopes"),
            "granted_scopes": {"oneOf": [_ref("Scopes"), {"type": "null"}]},
            "profile": {"enum": ["local", "remote"]},
            "audience": STR,
            "aggregates": _closed(["min_max", "exact"], {"min_max": {"type": "boolean"}, "exact": {"type": "boolean"}}),
            "data_retention_policy": {"type": "object"},
            "deletion_proof_id": STR,
            "status_reason": STR,
            "abnormal": {"type": "boolean"},
            "abnormal_reason": STR,
        },
        "§13.2: the user's view of a session (never token material); abnormal (§19.5): ended without the "
        "deletion proof its agent owed",
    ),
    "SessionList": _closed(["sessions"], {"sessions": {"type": "array", "items": _ref("Session")}}),
    "SessionEnded": _closed(["session_id", "status"], {"session_id": STR, "status": {"enum": ["closed", "revoked"]}}),
    "Grant": _closed(
        ["token", "token_type", "expires_at", "session_id", "session_expires_at"],
        {
            "token": STR,
            "token_type": {"const": "Bearer"},
            "expires_at": TIME,
            "session_id": STR,
            "session_expires_at": TIME,
            "refresh_token": STR,
            "refresh_expires_at": TIME,
        },
        "the capability token (§7); refresh_token only for a remote, key-bound grant asked with refresh",
    ),
    "Refreshed": _closed(
        ["access_token", "token", "token_type", "expires_at", "refresh_token", "refresh_expires_at", "session_id"],
        {
            "access_token": STR,
            "token": {"description": "the same as access_token", "type": "string"},
            "token_type": {"const": "Bearer"},
            "expires_at": TIME,
            "refresh_token": STR,
            "refresh_expires_at": TIME,
            "session_id": STR,
        },
        "§15.5: a new access token and the next refresh token (the presented one is spent)",
    ),
    "DeletionAccepted": _closed(
        ["status", "deletion_proof_id"], {"status": {"const": "accepted"}, "deletion_proof_id": STR}
    ),
    "Validation": {
        "oneOf": [
            _closed(
                ["valid", "session_id", "agent_id", "expires_at", "status"],
                {
                    "valid": {"const": True},
                    "session_id": STR,
                    "agent_id": STR,
                    "expires_at": TIME,
                    "status": {"enum": ["created", "active"]},
                },
            ),
            _closed(
                ["valid", "code", "message"],
                {"valid": {"const": False}, "code": {"enum": sorted(STATUS)}, "message": STR, "session_id": STR},
            ),
        ]
    },
    "Renewed": _closed(
        ["certificate", "serial", "not_after"],
        {
            "certificate": {"type": "string", "pattern": "^-----BEGIN CERTIFICATE-----"},
            "serial": {"type": "string", "pattern": "^[0-9a-f]+$"},
            "not_after": TIME,
        },
    ),
    "PayloadStored": _closed(
        ["payload_id", "hash", "size", "expires_at"],
        {
            "payload_id": STR,
            "hash": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
            "size": INT,
            "expires_at": TIME,
        },
    ),
    "UploadUrl": _closed(
        ["upload_url", "method", "max_size", "expires_at"],
        {
            "upload_url": {"type": "string", "pattern": "^https://"},
            "method": {"const": "PUT"},
            "max_size": INT,
            "expires_at": TIME,
        },
    ),
    "Payload": _closed(
        [
            "payload_id",
            "session_id",
            "agent_id",
            "format",
            "size",
            "hash",
            "encryption",
            "created_at",
            "expires_at",
            "opened",
        ],
        {
            "payload_id": STR,
            "session_id": STR,
            "agent_id": STR,
            "format": STR,
            "size": INT,
            "hash": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
            "encryption": {"type": "object"},
            "created_at": {"type": "number", "description": "Unix time"},
            "expires_at": {"type": "number"},
            "opened": {"type": "boolean"},
        },
    ),
    "PayloadList": _closed(["payloads"], {"payloads": {"type": "array", "items": _ref("Payload")}}),
    "Proposal": _closed(
        ["proposal_id", "op", "key", "status", "base_version", "created_at", "expires_at"],
        {
            "proposal_id": STR,
            "op": {"enum": ["put", "delete"]},
            "key": STR,
            "status": {"enum": ["pending", "approved", "rejected", "withdrawn", "expired", "stale"]},
            "base_version": INT,
            "applied_version": {"type": ["integer", "null"]},
            "created_at": STR,
            "expires_at": STR,
            "decided_at": {"type": ["string", "null"]},
        },
        "An agent's staged write (docs/writes.md): nothing changes until the user approves it",
    ),
    "ProposalList": _closed(["proposals"], {"proposals": {"type": "array", "items": _ref("Proposal")}}),
    "Error": _closed(
        ["error"],
        {
            "error": _closed(
                ["code", "message"],
                {
                    "code": {"enum": sorted(STATUS)},
                    "message": STR,
                    "session_id": STR,
                    "details": {"type": "object"},
                    # CERT_REQUIRED for a certificate of the user's CA (gateway.remote.tls.REFUSAL_REASONS)
                    "reason": {"enum": list(CERT_REFUSAL_REASONS)},
                },
            )
        },
        "§8.4",
    ),
}

QUOTA = {
    "X-UOMP-Quota-Remaining": {
        "description": "read queries left in this session (§10.4 step 5), once this request was counted",
        "required": False,
        "schema": INT,
    }
}


def _error_response(status: int) -> dict[str, Any]:
    codes = sorted(c for c, s in STATUS.items() if s == status)
    schema = {"allOf": [_ref("Error"), {"properties": {"error": {"properties": {"code": {"enum": codes}}}}}]}
    out: dict[str, Any] = {"description": f"refused: {', '.join(codes)} (§8.4)", "content": {JSON: {"schema": schema}}}
    headers: dict[str, Any] = {}
    if status == 401:
        headers["WWW-Authenticate"] = {
            "description": "the Bearer scheme",
            "required": True,
            "schema": {"type": "string", "pattern": "^Bearer"},
        }
    if status in (403, 429):  # a read refused after its quota was counted says what is left
        headers.update(QUOTA)
    if headers:
        out["headers"] = headers
    return out


ERROR_STATUSES = (400, 401, 403, 404, 409, 413, 429, 501, 502, 503, 504, 507)


def _ok(
    schema: dict[str, Any], description: str = "OK", headers: dict[str, Any] | None = None, media: str = JSON
) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {media: {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _param(
    name: str,
    where: str = "query",
    *,
    required: bool = False,
    description: str = "",
    schema: dict[str, Any] | None = None,
    example: Any = None,
) -> dict[str, Any]:
    out = {
        "name": name,
        "in": where,
        "required": required or where == "path",
        "schema": schema or STR,
        **({"description": description} if description else {}),
    }
    if example is not None:
        out["example"] = example
    return out


def _op(
    summary: str,
    served: tuple[str, ...],
    *,
    ok: dict[str, Any] | None,
    status: str = "200",
    refusals: tuple[int, ...],
    params: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    body_example: Any = None,
    media: str = JSON,
    security: str | None = "token",
) -> dict[str, Any]:
    responses: dict[str, Any] = {status: ok} if ok is not None else {}
    for code in sorted(refusals):
        responses[str(code)] = {"$ref": f"#/components/responses/E{code}"}
    # the listeners again as tags, for tools that filter by tag (schemathesis run --include-tag gateway)
    op: dict[str, Any] = {
        "summary": summary,
        "x-uomp-served-by": list(served),
        "tags": list(served),
        "responses": responses,
    }
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"required": False, "content": {media: {"schema": body}}}
        if body_example is not None:
            op["requestBody"]["content"][media]["example"] = body_example
    op["security"] = [] if security is None else [{security: []}]
    return op


def _either(op: dict[str, Any]) -> dict[str, Any]:
    """An operation that takes an agent token or the admin credential."""
    op["security"] = [{"token": []}, {"admin": []}]
    return op


SID = _param("sid", "path", description="session id")
SINCE = _param(
    "since",
    description="a tree size this agent saw signed: adds the consistency proof between it and the answer's checkpoint",
    schema={"type": "integer", "minimum": 0},
    example=0,
)
CONSISTENCY = _closed(
    ["old_size", "new_size", "path"],
    {
        "old_size": {"type": "integer", "minimum": 0},
        "new_size": {"type": "integer", "minimum": 0},
        "path": {"type": "array", "items": STR},
    },
)
KEY = _param("key", "path", description="Memory Item key", example="preference.theme")
PID = _param("pid", "path", description="payload id")
OCTETS = "application/octet-stream"
ENVELOPE = _param(
    "X-UOMP-Payload-Envelope",
    "header",
    description="the streaming form: base64url (no padding) of "
    "the envelope without its ciphertext; the body is then the sealed bytes, "
    'followed by their raw 32-byte SHA-256 when the envelope\'s hash is "sha256:trailer"',
)

IF_MATCH = _param("If-Match", "header", description='the item version the change is based on, as "N"')
WRITE_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["value"],
    "properties": {
        "value": {"description": "the proposed value (any JSON)"},
        "tags": STR_LIST,
        "sensitivity": {"enum": ["low", "medium"]},
        "description": STR,
        "base_version": INT,
    },
    "additionalProperties": False,
}

# What every agent route can answer on any listener: a malformed or repeated header (400), no or a
# bad token or certificate (401), a rule (403), a database busy past its bounded wait or the guard
# unreachable (503); through the gateway also the guard's failures (502, 504).
AGENT = (400, 401, 403, 503, 502, 504)
READ = (*AGENT, 429)
ADMIN = (400, 401, 503)
SCOPE_IN = {
    "type": "object",
    "properties": {
        "tags": STR_LIST,
        "keys": STR_LIST,
        "deny_tags": STR_LIST,
        "deny_keys": STR_LIST,
        "allowed_fields": STR_LIST,
    },
}


def _with_response(op: dict[str, Any], status: str, response: dict[str, Any]) -> dict[str, Any]:
    """``op`` with one more success answer (an operation with two, like a poll's 200 and 202)."""
    op["responses"] = dict(sorted({**op["responses"], status: response}.items()))
    return op


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of every endpoint of the guard, the Auth Service and the gateway."""
    paths: dict[str, dict[str, Any]] = {
        "/v1/health": {
            "get": _op(
                "liveness; on the gateway 503 STORE_UNAVAILABLE while the guard behind it is down",
                ALL,
                ok=_ok(_closed(["status"], {"status": {"const": "ok"}})),
                refusals=(400, 503),
                security=None,
            )
        },
        "/v1/openapi.json": {
            "get": _op(
                "this document",
                LOCAL,
                ok=_ok(
                    {
                        "type": "object",
                        "required": ["openapi", "info", "paths"],
                        "properties": {"openapi": {"const": "3.1.0"}},
                    }
                ),
                refusals=(400,),
                security=None,
            )
        },
        "/v1/memory/{key}": {
            "get": _op(
                "read one item by key (§10.2)", ALL, ok=_ok(_ref("Item"), headers=QUOTA), refusals=READ, params=[KEY]
            ),
            "put": _op(
                "agent write: a proposal the user approves (202; docs/writes.md); 403 WRITE_NOT_AVAILABLE "
                "without a write scope (§10.1, §20.4)",
                ALL,
                ok=_ok(_ref("Proposal"), "proposal stored; nothing changed yet"),
                status="202",
                refusals=(*AGENT, 409, 413, 429),
                params=[KEY, IF_MATCH],
                body=WRITE_BODY,
                body_example={"value": "light"},
            ),
            "delete": _op(
                "agent delete: a proposal the user approves (202; docs/writes.md); 403 WRITE_NOT_AVAILABLE "
                "without a write scope (§10.1, §20.4)",
                ALL,
                ok=_ok(_ref("Proposal"), "proposal stored; nothing changed yet"),
                status="202",
                refusals=(*AGENT, 409, 413, 429),
                params=[KEY, IF_MATCH],
            ),
        },
        "/v1/proposals": {
            "get": _op(
                "this session's own proposals and their outcome", ALL, ok=_ok(_ref("ProposalList")), refusals=AGENT
            )
        },
        "/v1/proposals/{pid}/withdraw": {
            "post": _op(
                "withdraw one of this session's pending proposals (another session's: 404, as an unknown one)",
                ALL,
                ok=_ok(_ref("Proposal")),
                refusals=(*AGENT, 404, 409),
                params=[_param("pid", "path", description="proposal id")],
            )
        },
        "/v1/memory": {
            "get": _op(
                "read by tag, paged (§10.3)",
                ALL,
                ok=_ok(_ref("TagPage"), headers=QUOTA),
                refusals=READ,
                params=[
                    _param("tag", required=True, example="preference"),
                    _param("cursor"),
                    _param(
                        "limit",
                        description="1 to max_tag_results (the default, 1000)",
                        schema={"type": "integer", "minimum": 1},
                        example=1,
                    ),
                ],
            )
        },
        "/v1/memory/aggregate": {
            "get": _op(
                "aggregate over a tag (§10.5)",
                ALL,
                ok=_ok(_ref("Aggregate"), headers=QUOTA),
                refusals=READ,
                params=[
                    _param("tag", required=True, example="portfolio:holdings"),
                    _param(
                        "op", required=True, schema={"enum": ["sum", "avg", "count", "min", "max"]}, example="count"
                    ),
                    _param(
                        "field",
                        description="value, value.<name>... or <name>... (short for value.<name>...): "
                        "needed for every op but count",
                        example="value.market_value",
                    ),
                ],
            )
        },
        "/v1/memory/query": {
            "post": _op(
                "semantic query: not in this version (§10.1): 501 NOT_IMPLEMENTED after authentication",
                ALL,
                ok=None,
                refusals=(*AGENT, 413, 501),
            )
        },
        "/v1/audit": {
            "get": _op(
                "this session's audit trail (§18), newest first",
                ALL,
                ok=_ok(_ref("AuditPage")),
                refusals=AGENT,
                params=[
                    _param("session_id", description="the token's own only"),
                    _param(
                        "limit",
                        description="default 100",
                        schema={"type": "integer", "minimum": 1, "maximum": 1000},
                        example=5,
                    ),
                ],
            )
        },
        "/v1/audit/{event_id}/proof": {
            "get": _op(
                "proof bundle of one of this session's allowed events (docs/audit.md); another session's or an "
                "unknown id: 404 NOT_FOUND",
                ALL,
                ok=_ok(
                    {
                        "type": "object",
                        "required": [
                            "version",
                            "event",
                            "leaf_index",
                            "tree_size",
                            "inclusion_path",
                            "checkpoint",
                            "verifier_key",
                            "checkpoint_hash",
                            "anchor",
                        ],
                        "properties": {
                            "event": {"type": "object"},
                            "leaf_index": {"type": "integer", "minimum": 0},
                            "tree_size": {"type": "integer", "minimum": 1},
                            "inclusion_path": {"type": "array", "items": STR},
                            "checkpoint": STR,
                            "verifier_key": STR,
                            "checkpoint_hash": STR,
                            "anchor": {"type": ["object", "null"]},
                            "consistency": CONSISTENCY,
                        },
                    }
                ),
                refusals=(*AGENT, 404),
                params=[_param("event_id", "path", description="audit event id"), SINCE],
            )
        },
        "/v1/audit/checkpoint": {
            "get": _op(
                "the log's newest signed checkpoint and, with since, the RFC 9162 consistency proof from that tree "
                "size (docs/audit.md, agents as witnesses); since beyond the newest checkpoint: 400 AUDIT_SIZE_UNKNOWN",
                ALL,
                ok=_ok(
                    _closed(
                        ["tree_size", "checkpoint", "verifier_key"],
                        {
                            "tree_size": {"type": "integer", "minimum": 1},
                            "checkpoint": STR,
                            "verifier_key": STR,
                            "consistency": CONSISTENCY,
                        },
                    )
                ),
                refusals=AGENT,
                params=[SINCE],
            )
        },
        "/v1/sessions": {
            "post": _op(
                "create a session (§9; admin)",
                LOCAL,
                ok=_ok(_ref("SessionCreated"), "created"),
                status="201",
                refusals=(*ADMIN, 413),
                security="admin",
                body={
                    "type": "object",
                    "required": ["agent_id", "requested_scopes"],
                    "properties": {
                        "agent_id": STR,
                        "agent_name": STR,
                        "requested_scopes": {"type": "object", "properties": {"read": SCOPE_IN}},
                        "duration_minutes": {"type": "number"},
                        "profile": {"enum": ["local", "remote"]},
                        "identity_public_jwk": {"type": "object"},
                        "data_retention_policy": {"type": "object"},
                    },
                },
                body_example={
                    "agent_id": "calendar_agent",
                    "agent_name": "Calendar",
                    "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
                    "duration_minutes": 30,
                },
            ),
            "get": _op(
                "list sessions (admin)",
                LOCAL,
                ok=_ok(_ref("SessionList")),
                refusals=ADMIN,
                security="admin",
                params=[_param("status")],
            ),
        },
        "/v1/sessions/{sid}": {
            "get": _either(
                _op(
                    "one session (admin: any; an agent token: its own session only, 403 otherwise)",
                    ALL,
                    ok=_ok(_ref("Session")),
                    refusals=(*AGENT, 404),
                    params=[SID],
                )
            )
        },
        "/v1/sessions/{sid}/grant": {
            "post": _op(
                "grant: issues the capability token (§9; admin)",
                LOCAL,
                ok=_ok(_ref("Grant")),
                refusals=(*ADMIN, 403, 404, 409, 413),
                security="admin",
                params=[SID],
                body={
                    "type": "object",
                    "required": ["granted_scopes"],
                    "properties": {
                        "granted_scopes": {"type": "object", "properties": {"read": SCOPE_IN}},
                        "profile": {"enum": ["local", "remote"]},
                        "audience": STR,
                        "allowed_fields": STR_LIST,
                        "allowed_endpoints": STR_LIST,
                        "aggregation_only": {"type": "boolean"},
                        "task_bound": {"type": "boolean"},
                        "aggregate_min_max": {"type": "boolean"},
                        "aggregate_exact": {"type": "boolean"},
                        "widen": {"type": "boolean"},
                        "refresh": {"type": "boolean"},
                        "token_lifetime_seconds": {"type": "integer"},
                        "limits": {"type": "object", "properties": {"max_read_queries": INT}},
                        "cnf": {"type": "object", "properties": {"x5t#S256": STR, "jkt": STR}},
                    },
                },
                body_example={"granted_scopes": {"read": {"tags": ["preference"], "keys": []}}},
            )
        },
        "/v1/sessions/{sid}/close": {
            "post": _either(
                _op(
                    "close (§9.3, §13; admin: any; an agent token: its own session only, 403 otherwise)",
                    ALL,
                    ok=_ok(_ref("SessionEnded")),
                    refusals=(*AGENT, 404, 409),
                    params=[SID],
                )
            )
        },
        "/v1/sessions/{sid}/revoke": {
            "post": _op(
                "revoke (§13.4; admin)",
                LOCAL,
                ok=_ok(_ref("SessionEnded")),
                refusals=(*ADMIN, 404, 409),
                security="admin",
                params=[SID],
            )
        },
        "/v1/sessions/{sid}/deletion-proof": {
            "post": _op(
                "deletion proof (§13.5, §19.3)",
                ALL,
                ok=_ok(_ref("DeletionAccepted")),
                refusals=(*AGENT, 413),
                params=[SID],
                body=_closed(
                    [
                        "deletion_proof_id",
                        "session_id",
                        "agent_id",
                        "deleted_at",
                        "memory_hash",
                        "method",
                        "proof_value",
                    ],
                    {
                        "deletion_proof_id": ID,
                        "session_id": ID,
                        "agent_id": ID,
                        "deleted_at": TIME,
                        "memory_hash": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
                        "fields_accessed": {"type": "array", "maxItems": 64, "items": STR},
                        "method": {"enum": list(DELETION_METHODS)},
                        "proof_value": {"type": "string", "minLength": 1, "maxLength": 256},
                    },
                ),
            )
        },
        "/v1/sessions/{sid}/refresh": {
            "post": _op(
                "rotate a refresh token (§15.5): on the gateway; the guard's Unix-socket route is its internal half",
                (UNIX, GW),
                ok=_ok(_ref("Refreshed")),
                refusals=AGENT,
                security="refresh",
                params=[SID],
            )
        },
        "/v1/tokens/validate": {
            "post": _op(
                "validate a token (§9.5): an agent its own (the Authorization token; another: 403); "
                "without Authorization on the Unix socket: any token (the gateway's status check)",
                ALL,
                ok=_ok(_ref("Validation")),
                refusals=(*AGENT, 413),
                body={"type": "object", "properties": {"token": STR}},
                security=None,  # the socket's status check takes none; an agent's token: the same as the body's
            )
        },
        "/v1/internal/events": {
            "post": _op(
                "the gateway's own events into the one log (Unix socket only, idempotent by event id)",
                (UNIX,),
                ok=_ok(_closed(["accepted"], {"accepted": {"type": "integer", "minimum": 0}})),
                refusals=(400, 413, 503),
                body={"type": "object", "properties": {"events": {"type": "array"}}},
                security=None,
            )
        },
        "/v1/certificates/renew": {
            "post": _op(
                "renew the agent certificate from a CSR (mTLS only; in the last part of its life)",
                (GW,),
                ok=_ok(_ref("Renewed")),
                refusals=(400, 401, 409, 413, 429, 503),
                security="mtls",
                body={"type": "object", "properties": {"csr": STR}},
            )
        },
        "/v1/enroll/ca": {
            "get": _op(
                "the user's CA certificate and its fingerprint, for an agent that enrolls (docs/enrollment.md): "
                "it checks the fingerprint from its enrollment line before it sends anything",
                (GW,),
                ok=_ok(_closed(["ca_cert", "fingerprint"], {"ca_cert": STR, "fingerprint": STR})),
                refusals=(400, 503),
                security=None,
            )
        },
        "/v1/enroll": {
            "post": _op(
                "enroll with a one-time code (docs/enrollment.md): code, manifest, CSR and a one-time X25519 key; "
                "202 with the request id and its poll secret; every code that opens nothing: ENROLL_CODE_INVALID",
                (GW,),
                ok=_ok({"type": "object"}, "request opened, waiting for the user"),
                status="202",
                refusals=(400, 403, 413, 429, 503),
                body=_closed(
                    ["code", "manifest", "csr", "seal_key"],
                    {"code": STR, "manifest": STR, "csr": STR, "seal_key": STR},
                ),
                security=None,
            )
        },
        "/v1/enroll/{rid}/status": {
            "post": _with_response(
                _op(
                    "poll an enrollment request with its secret: 202 pending, 200 approved (the answer sealed to the "
                    "agent's key, handed over once), ENROLL_DENIED, 404 for an unknown id or a wrong secret alike",
                    (GW,),
                    ok=_ok({"type": "object"}, "approved: the sealed answer"),
                    refusals=(400, 403, 404, 409, 413, 429, 503),
                    body=_closed(["poll_token"], {"poll_token": STR}),
                    params=[_param("rid", "path", description="enrollment request id")],
                    security=None,
                ),
                "202",
                _ok({"type": "object"}, "pending: ask again after poll_after_seconds"),
            )
        },
        "/v1/payload/upload": {
            "post": _op(
                "upload a sealed payload (§15.6): the JSON envelope, or the streaming form "
                "(application/octet-stream with the X-UOMP-Payload-Envelope header)",
                (GW,),
                ok=_ok(_ref("PayloadStored"), "stored"),
                status="201",
                refusals=(*AGENT, 409, 413, 429, 507),
                body={"type": "object"},
                params=[ENVELOPE],
            )
        },
        "/v1/payload/upload-url": {
            "post": _op(
                "a single-use upload URL (§15.6 presigned-url)",
                (GW,),
                ok=_ok(_ref("UploadUrl"), "issued"),
                status="201",
                refusals=(*AGENT, 413, 429),
                body=_closed(["size"], {"size": INT}),
                body_example={"size": 4096},
            )
        },
        "/v1/payload/presigned": {
            "put": _op(
                "upload the streaming form to a single-use URL (still needs the certificate and token)",
                (GW,),
                ok=_ok(_ref("PayloadStored"), "stored"),
                status="201",
                refusals=(*AGENT, 409, 413, 429, 507),
                params=[_param("t", required=True, description="the URL's single-use token"), ENVELOPE],
                body={"type": "string", "format": "binary"},
                media=OCTETS,
            )
        },
        "/v1/payload/{pid}": {
            "get": _op(
                "agents never read payloads: 404 NOT_FOUND whatever the id (§21)",
                (GW,),
                ok=None,
                refusals=(*AGENT, 404),
                params=[PID],
            )
        },
        "/v1/payload/audit": {
            "post": _op(
                "gateway -> guard payload audit event (internal)",
                (UNIX,),
                ok=_ok(_closed(["recorded"], {"recorded": {"const": True}})),
                refusals=(400, 403, 413, 503),
                body={"type": "object"},
                security=None,
            )
        },
        "/v1/payloads": {
            "get": _op(
                "list waiting payloads (user)",
                (UNIX,),
                ok=_ok(_ref("PayloadList")),
                refusals=ADMIN,
                security="admin",
                params=[_param("session_id")],
            )
        },
        "/v1/payloads/{pid}": {
            "get": _op(
                "one payload's envelope (user)",
                (UNIX,),
                ok=_ok(_ref("Payload")),
                refusals=(*ADMIN, 404),
                security="admin",
                params=[PID],
            ),
            "delete": _op(
                "delete a payload (user)",
                (UNIX,),
                ok=_ok(_closed(["payload_id", "removed"], {"payload_id": STR, "removed": {"const": True}})),
                refusals=(*ADMIN, 404),
                security="admin",
                params=[PID],
            ),
        },
        "/v1/payloads/{pid}/ciphertext": {
            "get": _op(
                "the sealed bytes (user)",
                (UNIX,),
                ok=_ok(
                    {"type": "string", "format": "binary"},
                    media=OCTETS,
                    headers={
                        "X-UOMP-Payload-Hash": {
                            "required": True,
                            "schema": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
                        }
                    },
                ),
                refusals=(*ADMIN, 400, 404),
                security="admin",
                params=[PID],
            )
        },
        "/v1/payloads/{pid}/opened": {
            "post": _op(
                "mark opened (user)",
                (UNIX,),
                ok=_ok(_closed(["payload_id", "opened"], {"payload_id": STR, "opened": {"const": True}})),
                refusals=(*ADMIN, 404),
                security="admin",
                params=[PID],
            )
        },
    }
    paths["/v1/payload/upload"]["post"]["requestBody"]["content"][OCTETS] = {
        "schema": {"type": "string", "format": "binary"}
    }
    for item in paths.values():
        for op in item.values():
            if GW in op["x-uomp-served-by"] and op["security"]:
                op.setdefault("parameters", []).append(
                    {
                        "name": "X-UOMP-Agent-Id",
                        "in": "header",
                        "required": False,
                        "schema": STR,
                        "description": "required on the gateway (§15.4); must equal the token's and the "
                        "certificate's agent",
                    }
                )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "UOMP guard, Auth Service and gateway",
            "version": "draft-00",
            "description": "Endpoints of the UOMP appliance. x-uomp-served-by names the listeners that "
            "serve each operation. Every status an operation answers is listed; refusals are the §8.4 body "
            "with a stable code of that status (docs/errors.md).",
        },
        "servers": [
            {"url": "http://127.0.0.1:9374", "description": "guard, Local Profile listener"},
            {"url": "https://localhost:9443", "description": "gateway (TLS 1.3, mutual TLS)"},
        ],
        "tags": [
            {"name": TCP, "description": "the guard's Local Profile listener (http://127.0.0.1:9374)"},
            {"name": UNIX, "description": "the guard's Unix socket ($UOMP_HOME/guard.sock)"},
            {"name": GW, "description": "the gateway (https://localhost:9443, TLS 1.3, mutual TLS)"},
        ],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "token": {
                    "type": "http",
                    "scheme": "bearer",
                    "bearerFormat": "JWT",
                    "description": "capability token (§7)",
                },
                "refresh": {"type": "http", "scheme": "bearer", "description": "refresh token (§15.5)"},
                "admin": {"type": "http", "scheme": "bearer", "description": "the user's admin credential"},
                "mtls": {"type": "mutualTLS", "description": "agent certificate from the user's CA"},
            },
            "schemas": SCHEMAS,
            "responses": {f"E{s}": _error_response(s) for s in ERROR_STATUSES},
        },
    }


def render() -> str:
    """The document as the JSON text kept in docs/openapi.json."""
    return json.dumps(document(), indent=2, ensure_ascii=False) + "\n"
