"""HTTP/1.1 request parsing on the gateway's mTLS listener, byte by byte: real TLS 1.3 with a real
client certificate, the real guard behind it on its Unix socket, one appliance for the module.

What the appliance promises, whatever HTTP server runs the listener: a refused request is a 4xx
with the §8.4 JSON body, never a 5xx, echoes none of its bytes, and reaches no guard handler
(:func:`guard_saw`); a framing refusal also ends the connection. Where a detail is the HTTP
server's choice, not a promise (400 or 414/431, the status line's version, answering a request
before a broken one), only the security property is asserted."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import json
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from gatewaykit import Appliance, appliance, ledger_events
from shortdir import short_dir

from gateway.config import Paths
from gateway.errors import ErrorCode, known_code
from gateway.keys import init_home
from gateway.remote import pathnorm, transport

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

KEY, KEY2 = "/v1/memory/preference.theme", "/v1/memory/preference.lang"  # values "dark", "en"
VALIDATE = "/v1/tokens/validate"  # a POST the gateway forwards; {} asks about the token presented
MARK = "zq-wire-7f3a"  # in every refused request; never in an answer
LIBRARIES = ("aiohttp", "python", "httptools", "llhttp", "uvloop", "cpython")


@dataclasses.dataclass
class Answer:
    status: int
    version: bytes
    headers: list[tuple[str, str]]  # (lower-case name, value), in order
    body: bytes
    raw: bytes  # every byte of it, status line to body

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        assert len(values) <= 1, (name, values)
        return values[0] if values else None

    def error(self) -> str:
        """The §8.4 code of this JSON error answer (its shape checked)."""
        assert (self.header("content-type") or "").startswith("application/json"), self.raw[:300]
        err = json.loads(self.body)["error"]
        assert isinstance(err["message"], str) and known_code(err["code"]) is not None, err
        return str(err["code"])

    def value(self) -> Any:
        assert self.status == 200, self.raw[:400]
        return json.loads(self.body)["value"]


class Wire:
    """One raw connection over TLS 1.3 with the agent's certificate: we write the bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, timeout: float = 5.0) -> Answer:
        """The next answer (an interim 1xx too), body read by its framing."""
        async with asyncio.timeout(timeout):
            raw = status_line = await self.reader.readline()
            assert status_line, "closed by the gateway before an answer"
            version, status, _ = status_line.split(b" ", 2)
            headers = []
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                raw += line
                name, _, value = line.decode("latin-1").partition(":")
                headers.append((name.strip().lower(), value.strip()))
            raw += line
            ans = Answer(int(status), version, headers, b"", raw)
            if ans.status < 200:
                return ans
            if (length := ans.header("content-length")) is not None:
                ans.body = await self.reader.readexactly(int(length))
            elif (ans.header("transfer-encoding") or "").lower() == "chunked":
                while size := int((await self.reader.readline()).split(b";")[0], 16):
                    ans.body += (await self.reader.readexactly(size + 2))[:-2]
                await self.reader.readline()
            else:
                ans.body = await self.reader.read()
            ans.raw += ans.body
            return ans

    async def closed(self, timeout: float = 3.0) -> bytes:
        """Wait for the gateway's close (EOF or reset); whatever came before it (b"": nothing)."""
        data = b""
        try:
            async with asyncio.timeout(timeout):
                while chunk := await self.reader.read(65536):
                    data += chunk
        except TimeoutError:
            pytest.fail(f"the connection is still open after {timeout} s")
        except (OSError, ssl.SSLError):
            pass
        return data

    async def still_open(self, seconds: float = 0.3) -> bool:
        """True when the connection stays open and silent for ``seconds``; False when it is closed."""
        try:
            async with asyncio.timeout(seconds):
                extra = await self.reader.read(1)
        except TimeoutError:
            return True
        except (OSError, ssl.SSLError):
            return False
        assert not extra, f"bytes nobody asked for: {extra!r}"
        return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


@dataclasses.dataclass
class Env:
    app: Appliance
    token: str
    ctx: ssl.SSLContext

    @contextlib.asynccontextmanager
    async def wire(self) -> AsyncIterator[Wire]:
        port = self.app.gateway.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=self.ctx, server_hostname="localhost")
        w = Wire(reader, writer)
        try:
            yield w
        finally:
            w.close()

    def head(self, line: str, *extra: str, auth: bool = True) -> str:
        """A request line and its header lines (Host, then the agent's credentials, then ``extra``),
        CRLF after each, no blank line: the caller ends the head."""
        creds = [f"Authorization: Bearer {self.token}", "X-UOMP-Agent-Id: agent_a"] if auth else []
        return "".join(f"{x}\r\n" for x in (line, "Host: localhost", *creds, *extra))

    def get(self, path: str = KEY, *extra: str, version: str = "HTTP/1.1") -> bytes:
        return (self.head(f"GET {path} {version}", *extra) + "\r\n").encode()

    def post(self, body: bytes, *extra: str) -> bytes:
        head = self.head(f"POST {VALIDATE} HTTP/1.1", "Content-Type: application/json", f"X-Probe: {MARK}", *extra)
        return (head + "\r\n").encode() + body


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[Env]:
    home = Paths(short_dir("uomp-"))
    init_home(home)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UOMP_HOME", str(home.home))
        async with appliance(home) as app:
            agent = app.agent("agent_a")
            grant = await app.grant(agent)  # its read quota (100) is well above this module's ~20 reads
            yield Env(app, grant["token"], agent.ssl())


def guard_saw(env: Env) -> int:
    """Requests on the mTLS listener that reached the guard: it writes their events itself (the
    events the gateway writes alone reach the ledger marked ``origin: gateway``)."""
    return sum(1 for e in ledger_events(env.app.paths, listener="mtls") if e.get("origin") != "gateway")


def served_by_us(ans: Answer) -> None:
    assert ans.header("server") == "uomp-gateway", ans.raw[:300]
    names = " ".join(f"{k}: {v}" for k, v in ans.headers).lower()
    assert not any(lib in names for lib in LIBRARIES), ans.headers
    # an origin server with a clock sends Date (RFC 9110 §6.6.1), within a few seconds of now
    date = ans.header("date")
    assert date is not None and abs(email.utils.parsedate_to_datetime(date).timestamp() - time.time()) < 5, date


async def exchange(env: Env, data: bytes) -> Answer:
    async with env.wire() as w:
        await w.send(data)
        return await w.answer()


async def refused(env: Env, data: bytes, statuses: tuple[int, ...] = (400,), *, closes: bool = True) -> Answer:
    """``data`` is refused: a status of ``statuses`` with the §8.4 body (400: INVALID_REQUEST), none of
    its bytes echoed, no guard handler reached, and (``closes``) the connection then ended."""
    before = guard_saw(env)
    async with env.wire() as w:
        await w.send(data)
        ans = await w.answer()
        assert ans.status in statuses, ans.raw[:300]
        code = ans.error()
        assert code == ErrorCode.INVALID_REQUEST or ans.status != 400, code
        assert MARK.encode() not in ans.raw and env.token.encode() not in ans.raw, ans.raw
        if closes:
            assert await w.closed() == b"", "more bytes after a refusal that ends the connection"
    assert guard_saw(env) == before
    return ans


async def served(env: Env, data: bytes, want: Any = "dark") -> Answer:
    """``data`` is served normally: 200, our Server header, the guard answered it once."""
    before = guard_saw(env)
    ans = await exchange(env, data)
    assert ans.status == 200, ans.raw[:300]
    served_by_us(ans)
    if want is not None:
        assert ans.value() == want
    assert guard_saw(env) == before + 1
    return ans


# ---------------------------------------------------------------------------------------- 1. keep-alive


async def test_keepalive_serves_several_requests_and_connection_close_ends_it(env: Env) -> None:
    before = guard_saw(env)
    async with env.wire() as w:
        for path, want in ((KEY, "dark"), (KEY2, "en")):
            await w.send(env.get(path))
            ans = await w.answer()
            assert ans.value() == want
            served_by_us(ans)
        assert await w.still_open()
        await w.send(env.get(KEY, "Connection: close"))
        ans = await w.answer()
        assert ans.value() == "dark"
        served_by_us(ans)
        assert await w.closed() == b""
    assert guard_saw(env) == before + 3  # one event per request, each answered once


# ---------------------------------------------------------------------------------------- 2. smuggling


def _smuggled(env: Env) -> str:
    # a whole request hidden where a body would be: a server that framed it as the next request
    # would forward it to the guard (guard_saw would count it)
    return env.head(f"GET {KEY2} HTTP/1.1") + "\r\n"


SMUGGLING = {
    "content-length-and-chunked": lambda e: e.post(
        f"0\r\n\r\n{_smuggled(e)}".encode(), f"Content-Length: {5 + len(_smuggled(e))}", "Transfer-Encoding: chunked"
    ),
    "two-content-lengths": lambda e: e.post(
        f"{{}}{_smuggled(e)}".encode(), "Content-Length: 2", f"Content-Length: {2 + len(_smuggled(e))}"
    ),
    "chunked-twice": lambda e: e.post(
        b"2\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding: chunked", "Transfer-Encoding: chunked"
    ),
    "unknown-coding": lambda e: e.post(f"{{}}{_smuggled(e)}".encode(), f"Transfer-Encoding: {MARK}"),
    "chunked-not-last": lambda e: e.post(b"2\r\n{}\r\n0\r\n\r\n", f"Transfer-Encoding: chunked, {MARK}"),
    "obs-fold": lambda e: e.get(KEY, "X-Probe: a", f" {MARK}"),
    "space-before-colon": lambda e: e.get(KEY, f"X-Probe : {MARK}"),
    "bare-lf-head": lambda e: e.get(KEY, f"X-Probe: {MARK}").replace(b"\r\n", b"\n"),
    "bare-lf-one-line": lambda e: e.get(KEY, f"X-Probe: {MARK}\nX-Other: 1"),
    "nul-in-value": lambda e: e.get(KEY, f"X-Probe: {MARK}\x00x"),
    "space-in-target": lambda e: e.get(f"{KEY} {MARK}"),
}


@pytest.mark.parametrize("case", SMUGGLING)
async def test_ambiguous_framing_and_bad_header_bytes_are_refused_and_end_the_connection(env: Env, case: str) -> None:
    await refused(env, SMUGGLING[case](env))


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_well_framed_partners_are_served(env: Env, framing: str) -> None:
    if framing == "chunked":
        data = env.post(b"2\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding: chunked")
    else:
        data = env.post(b"{}", "Content-Length: 2")
    ans = await served(env, data, want=None)
    assert json.loads(ans.body)["valid"] is True
    await served(env, env.get(KEY, f"X-Probe: {MARK}"))  # the header lines above, well formed


@pytest.mark.parametrize("coding", ["gzip, chunked", f"{MARK}, chunked"])
async def test_a_transfer_coding_the_gateway_does_not_implement_is_refused(env: Env, coding: str) -> None:
    # RFC 9112 §6.1 suggests 501 for a coding not understood: 400 and 501 are both acceptable refusals
    await refused(env, env.post(b"2\r\n{}\r\n0\r\n\r\n", f"Transfer-Encoding: {coding}"), (400, 501))


# ---------------------------------------------------------------------------------------- 3. pipelining


async def test_pipelined_requests_are_answered_in_order(env: Env) -> None:
    before = guard_saw(env)
    async with env.wire() as w:
        await w.send(env.get(KEY) + env.get(KEY2) + env.get(KEY))
        assert [(await w.answer()).value() for _ in range(3)] == ["dark", "en", "dark"]
        assert await w.still_open()
    assert guard_saw(env) == before + 3


async def test_garbage_after_a_pipelined_request_is_refused_and_ends_the_connection(env: Env) -> None:
    before = guard_saw(env)
    async with env.wire() as w:
        await w.send(env.get(KEY) + f"\x01\x02{MARK} garbage\r\n\r\n".encode())
        answers = [await w.answer()]
        if answers[0].status == 200:
            answers.append(await w.answer())
        assert await w.closed() == b""
    # The valid request is answered in full or not at all, then the refusal: [200, 400] or [400]
    # (a server that parses the whole write before answering), either is safe.
    assert [a.status for a in answers] in ([400], [200, 400]), [a.raw[:200] for a in answers]
    if len(answers) == 2:
        assert answers[0].value() == "dark"
    assert answers[-1].error() == ErrorCode.INVALID_REQUEST and MARK.encode() not in answers[-1].raw
    assert guard_saw(env) == before + len(answers) - 1  # the guard saw exactly the requests answered 200


# ---------------------------------------------------------------------------------------- 4. limits


async def test_heads_over_the_limits_are_refused(env: Env) -> None:
    limit = env.app.gateway.cfg.max_header_bytes
    # 400, or the precise 414 (target) / 431 (header line, header count)
    long_target = f"{KEY}?{MARK}=" + "a" * limit
    await refused(env, env.get(long_target), (400, 414))
    await refused(env, env.get(KEY, f"X-Probe: {MARK}{'a' * limit}"), (400, 431))
    await refused(env, env.get(KEY, f"X-Probe: {MARK}", *(f"X-H{i}: v" for i in range(61))), (400, 431))


async def test_heads_within_the_limits_are_served(env: Env) -> None:
    limit = env.app.gateway.cfg.max_header_bytes
    # The longest target the gateway routes (pathnorm's own bounds: a longer one, still under
    # max_header_bytes, is pathnorm's 400 'length', pinned in tests/remote/test_pathnorm.py).
    await served(env, env.get(f"{KEY}?pad=" + "a" * (pathnorm.MAX_QUERY_LENGTH - 4)))
    # One header line that fills the whole head to just under the limit (whether a server bounds
    # each line or the whole head, this fits).
    data = env.get(KEY, "X-Probe: " + "a" * (limit - 64 - len(env.get(KEY, "X-Probe: "))))
    assert len(data) == limit - 64
    await served(env, data)
    await served(env, env.get(KEY, *(f"X-H{i}: v" for i in range(61))))  # 64 header lines in all


# ---------------------------------------------------------------------------------------- 5. body size


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_over_max_body_bytes_is_413_and_the_sender_reads_it(env: Env, framing: str) -> None:
    limit = env.app.gateway.cfg.max_body_bytes
    # the body is a run of valid requests: one taken for the next request would reach the guard
    filler = (env.get(KEY2) * (limit // len(env.get(KEY2)) + 2))[: limit + 4096]
    if framing == "chunked":
        step = 16 * 1024
        body = b"".join(
            b"%x\r\n%s\r\n" % (len(c), c) for c in (filler[i : i + step] for i in range(0, len(filler), step))
        )
        head, body = env.post(b"", "Transfer-Encoding: chunked"), body + b"0\r\n\r\n"
    else:
        head, body = env.post(b"", f"Content-Length: {len(filler)}"), filler
    before, refusals, follow = guard_saw(env), len(ledger_events(env.app.paths, code="PAYLOAD_TOO_LARGE")), 0
    async with env.wire() as w:
        await w.send(head)

        async def keep_sending() -> None:
            with contextlib.suppress(OSError, ssl.SSLError, RuntimeError):
                for i in range(0, len(body), 64 * 1024):
                    await w.send(body[i : i + 64 * 1024])

        sender = asyncio.create_task(keep_sending())
        try:
            ans = await w.answer(timeout=10.0)  # read while still sending: no reset before the answer
        finally:
            await asyncio.wait_for(sender, 10.0)
        assert ans.status == 413 and ans.error() == ErrorCode.PAYLOAD_TOO_LARGE, ans.raw[:300]
        served_by_us(ans)
        # The rest is read and dropped; the connection may then close or go on. Either way none of
        # the body is ever taken as a request.
        if await w.still_open(0.5):
            await w.send(env.get(KEY, "Connection: close"))
            assert (await w.answer()).value() == "dark"
            follow = 1
    assert guard_saw(env) == before + follow
    assert len(ledger_events(env.app.paths, code="PAYLOAD_TOO_LARGE")) == refusals + 1  # its one event


# ---------------------------------------------------------------------------------------- 6. expect, HTTP/1.0


async def test_expect_100_continue_then_the_answer(env: Env) -> None:
    before = guard_saw(env)
    async with env.wire() as w:
        await w.send(env.post(b"", "Content-Length: 2", "Expect: 100-continue"))
        ans = await w.answer()
        if ans.status == 100:  # 100 Continue first, or the final answer at once: both are HTTP/1.1
            await w.send(b"{}")
            ans = await w.answer()
        assert ans.status == 200 and json.loads(ans.body)["valid"] is True, ans.raw[:300]
        served_by_us(ans)
    assert guard_saw(env) == before + 1


async def test_http_1_0_without_keepalive_is_answered_then_closed(env: Env) -> None:
    before = guard_saw(env)
    async with env.wire() as w:
        await w.send(env.get(KEY, version="HTTP/1.0"))
        ans = await w.answer()
        assert ans.value() == "dark" and ans.version in (b"HTTP/1.0", b"HTTP/1.1")
        served_by_us(ans)
        assert await w.closed() == b""
    assert guard_saw(env) == before + 1


async def test_http_1_0_keepalive_is_told_the_connection_stays_and_is_served_again(env: Env) -> None:
    # as ab -k asks: an HTTP/1.0 client keeps its connection only when the answer says keep-alive
    before = guard_saw(env)
    async with env.wire() as w:
        for path, want in ((KEY, "dark"), (KEY2, "en")):
            await w.send(env.get(path, "Connection: Keep-Alive", version="HTTP/1.0"))
            ans = await w.answer()
            assert ans.value() == want and (ans.header("connection") or "").lower() == "keep-alive", ans.raw[:300]
            served_by_us(ans)
    assert guard_saw(env) == before + 2


# ---------------------------------------------------------------------------------------- 7. plain HTTP


async def test_plain_http_on_the_tls_port_is_told_to_use_https(env: Env) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", env.app.gateway.port)
    try:
        writer.write(f"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nX-Probe: {MARK}\r\n\r\n".encode())
        async with asyncio.timeout(5):
            data = await reader.read()
    finally:
        writer.close()
    assert data == transport.USE_HTTPS
    assert not any(lib.encode() in data.lower() for lib in LIBRARIES)


# ---------------------------------------------------------------------------------------- 8. methods, targets


async def test_an_unknown_method_is_a_4xx(env: Env) -> None:
    # llhttp knows no such method: 400 while parsing, or 405 from routing. Never a 5xx.
    await refused(env, env.get(KEY, f"X-Probe: {MARK}").replace(b"GET ", b"FOO ", 1), (400, 405), closes=False)


async def test_trace_is_405_and_echoes_nothing(env: Env) -> None:
    ans = await refused(env, env.get(KEY, f"X-Probe: {MARK}").replace(b"GET ", b"TRACE ", 1), (405,), closes=False)
    assert ans.error() == ErrorCode.METHOD_NOT_ALLOWED
    served_by_us(ans)


async def test_an_absolute_form_target_is_refused_by_the_gateway(env: Env) -> None:
    ans = await refused(env, env.get(f"https://localhost{KEY}", f"X-Probe: {MARK}"), closes=False)
    assert json.loads(ans.body)["error"]["details"]["rule"] == "origin"  # pathnorm: origin-form only
    served_by_us(ans)
    await served(env, env.get(KEY, f"X-Probe: {MARK}"))  # the partner: the same request in origin form


# ---------------------------------------------------------------------------------------- 9. repeated headers


HEADERS = {
    "host-twice": lambda e: e.get(KEY, f"X-Probe: {MARK}", "Host: localhost"),
    "host-twice-other-case": lambda e: e.get(KEY, f"X-Probe: {MARK}", "host: localhost"),
    "agent-id-twice": lambda e: e.get(KEY, f"X-Probe: {MARK}", "X-UOMP-Agent-Id: agent_a"),
    # identical values frame the body one way only (RFC 9112 §6.3 lets a server accept them), but
    # Content-Length is single-valued here (contract.SINGLE_VALUED)
    "content-length-twice-same-value": lambda e: e.post(b"{}", *["Content-Length: 2"] * 2),
    "no-host": lambda e: e.get(KEY, f"X-Probe: {MARK}").replace(b"Host: localhost\r\n", b""),
}


@pytest.mark.parametrize("case", HEADERS)
async def test_a_missing_host_or_a_repeated_single_valued_header_is_400(env: Env, case: str) -> None:
    # refused by the parser or by contract.header_problem; closing is not pinned.
    await refused(env, HEADERS[case](env), closes=False)


async def test_a_repeated_authorization_header_is_400_from_the_gateway(env: Env) -> None:
    ans = await refused(env, env.get(KEY, f"X-Probe: {MARK}", f"Authorization: Bearer {env.token}"), closes=False)
    served_by_us(ans)


# ---------------------------------------------------------------------------------------- 10. Server header


@pytest.mark.parametrize("case", ["content-length-and-chunked", "nul-in-value", "too-many-headers", "second-host"])
async def test_a_parser_refusal_names_no_library(env: Env, case: str) -> None:
    data = {
        "too-many-headers": lambda e: e.get(KEY, *(f"X-H{i}: v" for i in range(70))),
        "second-host": lambda e: e.get(KEY, "Host: localhost"),
        **SMUGGLING,
    }[case](env)
    served_by_us(await exchange(env, data))


@pytest.mark.parametrize(
    "body",
    [b"2\r\n{}\r\nzz\r\n", b"2\r\n{}XX0\r\n\r\n", b"1ffffffffffffffff\r\n{}\r\n0\r\n\r\n"],
    ids=["bad-size", "no-crlf-after-data", "size-overflow"],
)
async def test_a_malformed_chunked_body_is_a_4xx_never_a_5xx(env: Env, body: bytes) -> None:
    """Broken framing inside the body, after the head was accepted: the request is refused (4xx,
    the §8.4 JSON, nothing echoed), the connection ends, and the guard never sees it. (A chunk size
    that can be read but whose bytes never come is the body deadline's business:
    tests/remote/test_keepalive_deadlines.py.)"""
    await refused(env, env.post(b"", "Transfer-Encoding: chunked") + body)
    # the partner: the same request, well framed, is served
    await served(env, env.post(b"", "Transfer-Encoding: chunked") + b"2\r\n{}\r\n0\r\n\r\n", want=None)
