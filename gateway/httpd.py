"""The HTTP/1.1 server of the guard and of the gateway's listeners: llhttp (through
:mod:`httptools`) parses every request, this module routes it to a handler and writes the answer.

The guard serves one small route table to its own clients (the gateway and the CLI on the Unix
socket, local agents on 127.0.0.1); the gateway serves remote agents over TLS
(:mod:`gateway.remote.transport` puts its connection budgets and deadlines around
:class:`Connection`). They need this much of an HTTP server, and no more:

* **Strict parsing.** llhttp without any leniency: a bad request line, bad header bytes, a conflicting
  ``Content-Length`` / ``Transfer-Encoding`` are refused before any handler (400, the connection then
  closed), as is a transfer coding other than one ``chunked`` (RFC 9112 §6.1: another parser on
  the way could frame the body differently) and an HTTP version other than 1.0 or 1.1 (505). The
  answer is built by ``App.refusal`` (the §8.4 JSON); no request byte is echoed or logged.
* **Bounded.** The request target at most ``max_line`` bytes (414 past it), each header line at most
  ``max_field``, at most ``max_headers`` headers (431 past them); :data:`MAX_LINE`,
  :data:`MAX_FIELD` and :data:`MAX_HEADERS` unless the :class:`Server` is given others. A body is
  read by its handler within the handler's own limit, and at most :data:`BODY_BUFFER` bytes of it
  wait unread (reading from the client pauses beyond that; :meth:`Body.set_buffer` for a reader of
  larger blocks). A request's headers must arrive within :data:`HEADER_SECONDS` of its first byte,
  and a connection idle between requests is closed after ``keepalive_seconds``.
* **In order.** One request at a time per connection; pipelined requests wait their turn (reading
  pauses while one waits). Keep-alive unless the client asks to close (or speaks HTTP/1.0 without
  keep-alive) or an answer must end the connection: one to a request that could not be parsed, one
  answered (``force_close``) to end it, one whose body had not all arrived when it was answered.
  The rest of such a body is read and dropped for up to :data:`LINGER_SECONDS` (and
  :data:`LINGER_BYTES`) before the connection is closed, so a client still sending it gets to read
  the answer (a close with unread bytes would reset it).
* **Answers.** A :class:`Response` carries its bytes (``Content-Length``); a
  :class:`StreamResponse` writes in pieces, each write waiting while the client's side of the
  socket is full, of a declared length or else chunked. The answer to ``HEAD`` is the head alone.
* **A budget of connections** per listener (``max_connections``; None where the caller keeps its
  own). When it is full, a newcomer takes the place of the connection idle the longest (between
  requests, or still sending a head); only when every connection is in the middle of a request is
  the newcomer closed at once. So idle and silent sockets cannot keep a client out, and the
  descriptors stay bounded.
* **Stop.** :meth:`Server.close` stops accepting, closes idle connections and gives requests in
  progress ``grace`` seconds to finish before their connections are cut.

Longer than ~500 lines on purpose: the parser's callbacks, the per-connection queue, flow control
and deadlines share each connection's state, and the request and answer types are what every
route imports, so they stay in one module.

Handlers are never cancelled when their client goes away: a request that reached its handler runs
to its end (its audit event is written), and the answer is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from http import HTTPStatus
from typing import Any, Generic, TypeVar, cast, overload
from urllib.parse import parse_qsl, unquote

import httptools
from mypy_extensions import mypyc_attr

from gateway import jsonio

log = logging.getLogger("uomp.httpd")

T = TypeVar("T")

MAX_LINE = 8190  # bytes of the request target
MAX_FIELD = 8190  # bytes of one header line (name and value)
MAX_HEADERS = 128  # header lines of one request
BODY_BUFFER = 256 * 1024  # request body bytes held ahead of the handler; reading pauses past it
READ_BUFFER = 256 * 1024  # what one read from a connection takes at most (Server.read_buffer)
HEADER_SECONDS = 30.0  # a request's headers arrive whole within this of its first byte
KEEPALIVE_SECONDS = 75.0  # an idle keep-alive connection is closed after this
LINGER_SECONDS = 10.0  # the unread rest of a refused body is read and dropped for at most this long
LINGER_BYTES = 64 * 1024 * 1024  # ... and at most this many bytes
STOP_GRACE_SECONDS = 30.0  # at stop, requests in progress get this long to finish
MAX_CONNECTIONS = 1024  # a listener's connections (Server's default budget)
BUDGET_LOG_SECONDS = 60.0  # a full budget is logged at most this often


class _Key(Generic[T]):
    """A typed key: its value's type is ``T`` (given as the second argument, for the reader)."""

    __slots__ = ("name",)

    def __init__(self, name: str, _type: type[T] | None = None) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class AppKey(_Key[T]):
    """A typed key of an :class:`App`'s state (``app[KEY]``)."""

    __slots__ = ()


class RequestKey(_Key[T]):
    """A typed key of one request's state (``request[KEY]``, ``request.get(KEY)``)."""

    __slots__ = ()


class HTTPError(Exception):
    """Raised by the router: no route for the path (404), or not for this method (405)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Headers:
    """A request's headers: case-insensitive, the first value of each name (a repeated single-valued
    header is refused before any handler by :func:`gateway.contract.header_problem`). Values are
    decoded as UTF-8 (bytes that are not kept as surrogates); names iterate in lower case."""

    __slots__ = ("_d", "_raw")

    def __init__(self, raw: tuple[tuple[bytes, bytes], ...]) -> None:
        d: dict[str, str] = {}
        for name, value in raw:
            d.setdefault(name.decode("latin-1").lower(), value.decode("utf-8", "surrogateescape"))
        self._d = d
        self._raw = raw

    def getall(self, name: str, default: list[str]) -> list[str]:
        """Every value of ``name``, in the order received (``default`` when there is none)."""
        low = name.lower().encode("latin-1")
        values = [v.decode("utf-8", "surrogateescape") for k, v in self._raw if k.lower() == low]
        return values or default

    def items(self) -> Iterator[tuple[str, str]]:
        """``(name, value)`` of each name's first value (names in lower case)."""
        return iter(self._d.items())

    def __getitem__(self, name: str) -> str:
        return self._d[name.lower()]

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._d.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


class Query:
    """The query string's parameters (``+`` and percent escapes decoded, blank values kept)."""

    __slots__ = ("_pairs",)

    def __init__(self, query_string: str) -> None:
        self._pairs = parse_qsl(query_string, keep_blank_values=True) if query_string else []

    def getall(self, name: str, default: list[str]) -> list[str]:
        values = [v for k, v in self._pairs if k == name]
        return values or default

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        for k, v in self._pairs:
            if k == name:
                return v
        return default

    def __contains__(self, name: object) -> bool:
        return any(k == name for k, _ in self._pairs)


@mypyc_attr(native_class=False)  # compiled (gateway/native.py): a native class cannot subclass an OSError
class BodyError(ConnectionResetError):
    """The request's body cannot be read to its end: the connection broke, or its framing (a chunk)
    was malformed. The request is the client's fault, never the server's (a 4xx)."""


class Body:
    """A request's body as it arrives: :meth:`readany` gives the next piece, ``b""`` at its end, and
    raises :class:`BodyError` when the connection broke before the end or the body was malformed."""

    __slots__ = ("_chunks", "_conn", "_continue", "_dropped", "_eof", "_error", "_limit", "_size", "_waiter")

    def __init__(self, conn: Connection, expect_continue: bool) -> None:
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._continue = expect_continue  # "Expect: 100-continue": answered at the first read
        self._dropped: int | None = None  # bytes dropped once nobody will read the rest (discard)
        self._limit = BODY_BUFFER

    def set_buffer(self, limit: int) -> None:
        """Hold up to ``limit`` unread bytes before reading pauses (for a reader of large blocks)."""
        self._limit = max(limit, 1)

    @property
    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    @property
    def complete(self) -> bool:
        """All of the body has arrived (read or not): the connection is at the next request."""
        return self._eof

    @property
    def ended(self) -> bool:
        """Nothing more of the body will arrive: all of it came (read or not), or it broke off."""
        return self._eof or self._error is not None

    def discard(self) -> None:
        """Nobody reads the rest: what is buffered and what still comes is dropped, and counted."""
        self._dropped = 0
        self._chunks.clear()
        self._size = 0

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def feed(self, data: bytes) -> None:
        if self._dropped is not None:
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self._conn.close()
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._size > self._limit:
            self._conn.pause_for_body()
        self._wake()

    def end(self) -> None:
        self._eof = True
        self._wake()

    def fail(self, why: str = "the connection closed before the request body's end") -> None:
        if not self._eof:
            self._error = BodyError(why)
        self._wake()

    async def readany(self) -> bytes:
        if self._continue:
            self._continue = False
            if not self._eof and not self._chunks:
                self._conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while not self._chunks:
            if self._eof:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft()
        self._size -= len(chunk)
        if self._size <= self._limit // 2:
            self._conn.resume_for_body()
        return chunk


class Request:
    """One parsed request, as a handler sees it."""

    __slots__ = (
        "_query",
        "_state",
        "app",
        "conn",
        "content",
        "content_length",
        "headers",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "query_string",
        "raw_headers",
        "raw_path",
        "route",
        "version",
    )

    def __init__(
        self,
        app: App,
        conn: Connection,
        method: str,
        target: bytes,
        raw_headers: tuple[tuple[bytes, bytes], ...],
        keep_alive: bool,
        version: str = "1.1",
    ) -> None:
        self.app = app
        self.conn = conn
        self.method = method
        self.version = version
        self.raw_path = target.decode("latin-1")  # the request-target exactly as it was sent
        raw_path, _, query = target.partition(b"?")
        raw_path = raw_path.partition(b"#")[0]
        self.path = raw_path.decode("latin-1")  # percent-escaped; handlers read match_info (decoded)
        self.query_string = query.partition(b"#")[0].decode("latin-1")
        self.raw_headers = raw_headers
        self.headers = Headers(raw_headers)
        self.match_info: dict[str, str] = {}
        self.route: str | None = None  # the pattern of the route it matched
        self.keep_alive = keep_alive
        length = self.headers.get("content-length")
        self.content_length: int | None = int(length) if length is not None and length.isdigit() else None
        expect = self.headers.get("expect", "").lower() == "100-continue"
        self.content = Body(conn, expect)
        self._state: dict[RequestKey[Any], Any] = {}
        self._query: Query | None = None

    @property
    def query(self) -> Query:
        if self._query is None:
            self._query = Query(self.query_string)
        return self._query

    @property
    def cookies(self) -> dict[str, str]:
        """The ``Cookie`` header's pairs (RFC 6265 §5.4; the first of a repeated name)."""
        out: dict[str, str] = {}
        for value in self.headers.getall("cookie", []):
            for pair in value.split(";"):
                name, eq, val = pair.strip().partition("=")
                if eq and name:
                    out.setdefault(name, val.strip().strip('"'))
        return out

    @property
    def can_read_body(self) -> bool:
        """Body bytes are still to be read (none: no body, an empty one, or all of it read)."""
        return not self.content.at_eof

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport (None once it is lost)."""
        return self.conn.transport

    @property
    def remote(self) -> str | None:
        """The client's address (its IP on TCP; None on a Unix socket or once the connection is lost)."""
        return self.conn.remote

    @property
    def host(self) -> str:
        """The ``Host`` header ('' without one)."""
        return self.headers.get("host", "")

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type``, lower case, without parameters (default
        ``application/octet-stream``, RFC 9110 §8.3)."""
        value = self.headers.get("content-type")
        if value is None:
            return "application/octet-stream"
        return value.partition(";")[0].strip().lower()

    def get(self, key: RequestKey[T], default: T | None = None) -> T | None:
        return self._state.get(key, default)

    def __getitem__(self, key: RequestKey[T]) -> T:
        return self._state[key]  # type: ignore[no-any-return]

    def __setitem__(self, key: RequestKey[T], value: T) -> None:
        self._state[key] = value


_REASONS = {s.value: s.phrase for s in HTTPStatus}


_BREAKS = re.compile(r"[\r\n\x00]")


def _head(status: int, headers: Mapping[str, str], length: int | None, close: bool, version: str = "1.1") -> bytes:
    """The status line and headers of an answer; ValueError for a header that would break its line
    (a CR, LF or NUL in a name or value could start a header or an answer of its own). ``length``
    None: the body is chunked (``close`` False) or ends with the connection (``close`` True). To an
    HTTP/1.0 client (``version``) a connection that stays open says so: such a client takes an
    answer without ``Connection: keep-alive`` to end its connection (RFC 9112 §9.3)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
    for k, v in headers.items():
        if _BREAKS.search(k) or _BREAKS.search(v):
            raise ValueError("a header name or value holds a line break")
        lines.append(f"{k}: {v}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    elif not close:
        lines.append("Transfer-Encoding: chunked")
    if close:
        lines.append("Connection: close")
    elif version == "1.0":
        lines.append("Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Response:
    """An answer whose body is in memory (``force_close``: the connection ends after it)."""

    __slots__ = ("body", "closes", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers: dict[str, str] = dict(headers) if headers else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        self.closes = False

    def force_close(self) -> None:
        """The connection ends after this answer."""
        self.closes = True


class StreamResponse:
    """An answer written in pieces: :meth:`prepare` sends the head, each :meth:`write` waits while
    the client's side of the socket is full, :meth:`write_eof` ends it. Of a declared
    ``content_length``, or else chunked (to an HTTP/1.0 client: ended by the connection's close).
    The answer to ``HEAD`` is its head alone. ``force_close``: the connection ends after it."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_eof",
        "_head_only",
        "_sent",
        "closes",
        "content_length",
        "headers",
        "prepared",
        "status",
    )

    def __init__(self, *, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers) if headers else {}
        self.content_length: int | None = None
        self._conn: Connection | None = None
        self._sent = 0
        self._chunked = False
        self._eof = False
        self._head_only = False
        self.prepared = False
        self.closes = False

    def force_close(self) -> None:
        """The connection ends after this answer."""
        self.closes = True

    async def prepare(self, request: Request) -> None:
        request.app.decorate(request, self.headers)
        if self.content_length is None and request.version != "1.1":
            self.closes = True  # an HTTP/1.0 client: the body ends with the connection
        close = self.closes or not request.keep_alive
        self._chunked = self.content_length is None and not close
        head = _head(self.status, self.headers, self.content_length, close, request.version)
        self._head_only = request.method == "HEAD"
        self._conn = request.conn
        self._conn.stream = self
        self.prepared = True
        self._conn.write(head)

    async def write(self, data: bytes) -> None:
        assert self._conn is not None
        if self._eof:
            raise ValueError("the answer has ended")
        if self.content_length is not None and self._sent + len(data) > self.content_length:
            raise ValueError("more bytes than the declared length")
        self._sent += len(data)
        if self._head_only or not data:
            return
        if self._chunked:
            self._conn.write(b"%x\r\n" % len(data) + data + b"\r\n")
        else:
            self._conn.write(data)
        await self._conn.drain()

    async def write_eof(self) -> None:
        assert self._conn is not None
        if self._chunked and not self._eof and not self._head_only:
            self._conn.write(b"0\r\n\r\n")
        self._eof = True
        await self._conn.drain()

    @property
    def complete(self) -> bool:
        if self.content_length is None:
            return self._eof and not self.closes
        return self._sent == self.content_length


def json_response(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """``body`` as a JSON answer (orjson where it gives json's bytes)."""
    return Response(jsonio.dumps(body), status, headers, "application/json; charset=utf-8")


AnyResponse = Response | StreamResponse
Handler = Callable[[Request], Awaitable[AnyResponse]]
Middleware = Callable[[Request, Handler], Awaitable[AnyResponse]]

_SEGMENT = re.compile(r"\{(\w+)(?::([\w.-]+(?:\|[\w.-]+)*))?\}")


_Part = tuple[bool, str, frozenset[str] | None]  # (is a {name}, the name or the literal, the values allowed)


class Router:
    """Routes by method and path: ``/v1/memory/{key}`` matches one path segment per ``{name}``
    (percent escapes decoded in the value; ``%2F`` stays inside one segment, an empty segment
    matches nothing), ``{how:approve|reject}`` one of those words only. A path that matches no
    pattern is 404; one that matches only other methods' patterns is 405."""

    def __init__(self) -> None:
        self._table: set[tuple[str, str]] = set()
        self._static: dict[str, dict[str, Handler]] = {}  # decoded path -> method -> handler
        # by segment count: (pattern, its parts, method -> handler)
        self._dynamic: dict[int, list[tuple[str, tuple[_Part, ...], dict[str, Handler]]]] = {}

    def add_route(self, method: str, pattern: str, handler: Handler) -> None:
        self._table.add((method, pattern))
        parts: tuple[_Part, ...] = tuple(
            (True, m.group(1), frozenset(m.group(2).split("|")) if m.group(2) else None)
            if (m := _SEGMENT.fullmatch(seg))
            else (False, seg, None)
            for seg in pattern.split("/")
        )
        if not any(is_var for is_var, _, _ in parts):
            self._static.setdefault(pattern, {})[method] = handler
            return
        rows = self._dynamic.setdefault(len(parts), [])
        for _pattern, row_parts, methods in rows:
            if row_parts == parts:
                methods[method] = handler
                return
        rows.append((_SEGMENT.sub(r"{\1}", pattern), parts, {method: handler}))  # shown as {name}

    def table(self) -> set[tuple[str, str]]:
        """``(method, pattern)`` of every route."""
        return set(self._table)

    def match(self, method: str, path: str) -> tuple[Handler, dict[str, str], str]:
        """The handler, the path's ``{name}`` values and the pattern that matched (``{name}`` for
        each, alternatives left out): a literal path's routes first, then the patterns in the order
        they were added; the first that has ``method`` wins."""
        if "%" in path:
            segments = [unquote(seg, errors="surrogateescape") for seg in path.split("/")]
            literal = None if any("/" in seg for seg in segments) else "/".join(segments)
        else:
            segments = path.split("/")
            literal = path
        matched = False
        methods = self._static.get(literal) if literal is not None else None
        if methods is not None:
            handler = methods.get(method)
            if handler is not None:
                assert literal is not None
                return handler, {}, literal
            matched = True
        for pattern, parts, row_methods in self._dynamic.get(len(segments), ()):
            match: dict[str, str] = {}
            for (is_var, name, allowed), seg in zip(parts, segments, strict=True):
                if is_var:
                    if not seg or (allowed is not None and seg not in allowed):
                        break
                    match[name] = seg
                elif seg != name:
                    break
            else:
                handler = row_methods.get(method)
                if handler is not None:
                    return handler, match, pattern
                matched = True
        raise HTTPError(405 if matched else 404)


class App:
    """A route table, its middleware, its state (``app[KEY]``), the answer to a request that could
    not be parsed (``refusal``, given the transport status) and the headers every answer gets
    (``decorate``). ``routed`` False: no route table, the middleware routes every request itself
    (the handler it is given raises 404)."""

    def __init__(
        self,
        *,
        middleware: Middleware,
        refusal: Callable[[int], Response],
        decorate: Callable[[Request, dict[str, str]], None] | None = None,
        routed: bool = True,
    ) -> None:
        self.router = Router()
        self._routed = routed
        self._middleware = middleware
        self.refusal = refusal
        self._decorate = decorate
        self._state: dict[AppKey[Any], Any] = {}
        self.on_cleanup: list[Callable[[App], Awaitable[None]]] = []

    def __getitem__(self, key: AppKey[T]) -> T:
        return self._state[key]  # type: ignore[no-any-return]

    def __setitem__(self, key: AppKey[T], value: T) -> None:
        self._state[key] = value

    def decorate(self, request: Request, headers: dict[str, str]) -> None:
        if self._decorate is not None:
            self._decorate(request, headers)

    async def handle(self, request: Request) -> AnyResponse:
        """The request routed (``match_info``, ``route``), then through the middleware to its handler
        (one that raises the router's :class:`HTTPError` when no route matched)."""
        if not self._routed:
            return await self._middleware(request, _not_found)
        try:
            handler, request.match_info, request.route = self.router.match(request.method, request.path)
        except HTTPError as exc:
            refused = exc

            async def handler(_request: Request) -> AnyResponse:
                raise refused

        return await self._middleware(request, handler)

    async def cleanup(self) -> None:
        for cb in self.on_cleanup:
            try:
                await cb(self)
            except Exception as exc:  # one failing cleanup does not keep the others from running
                log.warning("cleanup failed: %s", type(exc).__name__)


async def _not_found(request: Request) -> AnyResponse:
    raise HTTPError(404)


class _Refused(Exception):
    """A limit of this module, found by a parser callback: stops the parse (the status to answer is
    kept on the connection, :meth:`Connection._limit`)."""


class Connection(asyncio.BufferedProtocol):
    """One client connection: the parser's callbacks queue requests, :meth:`_serve` answers them in order.

    Reads land in the server's one read buffer (:meth:`Server.read_buffer`), which every read's
    parse empties before the next read: the parser copies what it keeps (target, headers, body
    pieces). A copying protocol would have the loop's TLS layer allocate a fresh read-sized bytes
    object per read (256 KiB under uvloop: above glibc's mmap threshold, so an mmap, mremap and
    munmap with their page faults for every request; ``benchmarks/bench_tls_transport.py``)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.app = server.app
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None  # the peer's IP on TCP
        self.tls = False  # on a TLS transport: no half-close (asyncio's TLS has none)
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()
        self.parsing: Request | None = None
        self.worker: asyncio.Task[None] | None = None
        self.closing = False
        self.busy = False  # a request is with its handler or being answered
        self._target = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._in_message = False
        # why reading is paused: bit 1 a request waits in the queue, bit 2 a body's buffer is full,
        # bit 4 for good (bad bytes were read, or an Upgrade): nothing more is read
        self._paused_by = 0
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.peer_eof = False  # the client closed its side: no request follows those queued
        self.stream: StreamResponse | None = None  # the streamed answer of the request in hand
        self.lingering = False  # answered; the unread rest of its body is being dropped, then the end
        self._refusal: int | None = None  # bytes that could not be parsed, answered after those queued
        self._limit_status: int | None = None  # set by a parser callback that refuses (_limit)
        self.last_active = self.loop.time()  # the last byte read or answer written (Server.admit)

    # -- the transport's side --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else None
        self.tls = transport.get_extra_info("ssl_object") is not None
        if not self.server.admit():
            self.closing = True
            self.transport.abort()
            return
        self.server.connections.add(self)
        self._arm(self.server.keepalive_seconds)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        self._cancel_timer()
        if self.parsing is not None:
            self.parsing.content.fail()
        for request in self.queue:
            request.content.fail()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client went away"))
        self.transport = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.server.read_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self.server.read_buffer()[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        """Bytes read from the client (a view of the server's read buffer: parsed before returning)."""
        if self.closing:
            return
        self.last_active = self.loop.time()
        if not self._in_message and not self.busy and not self.queue and not self.lingering:
            self._arm(HEADER_SECONDS)  # a new request's first bytes: its headers have a deadline now
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # no protocol is switched to: the request is answered as HTTP/1.1, then the connection ends
            if self.queue:
                self.queue[-1].keep_alive = False
                self._pause(4)  # never resumed
            else:
                self.close()
        except httptools.HttpParserCallbackError:
            # the status is the connection's: the parser error's context is whatever exception was
            # being handled when it was raised, not necessarily the callback's
            status, self._limit_status = self._limit_status or 400, None
            self._refuse(status)
        except httptools.HttpParserError:
            self._refuse(400)

    def eof_received(self) -> bool | None:
        self.peer_eof = True
        if self.parsing is not None:
            self.parsing.content.fail()
        if not self.busy and not self.queue:
            self.close()
        # half-closed: the answers to what was sent are still written (TLS in asyncio cannot)
        return None if self.tls else True

    # -- the parser's callbacks ------------------------------------------------------------

    def _limit(self, status: int) -> _Refused:
        """A limit found by a callback: ``status`` is answered once the parser stops."""
        self._limit_status = status
        return _Refused(status)

    def on_message_begin(self) -> None:
        self._in_message = True
        self._target.clear()
        self._headers = []

    def on_url(self, url: bytes) -> None:
        self._target += url
        if len(self._target) > self.server.max_line:
            raise self._limit(414)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) + 2 > self.server.max_field:
            raise self._limit(431)
        self._headers.append((name, value))
        if len(self._headers) > self.server.max_headers:
            raise self._limit(431)

    def on_headers_complete(self) -> None:
        if self.lingering:
            return  # nothing more is answered on this connection
        parser = self.parser
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise self._limit(505)
        codings = [v for k, v in self._headers if k.lower() == b"transfer-encoding"]
        if codings and (len(codings) > 1 or codings[0].strip().lower() != b"chunked"):
            # one coding is understood, chunked, alone (RFC 9112 §6.1): anything else could frame
            # the body differently for another parser on the way (request smuggling)
            raise self._limit(400)
        keep_alive = parser.should_keep_alive() and not self.closing
        request = Request(
            self.app,
            self,
            parser.get_method().decode("ascii"),
            bytes(self._target),
            tuple(self._headers),
            keep_alive,
            version,
        )
        url = httptools.parse_url(request.path.encode("latin-1")) if request.path[:1] != "/" else None
        if url is not None:  # the absolute form (http://host/path): the path of it
            request.path = (url.path or b"/").decode("latin-1")
        self.parsing = request
        self.queue.append(request)
        if self.worker is None:
            self.busy = True
            self._cancel_timer()
            self.worker = self.loop.create_task(self._serve())
        else:
            self._pause(1)  # one at a time: the next waits, and nothing more is read meanwhile

    def on_body(self, body: bytes) -> None:
        if self.parsing is not None:
            self.parsing.content.feed(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        if self.parsing is not None:
            self.parsing.content.end()
            self.parsing = None
        if self.lingering:
            self.close()  # the refused body's end: the answer was read or will be

    # -- answering ---------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closing:
                request = self.queue[0]
                if len(self.queue) == 1:
                    self._resume(1)  # none waits behind it: its own body may still be arriving
                try:
                    response = await self.app.handle(request)
                except Exception as exc:
                    log.error("unhandled %s answering %s", type(exc).__name__, request.method)
                    if self.stream is not None:  # its head is out: no other answer can follow
                        self.stream = None
                        self.abort()
                        return
                    # the app's 500, then the end (the rest of the body read and dropped first)
                    response = self.app.refusal(500)
                    response.force_close()
                self.queue.popleft()
                # a body that has not all arrived: the connection ends after this answer (_end); one
                # that has, read or not, leaves the connection at the next request
                keep = request.keep_alive and request.content.complete and not self.closing and not response.closes
                if keep:
                    self._resume(2)  # what the handler left unread no longer holds reading back
                stream, self.stream = self.stream, None
                if stream is not None or isinstance(response, StreamResponse):
                    # a head already sent: whatever the handler returned, the connection goes on
                    # only after a whole body
                    if stream is None or not stream.complete or stream.closes or not keep:
                        self._end(request)
                        return
                else:
                    self.app.decorate(request, response.headers)
                    try:
                        head = _head(response.status, response.headers, len(response.body), not keep, request.version)
                    except ValueError:
                        log.error("an answer to %s held a header with a line break", request.method)
                        self._refuse(500)
                        return
                    self.write(head + response.body if request.method != "HEAD" else head)
                    self.last_active = self.loop.time()
                    if not keep:
                        self._end(request)
                        return
        finally:
            self.worker = None
            self.busy = False
            if self._refusal is not None:
                self._refuse(self._refusal)
            if not self.closing and not self.queue and not self.lingering:
                if self.peer_eof or self.transport is None or self.transport.is_closing():
                    self.close()
                else:
                    self._arm(self.server.keepalive_seconds if not self._in_message else HEADER_SECONDS)
            self.server.idle_changed()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("the client went away")
        if self._write_paused:
            self._drain = self.loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None

    def _end(self, request: Request) -> None:
        """The connection ends after this answer: now, or once the unread rest of the request's
        body has arrived (read and dropped) or :data:`LINGER_SECONDS` have passed."""
        if request.content.ended or self.closing or self.peer_eof or self.transport is None:
            self.close()
            return
        self.lingering = True
        request.content.discard()
        self.queue.clear()
        self._arm(LINGER_SECONDS)
        if self._paused_by:
            self._paused_by = 0
            self.transport.resume_reading()

    def _refuse(self, status: int) -> None:
        """A request that could not be parsed or that broke a limit: its answer, then the end. While
        requests before it are in hand, it waits for their answers (answers go out in order)."""
        if self.closing:
            return
        if self.busy:
            self._pause(4)  # never resumed: nothing after the bad bytes is read
            if self.parsing is not None:
                # the bad bytes are in the body of a request already queued: that request gets the
                # one answer (its handler's; a read of the body fails), then the connection ends
                self.parsing.content.fail("the request body is malformed")
                self.parsing.keep_alive = False
                self.parsing = None
            else:
                self._refusal = status  # a request head after those in hand: answered after them
            return
        resp = self.refused(status)
        self.write(_head(resp.status, resp.headers, len(resp.body), True) + resp.body)
        self.close()

    def refused(self, status: int) -> Response:
        """The answer to bytes that could not be parsed or broke a limit (the app's ``refusal``)."""
        return self.app.refusal(status)

    # -- flow and time ------------------------------------------------------------------------

    def _pause(self, why: int) -> None:
        if not self._paused_by and self.transport is not None:
            self.transport.pause_reading()
        self._paused_by |= why

    def _resume(self, why: int) -> None:
        was = self._paused_by
        self._paused_by &= ~why
        if was and not self._paused_by and self.transport is not None and not self.closing:
            self.transport.resume_reading()

    def pause_for_body(self) -> None:
        self._pause(2)

    def resume_for_body(self) -> None:
        self._resume(2)

    def _arm(self, seconds: float) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(seconds, self._expired)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if not self.busy or self.lingering:
            self.close()  # idle past keep-alive, headers that never finished, a body dropped too long

    def close(self) -> None:
        self.closing = True
        self._cancel_timer()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        self.closing = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()


class Server:
    """The listeners of one :class:`App` and the connections they accepted."""

    def __init__(
        self,
        app: App,
        *,
        name: str = "http",
        max_connections: int | None = MAX_CONNECTIONS,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
        max_line: int = MAX_LINE,
        max_field: int = MAX_FIELD,
        max_headers: int = MAX_HEADERS,
    ) -> None:
        self.app = app
        self.name = name
        self.loop = asyncio.get_running_loop()
        # None: the budget is kept by the caller (gateway.remote.transport counts at accept)
        self.max_connections = None if max_connections is None else max(1, max_connections)
        self.keepalive_seconds = keepalive_seconds
        self.max_line = max_line
        self.max_field = max_field
        self.max_headers = max_headers
        self.connections: set[Connection] = set()
        self.listeners: list[asyncio.AbstractServer] = []
        self._idle: asyncio.Event | None = None
        self.evicted = 0  # idle connections closed to make room for a newcomer
        self.refused = 0  # newcomers closed because every connection was in a request
        self._said_at: float | None = None
        self._read_buffer: memoryview | None = None

    def read_buffer(self) -> memoryview:
        """The buffer every connection of this server reads into (made at the first read). One is
        enough: a server belongs to one event loop, and each read is parsed before the loop reads
        again; its pages are touched only as far as reads fill it."""
        if self._read_buffer is None:
            self._read_buffer = memoryview(bytearray(READ_BUFFER))
        return self._read_buffer

    def admit(self) -> bool:
        """Room for one more connection: under the budget, or once the connection idle the longest
        is closed. False (the newcomer is closed) when every connection is in a request."""
        if self.max_connections is None or len(self.connections) < self.max_connections:
            return True
        idle = [c for c in self.connections if not c.busy]
        if idle:
            victim = min(idle, key=lambda c: c.last_active)
            self.connections.discard(victim)
            victim.abort()
            self.evicted += 1
            admitted = True
        else:
            self.refused += 1
            admitted = False
        now = self.loop.time()
        if self._said_at is None or now - self._said_at >= BUDGET_LOG_SECONDS:
            self._said_at = now
            log.warning(
                "%s listener: all %d connections in use; %d idle ones closed for newcomers, %d newcomers refused",
                self.name,
                self.max_connections,
                self.evicted,
                self.refused,
            )
        return admitted

    def protocol(self) -> Connection:
        return Connection(self)

    async def serve_unix(self, path: str, *, backlog: int) -> None:
        self.listeners.append(await self.loop.create_unix_server(self.protocol, path, backlog=backlog))

    async def serve_tcp(self, host: str, port: int, *, backlog: int = 128) -> int:
        """Listens on ``host:port`` (0: any free port); returns the port."""
        srv = await self.loop.create_server(self.protocol, host, port, backlog=backlog, reuse_address=True)
        self.listeners.append(srv)
        return bound_port(srv)

    def idle_changed(self) -> None:
        if self._idle is not None and not any(c.busy for c in self.connections):
            self._idle.set()

    async def close(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """Stop accepting; close idle connections; give busy ones ``grace`` seconds; cut the rest."""
        for srv in self.listeners:
            srv.close()
        self.listeners.clear()
        for conn in list(self.connections):
            if not conn.busy:
                conn.close()
            else:
                conn.closing = True  # the answer in progress is written, then the connection ends
        if any(c.busy for c in self.connections):
            self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._idle.wait()
        for conn in list(self.connections):
            conn.abort()
        await self.app.cleanup()


def bound_port(server: asyncio.AbstractServer) -> int:
    """The port ``server`` listens on (its first socket's). ``sockets`` is read untyped: uvloop's is a
    list where asyncio's stubs say tuple, and compiled code checks the declared type."""
    return int(cast(Any, server).sockets[0].getsockname()[1])
