"""The gateway's hop to the guard: the lean HTTP/1.1 client against small real Unix-socket servers,
the forwarder through the whole appliance (large bodies over TLS in one process), and the
appliance's supervised guard process (killed: 503, then back)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gatewaykit import agent_call, agent_session, appliance
from guardkit import ITEMS, NOW, seed
from shortdir import short_dir
from startkit import read_until, remote_calendar

from gateway.config import Paths
from gateway.core import http1
from gateway.errors import UompError
from gateway.guard.items import MemoryItem
from gateway.remote import transport, upstream
from gateway.remote.guard_client import Forwarder
from gateway.remote.upstream import Upstream, UpstreamClient

pytestmark = pytest.mark.timeout(60)

Script = Callable[["Fake", int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Fake:
    """A scripted HTTP server on a Unix socket: records connections and the raw requests."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(self, self.connections, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        m = re.search(rb"\r\ncontent-length: *(\d+)", head, re.I)
        body = await reader.readexactly(int(m.group(1))) if m else b""
        self.requests.append(head + body)
        return head + body


@contextlib.asynccontextmanager
async def fake(
    home: Paths, script: Script, *, timeout: float = 2.0, **kw: Any
) -> AsyncIterator[tuple[Fake, UpstreamClient]]:
    f = Fake(script)
    path = str(home.home / "fake.sock")
    f.server = await asyncio.start_unix_server(f.handle, path=path)
    client = UpstreamClient(Upstream("unix", path), timeout_seconds=timeout, **kw)
    try:
        yield f, client
    finally:
        await client.close()
        f.server.close()
        await f.server.wait_closed()


def ok(body: bytes = b'{"ok":true}', extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


def serve_forever(answer: bytes) -> Script:
    async def script(f: Fake, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await f.read_request(reader) is not None:
            writer.write(answer)
            await writer.drain()

    return script


async def fetch(
    client: UpstreamClient,
    method: str = "GET",
    target: str = "/v1/memory/a",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> tuple[int, bytes]:
    resp = await client.request(method, target, headers or {}, body=body)
    try:
        return resp.status, await resp.read(1 << 31)
    finally:
        resp.release()


# ----------------------------------------------------------------------------- the request


async def test_request_is_reframed_and_only_safe_headers_cross(home: Paths) -> None:
    async with fake(home, serve_forever(ok())) as (f, client):
        hostile = {
            "Authorization": "Bearer t",
            "X-UOMP-Agent-Id": "a",
            "Transfer-Encoding": "chunked",
            "Connection": "close, x-uomp-agent-id",
            "Content-Length": "999",
            "Host": "evil",
            "Keep-Alive": "timeout=1",
            "Upgrade": "h2c",
            "TE": "trailers",
            "Expect": "100-continue",
        }
        assert await fetch(client, headers=hostile) == (200, b'{"ok":true}')
        assert await fetch(
            client, "POST", "/v1/tokens/validate", {"content-type": "application/json"}, b'{"token":"x"}'
        ) == (200, b'{"ok":true}')
        assert await fetch(client, "POST", "/v1/x") == (200, b'{"ok":true}')
    get, post, empty_post = f.requests
    assert get == (
        b"GET /v1/memory/a HTTP/1.1\r\nHost: uomp-guard\r\nAuthorization: Bearer t\r\nX-UOMP-Agent-Id: a\r\n\r\n"
    )  # no framing of the agent's, no Content-Length on a GET
    assert post.endswith(b'Content-Length: 13\r\n\r\n{"token":"x"}') and b"chunked" not in post.lower()
    assert b"Content-Length: 0\r\n\r\n" in empty_post  # POST always says how long it is
    assert f.connections == 1  # all three on one keep-alive connection


@pytest.mark.parametrize(
    ("headers", "target"),
    [
        ({"X-A": "v\r\nX-Injected: 1"}, "/v1/memory/a"),
        ({"X-A": "v\nX-Injected: 1"}, "/v1/memory/a"),
        ({"X-A": "v\x00"}, "/v1/memory/a"),
        ({"X A": "v"}, "/v1/memory/a"),
        ({"X-A\r\nX-B": "v"}, "/v1/memory/a"),
        ({}, "/v1/memory/a HTTP/1.1\r\nX: y"),
        ({}, "/v1/memory/é"),
        ({}, "v1/memory/a"),
    ],
    ids=[
        "crlf-value",
        "lf-value",
        "nul-value",
        "space-name",
        "crlf-name",
        "target-crlf",
        "target-non-ascii",
        "target-not-origin-form",
    ],
)
async def test_unsendable_request_is_refused_before_any_byte(home: Paths, headers: dict[str, str], target: str) -> None:
    async with fake(home, serve_forever(ok())) as (f, client):
        with pytest.raises(UompError) as exc:
            await fetch(client, target=target, headers=headers)
        assert exc.value.code == "INVALID_REQUEST"
        assert await fetch(client) == (200, b'{"ok":true}')  # the slot was given back
    assert f.connections == 1 and len(f.requests) == 1


# ----------------------------------------------------------------------------- answers


async def test_chunked_answer_with_extensions_and_trailers_then_reuse(home: Paths) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
        b'5;ext=1\r\n{"a":\r\n3\r\n 1}\r\n0\r\nX-Trailer: t\r\n\r\n'
    )
    async with fake(home, serve_forever(answer)) as (f, client):
        for _ in range(3):
            resp = await client.request("GET", "/v1/memory", {})
            assert resp.body is None and resp.content_length is None and resp.content_type == "application/json"
            chunks = [c async for c in resp.iter_chunks(2)]
            resp.release()
            assert b"".join(chunks) == b'{"a": 1}' and max(len(c) for c in chunks) <= 2
        assert client.idle_connections == 1
    assert f.connections == 1


async def test_large_length_body_is_streamed_and_connection_reused(home: Paths) -> None:
    body = os.urandom(upstream.BUFFER_BODY_BYTES * 3 + 17)
    async with fake(home, serve_forever(ok(body))) as (f, client):
        for _ in range(2):
            resp = await client.request("GET", "/v1/memory", {})
            assert resp.body is None and resp.content_length == len(body)
            got = b"".join([c async for c in resp.iter_chunks(65536)])
            resp.release()
            assert got == body
    assert f.connections == 1


async def test_close_delimited_and_connection_close_answers_are_not_reused(home: Paths) -> None:
    async def script(f: Fake, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await f.read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
        else:
            writer.write(ok(extra="Connection: close\r\n"))
            await writer.drain()
            await reader.read()  # keeps it open: the client must not reuse it anyway

    async with fake(home, script) as (f, client):
        assert await fetch(client) == (200, b"until the end")
        assert await fetch(client) == (200, b'{"ok":true}')
        assert client.idle_connections == 0
        assert await fetch(client) == (200, b'{"ok":true}')
    assert f.connections == 3


async def test_stray_bytes_after_an_answer_retire_the_connection(home: Paths) -> None:
    async with fake(home, serve_forever(ok() + b"HTTP/1.1 200 OK\r\n")) as (f, client):
        assert await fetch(client) == (200, b'{"ok":true}')
        await asyncio.sleep(0.05)
        assert await fetch(client) == (200, b'{"ok":true}')  # never the stray bytes as an answer
    assert f.connections == 2


GARBAGE = [
    ("not http", b"NOT HTTP AT ALL\r\n\r\n\x00\x01"),
    ("http/2 status line", b"HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n"),
    ("two-digit status", b"HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n"),
    ("length and chunked", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    ("two lengths", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc"),
    ("negative length", b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"),
    ("length with sign", b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nab"),
    ("length not a number", b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n"),
    ("gzip coding", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"),
    ("two codings fields", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"),
    ("obs-fold", b"HTTP/1.1 200 OK\r\nContent-Type: a\r\n b\r\nContent-Length: 0\r\n\r\n"),
    ("space before colon", b"HTTP/1.1 200 OK\r\nContent-Length : 0\r\n\r\n"),
    ("field without colon", b"HTTP/1.1 200 OK\r\nContent-Length 0\r\n\r\n"),
    ("nul in value", b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n"),
    ("bare lf in head", b"HTTP/1.1 200 OK\r\nX-A: a\nContent-Length: 0\r\n\r\n"),
    ("interim 1xx", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
    ("head too large", b"HTTP/1.1 200 OK\r\nX-A: " + b"a" * (upstream.MAX_HEAD_BYTES + 10) + b"\r\n\r\n"),
    ("too many fields", b"HTTP/1.1 200 OK\r\n" + b"X-A: a\r\n" * (upstream.MAX_HEADERS + 1) + b"\r\n"),
    ("body cut short", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"),
    ("head cut short", b"HTTP/1.1 200 OK\r\nContent-Le"),
    ("bad chunk size", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n"),
    ("chunk without crlf", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXX0\r\n\r\n"),
    ("chunked cut short", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc"),
    ("huge chunk size", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffff\r\nab"),
]


@pytest.mark.parametrize(("name", "answer"), GARBAGE, ids=[g[0] for g in GARBAGE])
async def test_garbage_is_upstream_error_and_the_connection_is_discarded(home: Paths, name: str, answer: bytes) -> None:
    async def script(f: Fake, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await f.read_request(reader) is not None:
            writer.write(answer if n == 1 else ok())
            await writer.drain()
            if n == 1:
                return  # and close

    async with fake(home, script) as (f, client):
        with pytest.raises(UompError) as exc:
            await fetch(client)
        assert exc.value.code == "UPSTREAM_ERROR", exc.value.message
        assert b"a" * 64 not in exc.value.message.encode()  # never echoes the upstream's bytes
        assert await fetch(client) == (200, b'{"ok":true}')
    assert f.connections == 2


async def test_body_over_the_cap_is_upstream_error(home: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "MAX_BODY_BYTES", 1000)  # the parser's cap (gateway/core/http1.py)
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"200\r\n" + b"x" * 512 + b"\r\n") * 3
    async with fake(home, serve_forever(ok(b"x" * 1001))) as (_f, client):
        with pytest.raises(UompError) as exc:
            await fetch(client)
        assert exc.value.code == "UPSTREAM_ERROR"
    async with fake(home, serve_forever(chunked)) as (_f, client):
        with pytest.raises(UompError) as exc:
            await fetch(client)
        assert exc.value.code == "UPSTREAM_ERROR"


# ----------------------------------------------------------------------------- hang, down, closed


async def test_hang_is_timeout_before_and_inside_the_body(home: Paths) -> None:
    async def script(f: Fake, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await f.read_request(reader)
        if n == 2:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc")
        elif n == 3:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 400000\r\n\r\nabc")
        await reader.read()  # until the client gives up

    async with fake(home, script, timeout=0.3) as (f, client):
        for _ in range(2):  # nothing at all; a small body cut off
            t0 = time.monotonic()
            with pytest.raises(UompError) as exc:
                await fetch(client)
            assert exc.value.code == "UPSTREAM_TIMEOUT" and time.monotonic() - t0 < 2
        resp = await client.request("GET", "/v1/memory", {})  # a large body: streamed, then cut off
        with pytest.raises(UompError) as exc:
            async for _c in resp.iter_chunks():
                pass
        resp.release()
        assert exc.value.code == "UPSTREAM_TIMEOUT"
        assert client.idle_connections == 0
    assert f.connections == 3


async def test_down_is_store_unavailable(home: Paths) -> None:
    missing = UpstreamClient(Upstream("unix", str(home.home / "nobody.sock")), timeout_seconds=1)
    with pytest.raises(UompError) as exc:
        await fetch(missing)
    assert exc.value.code == "STORE_UNAVAILABLE"
    # a socket file nobody listens on (what a killed guard leaves): refused
    stale = home.home / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    refused = UpstreamClient(Upstream("unix", str(stale)), timeout_seconds=1)
    with pytest.raises(UompError) as exc:
        await fetch(refused)
    assert exc.value.code == "STORE_UNAVAILABLE"
    # TCP: nothing on the port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tcp = UpstreamClient(Upstream.parse(f"http://127.0.0.1:{port}"), timeout_seconds=1)
    with pytest.raises(UompError) as exc:
        await fetch(tcp)
    assert exc.value.code == "STORE_UNAVAILABLE"


async def test_accepted_then_closed_without_a_byte_is_store_unavailable(home: Paths) -> None:
    async def script(f: Fake, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await f.read_request(reader)

    async with fake(home, script) as (f, client):
        with pytest.raises(UompError) as exc:
            await fetch(client)
        assert exc.value.code == "STORE_UNAVAILABLE" and client.retries == 0  # fresh connection: no retry
    assert f.connections == 1


def _close_second_request_on_first_connection(answer: bytes) -> Script:
    """Connection 1 answers one request, then reads the next and closes without a byte: a keep-alive
    connection the server closed just as the client reused it."""

    async def script(f: Fake, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await f.read_request(reader) is not None:
            if n == 1 and len(f.requests) == 2:
                return
            writer.write(answer)
            await writer.drain()

    return script


async def test_reused_connection_closed_by_server_get_is_retried_once(home: Paths) -> None:
    async with fake(home, _close_second_request_on_first_connection(ok())) as (f, client):
        assert await fetch(client) == (200, b'{"ok":true}')
        assert await fetch(client) == (200, b'{"ok":true}')  # transparently, on a new connection
        assert client.retries == 1
    assert f.connections == 2 and len(f.requests) == 3


async def test_reused_connection_closed_by_server_post_is_never_replayed(home: Paths) -> None:
    async with fake(home, _close_second_request_on_first_connection(ok())) as (f, client):
        assert await fetch(client, "POST", "/v1/tokens/validate", body=b"{}") == (200, b'{"ok":true}')
        with pytest.raises(UompError) as exc:
            await fetch(client, "POST", "/v1/tokens/validate", body=b"{}")
        assert exc.value.code == "STORE_UNAVAILABLE" and client.retries == 0
    assert f.connections == 1 and len(f.requests) == 2  # sent once, not twice


async def test_idle_connection_closed_by_server_is_not_reused(home: Paths) -> None:
    async def script(f: Fake, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await f.read_request(reader)
        writer.write(ok())
        await writer.drain()  # then close while the client holds it idle

    async with fake(home, script) as (f, client):
        assert await fetch(client) == (200, b'{"ok":true}')
        await asyncio.sleep(0.1)
        assert await fetch(client) == (200, b'{"ok":true}')
        assert client.retries == 0  # seen closed before use: a new connection, no replay needed
    assert f.connections == 2


async def test_connections_are_bounded(home: Paths) -> None:
    async def slow(f: Fake, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await f.read_request(reader) is not None:
            await asyncio.sleep(0.1)
            writer.write(ok())
            await writer.drain()

    async with fake(home, slow, max_connections=2) as (f, client):
        results = await asyncio.gather(*(fetch(client) for _ in range(6)))
        assert results == [(200, b'{"ok":true}')] * 6
    assert f.connections == 2

    async def silent(f: Fake, n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await f.read_request(reader)
        await reader.read()

    async with fake(home, silent, timeout=0.3, max_connections=1) as (f, client):
        got = await asyncio.gather(*(fetch(client) for _ in range(2)), return_exceptions=True)
        assert [r.code if isinstance(r, UompError) else r for r in got] == ["UPSTREAM_TIMEOUT"] * 2
    assert f.connections == 1  # the second waited for a slot (within its deadline) and never connected


async def test_json_call_bounds(home: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(home.home / "fake.sock")
    for answer, code in (
        (ok(b"[1, 2]"), "UPSTREAM_ERROR"),
        (ok(b"{nope"), "UPSTREAM_ERROR"),
        (ok(b'{"a": "' + b"x" * 2000 + b'"}'), "UPSTREAM_ERROR"),
    ):
        monkeypatch.setattr("gateway.remote.guard_client.MAX_JSON_BYTES", 1000)
        f = Fake(serve_forever(answer))
        server = await asyncio.start_unix_server(f.handle, path=path)
        fw = Forwarder(Upstream("unix", path), timeout_seconds=1)
        try:
            with pytest.raises(UompError) as exc:
                await fw.json_call("POST", "/v1/tokens/validate", body={"token": "t"})
            assert exc.value.code == code
        finally:
            await fw.close()
            server.close()
            await server.wait_closed()


# ----------------------------------------------------------------------------- through the appliance


async def test_large_bodies_over_tls_both_ways_in_one_process(home: Paths) -> None:
    """The gateway shrinks asyncio's TLS read buffer process-wide; TLS clients in this same process
    (aiohttp's, here) still move large bodies both ways, and the forwarder streams a large answer."""
    from asyncio import sslproto

    big = "v" * (900 * 1024)
    seed(home, [*ITEMS, MemoryItem("preference.big", big, ("preference",), "low", "user", NOW, NOW)])
    async with appliance(home) as app:
        assert sslproto.SSLProtocol.max_size == transport.TLS_READ_BUFFER_BYTES
        a = app.agent("agent_a")
        g = await app.grant(a)
        async with agent_session(a, app.paths) as s:
            status, body, hdrs = await agent_call(
                s, app.base, "/v1/memory/preference.big", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and body["value"] == big
            assert hdrs["X-UOMP-Quota-Remaining"] == "99"
            # 900 KiB up: through the gateway's TLS and the client to the guard, which refuses it (its cap)
            status, body, _ = await agent_call(
                s,
                app.base,
                f"/v1/sessions/{g['session_id']}/deletion-proof",
                token=g["token"],
                agent_id=a.agent_id,
                method="POST",
                data=b"x" * (900 * 1024),
                headers={"Content-Type": "application/json"},
            )
            assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE", body
            # 60 KiB of valid JSON (under the guard's cap) arrives in several TLS reads: forwarded whole
            # (one read() of the request stream used to forward only what had arrived so far)
            padded = json.dumps({"pad": "p" * (60 * 1024)}).encode()
            status, body, _ = await agent_call(
                s,
                app.base,
                f"/v1/sessions/{g['session_id']}/deletion-proof",
                token=g["token"],
                agent_id=a.agent_id,
                method="POST",
                data=padded,
                headers={"Content-Type": "application/json"},
            )
            assert status == 400 and body["error"]["message"] != "request body is not valid JSON", body
            status, body, _ = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id=a.agent_id
            )
            assert status == 200 and body["value"] == "dark"


def test_tls_buffer_only_ever_shrinks(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncio import sslproto

    monkeypatch.setattr(sslproto.SSLProtocol, "max_size", 256 * 1024)
    assert transport.shrink_tls_read_buffer() is True
    assert sslproto.SSLProtocol.max_size == 32 * 1024
    assert transport.shrink_tls_read_buffer(64 * 1024) is False  # never raised
    assert transport.shrink_tls_read_buffer(1024) is False  # never below one TLS record
    monkeypatch.setattr(sslproto.SSLProtocol, "max_size", "odd")
    assert transport.shrink_tls_read_buffer() is False and sslproto.SSLProtocol.max_size == "odd"


# ----------------------------------------------------------------------------- the supervised guard

UOMP = [sys.executable, "-m", "gateway.cli.main"]


@pytest.fixture
def sv_home() -> Iterator[Path]:
    """A fresh UOMP_HOME under a short /tmp path (Unix socket paths are limited), removed afterwards."""
    import shutil

    top = short_dir("uomp-sv-")
    yield top / "home"
    shutil.rmtree(top, ignore_errors=True)


def _uomp(
    home: Path, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=60, check=check, env=env
    )


@pytest.mark.timeout(90)
async def test_killed_guard_child_gives_503_then_recovers(tmp_path: Path, sv_home: Path) -> None:
    home = sv_home
    _uomp(home, "init")
    _uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    proc = subprocess.Popen(
        [*UOMP, "--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err_lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(
        target=lambda: err_lines.extend(iter(proc.stderr.readline, "")),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    try:
        m = re.search(r"https://127\.0\.0\.1:(\d+)", read_until(proc, "gateway: "))
        assert m
        port = int(m.group(1))
        g = re.search(r"\(process (\d+)", read_until(proc, "guard: "))
        assert g
        guard_pid = int(g.group(1))
        assert guard_pid != proc.pid
        ctx, headers = remote_calendar(_uomp, home, tmp_path, port)
        url = f"https://localhost:{port}/v1/memory/preference.theme"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
            async with s.get(url, headers=headers) as resp:
                assert resp.status == 200
            os.kill(guard_pid, signal.SIGKILL)
            _wait_dead(guard_pid)
            async with s.get(url, headers=headers) as resp:  # the gateway is up; the guard is not
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "STORE_UNAVAILABLE"
            deadline = time.monotonic() + 30
            while True:  # restarted by the supervisor, with no help
                async with s.get(url, headers=headers) as resp:
                    if resp.status == 200:
                        assert (await resp.json())["value"] == "dark"
                        break
                    assert resp.status == 503
                assert time.monotonic() < deadline, "the guard did not come back"
                await asyncio.sleep(0.2)
        while not any("guard process restarted" in line for line in err_lines):  # logged once it is healthy
            assert time.monotonic() < deadline, "no restart logged"
            await asyncio.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        reader.join(10)
    assert proc.stdout is not None
    out, err = proc.stdout.read(), "".join(err_lines)
    assert proc.returncode == 0, err
    assert "exited unexpectedly (killed by SIGKILL)" in err
    r = re.search(r"guard process restarted \(pid (\d+)", err)
    assert r
    new_pid = int(r.group(1))
    assert new_pid != guard_pid
    assert not (home / "guard.sock").exists()
    with contextlib.suppress(ProcessLookupError):
        os.kill(new_pid, 0)
        raise AssertionError("the guard child outlived the appliance")
    assert headers["Authorization"][7:] not in out + err


def _wait_dead(pid: int, timeout: float = 5.0) -> None:
    """Until ``pid`` is gone or a zombie (its parent, the appliance, reaps it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} still alive")


def test_guard_dying_at_startup_is_a_clear_error(sv_home: Path) -> None:
    home = sv_home
    _uomp(home, "init")
    # a damaged auth.db (only the guard child opens it): the child exits during startup
    (home / "auth.db").write_bytes(b"not a database" * 400)
    res = _uomp(home, "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port", check=False)
    assert res.returncode == 1
    assert "error STORE_UNAVAILABLE: the guard process exited during startup (exit code 1)" in res.stderr
    assert "the session database is unavailable" in res.stderr  # the child's own words, in the error
    assert "gateway:" not in res.stdout  # the gateway never started
    assert not (home / "guard.sock").exists()


def test_local_profile_port_taken_is_refused_before_anything_starts(sv_home: Path) -> None:
    home = sv_home
    _uomp(home, "init")
    with socket.socket() as busy:  # the Local Profile port is taken
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = {**os.environ, "UOMP_GUARD_TCP_PORT": str(busy.getsockname()[1])}
        res = _uomp(home, "gateway", "start", "--listen", "127.0.0.1:0", check=False, env=env)
    assert res.returncode == 1
    assert res.stderr.startswith("error PORT_IN_USE: the guard's Local Profile listener cannot listen on")
    assert "Traceback" not in res.stderr and "gateway:" not in res.stdout
    assert not (home / "guard.sock").exists()


def test_live_guard_on_the_socket_is_refused_before_anything_starts(sv_home: Path) -> None:
    home = sv_home
    _uomp(home, "init")
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(str(home / "guard.sock"))
    squatter.listen()
    try:
        res = _uomp(home, "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port", check=False)
    finally:
        squatter.close()
    assert res.returncode == 1 and "already listening" in res.stderr
    assert "guard listening" not in res.stderr  # no child was started


@pytest.mark.parametrize(
    "spec",
    [
        "http://user:pw@127.0.0.1:1",
        "http://127.0.0.1:99999",
        "http://:80",
        "http://127.0.0.1:1/?q=1",
        "https://127.0.0.1:1",
        "tcp:127.0.0.1:1",
    ],
)
def test_bad_upstream_is_a_config_error(spec: str) -> None:
    with pytest.raises(UompError) as exc:
        UpstreamClient(Upstream.parse(spec), timeout_seconds=1)
    assert exc.value.code == "CONFIG_ERROR"


async def test_http_upstream_with_a_path_prefix(home: Paths) -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(ok())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = UpstreamClient(Upstream.parse(f"http://127.0.0.1:{port}/guard/"), timeout_seconds=2)
    try:
        assert await fetch(client, target="/v1/memory/a?x=1") == (200, b'{"ok":true}')
    finally:
        await client.close()
        server.close()
    assert seen[0].startswith(f"GET /guard/v1/memory/a?x=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode())
