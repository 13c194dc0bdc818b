"""The gateway's forwarded routes: one row each (a gateway-served route adds its row beside its
handler, with :func:`gateway.remote.state.register_route`)."""

from __future__ import annotations

import re

from gateway.remote.request import Route

# §15.4. Session create, grant, revoke and list are deliberately absent: never reachable here. Close,
# status and token validation are the agent's own session's only (the guard decides:
# gateway/guard/routes/sessions.py).
ROUTES: list[Route] = [
    Route("GET", re.compile(r"/v1/health"), "health", auth=False),
    Route("GET", re.compile(r"/v1/memory/aggregate"), "aggregate", reads=True, status_check=False),
    Route("GET", re.compile(r"/v1/memory/(?P<key>[^/]+)"), "read_key", reads=True, status_check=False),
    Route("GET", re.compile(r"/v1/memory"), "read_tag", reads=True, status_check=False),
    Route("GET", re.compile(r"/v1/audit"), "audit", status_check=False),
    Route("POST", re.compile(r"/v1/sessions/(?P<sid>[^/]+)/deletion-proof"), "deletion_proof", status_check=False),
    # own session only (the guard decides)
    Route("GET", re.compile(r"/v1/audit/(?P<event_id>[^/]+)/proof"), "audit_proof", status_check=False),
    Route("GET", re.compile(r"/v1/audit/checkpoint"), "audit_checkpoint", status_check=False),
    Route("POST", re.compile(r"/v1/sessions/(?P<sid>[^/]+)/close"), "session_close", status_check=False),
    Route("GET", re.compile(r"/v1/sessions/(?P<sid>[^/]+)"), "session_status", status_check=False),
    Route("POST", re.compile(r"/v1/tokens/validate"), "token_validate", status_check=False),
    # §10.1 / §20.4: no agent writes and no semantic query in this version. Forwarded (after every
    # check) so the agent gets the guard's own answer (WRITE_NOT_AVAILABLE / NOT_IMPLEMENTED) and
    # the guard's audit log records the attempt, exactly as on the guard itself.
    Route("PUT", re.compile(r"/v1/memory/(?P<key>[^/]+)"), "write", status_check=False),
    Route("DELETE", re.compile(r"/v1/memory/(?P<key>[^/]+)"), "delete", status_check=False),
    Route("POST", re.compile(r"/v1/memory/query"), "query", status_check=False),
]
