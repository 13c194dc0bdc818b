"""The home end of the uplink: dial the gateway on the VPS (outbound only: no port is opened at
home), keep the connection, and hand each request that arrives on it to the guard's Unix socket.

* TLS 1.3 with the home certificate; the gateway must present the pinned uplink certificate and the
  name dialled (:mod:`gateway.uplink.tlsctx`). A gateway that fails either is dropped and logged.
* Reconnect with exponential backoff and jitter (``backoff_min`` doubling to ``backoff_max``; back to
  ``backoff_min`` after a link that stayed up :data:`STABLE_SECONDS`).
* Each request: at most :data:`MAX_REQUEST_BODY` bytes of body, then one exchange with the guard
  through :class:`gateway.remote.upstream.UpstreamClient` (the same strict HTTP/1.1 hop the local
  gateway uses), the answer streamed back within the stream's flow-control window. A guard that is
  down answers the gateway with the §8.4 body of ``STORE_UNAVAILABLE`` (503), so the gateway relays
  a stable code.
* The gateway's own trust poll (``:authority`` :data:`gateway.uplink.trust.AUTHORITY`) is answered
  here, never by the guard: this home's CRL and key files (:mod:`gateway.uplink.trust`), at once
  when they differ from what the gateway holds, else when they change (or 204 after the wait).
  While the home side runs, a CRL nearing its nextUpdate is re-signed here when the CA key is here.
* The payloads the gateway relays (``:authority`` :data:`gateway.uplink.trust.AUTHORITY`, path
  :data:`gateway.uplink.relay.PATH`) go into this home's payload store, streamed, checked, audited
  (:mod:`gateway.uplink.relay`).
* At most ``max_streams`` requests at once (advertised to the gateway as
  SETTINGS_MAX_CONCURRENT_STREAMS; a gateway that opens more loses the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import secrets
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import h2.errors

from gateway.config import Paths
from gateway.contract import (
    VERIFIED_AGENT_HEADER,
    VERIFIED_LISTENER_HEADER,
    VERIFIED_REQUEST_ID_HEADER,
    VERIFIED_VIA_HEADER,
)
from gateway.core import http1
from gateway.durable import FAULT_ENV, fault_point
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write
from gateway.payloads.store import Limits
from gateway.remote.upstream import Upstream, UpstreamClient
from gateway.uplink import certs, relay, tlsctx, trust
from gateway.uplink.homestatus import STATUS_FILE
from gateway.uplink.link import DEFAULT_MAX_STREAMS, Headers, Link, Stream

log = logging.getLogger("uomp.uplink")

MAX_REQUEST_BODY = 8 * 1024 * 1024
CRL_TICK_SECONDS = 5.0
STABLE_SECONDS = 30.0
CONNECT_TIMEOUT = 15.0
_DROP = frozenset({b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te"})


def _after_head(link: Link) -> None:
    """The kill point of the tests: the answer's head is on the wire, its body is not."""
    if os.environ.get(FAULT_ENV) == "uplink.home.after-head":
        link.flush_now()
        fault_point("uplink.home.after-head")


def parse_url(url: str) -> tuple[str, int]:
    """``https://HOST:PORT`` of the VPS's uplink listener as (host, port)."""
    parts = urlsplit(url)
    try:
        port = parts.port or 443
    except ValueError:
        port = -1
    if parts.scheme != "https" or not parts.hostname or port < 1 or parts.path not in ("", "/") or parts.query:
        raise UompError(ErrorCode.USAGE, "the uplink URL must be https://HOST:PORT (the gateway's uplink listener)")
    return parts.hostname, port


class HomeUplink:
    """The home end of the uplink: dial out with backoff, serve each stream from the guard's socket."""

    def __init__(
        self,
        url: str,
        *,
        cert_file: Path,
        key_file: Path,
        ca_file: Path,
        pins_file: Path,
        guard: Upstream,
        paths: Paths | None = None,
        keep_crl: bool = True,
        guard_timeout: float = 10.0,
        max_streams: int = DEFAULT_MAX_STREAMS,
        keepalive: float = 5.0,
        backoff_min: float = 0.2,
        backoff_max: float = 30.0,
        payload_limits: Limits | None = None,
    ) -> None:
        self.host, self.port = parse_url(url)
        self.context = tlsctx.client_context(cert_file, key_file, ca_file)
        self.pins = certs.load_pins(pins_file)
        self.guard = UpstreamClient(guard, timeout_seconds=guard_timeout, max_connections=max_streams)
        self.max_streams = max_streams
        self.keepalive = keepalive
        self.backoff_min = backoff_min
        self.backoff_max = backoff_max
        self.link: Link | None = None
        self.connects = 0
        self.failures = 0
        self.last_error: str | None = None
        self.connected = asyncio.Event()
        self._check = tlsctx.peer_check(self.pins, want_home_role=False)
        self._refused: str | None = None
        self.url = url
        self.paths = paths
        self.trust = trust.TrustSource(paths) if paths is not None else None
        self.keep_crl = keep_crl  # re-sign this home's CRL before it goes stale (when its CA key is here)
        # payloads uploaded at the gateway come home over the link (gateway/uplink/relay.py)
        self.inbox = (
            relay.Inbox(paths, via=f"uplink:{self.host}:{self.port}", record=self._record, limits=payload_limits)
            if paths is not None
            else None
        )
        self.connected_since: float | None = None
        self._running = False  # run() is dialling or serving (the status file says so)

    def _verify(self, obj: object) -> str | None:
        import ssl

        why = self._check(obj if isinstance(obj, ssl.SSLObject) else None)
        if why is not None:
            self._refused = why
        return why

    async def connect_once(self) -> Link:
        """One dial; the link once it passed the pin check, else UompError(UPSTREAM_ERROR / STORE_UNAVAILABLE)."""
        loop = asyncio.get_running_loop()
        self._refused = None

        def factory() -> Link:
            return Link(
                client_side=False,
                max_streams=self.max_streams,
                keepalive=self.keepalive,
                verify_peer=self._verify,
                on_request=self._serve,
            )

        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                _t, link = await loop.create_connection(
                    factory,
                    self.host,
                    self.port,
                    ssl=self.context,
                    server_hostname=self.host,
                    ssl_handshake_timeout=CONNECT_TIMEOUT,
                )
        except TimeoutError as exc:
            raise UompError(ErrorCode.UPSTREAM_TIMEOUT, "the gateway did not answer the uplink dial in time") from exc
        except OSError as exc:  # refused, unreachable, TLS verification failed (ssl.SSLError is an OSError)
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE, f"the gateway's uplink listener refused the dial ({type(exc).__name__})"
            ) from exc
        if self._refused is not None or link.closed:
            raise UompError(ErrorCode.UPSTREAM_ERROR, self._refused or link.close_reason)
        return link

    def snapshot(self) -> dict[str, object]:
        """The home side's state (what the status file holds; no key, no token)."""
        out: dict[str, object] = {
            "target": self.url,
            "connected": self.link is not None and not self.link.closed,
            "connected_since": self.connected_since,
            "connects": self.connects,
            "reconnects": max(0, self.connects - 1),
            "failures": self.failures,
            "last_error": self.last_error,
            "updated_at": time.time(),
            "pid": os.getpid(),
            "running": self._running,
        }
        t = self.trust
        if t is not None:
            out.update(crl_pushed_at=t.sent_at, crl_acked_at=t.acked_at, vps_crl_number=t.vps_crl_number)
        if self.inbox is not None:
            out["payloads"] = self.inbox.snapshot()
        return out

    async def _record(self, body: dict[str, object]) -> None:
        """One payload event into the guard's audit log (``POST /v1/payload/audit``), durable on return."""
        headers = {
            VERIFIED_AGENT_HEADER: str(body["agent_id"]),
            VERIFIED_VIA_HEADER: f"uplink:{self.host}:{self.port}",
            VERIFIED_LISTENER_HEADER: "uplink",
            VERIFIED_REQUEST_ID_HEADER: "upl_" + secrets.token_hex(8),
            "Content-Type": "application/json",
        }
        resp = await self.guard.request("POST", "/v1/payload/audit", headers, body=json.dumps(body).encode())
        try:
            raw = resp.body if resp.body is not None else await resp.read(64 * 1024)
        finally:
            resp.release()
        try:
            doc = json.loads(raw)
            recorded = resp.status == 200 and doc.get("recorded") is True
            code = doc.get("error", {}).get("code") if 400 <= resp.status < 500 else None
        except (ValueError, AttributeError):
            recorded, code = False, None
        if code in (ErrorCode.PAYLOAD_HASH_MISMATCH, ErrorCode.INVALID_REQUEST, ErrorCode.AGENT_MISMATCH):
            raise UompError(ErrorCode(code), str(doc["error"].get("message", ""))[:300])  # refused, not failed
        if not recorded:
            raise UompError(
                ErrorCode.STORE_UNAVAILABLE, "the audit log did not record the payload event; nothing was kept"
            )

    async def _settle_arriving(self) -> None:
        """Arrivals a crash left unconfirmed are settled once the link is up (failures: the next offer does it)."""
        if self.inbox is None:
            return
        try:
            done = await self.inbox.settle_arriving()
        except Exception as exc:  # the guard may be away: the gateway's next offer settles it
            log.warning("uplink: settling payloads that arrived before a crash failed (%s)", type(exc).__name__)
        else:
            if done:
                log.info("uplink: settled %d payload(s) that arrived before a crash", done)

    def write_status(self) -> None:
        """The snapshot into ``uplink/home-status.json`` (atomic; a failure is logged, never fatal)."""
        if self.paths is None:
            return
        try:
            atomic_write(self.paths.uplink_dir / STATUS_FILE, json.dumps(self.snapshot()).encode() + b"\n", mode=0o600)
        except OSError as exc:
            log.warning("uplink: cannot write the status file (%s)", exc.strerror)

    async def _keep_crl(self, paths: Paths) -> None:
        """Re-sign this home's CRL before it goes stale (it is what the gateway is sent)."""
        from gateway import ca_store

        watch = ca_store.CrlWatch(paths)
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(None, watch.tick)
            except Exception as exc:  # a failing refresh never stops the home side
                log.warning("uplink: refreshing the CRL failed (%s)", type(exc).__name__)
            await asyncio.sleep(CRL_TICK_SECONDS)

    async def run(self) -> None:
        """Dial, serve, and dial again with backoff; until cancelled."""
        delay = self.backoff_min
        self._running = True
        crl_task = None
        if self.keep_crl and self.paths is not None and self.paths.ca_key.exists():
            crl_task = asyncio.get_running_loop().create_task(self._keep_crl(self.paths))
        try:
            while True:
                started = time.monotonic()
                try:
                    link = await self.connect_once()
                except UompError as exc:
                    self.failures += 1
                    self.last_error = exc.message
                    log.warning("uplink: cannot connect to %s:%s: %s", self.host, self.port, exc.message)
                    self.write_status()
                else:
                    self.link = link
                    self.connects += 1
                    self.connected_since = time.time()
                    self.connected.set()
                    log.warning("uplink: connected to the gateway at %s:%s", self.host, self.port)
                    self.write_status()
                    settling = asyncio.get_running_loop().create_task(self._settle_arriving())
                    reason = await asyncio.shield(link.done)
                    settling.cancel()
                    self.connected.clear()
                    self.link = None
                    self.connected_since = None
                    self.last_error = reason
                    self.write_status()
                    log.warning("uplink: the link to the gateway ended (%s); dialling again", reason)
                    if time.monotonic() - started >= STABLE_SECONDS:
                        delay = self.backoff_min
                await asyncio.sleep(delay * (0.5 + random.random() / 2))  # noqa: S311 (jitter, not a secret)
                delay = min(self.backoff_max, delay * 2)
        finally:
            if crl_task is not None:
                crl_task.cancel()
            if self.link is not None:
                self.link.close("the home side is stopping")
            self.link = None
            self.connected_since = None
            self._running = False
            self.write_status()
            await self.guard.close()
            if self.inbox is not None:
                self.inbox.close()

    # ------------------------------------------------------------------ one request

    async def _serve(self, link: Link, st: Stream) -> None:
        hdrs = st.headers or []
        method = path = ""
        authority = b""
        fwd: dict[str, str] = {}
        for k, v in hdrs:
            if k == b":method":
                method = v.decode("ascii", "replace")
            elif k == b":path":
                path = v.decode("utf-8", "surrogateescape")
            elif k == b":authority":
                authority = v
            elif k.startswith(b":") or k in _DROP:
                continue
            else:
                name = k.decode("latin-1")
                value = v.decode("utf-8", "surrogateescape")
                fwd[name] = f"{fwd[name]}, {value}" if name in fwd else value
        if authority == trust.AUTHORITY and path.startswith(relay.PATH):  # a payload the gateway relays: streamed
            if self.inbox is None:
                await self._answer_error(
                    link, st, UompError(ErrorCode.NOT_FOUND, "this home side does not take payloads")
                )
            else:
                await self.inbox.serve(link, st, method, path)
                self.write_status()
            return
        parts: list[bytes] = []
        got = 0
        while True:
            piece = await st.read_chunk()
            if not piece:
                break
            got += len(piece)
            if got > MAX_REQUEST_BODY:
                link.reset(st, h2.errors.ErrorCodes.REFUSED_STREAM)
                return
            parts.append(piece)
        if authority == trust.AUTHORITY:
            await self._serve_trust(link, st, method, path)
            return
        body = b"".join(parts) if parts or method in ("POST", "PUT", "PATCH") else None
        try:
            resp = await self.guard.request(method, path, fwd, body=body)
        except UompError as exc:
            await self._answer_error(link, st, exc)
            return
        try:
            out: Headers = [(b":status", str(resp.status).encode())]
            for name, value in resp.headers:
                low = name.lower().encode("latin-1")
                if low in _DROP or http1.field_name(name) is None:
                    continue
                out.append((low, value.encode("utf-8", "surrogateescape")))
            if resp.body is not None:
                out.append((b"content-length", str(len(resp.body)).encode()))
                link.send_headers(st.sid, out, end_stream=not resp.body)
                _after_head(link)
                if resp.body:
                    await link.send_data(st.sid, resp.body, end_stream=True)
                return
            if resp.content_length is not None:
                out.append((b"content-length", str(resp.content_length).encode()))
            link.send_headers(st.sid, out, end_stream=False)
            _after_head(link)
            async for chunk in resp.iter_chunks(64 * 1024):
                await link.send_data(st.sid, chunk, end_stream=False)
            await link.send_data(st.sid, b"", end_stream=True)
        except UompError:  # the guard's answer broke mid-way: the gateway sees the stream cut
            link.reset(st, h2.errors.ErrorCodes.INTERNAL_ERROR)
        finally:
            resp.release()

    async def _serve_trust(self, link: Link, st: Stream, method: str, path: str) -> None:
        """The gateway's trust poll: this home's CRL and keys when they differ from ``have``."""
        target = urlsplit(path)
        source = self.trust
        if method != "GET" or target.path != trust.PATH or source is None:
            await self._answer_error(
                link, st, UompError(ErrorCode.NOT_FOUND, "this home side does not serve that uplink request")
            )
            return
        q = parse_qs(target.query)
        have = (q.get("have") or [""])[0]
        try:
            wait = min(trust.MAX_WAIT, max(0.0, float((q.get("wait") or ["0"])[0])))
        except ValueError:
            wait = 0.0
        crl_raw = (q.get("crl") or [""])[0]
        source.polled(have, int(crl_raw) if crl_raw.isdigit() and len(crl_raw) < 40 else None)
        self.write_status()
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while True:
            try:
                bundle = await loop.run_in_executor(None, source.current)
            except UompError as exc:
                await self._answer_error(link, st, exc)
                return
            if bundle.etag != have:
                break
            if loop.time() >= until:
                link.send_headers(st.sid, [(b":status", b"204")], end_stream=True)
                return
            await asyncio.sleep(min(trust.LOOK_SECONDS, max(0.0, until - loop.time())))
        body = bundle.encode()
        link.send_headers(
            st.sid,
            [
                (b":status", b"200"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            end_stream=False,
        )
        await link.send_data(st.sid, body, end_stream=True)
        source.sent(bundle)
        self.write_status()

    async def _answer_error(self, link: Link, st: Stream, exc: UompError) -> None:
        body = json.dumps(exc.body()).encode()
        with contextlib.suppress(Exception):
            link.send_headers(
                st.sid,
                [
                    (b":status", str(exc.status).encode()),
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
                end_stream=False,
            )
            await link.send_data(st.sid, body, end_stream=True)
