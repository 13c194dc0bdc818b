"""A lean HTTP/1.1 client for the gateway's one hop to the Memory Guard (Unix socket or loopback TCP).

Longer than ~500 lines on purpose: the connection, the streamed response and the pool share each
exchange's slot and idle-list bookkeeping, so they stay together; the wire format (parsing and
request bytes) lives apart, free of I/O, in :mod:`gateway.core.http1`.

Why not aiohttp's client: in a profile of the gateway it was the largest single cost of a request
(~350 µs of the gateway's CPU per forwarded read, more than TLS). This hop talks to one known
server over a local socket, so a small strict client does the job: a pool of keep-alive
connections, one request at a time on each (no pipelining), every step bounded.

Request (RFC 9112 §3): ``METHOD <target> HTTP/1.1``, where the target is the gateway's canonical
spelling (:mod:`gateway.remote.pathnorm`) sent byte for byte; ``Host``; the caller's headers
minus every header that frames or routes a message (:data:`HOP_HEADERS`: a client's
``Transfer-Encoding``, ``Connection``, ``Content-Length``, ``Host`` ... never cross), and a header
name that is not an RFC 9110 token or a value holding CR, LF or NUL is refused, not sent. A
request body is always sent with ``Content-Length`` (never chunked); POST and PUT always carry
one, even ``0``. So the guard sees one unambiguous message per request: nothing to smuggle.

Response, parsed strictly by the sans-I/O :mod:`gateway.core.http1` (this module only moves the
bytes and keeps the pool): a status line ``HTTP/1.x DDD ...``; at most :data:`MAX_HEAD_BYTES` of
head and :data:`MAX_HEADERS` fields; field names are tokens, no obs-fold, no CR/LF/NUL in
values; the body framed by one ``Content-Length`` value or ``Transfer-Encoding: chunked``
(exactly that coding; chunk extensions ignored, trailers read and dropped) or, failing both, by
the connection's close; ``Content-Length`` together with ``Transfer-Encoding``, two different
lengths, any other coding, or a 1xx answer is garbage; at most :data:`MAX_BODY_BYTES` of body. A
``Content-Length`` body of at most :data:`BUFFER_BODY_BYTES` (every JSON answer of the guard) is
read whole before the caller sees the status; a larger or chunked one is streamed.

Failures map to the gateway's stable codes:

* socket missing, connection refused, or a connection closed before a single byte of an answer:
  ``STORE_UNAVAILABLE`` (503): the guard is down or restarting;
* anything unparsable, an answer cut short, a body over the cap: ``UPSTREAM_ERROR`` (502);
* no complete answer within the request's deadline (``timeout_seconds`` for the whole exchange:
  waiting for a pool slot, connect, send, head and body): ``UPSTREAM_TIMEOUT`` (504).

Connections: a connection is reused only after a complete, well-framed exchange that left no
stray byte behind and did not say ``Connection: close`` (nor was HTTP/1.0); one that errors, times
out or is cancelled mid-exchange is closed, never reused. An idle connection is dropped when the
guard has closed it, when it holds unexpected bytes, or after :data:`IDLE_SECONDS`. If a *reused*
connection turns out to be closed before any byte of the answer (the guard closed it while idle,
or restarted), the exchange is retried once on a new connection, but only for ``GET`` (idempotent
here); a POST is never replayed. At most ``max_connections`` exchanges run at once (others wait
for a slot within their deadline), at most :data:`MAX_IDLE` idle connections are kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from gateway.core import http1
from gateway.core.http1 import (  # noqa: F401  (the limits and HOP_HEADERS stay importable from here)
    BAD_TARGET,
    CHUNKED,
    HOP_HEADERS,
    LENGTH,
    MAX_BODY_BYTES,
    MAX_CHUNK_LINE,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_TRAILERS,
    NONE,
    UNTIL_CLOSE,
    garbage,
)
from gateway.errors import ErrorCode, UompError, caused_by

BUFFER_BODY_BYTES = 256 * 1024  # Content-Length bodies up to this size are read whole at once
READ_HIGH_WATER = 256 * 1024  # stop reading the socket while this much is buffered and unread
IDLE_SECONDS = 10.0  # an idle pooled connection older than this is closed (the guard keeps 75 s)
MAX_IDLE = 64  # idle connections kept in the pool
CHUNK_BYTES = 64 * 1024  # the pieces a streamed answer is read in
DEFAULT_MAX_CONNECTIONS = 256  # exchanges at once


def _timeout() -> UompError:
    return UompError(ErrorCode.UPSTREAM_TIMEOUT, "the memory guard did not answer in time")


def _unavailable() -> UompError:
    return UompError(ErrorCode.STORE_UNAVAILABLE, "the memory guard is unavailable")


class _NoAnswer(Exception):
    """The connection closed before a single byte of the answer arrived."""


@dataclass(frozen=True)
class Upstream:
    """Where the guard is: a Unix socket path or an http URL."""

    kind: str  # "unix" or "http"
    target: str  # socket path or base URL

    @classmethod
    def parse(cls, spec: str) -> Upstream:
        if spec.startswith("unix:"):
            return cls("unix", spec[len("unix:") :])
        if spec.startswith("http://"):
            return cls("http", spec.rstrip("/"))
        raise UompError(ErrorCode.CONFIG_ERROR, "upstream must be unix:/path/to/guard.sock or http://127.0.0.1:PORT")


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _Conn(asyncio.Protocol):
    """One upstream connection: a byte buffer fed by the event loop, read by one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.closed = False
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.drain_waiter: asyncio.Future[None] | None = None
        self.write_paused = False
        self.idle_since = 0.0

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have asyncio.Transport's methods but not its class: no isinstance here
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > READ_HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.closed = True
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        w = self.drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- used by the client

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, deadline: float) -> None:
        """Until more bytes (or EOF) arrive; TimeoutError at ``deadline`` (loop time)."""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        fut = self.loop.create_future()
        self.waiter = fut
        handle = self.loop.call_at(deadline, _expire, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self.waiter = None

    async def send(self, data: bytes, deadline: float) -> None:
        assert self.transport is not None
        self.transport.write(data)
        if self.write_paused and not self.closed:
            fut = self.loop.create_future()
            self.drain_waiter = fut
            handle = self.loop.call_at(deadline, _expire, fut)
            try:
                await fut
            finally:
                handle.cancel()
                self.drain_waiter = None

    def usable(self, now: float) -> bool:
        return (
            not self.eof
            and not self.buf
            and self.transport is not None
            and not self.transport.is_closing()
            and now - self.idle_since < IDLE_SECONDS
        )

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    async def read_head(self, deadline: float) -> bytes:
        start = 0
        while True:
            i = http1.head_end(self.buf, start)
            if i >= 0:
                head = bytes(self.buf[:i])
                del self.buf[: i + 4]
                return head
            if self.eof:
                if not self.buf:
                    raise _NoAnswer
                raise garbage("connection closed inside the header section")
            start = max(0, len(self.buf) - 3)
            await self.wait(deadline)

    async def read_exact(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            if self.eof:
                raise garbage("connection closed inside the body")
            await self.wait(deadline)
        if n == len(self.buf):
            out = bytes(self.buf)
            self.buf.clear()
        else:
            out = bytes(self.buf[:n])
            del self.buf[:n]
        return out

    async def read_some(self, n: int, deadline: float) -> bytes:
        """Up to ``n`` bytes (at least one), or b"" at EOF."""
        while not self.buf:
            if self.eof:
                return b""
            await self.wait(deadline)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def read_line(self, deadline: float) -> bytes:
        start = 0
        while True:
            i = http1.line_end(self.buf, start)
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return line
            if self.eof:
                raise garbage("connection closed inside a chunked body")
            start = max(0, len(self.buf) - 1)
            await self.wait(deadline)


class UpstreamResponse:
    """The guard's answer. ``body`` is set when it was read whole already; else stream it with
    :meth:`iter_chunks` or :meth:`read`. Always :meth:`release` it (returns or closes the connection)."""

    def __init__(
        self,
        client: UpstreamClient,
        conn: _Conn,
        status: int,
        headers: list[tuple[str, str]],
        mode: int,
        length: int,
        keep_alive: bool,
        deadline: float,
    ) -> None:
        self.status = status
        self.headers = headers
        self.body: bytes | None = None
        self._client = client
        self._conn: _Conn | None = conn
        self._mode = mode
        self._length = length  # LENGTH: bytes still to read
        self._keep_alive = keep_alive
        self._deadline = deadline
        self._received = 0
        self._done = mode == NONE
        self._chunk_left = 0  # CHUNKED: bytes left in the current chunk
        self._framed_length = length if mode == LENGTH else (0 if mode == NONE else None)

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters ("" when absent)."""
        value = self.header("content-type") or ""
        return value.split(";", 1)[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        """The body's length when the guard framed it by length (or it has none)."""
        return self._framed_length

    async def _next(self, size: int) -> bytes:
        """The next piece of the body (at most ``size`` bytes), b"" once it is complete."""
        conn = self._conn
        if self._done or conn is None:
            return b""
        dl = self._deadline
        try:
            if self._mode == LENGTH:
                if self._length == 0:
                    self._done = True
                    return b""
                data = await conn.read_some(min(size, self._length), dl)
                if not data:
                    raise garbage("connection closed inside the body")
                self._length -= len(data)
                if self._length == 0:
                    self._done = True
                return data
            if self._mode == UNTIL_CLOSE:
                data = await conn.read_some(size, dl)
                if not data:
                    self._done = True
                    self._keep_alive = False
                    return b""
                self._count(len(data))
                return data
            # chunked
            if self._chunk_left == 0:
                line = await conn.read_line(dl)
                n = http1.chunk_size(line)
                if n == 0:
                    for _ in range(MAX_TRAILERS + 1):
                        if not await conn.read_line(dl):
                            self._done = True
                            return b""
                    raise garbage("too many trailer fields")
                self._count(n)
                self._chunk_left = n
            data = await conn.read_some(min(size, self._chunk_left), dl)
            if not data:
                raise garbage("connection closed inside a chunk")
            self._chunk_left -= len(data)
            if self._chunk_left == 0 and await conn.read_exact(2, dl) != b"\r\n":
                raise garbage("chunk not followed by CRLF")
            return data
        except TimeoutError as exc:
            self._abort()
            raise caused_by(_timeout(), exc)
        except BaseException:
            self._abort()
            raise

    def _count(self, n: int) -> None:
        self._received += n
        http1.check_body_size(self._received)

    async def read(self, limit: int) -> bytes:
        """The body, or its first ``limit`` bytes (the rest is not read: the connection is closed)."""
        if self.body is not None:
            return self.body[:limit]
        parts: list[bytes] = []
        got = 0
        while got < limit:
            piece = await self._next(min(CHUNK_BYTES, limit - got))
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
        return b"".join(parts)

    def iter_chunks(self, size: int = CHUNK_BYTES) -> BodyChunks:
        """The body in pieces of at most ``size`` bytes (``async for``)."""
        return BodyChunks(self, size)

    def _abort(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            self._client._finished(None)

    def release(self) -> None:
        """Give the connection back (if the exchange ended cleanly) or close it; idempotent."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep_alive and not conn.buf:
            self._client._finished(conn)
        else:
            conn.close()
            self._client._finished(None)


class BodyChunks:
    """An answer's body in pieces of at most ``size`` bytes (a plain async iterator: the module is
    compiled with mypyc, which has no async generators)."""

    def __init__(self, response: UpstreamResponse, size: int) -> None:
        self.response = response
        self.size = size
        self.offset = 0  # into a body read whole already

    def __aiter__(self) -> BodyChunks:
        return self

    async def __anext__(self) -> bytes:
        body = self.response.body
        if body is not None:
            piece = body[self.offset : self.offset + self.size]
            self.offset += len(piece)
        else:
            piece = await self.response._next(self.size)
        if not piece:
            raise StopAsyncIteration
        return piece


class UpstreamClient:
    """A bounded pool of keep-alive HTTP/1.1 connections to one upstream (see the module doc)."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        timeout_seconds: float,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_idle: int = MAX_IDLE,
    ) -> None:
        self.upstream = upstream
        self.timeout = float(timeout_seconds)
        self.max_idle = max_idle
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Conn] = []
        self.opened = 0  # connections opened so far (tests and diagnostics)
        self.retries = 0  # GETs replayed after a reused connection turned out closed
        self._closed = False
        if upstream.kind == "unix":
            self._host = "uomp-guard"
            self._prefix = ""
            self._addr: tuple[str, int] | None = None
        elif upstream.kind == "http":
            parts = urlsplit(upstream.target)
            try:
                port = parts.port or 80
            except ValueError:
                port = -1
            if not parts.hostname or parts.username or parts.password or parts.query or parts.fragment or port < 0:
                raise UompError(ErrorCode.CONFIG_ERROR, "upstream must be http://HOST:PORT (optionally /prefix)")
            host = parts.hostname
            self._addr = (host, port)
            shown = f"[{host}]" if ":" in host else host
            self._host = shown if port == 80 else f"{shown}:{port}"
            self._prefix = parts.path.rstrip("/")
            if BAD_TARGET.search(self._prefix):
                raise UompError(ErrorCode.CONFIG_ERROR, "upstream URL path has characters that cannot be sent")
        else:
            raise UompError(ErrorCode.CONFIG_ERROR, f"unknown upstream kind {upstream.kind!r}")

    # ------------------------------------------------------------------------------ request

    def _serialize(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes | None,
        block: http1.HeaderBlock | None = None,
    ) -> bytes:
        return http1.serialize_request(method, target, headers, body, host=self._host, prefix=self._prefix, block=block)

    async def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        *,
        body: bytes | None = None,
        block: http1.HeaderBlock | None = None,
    ) -> UpstreamResponse:
        """Send one request; returns once the status and headers (and a small body) are in.
        ``block``: header lines checked once already (:func:`gateway.core.http1.header_block`),
        sent before ``headers``."""
        if self._closed:
            raise _unavailable()
        data = self._serialize(method, target, headers, body, block)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        slots = self._slots
        if slots.locked():
            try:
                await asyncio.wait_for(slots.acquire(), max(0.0, deadline - loop.time()))
            except TimeoutError as exc:
                raise caused_by(_timeout(), exc)
        else:
            await slots.acquire()
        try:
            return await self._exchange(loop, method, data, deadline)
        except BaseException:
            slots.release()
            raise

    async def _exchange(
        self, loop: asyncio.AbstractEventLoop, method: str, data: bytes, deadline: float
    ) -> UpstreamResponse:
        for attempt in (0, 1):
            conn = self._pop_idle(loop.time()) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(loop, deadline)
            try:
                await conn.send(data, deadline)
                head = await conn.read_head(deadline)
                status, keep_alive, headers, framing = http1.parse_head(head)
                resp = self._response(conn, method, status, keep_alive, headers, framing, deadline)
                if resp._mode == LENGTH and resp._length <= BUFFER_BODY_BYTES:
                    resp.body = await conn.read_exact(resp._length, deadline)
                    resp._length = 0
                    resp._done = True
                    resp.release()
                elif resp._mode == NONE:
                    resp.body = b""
                    resp.release()
                return resp
            except _NoAnswer:
                conn.close()
                if reused:
                    self._drop_idle()  # the guard closed or restarted: the other idle ones are stale too
                    if method == "GET" and attempt == 0:
                        self.retries += 1
                        continue
                raise caused_by(_unavailable(), None)
            except TimeoutError as exc:
                conn.close()
                raise caused_by(_timeout(), exc)
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _response(
        self,
        conn: _Conn,
        method: str,
        status: int,
        keep_alive: bool,
        headers: list[tuple[str, str]],
        framing: dict[str, list[str]],
        deadline: float,
    ) -> UpstreamResponse:
        mode, n, keep_alive = http1.body_framing(method, status, keep_alive, framing)
        return UpstreamResponse(self, conn, status, headers, mode, n, keep_alive, deadline)

    # ------------------------------------------------------------------------------ pool

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Conn:
        def factory() -> _Conn:
            return _Conn(loop)

        try:
            async with asyncio.timeout_at(deadline):
                if self._addr is None:
                    _t, conn = await loop.create_unix_connection(factory, self.upstream.target)
                else:
                    _t, conn = await loop.create_connection(factory, *self._addr)
        except TimeoutError as exc:
            raise caused_by(_timeout(), exc)
        except OSError as exc:  # missing socket, refused, permission, unreachable
            raise caused_by(_unavailable(), exc)
        self.opened += 1
        return conn

    def _pop_idle(self, now: float) -> _Conn | None:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn
            conn.close()
        return None

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _finished(self, conn: _Conn | None) -> None:
        """An exchange ended: free its slot; pool its connection if given (and there is room)."""
        self._slots.release()
        if conn is None:
            return
        if self._closed or len(self._idle) >= self.max_idle or conn.eof or conn.closed:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        self._idle.append(conn)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def close(self) -> None:
        """Close the idle connections; exchanges in flight finish and then close theirs. No await inside."""
        self._closed = True
        self._drop_idle()
