"""The Python agent SDK: read the user's memory through a UOMP gateway (spec §8, §10, §15, §19).

::

    async with UompClient.from_bundle("bundle.json") as uomp:
        item = await uomp.get("preference.theme")
        items = await uomp.by_tag("preference")

Three transports (``mode``):

``"mtls"`` (default for a bundle with a certificate and key)
    TLS 1.3 to the gateway's mTLS listener with the agent's client certificate on every
    connection. The gateway's certificate is verified against the CA in the bundle and nothing
    else (no system roots), with the host name checked (:func:`gateway.client.tls.build_client_context`).
    There is no switch to turn verification off. Tokens go as ``Authorization: Bearer``; the
    gateway checks they are bound to this certificate (RFC 8705 ``cnf``).
``"dpop"`` (for the Cloudflare quick-tunnel URL)
    TLS ends at the tunnel's edge, so no client certificate can reach the gateway. Instead every
    request carries an RFC 9449 DPoP proof signed by the agent key from the bundle (``htm``,
    ``htu``, ``iat``, ``ath``, a fresh ``jti``) and ``Authorization: DPoP <token>``. The server
    certificate is verified against the system trust store (or ``ca_file``), TLS 1.3 only.
``"bearer"`` (Local Profile, :meth:`UompClient.from_env`)
    ``UOM_TOKEN`` as ``Authorization: Bearer`` to the local guard (``http://127.0.0.1:9374``).

Plain ``http://`` is accepted only when the host is a loopback address (``127.0.0.0/8``, ``::1``)
or ``localhost``: the Local Profile, and the tunnel-origin listener that ``cloudflared`` (running
on the gateway's host) forwards to. Any other ``http://`` URL is refused; mTLS is https only.

``public_url`` (DPoP mode): the URL the agent addresses as the world sees it, used for the
proof's ``htu`` and the ``Host`` header, apart from the address the client connects to. This is
what ``cloudflared`` does: the agent asks ``https://xxx.trycloudflare.com/v1/memory/k``,
Cloudflare forwards it over the tunnel and ``cloudflared`` hands it to the loopback origin
(``http://127.0.0.1:<port>``) with ``Host: xxx.trycloudflare.com`` unchanged, so the gateway
checks the proof against the public URL. Connecting straight to the origin
(``base_url="http://127.0.0.1:PORT"``) with ``public_url`` set (by default the bundle's
``gateway_url``) reproduces those requests byte for byte, which is how the tests run.

Tokens (§15.5): the access token is refreshed before it expires (when less than
``refresh_before_seconds`` or ``refresh_before_fraction`` of its life remains) and once more when
the gateway answers ``TOKEN_EXPIRED`` (the request is then retried once). Refresh tokens rotate on
every use and a spent one presented again revokes the session, so: concurrent calls share ONE
refresh (an ``asyncio.Lock``, plus an ``flock`` on ``<bundle>.lock`` across processes), and the
rotated pair is written back to the bundle file (atomically, 0600) before the call returns; a
restarted agent then starts from the live refresh token, never from a spent one. Use one bundle
per agent instance; processes sharing one take turns through the lock and adopt what the other
wrote.

Certificates (mTLS): once ``renew_at_fraction`` (2/3) of the certificate's life has passed, the
next call first renews it over ``POST /v1/certificates/renew`` (same key), writes it to the bundle
(``agent_cert``) and moves new connections to it (connections in flight finish on the old one).
An expired certificate cannot be renewed (the renewal is authenticated by the certificate
itself): the call fails with :class:`CertificateError` ``CERT_EXPIRED`` and the user must issue a
new one. The gateway renews only in the last third of a certificate's life (``RENEWAL_TOO_EARLY``
before; ``renew_at_fraction`` must stay >= 2/3) and a few times per hour per agent (``RATE_LIMITED``).
:meth:`UompClient.renew_certificate` with ``csr_key`` rotates the key (the new key is then
stored in the bundle, ``agent_key``); note that tokens are bound to the key they were granted for,
so after a key rotation the user must authorize the agent again.

Bounded: every call has a total time-out and a connect time-out, answers are read up to
``max_response_bytes``, redirects are not followed (they would carry the token elsewhere).

Secrets: no token or key appears in a log line, an exception or a ``repr``. The SDK logs to the
``uomp.client`` logger (refreshes, renewals, session ids; never tokens, keys or memory values).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import ssl
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote, urlsplit

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from yarl import URL

from gateway.bundle import AgentBundle, load_bundle, write_bundle
from gateway.client import payloads
from gateway.client.errors import (
    AuthError,
    CertificateError,
    ConfigError,
    ProtocolError,
    Unavailable,
    UompClientError,
    error_from_answer,
)
from gateway.client.tls import build_client_context
from gateway.core import ca, jose
from gateway.core.canonical import canonical_json
from gateway.core.deletion import sign_deletion_proof
from gateway.core.dpop import make_dpop_proof
from gateway.core.envelope import HEADER_NAME, encode_header, parse_public_key
from gateway.core.sealing import Binding
from gateway.core.tokens import iso, parse_iso
from gateway.errors import UompError

log = logging.getLogger("uomp.client")

Mode = Literal["mtls", "dpop", "bearer"]
AgentKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
JSONObject = dict[str, Any]

AGENT_HEADER = "X-UOMP-Agent-Id"
LOCAL_BASE_URL = "http://127.0.0.1:9374"
# Characters left unescaped in a path segment: the gateway's canonical spelling (pathnorm.SEGMENT_SAFE).
SEGMENT_SAFE = "!$&'()*+,;=:@-._~"
AGGREGATE_OPS = ("sum", "avg", "count", "min", "max")
READ_CHUNK = 64 * 1024
# A refresh that got no answer is tried again on these (see _post_refresh).
RETRY_REFRESH_CODES = ("TIMEOUT", "CONNECTION_FAILED", "CONNECTION_CLOSED")
RETRY_REFRESH_STATUSES = (502, 503, 504)
# Recently held tokens, scrubbed from any message the gateway sends back.
REMEMBERED_SECRETS = 8


@dataclass(frozen=True)
class ClientOptions:
    """Limits and schedules, each with its unit."""

    timeout_seconds: float = 30.0  # one call, from connecting to the last byte of the answer
    connect_timeout_seconds: float = 10.0  # TCP connect + TLS handshake
    max_response_bytes: int = 8 * 1024 * 1024  # answers larger than this are refused (RESPONSE_TOO_LARGE)
    refresh_before_seconds: float = 60.0  # refresh when less than this is left of the access token ...
    refresh_before_fraction: float = 0.2  # ... or less than this share of its life (never more than half)
    renew_at_fraction: float = 2 / 3  # renew the certificate once this share of its life has passed
    renew_retry_seconds: float = 60.0  # after a failed automatic renewal, wait this long before the next try
    lock_timeout_seconds: float = 30.0  # wait at most this long for another process refreshing the bundle
    max_connections: int = 16  # connection pool size
    refresh_retry_attempts: int = 6  # a refresh that got no answer (closed, timed out, 502/503/504) is tried again
    refresh_retry_initial_seconds: float = 0.5  # first back-off, doubled after each try ...
    refresh_retry_max_seconds: float = 8.0  # ... up to this (a spent token may be retried: see README "Refresh")
    payload_timeout_seconds: float = 1800.0  # one streamed payload upload, start to answer

    def __post_init__(self) -> None:
        if self.timeout_seconds <= 0 or self.connect_timeout_seconds <= 0 or self.max_response_bytes <= 0:
            raise ConfigError("CONFIG_ERROR", "time-outs and the response size limit must be positive")
        if not 0 < self.renew_at_fraction < 1 or not 0 <= self.refresh_before_fraction < 1:
            raise ConfigError("CONFIG_ERROR", "renew_at_fraction and refresh_before_fraction must lie in (0, 1)")
        if self.refresh_retry_attempts < 1 or not 0 <= self.refresh_retry_initial_seconds <= \
                self.refresh_retry_max_seconds:
            raise ConfigError("CONFIG_ERROR", "refresh_retry_attempts must be >= 1 and the back-off "
                              "0 <= initial <= max")


@dataclass(frozen=True)
class RenewedCertificate:
    """What :meth:`UompClient.renew_certificate` got (public facts only)."""

    serial: str
    not_after: dt.datetime
    certificate: str  # PEM
    new_key: bool


def memory_hash(items: Iterable[Mapping[str, Any]]) -> str:
    """``sha256:<hex>`` over the keys and values the agent read, for a deletion proof (§19.3).

    The spec says "SHA-256 of all accessed memory item keys concatenated with their values"; this
    SDK makes that unambiguous as SHA-256 of the RFC 8785 canonical JSON of ``[[key, value], ...]``
    sorted by key (one entry per key). Anyone holding the same items computes the same hash.
    """
    pairs: dict[str, Any] = {}
    for item in items:
        key = item.get("key")
        if not isinstance(key, str):
            raise ValueError("every item needs a string 'key'")
        pairs[key] = item.get("value")
    doc = [[k, pairs[k]] for k in sorted(pairs)]
    return "sha256:" + hashlib.sha256(canonical_json(doc)).hexdigest()


# ------------------------------------------------------------------------------- helpers


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_url(url: str, what: str, *, allow_loopback_http: bool) -> str:
    """``url`` without a trailing slash, or ConfigError. https always; http only for loopback hosts."""
    if not isinstance(url, str) or not url or len(url) > 2048:
        raise ConfigError("CONFIG_ERROR", f"{what} is missing or too long")
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise ConfigError("CONFIG_ERROR", f"{what} is not a valid URL") from exc
    scheme = parts.scheme.lower()
    host = parts.hostname or ""
    if not host or "@" in parts.netloc or parts.query or parts.fragment:
        raise ConfigError("CONFIG_ERROR", f"{what} must be scheme://host[:port][/path] with no user, query or "
                          "fragment")
    if scheme == "http":
        if not allow_loopback_http:
            raise ConfigError("CONFIG_ERROR", f"{what} must be https:// in this mode")
        if not _is_loopback(host):
            raise ConfigError("CONFIG_ERROR", f"{what}: plain http:// is allowed only for loopback addresses "
                              "(127.0.0.1, ::1, localhost); use https://")
    elif scheme != "https":
        raise ConfigError("CONFIG_ERROR", f"{what} must be an https:// URL")
    return url.strip().rstrip("/")


def _token_claims(token: str) -> JSONObject:
    """The claims of a compact JWS, NOT verified: only for scheduling and ids (the gateway verifies)."""
    try:
        return dict(jose.parse_compact(token).payload)
    except UompError:
        return {}


def _iso_ts(value: Any) -> float | None:
    try:
        return parse_iso(value)
    except (ValueError, OverflowError, TypeError):
        return None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _spki(key: Any) -> bytes:
    return bytes(key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))


def _load_key_pem(data: bytes, what: str) -> AgentKey:
    try:
        return ca.load_private_key(data)
    except (ValueError, TypeError) as exc:
        raise ConfigError("CONFIG_ERROR", f"{what} is not a P-256 or Ed25519 PEM private key") from exc


def _bundle_key(bundle: AgentBundle, bundle_path: Path) -> AgentKey | None:
    if bundle.agent_key:
        return _load_key_pem(bundle.agent_key.encode(), "the bundle's agent_key")
    if not bundle.agent_key_file:
        return None
    path = Path(bundle.agent_key_file).expanduser()
    if not path.is_absolute():
        path = bundle_path.parent / path
    try:
        if path.stat().st_mode & 0o077:
            raise ConfigError("CONFIG_ERROR", f"{path} holds the agent key and must not be readable by others; "
                              "chmod 600 it")
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError("CONFIG_ERROR", f"cannot read the agent key file {path}: {exc.strerror}") from exc
    return _load_key_pem(data, f"{path}")


def _describe(exc: BaseException) -> str:
    """A short reason for a transport failure (type and SSL reason; never headers or tokens)."""
    seen: list[str] = []
    cur: BaseException | None = exc
    for _ in range(4):
        if cur is None:
            break
        reason = getattr(cur, "reason", None) if isinstance(cur, ssl.SSLError) else None
        seen.append(f"{type(cur).__name__}" + (f" {reason}" if isinstance(reason, str) else ""))
        nxt = getattr(cur, "os_error", None) or cur.__cause__ or cur.__context__
        cur = nxt if isinstance(nxt, BaseException) and nxt is not cur else None
    return ", ".join(seen)


def _ssl_in_chain(exc: BaseException) -> bool:
    cur: BaseException | None = exc
    for _ in range(6):
        if cur is None:
            return False
        if isinstance(cur, ssl.SSLError | aiohttp.ClientSSLError):
            return True
        nxt = getattr(cur, "os_error", None) or cur.__cause__ or cur.__context__
        cur = nxt if isinstance(nxt, BaseException) and nxt is not cur else None
    return False


class _Conn:
    """One aiohttp session (one SSL context); retired sessions close when their last call ends."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self.inflight = 0
        self.retired = False

    async def release(self) -> None:
        self.inflight -= 1
        if self.retired and self.inflight == 0 and not self.session.closed:
            await self.session.close()


# ------------------------------------------------------------------------------- the client


class UompClient:
    """An async UOMP client for one session of one agent. See the module docstring.

    Build it with :meth:`from_bundle` (Remote Profile) or :meth:`from_env`; the constructor is the
    low-level form both use. Use ``async with client:`` (or call :meth:`aclose`).
    """

    def __init__(
        self,
        *,
        agent_id: str,
        session_id: str,
        access_token: str,
        base_url: str,
        access_expires_at: str | float | None = None,
        refresh_token: str | None = None,
        refresh_expires_at: str | float | None = None,
        mode: Mode = "bearer",
        ca_cert: str | None = None,
        agent_cert: str | None = None,
        agent_key: AgentKey | None = None,
        bundle: AgentBundle | None = None,
        bundle_path: str | os.PathLike[str] | None = None,
        public_url: str | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        options: ClientOptions | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if mode not in ("mtls", "dpop", "bearer"):
            raise ConfigError("CONFIG_ERROR", "mode must be mtls, dpop or bearer")
        if not agent_id or not session_id or not access_token:
            raise ConfigError("CONFIG_ERROR", "agent_id, session_id and an access token are required")
        self._mode: Mode = mode
        self._agent_id = agent_id
        self._session_id = session_id
        self._opts = options or ClientOptions()
        self._clock = clock
        self._base = _check_url(base_url, "base_url", allow_loopback_http=mode != "mtls")
        self._ca_file = Path(ca_file) if ca_file is not None else None
        self._ca_cert = ca_cert
        self._key: AgentKey | None = agent_key
        self._bundle = bundle
        self._bundle_path = Path(bundle_path) if bundle_path is not None else None
        if self._bundle_path is not None and self._bundle is None:
            raise ConfigError("CONFIG_ERROR", "bundle_path needs the bundle it was loaded from")
        self._cert: x509.Certificate | None = None
        self._cert_pem: str | None = None
        self._renew_at = float("inf")
        self._renew_blocked_until = 0.0

        # where requests are addressed (DPoP htu, Host) vs where the client connects
        base_parts = urlsplit(self._base)
        self._public = self._base
        self._host_header: str | None = None
        if public_url is not None and mode != "dpop":
            raise ConfigError("CONFIG_ERROR", "public_url is for DPoP mode (a tunnel origin) only")
        if mode == "dpop":
            if agent_key is None:
                raise ConfigError("CONFIG_ERROR", "DPoP mode needs the agent key (bundle agent_key or agent_key_file)")
            if public_url is not None:
                self._public = _check_url(public_url, "public_url", allow_loopback_http=False)
            elif base_parts.scheme == "http":
                raise ConfigError("CONFIG_ERROR", "DPoP to a loopback http:// origin needs public_url: the https:// "
                                  "URL cloudflared serves (proofs are checked against it)")
            pub_parts = urlsplit(self._public)
            if self._public != self._base:
                if base_parts.scheme != "http":
                    raise ConfigError("CONFIG_ERROR", "public_url may differ from base_url only when base_url is the "
                                      "loopback tunnel origin (http://127.0.0.1:PORT)")
                if pub_parts.path.rstrip("/") != base_parts.path.rstrip("/"):
                    raise ConfigError("CONFIG_ERROR", "public_url and base_url must have the same path")
                self._host_header = pub_parts.netloc
        if ca_file is not None and mode == "mtls":
            raise ConfigError("CONFIG_ERROR", "mTLS trusts the CA in the bundle only; ca_file is for dpop/bearer")
        if mode == "mtls":
            if not ca_cert or not agent_cert or agent_key is None:
                raise ConfigError("CONFIG_ERROR", "mTLS needs the CA certificate, the agent certificate and its key")
            self._set_certificate(agent_cert, agent_key)

        # tokens
        self._access_token = access_token
        self._access_exp, self._access_iat = self._token_times(access_token, access_expires_at)
        self._refresh_token = refresh_token
        self._refresh_exp: float | None = None
        if refresh_token:
            self._refresh_exp = (_iso_ts(refresh_expires_at) if isinstance(refresh_expires_at, str)
                                 else _num(refresh_expires_at)) or _num(_token_claims(refresh_token).get("exp"))
        self._recent: deque[str] = deque(maxlen=REMEMBERED_SECRETS)
        self._remember(access_token, refresh_token)

        self._refresh_lock = asyncio.Lock()
        self._cert_lock = asyncio.Lock()
        self._open_lock = asyncio.Lock()
        self._conn: _Conn | None = None
        self._retired: list[_Conn] = []
        self._closed = False
        self.refresh_count = 0  # rotations done by this client (for monitoring and tests)

    # ----------------------------------------------------------------------- constructors

    @classmethod
    def from_bundle(
        cls,
        path: str | os.PathLike[str],
        *,
        mode: Literal["auto", "mtls", "dpop"] = "auto",
        base_url: str | None = None,
        public_url: str | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        options: ClientOptions | None = None,
        clock: Callable[[], float] = time.time,
    ) -> UompClient:
        """A client from the agent bundle ``uomp authorize --remote`` wrote (mode 0600).

        ``mode="auto"``: mTLS (the bundle has a certificate and key). ``mode="dpop"``: through the
        tunnel; ``base_url`` then defaults to the bundle's ``gateway_url`` (the tunnel URL), and when
        ``base_url`` is the loopback origin ``public_url`` defaults to the bundle's ``gateway_url``.
        Rotated tokens and renewed certificates are written back to ``path``.
        """
        p = Path(path)
        try:
            bundle = load_bundle(p)
        except UompError as exc:
            raise ConfigError("CONFIG_ERROR", exc.message) from None
        key = _bundle_key(bundle, p)
        chosen: Mode
        if mode == "auto":
            if not bundle.agent_cert or key is None:
                raise ConfigError("CONFIG_ERROR", "the bundle has no agent certificate and key for mTLS (made with "
                                  "--cert?); add agent_key_file or use mode='dpop'")
            chosen = "mtls"
        elif mode in ("mtls", "dpop"):
            chosen = mode
        else:
            raise ConfigError("CONFIG_ERROR", "mode must be auto, mtls or dpop")
        base = base_url or bundle.gateway_url
        if chosen == "dpop" and public_url is None and urlsplit(base).scheme == "http":
            public_url = bundle.gateway_url
        return cls(agent_id=bundle.agent_id, session_id=bundle.session_id, access_token=bundle.access_token,
                   access_expires_at=bundle.access_expires_at, refresh_token=bundle.refresh_token,
                   refresh_expires_at=bundle.refresh_expires_at, base_url=base, mode=chosen,
                   ca_cert=bundle.ca_cert, agent_cert=bundle.agent_cert, agent_key=key, bundle=bundle,
                   bundle_path=p, public_url=public_url, ca_file=ca_file, options=options, clock=clock)

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        options: ClientOptions | None = None,
        clock: Callable[[], float] = time.time,
    ) -> UompClient:
        """``UOMP_BUNDLE`` set: :meth:`from_bundle` (``UOMP_BASE_URL`` overrides its URL, ``UOMP_MODE``
        = ``auto``/``mtls``/``dpop`` picks the transport). Otherwise the Local Profile: ``UOM_TOKEN`` as
        a bearer token to ``UOMP_BASE_URL`` (default ``http://127.0.0.1:9374``), no refresh, no client
        certificate."""
        values = os.environ if env is None else env
        bundle = values.get("UOMP_BUNDLE")
        base = values.get("UOMP_BASE_URL") or None
        if bundle:
            modes: dict[str, Literal["auto", "mtls", "dpop"]] = {"auto": "auto", "mtls": "mtls", "dpop": "dpop"}
            mode = modes.get(values.get("UOMP_MODE") or "auto")
            if mode is None:
                raise ConfigError("CONFIG_ERROR", "UOMP_MODE must be auto, mtls or dpop")
            return cls.from_bundle(bundle, mode=mode, base_url=base, options=options, clock=clock)
        token = values.get("UOM_TOKEN", "").strip()
        if not token:
            raise ConfigError("CONFIG_ERROR", "set UOM_TOKEN (and UOMP_BASE_URL), or UOMP_BUNDLE")
        claims = _token_claims(token)
        agent_id, session_id = claims.get("agent_id"), claims.get("session_id")
        if not isinstance(agent_id, str) or not isinstance(session_id, str):
            raise ConfigError("CONFIG_ERROR", "UOM_TOKEN is not a UOMP capability token")
        return cls(agent_id=agent_id, session_id=session_id, access_token=token, base_url=base or LOCAL_BASE_URL,
                   mode="bearer", options=options, clock=clock)

    # ------------------------------------------------------------------------- properties

    @property
    def agent_id(self) -> str:
        return self._agent_id

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def base_url(self) -> str:
        return self._base

    @property
    def public_url(self) -> str:
        return self._public

    @property
    def access_expires_at(self) -> float:
        """When the current access token expires (seconds since the epoch)."""
        return self._access_exp

    @property
    def certificate_serial(self) -> str | None:
        return ca.serial_hex(self._cert.serial_number) if self._cert is not None else None

    @property
    def certificate_not_after(self) -> dt.datetime | None:
        return self._cert.not_valid_after_utc if self._cert is not None else None

    def __repr__(self) -> str:
        return (f"UompClient(agent_id={self._agent_id!r}, session_id={self._session_id!r}, mode={self._mode!r}, "
                f"base_url={self._base!r}, tokens=<redacted>)")

    __str__ = __repr__

    # ------------------------------------------------------------------------ life cycle

    async def __aenter__(self) -> UompClient:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

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

    def _new_conn(self) -> _Conn:
        o = self._opts
        connector = aiohttp.TCPConnector(ssl=self._ssl_context(), limit=o.max_connections)
        timeout = aiohttp.ClientTimeout(total=o.timeout_seconds, connect=o.connect_timeout_seconds,
                                        sock_connect=o.connect_timeout_seconds, sock_read=o.timeout_seconds)
        session = aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar(),
                                        trust_env=False, raise_for_status=False)
        return _Conn(session)

    def _ssl_context(self) -> ssl.SSLContext:
        if self._mode == "mtls":
            assert self._ca_cert is not None and self._cert_pem is not None and self._key is not None
            # ssl loads certificates and keys from files only: a private directory (0700) that lives
            # for the duration of this call, the key file 0600.
            with tempfile.TemporaryDirectory(prefix="uomp-sdk-") as d:
                ca_f, cert_f, key_f = Path(d, "ca.crt"), Path(d, "agent.crt"), Path(d, "agent.key")
                ca_f.write_text(self._ca_cert)
                cert_f.write_text(self._cert_pem)
                fd = os.open(key_f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(ca.key_pem(self._key))
                try:
                    return build_client_context(ca_f, cert_f, key_f)
                except (ssl.SSLError, ValueError) as exc:
                    raise ConfigError("CONFIG_ERROR", "the bundle's CA, certificate or key cannot be loaded "
                                      f"({_describe(exc)})") from None
        if self._ca_file is not None:
            try:
                return build_client_context(self._ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError("CONFIG_ERROR", f"cannot load ca_file {self._ca_file} ({_describe(exc)})") from None
        # dpop through a public tunnel / bearer over https: the system trust store, TLS 1.3 (spec §15.2).
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        return ctx

    # -------------------------------------------------------------------------- the API

    async def get(self, key: str) -> JSONObject:
        """§10.2 ``GET /v1/memory/{key}``: one Memory Item."""
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty string")
        return self._object(await self._call("GET", "/v1/memory/" + quote(key, safe=SEGMENT_SAFE)))

    async def by_tag(self, tag: str) -> list[JSONObject]:
        """§10.3 ``GET /v1/memory?tag=``: every item with ``tag`` the grant lets through, following
        the pages' ``next`` cursors (one read query per page). For large tags use
        :meth:`iter_by_tag` (one page in memory) or :meth:`by_tag_page`."""
        return [item async for item in self.iter_by_tag(tag)]

    async def iter_by_tag(self, tag: str, *, limit: int | None = None) -> AsyncIterator[JSONObject]:
        """The items of :meth:`by_tag`, fetched a page (at most ``limit`` items) at a time."""
        cursor: str | None = None
        while True:
            items, nxt = await self.by_tag_page(tag, cursor=cursor, limit=limit)
            if nxt is not None and (nxt == cursor or not items):
                raise ProtocolError("BAD_RESPONSE", "the gateway's paging does not advance")
            for item in items:
                yield item
            if nxt is None:
                return
            cursor = nxt

    async def by_tag_page(self, tag: str, *, cursor: str | None = None, limit: int | None = None
                          ) -> tuple[list[JSONObject], str | None]:
        """One page: its items and the opaque cursor of the next page (None after the last one)."""
        query = {"tag": tag}
        if cursor is not None:
            query["cursor"] = cursor
        if limit is not None:
            query["limit"] = str(int(limit))
        answer = self._object(await self._call("GET", "/v1/memory", query=query))
        nxt = answer.get("next")
        if nxt is not None and (not isinstance(nxt, str) or not nxt):
            raise ProtocolError("BAD_RESPONSE", "the gateway's answer has a malformed 'next' cursor")
        return self._list(answer, "items"), nxt

    async def aggregate(self, tag: str, op: str, field: str | None = None) -> JSONObject:
        """§10.5 ``GET /v1/memory/aggregate``: ``{"op", "result", ...}``, never item values."""
        if op not in AGGREGATE_OPS:
            raise ValueError(f"op must be one of {', '.join(AGGREGATE_OPS)}")
        query = {"tag": tag, "op": op}
        if field is not None:
            query["field"] = field
        return self._object(await self._call("GET", "/v1/memory/aggregate", query=query))

    async def audit(self, limit: int | None = None) -> list[JSONObject]:
        """§18 ``GET /v1/audit``: this session's audit entries (newest first, ``limit`` 1-1000)."""
        query = {"session_id": self._session_id}
        if limit is not None:
            query["limit"] = str(int(limit))
        return self._list(self._object(await self._call("GET", "/v1/audit", query=query)), "logs")

    async def submit_deletion_proof(
        self,
        *,
        identity_key: ed25519.Ed25519PrivateKey,
        memory_hash: str,
        fields_accessed: Sequence[str] | None,
        method: str,
        deletion_proof_id: str | None = None,
        deleted_at: str | dt.datetime | None = None,
    ) -> JSONObject:
        """§19.3/§19.4: sign and submit a deletion proof for this session.

        ``identity_key`` is the Ed25519 key of the ``did:key`` that signed the agent's ``uom.json``
        (the Auth Service verifies against it); ``memory_hash`` e.g. from :func:`memory_hash`;
        ``method`` must be the manifest's ``deletion_method``. Answers
        ``{"status": "accepted", "deletion_proof_id"}``; a task-bound session closes.
        """
        if deleted_at is None:
            when = iso(time.time())
        elif isinstance(deleted_at, dt.datetime):
            when = deleted_at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        else:
            when = deleted_at
        fields: JSONObject = {
            "deletion_proof_id": deletion_proof_id or f"del_{secrets.token_hex(12)}",
            "session_id": self._session_id,
            "agent_id": self._agent_id,
            "deleted_at": when,
            "memory_hash": memory_hash,
            "method": method,
        }
        if fields_accessed is not None:
            fields["fields_accessed"] = list(fields_accessed)
        proof = sign_deletion_proof(fields, identity_key)
        path = f"/v1/sessions/{quote(self._session_id, safe=SEGMENT_SAFE)}/deletion-proof"
        return self._object(await self._call("POST", path, body=proof))

    async def upload_payload(self, data: bytes | os.PathLike[str], *, format: str, presigned: bool = False) -> str:
        """§15.6: seal ``data`` to the user's payload key (the bundle's ``payload_public_key``) and upload
        it; returns the ``payload_id``. Only the user can open it (``uomp payload pull``).

        ``bytes`` up to :data:`gateway.client.payloads.JSON_MAX_SEALED` go as the JSON envelope; a
        path (or larger bytes) is sealed into a private temporary file first and streamed from it, so
        memory stays constant. ``presigned``: ask for a single-use upload URL first and upload to it.
        Refusals raise the usual errors (``PAYLOAD_TOO_LARGE``, ``PAYLOAD_QUOTA_EXCEEDED`` ...); the
        gateway checked the hash it answers against ours (:class:`ProtocolError` if not).
        """
        payloads.check_format(format)
        key_text = self._bundle.payload_public_key if self._bundle is not None else None
        if not key_text:
            raise ConfigError("CONFIG_ERROR", "the bundle has no payload_public_key (it predates payloads): ask the "
                              "user to authorize the agent again", None, self._session_id)
        try:
            recipient = parse_public_key(key_text)
        except ValueError:
            raise ConfigError("CONFIG_ERROR", "the bundle's payload_public_key is not an X25519 key", None,
                              self._session_id) from None
        binding = Binding(payloads.new_payload_id(), self._session_id, self._agent_id, format)
        if isinstance(data, bytes | bytearray) and not presigned and len(data) <= payloads.JSON_MAX_SEALED - 256:
            doc = await asyncio.to_thread(payloads.seal_small, recipient, binding, bytes(data))
            answer = self._object(await self._call("POST", "/v1/payload/upload", body=doc))
            return self._payload_answer(answer, binding.payload_id, str(doc["hash"]))
        sealed = await asyncio.to_thread(payloads.seal_to_file, recipient, binding,
                                         data if isinstance(data, bytes | bytearray) else Path(data))
        try:
            path, query, method = "/v1/payload/upload", None, "POST"
            if presigned:
                grant = self._object(await self._call("POST", "/v1/payload/upload-url",
                                                      body={"size": sealed.envelope.size}))
                url = grant.get("upload_url")
                token = urlsplit(url).query.partition("t=")[2] if isinstance(url, str) else ""
                if not token:
                    raise ProtocolError("BAD_RESPONSE", "the upload-url answer has no upload_url", None,
                                        self._session_id)
                path, query, method = "/v1/payload/presigned", {"t": token}, "PUT"
            answer = self._object(await self._stream_payload(method, path, query, sealed))
            return self._payload_answer(answer, binding.payload_id, sealed.envelope.hash)
        finally:
            await asyncio.to_thread(sealed.remove)

    def _payload_answer(self, answer: JSONObject, payload_id: str, digest: str) -> str:
        if answer.get("payload_id") != payload_id or answer.get("hash") != digest:
            raise ProtocolError("BAD_RESPONSE", "the gateway's answer does not name the payload and hash sent",
                                None, self._session_id)
        return payload_id

    async def _stream_payload(self, method: str, path: str, query: Mapping[str, str] | None,
                              sealed: payloads.SealedFile, *, retried: bool = False) -> Any:
        """The streaming form of an upload (its own exchange: a body from a file, a longer time-out)."""
        await self.open()
        if self._mode == "mtls":
            await self._ensure_certificate()
        if self._refresh_token and self._refresh_due():
            await self._refresh(stale=None, force=False)
        conn = self._conn
        if conn is None:
            raise ConfigError("CONFIG_ERROR", "this client is closed")
        token = self._access_token
        headers = {"Accept": "application/json", AGENT_HEADER: self._agent_id,
                   "Content-Type": "application/octet-stream", "Content-Length": str(sealed.envelope.size),
                   HEADER_NAME: encode_header(sealed.envelope)}
        if self._host_header is not None:
            headers["Host"] = self._host_header
        if self._mode == "dpop":
            assert self._key is not None
            headers["Authorization"] = f"DPoP {token}"
            headers["DPoP"] = make_dpop_proof(self._key, method=method, url=self._public + path, access_token=token,
                                              now=time.time())
        else:
            headers["Authorization"] = f"Bearer {token}"
        target = path + ("?" + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query.items())
                         if query else "")

        async def body() -> AsyncIterator[bytes]:
            fh = await asyncio.to_thread(open, sealed.path, "rb")
            try:
                while block := await asyncio.to_thread(fh.read, payloads.READ_BLOCK):
                    yield block
            finally:
                await asyncio.to_thread(fh.close)

        o = self._opts
        timeout = aiohttp.ClientTimeout(total=o.payload_timeout_seconds, connect=o.connect_timeout_seconds,
                                        sock_connect=o.connect_timeout_seconds, sock_read=o.timeout_seconds)
        conn.inflight += 1
        try:
            async with conn.session.request(method, URL(self._base + target, encoded=True), headers=headers,
                                            data=body(), allow_redirects=False, timeout=timeout) as resp:
                status = resp.status
                raw = await self._read_capped(resp)
        except UompClientError:
            raise
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise Unavailable("TIMEOUT", "the payload upload did not finish in time", None,
                              self._session_id) from exc
        except aiohttp.ClientError as exc:
            if _ssl_in_chain(exc):
                raise CertificateError("TLS_HANDSHAKE_FAILED", "the gateway refused the TLS connection (certificate "
                                       f"revoked, expired or not from the user's CA?) ({_describe(exc)})", None,
                                       self._session_id) from exc
            raise Unavailable("CONNECTION_FAILED", f"the payload upload broke off ({_describe(exc)})", None,
                              self._session_id) from exc
        finally:
            await conn.release()
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            answer = None
        if status < 300:
            if answer is None:
                raise ProtocolError("BAD_RESPONSE", "the gateway's answer is not JSON", status, self._session_id)
            return answer
        err = error_from_answer(status, answer, session_id=self._session_id, secrets=self._recent)
        if err.code == "TOKEN_EXPIRED" and not retried and self._refresh_token and query is None:
            await self._refresh(stale=token, force=True)
            return await self._stream_payload(method, path, query, sealed, retried=True)
        raise err

    async def refresh(self) -> None:
        """Rotate the tokens now (normally automatic), and save them to the bundle."""
        await self.open()
        if self._mode == "mtls":
            await self._ensure_certificate()
        await self._refresh(stale=self._access_token, force=True)

    async def renew_certificate(self, csr_key: AgentKey | None = None) -> RenewedCertificate:
        """Renew the agent certificate now (normally automatic at 2/3 of its life); mTLS only.

        Without ``csr_key`` the new certificate has the same key. With ``csr_key`` (a new P-256 or
        Ed25519 key) a CSR moves the certificate to that key, and the key is saved in the bundle;
        tokens stay bound to the old key, so the user must authorize the agent again after that.
        """
        if self._mode != "mtls":
            raise ConfigError("CONFIG_ERROR", "certificate renewal is an mTLS call (the gateway's mTLS listener)")
        await self.open()
        self._check_not_expired()
        async with self._cert_lock:
            return await self._renew(csr_key)

    # ------------------------------------------------------------------------- plumbing

    @staticmethod
    def _object(answer: Any) -> JSONObject:
        if not isinstance(answer, dict):
            raise ProtocolError("BAD_RESPONSE", "the gateway's answer is not a JSON object")
        return answer

    @staticmethod
    def _list(answer: JSONObject, name: str) -> list[JSONObject]:
        value = answer.get(name)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ProtocolError("BAD_RESPONSE", f"the gateway's answer has no '{name}' list")
        return value

    def _remember(self, *tokens: str | None) -> None:
        for t in tokens:
            if t and t not in self._recent:
                self._recent.append(t)

    def _token_times(self, token: str, expires_at: str | float | None) -> tuple[float, float | None]:
        claims = _token_claims(token)
        exp = _iso_ts(expires_at) if isinstance(expires_at, str) else _num(expires_at)
        if exp is None:
            exp = _num(claims.get("exp")) or _iso_ts(claims.get("expires_at"))
        iat = _num(claims.get("iat")) or _iso_ts(claims.get("issued_at"))
        return (exp if exp is not None else float("inf")), iat

    async def _call(self, method: str, path: str, *, query: Mapping[str, str] | None = None,
                    body: Any = None, retried: bool = False) -> Any:
        await self.open()
        if self._mode == "mtls":
            await self._ensure_certificate()
        if self._refresh_token and self._refresh_due():
            await self._refresh(stale=None, force=False)
        token = self._access_token
        status, answer = await self._send(method, path, query, body, token)
        if status < 300:
            return answer
        err = error_from_answer(status, answer, session_id=self._session_id, secrets=self._recent)
        if err.code == "TOKEN_EXPIRED" and not retried and self._refresh_token:
            log.info("access token refused as expired for session %s; refreshing and retrying once",
                     self._session_id)
            await self._refresh(stale=token, force=True)
            return await self._call(method, path, query=query, body=body, retried=True)
        raise err

    async def _send(self, method: str, path: str, query: Mapping[str, str] | None, body: Any,
                    token: str | None) -> tuple[int, Any]:
        """One HTTP exchange: (status, decoded JSON or None). Transport failures become errors."""
        conn = self._conn
        if conn is None:
            raise ConfigError("CONFIG_ERROR", "this client is closed")
        target = path
        if query:
            target += "?" + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query.items())
        headers = {"Accept": "application/json", AGENT_HEADER: self._agent_id}
        if self._host_header is not None:
            headers["Host"] = self._host_header
        if token is not None:
            if self._mode == "dpop":
                assert self._key is not None
                headers["Authorization"] = f"DPoP {token}"
                # RFC 9449 §4.2: htu is the URL the request is addressed to, without query/fragment.
                headers["DPoP"] = make_dpop_proof(self._key, method=method, url=self._public + path,
                                                  access_token=token, now=time.time())
            else:
                headers["Authorization"] = f"Bearer {token}"
        data: bytes | None = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn.inflight += 1
        try:
            async with conn.session.request(method, URL(self._base + target, encoded=True), headers=headers,
                                            data=data, allow_redirects=False) as resp:
                status = resp.status
                raw = await self._read_capped(resp)
        except UompClientError:
            raise
        except aiohttp.ClientConnectorCertificateError as exc:
            raise CertificateError("SERVER_CERT_INVALID", "the gateway's certificate did not verify against the "
                                   f"trusted CA or does not match the host name ({_describe(exc)})",
                                   None, self._session_id) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise Unavailable("TIMEOUT", f"no answer from the gateway within {self._opts.timeout_seconds:g} s",
                              None, self._session_id) from exc
        except aiohttp.ClientError as exc:
            # A refused client certificate: TLS 1.3 finishes the client's side of the handshake before
            # the server checks the certificate, so the refusal arrives as an alert or a closed/reset
            # connection on the first read (aiohttp already retried idempotent calls once on a fresh
            # connection). Connection refused / DNS failures are ClientConnectorError: unavailable.
            closed = not isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
                exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError) and not _ssl_in_chain(exc)
            # A plain close is also what a gateway that stopped or restarted mid-request looks like:
            # one fresh handshake tells the two apart (refused again, or the gateway is fine / down).
            refused = self._mode == "mtls" and closed and not await self._handshake_ok()
            if closed and not refused:
                raise Unavailable("CONNECTION_CLOSED", "the gateway closed the connection before answering (it "
                                  f"stopped or restarted; {_describe(exc)})", None, self._session_id) from exc
            if _ssl_in_chain(exc) or refused:
                raise CertificateError("TLS_HANDSHAKE_FAILED", "the gateway closed the TLS connection; in mTLS this "
                                       "is how it refuses a client certificate that is revoked, expired or not from "
                                       f"the user's CA ({_describe(exc)})", None, self._session_id) from exc
            raise Unavailable("CONNECTION_FAILED", f"cannot reach the gateway ({_describe(exc)})", None,
                              self._session_id) from exc
        finally:
            await conn.release()
        if 300 <= status < 400:
            raise ProtocolError("BAD_RESPONSE", f"the gateway answered a redirect (HTTP {status}); not followed",
                                status, self._session_id)
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
        headers = {"Host": self._host_header} if self._host_header is not None else None
        try:
            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(ssl=self._ssl_context(), force_close=True), timeout=timeout,
                    cookie_jar=aiohttp.DummyCookieJar(), trust_env=False) as probe, \
                    probe.get(URL(self._base + "/v1/health", encoded=True), headers=headers,
                              allow_redirects=False) as resp:
                await resp.read()
                return True
        except aiohttp.ClientConnectorCertificateError:
            return False
        except aiohttp.ClientConnectorError as exc:
            return not _ssl_in_chain(exc)  # not listening (stopped, restarting): a closed connection
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _read_capped(self, resp: aiohttp.ClientResponse) -> bytes:
        limit = self._opts.max_response_bytes
        if resp.content_length is not None and resp.content_length > limit:
            raise ProtocolError("RESPONSE_TOO_LARGE", f"the answer exceeds {limit} bytes", resp.status,
                                self._session_id)
        chunks: list[bytes] = []
        total = 0
        async for chunk in resp.content.iter_chunked(READ_CHUNK):
            total += len(chunk)
            if total > limit:
                resp.close()
                raise ProtocolError("RESPONSE_TOO_LARGE", f"the answer exceeds {limit} bytes", resp.status,
                                    self._session_id)
            chunks.append(chunk)
        return b"".join(chunks)

    # ---------------------------------------------------------------------------- refresh

    def _refresh_due(self) -> bool:
        remaining = self._access_exp - self._clock()
        margin = self._opts.refresh_before_seconds
        if self._access_iat is not None:
            life = self._access_exp - self._access_iat
            if life > 0:
                margin = min(max(margin, life * self._opts.refresh_before_fraction), life / 2)
        return remaining <= margin

    async def _refresh(self, *, stale: str | None, force: bool) -> None:
        """One refresh for all concurrent callers. ``force``: the gateway refused ``stale`` as
        expired (skip if another caller already replaced it)."""
        async with self._refresh_lock, self._bundle_lock():
            self._adopt_from_disk()
            if force:
                if stale is not None and self._access_token != stale:
                    return
            elif not self._refresh_due():
                return
            answer = await self._post_refresh()
            self._apply_tokens(answer)
            self.refresh_count += 1
            log.info("tokens rotated for session %s; access token valid until %s", self._session_id,
                     answer["expires_at"])
            await self._persist(lambda b: b.with_tokens(answer), "the rotated tokens")

    async def _post_refresh(self) -> JSONObject:
        rt = self._refresh_token
        if not rt:
            raise AuthError("TOKEN_EXPIRED", "the access token expired and this client has no refresh token; ask "
                            "the user to authorize the agent again", None, self._session_id)
        if self._refresh_exp is not None and self._clock() >= self._refresh_exp:
            raise AuthError("TOKEN_EXPIRED", f"the refresh token expired at {iso(self._refresh_exp)}; ask the user "
                            "to authorize the agent again", None, self._session_id)
        path = f"/v1/sessions/{quote(self._session_id, safe=SEGMENT_SAFE)}/refresh"
        # The answer may be lost after the token was spent (gateway or guard killed, network cut). The
        # Auth Service lets the same key retry a spent token until its successor pair is first used,
        # so retrying with bounded back-off is safe, as is a later refresh by a restarted agent.
        o = self._opts
        delay = o.refresh_retry_initial_seconds
        for attempt in range(1, max(1, o.refresh_retry_attempts) + 1):
            last = attempt >= o.refresh_retry_attempts
            try:
                status, answer = await self._send("POST", path, None, None, rt)
            except Unavailable as exc:
                if exc.code not in RETRY_REFRESH_CODES or last:
                    raise
                reason = exc.code
            else:
                code = error_from_answer(status, answer, session_id=self._session_id).code if status >= 300 else ""
                if status not in RETRY_REFRESH_STATUSES or last:
                    break
                reason = f"{code} (HTTP {status})"
            log.warning("refresh for session %s got no answer (%s); retrying in %.1f s (try %d of %d)",
                        self._session_id, reason, delay, attempt + 1, o.refresh_retry_attempts)
            await asyncio.sleep(delay)
            delay = min(delay * 2, o.refresh_retry_max_seconds)
        if status >= 300:
            err = error_from_answer(status, answer, session_id=self._session_id, secrets=self._recent)
            if err.code == "REFRESH_REUSED":
                log.error("the gateway saw a spent refresh token for session %s: the session is revoked "
                          "(was the bundle copied, or restored from an old copy?)", self._session_id)
            raise err
        if not isinstance(answer, dict) or not all(
                isinstance(answer.get(k), str) and answer.get(k) for k in ("access_token", "expires_at")):
            raise ProtocolError("BAD_RESPONSE", "the refresh answer has no access_token/expires_at", status,
                                self._session_id)
        for k in ("refresh_token", "refresh_expires_at"):
            if answer.get(k) is not None and not isinstance(answer.get(k), str):
                raise ProtocolError("BAD_RESPONSE", f"the refresh answer's {k} is not a string", status,
                                    self._session_id)
        return answer

    def _apply_tokens(self, answer: Mapping[str, Any]) -> None:
        self._access_token = str(answer["access_token"])
        self._access_exp, self._access_iat = self._token_times(self._access_token, answer["expires_at"])
        new_rt = answer.get("refresh_token")
        if isinstance(new_rt, str) and new_rt:
            self._refresh_token = new_rt
            self._refresh_exp = (_iso_ts(answer.get("refresh_expires_at"))
                                 or _num(_token_claims(new_rt).get("exp")))
        self._remember(self._access_token, self._refresh_token)

    def _adopt_from_disk(self) -> None:
        """Another process of this agent may have rotated the tokens in the bundle: take them."""
        if self._bundle_path is None:
            return
        try:
            disk = load_bundle(self._bundle_path)
        except UompError:
            return
        if (disk.session_id != self._session_id or disk.refresh_token == self._refresh_token
                or disk.access_token == self._access_token):
            return
        exp = _iso_ts(disk.access_expires_at)
        if exp is None or exp < self._access_exp:
            return
        log.info("adopting tokens another process rotated for session %s", self._session_id)
        self._apply_tokens({"access_token": disk.access_token, "expires_at": disk.access_expires_at,
                            "refresh_token": disk.refresh_token, "refresh_expires_at": disk.refresh_expires_at})
        self._bundle = disk

    @contextlib.asynccontextmanager
    async def _bundle_lock(self) -> AsyncIterator[None]:
        """``flock`` on ``<bundle>.lock``: one refresh at a time across processes sharing the bundle."""
        if self._bundle_path is None:
            yield
            return
        lock_path = self._bundle_path.with_name(self._bundle_path.name + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError("CONFIG_ERROR", f"cannot open the lock file {lock_path}: {exc.strerror}") from None
        try:
            deadline = time.monotonic() + self._opts.lock_timeout_seconds
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise Unavailable("LOCK_TIMEOUT", f"another process held {lock_path} for more than "
                                          f"{self._opts.lock_timeout_seconds:g} s", None, self._session_id) from None
                    await asyncio.sleep(0.05)
            yield
        finally:
            os.close(fd)  # releases the lock

    async def _persist(self, update: Callable[[AgentBundle], AgentBundle], what: str) -> None:
        """Write ``update(bundle)`` to the bundle file (caller holds the bundle lock)."""
        path, mine = self._bundle_path, self._bundle
        if path is None or mine is None:
            return

        def write() -> AgentBundle:
            base = mine
            with contextlib.suppress(UompError):
                disk = load_bundle(path)
                if disk.session_id == mine.session_id:
                    base = disk  # keep what another process wrote (newer tokens or certificate)
            new = update(base)
            write_bundle(path, new)
            return new

        try:
            self._bundle = await asyncio.to_thread(write)
        except OSError as exc:
            log.error("could not save %s to the agent bundle %s", what, path)
            raise ConfigError("CONFIG_ERROR", f"could not save {what} to {path} ({exc.strerror}); fix this before the "
                              "agent restarts: a restarted agent holding a spent refresh token revokes its own "
                              "session", None, self._session_id) from None

    # ----------------------------------------------------------------------- certificates

    def _set_certificate(self, pem: str, key: AgentKey) -> None:
        try:
            cert = x509.load_pem_x509_certificate(pem.encode())
        except ValueError as exc:
            raise ConfigError("CONFIG_ERROR", "the agent certificate is not a PEM certificate") from exc
        if _spki(cert.public_key()) != _spki(key.public_key()):
            raise ConfigError("CONFIG_ERROR", "the agent certificate and the agent key do not belong together")
        cert_agent = ca.agent_id_from_cert(cert)
        if cert_agent != self._agent_id:
            raise ConfigError("CONFIG_ERROR", "the agent certificate names another agent than the bundle")
        self._cert, self._cert_pem, self._key = cert, pem, key
        nb = cert.not_valid_before_utc.timestamp()
        na = cert.not_valid_after_utc.timestamp()
        self._renew_at = nb + (na - nb) * self._opts.renew_at_fraction

    def _check_not_expired(self) -> None:
        if self._cert is None:
            return
        if self._clock() >= self._cert.not_valid_after_utc.timestamp():
            na = self._cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
            raise CertificateError(
                "CERT_EXPIRED",
                f"the agent certificate (serial {self.certificate_serial}) expired at {na}; a certificate is "
                "renewed with itself, so it is too late to renew: ask the user for a new one ('uomp agent issue "
                f"{self._agent_id}' or 'uomp authorize --remote')", None, self._session_id)

    async def _ensure_certificate(self) -> None:
        self._check_not_expired()
        now = self._clock()
        if now < self._renew_at or now < self._renew_blocked_until:
            return
        async with self._cert_lock:
            now = self._clock()
            if now < self._renew_at or now < self._renew_blocked_until:
                return
            try:
                await self._renew(None)
            except UompClientError as exc:
                self._renew_blocked_until = self._clock() + self._opts.renew_retry_seconds
                log.warning("automatic renewal of the agent certificate failed (%s: %s); the current one stays in "
                            "use until %s", exc.code, exc.message, self.certificate_not_after)

    async def _renew(self, csr_key: AgentKey | None) -> RenewedCertificate:
        assert self._key is not None and self._ca_cert is not None
        body: JSONObject | None = None
        if csr_key is not None:
            csr = ca.make_csr(csr_key, self._agent_id)
            body = {"csr": csr.public_bytes(serialization.Encoding.PEM).decode()}
        status, answer = await self._send("POST", "/v1/certificates/renew", None, body if body is not None else {},
                                          None)
        if status >= 300:
            raise error_from_answer(status, answer, session_id=self._session_id, secrets=self._recent)
        pem = answer.get("certificate") if isinstance(answer, dict) else None
        if not isinstance(pem, str):
            raise ProtocolError("BAD_RESPONSE", "the renewal answer has no certificate", status, self._session_id)
        new_key = csr_key if csr_key is not None else self._key
        try:
            cert = x509.load_pem_x509_certificate(pem.encode())
            ca_cert = x509.load_pem_x509_certificate(self._ca_cert.encode())
        except ValueError:
            raise ProtocolError("BAD_RESPONSE", "the renewed certificate is not PEM", status,
                                self._session_id) from None
        if not ca.is_issued_by(cert, ca_cert):
            raise ProtocolError("BAD_RESPONSE", "the renewed certificate was not issued by the bundle's CA", status,
                                self._session_id)
        try:
            self._set_certificate(pem, new_key)
        except ConfigError as exc:
            raise ProtocolError("BAD_RESPONSE", f"the renewed certificate is unusable: {exc.message}", status,
                                self._session_id) from None
        # New connections use the new certificate; calls in flight finish on the old pool.
        old, self._conn = self._conn, self._new_conn()
        self._retired = [c for c in self._retired if not c.session.closed]
        if old is not None:
            old.retired = True
            if old.inflight == 0:
                await old.session.close()
            else:
                self._retired.append(old)
        rotated = csr_key is not None
        key_pem = ca.key_pem(new_key).decode() if rotated else None

        def update(b: AgentBundle) -> AgentBundle:
            if key_pem is None:
                return dataclasses.replace(b, agent_cert=pem)
            return dataclasses.replace(b, agent_cert=pem, agent_key=key_pem, agent_key_file=None)

        async with self._bundle_lock():
            await self._persist(update, "the renewed certificate")
        serial = ca.serial_hex(cert.serial_number)
        log.info("agent certificate renewed for %s: serial %s valid until %s%s", self._agent_id, serial,
                 cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ"), " (new key)" if rotated else "")
        return RenewedCertificate(serial=serial, not_after=cert.not_valid_after_utc, certificate=pem,
                                  new_key=rotated)


__all__ = ["AGGREGATE_OPS", "ClientOptions", "Mode", "RenewedCertificate", "UompClient", "memory_hash"]
