"""One HTTP/2 connection of the uplink, on either end (the h2 library does the framing).

Why HTTP/2 from a library rather than a framing of our own: the uplink needs exactly what HTTP/2
already specifies and h2 implements and fuzzes — many requests in flight on one connection, each
stream with its own flow-control window (one slow answer cannot stall the others: a stalled
stream holds at most its own window), header compression, PING keep-alives, GOAWAY with a reason,
and limits a peer must obey (SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_MAX_HEADER_LIST_SIZE). A
framing of our own would repeat that with less review. h2 is sans-I/O, so this module only moves
bytes and keeps each stream's buffer.

Roles are reversed on purpose: the home side dials out (TLS client) but is the HTTP/2 *server*;
the gateway accepts (TLS server) and is the HTTP/2 *client* that sends agent requests.

Bounds: at most ``max_streams`` concurrent streams (advertised; a peer that opens more breaks the
connection), :data:`STREAM_WINDOW` bytes buffered per stream and :data:`CONNECTION_WINDOW` per
connection (received data is acknowledged only once its reader took it), header lists of at most
:data:`MAX_HEADER_LIST` bytes. Anything h2 refuses as a protocol error closes the connection.
Keep-alive: a PING every ``keepalive`` seconds; a connection silent for ``3 * keepalive`` is dropped.

A little over ~500 lines: one HTTP/2 connection's state (streams, flow control, keep-alives,
bounds and their failure modes) is one job; split, each half would reach into the other's state.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack

log = logging.getLogger("uomp.uplink")

STREAM_WINDOW = 1024 * 1024  # bytes a peer may send on one stream before its reader takes them
CONNECTION_WINDOW = 16 * 1024 * 1024  # ... on the whole connection
MAX_HEADER_LIST = 64 * 1024
MAX_FRAME = 64 * 1024
DEFAULT_MAX_STREAMS = 128
DEFAULT_KEEPALIVE = 5.0
SILENT_FACTOR = 3.0  # a connection silent for this many keep-alive intervals is dead

Headers = list[tuple[bytes, bytes]]


class _PlainEncoder(hpack.Encoder):
    """HPACK without Huffman coding: the uplink spends CPU, not bytes. In a profile of the uplink,
    Huffman coding and decoding of headers that are never indexed (``authorization`` is sent
    never-indexed by h2) was its largest cost."""

    def encode(self, headers: Any, huffman: bool = False) -> bytes:
        return super().encode(headers, huffman=False)


class LinkDown(Exception):
    """The connection closed (or broke) before the stream finished."""


class StreamReset(Exception):
    """The peer reset this stream."""


class Stream:
    """One request/response on the link: headers, then body pieces, read by one reader."""

    def __init__(self, link: Link, sid: int) -> None:
        self.link = link
        self.sid = sid
        self.headers: Headers | None = None
        self.chunks: collections.deque[tuple[bytes, int]] = collections.deque()
        self.buffered = 0
        self.ended = False  # the peer ended the stream
        self.sent_end = False  # we ended it
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiter = fut
        try:
            await fut
        finally:
            self._waiter = None

    async def response_headers(self) -> Headers:
        while self.headers is None:
            if self.error is not None:
                raise self.error
            await self._wait()
        return self.headers

    async def read_chunk(self) -> bytes:
        """The next piece of the body, b"" once it ended; LinkDown / StreamReset if it broke."""
        while not self.chunks:
            if self.ended:  # the peer's side is complete (a reset or a lost link after it takes nothing away)
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()
        data, flow = self.chunks.popleft()
        self.buffered -= len(data)
        self.link._ack(self.sid, flow)
        return data

    def discard(self) -> None:
        """Drop what is buffered (its window goes back to the connection)."""
        flow = sum(f for _d, f in self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if flow:
            self.link._ack(self.sid, flow)


class Link(asyncio.Protocol):
    """One HTTP/2 connection over an established TLS transport."""

    def __init__(
        self,
        *,
        client_side: bool,
        max_streams: int = DEFAULT_MAX_STREAMS,
        keepalive: float = DEFAULT_KEEPALIVE,
        verify_peer: Callable[[ssl.SSLObject | None], str | None] | None = None,
        on_request: Callable[[Link, Stream], Awaitable[None]] | None = None,
        on_open: Callable[[Link], None] | None = None,  # once the peer's first SETTINGS arrived
        on_close: Callable[[Link, str], None] | None = None,
    ) -> None:
        self.client_side = client_side
        self.max_streams = max_streams
        self.keepalive = max(0.05, keepalive)
        self.verify_peer = verify_peer
        self.on_request = on_request
        self.on_open = on_open
        self.on_close = on_close
        # outbound headers are checked before they get here (gateway.core.http1 on the gateway, field
        # names from the guard at home); what comes in is validated by h2
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=client_side,
                header_encoding=None,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
            )
        )
        self.conn.encoder = _PlainEncoder()
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.closed = False
        self.ready = False  # the peer's first SETTINGS arrived (on_open is called then)
        self.close_reason = ""
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.peer_goaway: bytes | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._serving: dict[int, asyncio.Task[None]] = {}  # server side: the task of each open request
        self._window_waiters: list[asyncio.Future[None]] = []
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False
        self._last_seen = 0.0
        self._keepalive_task: asyncio.Task[None] | None = None
        self.peer_cert_der: bytes | None = None
        # frame boundaries of what the peer sent (_frame_lengths_ok); a server first gets the 24-byte preface
        self._skip = 0 if client_side else 24
        self._head = bytearray()
        self._flush_scheduled = False

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        loop = asyncio.get_running_loop()
        self._last_seen = loop.time()
        ssl_obj = transport.get_extra_info("ssl_object")
        if isinstance(ssl_obj, ssl.SSLObject):
            self.peer_cert_der = ssl_obj.getpeercert(binary_form=True)
        if self.verify_peer is not None:
            why = self.verify_peer(ssl_obj if isinstance(ssl_obj, ssl.SSLObject) else None)
            if why is not None:
                self._close(why)
                return
        conn = self.conn
        conn.local_settings = h2.settings.Settings(
            client=self.client_side,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
            },
        )
        # h2 took its inbound limits from the default settings it was made with: what we advertise
        # must be what it enforces (else the peer's first frame over 16 KiB breaks the connection)
        conn.max_inbound_frame_size = MAX_FRAME
        conn.decoder.max_header_list_size = MAX_HEADER_LIST
        conn.initiate_connection()
        conn.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self._flush()
        self._keepalive_task = loop.create_task(self._keepalive_loop())

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._last_seen = asyncio.get_running_loop().time()
        if not self._frame_lengths_ok(data):
            self._close(
                "the peer broke the HTTP/2 protocol (a frame over its size)", h2.errors.ErrorCodes.FRAME_SIZE_ERROR
            )
            return
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.TooManyStreamsError:
            self._close("the peer opened more streams than allowed", h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        except (h2.exceptions.ProtocolError, ValueError, KeyError) as exc:
            self._close(
                f"the peer broke the HTTP/2 protocol ({type(exc).__name__})", h2.errors.ErrorCodes.PROTOCOL_ERROR
            )
            return
        for ev in events:
            self._event(ev)
            if self.closed:
                return
        self._flush()

    def _frame_lengths_ok(self, data: bytes) -> bool:
        """Every frame header so far announces at most :data:`MAX_FRAME` bytes. h2 checks a frame's
        length only once the whole frame is buffered, so without this a peer could make us buffer
        16 MiB before being refused."""
        i, n = 0, len(data)
        while i < n:
            if self._skip:
                take = min(self._skip, n - i)
                self._skip -= take
                i += take
                continue
            part = data[i : i + 9 - len(self._head)]
            self._head += part
            i += len(part)
            if len(self._head) == 9:
                length = int.from_bytes(self._head[:3], "big")
                self._head.clear()
                if length > MAX_FRAME:
                    return False
                self._skip = length
        return True

    def eof_received(self) -> bool:
        self._close("the peer closed the connection")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._close("the connection was lost")

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    # ------------------------------------------------------------------ events

    def _event(self, ev: h2.events.Event) -> None:
        if isinstance(ev, h2.events.RequestReceived):
            sid = ev.stream_id
            st = Stream(self, sid)
            st.headers = list(cast(Headers, ev.headers or []))
            if ev.stream_ended is not None:
                st.ended = True
            self.streams[sid] = st
            if self.on_request is None:
                self._reset(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
                return
            task = asyncio.get_running_loop().create_task(self._serve(st))
            self._tasks.add(task)
            self._serving[sid] = task
            task.add_done_callback(self._tasks.discard)
        elif isinstance(ev, h2.events.ResponseReceived):
            st_or = self.streams.get(ev.stream_id)
            if st_or is not None:
                st_or.headers = list(cast(Headers, ev.headers or []))
                if ev.stream_ended is not None:
                    st_or.ended = True
                st_or._wake()
        elif isinstance(ev, h2.events.DataReceived):
            st_or = self.streams.get(ev.stream_id) if ev.stream_id is not None else None
            flow = ev.flow_controlled_length or 0
            if st_or is None:
                if ev.stream_id is not None:
                    self._ack(ev.stream_id, flow)
                return
            data = ev.data or b""
            st_or.chunks.append((data, flow))
            st_or.buffered += len(data)
            if ev.stream_ended is not None:
                st_or.ended = True
            st_or._wake()
        elif isinstance(ev, h2.events.StreamEnded):
            st_or = self.streams.get(ev.stream_id) if ev.stream_id is not None else None
            if st_or is not None:
                st_or.ended = True
                st_or._wake()
        elif isinstance(ev, h2.events.StreamReset):
            st_or = self.streams.pop(ev.stream_id, None) if ev.stream_id is not None else None
            if st_or is not None:
                st_or.error = StreamReset(f"the peer reset the stream ({ev.error_code!s})")
                st_or._wake()
            serving = self._serving.pop(ev.stream_id, None) if ev.stream_id is not None else None
            if serving is not None:
                serving.cancel()  # the peer gave up: so does the work for it (the guard exchange included)
            self._wake_windows()
        elif isinstance(ev, h2.events.RemoteSettingsChanged):
            if not self.ready:  # the peer's first SETTINGS: it speaks HTTP/2, the link is usable
                self.ready = True
                if self.on_open is not None:
                    self.on_open(self)
            self._wake_windows()
        elif isinstance(ev, h2.events.WindowUpdated):
            self._wake_windows()
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.peer_goaway = ev.additional_data or b""
            reason = "the peer ended the connection"
            if self.peer_goaway:
                reason += ": " + self.peer_goaway[:200].decode("utf-8", "replace")
            self._close(reason)
        # PingReceived is answered by h2 itself; PingAckReceived / settings acks: _last_seen did it

    async def _serve(self, st: Stream) -> None:
        assert self.on_request is not None
        try:
            await self.on_request(self, st)
        except (LinkDown, StreamReset):
            pass
        except Exception as exc:  # one broken stream never takes the link down
            log.warning("uplink: a request failed (%s)", type(exc).__name__)
            self._reset(st.sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
        finally:
            self._serving.pop(st.sid, None)
            self.forget(st)

    # ------------------------------------------------------------------ sending

    def _flush(self) -> None:
        """Write what h2 has queued, once, at the end of this turn of the event loop: the frames of
        several streams (and a response's HEADERS and DATA) go out in one TLS write."""
        if not self._flush_scheduled and self.transport is not None and not self.closed:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_now)

    def flush_now(self) -> None:
        """Write what is queued now (before a kill point in the tests)."""
        self._flush_now()

    def _flush_now(self) -> None:
        self._flush_scheduled = False
        if self.transport is None or self.closed:
            return
        data = self.conn.data_to_send()
        if data:
            self.transport.write(data)

    async def _drained(self) -> None:
        if self._write_paused and not self.closed:
            fut = asyncio.get_running_loop().create_future()
            self._drain = fut
            try:
                await fut
            finally:
                self._drain = None
        if self.closed:
            raise LinkDown(self.close_reason)

    def _check_open(self) -> None:
        if self.closed:
            raise LinkDown(self.close_reason)

    def open_stream(self, headers: Headers, *, end_stream: bool) -> Stream:
        """Client side: a new request stream with its headers sent."""
        self._check_open()
        try:
            sid = self.conn.get_next_available_stream_id()
            self.conn.send_headers(sid, headers, end_stream=end_stream)
        except h2.exceptions.ProtocolError as exc:
            raise LinkDown(f"no stream could be opened ({type(exc).__name__})") from exc
        st = Stream(self, sid)
        st.sent_end = end_stream
        self.streams[sid] = st
        self._flush()
        return st

    @property
    def open_streams(self) -> int:
        return len(self.streams)

    @property
    def stream_budget(self) -> int:
        """Streams this end may open at once (the peer's limit and ours)."""
        return min(self.max_streams, self.conn.remote_settings.max_concurrent_streams)

    def send_headers(self, sid: int, headers: Headers, *, end_stream: bool) -> None:
        self._check_open()
        try:
            self.conn.send_headers(sid, headers, end_stream=end_stream)
        except h2.exceptions.StreamClosedError as exc:
            raise StreamReset("the stream was closed") from exc
        if end_stream:
            self._sent_end(sid)
        self._flush()

    async def send_data(self, sid: int, data: bytes, *, end_stream: bool) -> None:
        """Send ``data`` on ``sid`` within the peer's flow-control windows."""
        view = memoryview(data)
        off = 0
        while True:
            self._check_open()
            if off >= len(view):
                if end_stream:
                    try:
                        self.conn.end_stream(sid)
                    except h2.exceptions.StreamClosedError as exc:
                        raise StreamReset("the stream was closed") from exc
                    self._sent_end(sid)
                    self._flush()
                return
            try:
                window = self.conn.local_flow_control_window(sid)
            except h2.exceptions.StreamClosedError as exc:
                raise StreamReset("the stream was closed") from exc
            size = min(window, self.conn.max_outbound_frame_size, len(view) - off)
            if size <= 0:
                await self._window()
                continue
            last = end_stream and off + size >= len(view)
            try:
                self.conn.send_data(sid, view[off : off + size].tobytes(), end_stream=last)
            except h2.exceptions.StreamClosedError as exc:
                raise StreamReset("the stream was closed") from exc
            if last:
                self._sent_end(sid)
            off += size
            self._flush()
            await self._drained()
            if last:
                return

    async def _window(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._window_waiters.append(fut)
        await fut
        self._check_open()

    def _wake_windows(self) -> None:
        waiters, self._window_waiters = self._window_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def _ack(self, sid: int, flow: int) -> None:
        if flow <= 0 or self.closed:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            self.conn.acknowledge_received_data(flow, sid)
        self._flush()

    def _reset(self, sid: int, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.CANCEL) -> None:
        if self.closed:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            self.conn.reset_stream(sid, code)
        self._flush()

    def _sent_end(self, sid: int) -> None:
        st = self.streams.get(sid)
        if st is not None:
            st.sent_end = True

    def forget(self, st: Stream) -> None:
        """The stream's reader is done with it: reset it if it is still open, give back its window."""
        st.discard()
        if self.streams.pop(st.sid, None) is not None and not (st.ended and st.sent_end):
            self._reset(st.sid)
        self._wake_windows()

    def reset(self, st: Stream, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.CANCEL) -> None:
        self.streams.pop(st.sid, None)
        st.discard()
        self._reset(st.sid, code)

    # ------------------------------------------------------------------ life

    async def _keepalive_loop(self) -> None:
        loop = asyncio.get_running_loop()
        n = 0
        while not self.closed:
            await asyncio.sleep(self.keepalive)
            if loop.time() - self._last_seen > self.keepalive * SILENT_FACTOR:
                self._close("the peer went silent (no answer to keep-alive pings)")
                return
            n += 1
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.ping(n.to_bytes(8, "big"))
            self._flush()

    def goaway(self, reason: str, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR) -> None:
        """End the connection with a GOAWAY that says why."""
        self._close(reason, code, tell_peer=reason.encode()[:200])

    def _close(
        self,
        reason: str,
        code: h2.errors.ErrorCodes | None = None,
        *,
        tell_peer: bytes | None = None,
    ) -> None:
        if self.closed:
            return
        if self.transport is not None and (code is not None or tell_peer is not None):
            with contextlib.suppress(Exception):
                self.conn.close_connection(code or h2.errors.ErrorCodes.NO_ERROR, additional_data=tell_peer)
                self._flush_now()
        self.closed = True
        self.close_reason = reason
        if self.transport is not None:
            if tell_peer is not None or code is not None:
                self.transport.close()  # what was flushed (the GOAWAY) goes out first
            else:
                self.transport.abort()
        down = LinkDown(reason)
        for st in list(self.streams.values()):
            if st.error is None:
                st.error = down
            st._wake()
        self._wake_windows()
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)
        for t in list(self._tasks):
            t.cancel()
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()
        if not self.done.done():
            self.done.set_result(reason)
        if self.on_close is not None:
            self.on_close(self, reason)

    def close(self, reason: str = "closed") -> None:
        self._close(reason, h2.errors.ErrorCodes.NO_ERROR)
