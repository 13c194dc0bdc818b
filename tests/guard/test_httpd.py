"""The guard's HTTP/1.1 server (gateway/httpd.py) on a real Unix socket and a real loopback
TCP port, driven by raw bytes: keep-alive and pipelining, the parser's refusals and this module's
limits (each with the partner just inside it), deadlines, flow control both ways, routing, stop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway import httpd


def refusal(status: int) -> httpd.Response:
    return httpd.Response(json.dumps({"refused": status}).encode(), status, content_type="application/json")


class Harness:
    """One app and its server on a Unix socket; what the handlers saw."""

    def __init__(self, server: httpd.Server, sock: Path) -> None:
        self.server = server
        self.sock = sock
        self.seen: list[str] = []
        self.finished: list[str] = []
        self.release = asyncio.Event()

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(str(self.sock))


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return status, headers, body


async def post_mib(writer: asyncio.StreamWriter, path: bytes, mib: int) -> None:
    """A POST of ``mib`` MiB of ``y``, sent in 64 KiB writes, each waiting for the socket."""
    writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: g\r\nContent-Length: %d\r\n\r\n" % (mib << 20))
    for _ in range(mib * 16):
        writer.write(b"y" * 65536)
        await writer.drain()


async def closed(reader: asyncio.StreamReader, within: float = 5.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except (ConnectionResetError, TimeoutError):
        return False


async def status_only(request: httpd.Request, handler: httpd.Handler) -> httpd.AnyResponse:
    """The test apps' middleware: the router's 404/405 as an empty answer of that status."""
    try:
        return await handler(request)
    except httpd.HTTPError as exc:
        return httpd.Response(b"", exc.status)


async def serve(server: httpd.Server, sock: Path, routes: tuple[tuple[str, str, httpd.Handler], ...]) -> None:
    """``routes`` (method, pattern, handler) in ``server``'s app, served on the Unix socket ``sock``."""
    for method, pattern, handler in routes:
        server.app.router.add_route(method, pattern, handler)
    await server.serve_unix(str(sock), backlog=16)


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    app = httpd.App(middleware=status_only, refusal=refusal, decorate=lambda r, hd: hd.__setitem__("Server", "t"))
    server = httpd.Server(app, keepalive_seconds=0.5)
    harness = Harness(server, tmp_path / "t.sock")

    async def echo(request: httpd.Request) -> httpd.Response:
        harness.seen.append(request.match_info.get("name", request.path))
        return httpd.Response(json.dumps({"name": request.match_info.get("name")}).encode())

    async def slow(request: httpd.Request) -> httpd.Response:
        ms = int(request.match_info["ms"])
        harness.seen.append(f"slow {ms}")
        await asyncio.sleep(ms / 1000)
        harness.finished.append(f"slow {ms}")
        return httpd.Response(str(ms).encode())

    async def held(request: httpd.Request) -> httpd.Response:
        harness.seen.append("held")
        await harness.release.wait()
        harness.finished.append("held")
        return httpd.Response(b"done")

    async def body(request: httpd.Request) -> httpd.Response:
        parts = []
        while chunk := await request.content.readany():
            parts.append(chunk)
        data = b"".join(parts)
        return httpd.Response(str(len(data)).encode() + b":" + data[:16])

    async def ignore_body(request: httpd.Request) -> httpd.Response:
        return httpd.Response(b"not read")

    async def stream(request: httpd.Request) -> httpd.StreamResponse:
        size = int(request.match_info["size"])
        resp = httpd.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = size
        await resp.prepare(request)
        sent = 0
        while sent < size:
            n = min(65536, size - sent)
            await resp.write(b"x" * n)
            sent += n
            harness.seen.append(f"wrote {sent}")
        await resp.write_eof()
        return resp

    async def split(request: httpd.Request) -> httpd.Response:
        return httpd.Response(b"x", headers={"X-Echo": request.headers.get("x-in", "") + "\r\nX-Injected: 1"})

    routes: tuple[tuple[str, str, httpd.Handler], ...] = (
        ("GET", "/v1/echo/{name}", echo),
        ("GET", "/v1/echo/fixed", echo),
        ("GET", "/v1/slow/{ms}", slow),
        ("GET", "/v1/held", held),
        ("POST", "/v1/body", body),
        ("POST", "/v1/ignore", ignore_body),
        ("GET", "/v1/stream/{size}", stream),
        ("GET", "/v1/split", split),
    )
    await serve(server, harness.sock, routes)
    try:
        yield harness
    finally:
        harness.release.set()
        await server.close(grace=2)


async def test_keep_alive_answers_in_order_and_close_ends_the_connection(h: Harness) -> None:
    reader, writer = await h.open()
    writer.write(b"GET /v1/echo/a HTTP/1.1\r\nHost: g\r\n\r\n")
    assert (await read_answer(reader))[0] == 200
    writer.write(b"GET /v1/echo/b HTTP/1.1\r\nHost: g\r\n\r\n")
    status, headers, body = await read_answer(reader)
    assert status == 200 and json.loads(body) == {"name": "b"} and headers["server"] == "t"
    assert "connection" not in headers
    # pipelined: three requests in one write, the first the slowest; answered in the order sent
    writer.write(
        b"GET /v1/slow/200 HTTP/1.1\r\nHost: g\r\n\r\n"
        b"GET /v1/slow/1 HTTP/1.1\r\nHost: g\r\n\r\n"
        b"GET /v1/echo/c HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n"
    )
    answers = [await read_answer(reader) for _ in range(3)]
    assert [a[2] for a in answers] == [b"200", b"1", b'{"name": "c"}']
    assert h.seen[-3:] == ["slow 200", "slow 1", "c"]  # one at a time: the second began after the first
    assert answers[2][1]["connection"] == "close"
    assert await closed(reader)
    writer.close()


async def test_http10_without_keep_alive_is_closed_after_its_answer(h: Harness) -> None:
    reader, writer = await h.open()
    writer.write(b"GET /v1/echo/a HTTP/1.0\r\n\r\n")
    status, headers, _ = await read_answer(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await closed(reader)
    writer.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /v1/echo/a HTTP/1.1\r\nHost: g\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"POST /v1/body HTTP/1.1\r\nHost: g\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET /v1/echo/a HTTP/1.1\r\nHost: g\r\nBad Header: x\r\n\r\n",
        b"GET /v1/echo/a HTTP/1.1\r\nHost: g\r\nX: a\x00b\r\n\r\n",
        b"GET /v1/echo/a HTTP/9.9\r\nHost: g\r\n\r\n",
        b"GET /v1/echo/a HTTP/1.1\nHost: g\n\n",
    ],
)
async def test_what_llhttp_refuses_is_the_apps_refusal_then_the_end(h: Harness, raw: bytes) -> None:
    reader, writer = await h.open()
    writer.write(raw)
    status, headers, body = await read_answer(reader)
    assert status == 400 and json.loads(body) == {"refused": 400}
    assert headers["connection"] == "close"
    assert await closed(reader)
    assert h.seen == []  # no handler ran
    writer.close()


async def test_bad_bytes_after_a_request_in_hand_are_refused_after_its_answer(h: Harness) -> None:
    reader, writer = await h.open()
    writer.write(b"GET /v1/slow/300 HTTP/1.1\r\nHost: g\r\n\r\nGARBAGE\r\n\r\n")
    first = await read_answer(reader)
    second = await read_answer(reader)
    assert (first[0], first[2]) == (200, b"300")  # the request before the bad bytes: answered first
    assert second[0] == 400 and second[1]["connection"] == "close"
    assert await closed(reader)
    writer.close()


async def test_a_malformed_body_of_the_request_in_hand_gets_one_answer(h: Harness) -> None:
    # the body breaks while its handler runs: the handler's answer is the only one, then the end
    for path, want in ((b"/v1/ignore", b"not read"), (b"/v1/body", None)):
        reader, writer = await h.open()
        writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        status, headers, body = await read_answer(reader)
        if want is not None:
            assert body == want
        else:  # the handler read the body and saw it break (the test app lets the error through: 500)
            assert status in (400, 500)
        assert headers["connection"] == "close"
        assert await reader.read() == b""  # nothing after that one answer
        writer.close()


async def test_limits_of_target_header_line_and_header_count_each_with_its_partner(h: Harness) -> None:
    async def status_of(raw: bytes) -> int:
        reader, writer = await h.open()
        writer.write(raw)
        try:
            return (await read_answer(reader))[0]
        finally:
            writer.close()

    def target(n: int) -> bytes:
        path = b"/v1/echo/"
        return path + b"a" * (n - len(path))

    assert await status_of(b"GET " + target(httpd.MAX_LINE) + b" HTTP/1.1\r\nHost: g\r\n\r\n") == 200
    assert await status_of(b"GET " + target(httpd.MAX_LINE + 1) + b" HTTP/1.1\r\nHost: g\r\n\r\n") == 414

    def field(n: int) -> bytes:
        return b"X-Long: " + b"v" * (n - len(b"X-Long") - 2) + b"\r\n"

    head = b"GET /v1/echo/a HTTP/1.1\r\nHost: g\r\n"
    assert await status_of(head + field(httpd.MAX_FIELD) + b"\r\n") == 200
    assert await status_of(head + field(httpd.MAX_FIELD + 1) + b"\r\n") == 431

    def many(n: int) -> bytes:
        return b"GET /v1/echo/a HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(n)) + b"\r\n"

    assert await status_of(many(httpd.MAX_HEADERS)) == 200
    assert await status_of(many(httpd.MAX_HEADERS + 1)) == 431


async def test_idle_and_stalled_connections_are_closed_and_busy_ones_are_not(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(httpd, "HEADER_SECONDS", 0.3)
    # idle after an answer: closed after keep-alive (0.5 s here)
    reader, writer = await h.open()
    writer.write(b"GET /v1/echo/a HTTP/1.1\r\nHost: g\r\n\r\n")
    await read_answer(reader)
    assert await closed(reader, 3)
    writer.close()
    # half a request, then silence: closed at the header deadline, no handler ran
    reader, writer = await h.open()
    writer.write(b"GET /v1/echo/stalled HTTP/1.1\r\nHo")
    assert await closed(reader, 3)
    assert "stalled" not in h.seen
    writer.close()
    # partner: a request in its handler for longer than both is answered, and the connection kept
    reader, writer = await h.open()
    writer.write(b"GET /v1/slow/900 HTTP/1.1\r\nHost: g\r\n\r\n")
    assert (await read_answer(reader))[2] == b"900"
    writer.write(b"GET /v1/echo/after HTTP/1.1\r\nHost: g\r\n\r\n")
    assert (await read_answer(reader))[0] == 200
    writer.close()


async def test_bodies_chunked_continue_and_unread(h: Harness) -> None:
    reader, writer = await h.open()
    writer.write(
        b"POST /v1/body HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    assert (await read_answer(reader))[2] == b"11:hello world"
    # Expect: 100-continue: the interim answer comes before the body is sent
    writer.write(b"POST /v1/body HTTP/1.1\r\nHost: g\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"abcd")
    _status, headers, body = await read_answer(reader)
    assert body == b"4:abcd" and "connection" not in headers
    # a body its handler did not read: answered, the rest of it read and dropped, then the end
    writer.write(b"POST /v1/ignore HTTP/1.1\r\nHost: g\r\nContent-Length: 100000\r\n\r\n" + b"z" * 1000)
    _status, headers, body = await read_answer(reader)
    assert body == b"not read" and headers["connection"] == "close"
    writer.write(b"z" * 99000 + b"GET /v1/echo/never HTTP/1.1\r\nHost: g\r\n\r\n")
    assert await closed(reader)
    assert "never" not in h.seen  # nothing after it is answered
    writer.close()


async def test_a_client_still_sending_a_refused_body_reads_the_answer(h: Harness) -> None:
    # 16 MiB sent while the handler answers at once without reading: the client finishes sending
    # (the rest is dropped, not reset) and reads the answer
    reader, writer = await h.open()
    await post_mib(writer, b"/v1/ignore", 16)
    _status, headers, body = await read_answer(reader)
    assert body == b"not read" and headers["connection"] == "close"
    assert await closed(reader)
    writer.close()


async def test_dropping_a_refused_body_is_bounded_in_time_and_bytes(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(httpd, "LINGER_SECONDS", 0.3)
    monkeypatch.setattr(httpd, "LINGER_BYTES", 1024 * 1024)
    # a client that stops sending: closed after the linger time
    reader, writer = await h.open()
    writer.write(b"POST /v1/ignore HTTP/1.1\r\nHost: g\r\nContent-Length: 100000\r\n\r\nzz")
    assert (await read_answer(reader))[2] == b"not read"
    assert await closed(reader, 3)
    writer.close()
    # a client that sends more than the byte bound: cut there, not at its end
    reader, writer = await h.open()
    writer.write(b"POST /v1/ignore HTTP/1.1\r\nHost: g\r\nContent-Length: %d\r\n\r\n" % (1 << 30))
    assert (await read_answer(reader))[2] == b"not read"
    sent = 0
    with pytest.raises(OSError):
        for _ in range(1 << 14):
            writer.write(b"z" * 65536)
            await asyncio.wait_for(writer.drain(), 5)
            sent += 65536
    assert sent < 64 * 1024 * 1024
    writer.close()


async def test_a_large_body_is_read_with_bounded_buffering(h: Harness) -> None:
    reader, writer = await h.open()
    await post_mib(writer, b"/v1/body", 8)
    assert (await read_answer(reader))[2] == b"%d:%s" % (8 << 20, b"y" * 16)
    writer.close()


async def test_a_streamed_answer_waits_for_a_slow_reader(h: Harness) -> None:
    reader, writer = await h.open()
    size = 32 * 1024 * 1024
    writer.write(b"GET /v1/stream/%d HTTP/1.1\r\nHost: g\r\n\r\n" % size)
    await asyncio.sleep(0.5)
    written = [int(s.split()[1]) for s in h.seen if s.startswith("wrote")]
    assert written and written[-1] < size  # the reader reads nothing: the writer waits
    head = await reader.readuntil(b"\r\n\r\n")
    assert b"Content-Length: %d" % size in head
    got = 0
    while got < size:
        chunk = await asyncio.wait_for(reader.read(1 << 20), 10)
        assert chunk and set(chunk) == {ord("x")}
        got += len(chunk)
    assert got == size
    # partner: the connection is kept for the next request
    writer.write(b"GET /v1/echo/next HTTP/1.1\r\nHost: g\r\n\r\n")
    assert (await read_answer(reader))[0] == 200
    writer.close()


async def test_routing_decodes_segments_and_tells_404_from_405(h: Harness) -> None:
    reader, writer = await h.open()

    async def get(path: bytes, method: bytes = b"GET") -> tuple[int, bytes]:
        writer.write(method + b" " + path + b" HTTP/1.1\r\nHost: g\r\n\r\n")
        status, _, body = await read_answer(reader)
        return status, body

    assert await get(b"/v1/echo/fixed") == (200, b'{"name": null}')  # the literal route first
    assert await get(b"/v1/echo/%66ixed") == (200, b'{"name": null}')
    assert await get(b"/v1/echo/a%20b") == (200, b'{"name": "a b"}')
    assert await get(b"/v1/echo/a%2Fb") == (200, b'{"name": "a/b"}')  # one segment still
    assert await get(b"/v1/echo/a?x=1") == (200, b'{"name": "a"}')
    assert (await get(b"/v1/echo/"))[0] == 404
    assert (await get(b"/v1/echo/a/b"))[0] == 404
    assert (await get(b"/v1/echo/../held"))[0] == 404  # no dot-segment resolution: no route
    assert (await get(b"/nowhere"))[0] == 404
    assert (await get(b"/v1/echo/a", b"POST"))[0] == 405
    assert (await get(b"/v1/echo/a", b"HEAD"))[0] == 405
    assert (await get(b"http://g/v1/echo/abs"))[1] == b'{"name": "abs"}'  # absolute form
    writer.close()


async def test_query_parameters() -> None:
    q = httpd.Query("a=1&b=&a=2&c=x+y%21")
    assert q.getall("a", []) == ["1", "2"] and q.get("b") == "" and q.get("c") == "x y!"
    assert q.getall("zz", []) == [] and q.get("zz") is None and "a" in q and "zz" not in q


async def test_stop_finishes_the_request_in_hand_and_closes_the_rest(h: Harness) -> None:
    busy_r, busy_w = await h.open()
    idle_r, idle_w = await h.open()
    idle_w.write(b"GET /v1/echo/a HTTP/1.1\r\nHost: g\r\n\r\n")
    await read_answer(idle_r)
    busy_w.write(b"GET /v1/held HTTP/1.1\r\nHost: g\r\n\r\n")
    while "held" not in h.seen:
        await asyncio.sleep(0.01)
    stopping = asyncio.create_task(h.server.close(grace=10))
    assert await closed(idle_r, 3)  # the idle one at once
    with pytest.raises(OSError):
        await h.open()  # nothing new is accepted
    assert not stopping.done()
    h.release.set()
    _status, headers, body = await read_answer(busy_r)
    assert body == b"done" and headers["connection"] == "close"
    await asyncio.wait_for(stopping, 5)
    busy_w.close()
    idle_w.close()


async def test_a_client_that_leaves_does_not_cancel_its_handler(h: Harness) -> None:
    _reader, writer = await h.open()
    writer.write(b"GET /v1/held HTTP/1.1\r\nHost: g\r\n\r\n")
    while "held" not in h.seen:
        await asyncio.sleep(0.01)
    writer.close()
    await asyncio.sleep(0.1)
    h.release.set()
    for _ in range(100):
        if "held" in h.finished:
            break
        await asyncio.sleep(0.01)
    assert h.finished == ["held"]


async def test_an_upgrade_request_is_answered_as_http11_and_then_closed(h: Harness) -> None:
    reader, writer = await h.open()
    writer.write(b"GET /v1/echo/up HTTP/1.1\r\nHost: g\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
    status, headers, _ = await read_answer(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await closed(reader)
    writer.close()


async def test_tcp_listener_on_loopback(tmp_path: Path) -> None:
    async def mw(request: httpd.Request, handler: httpd.Handler) -> httpd.AnyResponse:
        return await handler(request)

    async def hello(request: httpd.Request) -> httpd.Response:
        return httpd.Response(b"hi")

    app = httpd.App(middleware=mw, refusal=refusal)
    app.router.add_route("GET", "/", hello)
    server = httpd.Server(app)
    port = await server.serve_tcp("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: g\r\n\r\n")
        assert (await read_answer(reader))[2] == b"hi"
        writer.write(b"BAD\r\n\r\n")
        assert (await read_answer(reader))[0] == 400
        writer.close()
    finally:
        await server.close()


async def test_a_pipelined_request_whose_body_comes_later_is_not_stuck(h: Harness) -> None:
    # the second request's head arrives while the first is in its handler (reading pauses); its body
    # comes after the first was answered: reading resumes for it
    reader, writer = await h.open()
    writer.write(
        b"GET /v1/slow/300 HTTP/1.1\r\nHost: g\r\n\r\nPOST /v1/body HTTP/1.1\r\nHost: g\r\nContent-Length: 5\r\n\r\nab"
    )
    assert (await read_answer(reader))[2] == b"300"
    writer.write(b"cde")
    assert (await asyncio.wait_for(read_answer(reader), 5))[2] == b"5:abcde"
    writer.close()


async def test_a_full_budget_closes_the_longest_idle_connection_for_a_newcomer(h: Harness) -> None:
    h.server.max_connections = 3
    first = await h.open()
    await asyncio.sleep(0.02)
    others = [await h.open() for _ in range(2)]
    # partner: under the budget nobody was closed; each answers
    for reader, writer in (first, *others):
        writer.write(b"GET /v1/echo/a HTTP/1.1\r\nHost: g\r\n\r\n")
        assert (await read_answer(reader))[0] == 200
    await asyncio.sleep(0.02)
    for reader, writer in others:  # the first is now the one idle the longest
        writer.write(b"GET /v1/echo/b HTTP/1.1\r\nHost: g\r\n\r\n")
        await read_answer(reader)
    newcomer = await h.open()
    newcomer[1].write(b"GET /v1/echo/new HTTP/1.1\r\nHost: g\r\n\r\n")
    assert (await read_answer(newcomer[0]))[0] == 200
    assert await closed(first[0], 3)  # the longest idle made room
    for reader, writer in others:  # the others kept theirs
        writer.write(b"GET /v1/echo/c HTTP/1.1\r\nHost: g\r\n\r\n")
        assert (await read_answer(reader))[0] == 200
    assert h.server.evicted == 1 and h.server.refused == 0
    for _r, w in (first, *others, newcomer):
        w.close()


async def test_a_budget_of_busy_connections_refuses_the_newcomer(h: Harness) -> None:
    h.server.max_connections = 2
    busy = [await h.open() for _ in range(2)]
    for _r, w in busy:
        w.write(b"GET /v1/held HTTP/1.1\r\nHost: g\r\n\r\n")
    while h.seen.count("held") < 2:
        await asyncio.sleep(0.01)
    reader, writer = await h.open()
    writer.write(b"GET /v1/echo/late HTTP/1.1\r\nHost: g\r\n\r\n")
    try:  # closed at once (aborted: an EOF or a reset), never answered
        assert await asyncio.wait_for(reader.read(), 3) == b""
    except (ConnectionResetError, BrokenPipeError):
        pass
    assert "late" not in h.seen and h.server.refused == 1
    writer.close()
    h.release.set()
    for r, _w in busy:  # the requests in hand were not touched
        assert (await read_answer(r))[2] == b"done"
    reader, writer = await h.open()  # room again
    writer.write(b"GET /v1/echo/later HTTP/1.1\r\nHost: g\r\n\r\n")
    assert (await read_answer(reader))[0] == 200
    writer.close()
    for _r, w in busy:
        w.close()


def test_the_guards_budgets_fit_its_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from gateway.config import GuardConfig
    from gateway.guard import server

    cfg = GuardConfig()
    ceilings = (cfg.unix_max_connections, cfg.tcp_max_connections)
    assert ceilings == (4096, 256)
    for soft, want in ((1024, (720, 240)), (20000, (4096, 256)), (256, (144, 48))):
        monkeypatch.setattr(resource, "getrlimit", lambda _r, s=soft: (s, 1 << 20))
        unix, tcp = server.connection_budgets(*ceilings)
        assert (unix, tcp) == want
        assert unix + tcp + server.FD_RESERVE <= max(soft, 128 + server.FD_RESERVE)
        # settings below the descriptor limit's share are kept as they are; above it, lowered
        assert server.connection_budgets(100, 10) == (min(100, want[0]), min(10, want[1]))
        assert server.connection_budgets(1 << 16, 1 << 16) == (
            max(64, soft - server.FD_RESERVE) * 3 // 4,
            max(64, soft - server.FD_RESERVE) // 4,
        )


async def test_an_answer_header_with_a_line_break_is_never_written(h: Harness) -> None:
    reader, writer = await h.open()
    writer.write(b"GET /v1/split HTTP/1.1\r\nHost: g\r\n\r\n")
    status, headers, body = await read_answer(reader)
    assert status == 500 and json.loads(body) == {"refused": 500}
    assert "x-injected" not in headers and "x-echo" not in headers
    assert await closed(reader)
    writer.close()
    # partner: the same route's neighbours answer normally on a new connection
    reader, writer = await h.open()
    writer.write(b"GET /v1/echo/fine HTTP/1.1\r\nHost: g\r\n\r\n")
    assert (await read_answer(reader))[0] == 200
    writer.close()


async def test_a_refusal_keeps_its_status_when_the_parse_runs_inside_a_handled_exception(h: Harness) -> None:
    """A limit found in a parser callback answers its own status (414, 431, 505) even when the bytes
    are parsed while another exception is being handled: Python then sets the parser error's context
    to that exception, so the status cannot be read back from the context. Its partners: a request
    inside the limits, parsed the same way, is answered 200."""
    too_long = b"/v1/echo/" + b"a" * httpd.MAX_LINE
    heads = {
        414: b"GET " + too_long + b" HTTP/1.1\r\nHost: g\r\n\r\n",
        431: b"GET /v1/echo/x HTTP/1.1\r\nHost: g\r\n" + b"X-A: b\r\n" * (httpd.MAX_HEADERS + 1) + b"\r\n",
        505: b"GET /v1/echo/x HTTP/2.0\r\nHost: g\r\n\r\n",
        200: b"GET /v1/echo/fine HTTP/1.1\r\nHost: g\r\n\r\n",
    }
    for status, raw in heads.items():
        known = set(h.server.connections)
        reader, writer = await h.open()
        for _ in range(200):
            fresh = h.server.connections - known
            if fresh:
                break
            await asyncio.sleep(0.01)
        (conn,) = fresh
        try:
            raise LookupError("handled by someone else while the bytes are parsed")
        except LookupError:
            conn.data_received(raw)
        assert (await read_answer(reader))[0] == status, raw[:40]
        writer.close()
