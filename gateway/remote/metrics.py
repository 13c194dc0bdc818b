"""Gateway metrics in the Prometheus text exposition format 0.0.4, without a client library.

Families (names prefixed by ``namespace``, default ``uomp_gateway``):

* ``<ns>_requests_total{route, code}`` counter: requests answered;
* ``<ns>_request_duration_seconds{route}`` histogram with fixed buckets;
* ``<ns>_open_connections`` gauge: client connections currently open;
* ``<ns>_upstream_up`` gauge: 1 when the guard behind the gateway answered its last health check
  (on a new connection, see :mod:`gateway.remote.upstream_health`);
* ``<ns>_upstream_failures_total{code}`` counter: exchanges with the guard that failed
  (``STORE_UNAVAILABLE``, ``UPSTREAM_ERROR``, ``UPSTREAM_TIMEOUT``);
* ``<ns>_guard_restarts_total`` counter: guard child restarts by the appliance's supervisor.
* ``<ns>_tls_handshakes_rejected_total{listener, reason}`` counter: handshakes OpenSSL refused
  (reasons: ``gateway.remote.handshake_log.REASONS``).
* ``<ns>_access_log_writable`` gauge and ``<ns>_access_log_events_counted_total`` counter, when
  the gateway connects its access log (fail-closed mode and summarised events).
* ``uomp_anchors{state}`` gauge: the audit checkpoints' anchoring backlog per state (``confirmed``
  means checked on chain; ``rejected``: the chain did not show what the node claimed), when the
  appliance connects it (read at scrape time, off the event loop).

Label values are bounded by construction, so a scrape can never leak a path, a memory key or a
token and the series count cannot grow with traffic: ``route`` is one of the route *names* given
at construction or added with :meth:`Metrics.add_route` (``[a-z][a-z0-9_]*``, never a path);
``code`` is ``OK`` or an error code of :data:`gateway.errors.STATUS` (preferred), or, when only
an HTTP status is at hand, ``OK`` for 1xx-3xx and ``HTTP_<status>`` for 4xx/5xx. Anything else is
counted under ``other``. Values are escaped anyway (``\\``, ``"``, newline) as the format requires.

:func:`create_metrics_app` serves ``GET /metrics``. It carries no authentication: mount it on a
loopback-only listener, never on the agent-facing one.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from http import HTTPStatus

from gateway import httpd
from gateway.errors import STATUS
from gateway.remote.routenames import ROUTE_NAMES, UNKNOWN

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

OK = "OK"  # the code label of a request answered without an error
OTHER = "other"  # the label for a route or code outside the fixed sets

# Route names of the gateway API (spec §15.4): the route table's names (gateway/remote/routenames.py)
# and "unknown" (no route matched: NOT_FOUND / METHOD_NOT_ALLOWED / refused request-target).
DEFAULT_ROUTES: tuple[str, ...] = (*ROUTE_NAMES, UNKNOWN)

# Seconds. Upper bounds of the histogram buckets; +Inf is implicit.
DEFAULT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_CODES = frozenset(STATUS) | {OK}


def escape_label_value(value: str) -> str:
    """Escape a label value for the text format: backslash, double quote, line feed."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Escape HELP text: backslash and line feed."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value (or ``le``) as the text format writes it: ``+Inf``, ``-Inf``, ``NaN``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in pairs) + "}"


class _Histogram:
    __slots__ = ("counts", "sum", "total")

    def __init__(self, nbuckets: int) -> None:
        self.counts = [0] * nbuckets  # per bucket, not cumulative; the last one is +Inf
        self.sum = 0.0
        self.total = 0


class Metrics:
    """Counters, a histogram and two gauges for the gateway. Thread-safe; cheap to update."""

    def __init__(
        self,
        *,
        routes: Iterable[str] = DEFAULT_ROUTES,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        namespace: str = "uomp_gateway",
    ) -> None:
        self.routes = frozenset(routes)
        for r in self.routes | {namespace}:
            if not _NAME.fullmatch(r):
                raise ValueError(f"metric/route name must match {_NAME.pattern}: {r!r}")
        bounds = tuple(float(b) for b in buckets)
        if not bounds or any(not math.isfinite(b) for b in bounds) or list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram buckets must be finite, distinct and increasing")
        self.buckets = bounds
        self.namespace = namespace
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._durations: dict[str, _Histogram] = {}
        self._open_connections = 0
        self._upstream_up = 0
        self._upstream_failures: dict[str, int] = {}
        self._guard_restarts = 0
        self._handshakes_rejected: dict[tuple[str, str], int] = {}
        # the access log's state, read at scrape time (set by the gateway; None in bare tests)
        self.access_log_state: Callable[[], tuple[bool, int]] | None = None
        # the anchoring backlog's counts per state, read at scrape time (None: not connected)
        self.anchor_state: Callable[[], dict[str, int] | None] | None = None
        # the spool's replay into the guard's log: backlog, batches refused, events set aside, replayed
        self.spool_state: Callable[[], tuple[int, int, int, int]] | None = None

    # ---------------------------------------------------------------------------- labels

    def add_route(self, name: str) -> None:
        """Extend the fixed route set (a route registered at start-up by another module)."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"route name must match {_NAME.pattern}: {name!r}")
        with self._lock:
            self.routes = self.routes | {name}

    def route_label(self, route: str) -> str:
        return route if route in self.routes else OTHER

    @staticmethod
    def code_label(code: str | int | None) -> str:
        """``OK``, an error code of errors.STATUS, ``HTTP_4xx``/``HTTP_5xx``, or ``other``."""
        if code is None:
            return OK
        if isinstance(code, int) and not isinstance(code, bool):
            if 100 <= code < 400:
                return OK
            return f"HTTP_{code}" if 400 <= code <= 599 else OTHER
        return code if code in _CODES else OTHER

    # ---------------------------------------------------------------------------- updates

    def observe_request(self, route: str, code: str | int | None, seconds: float) -> None:
        """Count one answered request and its duration.

        ``code``: the error code (``UompError.code``), or None / ``"OK"`` for success; an HTTP
        status is accepted too (coarser: ``OK`` or ``HTTP_<status>``).
        """
        r = route if route in self.routes else OTHER
        c = OK if code is None else self.code_label(code)
        if not 0.0 <= seconds < math.inf:  # negative, infinite or NaN: counted as 0
            seconds = 0.0
        # index of the first bucket whose upper bound holds the value (len(buckets) is +Inf)
        idx = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            self._requests[(r, c)] = self._requests.get((r, c), 0) + 1
            h = self._durations.get(r)
            if h is None:
                h = self._durations[r] = _Histogram(len(self.buckets) + 1)
            h.counts[idx] += 1
            h.sum += seconds
            h.total += 1

    def connection_opened(self) -> None:
        with self._lock:
            self._open_connections += 1

    def connection_closed(self) -> None:
        with self._lock:
            self._open_connections = max(0, self._open_connections - 1)

    def set_upstream_up(self, up: bool) -> None:
        with self._lock:
            self._upstream_up = 1 if up else 0

    def upstream_failure(self, code: str) -> None:
        """Count one failed exchange with the guard (``code``: a stable error code)."""
        c = self.code_label(code)
        with self._lock:
            self._upstream_failures[c] = self._upstream_failures.get(c, 0) + 1

    def guard_restarted(self) -> None:
        with self._lock:
            self._guard_restarts += 1

    def tls_handshake_rejected(self, listener: str, reason: str) -> None:
        """Count one TLS handshake refused on ``listener`` (reason: gateway.remote.handshake_log.REASONS)."""
        key = (listener if _NAME.fullmatch(listener) else "other", reason if _NAME.fullmatch(reason) else "other")
        with self._lock:
            self._handshakes_rejected[key] = self._handshakes_rejected.get(key, 0) + 1

    def upstream_failures(self, code: str) -> int:
        with self._lock:
            return self._upstream_failures.get(self.code_label(code), 0)

    # ---------------------------------------------------------------------------- reading

    def requests_total(self, route: str, code: str | int | None) -> int:
        with self._lock:
            return self._requests.get((self.route_label(route), self.code_label(code)), 0)

    @property
    def open_connections(self) -> int:
        return self._open_connections

    @property
    def upstream_up(self) -> int:
        return self._upstream_up

    def render(self) -> str:
        """The text exposition format 0.0.4: HELP and TYPE for each family, series sorted."""
        ns = self.namespace
        with self._lock:
            requests = sorted(self._requests.items())
            durations = sorted((r, list(h.counts), h.sum, h.total) for r, h in self._durations.items())
            open_conns, up = self._open_connections, self._upstream_up
            failures = sorted(self._upstream_failures.items())
            restarts = self._guard_restarts
            handshakes = sorted(self._handshakes_rejected.items())
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {escape_help(help_text)}")
            out.append(f"# TYPE {name} {kind}")

        name = f"{ns}_requests_total"
        family(name, "counter", "Requests answered by the gateway, by route name and result code.")
        for (r, c), n in requests:
            out.append(f"{name}{_labels((('route', r), ('code', c)))} {n}")

        name = f"{ns}_request_duration_seconds"
        family(name, "histogram", "Time from request received to response ready, by route name.")
        for r, counts, total_s, total_n in durations:
            cumulative = 0
            for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += count
                out.append(f"{name}_bucket{_labels((('route', r), ('le', format_value(bound))))} {cumulative}")
            out.append(f"{name}_sum{_labels((('route', r),))} {format_value(total_s)}")
            out.append(f"{name}_count{_labels((('route', r),))} {total_n}")

        name = f"{ns}_open_connections"
        family(name, "gauge", "Client connections currently open.")
        out.append(f"{name} {open_conns}")

        name = f"{ns}_upstream_up"
        family(name, "gauge", "1 if the upstream guard answered its last health check, else 0.")
        out.append(f"{name} {up}")

        name = f"{ns}_upstream_failures_total"
        family(name, "counter", "Exchanges with the upstream guard that failed, by error code.")
        for c, n in failures:
            out.append(f"{name}{_labels((('code', c),))} {n}")

        name = f"{ns}_guard_restarts_total"
        family(name, "counter", "Guard child processes restarted by the appliance's supervisor.")
        out.append(f"{name} {restarts}")

        name = f"{ns}_tls_handshakes_rejected_total"
        family(
            name,
            "counter",
            "TLS handshakes refused (bad, revoked or foreign certificate, old TLS, plain HTTP), "
            "by listener and reason.",
        )
        for (lst, why), n in handshakes:
            out.append(f"{name}{_labels((('listener', lst), ('reason', why)))} {n}")
        if self.access_log_state is not None:
            writable, counted = self.access_log_state()
            name = f"{ns}_access_log_writable"
            family(name, "gauge", "0 while the access log cannot be written (requests refused with 503).")
            out.append(f"{name} {int(writable)}")
            name = f"{ns}_access_log_events_counted_total"
            family(
                name,
                "counter",
                "Events counted into summary events instead of written one by one "
                "(refused while the log could not be written, or rate-limited unauthenticated events).",
            )
            out.append(f"{name} {counted}")
        anchors = self.anchor_state() if self.anchor_state is not None else None
        if anchors is not None:
            name = "uomp_anchors"
            family(
                name,
                "gauge",
                "Audit checkpoints in the anchoring backlog by state (confirmed = checked on chain; "
                "rejected = the chain did not show it).",
            )
            for state, n in sorted(anchors.items()):
                if _NAME.fullmatch(state):
                    out.append(f"{name}{_labels((('state', state),))} {int(n)}")
        if self.spool_state is not None:
            backlog, refused, set_aside, replayed = self.spool_state()
            for suffix, kind, text, value in (
                ("spool_backlog_events", "gauge", "Spooled gateway events not yet in the guard's log.", backlog),
                (
                    "spool_batches_refused_total",
                    "counter",
                    "Event batches the guard refused (400/413), split and sent again.",
                    refused,
                ),
                (
                    "spool_events_set_aside_total",
                    "counter",
                    "Single spooled events the guard refused: set "
                    "aside (listed in access.setaside.jsonl, kept in the spool), not replayed.",
                    set_aside,
                ),
                ("spool_events_replayed_total", "counter", "Spooled events replayed into the guard's log.", replayed),
            ):
                name = f"{ns}_{suffix}"
                family(name, kind, text)
                out.append(f"{name} {value}")
        return "\n".join(out) + "\n"


METRICS_KEY = httpd.AppKey("uomp_metrics", Metrics)


async def _serve_metrics(request: httpd.Request) -> httpd.Response:
    metrics = request.app[METRICS_KEY]
    text = await asyncio.to_thread(metrics.render) if metrics.anchor_state is not None else metrics.render()
    return httpd.Response(
        body=text.encode("utf-8"), headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"}
    )


def _refusal(status: int) -> httpd.Response:
    return httpd.Response(HTTPStatus(status).phrase.encode() + b"\n", status, content_type="text/plain; charset=utf-8")


async def _plain_errors(request: httpd.Request, handler: httpd.Handler) -> httpd.AnyResponse:
    try:
        return await handler(request)
    except httpd.HTTPError as exc:  # no route (404), or not this method (405)
        return _refusal(exc.status)


def create_metrics_app(metrics: Metrics, *, middleware: httpd.Middleware | None = None) -> httpd.App:
    """An app serving ``GET /metrics`` (and HEAD); ``middleware`` runs around every request.
    Bind it to loopback only."""

    async def errors(request: httpd.Request, handler: httpd.Handler) -> httpd.AnyResponse:
        if middleware is None:
            return await _plain_errors(request, handler)
        return await middleware(request, lambda r: _plain_errors(r, handler))

    app = httpd.App(middleware=errors, refusal=_refusal)
    app[METRICS_KEY] = metrics
    app.router.add_route("GET", "/metrics", _serve_metrics)
    app.router.add_route("HEAD", "/metrics", _serve_metrics)
    return app
