"""The dashboard's HTTP server (:mod:`gateway.httpd`, Jinja2 templates, everything shipped in the package).
Jinja2 and the pages' own code (the data readers, the Memory and Proposals pages, the charts,
the enrolment view) are imported at the first request that needs them: an appliance whose
dashboard nobody opens holds none of it.

Loopback only, behind the gate of :mod:`gateway.dashboard.security`; served by the appliance
(``uomp gateway start``, :func:`start_for_appliance`) or alone (``uomp dashboard``). Every
response carries a strict Content-Security-Policy (no inline script or style), ``frame-ancestors
'none'`` and ``X-Frame-Options: DENY``, ``Referrer-Policy: no-referrer`` and ``Cache-Control:
no-store``. There is no access log: a request line could carry a login token.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from gateway import httpd
from gateway.config import DashboardConfig, Paths
from gateway.dashboard import security
from gateway.dashboard.answers import (
    Redirect,
    read_form,
    refusal,
    security_headers,
    session_cookie,
    text_answer,
)
from gateway.errors import STATUS, ErrorCode, UompError


class _Later:
    """A module imported at its first attribute read."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: Any = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


# (method, path, module, class, method) of the pages whose module is imported at their first request
LATER_PAGES = (
    ("GET", "/proposals", "proposals_page", "ProposalPages", "page"),
    ("POST", "/proposals/{pid}/{how:approve|reject}", "proposals_page", "ProposalPages", "decide"),
    ("GET", "/memory", "memory_page", "MemoryPages", "page"),
    ("GET", "/memory/item", "memory_page", "MemoryPages", "item"),
    ("POST", "/memory/{how:rollback|delete}", "memory_page", "MemoryPages", "change"),
)

if TYPE_CHECKING:
    from gateway.dashboard import charts, data, enroll_view
else:
    charts = _Later("gateway.dashboard.charts")
    data = _Later("gateway.dashboard.data")
    enroll_view = _Later("gateway.dashboard.enroll_view")

log = logging.getLogger("uomp.dashboard")

ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
MAX_OPEN_BYTES = 64 << 20  # the payload store's largest ciphertext; decrypted in memory only
STOP_GRACE_SECONDS = 5.0  # at stop, a page being answered gets this long
PUBLIC_PATHS = ("/login", "/static/")
STATIC = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}

Handler = Callable[[httpd.Request], Awaitable[httpd.AnyResponse]]
SESSION_KEY = httpd.RequestKey("uomp_dashboard_session", security.DashSession)
FORM_KEY = httpd.RequestKey("uomp_dashboard_form", dict)  # the POST's form: name -> its first value
MAX_CONNECTIONS = 64  # the listener's budget (loopback: the user's browser)


class Dashboard:
    """One dashboard server: its app, its login links and sessions, its listener."""

    def __init__(self, paths: Paths, cfg: DashboardConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.paths = paths
        self.cfg = cfg
        self.links = security.LoginLinks(cfg.login_ttl_seconds, paths=paths, clock=clock)
        self.sessions = security.Sessions(idle=cfg.idle_timeout_seconds, max_age=cfg.max_session_seconds, clock=clock)
        self.port: int = cfg.port
        self._server: httpd.Server | None = None
        self._env: Any = None  # the jinja2.Environment, made at the first page rendered (_template)
        self._pages: dict[str, Any] = {}  # the LATER_PAGES objects, by class, made at their first request
        pkg = resources.files("gateway.dashboard") / "static"
        self._static = {name: (pkg.joinpath(name).read_bytes(), ctype) for name, ctype in STATIC.items()}

    # ------------------------------------------------------------------------- lifecycle

    def create_app(self) -> httpd.App:
        app = httpd.App(middleware=self._gate, refusal=refusal, decorate=security_headers)
        r = app.router
        for method, path, handler in (
            ("GET", "/login", self.login),
            ("GET", "/static/{name}", self.static),
            ("GET", "/", self.overview),
            ("GET", "/sessions", self.sessions_page),
            ("POST", "/sessions/{sid}/{how:revoke|close}", self.end_session),
            ("GET", "/audit", self.audit_page),
            ("GET", "/audit/{eid}/proof.json", self.proof),
            ("GET", "/agents", self.agents_page),
            ("POST", "/agents/revoke", self.revoke_agent),
            ("GET", "/payloads", self.payloads_page),
            ("POST", "/payloads/{pid}/open", self.open_payload),
            ("POST", "/payloads/{pid}/delete", self.delete_payload),
            ("GET", "/appliance", self.appliance_page),
            *((m, path, self._later(module, cls, name)) for m, path, module, cls, name in LATER_PAGES),
            ("POST", "/logout", self.logout),
        ):
            r.add_route(method, path, handler)
            if method == "GET":
                r.add_route("HEAD", path, handler)
        return app

    def _later(self, module: str, cls: str, name: str) -> Handler:
        """The handler ``cls(self).name`` of ``gateway.dashboard.module``, imported at its first request
        (one instance of ``cls`` per dashboard)."""

        async def handler(request: httpd.Request) -> httpd.AnyResponse:
            pages = self._pages.get(cls)
            if pages is None:
                pages = self._pages[cls] = getattr(importlib.import_module(f"gateway.dashboard.{module}"), cls)(self)
            result: httpd.AnyResponse = await getattr(pages, name)(request)
            return result

        return handler

    async def start(self) -> None:
        server = httpd.Server(self.create_app(), name="dashboard", max_connections=MAX_CONNECTIONS)
        try:
            self.port = await server.serve_tcp(self.cfg.host, self.cfg.port)
        except BaseException:
            await server.close(grace=0)
            raise
        self._server = server
        log.info("dashboard: listening on http://%s:%d", self.cfg.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.close(grace=STOP_GRACE_SECONDS)
            self._server = None

    @property
    def base_url(self) -> str:
        host = "[::1]" if self.cfg.host == "::1" else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def login_link(self) -> str:
        """A fresh one-time login link (print it; never log it)."""
        return f"{self.base_url}/login?t={self.links.mint()}"

    # ------------------------------------------------------------------------- the gate

    async def _gate(self, request: httpd.Request, handler: Handler) -> httpd.AnyResponse:
        try:
            return await self._gated(request, handler)
        except Redirect as exc:
            return exc.response
        except httpd.HTTPError as exc:  # no route (404), not this method (405), a form too large (413)
            return refusal(exc.status)

    async def _gated(self, request: httpd.Request, handler: Handler) -> httpd.AnyResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if not security.peer_is_loopback(peer):
            log.warning("dashboard: refused a request from a non-loopback peer")
            return text_answer(403, "the dashboard answers only on this machine (loopback)\n")
        if not security.host_ok(request.headers.get("Host"), self.port):
            log.warning("dashboard: refused a request for another host name (DNS rebinding?)")
            return text_answer(421, "wrong Host: open the dashboard at its 127.0.0.1 address\n")
        if request.path.startswith(PUBLIC_PATHS):
            return await handler(request)
        cookie = request.cookies.get(security.COOKIE_NAME)
        session = self.sessions.get(cookie)
        if session is None:
            return self._render(
                request, "signin.html", status=401, session=None, title="Sign in", stale=cookie is not None
            )
        request[SESSION_KEY] = session
        if request.method == "POST":
            if not security.origin_ok(request.headers.get("Origin"), request.headers.get("Sec-Fetch-Site"), self.port):
                log.warning("dashboard: refused a cross-site POST to %s", _endpoint(request))
                return self._render(
                    request,
                    "error.html",
                    status=403,
                    title="Refused",
                    message="This request came from another site and was refused.",
                )
            form = await read_form(request)
            request[FORM_KEY] = form
            presented = form.get(security.CSRF_FIELD)
            if not isinstance(presented, str) or not security.csrf_ok(session, presented):
                log.warning("dashboard: refused a POST to %s without the right form token", _endpoint(request))
                return self._render(
                    request,
                    "error.html",
                    status=403,
                    title="Refused",
                    message="This form has expired or did not come from the dashboard. Reload the page and try again.",
                )
        try:
            return await handler(request)
        except UompError as exc:
            return self._render(
                request, "error.html", status=STATUS.get(exc.code, 500), title=exc.code, message=exc.message
            )
        except (Redirect, httpd.HTTPError):
            raise
        except Exception:
            log.exception("dashboard: %s %s failed", request.method, _endpoint(request))
            return self._render(
                request,
                "error.html",
                status=500,
                title="Internal error",
                message="This page failed; the appliance's log has the details.",
            )

    # ------------------------------------------------------------------------- rendering

    def _template(self, name: str) -> Any:
        if self._env is None:
            import jinja2

            loader = jinja2.PackageLoader("gateway.dashboard", "templates")
            self._env = jinja2.Environment(loader=loader, autoescape=True)
        return self._env.get_template(name)

    def _render(self, request: httpd.Request, template: str, *, status: int = 200, **ctx: Any) -> httpd.Response:
        session: security.DashSession | None = ctx.pop("session", request.get(SESSION_KEY))
        flash: list[str] = []
        if session is not None:
            flash, session.flash = session.flash, []
        html = self._template(template).render(
            csrf=session.csrf if session else "",
            csrf_field=security.CSRF_FIELD,
            signed_in=session is not None,
            flash=flash,
            path=request.path,
            **ctx,
        )
        return httpd.Response(html.encode("utf-8"), status, content_type="text/html; charset=utf-8")

    @staticmethod
    def _back(request: httpd.Request, to: str, message: str) -> httpd.Response:
        session: security.DashSession = request[SESSION_KEY]
        session.flash.append(message)
        raise Redirect(to)

    # ------------------------------------------------------------------------- pages

    async def login(self, request: httpd.Request) -> httpd.AnyResponse:
        token = request.query.get("t", "")
        if not await asyncio.to_thread(self.links.redeem, token):
            log.warning("dashboard: a login link was refused (unknown, used or expired)")
            return self._render(
                request,
                "error.html",
                status=403,
                session=None,
                title="This link does not work",
                message="A login link works once and for a short time. Run 'uomp dashboard' for a new one.",
            )
        cookie, _ = self.sessions.create()
        log.info("dashboard: signed in with a one-time link")
        max_age = int(self.cfg.max_session_seconds)
        raise Redirect("/", {"Set-Cookie": session_cookie(security.COOKIE_NAME, cookie, max_age=max_age)})

    async def logout(self, request: httpd.Request) -> httpd.AnyResponse:
        self.sessions.end(request.cookies.get(security.COOKIE_NAME))
        raise Redirect("/login", {"Set-Cookie": session_cookie(security.COOKIE_NAME, "", max_age=0)})

    async def static(self, request: httpd.Request) -> httpd.AnyResponse:
        item = self._static.get(request.match_info["name"])
        if item is None:
            raise httpd.HTTPError(404)
        return httpd.Response(item[0], content_type=item[1])

    async def overview(self, request: httpd.Request) -> httpd.AnyResponse:
        status, series, sessions = await asyncio.gather(
            asyncio.to_thread(data.appliance, self.paths),
            asyncio.to_thread(data.activity, self.paths),
            asyncio.to_thread(data.list_sessions, self.paths),
        )
        refused = await asyncio.to_thread(
            data.timeline, self.paths, data.Filters(verdict="refused", period="day"), limit=5
        )
        return self._render(
            request,
            "overview.html",
            title="Overview",
            status_info=status,
            charts=[(a, charts.activity_svg(a, s)) for a, s in series.items()],
            live=[s for s in sessions if s["live"]],
            refused=refused,
        )

    async def sessions_page(self, request: httpd.Request) -> httpd.AnyResponse:
        rows = await asyncio.to_thread(data.list_sessions, self.paths)
        return self._render(
            request,
            "sessions.html",
            title="Sessions",
            live=[r for r in rows if r["live"]],
            past=[r for r in rows if not r["live"]],
        )

    async def end_session(self, request: httpd.Request) -> httpd.AnyResponse:
        sid, how = request.match_info["sid"], request.match_info["how"]
        if not ID_RE.match(sid):
            raise UompError(ErrorCode.INVALID_REQUEST, "not a session id")
        if request[FORM_KEY].get("confirmed") != "yes":
            return self._render(
                request,
                "confirm.html",
                title="Confirm",
                action=f"/sessions/{sid}/{how}",
                question=f"{how.capitalize()} session {sid}?",
                consequence="Its tokens stop working at once; the agent must be authorized again."
                if how == "revoke"
                else "The session ends normally; its tokens stop working.",
                button=f"{how.capitalize()} session",
                fields={},
                cancel="/sessions",
            )
        await asyncio.to_thread(data.end_session, self.paths, sid, how)
        log.info("dashboard: session %s %s by the user", sid, "revoked" if how == "revoke" else "closed")
        return self._back(request, "/sessions", f"Session {sid} {'revoked' if how == 'revoke' else 'closed'}.")

    async def audit_page(self, request: httpd.Request) -> httpd.AnyResponse:
        f = data.parse_filters(request.query)
        rows, (agents, sessions) = await asyncio.gather(
            asyncio.to_thread(data.timeline, self.paths, f),
            asyncio.to_thread(data.known_agents_and_sessions, self.paths),
        )
        return self._render(
            request,
            "audit.html",
            title="Audit timeline",
            rows=rows,
            f=f,
            agents=agents,
            sessions=sessions,
            periods=list(data.PERIODS),
        )

    async def proof(self, request: httpd.Request) -> httpd.AnyResponse:
        eid = request.match_info["eid"]
        if not ID_RE.match(eid):
            raise UompError(ErrorCode.INVALID_REQUEST, "not an event id")
        bundle = await asyncio.to_thread(data.proof_bundle, self.paths, eid)
        return httpd.Response(
            json.dumps(bundle, indent=2).encode() + b"\n",
            content_type="application/json",
            headers={"Content-Disposition": f'attachment; filename="proof-{eid}.json"'},
        )

    async def agents_page(self, request: httpd.Request) -> httpd.AnyResponse:
        rows = await asyncio.to_thread(data.agents, self.paths)
        asked = await asyncio.to_thread(enroll_view.requests, self.paths)
        return self._render(request, "agents.html", title="Agents and certificates", rows=rows, requests=asked)

    async def revoke_agent(self, request: httpd.Request) -> httpd.AnyResponse:
        target = str(request[FORM_KEY].get("target", ""))
        if not ID_RE.match(target):
            raise UompError(ErrorCode.INVALID_REQUEST, "not an agent id or serial")
        if request[FORM_KEY].get("confirmed") != "yes":
            return self._render(
                request,
                "confirm.html",
                title="Confirm",
                action="/agents/revoke",
                question=f"Revoke the certificate(s) of {target}?",
                consequence="The certificate(s) and those renewed from them stop working at once, "
                "and the sessions bound to them are revoked.",
                button="Revoke",
                fields={"target": target},
                cancel="/agents",
            )
        done = await asyncio.to_thread(data.revoke_agent, self.paths, target)
        log.info("dashboard: certificates of %s revoked by the user", target)
        return self._back(
            request,
            "/agents",
            f"Revoked {len(done['revoked'])} certificate(s) of {target}; "
            f"{len(done['sessions'])} session(s) bound to them revoked too.",
        )

    async def payloads_page(self, request: httpd.Request) -> httpd.AnyResponse:
        try:
            rows = await asyncio.to_thread(data.payloads, self.paths)
            problem = None
        except UompError as exc:
            rows, problem = [], exc.message
        return self._render(request, "payloads.html", title="Payload inbox", rows=rows, problem=problem)

    async def open_payload(self, request: httpd.Request) -> httpd.AnyResponse:
        pid = request.match_info["pid"]
        if not ID_RE.match(pid):
            raise UompError(ErrorCode.INVALID_REQUEST, "not a payload id")
        meta, plain = await asyncio.to_thread(data.open_payload, self.paths, pid, max_bytes=MAX_OPEN_BYTES)
        log.info("dashboard: payload %s opened by the user", pid)
        ext = {"application/json": "json", "text/plain": "txt", "text/csv": "csv"}.get(str(meta["format"]), "bin")
        return httpd.Response(
            plain,
            content_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{pid}.{ext}"'},
        )

    async def delete_payload(self, request: httpd.Request) -> httpd.AnyResponse:
        pid = request.match_info["pid"]
        if not ID_RE.match(pid):
            raise UompError(ErrorCode.INVALID_REQUEST, "not a payload id")
        if request[FORM_KEY].get("confirmed") != "yes":
            return self._render(
                request,
                "confirm.html",
                title="Confirm",
                action=f"/payloads/{pid}/delete",
                question=f"Delete payload {pid}?",
                consequence="It is removed from the relay; it cannot be opened afterwards.",
                button="Delete",
                fields={},
                cancel="/payloads",
            )
        await asyncio.to_thread(data.delete_payload, self.paths, pid)
        return self._back(request, "/payloads", f"Payload {pid} deleted.")

    async def appliance_page(self, request: httpd.Request) -> httpd.AnyResponse:
        status = await asyncio.to_thread(data.appliance, self.paths)
        return self._render(request, "appliance.html", title="Appliance", s=status, dashboard_url=self.base_url)


def _endpoint(request: httpd.Request) -> str:
    """The route a request matched, as a log line may show it (``/payloads/{pid}/open``): never the
    path's own text, which is decoded (a ``%0A`` in it would start a forged log line)."""
    return request.route or "(a path of no route)"


async def start_for_appliance(paths: Paths, *, cfg: DashboardConfig | None = None) -> Dashboard | None:
    """The appliance's hook: start the dashboard when ``[dashboard] enabled`` (the default)."""
    from gateway.config import load_section

    cfg = cfg or load_section(DashboardConfig, "dashboard", file=paths.config_file)
    if not cfg.enabled:
        return None
    dash = Dashboard(paths, cfg)
    await dash.start()
    return dash
