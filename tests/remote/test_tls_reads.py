"""What a read from a TLS connection allocates on the gateway's listener (``gateway.remote.transport``
with ``gateway.httpd``): the loop's TLS protocol decrypts into the server's one read buffer, so a
request costs no read-sized object. A copying protocol has the TLS layer allocate ``max_size``
bytes per read (256 KiB on uvloop: an mmap, mremap and munmap each request) and trim them.

Real TLS 1.3 with a client certificate on 127.0.0.1; the client is a thread with a blocking socket
reading into its own buffer, so the only allocations traced are the server's. Run again on uvloop
by test_tls_reads_uvloop.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import ssl
import tracemalloc
from pathlib import Path

from gateway import httpd
from gateway.config import GatewayConfig
from gateway.remote import transport
from gateway.remote.tls import build_server_context
from tests.certutil import make_cert_set

ANSWER_BYTES = 64


async def _echo_digest(request: httpd.Request) -> httpd.AnyResponse:
    h = hashlib.sha256()
    while chunk := await request.content.readany():
        h.update(chunk)
    return httpd.Response(h.hexdigest().encode()[:ANSWER_BYTES])


async def _pass(request: httpd.Request, handler: httpd.Handler) -> httpd.AnyResponse:
    return await handler(request)


async def _listener(tmp_path: Path) -> tuple[httpd.Server, int, ssl.SSLContext]:
    certs = make_cert_set(tmp_path / "certs", variants=("good",))
    ctx = build_server_context(certs.server_cert, certs.server_key, certs.ca_cert, certs.crl)
    app = httpd.App(middleware=_pass, refusal=lambda status: httpd.Response(b"", status))
    app.router.add_route("GET", "/r", _echo_digest)
    app.router.add_route("POST", "/r", _echo_digest)
    server = httpd.Server(app, name="tls-reads")
    limits = transport.Limits.for_listener(GatewayConfig(), "mtls")  # the product's defaults
    srv = await transport.listen(
        server,
        "127.0.0.1",
        0,
        ssl_context=ctx,
        registry=transport.ConnectionRegistry(limits),
    )
    return server, int(srv.sockets[0].getsockname()[1]), certs.client_context("good")


class _Client:
    """One keep-alive TLS connection in a blocking socket (used from a thread), reading answers into
    its own buffer."""

    def __init__(self, port: int, ctx: ssl.SSLContext) -> None:
        raw = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.sock = ctx.wrap_socket(raw, server_hostname="localhost")
        self.buf = bytearray(4096)

    def ask(self, bodies: list[bytes]) -> list[bytes]:
        """Each body POSTed in turn (an empty one as a GET); the answers' bodies."""
        buf, view, answers = self.buf, memoryview(self.buf), []
        for body in bodies:
            if body:
                self.sock.sendall(b"POST /r HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            else:
                self.sock.sendall(b"GET /r HTTP/1.1\r\nHost: t\r\n\r\n")
            got = 0
            while b"\r\n\r\n" not in buf[:got] or got < buf.index(b"\r\n\r\n") + 4 + ANSWER_BYTES:
                n = self.sock.recv_into(view[got:])
                assert n, "the server closed the connection"
                got += n
            answers.append(bytes(buf[buf.index(b"\r\n\r\n") + 4 : got]))
        return answers

    def close(self) -> None:
        self.sock.close()


def _exchange(port: int, ctx: ssl.SSLContext, bodies: list[bytes]) -> list[bytes]:
    client = _Client(port, ctx)
    try:
        return client.ask(bodies)
    finally:
        client.close()


async def test_a_request_costs_no_read_sized_allocation(tmp_path: Path) -> None:
    server, port, ctx = await _listener(tmp_path)
    client = await asyncio.to_thread(_Client, port, ctx)
    try:
        await asyncio.to_thread(client.ask, [b""] * 3)  # the connection is set up, the read buffer made
        tracemalloc.start()
        try:
            await asyncio.to_thread(client.ask, [b""] * 3)
            tracemalloc.reset_peak()
            answers = await asyncio.to_thread(client.ask, [b""] * 20)
            current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert answers == [hashlib.sha256(b"").hexdigest().encode()] * 20
        # a copying protocol: one transient read-sized object per read (asyncio's TLS 32 KiB, uvloop's 256)
        assert peak - current < 16 * 1024, (peak, current)
    finally:
        client.close()
        await server.close(grace=1)


async def test_connections_sharing_the_read_buffer_keep_their_own_bytes(tmp_path: Path) -> None:
    """The buffer is the server's, not the connection's: four connections sending large bodies at
    once, each body read in many pieces between the others' reads, each digest right."""
    server, port, ctx = await _listener(tmp_path)
    try:
        bodies = [[os.urandom(300_000 + 7919 * i + k) for k in range(3)] for i in range(4)]
        answers = await asyncio.gather(*(asyncio.to_thread(_exchange, port, ctx, b) for b in bodies))
        for sent, got in zip(bodies, answers, strict=True):
            assert got == [hashlib.sha256(b).hexdigest().encode() for b in sent]
    finally:
        await server.close(grace=1)
