"""Listening sockets for the gateway, with the limits aiohttp does not have on its own.

aiohttp's server bounds header sizes and idle keep-alive time but has no cap on connections and no
deadline for a client that trickles its request headers (slowloris). Each connection's protocol is
wrapped here:

* at most ``max_connections`` at once: one over the cap is closed straight after accept;
* a request's headers must arrive within ``header_timeout`` of its first byte, else the
  connection is closed (the handler marks a request as started through :func:`request_started`);
* requests aiohttp cannot parse get a §8.4 JSON error and an audit callback instead of aiohttp's
  text/plain answer (which could echo request bytes into the log).
* the TLS handshake itself is bounded by ``ssl_handshake_timeout``;
* asyncio's per-connection TLS read buffer is cut from 256 KiB to :data:`TLS_READ_BUFFER_BYTES`
  (see :func:`shrink_tls_read_buffer`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

# CPython's asyncio.sslproto.SSLProtocol allocates and zero-fills a read buffer of ``max_size`` bytes
# (256 KiB in 3.11) for every TLS connection: ~266 KiB of RSS per idle mTLS connection, ~270 MiB at
# the default max_connections. TLS records carry at most 16 KiB of plaintext, so 32 KiB costs
# nothing (measured: same new connections/s, 65-71 KiB per idle connection; benchmarks/README.md).
TLS_READ_BUFFER_BYTES = 32 * 1024


def shrink_tls_read_buffer(size: int | None = None) -> bool:
    """Lower ``asyncio.sslproto.SSLProtocol.max_size`` (never raise it); True if it was changed.

    ``max_size`` is a private class attribute, so: only if it exists and is an int. It is process
    wide: every TLS transport asyncio makes in this process (client ones too: the SDK, aiohttp's
    client) reads and decrypts at most this much per call, which only means more, smaller reads
    for a large body (tests/test_forward.py checks a 900 KiB body over TLS both ways in one process).
    """
    from asyncio import sslproto

    want = TLS_READ_BUFFER_BYTES if size is None else size
    current = getattr(sslproto.SSLProtocol, "max_size", None)
    if not isinstance(current, int) or isinstance(current, bool) or current <= want or want < 16 * 1024 + 256:
        return False
    sslproto.SSLProtocol.max_size = want
    return True


class GuardedHandler(RequestHandler):
    """aiohttp's RequestHandler plus the connection cap and the header deadline."""

    __slots__ = ("_uomp_admitted", "_uomp_in_request", "_uomp_registry", "_uomp_timer")

    def __init__(self, manager: web.Server, registry: ConnectionRegistry, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._uomp_registry = registry
        self._uomp_timer: asyncio.TimerHandle | None = None
        self._uomp_in_request = False
        self._uomp_admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._uomp_registry.admit(self):
            transport.close()
            return
        self._uomp_admitted = True
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_deadline()
        if self._uomp_admitted:
            self._uomp_admitted = False
            self._uomp_registry.release(self)
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._uomp_in_request and self._uomp_timer is None:
            self._uomp_timer = asyncio.get_running_loop().call_later(self._uomp_registry.header_timeout,
                                                                     self._deadline_passed)
        super().data_received(data)

    def request_started(self) -> None:
        self._uomp_in_request = True
        self._cancel_deadline()

    def request_finished(self) -> None:
        self._uomp_in_request = False

    def _cancel_deadline(self) -> None:
        if self._uomp_timer is not None:
            self._uomp_timer.cancel()
            self._uomp_timer = None

    def _deadline_passed(self) -> None:
        self._uomp_timer = None
        if not self._uomp_in_request and self.transport is not None:
            self._uomp_registry.slow_closed += 1
            self.transport.close()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # aiohttp answers unparsable requests (oversized header, bad request line) itself with a
        # text/plain body and logs the exception, which can quote the request. Replace both with a
        # §8.4 JSON error and an audit event that carries no request bytes.
        code = "INVALID_REQUEST" if status < 500 else "INTERNAL"
        text = "malformed or oversized request" if status < 500 else "internal error"
        if self._uomp_registry.on_rejected is not None:
            self._uomp_registry.on_rejected(status, code, text)
        resp = web.json_response({"error": {"code": code, "message": text}}, status=status)
        resp.force_close()
        return resp


class ConnectionRegistry:
    def __init__(self, *, max_connections: int, header_timeout: float) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.active: set[GuardedHandler] = set()
        self.refused = 0
        self.slow_closed = 0
        # called (status, code, message) when aiohttp itself rejects a request before routing
        self.on_rejected: Callable[[int, str, str], None] | None = None
        # told about connections opening and closing (the metrics' open_connections gauge)
        self.on_open: Callable[[], None] | None = None
        self.on_close: Callable[[], None] | None = None

    def admit(self, guard: GuardedHandler) -> bool:
        if len(self.active) >= self.max_connections:
            self.refused += 1
            return False
        self.active.add(guard)
        if self.on_open is not None:
            self.on_open()
        return True

    def release(self, guard: GuardedHandler) -> bool:
        if guard in self.active:
            self.active.discard(guard)
            if self.on_close is not None:
                self.on_close()
            return True
        return False


def request_started(request: web.BaseRequest) -> None:
    if isinstance(request.protocol, GuardedHandler):
        request.protocol.request_started()


def request_finished(request: web.BaseRequest) -> None:
    if isinstance(request.protocol, GuardedHandler):
        request.protocol.request_finished()


async def listen(runner: web.AppRunner, host: str, port: int, *, ssl_context: ssl.SSLContext | None,
                 registry: ConnectionRegistry, handshake_timeout: float = 10.0,
                 backlog: int = 1024) -> asyncio.Server:
    """Start serving ``runner`` (already set up) on host:port with the wrapped protocol."""
    loop = asyncio.get_running_loop()
    server = runner.server
    assert server is not None
    kwargs_h = dict(server._kwargs)

    def factory() -> asyncio.Protocol:
        return GuardedHandler(server, registry, loop=loop, **kwargs_h)

    kwargs: dict[str, Any] = {}
    if ssl_context is not None:
        shrink_tls_read_buffer()
        kwargs["ssl"] = ssl_context
        kwargs["ssl_handshake_timeout"] = handshake_timeout
    srv = await loop.create_server(factory, host, port, backlog=backlog, reuse_address=True,
                                   family=socket.AF_INET6 if ":" in host else socket.AF_INET, **kwargs)
    return srv
