"""The OpenAPI 3.1 document of the guard, Auth Service and gateway endpoints (issue 14).

:func:`document` builds it; ``docs/openapi.json`` is its committed rendering and the guard serves it
at ``GET /v1/openapi.json`` on both local listeners (:func:`serve`). ``tests/test_openapi.py``
keeps it true: the committed file equals :func:`document`, and each operation's
``x-uomp-served-by`` (``guard-tcp``: the Local Profile listener; ``guard-unix``: the guard's Unix
socket; ``gateway``: the mTLS gateway) matches the running apps' route tables exactly.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from aiohttp import web

TCP, UNIX, GW = "guard-tcp", "guard-unix", "gateway"
LOCAL = (TCP, UNIX)
ALL = (TCP, UNIX, GW)

ERROR = {"$ref": "#/components/responses/Error"}
OBJ: dict[str, Any] = {"type": "object"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _param(name: str, where: str = "query", *, required: bool = False, description: str = "") -> dict[str, Any]:
    return {"name": name, "in": where, "required": required or where == "path", "schema": {"type": "string"},
            **({"description": description} if description else {})}


def _op(summary: str, served: tuple[str, ...], *, ok: dict[str, Any] | None = None, status: str = "200",
        params: list[dict[str, Any]] | None = None, body: dict[str, Any] | None = None,
        security: str | None = "token") -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "x-uomp-served-by": list(served),
                          "responses": {status: ok or _json(OBJ), "default": ERROR}}
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"required": False, "content": {"application/json": {"schema": body}}}
    op["security"] = [] if security is None else [{security: []}]
    return op


ITEM = {"type": "object", "description": "A Memory Item (§6), filtered by allowed_fields",
        "properties": {"key": {"type": "string"}, "value": {}, "tags": {"type": "array", "items": {"type": "string"}},
                       "sensitivity": {"enum": ["low", "medium", "high"]}, "source": {"type": "string"},
                       "description": {"type": "string"}, "created_at": {"type": "string"},
                       "updated_at": {"type": "string"}}}
TAG_PAGE = {"type": "object", "required": ["items"],
            "properties": {"items": {"type": "array", "items": ITEM}, "next": {"type": ["string", "null"]}}}
GRANT_ANSWER = {"type": "object", "required": ["token", "token_type", "expires_at", "session_id"],
                "properties": {"token": {"type": "string"}, "token_type": {"const": "Bearer"},
                               "expires_at": {"type": "string"}, "session_id": {"type": "string"},
                               "session_expires_at": {"type": "string"}, "refresh_token": {"type": "string"},
                               "refresh_expires_at": {"type": "string"}}}
SID = _param("sid", "path", description="session id")
KEY = _param("key", "path", description="Memory Item key")
PID = _param("pid", "path", description="payload id")


@functools.cache
def document() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {
        "/v1/health": {"get": _op("liveness", ALL, security=None)},
        "/v1/openapi.json": {"get": _op("this document", LOCAL, security=None)},
        "/v1/memory/{key}": {
            "get": _op("read one item by key (§10.2)", ALL, ok=_json(ITEM), params=[KEY]),
            "put": _op("agent write: always refused WRITE_NOT_AVAILABLE (§10.1)", ALL, params=[KEY]),
            "delete": _op("agent delete: always refused WRITE_NOT_AVAILABLE (§10.1)", ALL, params=[KEY]),
        },
        "/v1/memory": {"get": _op("read by tag, paged (§10.3)", ALL, ok=_json(TAG_PAGE), params=[
            _param("tag", required=True), _param("cursor"), _param("limit")])},
        "/v1/memory/aggregate": {"get": _op("aggregate over a tag (§10.5)", ALL, params=[
            _param("tag", required=True), _param("op", required=True), _param("field")])},
        "/v1/memory/query": {"post": _op("semantic query: not in this version (§10.1): 501 NOT_IMPLEMENTED", ALL,
                                             ok=ERROR, status="501")},
        "/v1/audit": {"get": _op("this session's audit trail (§18)", ALL, ok=_json(
            {"type": "object", "required": ["logs"], "properties": {"logs": {"type": "array"}}}),
            params=[_param("session_id"), _param("limit")])},
        "/v1/sessions": {
            "post": _op("create a session (§9; admin)", LOCAL, status="201", security="admin", body=OBJ),
            "get": _op("list sessions (admin)", LOCAL, security="admin", params=[_param("status")]),
        },
        "/v1/sessions/{sid}": {"get": _op("one session (admin)", LOCAL, security="admin", params=[SID])},
        "/v1/sessions/{sid}/grant": {"post": _op("grant: issues the capability token (§9; admin)", LOCAL,
                                                 ok=_json(GRANT_ANSWER), security="admin", params=[SID],
                                                 body=OBJ)},
        "/v1/sessions/{sid}/close": {"post": _op("close (§13; admin)", LOCAL, security="admin", params=[SID])},
        "/v1/sessions/{sid}/revoke": {"post": _op("revoke (§13.4; admin)", LOCAL, security="admin", params=[SID])},
        "/v1/sessions/{sid}/deletion-proof": {"post": _op("deletion proof (§13.5)", ALL, params=[SID], body=OBJ)},
        "/v1/sessions/{sid}/refresh": {"post": _op(
            "rotate a refresh token (§15.5): on the gateway; the guard's Unix-socket route is its internal half",
            (UNIX, GW), ok=_json(GRANT_ANSWER), security="refresh", params=[SID])},
        "/v1/tokens/validate": {"post": _op("validate a token (§9; the gateway's status check, Unix socket only)",
                                             (UNIX,), body=OBJ, security=None)},
        "/v1/certificates/renew": {"post": _op("renew the agent certificate from a CSR (mTLS only)", (GW,),
                                               security="mtls")},
        "/v1/payload/upload": {"post": _op("upload a sealed payload (§15.6)", (GW,), body=OBJ)},
        "/v1/payload/upload-url": {"post": _op("a single-use upload URL (§15.6 presigned-url)", (GW,), body=OBJ)},
        "/v1/payload/presigned": {"put": _op("upload to a single-use URL", (GW,), security=None,
                                             params=[_param("u", required=True)])},
        "/v1/payload/{pid}": {"get": _op("agents never read payloads: always NOT_FOUND", (GW,), params=[PID])},
        "/v1/payload/audit": {"post": _op("gateway -> guard payload audit event (internal)", (UNIX,))},
        "/v1/payloads": {"get": _op("list waiting payloads (user)", (UNIX,))},
        "/v1/payloads/{pid}": {
            "get": _op("one payload's envelope (user)", (UNIX,), params=[PID]),
            "delete": _op("delete a payload (user)", (UNIX,), params=[PID]),
        },
        "/v1/payloads/{pid}/ciphertext": {"get": _op("the sealed bytes (user)", (UNIX,), params=[PID])},
        "/v1/payloads/{pid}/opened": {"post": _op("mark opened (user)", (UNIX,), params=[PID])},
    }
    for item in paths.values():
        for op in item.values():
            if GW in op["x-uomp-served-by"] and op["security"]:
                op.setdefault("parameters", []).append(
                    {"name": "X-UOMP-Agent-Id", "in": "header", "required": False, "schema": {"type": "string"},
                     "description": "required on the gateway (§15.4); must equal the token's and the "
                     "certificate's agent"})
    return {
        "openapi": "3.1.0",
        "info": {"title": "UOMP guard, Auth Service and gateway", "version": "draft-00",
                 "description": "Endpoints of the UOMP appliance. x-uomp-served-by names the listeners that "
                 "serve each operation. Errors are the §8.4 body with a stable code (README, Error codes)."},
        "servers": [{"url": "http://127.0.0.1:9374", "description": "guard, Local Profile listener"},
                    {"url": "https://localhost:9443", "description": "gateway (TLS 1.3, mutual TLS)"}],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "token": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT",
                          "description": "capability token (§7)"},
                "refresh": {"type": "http", "scheme": "bearer", "description": "refresh token (§15.5)"},
                "admin": {"type": "http", "scheme": "bearer", "description": "the user's admin credential"},
                "mtls": {"type": "mutualTLS", "description": "agent certificate from the user's CA"},
            },
            "schemas": {"Error": {
                "type": "object", "required": ["error"], "additionalProperties": False,
                "properties": {"error": {
                    "type": "object", "required": ["code", "message"],
                    "properties": {"code": {"type": "string", "pattern": "^[A-Z_]+$"},
                                   "message": {"type": "string"}, "session_id": {"type": "string"},
                                   "details": {"type": "object"}}}}}},
            "responses": {"Error": {
                "description": "a refusal in the §8.4 shape",
                "headers": {"WWW-Authenticate": {"description": "on 401: Bearer", "schema": {"type": "string"}}},
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
        },
    }


def render() -> str:
    return json.dumps(document(), indent=2, ensure_ascii=False) + "\n"


async def serve(request: web.Request) -> web.Response:
    return web.Response(text=render(), content_type="application/json")
