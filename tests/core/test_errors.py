"""gateway.errors: the ErrorCode enum, its one status mapping, checked conversion, the wire shape."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from guardkit import running_guard

from gateway.config import Paths
from gateway.errors import STATUS, ErrorCode, UompError, known_code, parse_code

ROOT = Path(__file__).resolve().parents[2]


def test_every_code_has_exactly_one_status() -> None:
    assert set(STATUS) == set(ErrorCode)
    for code in ErrorCode:
        assert code.name == code.value  # the member name is the wire value
        assert 400 <= STATUS[code] <= 599, code


@pytest.mark.parametrize("code", list(ErrorCode), ids=str)
def test_error_carries_its_codes_status(code: ErrorCode) -> None:
    err = UompError(code, "what happened")
    assert err.status == STATUS[code]
    assert err.code is code


def test_spec_codes_keep_their_statuses() -> None:
    spec = {
        "INVALID_TOKEN": 401,
        "TOKEN_EXPIRED": 401,
        "SESSION_REVOKED": 401,
        "ACCESS_DENIED": 403,
        "QUOTA_EXCEEDED": 429,
        "WRITE_NOT_AVAILABLE": 403,
        "STORE_UNAVAILABLE": 503,
        "SESSION_NOT_FOUND": 404,
        "INVALID_REQUEST": 400,
    }
    assert {name: STATUS[ErrorCode(name)] for name in spec} == spec


def test_no_per_call_status_override() -> None:
    with pytest.raises(TypeError):
        UompError(ErrorCode.INVALID_REQUEST, "x", status=431)  # type: ignore[call-arg]


@pytest.mark.parametrize("value", ["INVALID_TOKN", "invalid_token", "", " INVALID_TOKEN", "HTTP_500", "OK"], ids=repr)
def test_unknown_strings_are_refused_at_conversion(value: str) -> None:
    with pytest.raises(ValueError):
        ErrorCode(value)
    with pytest.raises(ValueError):
        UompError(value, "x")  # type: ignore[arg-type]
    assert known_code(value) is None
    assert parse_code(value, ErrorCode.UPSTREAM_ERROR) is ErrorCode.UPSTREAM_ERROR


@pytest.mark.parametrize(
    "value", [None, 401, 4.0, ["INVALID_TOKEN"], {"code": "INVALID_TOKEN"}, b"INVALID_TOKEN"], ids=repr
)
def test_non_strings_are_refused_at_conversion(value: object) -> None:
    assert known_code(value) is None
    assert parse_code(value, ErrorCode.SESSION_REVOKED) is ErrorCode.SESSION_REVOKED


def test_known_strings_convert() -> None:
    assert known_code("TOKEN_EXPIRED") is ErrorCode.TOKEN_EXPIRED
    assert parse_code("REFRESH_REUSED", ErrorCode.UPSTREAM_ERROR) is ErrorCode.REFRESH_REUSED


def test_wire_format_is_the_plain_string() -> None:
    err = UompError(ErrorCode.SESSION_REVOKED, "gone", session_id="s1", details={"n": 1})
    body = err.body()
    assert type(body["error"]["code"]) is str
    assert json.dumps(body, separators=(",", ":")) == (
        '{"error":{"code":"SESSION_REVOKED","message":"gone","session_id":"s1","details":{"n":1}}}'
    )
    assert json.dumps({"c": ErrorCode.INTERNAL}) == '{"c": "INTERNAL"}'  # a member that slips into JSON as is
    assert str(err) == "SESSION_REVOKED: gone"
    assert f"{ErrorCode.NOT_FOUND}" == "NOT_FOUND"


def test_a_misspelt_code_is_a_type_error(tmp_path: Path) -> None:
    """mypy (strict, as in CI) refuses a misspelt member and a bare string where an ErrorCode is due."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from gateway.errors import ErrorCode, UompError\n"
        "UompError(ErrorCode.INVALID_TOKEN, 'fine')\n"
        "UompError(ErrorCode.INVALD_TOKEN, 'typo')\n"
        "UompError('INVALID_TOKEN', 'a bare string')\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--follow-imports=silent",
            "--config-file=",
            str(probe),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ": error:" in ln]
    assert any("probe.py:3:" in ln and "INVALD_TOKEN" in ln for ln in lines), out.stdout
    assert any("probe.py:4:" in ln and "ErrorCode" in ln for ln in lines), out.stdout
    assert not any("probe.py:2:" in ln for ln in lines), out.stdout


async def _raw(paths: Paths, data: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_unix_connection(str(paths.guard_sock))
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


async def test_guard_answers_refused_requests_with_the_transport_status_and_json(home: Paths) -> None:
    """A request aiohttp refuses before any handler keeps aiohttp's status; the body is §8.4 JSON.
    Partners: a routed refusal gets its code's status (404, 401 with WWW-Authenticate)."""
    async with running_guard(home):
        status, headers, body = await _raw(home, b"GARBAGE\r\n\r\n")
        assert status == 400
        assert json.loads(body) == {"error": {"code": "INVALID_REQUEST", "message": "malformed or oversized request"}}
        assert "www-authenticate" not in headers

        status, headers, body = await _raw(
            home, b"GET /v1/health HTTP/1.1\r\nHost: g\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
        )
        assert status == 400 and json.loads(body)["error"]["code"] == "INVALID_REQUEST"

        status, headers, body = await _raw(home, b"GET /no/such/route HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
        assert status == 404 and json.loads(body)["error"]["code"] == "NOT_FOUND"

        status, headers, body = await _raw(
            home,
            b"POST /v1/sessions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
        )
        assert status == 401 and json.loads(body)["error"]["code"] == "UNAUTHORIZED"
        assert headers["www-authenticate"] == 'Bearer realm="uomp"'
