"""The gateway's route names, as a type: a route row, a metrics label or an audit action that names a
route which does not exist is a mypy error, not a silent "other" at run time.

The rows themselves live beside their handlers (:data:`gateway.remote.routes.ROUTES`, the refresh and
renewal rows in :mod:`gateway.remote.agent_routes`, the payload rows in
:mod:`gateway.remote.payload_routes`); ``tests/remote/test_gateway_routes.py`` checks that every name here
has exactly one row and every row's name is here.
"""

from __future__ import annotations

from typing import Literal, get_args

RouteName = Literal[
    "health",  # GET /v1/health
    "aggregate",  # GET /v1/memory/aggregate
    "read_key",  # GET /v1/memory/{key}
    "read_tag",  # GET /v1/memory?tag=
    "audit",  # GET /v1/audit
    "audit_proof",  # GET /v1/audit/{event_id}/proof
    "audit_checkpoint",  # GET /v1/audit/checkpoint?since=
    "deletion_proof",  # POST /v1/sessions/{id}/deletion-proof
    "write",  # PUT /v1/memory/{key} (refused by the guard: WRITE_NOT_AVAILABLE)
    "delete",  # DELETE /v1/memory/{key} (idem)
    "query",  # POST /v1/memory/query (refused by the guard: NOT_IMPLEMENTED)
    "session_close",  # POST /v1/sessions/{id}/close (the token's own session: the guard decides)
    "session_status",  # GET /v1/sessions/{id} (idem)
    "token_validate",  # POST /v1/tokens/validate (the token presented: idem)
    "refresh",  # POST /v1/sessions/{id}/refresh
    "renew",  # POST /v1/certificates/renew
    "payload_upload",  # POST /v1/payload/upload
    "payload_upload_url",  # POST /v1/payload/upload-url
    "payload_presigned",  # PUT /v1/payload/presigned
    "payload_get",  # GET /v1/payload/{id}
    "enroll_ca",  # GET /v1/enroll/ca
    "enroll",  # POST /v1/enroll
    "enroll_status",  # POST /v1/enroll/{request_id}/status
]
ROUTE_NAMES: tuple[RouteName, ...] = get_args(RouteName)

TokenUse = Literal["access", "refresh", "none"]
Listener = Literal["mtls", "tunnel"]

UNKNOWN = "unknown"  # the metrics label of a request that matched no route
