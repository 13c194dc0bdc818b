"""The HTTP/1.1 wire format of the gateway's hop to the guard, without I/O (RFC 9112).

Bytes in, decisions out: where a response head ends, what it says (:func:`parse_head`), how its
body is framed (:func:`body_framing`), what a chunk-size line means (:func:`chunk_size`), and the
bytes of a request (:func:`serialize_request`). No socket, no event loop: the connection pool in
:mod:`gateway.remote.upstream` does the reading and writing and asks this module at each step.
``tests/core/test_http1.py`` holds the byte-level case table.

Strict by design (the only server on the other end is our own guard): a status line
``HTTP/1.x DDD ...`` with DDD in 100..599; at most :data:`MAX_HEAD_BYTES` of head and
:data:`MAX_HEADERS` fields; field names are RFC 9110 tokens (so no obs-fold, no space before the
colon); no CR, LF or NUL inside a line (a bare LF or CR is refused); the body framed by one
``Content-Length`` value (repeats must agree) or ``Transfer-Encoding: chunked`` (exactly that
coding, once) or, failing both, by the connection's close; ``Content-Length`` together with
``Transfer-Encoding`` is refused (RFC 9112 §6.1: a smuggling vector), as is a 1xx answer. Every
refusal is ``UompError(ErrorCode.UPSTREAM_ERROR)`` with a fixed phrase, never the upstream's bytes (they
may hold a memory value).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from mypy_extensions import mypyc_attr

from gateway.errors import ErrorCode, UompError

MAX_HEAD_BYTES = 32 * 1024  # status line + header fields of one answer
MAX_HEADERS = 100  # header fields of one answer
MAX_CHUNK_LINE = 1024  # one chunk-size line (with extensions) or trailer line
MAX_TRAILERS = 32
MAX_BODY_BYTES = 1 << 30  # 1 GiB: a tag read may return up to 1,000 items of up to 1 MiB
MAX_CONTENT_LENGTH_DIGITS = 12

# Never taken from a caller: framing and routing are this client's business (RFC 9110 §7.6.1).
HOP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "proxy-authorization",
        "expect",
    }
)

# How a response body is framed (see body_framing).
LENGTH, CHUNKED, UNTIL_CLOSE, NONE = range(4)

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_METHOD = re.compile(r"[A-Z]{1,16}")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
BAD_TARGET = re.compile(r"[^\x21-\x7e]")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9]{2})(?: [\t\x20-\x7e\x80-\xff]*)?")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,12})[ \t]*(?:;[^\r\n]*)?")
_BODYLESS = (204, 304)
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})
_NAMES: dict[str, str] = {}  # field names already checked -> lower case (bounded: see field_name)
MAX_NAME_CACHE = 512

Headers = list[tuple[str, str]]
Framing = dict[str, list[str]]  # the framing fields (content-length, transfer-encoding, connection)


def field_name(name: str) -> str | None:
    """``name`` lower-cased if it is an RFC 9110 token, else None (results remembered, bounded)."""
    low = _NAMES.get(name)
    if low is None:
        if _TOKEN.fullmatch(name) is None:
            return None
        low = name.lower()
        if len(_NAMES) < MAX_NAME_CACHE:
            _NAMES[name] = low
    return low


def garbage(what: str) -> UompError:
    """UPSTREAM_ERROR for an invalid guard answer, named by a fixed phrase (never the upstream's bytes)."""
    # ``what`` is a fixed phrase: never the upstream's bytes (they may hold a memory value)
    return UompError(ErrorCode.UPSTREAM_ERROR, f"the memory guard answered with an invalid response ({what})")


def head_end(buf: bytes | bytearray, start: int = 0) -> int:
    """Index of the CRLF CRLF that ends the head in ``buf`` (searching from ``start``), -1 when it
    has not arrived yet; refuses a head longer than :data:`MAX_HEAD_BYTES` either way."""
    i = buf.find(b"\r\n\r\n", start)
    if i > MAX_HEAD_BYTES or (i < 0 and len(buf) > MAX_HEAD_BYTES):
        raise garbage("header section too large")
    return i


def line_end(buf: bytes | bytearray, start: int = 0) -> int:
    """Index of the CRLF that ends a chunk-size or trailer line, -1 when not there yet; refuses a
    line longer than :data:`MAX_CHUNK_LINE`."""
    i = buf.find(b"\r\n", start)
    if i > MAX_CHUNK_LINE or (i < 0 and len(buf) > MAX_CHUNK_LINE):
        raise garbage("chunk line too long")
    return i


def parse_head(head: bytes) -> tuple[int, bool, Headers, Framing]:
    """(status, keep_alive, headers, framing fields by lower-case name) of a head without its final
    CRLF CRLF; UPSTREAM_ERROR on anything not strictly HTTP/1.x."""
    lines = head.split(b"\r\n")
    m = _STATUS_LINE.fullmatch(lines[0])
    if m is None:
        raise garbage("bad status line")
    if len(lines) - 1 > MAX_HEADERS:
        raise garbage("too many header fields")
    crlfs = len(lines) - 1
    if head.count(b"\r") != crlfs or head.count(b"\n") != crlfs or b"\x00" in head:
        raise garbage("bad header field value")  # a CR, LF or NUL that does not end a line
    headers: Headers = []
    framing: Framing = {}
    for raw in lines[1:]:
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep:
            raise garbage("header field without a colon")
        low = field_name(name)  # a token: also refuses obs-fold (a leading space) and space before ':'
        if low is None:
            raise garbage("bad header field name")
        value = value.strip(" \t")
        headers.append((name, value))
        if low in _FRAMING:
            framing.setdefault(low, []).append(value)
    return int(m.group(2)), m.group(1) == b"1", headers, framing


def body_framing(method: str, status: int, keep_alive: bool, framing: Framing) -> tuple[int, int, bool]:
    """(mode, length, keep_alive) of a response's body: mode is :data:`LENGTH` (``length`` bytes),
    :data:`CHUNKED`, :data:`UNTIL_CLOSE` (the connection is then not reused) or :data:`NONE`."""
    if status < 200:
        raise garbage("interim (1xx) response")
    length: str | None = None
    coding: str | None = None
    if "content-length" in framing:
        lengths = framing["content-length"]
        if any(v != lengths[0] for v in lengths):
            raise garbage("conflicting Content-Length")
        length = lengths[0]
    if "transfer-encoding" in framing:
        if len(framing["transfer-encoding"]) > 1:
            raise garbage("repeated Transfer-Encoding")
        coding = framing["transfer-encoding"][0]
    for v in framing.get("connection", ()):
        if "close" in {t.strip().lower() for t in v.split(",")}:
            keep_alive = False
    if coding is not None:
        if length is not None:
            raise garbage("both Content-Length and Transfer-Encoding")
        if coding.lower() != "chunked":
            raise garbage("unsupported Transfer-Encoding")
    n = 0
    if length is not None:
        if not (length.isascii() and length.isdigit()) or len(length) > MAX_CONTENT_LENGTH_DIGITS:
            raise garbage("bad Content-Length")
        n = int(length)
        if n > MAX_BODY_BYTES:
            raise garbage("body larger than the gateway accepts")
    if method == "HEAD" or status in _BODYLESS:
        return NONE, 0, keep_alive
    if coding is not None:
        return CHUNKED, n, keep_alive
    if length is not None:
        return LENGTH, n, keep_alive
    return UNTIL_CLOSE, n, False


def chunk_size(line: bytes) -> int:
    """The size in a chunk-size line (extensions ignored); at most 12 hex digits."""
    m = _CHUNK_SIZE.fullmatch(line)
    if m is None:
        raise garbage("bad chunk size")
    return int(m.group(1), 16)


def check_body_size(received: int) -> None:
    """Refuses a guard answer whose body passed :data:`MAX_BODY_BYTES`."""
    if received > MAX_BODY_BYTES:
        raise garbage("body larger than the gateway accepts")


@mypyc_attr(native_class=False)  # compiled (gateway/native.py): a native class cannot subclass str
class HeaderBlock(str):
    """Header lines already checked by :func:`header_block` (a ``str`` of ``Name: value\r\n`` lines):
    a caller that sends the same headers on many requests checks them once."""

    __slots__ = ()


def header_block(headers: Mapping[str, str]) -> HeaderBlock:
    """``headers`` minus :data:`HOP_HEADERS` as header lines, each name an RFC 9110 token and no
    value holding CR, LF or NUL; else ``INVALID_REQUEST`` (a header that cannot be forwarded)."""
    parts = []
    values = []
    for k, v in headers.items():
        low = field_name(k)
        if low is None:
            raise UompError(ErrorCode.INVALID_REQUEST, "a request header cannot be forwarded")
        if low in HOP_HEADERS:
            continue
        parts.append(f"{k}: {v}\r\n")
        values.append(v)
    if _BAD_VALUE.search("".join(values)):  # one scan for CR, LF or NUL in any value
        raise UompError(ErrorCode.INVALID_REQUEST, "a request header cannot be forwarded")
    return HeaderBlock("".join(parts))


def serialize_request(
    method: str,
    target: str,
    headers: Mapping[str, str],
    body: bytes | None,
    *,
    host: str,
    prefix: str = "",
    block: HeaderBlock | None = None,
) -> bytes:
    """The bytes of one request: ``METHOD prefix+target HTTP/1.1``, ``Host``, the header lines of
    ``block`` (from :func:`header_block`), the caller's headers minus :data:`HOP_HEADERS`, and
    ``Content-Length`` when there is a body (always for POST, PUT, PATCH). A method, target or
    header that cannot be sent unambiguously is refused (``INVALID_REQUEST``), never passed on."""
    if _METHOD.fullmatch(method) is None:
        raise UompError(ErrorCode.INVALID_REQUEST, "method cannot be forwarded")
    if not target.startswith("/") or BAD_TARGET.search(target):
        raise UompError(ErrorCode.INVALID_REQUEST, "request target cannot be forwarded")
    if block is not None and not isinstance(block, HeaderBlock):
        raise TypeError("block must come from header_block()")
    parts = [f"{method} {prefix}{target} HTTP/1.1\r\nHost: {host}\r\n", block or "", header_block(headers)]
    if body is not None or method in ("POST", "PUT", "PATCH"):
        parts.append(f"Content-Length: {len(body) if body else 0}\r\n")
    parts.append("\r\n")
    # aiohttp hands header values over as UTF-8 with surrogateescape: send the original bytes
    head = "".join(parts).encode("utf-8", "surrogateescape")
    return head + body if body else head
