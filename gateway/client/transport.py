"""The agent SDK's transport: the gateway's URL rules, the aiohttp connection pools, and one HTTP
exchange (headers, DPoP proof, bounded answer, transport failures turned into the SDK's errors).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from yarl import URL

from gateway.client.errors import CertificateError, ConfigError, ProtocolError, Unavailable, UompClientError
from gateway.client.options import READ_CHUNK, AgentKey, ClientOptions, Mode
from gateway.client.tls import describe, ssl_in_chain, transport_context
from gateway.contract import AGENT_HEADER
from gateway.core.dpop import make_dpop_proof
from gateway.core.envelope import HEADER_NAME, TRAILER_LEN, Envelope, encode_header
from gateway.netutil import is_loopback


def check_url(url: str, what: str, *, allow_loopback_http: bool) -> str:
    """``url`` without a trailing slash, or ConfigError. https always; http only for loopback hosts."""
    if not isinstance(url, str) or not url or len(url) > 2048:
        raise ConfigError("CONFIG_ERROR", f"{what} is missing or too long")
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise ConfigError("CONFIG_ERROR", f"{what} is not a valid URL") from exc
    scheme = parts.scheme.lower()
    host = parts.hostname or ""  # lower case (urlsplit), as netutil.is_loopback expects
    if not host or "@" in parts.netloc or parts.query or parts.fragment:
        raise ConfigError("CONFIG_ERROR", f"{what} must be scheme://host[:port][/path] with no user, query or fragment")
    if scheme == "http":
        if not allow_loopback_http:
            raise ConfigError("CONFIG_ERROR", f"{what} must be https:// in this mode")
        if not is_loopback(host):
            raise ConfigError(
                "CONFIG_ERROR",
                f"{what}: plain http:// is allowed only for loopback addresses "
                "(127.0.0.1, ::1, localhost); use https://",
            )
    elif scheme != "https":
        raise ConfigError("CONFIG_ERROR", f"{what} must be an https:// URL")
    return url.strip().rstrip("/")


class Pool:
    """One aiohttp session (one SSL context); retired sessions close when their last call ends."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self.inflight = 0
        self.retired = False

    async def release(self) -> None:
        self.inflight -= 1
        if self.retired and self.inflight == 0 and not self.session.closed:
            await self.session.close()


def _query(query: Mapping[str, str] | None) -> str:
    return ("?" + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query.items())) if query else ""


class ClientTransport:
    """The connection part of :class:`~gateway.client.sdk.UompClient`: where it connects and how
    (TLS material by ``mode``), the connection pools, and one exchange (:meth:`send`,
    :meth:`send_stream`). The certificate renewer moves it to a new certificate with
    :meth:`use_certificate`; nothing else changes after construction."""

    def __init__(
        self,
        *,
        mode: Mode,
        agent_id: str,
        session_id: str,
        options: ClientOptions,
        base: str,
        public: str,
        host_header: str | None,
        ca_file: Path | None,
        ca_cert: str | None,
        key: AgentKey | None,
    ) -> None:
        self.mode = mode
        self.base = base  # where the client connects
        self.public = public  # where requests are addressed (DPoP htu); differs behind a tunnel origin
        self.host_header = host_header
        self._agent_id = agent_id
        self._session_id = session_id
        self._opts = options
        self._ca_file = ca_file
        self._ca_cert = ca_cert
        self.key = key  # the agent key: the client certificate's (mTLS), the DPoP proofs' signer
        self._cert_pem: str | None = None
        self._open_lock = asyncio.Lock()
        self._conn: Pool | None = None
        self._retired: list[Pool] = []
        self._closed = False

    async def open(self) -> None:
        """Create the connection pool (done on first use too)."""
        if self._closed:
            raise ConfigError("CONFIG_ERROR", "this client is closed")
        if self._conn is None:
            async with self._open_lock:
                if self._conn is None:
                    self._conn = self._new_conn()

    async def aclose(self) -> None:
        self._closed = True
        conns = [*self._retired, *([self._conn] if self._conn else [])]
        self._conn = None
        self._retired = []
        for c in conns:
            if not c.session.closed:
                await c.session.close()

    def set_certificate(self, cert_pem: str, key: AgentKey) -> None:
        """The client certificate (and its key) for connections made from now on."""
        self._cert_pem, self.key = cert_pem, key

    async def use_certificate(self, cert_pem: str, key: AgentKey) -> None:
        """Move to a new client certificate: new connections use it; calls in flight finish on the
        old pool, which closes when its last call ends."""
        self.set_certificate(cert_pem, key)
        old, self._conn = self._conn, self._new_conn()
        self._retired = [c for c in self._retired if not c.session.closed]
        if old is not None:
            old.retired = True
            if old.inflight == 0:
                await old.session.close()
            else:
                self._retired.append(old)

    def _new_conn(self) -> Pool:
        o = self._opts
        connector = aiohttp.TCPConnector(ssl=self._ssl_context(), limit=o.max_connections)
        timeout = aiohttp.ClientTimeout(
            total=o.timeout_seconds,
            connect=o.connect_timeout_seconds,
            sock_connect=o.connect_timeout_seconds,
            sock_read=o.timeout_seconds,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            raise_for_status=False,
        )
        return Pool(session)

    def _ssl_context(self) -> ssl.SSLContext:
        return transport_context(
            self.mode, ca_cert=self._ca_cert, cert_pem=self._cert_pem, key=self.key, ca_file=self._ca_file
        )

    async def send(
        self, method: str, path: str, query: Mapping[str, str] | None, body: Any, token: str | None
    ) -> tuple[int, Any]:
        """One HTTP exchange: (status, decoded JSON or None). Transport failures become errors."""
        conn = self._conn
        if conn is None:
            raise ConfigError("CONFIG_ERROR", "this client is closed")
        target = path + _query(query)
        headers = {"Accept": "application/json", AGENT_HEADER: self._agent_id}
        if self.host_header is not None:
            headers["Host"] = self.host_header
        if token is not None:
            if self.mode == "dpop":
                assert self.key is not None
                headers["Authorization"] = f"DPoP {token}"
                # RFC 9449 §4.2: htu is the URL the request is addressed to, without query/fragment.
                headers["DPoP"] = make_dpop_proof(
                    self.key, method=method, url=self.public + path, access_token=token, now=time.time()
                )
            else:
                headers["Authorization"] = f"Bearer {token}"
        data: bytes | None = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn.inflight += 1
        try:
            async with conn.session.request(
                method, URL(self.base + target, encoded=True), headers=headers, data=data, allow_redirects=False
            ) as resp:
                status = resp.status
                raw = await self._read_capped(resp)
        except UompClientError:
            raise
        except aiohttp.ClientConnectorCertificateError as exc:
            raise CertificateError(
                "SERVER_CERT_INVALID",
                "the gateway's certificate did not verify against the "
                f"trusted CA or does not match the host name ({describe(exc)})",
                None,
                self._session_id,
            ) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise Unavailable(
                "TIMEOUT", f"no answer from the gateway within {self._opts.timeout_seconds:g} s", None, self._session_id
            ) from exc
        except aiohttp.ClientError as exc:
            # A refused client certificate: TLS 1.3 finishes the client's side of the handshake before
            # the server checks the certificate, so the refusal arrives as an alert or a closed/reset
            # connection on the first read (aiohttp already retried idempotent calls once on a fresh
            # connection). Connection refused / DNS failures are ClientConnectorError: unavailable.
            closed = (
                not isinstance(exc, aiohttp.ClientConnectorError)
                and isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)
                and not ssl_in_chain(exc)
            )
            # A plain close is also what a gateway that stopped or restarted mid-request looks like:
            # one fresh handshake tells the two apart (refused again, or the gateway is fine / down).
            refused = self.mode == "mtls" and closed and not await self._handshake_ok()
            if closed and not refused:
                raise Unavailable(
                    "CONNECTION_CLOSED",
                    f"the gateway closed the connection before answering (it stopped or restarted; {describe(exc)})",
                    None,
                    self._session_id,
                ) from exc
            if ssl_in_chain(exc) or refused:
                raise CertificateError(
                    "TLS_HANDSHAKE_FAILED",
                    "the gateway closed the TLS connection; in mTLS this "
                    "is how it refuses a client certificate that is revoked, expired or not from "
                    f"the user's CA ({describe(exc)})",
                    None,
                    self._session_id,
                ) from exc
            raise Unavailable(
                "CONNECTION_FAILED", f"cannot reach the gateway ({describe(exc)})", None, self._session_id
            ) from exc
        finally:
            await conn.release()
        if 300 <= status < 400:
            raise ProtocolError(
                "BAD_RESPONSE",
                f"the gateway answered a redirect (HTTP {status}); not followed",
                status,
                self._session_id,
            )
        if not raw:
            return status, None
        try:
            return status, json.loads(raw)
        except ValueError:
            if status >= 400:
                return status, None
            raise ProtocolError("BAD_RESPONSE", "the gateway's answer is not JSON", status, self._session_id) from None

    async def _handshake_ok(self) -> bool:
        """After a closed connection in mTLS: does a fresh handshake with our certificate hold (or is
        the gateway simply not there)? False when it is refused again: a certificate refusal."""
        o = self._opts
        timeout = aiohttp.ClientTimeout(total=o.connect_timeout_seconds * 2, connect=o.connect_timeout_seconds)
        headers = {"Host": self.host_header} if self.host_header is not None else None
        try:
            async with (
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(ssl=self._ssl_context(), force_close=True),
                    timeout=timeout,
                    cookie_jar=aiohttp.DummyCookieJar(),
                    trust_env=False,
                ) as probe,
                probe.get(URL(self.base + "/v1/health", encoded=True), headers=headers, allow_redirects=False) as resp,
            ):
                await resp.read()
                return True
        except aiohttp.ClientConnectorCertificateError:
            return False
        except aiohttp.ClientConnectorError as exc:
            return not ssl_in_chain(exc)  # not listening (stopped, restarting): a closed connection
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _read_capped(self, resp: aiohttp.ClientResponse) -> bytes:
        limit = self._opts.max_response_bytes
        if resp.content_length is not None and resp.content_length > limit:
            raise ProtocolError(
                "RESPONSE_TOO_LARGE", f"the answer exceeds {limit} bytes", resp.status, self._session_id
            )
        chunks: list[bytes] = []
        total = 0
        async for chunk in resp.content.iter_chunked(READ_CHUNK):
            total += len(chunk)
            if total > limit:
                resp.close()
                raise ProtocolError(
                    "RESPONSE_TOO_LARGE", f"the answer exceeds {limit} bytes", resp.status, self._session_id
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def send_stream(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None,
        env: Envelope,
        body: AsyncIterator[bytes | memoryview],
        token: str,
    ) -> tuple[int, Any]:
        """The streaming form of an upload (its own exchange: a body streamed, a longer time-out):
        ``env`` in its header, ``body`` the sealed bytes (then their SHA-256 when ``env``'s hash is
        the trailer); (status, decoded JSON or None)."""
        conn = self._conn
        if conn is None:
            raise ConfigError("CONFIG_ERROR", "this client is closed")
        length = env.size + (TRAILER_LEN if env.trailer else 0)
        headers = {
            "Accept": "application/json",
            AGENT_HEADER: self._agent_id,
            "Content-Type": "application/octet-stream",
            "Content-Length": str(length),
            HEADER_NAME: encode_header(env),
        }
        if self.host_header is not None:
            headers["Host"] = self.host_header
        if self.mode == "dpop":
            assert self.key is not None
            headers["Authorization"] = f"DPoP {token}"
            headers["DPoP"] = make_dpop_proof(
                self.key, method=method, url=self.public + path, access_token=token, now=time.time()
            )
        else:
            headers["Authorization"] = f"Bearer {token}"
        target = path + _query(query)
        o = self._opts
        timeout = aiohttp.ClientTimeout(
            total=o.payload_timeout_seconds,
            connect=o.connect_timeout_seconds,
            sock_connect=o.connect_timeout_seconds,
            sock_read=o.timeout_seconds,
        )
        conn.inflight += 1
        try:
            async with conn.session.request(
                method,
                URL(self.base + target, encoded=True),
                headers=headers,
                data=body,
                allow_redirects=False,
                timeout=timeout,
            ) as resp:
                status = resp.status
                raw = await self._read_capped(resp)
        except UompClientError:
            raise
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise Unavailable("TIMEOUT", "the payload upload did not finish in time", None, self._session_id) from exc
        except aiohttp.ClientError as exc:
            if ssl_in_chain(exc):
                raise CertificateError(
                    "TLS_HANDSHAKE_FAILED",
                    "the gateway refused the TLS connection (certificate "
                    f"revoked, expired or not from the user's CA?) ({describe(exc)})",
                    None,
                    self._session_id,
                ) from exc
            raise Unavailable(
                "CONNECTION_FAILED", f"the payload upload broke off ({describe(exc)})", None, self._session_id
            ) from exc
        finally:
            await conn.release()
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            answer = None
        return status, answer
