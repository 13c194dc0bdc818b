"""The speed levers are correct (their speed is measured in benchmarks/, never here):

* gateway/jsonio.py answers exactly as the standard library (values, big integers, non-ASCII,
  floats, refusals);
* gateway/eventloop.py runs uvloop by default and asyncio's loop when switched off;
* the servers parse HTTP with llhttp, aiohttp's C extensions are what the SDK's client and the
  chain clients use, and ``uomp doctor`` says both;
* the decoded-session cache (gateway/guard/sessions.py) never outlives a revocation: revoked through
  the admin API (same process) or by ``uomp sessions revoke`` (another process, writing auth.db
  itself), the very next read is refused; expiry likewise.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sqlite3
import subprocess
import sys
from typing import Any

import pytest
from guardkit import admin_headers, call, grant, running_guard, seed, unix_session
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import eventloop, jsonio
from gateway.config import Paths

UOMP = [sys.executable, "-m", "gateway.cli.main"]
READ = {"tags": ["preference"], "keys": []}


# ----------------------------------------------------------------------------------- jsonio


def _std_dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _outcome(fn: Any, arg: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(arg))
    except Exception as exc:  # the refusal's type is part of the contract
        return ("error", type(exc).__mro__[1] if isinstance(exc, json.JSONDecodeError) else type(exc))


def _same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN and int/float kinds kept apart (1 vs 1.0)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.text()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([2**64, -(2**63) - 1, 2**63]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_jsonio_round_trips_like_the_standard_library(value: Any) -> None:
    wire = jsonio.dumps(value)
    assert _same(json.loads(wire), json.loads(_std_dumps(value)))  # same document on the wire
    assert _same(jsonio.loads(wire), json.loads(wire))
    assert _same(jsonio.loads(wire.decode("utf-8")), json.loads(wire))


@pytest.mark.parametrize(
    "text",
    [
        "18446744073709551616",
        "-9223372036854775809",
        "123456789012345678901234567890",
        '{"n": 99999999999999999999999, "s": "12345678901234567890"}',
        "9223372036854775807",
        '"été ✓ 𝄞"',
        '"\\u00e9\\ud834\\udd1e"',
        "1e16",
        "1e-7",
        "-0",
        "-0.0",
        "0.1",
        "1.7976931348623157e308",
    ],
)
def test_jsonio_loads_accepts_exactly_what_json_accepts(text: str) -> None:
    for data in (text, text.encode("utf-8")):
        got, want = _outcome(jsonio.loads, data), _outcome(json.loads, data)
        assert got[0] == want[0] == "ok" and _same(got[1], want[1]), (text, got, want)


def test_jsonio_loads_keeps_integers_beyond_64_bits_exact() -> None:
    for n in (2**64, 2**64 + 1, -(2**63) - 1, 10**30 + 7):
        got = jsonio.loads(f'{{"n": {n}}}'.encode())["n"]
        assert type(got) is int and got == n  # orjson alone would answer a float here


@pytest.mark.parametrize(
    "text",
    [
        "NaN",
        "-Infinity",
        "1e999",
        '"\\ud800"',
        "[1,]",
        "{'a': 1}",
        '"\x01"',
        "",
        "01",
        '{"a"}',
        "[" * 5000,
        b"\xff\xfe",
    ],
)
def test_jsonio_loads_refuses_or_accepts_the_oddities_as_json_does(text: str | bytes) -> None:
    got, want = _outcome(jsonio.loads, text), _outcome(json.loads, text)
    assert got[0] == want[0], (text, got, want)
    if got[0] == "ok":
        assert _same(got[1], want[1])
    else:
        assert got[1] is want[1]


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        [1, {"a": float("inf")}],
        {"x": -float("inf")},
        {1: "int key"},
        {"big": 2**80},
        {"s": "é\u2028"},
        object(),
        {"a": {1, 2}},
        "\ud800",
    ],
)
def test_jsonio_dumps_refuses_what_json_refuses(value: Any) -> None:
    got, want = _outcome(jsonio.dumps, value), _outcome(_std_dumps, value)
    assert got[0] == want[0], (value, got, want)
    if got[0] == "ok":
        assert json.loads(got[1]) == json.loads(want[1])
    else:
        assert issubclass(got[1], want[1]) or issubclass(want[1], got[1])


def test_jsonio_uses_orjson() -> None:
    assert jsonio.backend().startswith("orjson"), "orjson is a dependency: the hot path should use it"


# ------------------------------------------------------------------------------- event loop


async def _loop_kind() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_runs_the_servers_by_default_and_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UOMP_UVLOOP", raising=False)
    assert eventloop.run(_loop_kind()).startswith("uvloop")
    assert eventloop.describe().startswith("uvloop")
    for off in ("0", "off", "false"):
        monkeypatch.setenv("UOMP_UVLOOP", off)
        assert eventloop.run(_loop_kind()).startswith("asyncio")
        assert eventloop.describe() == "asyncio (UOMP_UVLOOP=0)"


def test_aiohttp_c_extensions_are_active_and_doctor_says_so(home: Paths) -> None:
    import aiohttp.http_parser as hp
    import aiohttp.http_websocket  # noqa: F401  (imported by the server; must not need pure Python)

    assert hp.HttpRequestParser.__module__ == "aiohttp._http_parser"
    assert hp.HttpResponseParser.__module__ == "aiohttp._http_parser"
    out = subprocess.run([*UOMP, "--home", str(home.home), "doctor"], capture_output=True, text=True, timeout=60)
    assert "aiohttp C extensions active" in out.stdout, out.stdout
    assert "HTTP servers parse with llhttp (httptools " in out.stdout, out.stdout
    assert "event loop uvloop" in out.stdout and "JSON orjson" in out.stdout
    assert "request path compiled (" in out.stdout, out.stdout
    off = subprocess.run(
        [*UOMP, "--home", str(home.home), "doctor"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "AIOHTTP_NO_EXTENSIONS": "1", "UOMP_UVLOOP": "0", "UOMP_NATIVE": "0"},
    )
    assert "aiohttp C extensions OFF" in off.stdout, off.stdout
    assert "event loop asyncio (UOMP_UVLOOP=0)" in off.stdout
    assert "request path plain Python (UOMP_NATIVE=0)" in off.stdout


# -------------------------------------------------------------------- session cache + revocation


@pytest.fixture
def seeded(home: Paths) -> Paths:
    seed(home)
    return home


async def test_revoked_through_the_admin_api_the_next_read_is_refused(seeded: Paths) -> None:
    async with running_guard(seeded) as runner, unix_session(seeded) as s:
        g = await grant(s, seeded, read=READ)
        auth = runner.services.auth  # type: ignore[union-attr]
        for _ in range(3):
            status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=g["token"])
            assert status == 200, body
        assert auth.rows.hits >= 2  # the cache is what answers the status check (so this test means something)
        status, body, _ = await call(s, "POST", f"/v1/sessions/{g['session_id']}/revoke", headers=admin_headers(seeded))
        assert status == 200, body
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=g["token"])
        assert status in (401, 403) and body["error"]["code"] == "SESSION_REVOKED", body
        # another session of the same guard is untouched (the cache forgot one row, not the service)
        g2 = await grant(s, seeded, read=READ)
        status, _, _ = await call(s, "GET", "/v1/memory/preference.theme", token=g2["token"])
        assert status == 200


async def test_revoked_by_another_process_the_next_read_is_refused(seeded: Paths) -> None:
    async with running_guard(seeded) as runner, unix_session(seeded) as s:
        g = await grant(s, seeded, read=READ)
        keep = await grant(s, seeded, read=READ)
        auth = runner.services.auth  # type: ignore[union-attr]
        for tok in (g["token"], keep["token"], g["token"]):
            status, _, _ = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
            assert status == 200
        hits = auth.rows.hits
        # `uomp sessions revoke` opens auth.db itself: a commit by another process and connection
        out = await asyncio.to_thread(
            subprocess.run,
            [*UOMP, "--home", str(seeded.home), "sessions", "revoke", g["session_id"]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=g["token"])
        assert body["error"]["code"] == "SESSION_REVOKED", body
        # refused by the session status (the cache saw the foreign commit), not only by the blacklist
        # row that the revocation also wrote ("token has been revoked")
        assert body["error"]["message"].startswith("session is revoked"), body
        status, _, _ = await call(s, "GET", "/v1/memory/preference.theme", token=keep["token"])
        assert status == 200
        assert auth.rows.hits >= hits  # (the foreign commit dropped the cache; it refills on demand)


def test_cached_row_is_never_served_past_the_session_expiry(seeded: Paths) -> None:
    from guardkit import guard_config

    from gateway.guard.audit import open_audit
    from gateway.guard.auth import AuthService

    now = [1_800_000_000.0]
    cfg = guard_config()
    auth = AuthService(seeded, cfg, open_audit(seeded, cfg), clock=lambda: now[0])
    try:
        sid = auth.create_session({"agent_id": "a1", "requested_scopes": {"read": READ}, "duration_minutes": 1})[
            "session_id"
        ]
        tok = auth.grant(sid, {"granted_scopes": {"read": READ}, "token_lifetime_seconds": 3600})["token"]
        auth.authenticate(tok)
        auth.authenticate(tok)
        assert auth.rows.hits >= 1
        now[0] += 59
        auth.authenticate(tok)  # still inside the minute: served (from the cache)
        now[0] += 2
        with pytest.raises(Exception) as exc:
            auth.authenticate(tok)
        assert getattr(exc.value, "code", None) in ("TOKEN_EXPIRED", "INVALID_TOKEN")
        assert auth.session(sid).status == "expired"
        # a deletion proof recorded through the service is seen at once too
        sid2 = auth.create_session({"agent_id": "a2", "requested_scopes": {"read": READ}})["session_id"]
        auth.grant(sid2, {"granted_scopes": {"read": READ}})
        assert auth.session(sid2).deletion_proof_id is None
        auth.record_deletion_proof(sid2, "dp_1")
        assert auth.session(sid2).deletion_proof_id == "dp_1"
    finally:
        auth.close_db()
        auth.audit.close()


def test_session_cache_off_switch(seeded: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.guard import sessions

    cache = sessions.SessionCache(sqlite3.connect(":memory:"), enabled=False)
    row = sessions.SessionRow("s", "a", None, "active", 0.0, 1e12, None, {}, None, {}, None, None, None)
    cache.keep(row)
    assert cache.lookup("s", 1.0) is None
    on = sessions.SessionCache(sqlite3.connect(":memory:"))
    on.keep(row)
    assert on.lookup("s", 1.0) is row
    assert on.lookup("s", 2e12) is None  # past its expiry: never served


def test_a_token_blacklisted_after_its_clean_check_was_cached_is_refused(seeded: Paths) -> None:
    """The blacklist lookup is skipped for a token already seen absent from it while auth.db is
    unchanged. Blacklisting that token later, by another connection (another process:
    its commit changes PRAGMA data_version) or by this service itself (its own commits do not), is
    seen at the next authentication. The session stays active, so only the blacklist can refuse."""
    from guardkit import guard_config

    from gateway.guard.audit import open_audit
    from gateway.guard.auth import AuthService, token_hash

    cfg = guard_config()
    auth = AuthService(seeded, cfg, open_audit(seeded, cfg))
    try:
        toks = []
        for agent in ("a1", "a2"):
            sid = auth.create_session({"agent_id": agent, "requested_scopes": {"read": READ}})["session_id"]
            toks.append((sid, auth.grant(sid, {"granted_scopes": {"read": READ}})["token"]))
        (sid1, tok1), (sid2, tok2) = toks
        for tok in (tok1, tok2, tok1, tok2):
            auth.authenticate(tok)
        assert auth.rows.not_blacklisted(token_hash(tok1))  # what makes this test mean something
        # another connection (as `uomp` in another process would) blacklists tok1 only
        other = sqlite3.connect(seeded.auth_db)
        with other:
            other.execute(
                "INSERT INTO token_blacklist (token_hash, session_id, expires_at, reason) VALUES (?, ?, ?, 'revoked')",
                (token_hash(tok1), sid1, 4e9),
            )
        other.close()
        with pytest.raises(Exception) as exc:
            auth.authenticate(tok1)
        assert getattr(exc.value, "code", None) == "SESSION_REVOKED" and "revoked" in str(exc.value)
        auth.authenticate(tok2)  # the other token is still served
        assert auth.rows.not_blacklisted(token_hash(tok2))
        # this service's own blacklist write (the same statement a revocation runs)
        with auth.db:
            auth._blacklist_session(sid2, "revoked")
        with pytest.raises(Exception) as exc:
            auth.authenticate(tok2)
        assert getattr(exc.value, "code", None) == "SESSION_REVOKED"
    finally:
        auth.close_db()
        auth.audit.close()
