"""``gateway/httpd.py``, the rules the gateway's listeners needed beyond the guard's first ones, on
a real Unix socket: ``HEAD`` gets the head alone, a streamed answer of unknown length is chunked
(an HTTP/1.0 client's ends with the connection), ``force_close`` ends the connection, a body that
had all arrived when it was answered leaves the connection at the next request, a handler's fault
is a 500 the client reads before the close, and framing the server does not implement is refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_httpd import closed, post_mib, read_answer, refusal, serve, status_only

from gateway import httpd


class Served:
    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.handled: list[str] = []

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(str(self.sock))


@pytest.fixture
async def s(tmp_path: Path) -> AsyncIterator[Served]:
    app = httpd.App(middleware=status_only, refusal=refusal)
    server = httpd.Server(app, keepalive_seconds=2.0)
    served = Served(tmp_path / "a.sock")

    async def item(request: httpd.Request) -> httpd.Response:
        served.handled.append(f"{request.method} {request.match_info['name']}")
        return httpd.json_response({"name": request.match_info["name"]})

    async def chunks(request: httpd.Request) -> httpd.StreamResponse:
        resp = httpd.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        for piece in (b"abc", b"", b"defgh"):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    async def last(request: httpd.Request) -> httpd.Response:
        resp = httpd.Response(b"last")
        resp.force_close()
        return resp

    async def faulty(request: httpd.Request) -> httpd.Response:
        served.handled.append("faulty")
        raise RuntimeError("a fault the handler did not foresee")

    async def unread(request: httpd.Request) -> httpd.Response:
        served.handled.append(f"unread {request.can_read_body}")
        return httpd.Response(b"not read")

    routes: tuple[tuple[str, str, httpd.Handler], ...] = (
        ("GET", "/item/{name}", item),
        ("HEAD", "/item/{name}", item),
        ("GET", "/chunks", chunks),
        ("GET", "/last", last),
        ("POST", "/faulty", faulty),
        ("POST", "/unread", unread),
    )
    await serve(server, served.sock, routes)
    try:
        yield served
    finally:
        await server.close(grace=2)


async def test_head_gets_the_head_alone_and_the_next_answer_is_read_right(s: Served) -> None:
    reader, writer = await s.open()
    writer.write(b"HEAD /item/a HTTP/1.1\r\nHost: g\r\n\r\nGET /item/b HTTP/1.1\r\nHost: g\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: 12\r\n" in head  # GET's length
    # the partner: the GET right after it is the next bytes, its body whole
    status, _headers, body = await read_answer(reader)
    assert status == 200 and json.loads(body) == {"name": "b"}
    assert s.handled == ["HEAD a", "GET b"]
    writer.close()


async def test_a_stream_of_unknown_length_is_chunked_and_the_connection_goes_on(s: Served) -> None:
    reader, writer = await s.open()
    writer.write(b"GET /chunks HTTP/1.1\r\nHost: g\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b"Transfer-Encoding: chunked\r\n" in head and b"Content-Length" not in head
    body = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
    assert body == b"3\r\nabc\r\n5\r\ndefgh\r\n0\r\n\r\n"  # an empty write is no chunk (it would end the body)
    writer.write(b"GET /item/next HTTP/1.1\r\nHost: g\r\n\r\n")
    assert (await read_answer(reader))[0] == 200
    writer.close()


async def test_an_http10_client_gets_an_unknown_length_ended_by_the_close(s: Served) -> None:
    reader, writer = await s.open()
    writer.write(b"GET /chunks HTTP/1.0\r\nHost: g\r\nConnection: keep-alive\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"Connection: close" in head and b"chunked" not in head and b"Content-Length" not in head
    assert body == b"abcdefgh"
    writer.close()


async def test_force_close_ends_the_connection_after_its_answer(s: Served) -> None:
    reader, writer = await s.open()
    writer.write(b"GET /last HTTP/1.1\r\nHost: g\r\n\r\n")
    _status, headers, body = await read_answer(reader)
    assert body == b"last" and headers["connection"] == "close"
    assert await closed(reader)
    writer.close()


async def test_a_body_all_arrived_but_unread_leaves_the_connection_at_the_next_request(s: Served) -> None:
    reader, writer = await s.open()
    writer.write(b"POST /unread HTTP/1.1\r\nHost: g\r\nContent-Length: 5\r\n\r\nhello")
    _status, headers, body = await read_answer(reader)
    assert body == b"not read" and "connection" not in headers
    writer.write(b"GET /item/after HTTP/1.1\r\nHost: g\r\n\r\n")
    assert json.loads((await read_answer(reader))[2]) == {"name": "after"}
    # the partner: a body still on its way when answered ends the connection (tests/guard/test_httpd.py)
    writer.close()


async def test_a_handlers_fault_is_a_500_the_client_reads_while_still_sending(s: Served) -> None:
    reader, writer = await s.open()
    sending = asyncio.ensure_future(post_mib(writer, b"/faulty", 8))
    status, headers, body = await read_answer(reader)
    assert status == 500 and json.loads(body) == {"refused": 500} and headers["connection"] == "close"
    await asyncio.wait_for(sending, 10)  # the rest of the body was read and dropped, not reset
    assert await closed(reader)
    assert s.handled == ["faulty"]
    writer.close()
    reader, writer = await s.open()  # partner: the server goes on
    writer.write(b"GET /item/ok HTTP/1.1\r\nHost: g\r\n\r\n")
    assert (await read_answer(reader))[0] == 200
    writer.close()


@pytest.mark.parametrize(
    ("framing", "status"),
    [
        (b"Transfer-Encoding: gzip, chunked\r\n", 400),
        (b"Transfer-Encoding: x-other, chunked\r\n", 400),
        (b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", 400),
        (b"Transfer-Encoding: chunked, gzip\r\n", 400),
    ],
)
async def test_a_transfer_coding_other_than_one_chunked_is_refused(s: Served, framing: bytes, status: int) -> None:
    reader, writer = await s.open()
    writer.write(b"POST /unread HTTP/1.1\r\nHost: g\r\n" + framing + b"\r\n5\r\nhello\r\n0\r\n\r\n")
    got, headers, body = await read_answer(reader)
    assert (got, json.loads(body)) == (status, {"refused": status}) and headers["connection"] == "close"
    assert await closed(reader)
    assert s.handled == []
    writer.close()
    # the partner: one "chunked", in any case, is the body's framing
    reader, writer = await s.open()
    writer.write(b"POST /unread HTTP/1.1\r\nHost: g\r\nTransfer-Encoding: Chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert (await read_answer(reader))[2] == b"not read"
    writer.close()


async def test_an_http_version_other_than_10_or_11_is_505(s: Served) -> None:
    for line in (b"GET /item/a HTTP/2.0", b"GET /item/a HTTP/1.2", b"GET /item/a HTTP/0.9"):
        reader, writer = await s.open()
        writer.write(line + b"\r\nHost: g\r\n\r\n")
        status, _headers, _body = await read_answer(reader)
        # llhttp refuses a version it cannot read (1.2, 0.9) itself: 400
        assert status == 505 if line.endswith(b"2.0") else status in (400, 505), (line, status)
        writer.close()
    assert s.handled == []
    reader, writer = await s.open()  # the partner: 1.0 is served
    writer.write(b"GET /item/a HTTP/1.0\r\nHost: g\r\n\r\n")
    assert (await read_answer(reader))[0] == 200
    writer.close()


async def test_an_http10_keep_alive_client_is_told_the_connection_stays(s: Served) -> None:
    """``ab -k`` and other HTTP/1.0 clients ask with ``Connection: keep-alive`` and keep the
    connection only when the answer says so; without it they wait for the close."""
    reader, writer = await s.open()
    for name in (b"a", b"b"):
        writer.write(b"GET /item/" + name + b" HTTP/1.0\r\nHost: g\r\nConnection: Keep-Alive\r\n\r\n")
        status, headers, body = await read_answer(reader)
        assert status == 200 and headers["connection"].lower() == "keep-alive", headers
        assert json.loads(body) == {"name": name.decode()}
    # the partner: without asking, an HTTP/1.0 client's connection ends after its answer
    writer.write(b"GET /item/c HTTP/1.0\r\nHost: g\r\n\r\n")
    _status, headers, _body = await read_answer(reader)
    assert headers["connection"] == "close"
    assert await closed(reader)
    writer.close()
