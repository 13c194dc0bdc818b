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

from gateway import contract, httpd
from gateway.guard.http import (
    BOTH,
    EVENT_KEY,
    LISTENER,
    SERVER_NAME,
    SERVICES,
    UNIX_ONLY,
    GuardRoute,
    errors_middleware,
    refusal,
)
from gateway.guard.routes import audit, internal, payloads, reads, sessions, writes
from gateway.guard.services import GuardServices


def _server_header(request: httpd.Request, headers: dict[str, str]) -> None:
    headers["Server"] = SERVER_NAME
    if request.app[LISTENER] == "unix":
        event_id = request.get(EVENT_KEY)
        if event_id is not None:
            headers[contract.EVENT_ID_HEADER] = event_id


ROUTES: tuple[GuardRoute, ...] = (
    GuardRoute("GET", "/v1/health", internal.health),
    GuardRoute("GET", "/v1/openapi.json", internal.openapi_document),
    GuardRoute("GET", "/v1/memory/aggregate", reads.aggregate),
    GuardRoute("POST", "/v1/memory/query", reads.query_refused),
    GuardRoute("GET", "/v1/memory/{key}", reads.get_key),
    GuardRoute("GET", "/v1/memory", reads.get_by_tag),
    GuardRoute("GET", "/v1/audit", audit.get_audit),
    GuardRoute("GET", "/v1/audit/checkpoint", audit.get_audit_checkpoint),
    GuardRoute("GET", "/v1/audit/{event_id}/proof", audit.get_audit_proof),
    GuardRoute("POST", "/v1/sessions", sessions.create_session),
    GuardRoute("GET", "/v1/sessions", sessions.list_sessions),
    GuardRoute("GET", "/v1/sessions/{sid}", sessions.session_status),
    GuardRoute("POST", "/v1/sessions/{sid}/grant", sessions.grant_session),
    GuardRoute("POST", "/v1/sessions/{sid}/close", sessions.session_close),
    GuardRoute("POST", "/v1/sessions/{sid}/revoke", sessions.revoke_session),
    GuardRoute("POST", "/v1/sessions/{sid}/deletion-proof", sessions.deletion_proof),
    GuardRoute("POST", "/v1/tokens/validate", sessions.token_validate),
    GuardRoute("POST", contract.INTERNAL_EVENTS_PATH, internal.internal_events, UNIX_ONLY),
    GuardRoute("POST", "/v1/sessions/{sid}/refresh", internal.refresh_internal, UNIX_ONLY),
)


def create_app(services: GuardServices, *, listener: str) -> httpd.App:
    """The guard's app for ``listener`` (``unix`` or ``tcp``): the rows of :data:`ROUTES` that
    listener serves. Request bodies are bounded by the handlers (http.read_body)."""
    if listener not in BOTH:
        raise ValueError("listener must be unix or tcp")
    app = httpd.App(middleware=errors_middleware, refusal=refusal, decorate=_server_header)
    app[SERVICES] = services
    app[LISTENER] = listener
    for row in (*ROUTES, *payloads.ROUTES, *writes.ROUTES):
        if listener in row.listeners:
            app.router.add_route(row.method, row.path, row.handler)
    if listener == "unix":
        payloads.open_store(app)
    return app
