"""Byte-level case tables for the sans-I/O HTTP/1.1 module (gateway/core/http1.py): the response
head, its body framing, chunk-size lines and the request bytes. One row a test, each row named.

tests/remote/test_forward.py sends the same kinds of garbage through a real socket and checks that the
connection is discarded; this file pins down, byte for byte, what the parser accepts and refuses.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core import http1
from gateway.core.http1 import CHUNKED, LENGTH, MAX_BODY_BYTES, MAX_HEAD_BYTES, MAX_HEADERS, NONE, UNTIL_CLOSE
from gateway.errors import UompError

CRLF = b"\r\n"


def head(*lines: bytes) -> bytes:
    return CRLF.join(lines) + CRLF + CRLF


OK = b"HTTP/1.1 200 OK"
CL0 = b"Content-Length: 0"


def decide(data: bytes, method: str = "GET") -> tuple[int, int, int, bool] | str:
    """What the client makes of ``data`` (a whole head): (status, mode, length, keep_alive), or
    "pending" (the head has not ended), or the refusal's fixed phrase."""
    try:
        end = http1.head_end(data)
        if end < 0:
            return "pending"
        status, keep_alive, _headers, framing = http1.parse_head(data[:end])
        mode, length, keep_alive = http1.body_framing(method, status, keep_alive, framing)
    except UompError as exc:
        assert exc.code == "UPSTREAM_ERROR"
        assert exc.message.startswith("the memory guard answered with an invalid response (")
        return exc.message.split("(", 1)[1].rstrip(")")
    return status, mode, length, keep_alive


HEADS: list[tuple[str, bytes, str, Any]] = [
    # (id, bytes, method, (status, mode, length, keep_alive) | "pending" | refusal phrase)
    # -- status lines
    ("ok-length", head(OK, b"Content-Length: 5"), "GET", (200, LENGTH, 5, True)),
    ("http10-not-kept", head(b"HTTP/1.0 200 OK", CL0), "GET", (200, LENGTH, 0, False)),
    ("no-reason-phrase", head(b"HTTP/1.1 404", CL0), "GET", (404, LENGTH, 0, True)),
    ("empty-reason-phrase", head(b"HTTP/1.1 404 ", CL0), "GET", (404, LENGTH, 0, True)),
    ("reason-obs-text", head(b"HTTP/1.1 200 \xe9t\xe9", CL0), "GET", (200, LENGTH, 0, True)),
    ("reason-with-tab", head(b"HTTP/1.1 200 O\tK", CL0), "GET", (200, LENGTH, 0, True)),
    ("status-599", head(b"HTTP/1.1 599 X", CL0), "GET", (599, LENGTH, 0, True)),
    ("status-lower-case-http", head(b"http/1.1 200 OK", CL0), "GET", "bad status line"),
    ("status-http2", head(b"HTTP/2 200 OK", CL0), "GET", "bad status line"),
    ("status-http12", head(b"HTTP/1.2 200 OK", CL0), "GET", "bad status line"),
    ("status-two-digits", head(b"HTTP/1.1 20 OK", CL0), "GET", "bad status line"),
    ("status-four-digits", head(b"HTTP/1.1 2000 OK", CL0), "GET", "bad status line"),
    ("status-600", head(b"HTTP/1.1 600 OK", CL0), "GET", "bad status line"),
    ("status-099", head(b"HTTP/1.1 099 OK", CL0), "GET", "bad status line"),
    ("status-leading-space", head(b" HTTP/1.1 200 OK", CL0), "GET", "bad status line"),
    ("status-double-space", head(b"HTTP/1.1  200 OK", CL0), "GET", "bad status line"),
    ("status-no-space-before-reason", head(b"HTTP/1.1 200OK", CL0), "GET", "bad status line"),
    ("status-reason-del", head(b"HTTP/1.1 200 O\x7fK", CL0), "GET", "bad status line"),
    ("status-reason-nul", head(b"HTTP/1.1 200 O\x00K", CL0), "GET", "bad status line"),
    ("status-empty", head(b"", CL0), "GET", "bad status line"),
    ("interim-100", head(b"HTTP/1.1 100 Continue"), "GET", "interim (1xx) response"),
    ("interim-101", head(b"HTTP/1.1 101 Switching Protocols"), "GET", "interim (1xx) response"),
    # -- header fields
    ("value-trimmed", head(OK, b"X-A: \t v \t", CL0), "GET", (200, LENGTH, 0, True)),
    ("value-empty", head(OK, b"X-A:", CL0), "GET", (200, LENGTH, 0, True)),
    ("value-non-ascii", head(OK, b"X-A: caf\xc3\xa9", CL0), "GET", (200, LENGTH, 0, True)),
    ("value-colon-inside", head(OK, b"X-A: a:b", CL0), "GET", (200, LENGTH, 0, True)),
    ("header-folding-space", head(OK, b"X-A: a", b" b", CL0), "GET", "header field without a colon"),
    ("header-folding-tab", head(OK, b"X-A: a", b"\tb", CL0), "GET", "header field without a colon"),
    ("header-folding-with-colon", head(OK, b"X-A: a", b" b: c", CL0), "GET", "bad header field name"),
    ("space-before-colon", head(OK, b"Content-Length : 0"), "GET", "bad header field name"),
    ("name-empty", head(OK, b": x", CL0), "GET", "bad header field name"),
    ("name-not-token", head(OK, b"X(A): 1", CL0), "GET", "bad header field name"),
    ("name-non-ascii", head(OK, b"X\xe9: 1", CL0), "GET", "bad header field name"),
    ("field-without-colon", head(OK, b"Content-Length 0"), "GET", "header field without a colon"),
    ("bare-lf-in-value", head(OK, b"X-A: a\nb", CL0), "GET", "bad header field value"),
    ("bare-lf-after-status", OK + b"\nContent-Length: 0" + CRLF + CRLF, "GET", "bad status line"),
    ("bare-lf-between-fields", head(OK, b"X-A: 1\nX-B: 2", CL0), "GET", "bad header field value"),
    ("bare-cr-in-value", head(OK, b"X-A: a\rb", CL0), "GET", "bad header field value"),
    ("nul-in-value", head(OK, b"X-A: a\x00b", CL0), "GET", "bad header field value"),
    ("fields-at-limit", head(OK, *[b"X-A: a"] * (MAX_HEADERS - 1), CL0), "GET", (200, LENGTH, 0, True)),
    ("fields-over-limit", head(OK, *[b"X-A: a"] * MAX_HEADERS, CL0), "GET", "too many header fields"),
    # -- size of the head
    ("head-at-limit", head(OK, b"X-A: " + b"a" * (MAX_HEAD_BYTES - len(OK) - 7)), "GET", (200, UNTIL_CLOSE, 0, False)),
    ("head-over-limit", head(OK, b"X-A: " + b"a" * (MAX_HEAD_BYTES - len(OK) - 6)), "GET", "header section too large"),
    ("head-unended-over-limit", OK + CRLF + b"X-A: " + b"a" * MAX_HEAD_BYTES, "GET", "header section too large"),
    ("head-unended", OK + CRLF + CL0 + CRLF, "GET", "pending"),
    ("head-ended-by-bare-lfs", OK + b"\nContent-Length: 0\n\n", "GET", "pending"),
    # -- body framing
    ("chunked", head(OK, b"Transfer-Encoding: chunked"), "GET", (200, CHUNKED, 0, True)),
    ("chunked-any-case", head(OK, b"Transfer-Encoding: Chunked"), "GET", (200, CHUNKED, 0, True)),
    ("until-close", head(OK, b"Content-Type: text/plain"), "GET", (200, UNTIL_CLOSE, 0, False)),
    ("no-content-204", head(b"HTTP/1.1 204 No Content", b"Content-Length: 7"), "GET", (204, NONE, 0, True)),
    ("not-modified-304", head(b"HTTP/1.1 304 Not Modified"), "GET", (304, NONE, 0, True)),
    ("head-request", head(OK, b"Content-Length: 10"), "HEAD", (200, NONE, 0, True)),
    ("connection-close", head(OK, CL0, b"Connection: close"), "GET", (200, LENGTH, 0, False)),
    ("connection-list-close", head(OK, CL0, b"Connection: keep-alive, Close"), "GET", (200, LENGTH, 0, False)),
    ("connection-keep-alive", head(OK, CL0, b"Connection: keep-alive"), "GET", (200, LENGTH, 0, True)),
    ("duplicate-cl-same", head(OK, b"Content-Length: 5", b"content-length: 5"), "GET", (200, LENGTH, 5, True)),
    ("duplicate-cl-differs", head(OK, b"Content-Length: 5", b"Content-Length: 6"), "GET", "conflicting Content-Length"),
    ("cl-list-in-one-field", head(OK, b"Content-Length: 5, 5"), "GET", "bad Content-Length"),
    ("cl-negative", head(OK, b"Content-Length: -1"), "GET", "bad Content-Length"),
    ("cl-plus-sign", head(OK, b"Content-Length: +5"), "GET", "bad Content-Length"),
    ("cl-hex", head(OK, b"Content-Length: 0x5"), "GET", "bad Content-Length"),
    ("cl-empty", head(OK, b"Content-Length:"), "GET", "bad Content-Length"),
    ("cl-non-ascii-digit", head(OK, "Content-Length: \u0665".encode()), "GET", "bad Content-Length"),
    ("cl-leading-zeros", head(OK, b"Content-Length: 000000000005"), "GET", (200, LENGTH, 5, True)),
    ("cl-thirteen-digits", head(OK, b"Content-Length: 0000000000005"), "GET", "bad Content-Length"),
    ("cl-at-body-cap", head(OK, b"Content-Length: %d" % MAX_BODY_BYTES), "GET", (200, LENGTH, MAX_BODY_BYTES, True)),
    (
        "cl-over-body-cap",
        head(OK, b"Content-Length: %d" % (MAX_BODY_BYTES + 1)),
        "GET",
        "body larger than the gateway accepts",
    ),
    (
        "cl-and-te",
        head(OK, b"Content-Length: 5", b"Transfer-Encoding: chunked"),
        "GET",
        "both Content-Length and Transfer-Encoding",
    ),
    (
        "te-and-cl",
        head(OK, b"Transfer-Encoding: chunked", b"Content-Length: 5"),
        "GET",
        "both Content-Length and Transfer-Encoding",
    ),
    ("te-gzip", head(OK, b"Transfer-Encoding: gzip"), "GET", "unsupported Transfer-Encoding"),
    ("te-gzip-chunked", head(OK, b"Transfer-Encoding: gzip, chunked"), "GET", "unsupported Transfer-Encoding"),
    (
        "te-twice",
        head(OK, b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"),
        "GET",
        "repeated Transfer-Encoding",
    ),
    (
        "te-on-204-still-checked",
        head(b"HTTP/1.1 204 X", b"Transfer-Encoding: gzip"),
        "GET",
        "unsupported Transfer-Encoding",
    ),
]


@pytest.mark.parametrize(("data", "method", "expected"), [pytest.param(d, m, e, id=i) for i, d, m, e in HEADS])
def test_response_head(data: bytes, method: str, expected: Any) -> None:
    assert decide(data, method) == expected


def test_headers_keep_their_spelling_and_order() -> None:
    status, keep, headers, framing = http1.parse_head(b"HTTP/1.1 200 OK\r\nX-B: 2\r\ncontent-LENGTH: 3\r\nX-A: 1")
    assert (status, keep) == (200, True)
    assert headers == [("X-B", "2"), ("content-LENGTH", "3"), ("X-A", "1")]
    assert framing == {"content-length": ["3"]}


def test_head_end_finds_the_terminator_from_an_offset() -> None:
    data = b"HTTP/1.1 200 OK\r\n\r\nbody"
    assert http1.head_end(data, 0) == 15
    assert http1.head_end(data, 14) == 15  # the resumed search starts 3 bytes before the old end
    assert http1.head_end(bytearray(data[:17]), 0) == -1


# ------------------------------------------------------------------------------------ chunked bodies

CHUNK_LINES: list[tuple[str, bytes, int | str]] = [
    ("zero", b"0", 0),
    ("one-hex-digit", b"a", 10),
    ("upper-case", b"FF", 255),
    ("leading-zeros", b"000010", 16),
    ("extension", b"1;name=value", 1),
    ("extension-after-space", b"1 ;name", 1),
    ("trailing-tab", b"1\t", 1),
    ("twelve-digits", b"ffffffffffff", 0xFFFFFFFFFFFF),
    ("thirteen-digits-overflow", b"1000000000000", "bad chunk size"),
    ("thirteen-zeros", b"0000000000000", "bad chunk size"),
    ("empty", b"", "bad chunk size"),
    ("negative", b"-1", "bad chunk size"),
    ("hex-prefix", b"0x1", "bad chunk size"),
    ("leading-space", b" 1", "bad chunk size"),
    ("two-numbers", b"1 2", "bad chunk size"),
    ("not-hex", b"g", "bad chunk size"),
    ("extension-with-bare-cr", b"1;a\rb", "bad chunk size"),
    ("non-ascii-digit", "\u0661".encode(), "bad chunk size"),
]


@pytest.mark.parametrize(("line", "expected"), [pytest.param(ln, e, id=i) for i, ln, e in CHUNK_LINES])
def test_chunk_size(line: bytes, expected: int | str) -> None:
    try:
        got: int | str = http1.chunk_size(line)
    except UompError as exc:
        assert exc.code == "UPSTREAM_ERROR"
        got = exc.message.split("(", 1)[1].rstrip(")")
    assert got == expected


LINE_ENDS: list[tuple[str, bytes, int | str]] = [
    ("ended", b"5\r\nhello", 1),
    ("not-yet", b"5", -1),
    ("bare-lf-does-not-end", b"5\nhello", -1),
    ("at-limit", b"1;" + b"x" * (http1.MAX_CHUNK_LINE - 2) + CRLF, http1.MAX_CHUNK_LINE),
    ("over-limit", b"1;" + b"x" * (http1.MAX_CHUNK_LINE - 1) + CRLF, "chunk line too long"),
    ("unended-over-limit", b"1;" + b"x" * http1.MAX_CHUNK_LINE, "chunk line too long"),
]


@pytest.mark.parametrize(("buf", "expected"), [pytest.param(b, e, id=i) for i, b, e in LINE_ENDS])
def test_chunk_line_end(buf: bytes, expected: int | str) -> None:
    try:
        got: int | str = http1.line_end(buf)
    except UompError as exc:
        got = exc.message.split("(", 1)[1].rstrip(")")
    assert got == expected


@pytest.mark.parametrize(
    ("received", "ok"),
    [
        pytest.param(MAX_BODY_BYTES, True, id="at-cap"),
        pytest.param(MAX_BODY_BYTES + 1, False, id="over-cap"),
    ],
)
def test_body_cap(received: int, ok: bool) -> None:
    if ok:
        http1.check_body_size(received)
    else:
        with pytest.raises(UompError):
            http1.check_body_size(received)


# ------------------------------------------------------------------------------------ request bytes

REQUESTS: list[tuple[str, dict[str, Any], bytes | None]] = [
    # (id, arguments, exact bytes | None for a refusal)
    (
        "get",
        {"method": "GET", "target": "/v1/memory/a", "headers": {"X-A": "1"}},
        b"GET /v1/memory/a HTTP/1.1\r\nHost: uomp-guard\r\nX-A: 1\r\n\r\n",
    ),
    (
        "post-without-body",
        {"method": "POST", "target": "/v1/x", "headers": {}},
        b"POST /v1/x HTTP/1.1\r\nHost: uomp-guard\r\nContent-Length: 0\r\n\r\n",
    ),
    (
        "put-with-body",
        {"method": "PUT", "target": "/v1/x", "headers": {}, "body": b"{}"},
        b"PUT /v1/x HTTP/1.1\r\nHost: uomp-guard\r\nContent-Length: 2\r\n\r\n{}",
    ),
    (
        "get-with-empty-body",
        {"method": "GET", "target": "/x", "headers": {}, "body": b""},
        b"GET /x HTTP/1.1\r\nHost: uomp-guard\r\nContent-Length: 0\r\n\r\n",
    ),
    (
        "prefix",
        {"method": "GET", "target": "/x", "headers": {}, "prefix": "/guard"},
        b"GET /guard/x HTTP/1.1\r\nHost: uomp-guard\r\n\r\n",
    ),
    (
        "hop-headers-dropped",
        {
            "method": "GET",
            "target": "/x",
            "headers": {
                "Host": "evil",
                "Transfer-Encoding": "chunked",
                "Content-Length": "9",
                "connection": "close",
                "TE": "trailers",
                "Upgrade": "h2c",
                "Expect": "100-continue",
                "X-Kept": "yes",
            },
        },
        b"GET /x HTTP/1.1\r\nHost: uomp-guard\r\nX-Kept: yes\r\n\r\n",
    ),
    (
        "value-utf8-surrogateescape",
        {"method": "GET", "target": "/x", "headers": {"X-A": b"caf\xc3\xa9".decode("utf-8", "surrogateescape")}},
        b"GET /x HTTP/1.1\r\nHost: uomp-guard\r\nX-A: caf\xc3\xa9\r\n\r\n",
    ),
    ("method-lower-case", {"method": "get", "target": "/x", "headers": {}}, None),
    ("method-too-long", {"method": "A" * 17, "target": "/x", "headers": {}}, None),
    ("target-without-slash", {"method": "GET", "target": "x", "headers": {}}, None),
    ("target-absolute-form", {"method": "GET", "target": "http://a/x", "headers": {}}, None),
    ("target-with-space", {"method": "GET", "target": "/a b", "headers": {}}, None),
    ("target-non-ascii", {"method": "GET", "target": "/caf\u00e9", "headers": {}}, None),
    ("name-with-space", {"method": "GET", "target": "/x", "headers": {"X A": "1"}}, None),
    ("name-with-colon", {"method": "GET", "target": "/x", "headers": {"X:A": "1"}}, None),
    ("value-with-crlf", {"method": "GET", "target": "/x", "headers": {"X-A": "1\r\nX-B: 2"}}, None),
    ("value-with-bare-lf", {"method": "GET", "target": "/x", "headers": {"X-A": "1\nX-B: 2"}}, None),
    ("value-with-nul", {"method": "GET", "target": "/x", "headers": {"X-A": "1\x00"}}, None),
]


@pytest.mark.parametrize(("args", "expected"), [pytest.param(a, e, id=i) for i, a, e in REQUESTS])
def test_request_bytes(args: dict[str, Any], expected: bytes | None) -> None:
    kw = {"body": None, "host": "uomp-guard", **args}
    if expected is None:
        with pytest.raises(UompError) as ei:
            http1.serialize_request(**kw)
        assert ei.value.code == "INVALID_REQUEST"
    else:
        assert http1.serialize_request(**kw) == expected
