"""The dashboard's HTTP server (aiohttp, Jinja2 templates, everything shipped in the package).
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

from aiohttp import web

from gateway.config import DashboardConfig, Paths
from gateway.dashboard import security
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

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")
MAX_OPEN_BYTES = 64 << 20  # the payload store's largest ciphertext; decrypted in memory only
MAX_FORM_BYTES = 16 * 1024
PUBLIC_PATHS = ("/login", "/static/")
STATIC = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_key: Any = getattr(web, "RequestKey", lambda name, _t: name)  # typed request keys (aiohttp >= 3.12)
SESSION_KEY: Any = _key("uomp_dashboard_session", security.DashSession)
FORM_KEY: Any = _key("uomp_dashboard_form", object)


class Dashboard:
    """One dashboard server: its app, its login links and sessions, its listener."""

    def __init__(self, paths: Paths, cfg: DashboardConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.paths = paths
        self.cfg = cfg
        self.links = security.LoginLinks(cfg.login_ttl_seconds, paths=paths, clock=clock)
        self.sessions = security.Sessions(idle=cfg.idle_timeout_seconds, max_age=cfg.max_session_seconds, clock=clock)
        self.port: int = cfg.port
        self._runner: web.AppRunner | None = None
        self._env: Any = None  # the jinja2.Environment, made at the first page rendered (_template)
        self._pages: dict[str, Any] = {}  # the LATER_PAGES objects, by class, made at their first request
        pkg = resources.files("gateway.dashboard") / "static"
        self._static = {name: (pkg.joinpath(name).read_bytes(), ctype) for name, ctype in STATIC.items()}

    # ------------------------------------------------------------------------- lifecycle

    def create_app(self) -> web.Application:
        app = web.Application(middlewares=[self._gate], client_max_size=MAX_FORM_BYTES)
        app.on_response_prepare.append(_security_headers)
        r = app.router
        r.add_get("/login", self.login)
        r.add_get("/static/{name}", self.static)
        r.add_get("/", self.overview)
        r.add_get("/sessions", self.sessions_page)
        r.add_post("/sessions/{sid}/{how:revoke|close}", self.end_session)
        r.add_get("/audit", self.audit_page)
        r.add_get("/audit/{eid}/proof.json", self.proof)
        r.add_get("/agents", self.agents_page)
        r.add_post("/agents/revoke", self.revoke_agent)
        r.add_get("/payloads", self.payloads_page)
        r.add_post("/payloads/{pid}/open", self.open_payload)
        r.add_post("/payloads/{pid}/delete", self.delete_payload)
        r.add_get("/appliance", self.appliance_page)
        for method, path, module, cls, name in LATER_PAGES:
            r.add_route(method, path, self._later(module, cls, name))
        r.add_post("/logout", self.logout)
        return app

    def _later(self, module: str, cls: str, name: str) -> Handler:
        """The handler ``cls(self).name`` of ``gateway.dashboard.module``, imported at its first request
        (one instance of ``cls`` per dashboard)."""

        async def handler(request: web.Request) -> web.StreamResponse:
            pages = self._pages.get(cls)
            if pages is None:
                pages = self._pages[cls] = getattr(importlib.import_module(f"gateway.dashboard.{module}"), cls)(self)
            result: web.StreamResponse = await getattr(pages, name)(request)
            return result

        return handler

    async def start(self) -> None:
        self._runner = web.AppRunner(self.create_app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            self._runner = None
            raise
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else self.cfg.port
        log.info("dashboard: listening on http://%s:%d", self.cfg.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def base_url(self) -> str:
        host = "[::1]" if self.cfg.host == "::1" else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def login_link(self) -> str:
        """A fresh one-time login link (print it; never log it)."""
        return f"{self.base_url}/login?t={self.links.mint()}"

    # ------------------------------------------------------------------------- the gate

    @web.middleware
    async def _gate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if not security.peer_is_loopback(peer):
            log.warning("dashboard: refused a request from a non-loopback peer")
            return web.Response(status=403, text="the dashboard answers only on this machine (loopback)\n")
        if not security.host_ok(request.headers.get("Host"), self.port):
            log.warning("dashboard: refused a request for another host name (DNS rebinding?)")
            return web.Response(status=421, text="wrong Host: open the dashboard at its 127.0.0.1 address\n")
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
            form = await request.post()
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
        except web.HTTPException:
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

    def _render(self, request: web.Request, template: str, *, status: int = 200, **ctx: Any) -> web.Response:
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
        return web.Response(status=status, text=html, content_type="text/html", charset="utf-8")

    @staticmethod
    def _back(request: web.Request, to: str, message: str) -> web.Response:
        session: security.DashSession = request[SESSION_KEY]
        session.flash.append(message)
        raise web.HTTPSeeOther(to)

    # ------------------------------------------------------------------------- pages

    async def login(self, request: web.Request) -> web.StreamResponse:
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
        resp = web.HTTPSeeOther("/")
        resp.set_cookie(
            security.COOKIE_NAME,
            cookie,
            httponly=True,
            samesite="Strict",
            path="/",
            max_age=int(self.cfg.max_session_seconds),
        )
        raise resp

    async def logout(self, request: web.Request) -> web.StreamResponse:
        self.sessions.end(request.cookies.get(security.COOKIE_NAME))
        resp = web.HTTPSeeOther("/login")
        resp.del_cookie(security.COOKIE_NAME, path="/")
        raise resp

    async def static(self, request: web.Request) -> web.StreamResponse:
        item = self._static.get(request.match_info["name"])
        if item is None:
            raise web.HTTPNotFound()
        return web.Response(body=item[0], content_type=item[1])

    async def overview(self, request: web.Request) -> web.StreamResponse:
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

    async def sessions_page(self, request: web.Request) -> web.StreamResponse:
        rows = await asyncio.to_thread(data.list_sessions, self.paths)
        return self._render(
            request,
            "sessions.html",
            title="Sessions",
            live=[r for r in rows if r["live"]],
            past=[r for r in rows if not r["live"]],
        )

    async def end_session(self, request: web.Request) -> web.StreamResponse:
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

    async def audit_page(self, request: web.Request) -> web.StreamResponse:
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

    async def proof(self, request: web.Request) -> web.StreamResponse:
        eid = request.match_info["eid"]
        if not ID_RE.match(eid):
            raise UompError(ErrorCode.INVALID_REQUEST, "not an event id")
        bundle = await asyncio.to_thread(data.proof_bundle, self.paths, eid)
        return web.Response(
            body=json.dumps(bundle, indent=2).encode() + b"\n",
            content_type="application/json",
            headers={"Content-Disposition": f'attachment; filename="proof-{eid}.json"'},
        )

    async def agents_page(self, request: web.Request) -> web.StreamResponse:
        rows = await asyncio.to_thread(data.agents, self.paths)
        asked = await asyncio.to_thread(enroll_view.requests, self.paths)
        return self._render(request, "agents.html", title="Agents and certificates", rows=rows, requests=asked)

    async def revoke_agent(self, request: web.Request) -> web.StreamResponse:
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

    async def payloads_page(self, request: web.Request) -> web.StreamResponse:
        try:
            rows = await asyncio.to_thread(data.payloads, self.paths)
            problem = None
        except UompError as exc:
            rows, problem = [], exc.message
        return self._render(request, "payloads.html", title="Payload inbox", rows=rows, problem=problem)

    async def open_payload(self, request: web.Request) -> web.StreamResponse:
        pid = request.match_info["pid"]
        if not ID_RE.match(pid):
            raise UompError(ErrorCode.INVALID_REQUEST, "not a payload id")
        meta, plain = await asyncio.to_thread(data.open_payload, self.paths, pid, max_bytes=MAX_OPEN_BYTES)
        log.info("dashboard: payload %s opened by the user", pid)
        ext = {"application/json": "json", "text/plain": "txt", "text/csv": "csv"}.get(str(meta["format"]), "bin")
        return web.Response(
            body=plain,
            content_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{pid}.{ext}"'},
        )

    async def delete_payload(self, request: web.Request) -> web.StreamResponse:
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

    async def appliance_page(self, request: web.Request) -> web.StreamResponse:
        status = await asyncio.to_thread(data.appliance, self.paths)
        return self._render(request, "appliance.html", title="Appliance", s=status, dashboard_url=self.base_url)


def _endpoint(request: web.Request) -> str:
    """The route a request matched, as a log line may show it (``/payloads/{pid}/open``): never the
    path's own text, which is decoded (a ``%0A`` in it would start a forged log line)."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "(a path of no route)"


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for k, v in HEADERS.items():
        response.headers.setdefault(k, v)


async def start_for_appliance(paths: Paths, *, cfg: DashboardConfig | None = None) -> Dashboard | None:
    """The appliance's hook: start the dashboard when ``[dashboard] enabled`` (the default)."""
    from gateway.config import load_section

    cfg = cfg or load_section(DashboardConfig, "dashboard", file=paths.config_file)
    if not cfg.enabled:
        return None
    dash = Dashboard(paths, cfg)
    await dash.start()
    return dash
