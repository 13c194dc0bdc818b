"""Forwarding verified requests to the Memory Guard: Unix socket (default) or loopback HTTP.

Both directions stream. Only an allow-list of headers crosses in either direction, so hop-by-hop
headers (RFC 9110 §7.6.1), anything named in ``Connection``, and any client-sent copy of the
``X-UOMP-Verified-*`` identity headers never reach the guard. Failures map to stable codes:
the guard unreachable is 503 STORE_UNAVAILABLE (the gateway stays up and recovers by itself on
the next request), garbage is 502 UPSTREAM_ERROR, a hang is 504 UPSTREAM_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.errors import UompError

# Request headers the gateway passes upstream (lower-case). Everything else is dropped.
FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-uomp-agent-id")
# Response headers passed back to the agent.
FORWARD_RESPONSE_HEADERS = ("content-type", "x-uomp-quota-remaining", "www-authenticate")
CHUNK = 64 * 1024


@dataclass(frozen=True)
class Upstream:
    kind: str  # "unix" or "http"
    target: str  # socket path or base URL

    @classmethod
    def parse(cls, spec: str) -> Upstream:
        if spec.startswith("unix:"):
            return cls("unix", spec[len("unix:"):])
        if spec.startswith("http://"):
            return cls("http", spec.rstrip("/"))
        raise UompError("CONFIG_ERROR", "upstream must be unix:/path/to/guard.sock or http://127.0.0.1:PORT")

    def url(self, path_and_query: str) -> str:
        base = "http://uomp-guard" if self.kind == "unix" else self.target
        return base + path_and_query


class Forwarder:
    def __init__(self, upstream: Upstream, *, timeout_seconds: float, max_connections: int = 256) -> None:
        self.upstream = upstream
        self.timeout = aiohttp.ClientTimeout(total=timeout_seconds, sock_connect=min(5.0, timeout_seconds))
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector: aiohttp.BaseConnector
            if self.upstream.kind == "unix":
                connector = aiohttp.UnixConnector(path=self.upstream.target, limit=self.max_connections)
            else:
                connector = aiohttp.TCPConnector(limit=self.max_connections)
            # auto_decompress off: bytes pass through untouched; no cookies, no env proxies.
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout,
                                                  auto_decompress=False, trust_env=False,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, path_and_query: str, headers: Mapping[str, str], *,
                      body: AsyncIterator[bytes] | bytes | None = None) -> aiohttp.ClientResponse:
        """Open the upstream response (caller streams and releases it)."""
        try:
            resp = await self._client().request(method, self.upstream.url(path_and_query), headers=dict(headers),
                                                data=body, allow_redirects=False)
        except TimeoutError as exc:
            raise UompError("UPSTREAM_TIMEOUT", "the memory guard did not answer in time") from exc
        except (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError) as exc:
            raise UompError("STORE_UNAVAILABLE", "the memory guard is unavailable") from exc
        except (aiohttp.ClientError, asyncio.IncompleteReadError, ValueError) as exc:
            raise UompError("UPSTREAM_ERROR", "the memory guard answered with an invalid response") from exc
        return resp

    async def json_call(self, method: str, path: str, *, body: Any = None,
                        headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """A small JSON exchange with the guard (token validation, refresh)."""
        hdrs = {"content-type": "application/json", **(headers or {})}
        data = json.dumps(body).encode() if body is not None else None
        resp = await self.request(method, path, hdrs, body=data)
        try:
            raw = await resp.content.read(1024 * 1024 + 1)
        except TimeoutError as exc:
            raise UompError("UPSTREAM_TIMEOUT", "the memory guard did not answer in time") from exc
        except aiohttp.ClientError as exc:
            raise UompError("UPSTREAM_ERROR", "the memory guard answered with an invalid response") from exc
        finally:
            resp.release()
        try:
            parsed = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise UompError("UPSTREAM_ERROR", "the memory guard answered with invalid JSON") from exc
        if not isinstance(parsed, dict):
            raise UompError("UPSTREAM_ERROR", "the memory guard answered with an unexpected shape")
        return resp.status, parsed
