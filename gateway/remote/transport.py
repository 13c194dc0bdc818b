"""Listening sockets for the gateway, with the limits aiohttp does not have on its own.

aiohttp's server bounds header sizes and idle keep-alive time but has no cap on connections and no
deadline for a client that trickles its request headers (slowloris). Each connection's protocol is
wrapped here:

* at most ``max_connections`` at once: one over the cap is closed straight after accept;
* a request's headers must arrive within ``header_timeout`` of its first byte, else the
  connection is closed (the handler marks a request as started through :func:`request_started`);
* the TLS handshake itself is bounded by ``ssl_handshake_timeout``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web

GUARD_ATTR = "_uomp_conn_guard"


class ConnectionGuard(asyncio.Protocol):
    """Delegates to aiohttp's RequestHandler; adds the connection cap and the header deadline."""

    def __init__(self, inner: Any, registry: ConnectionRegistry) -> None:
        self.inner = inner
        self.registry = registry
        self.transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False
        setattr(inner, GUARD_ATTR, self)
        # aiohttp answers unparsable requests (oversized header, bad request line) itself with a
        # text/plain body and logs the exception, which can quote the request. Replace both with
        # a §8.4 JSON error and an audit event that carries no request bytes.
        inner.handle_error = self._handle_error

    def _handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                      message: str | None = None) -> web.StreamResponse:
        code = "INVALID_REQUEST" if status < 500 else "INTERNAL"
        text = "malformed or oversized request" if status < 500 else "internal error"
        if self.registry.on_rejected is not None:
            self.registry.on_rejected(status, code, text)
        resp = web.json_response({"error": {"code": code, "message": text}}, status=status)
        resp.force_close()
        return resp

    # asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.registry.admit(self):
            transport.close()
            return
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self.registry.release(self):
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_request and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.registry.header_timeout, self._expired)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self.inner.eof_received()
        return result

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # request bookkeeping ------------------------------------------------------------------
    def request_started(self) -> None:
        self._in_request = True
        self._cancel()

    def request_finished(self) -> None:
        self._in_request = False

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if not self._in_request and self.transport is not None:
            self.registry.slow_closed += 1
            self.transport.close()


class ConnectionRegistry:
    def __init__(self, *, max_connections: int, header_timeout: float) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.active: set[ConnectionGuard] = set()
        self.refused = 0
        self.slow_closed = 0
        # called (status, code, message) when aiohttp itself rejects a request before routing
        self.on_rejected: Callable[[int, str, str], None] | None = None

    def admit(self, guard: ConnectionGuard) -> bool:
        if len(self.active) >= self.max_connections:
            self.refused += 1
            return False
        self.active.add(guard)
        return True

    def release(self, guard: ConnectionGuard) -> bool:
        if guard in self.active:
            self.active.discard(guard)
            return True
        return False


def request_started(request: web.BaseRequest) -> None:
    guard = getattr(request.protocol, GUARD_ATTR, None)
    if guard is not None:
        guard.request_started()


def request_finished(request: web.BaseRequest) -> None:
    guard = getattr(request.protocol, GUARD_ATTR, None)
    if guard is not None:
        guard.request_finished()


async def listen(runner: web.AppRunner, host: str, port: int, *, ssl_context: ssl.SSLContext | None,
                 registry: ConnectionRegistry, handshake_timeout: float = 10.0,
                 backlog: int = 1024) -> asyncio.Server:
    """Start serving ``runner`` (already set up) on host:port with the wrapped protocol."""
    loop = asyncio.get_running_loop()
    server = runner.server
    assert server is not None
    factory: Callable[[], asyncio.Protocol] = lambda: ConnectionGuard(server(), registry)  # noqa: E731
    kwargs: dict[str, Any] = {}
    if ssl_context is not None:
        kwargs["ssl"] = ssl_context
        kwargs["ssl_handshake_timeout"] = handshake_timeout
    srv = await loop.create_server(factory, host, port, backlog=backlog, reuse_address=True,
                                   family=socket.AF_INET6 if ":" in host else socket.AF_INET, **kwargs)
    return srv
