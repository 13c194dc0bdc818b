"""Forwarding verified requests to the Memory Guard: Unix socket (default) or loopback HTTP.

Both go through :mod:`gateway.remote.upstream`, a small strict HTTP/1.1 client with a pool of
keep-alive connections (aiohttp's client was the largest single cost of a forwarded request).
Only an allow-list of headers crosses in either direction, so hop-by-hop headers (RFC 9110
§7.6.1), anything named in ``Connection``, and any client-sent copy of the ``X-UOMP-Verified-*``
identity headers never reach the guard; the request is re-framed by the client (``Content-Length``
only, never the agent's framing). Failures map to stable codes: the guard unreachable is 503
STORE_UNAVAILABLE (the gateway stays up and recovers by itself on the next request), garbage is
502 UPSTREAM_ERROR, a hang is 504 UPSTREAM_TIMEOUT. Each such failure is reported to
``on_failure`` (the gateway's :class:`~gateway.remote.upstream_health.UpstreamMonitor`: it logs,
counts and re-checks the guard).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from gateway import contract, jsonio
from gateway.core.http1 import HeaderBlock
from gateway.errors import ErrorCode, UompError, caused_by
from gateway.remote.upstream import CHUNK_BYTES, DEFAULT_MAX_CONNECTIONS, Upstream, UpstreamClient, UpstreamResponse

__all__ = [
    "CHUNK",
    "FORWARD_REQUEST_HEADERS",
    "FORWARD_RESPONSE_HEADERS",
    "MAX_JSON_BYTES",
    "Answer",
    "Client",
    "Forwarder",
    "Upstream",
    "UpstreamResponse",
]

# Request headers the gateway copies from the client (lower-case; everything else is dropped) and
# response headers passed back: the gateway<->guard contract.
FORWARD_REQUEST_HEADERS = contract.FORWARD_REQUEST_HEADERS
FORWARD_RESPONSE_HEADERS = contract.FORWARD_RESPONSE_HEADERS
CHUNK = CHUNK_BYTES
MAX_JSON_BYTES = 1024 * 1024  # a JSON exchange with the guard (token validation, refresh)


class Answer(Protocol):
    """The guard's answer as the gateway reads it (:class:`UpstreamResponse`, or the uplink's)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes | None

    def header(self, name: str) -> str | None: ...
    @property
    def content_type(self) -> str: ...
    @property
    def content_length(self) -> int | None: ...
    async def read(self, limit: int) -> bytes: ...
    def iter_chunks(self, size: int = CHUNK_BYTES) -> AsyncIterator[bytes]: ...
    def release(self) -> None: ...


class Client(Protocol):
    """What carries requests to the guard: the Unix-socket/HTTP pool (:class:`UpstreamClient`), or the uplink hub."""

    async def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        *,
        body: bytes | None = None,
        block: HeaderBlock | None = None,
    ) -> Answer: ...

    async def close(self) -> None: ...


class Forwarder:
    """The gateway's client of the guard, with its time-out and failure codes: over
    :mod:`gateway.remote.upstream` by default, or over another :class:`Client` (the uplink hub)."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        timeout_seconds: float,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        client: Client | None = None,
    ) -> None:
        self.upstream = upstream
        self.client: Client = (
            client
            if client is not None
            else UpstreamClient(upstream, timeout_seconds=timeout_seconds, max_connections=max_connections)
        )
        self.on_failure: Callable[[ErrorCode], None] | None = None  # called with the code of a failed exchange

    def _failed(self, exc: UompError) -> None:
        if self.on_failure is not None and exc.code in (
            ErrorCode.STORE_UNAVAILABLE,
            ErrorCode.UPSTREAM_ERROR,
            ErrorCode.UPSTREAM_TIMEOUT,
        ):
            self.on_failure(exc.code)

    async def close(self) -> None:
        await self.client.close()

    async def request(
        self,
        method: str,
        path_and_query: str,
        headers: Mapping[str, str],
        *,
        body: bytes | None = None,
        block: HeaderBlock | None = None,
    ) -> Answer:
        """Send one request; the caller reads (``body`` or ``iter_chunks``) and ``release()``s the answer.
        ``block``: header lines checked once already (:func:`gateway.core.http1.header_block`)."""
        try:
            return await self.client.request(method, path_and_query, headers, body=body, block=block)
        except UompError as exc:
            self._failed(exc)
            raise

    async def json_call(
        self, method: str, path: str, *, body: Any = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """A small JSON exchange with the guard (token validation, refresh)."""
        hdrs = {"content-type": "application/json", **(headers or {})}
        data = json.dumps(body).encode() if body is not None else None
        resp = await self.request(method, path, hdrs, body=data)
        try:
            raw = await resp.read(MAX_JSON_BYTES + 1)
        finally:
            resp.release()
        try:
            if len(raw) > MAX_JSON_BYTES:
                raise UompError(ErrorCode.UPSTREAM_ERROR, "the memory guard answered with an oversized response")
            try:
                parsed = jsonio.loads(raw) if raw else {}
            except ValueError as exc:
                raise caused_by(UompError(ErrorCode.UPSTREAM_ERROR, "the memory guard answered with invalid JSON"), exc)
            if not isinstance(parsed, dict):
                raise UompError(ErrorCode.UPSTREAM_ERROR, "the memory guard answered with an unexpected shape")
        except UompError as exc:
            self._failed(exc)
            raise
        return resp.status, parsed
