"""The gateway's end of the uplink: the listener the home side dials, and the client that sends
agent requests to the guard over it (in place of the Unix socket; the same headers, the same
verified-identity contract of :mod:`gateway.contract`).

* One home connection at a time: a second one that passes the handshake and the pin while the first
  is alive is sent away with a GOAWAY that says so (the first one keeps serving); a dead one is
  noticed by the keep-alive (:mod:`gateway.uplink.link`) and then the next dial is taken.
* At most ``max_in_flight`` requests on the link (and no more than the home side's
  SETTINGS_MAX_CONCURRENT_STREAMS less the hub's own :data:`OWN_STREAMS`); at most ``max_queue``
  more wait for a place within their deadline; beyond that 503 ``STORE_BUSY``.
* No home connection: 503 ``STORE_UNAVAILABLE`` at once (the gateway adds ``Retry-After``), and the
  gateway spools its own events as with a lost Unix socket. The link dropped before the answer's
  head: ``STORE_UNAVAILABLE``; after it (cut short): ``UPSTREAM_ERROR``; no answer within the
  deadline: ``UPSTREAM_TIMEOUT`` — the codes of :mod:`gateway.remote.upstream`.
* Nothing is kept: bodies pass through memory only, per stream, bounded by the flow-control windows.
* The trust material from home (CRL, ``jwks.json``, revoked keys; :mod:`gateway.uplink.trust`):
  while a home connection is up, one long-poll stream of the hub's own (outside the in-flight
  budget) fetches it on connect and on every change, and hands it to :attr:`UplinkHub.trust`.
* The payloads uploaded here: :attr:`UplinkHub.payloads` offers each one home on a stream of the
  hub's own and removes it once home holds it (:mod:`gateway.uplink.relay`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

from gateway.config import GatewayConfig, Paths
from gateway.core import http1
from gateway.errors import ErrorCode, UompError
from gateway.uplink import certs, relay, tlsctx, trust
from gateway.uplink.link import Headers, Link, LinkDown, Stream, StreamReset

log = logging.getLogger("uomp.uplink")

BUFFER_BODY_BYTES = 256 * 1024  # answers framed by length up to this are read whole before returning
HANDSHAKE_TIMEOUT = 10.0
OWN_STREAMS = 3  # the hub's own streams on the link: the trust long-poll, one payload offer, one health probe
_METHOD = re.compile(r"[A-Z]{1,16}")
_AUTHORITY = b"uomp-guard"


def _down() -> UompError:
    return UompError(
        ErrorCode.STORE_UNAVAILABLE,
        "the memory guard is unreachable: the home uplink is not connected; "
        "start 'uomp guard uplink URL' at home, then retry",
    )


def _cut() -> UompError:
    return UompError(ErrorCode.UPSTREAM_ERROR, "the home uplink dropped in the middle of the guard's answer")


def _timeout() -> UompError:
    return UompError(ErrorCode.UPSTREAM_TIMEOUT, "the memory guard did not answer over the uplink in time")


class UplinkResponse:
    """The guard's answer over the uplink, shaped like :class:`gateway.remote.upstream.UpstreamResponse`."""

    def __init__(
        self,
        hub: UplinkHub,
        stream: Stream,
        status: int,
        headers: list[tuple[str, str]],
        deadline: float,
        counted: bool = True,
    ):
        self.status = status
        self._counted = counted
        self.headers = headers
        self.body: bytes | None = None
        self._hub = hub
        self._stream: Stream | None = stream
        self._deadline = deadline
        self._received = 0
        length = self.header("content-length")
        self._length = int(length) if length is not None and length.isdigit() and len(length) < 16 else None

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @property
    def content_type(self) -> str:
        return (self.header("content-type") or "").split(";", 1)[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        return self._length

    async def _next(self) -> bytes:
        st = self._stream
        if st is None:
            return b""
        try:
            async with asyncio.timeout_at(self._deadline):
                data = await st.read_chunk()
        except TimeoutError as exc:
            self.release()
            raise _timeout() from exc
        except (LinkDown, StreamReset) as exc:
            self.release()
            raise _cut() from exc
        self._received += len(data)
        if self._received > http1.MAX_BODY_BYTES or (self._length is not None and self._received > self._length):
            self.release()
            raise UompError(ErrorCode.UPSTREAM_ERROR, "the memory guard's answer over the uplink is too long")
        if not data and self._length is not None and self._received != self._length:
            self.release()
            raise _cut()
        return data

    async def read(self, limit: int) -> bytes:
        if self.body is not None:
            return self.body[:limit]
        parts: list[bytes] = []
        got = 0
        while got < limit:
            piece = await self._next()
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
        return b"".join(parts)[:limit]

    async def iter_chunks(self, size: int = 64 * 1024) -> AsyncIterator[bytes]:
        if self.body is not None:
            for i in range(0, len(self.body), size):
                yield self.body[i : i + size]
            return
        while True:
            piece = await self._next()
            if not piece:
                return
            for i in range(0, len(piece), size):
                yield piece[i : i + size]

    def release(self) -> None:
        st, self._stream = self._stream, None
        if st is not None:
            st.link.forget(st)
            if self._counted:
                self._hub._slot_free()


class UplinkHub:
    """The uplink listener and the request client over the current home connection."""

    def __init__(
        self,
        *,
        cert_file: Path,
        key_file: Path,
        ca_file: Path,
        pins_file: Path,
        timeout_seconds: float,
        max_in_flight: int = 256,
        max_queue: int = 1024,
        keepalive_seconds: float = 5.0,
    ) -> None:
        self.context = tlsctx.server_context(cert_file, key_file, ca_file)
        self.pins = certs.load_pins(pins_file)
        self.timeout = float(timeout_seconds)
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.keepalive = keepalive_seconds
        self.link: Link | None = None
        self.server: asyncio.Server | None = None
        self.port: int | None = None
        self._in_flight = 0
        self._waiters: list[asyncio.Future[None]] = []
        self.connected_since: float | None = None
        self.connects = 0  # home connections accepted so far
        self.refused = 0  # connections that passed TLS but were refused (pin, role, a second home side)
        self.last_error: str | None = None
        self._check = tlsctx.peer_check(self.pins, want_home_role=True)
        self.on_change: Callable[[], None] | None = None  # the gateway's upstream monitor checks again
        self.trust: trust.TrustSink | None = None  # where the CRL and keys from home go (None: not fetched)
        self.trust_retry_seconds = 5.0  # after a failed poll, on the same link
        self._trust_task: asyncio.Task[None] | None = None
        self.payloads: relay.Outbox | None = None  # the relay's stored payloads, offered home (None: not relayed)
        self._payload_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ listener

    async def listen(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            self._factory, host, port, ssl=self.context, ssl_handshake_timeout=HANDSHAKE_TIMEOUT, backlog=16
        )
        self.port = int(self.server.sockets[0].getsockname()[1])
        log.info("uplink listener on %s:%s (TLS 1.3, mTLS, pinned home side)", host, self.port)
        return self.port

    def _factory(self) -> Link:
        return Link(
            client_side=True,
            keepalive=self.keepalive,
            verify_peer=self._verify,
            on_open=self._opened,
            on_close=self._closed,
        )

    def _verify(self, obj: object) -> str | None:
        import ssl

        why = self._check(obj if isinstance(obj, ssl.SSLObject) else None)
        if why is not None:
            self.refused += 1
            self.last_error = why
            log.warning("uplink: a connection was refused: %s", why)
        return why

    def _opened(self, link: Link) -> None:
        cur = self.link
        if cur is not None and not cur.closed:
            self.refused += 1
            log.warning("uplink: a second home side connected while one is live; it was sent away")
            link.goaway("another home side is connected to this gateway as this appliance")
            return
        self.link = link
        self.connects += 1
        self.connected_since = time.time()
        self.last_error = None
        log.warning("uplink: the home side is connected")
        self._wake()
        if self.trust is not None:
            self._trust_task = asyncio.get_running_loop().create_task(self._trust_loop(link, self.trust))
        if self.payloads is not None:
            self._payload_task = asyncio.get_running_loop().create_task(
                self.payloads.follow(link, lambda: self.link is link and not link.closed)
            )
        if self.on_change is not None:
            self.on_change()

    def _closed(self, link: Link, reason: str) -> None:
        if self.link is link:
            self.link = None
            for task in (self._trust_task, self._payload_task):
                if task is not None:
                    task.cancel()
            self._trust_task = self._payload_task = None
            self.connected_since = None
            self.last_error = reason
            log.warning("uplink: the home side is gone (%s): requests are answered 503 until it is back", reason)
            self._wake()
            if self.on_change is not None:
                self.on_change()

    @property
    def connected(self) -> bool:
        return self.link is not None and not self.link.closed

    def snapshot(self) -> dict[str, object]:
        out: dict[str, object] = {
            "listen_port": self.port,
            "connected": self.connected,
            "connected_since": self.connected_since,
            "connects": self.connects,
            "refused": self.refused,
            "in_flight": self._in_flight,
            "last_error": self.last_error,
        }
        if self.trust is not None:
            out["trust"] = self.trust.snapshot()
        if self.payloads is not None:
            out["payloads"] = self.payloads.snapshot()
        return out

    # ------------------------------------------------------------------ trust from home

    async def _fetch_trust(self, target: str) -> tuple[int, bytes]:
        """One trust poll on a stream of the hub's own: (status, body)."""
        resp = await self.request("GET", target, {}, timeout=trust.WAIT + 10.0, probe=True, authority=trust.AUTHORITY)
        try:
            return resp.status, (await resp.read(trust.MAX_BUNDLE_BYTES + 1) if resp.status == 200 else b"")
        finally:
            resp.release()

    async def _trust_loop(self, link: Link, sink: trust.TrustSink) -> None:
        await trust.follow(
            self._fetch_trust, lambda: self.link is link and not link.closed, sink, self.trust_retry_seconds
        )

    async def close(self) -> None:
        for task in (self._trust_task, self._payload_task):
            if task is not None:
                task.cancel()
        self._trust_task = self._payload_task = None
        if self.server is not None:
            self.server.close()
        link, self.link = self.link, None
        if link is not None:
            link.goaway("the gateway is stopping")
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), 5)
            except TimeoutError:
                pass
            self.server = None

    # ------------------------------------------------------------------ places

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def _budget(self) -> int:
        """Agent requests on the link at once: ours and the home side's stream limit, less the
        streams the hub keeps for itself (the trust poll, a health probe), so those never make an
        agent request fail to open its stream."""
        link = self.link
        if link is None:
            return self.max_in_flight
        return min(self.max_in_flight, max(1, link.stream_budget - OWN_STREAMS))

    async def _slot(self, deadline: float) -> Link:
        """A place on the current link (waiting within ``deadline`` behind at most ``max_queue`` others)."""
        loop = asyncio.get_running_loop()
        queued = False
        while True:
            link = self.link
            if link is None or link.closed:
                raise _down()
            if self._in_flight < self._budget():
                self._in_flight += 1
                return link
            if not queued:
                if len(self._waiters) >= self.max_queue:
                    raise UompError(ErrorCode.STORE_BUSY, "the uplink to the memory guard is full; retry shortly")
                queued = True
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                async with asyncio.timeout_at(deadline):
                    await fut
            except TimeoutError as exc:
                raise _timeout() from exc
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)

    def _slot_free(self) -> None:
        self._in_flight -= 1
        while self._waiters:
            w = self._waiters.pop(0)
            if not w.done():
                w.set_result(None)
                return

    # ------------------------------------------------------------------ requests

    @staticmethod
    def _headers(
        method: str,
        target: str,
        headers: Mapping[str, str],
        block: http1.HeaderBlock | None,
        authority: bytes = _AUTHORITY,
    ) -> Headers:
        if _METHOD.fullmatch(method) is None:
            raise UompError(ErrorCode.INVALID_REQUEST, "method cannot be forwarded")
        if not target.startswith("/") or http1.BAD_TARGET.search(target):
            raise UompError(ErrorCode.INVALID_REQUEST, "request target cannot be forwarded")
        lines = (block or "") + http1.header_block(headers)  # checked: tokens, no CR/LF/NUL, no hop headers
        out: Headers = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority),
            (b":path", target.encode("utf-8", "surrogateescape")),
        ]
        for line in lines.split("\r\n"):
            if not line:
                continue
            name, _, value = line.partition(": ")
            low = name.lower()
            if low in ("te", "host"):
                continue
            out.append((low.encode(), value.encode("utf-8", "surrogateescape")))
        return out

    async def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        *,
        body: bytes | None = None,
        block: http1.HeaderBlock | None = None,
        timeout: float | None = None,
        probe: bool = False,
        authority: bytes = _AUTHORITY,
    ) -> UplinkResponse:
        """One request to the guard over the uplink. ``probe``: a health check (or the hub's own
        trust poll), outside the in-flight budget (so a full uplink is not reported as a lost
        guard), on a stream of its own. ``authority``: the hub's own streams only
        (:data:`gateway.uplink.trust.AUTHORITY`); what an agent asked for always goes as the guard's."""
        h = self._headers(method, target, headers, block, authority)
        if body is not None or method in ("POST", "PUT", "PATCH"):
            h.append((b"content-length", str(len(body or b"")).encode()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if timeout is None else timeout)
        if probe:
            link_or = self.link
            if link_or is None or link_or.closed:
                raise _down()
            link = link_or
        else:
            link = await self._slot(deadline)
        stream: Stream | None = None
        try:
            stream = link.open_stream(h, end_stream=not body)
            async with asyncio.timeout_at(deadline):
                if body:
                    await link.send_data(stream.sid, body, end_stream=True)
                raw = await stream.response_headers()
            resp = self._response(stream, raw, deadline, counted=not probe)
        except TimeoutError as exc:
            self._give_back(link, stream, counted=not probe)
            raise _timeout() from exc
        except (LinkDown, StreamReset) as exc:
            self._give_back(link, stream, counted=not probe)
            raise _down() from exc
        except BaseException:
            self._give_back(link, stream, counted=not probe)
            raise
        if resp._length is not None and resp._length <= BUFFER_BODY_BYTES:
            try:
                resp.body = await resp.read(resp._length + 1)
            except BaseException:
                resp.release()
                raise
            if len(resp.body) != resp._length:
                resp.release()
                raise _cut()
            resp.release()
        return resp

    def _give_back(self, link: Link, stream: Stream | None, *, counted: bool) -> None:
        if stream is not None:
            link.forget(stream)
        if counted:
            self._slot_free()

    def _response(self, stream: Stream, raw: Headers, deadline: float, *, counted: bool) -> UplinkResponse:
        status = -1
        out: list[tuple[str, str]] = []
        for k, v in raw:
            if k == b":status":
                status = int(v) if v.isdigit() and len(v) == 3 else -1
            elif not k.startswith(b":"):
                out.append((k.decode("latin-1"), v.decode("utf-8", "surrogateescape")))
        if not 200 <= status <= 599:
            raise UompError(ErrorCode.UPSTREAM_ERROR, "the memory guard's answer over the uplink has no valid status")
        return UplinkResponse(self, stream, status, out, deadline, counted)

    async def probe(self, timeout: float) -> str | None:
        """One health check of the guard through the uplink: None when it answers 200, else why not."""
        if not self.connected:
            return ErrorCode.STORE_UNAVAILABLE
        try:
            resp = await self.request("GET", "/v1/health", {}, timeout=min(self.timeout, timeout), probe=True)
        except UompError as exc:
            return exc.code
        status = resp.status
        resp.release()
        return None if status == 200 else f"HTTP {status}"


def uplink_hub(paths: Paths, cfg: GatewayConfig) -> UplinkHub:
    """The hub of a VPS gateway, from the files ``uomp uplink init`` exported into its data directory."""
    for p in (paths.uplink_server_cert, paths.uplink_server_key, paths.uplink_ca_cert, paths.uplink_pins):
        if not p.exists():
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                f"{p} is missing; run 'uomp uplink init --vps-host HOST --out DIR' at home and use DIR here",
            )
    return UplinkHub(
        cert_file=paths.uplink_server_cert,
        key_file=paths.uplink_server_key,
        ca_file=paths.uplink_ca_cert,
        pins_file=paths.uplink_pins,
        timeout_seconds=cfg.upstream_timeout_seconds,
        max_in_flight=cfg.uplink_max_in_flight,
        max_queue=cfg.uplink_max_queue,
        keepalive_seconds=cfg.uplink_keepalive_seconds,
    )
