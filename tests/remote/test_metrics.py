"""Prometheus text exposition: format, counters, cumulative histogram, bounded labels, the app."""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway import httpd
from gateway.errors import STATUS
from gateway.remote.metrics import (
    CONTENT_TYPE,
    DEFAULT_BUCKETS,
    Metrics,
    create_metrics_app,
    escape_help,
    escape_label_value,
    format_value,
)

NS = "uomp_gateway"
_SAMPLE = re.compile(
    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r'(?:\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")*)\})?'
    r" (?P<value>[+-]?Inf|NaN|[-+]?[0-9.eE+-]+)"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """A strict little parser for the 0.0.4 text format; fails the test on any odd line."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helps: set[str] = set()
    samples: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helps
            helps.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in {"counter", "gauge", "histogram", "summary", "untyped"}
            assert name in helps and name not in types
            types[name] = kind
        else:
            m = _SAMPLE.fullmatch(line)
            assert m, f"unparsable line {line!r}"
            name = m["name"]
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
            assert family in types, f"sample before its TYPE: {line!r}"
            labels = dict(_LABEL.findall(m["labels"] or ""))
            samples.append((name, labels, float(m["value"])))
    return types, samples


def value(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    hits = [v for n, lab, v in samples if n == name and lab == labels]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_empty_render_has_all_families() -> None:
    types, samples = parse(Metrics().render())
    assert types == {
        f"{NS}_requests_total": "counter",
        f"{NS}_request_duration_seconds": "histogram",
        f"{NS}_open_connections": "gauge",
        f"{NS}_upstream_up": "gauge",
        f"{NS}_upstream_failures_total": "counter",
        f"{NS}_guard_restarts_total": "counter",
        f"{NS}_tls_handshakes_rejected_total": "counter",
    }
    assert value(samples, f"{NS}_open_connections") == 0
    assert value(samples, f"{NS}_guard_restarts_total") == 0
    assert value(samples, f"{NS}_upstream_up") == 0
    assert not [s for s in samples if s[0].startswith(f"{NS}_requests_total")]


def test_counters_increment() -> None:
    m = Metrics()
    for _ in range(3):
        m.observe_request("read_key", None, 0.01)
    m.observe_request("read_key", "ACCESS_DENIED", 0.002)
    m.observe_request("health", "OK", 0.0001)
    assert m.requests_total("read_key", "OK") == 3
    assert m.requests_total("read_key", None) == 3
    _, samples = parse(m.render())
    assert value(samples, f"{NS}_requests_total", route="read_key", code="OK") == 3
    assert value(samples, f"{NS}_requests_total", route="read_key", code="ACCESS_DENIED") == 1
    assert value(samples, f"{NS}_requests_total", route="health", code="OK") == 1


def test_histogram_buckets_cumulative() -> None:
    m = Metrics()
    durations = [0.001, 0.005, 0.007, 0.2, 0.2, 3.0, 60.0, -1.0, math.nan, math.inf, -math.inf]
    for d in durations:
        m.observe_request("read_tag", None, d)
    _, samples = parse(m.render())
    name = f"{NS}_request_duration_seconds"
    buckets = [(lab["le"], v) for n, lab, v in samples if n == f"{name}_bucket" and lab["route"] == "read_tag"]
    assert [le for le, _ in buckets] == [format_value(b) for b in DEFAULT_BUCKETS] + ["+Inf"]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)  # cumulative: never decreasing
    # expected from the raw data (negative, infinite and NaN durations count as 0 s)
    clean = [max(0.0, d) if math.isfinite(d) else 0.0 for d in durations]
    for le, v in buckets:
        bound = math.inf if le == "+Inf" else float(le)
        assert v == sum(1 for d in clean if d <= bound), le
    assert counts[-1] == value(samples, f"{name}_count", route="read_tag") == len(durations)
    assert value(samples, f"{name}_sum", route="read_tag") == pytest.approx(sum(clean))
    assert dict(buckets)["0.005"] == 6  # bounds are inclusive (le)


def test_gauges() -> None:
    m = Metrics()
    m.connection_opened()
    m.connection_opened()
    m.connection_closed()
    m.set_upstream_up(True)
    _, samples = parse(m.render())
    assert value(samples, f"{NS}_open_connections") == 1
    assert value(samples, f"{NS}_upstream_up") == 1
    m.connection_closed()
    m.connection_closed()  # never negative
    m.set_upstream_up(False)
    _, samples = parse(m.render())
    assert value(samples, f"{NS}_open_connections") == 0
    assert value(samples, f"{NS}_upstream_up") == 0


def test_labels_are_bounded() -> None:
    """A path, a key or a token given as a label never reaches the output."""
    m = Metrics()
    secret = 'eyJhbGciOiJFZERTQSJ9.secret"\n'
    m.observe_request("/v1/memory/private.key", "OK", 0.1)
    m.observe_request("read_key", secret, 0.1)
    m.observe_request(secret, secret, 0.1)
    text = m.render()
    assert "private.key" not in text and "eyJ" not in text and "/v1/" not in text
    _, samples = parse(text)
    assert value(samples, f"{NS}_requests_total", route="other", code="OK") == 1
    assert value(samples, f"{NS}_requests_total", route="read_key", code="other") == 1
    assert value(samples, f"{NS}_requests_total", route="other", code="other") == 1


def test_every_error_code_is_a_label() -> None:
    m = Metrics()
    for code in STATUS:
        m.observe_request("audit", code, 0.0)
    _, samples = parse(m.render())
    codes = {lab["code"] for n, lab, _ in samples if n == f"{NS}_requests_total"}
    assert codes == set(STATUS)


@pytest.mark.parametrize("bad", [["memory get"], ["/v1/memory"], ["Memory"], [""], ["a" * 65]])
def test_route_names_validated(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        Metrics(routes=bad)


@pytest.mark.parametrize("bad", [[], [0.1, 0.1], [0.5, 0.1], [math.inf], [math.nan]])
def test_buckets_validated(bad: list[float]) -> None:
    with pytest.raises(ValueError):
        Metrics(buckets=bad)


def test_custom_routes_buckets_namespace() -> None:
    m = Metrics(routes=["a", "b"], buckets=[1, 2], namespace="gw")
    m.observe_request("a", None, 1.5)
    types, samples = parse(m.render())
    assert "gw_requests_total" in types
    assert value(samples, "gw_request_duration_seconds_bucket", route="a", le="1.0") == 0
    assert value(samples, "gw_request_duration_seconds_bucket", route="a", le="2.0") == 1
    assert value(samples, "gw_request_duration_seconds_bucket", route="a", le="+Inf") == 1


def test_escaping() -> None:
    assert escape_label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    assert escape_help("x\\y\nz") == "x\\\\y\\nz"
    assert format_value(math.inf) == "+Inf"
    assert format_value(-math.inf) == "-Inf"
    assert format_value(math.nan) == "NaN"
    assert format_value(3) == "3"
    assert format_value(0.25) == "0.25"


def test_render_is_deterministic() -> None:
    m = Metrics()
    for route in ("payload_get", "audit", "health"):
        m.observe_request(route, None, 0.01)
    text = m.render()
    assert text == m.render()
    routes = [lab["route"] for n, lab, _ in parse(text)[1] if n == f"{NS}_requests_total"]
    assert routes == sorted(routes)


@pytest.fixture
async def served() -> AsyncIterator[tuple[Metrics, str]]:
    m = Metrics()
    server = httpd.Server(create_metrics_app(m), name="metrics")
    port = await server.serve_tcp("127.0.0.1", 0)
    yield m, f"http://127.0.0.1:{port}"
    await server.close(grace=1.0)


async def test_app_serves_metrics(served: tuple[Metrics, str]) -> None:
    m, base = served
    m.observe_request("read_key", None, 0.02)
    m.set_upstream_up(True)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == CONTENT_TYPE
            assert resp.content_type == "text/plain"
            text = await resp.text()
        async with s.head(f"{base}/metrics") as resp:
            assert resp.status == 200
        async with s.post(f"{base}/metrics") as resp:
            assert resp.status == 405
        async with s.get(f"{base}/other") as resp:
            assert resp.status == 404
    assert "version=0.0.4" in CONTENT_TYPE
    _, samples = parse(text)
    assert value(samples, f"{NS}_requests_total", route="read_key", code="OK") == 1
    assert value(samples, f"{NS}_upstream_up") == 1


def test_http_status_codes_map_to_bounded_labels() -> None:
    m = Metrics()
    m.observe_request("read_key", 200, 0.01)
    m.observe_request("read_key", 304, 0.01)
    m.observe_request("read_key", 403, 0.01)
    m.observe_request("read_key", 999, 0.01)
    _, samples = parse(m.render())
    assert value(samples, f"{NS}_requests_total", route="read_key", code="OK") == 2
    assert value(samples, f"{NS}_requests_total", route="read_key", code="HTTP_403") == 1
    assert value(samples, f"{NS}_requests_total", route="read_key", code="other") == 1


def test_gauges_and_add_route() -> None:
    m = Metrics()
    for _ in range(8):
        m.connection_opened()
    m.connection_closed()
    m.set_upstream_up(True)
    assert (m.open_connections, m.upstream_up) == (7, 1)
    for _ in range(9):
        m.connection_closed()
    m.set_upstream_up(False)
    assert (m.open_connections, m.upstream_up) == (0, 0)  # never below zero
    m.observe_request("payload_bulk", None, 0.1)
    m.add_route("payload_bulk")
    m.observe_request("payload_bulk", None, 0.1)
    assert m.requests_total("payload_bulk", None) == 1
    assert value(parse(m.render())[1], f"{NS}_requests_total", route="other", code="OK") == 1
    with pytest.raises(ValueError):
        m.add_route("/v1/payload")


def test_upstream_failures_and_guard_restarts_are_counted() -> None:
    m = Metrics()
    for code in ("STORE_UNAVAILABLE", "STORE_UNAVAILABLE", "UPSTREAM_TIMEOUT", "not a code"):
        m.upstream_failure(code)
    m.guard_restarted()
    _types, samples = parse(m.render())
    assert value(samples, f"{NS}_upstream_failures_total", code="STORE_UNAVAILABLE") == 2
    assert value(samples, f"{NS}_upstream_failures_total", code="UPSTREAM_TIMEOUT") == 1
    assert value(samples, f"{NS}_upstream_failures_total", code="other") == 1  # bounded label values
    assert value(samples, f"{NS}_guard_restarts_total") == 1
