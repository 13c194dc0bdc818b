"""Session, refresh and access token lifetimes (spec §15.5, §20.1).

Remote sessions may last up to the user's configured maximum (default 30 days); the refresh
token lives 7 days by default and never past the session end; the access token at most 10
minutes. Local sessions keep their defaults (30 minutes, at most a day).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from gateway import ca_store, keys
from gateway.bundle import load_bundle
from gateway.cli.authorize import parse_duration
from gateway.cli.guard import open_auth
from gateway.cli.main import main
from gateway.config import GuardConfig, Paths
from gateway.core import jose, tokens
from gateway.errors import UompError

DAY = 86_400
MANIFEST: dict[str, Any] = {
    "uomp_version": "1.0",
    "agent": {"id": "saas_agent", "name": "SaaS agent", "version": "1.0.0"},
    "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
    "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
}


def cli(home: Paths, *args: str) -> int:
    return main(["--home", str(home.home), *args])


def agent_dir(tmp_path: Path) -> Path:
    d = tmp_path / "agent"
    d.mkdir(exist_ok=True)
    (d / "uom.json").write_text(json.dumps(MANIFEST))
    return d


def remote(home: Paths, tmp_path: Path, *extra: str) -> int:
    ca_store.init_all(home)
    return cli(
        home,
        "authorize",
        str(agent_dir(tmp_path)),
        "--yes",
        "--remote",
        "--out",
        str(tmp_path / "files"),
        "--bundle",
        str(tmp_path / "bundle.json"),
        *extra,
    )


def session_length(home: Paths, session_id: str) -> float:
    auth = open_auth(home, GuardConfig())
    try:
        row = auth.session(session_id)
        return row.expires_at - row.created_at
    finally:
        auth.close_db()
        auth.audit.close()


# ------------------------------------------------------------------------------ CLI, remote


def test_remote_default_is_the_configured_maximum_with_7_day_refresh(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert remote(home, tmp_path) == 0
    out = capsys.readouterr().out
    b = load_bundle(tmp_path / "bundle.json")
    assert session_length(home, b.session_id) == pytest.approx(30 * DAY, abs=5)
    pub = keys.load_public_keys(home)
    access = tokens.verify_token(b.access_token, pub, now=time.time())
    refresh = tokens.verify_token(b.refresh_token or "", pub, now=time.time())
    assert access.expires_at - access.issued_at <= 600
    assert refresh.expires_at - refresh.issued_at == pytest.approx(7 * DAY, abs=2)
    assert b.session_expires_at is not None
    assert tokens.parse_iso(b.session_expires_at) == pytest.approx(time.time() + 30 * DAY, abs=60)
    assert f"Session ends {b.session_expires_at}" in out  # after the grant, exactly
    assert "Session:   30 days" in out and "--session-ttl" in out  # before the yes, with how to shorten


@pytest.mark.parametrize(
    ("ttl", "seconds", "refresh_seconds"),
    [
        ("2d", 2 * DAY, 2 * DAY),  # refresh never past the session end
        ("12h", 12 * 3600, 12 * 3600),
        ("8d", 8 * DAY, 7 * DAY),
        ("30d", 30 * DAY, 7 * DAY),
    ],
    ids=["2-days", "12-hours", "8-days", "30-days"],
)
def test_remote_session_can_be_shortened(
    home: Paths, tmp_path: Path, ttl: str, seconds: int, refresh_seconds: int
) -> None:
    assert remote(home, tmp_path, "--session-ttl", ttl) == 0
    b = load_bundle(tmp_path / "bundle.json")
    assert session_length(home, b.session_id) == pytest.approx(seconds, abs=5)
    refresh = tokens.verify_token(b.refresh_token or "", keys.load_public_keys(home), now=time.time())
    assert refresh.expires_at - refresh.issued_at == pytest.approx(refresh_seconds, abs=5)


def test_remote_longer_than_the_maximum_is_refused_until_configured(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert remote(home, tmp_path, "--session-ttl", "31d") == 1
    err = capsys.readouterr().err
    assert "INVALID_REQUEST" in err and "30 days" in err and "remote_session_max_minutes" in err
    home.config_file.write_text("[guard]\nremote_session_max_minutes = 129600\n")  # 90 days
    assert remote(home, tmp_path, "--session-ttl", "60d") == 0
    b = load_bundle(tmp_path / "bundle.json")
    assert session_length(home, b.session_id) == pytest.approx(60 * DAY, abs=5)


# ------------------------------------------------------------------------------- CLI, local


def test_local_sessions_keep_their_defaults(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = tmp_path / "a.env"
    assert cli(home, "authorize", str(agent_dir(tmp_path)), "--yes", "--env-file", str(env)) == 0
    token = dict(line.split("=", 1) for line in env.read_text().splitlines())["UOM_TOKEN"]
    cap = tokens.verify_token(token, keys.load_public_keys(home), now=time.time())
    assert session_length(home, cap.session_id) == pytest.approx(30 * 60, abs=5)
    assert cap.expires_at - cap.issued_at <= 30 * 60
    assert cli(home, "authorize", str(agent_dir(tmp_path)), "--yes", "--env-file", str(env), "--session-ttl", "2d") == 1
    assert "session_max_minutes" in capsys.readouterr().err
    assert cli(home, "authorize", str(agent_dir(tmp_path)), "--yes", "--env-file", str(env), "--duration", "90") == 0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("90s", 90),
        ("30m", 1800),
        ("12h", 43200),
        ("7d", 7 * DAY),
        ("1.5h", 5400),
        (" 2D ", 2 * DAY),
    ],
    ids=["bare-minutes", "seconds", "minutes", "hours", "days", "fraction", "spaces-upper"],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["", "0", "0m", "-5m", "abc", "5w", "nan", "inf", "1e400d", "d", "5 m m", "١٢h"],
    ids=[
        "empty",
        "zero",
        "zero-minutes",
        "negative",
        "word",
        "weeks",
        "nan",
        "inf",
        "huge",
        "unit-only",
        "two-units",
        "non-ascii-digits",
    ],
)
def test_parse_duration_refusals(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


# ------------------------------------------------------------------------------ Auth Service


@pytest.fixture
def clock() -> list[float]:
    return [time.time()]


def _auth(home: Paths, clock: list[float], **cfg: Any) -> Any:
    from gateway.guard.audit import AuditLog
    from gateway.guard.auth import AuthService

    config = dataclasses.replace(GuardConfig(), **cfg)
    return AuthService(home, config, AuditLog(home.audit_db, retention_days=90), clock=lambda: clock[0])


CNF = {"x5t#S256": "A" * 43, "jkt": "B" * 43}
REMOTE_GRANT: dict[str, Any] = {
    "granted_scopes": {"read": {"tags": ["preference"], "keys": []}},
    "profile": "remote",
    "audience": "https://gw.example:9443",
    "cnf": CNF,
    "refresh": True,
}


@pytest.mark.parametrize(
    ("profile", "minutes", "ok"),
    [
        ("remote", 30 * 24 * 60, True),
        ("remote", 30 * 24 * 60 + 1, False),
        ("local", 24 * 60, True),
        ("local", 24 * 60 + 1, False),
        (None, 24 * 60 + 1, False),  # no profile: local bounds
        ("elsewhere", 30, False),
    ],
    ids=["remote-30-days", "remote-over-max", "local-1-day", "local-over-max", "default-local", "bad-profile"],
)
def test_create_session_bounds_by_profile(
    home: Paths, clock: list[float], profile: str | None, minutes: int, ok: bool
) -> None:
    auth = _auth(home, clock)
    try:
        body: dict[str, Any] = {
            "agent_id": "a",
            "requested_scopes": {"read": {"tags": ["t"], "keys": []}},
            "duration_minutes": minutes,
        }
        if profile is not None:
            body["profile"] = profile
        if ok:
            answer = auth.create_session(body)
            assert tokens.parse_iso(answer["expires_at"]) == pytest.approx(clock[0] + minutes * 60, abs=1)
        else:
            with pytest.raises(UompError) as info:
                auth.create_session(body)
            assert info.value.code == "INVALID_REQUEST"
    finally:
        auth.close_db()
        auth.audit.close()


def test_a_long_remote_session_cannot_be_granted_as_local(home: Paths, clock: list[float]) -> None:
    auth = _auth(home, clock)
    try:
        sid = auth.create_session(
            {
                "agent_id": "a",
                "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
                "duration_minutes": 7 * 24 * 60,
                "profile": "remote",
            }
        )["session_id"]
        with pytest.raises(UompError) as info:
            auth.grant(sid, {"granted_scopes": {"read": {"tags": ["preference"], "keys": []}}})
        assert info.value.code == "INVALID_REQUEST" and "local" in info.value.message
    finally:
        auth.close_db()
        auth.audit.close()


def test_refresh_chain_across_days_ends_at_the_session_end(home: Paths, clock: list[float]) -> None:
    """A 30-day session lives on refreshes: each refresh token lasts 7 days (never past the end),
    each access token at most 10 minutes even when the config asks for more."""
    auth = _auth(home, clock, remote_token_lifetime_seconds=3600)
    try:
        start = clock[0]
        sid = auth.create_session(
            {
                "agent_id": "a",
                "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
                "duration_minutes": 30 * 24 * 60,
                "profile": "remote",
            }
        )["session_id"]
        answer = auth.grant(sid, REMOTE_GRANT)
        end = tokens.parse_iso(answer["session_expires_at"])
        assert end == pytest.approx(start + 30 * DAY, abs=1)
        refresh = answer["refresh_token"]
        for day in (6, 12, 18, 24, 29):  # the agent refreshes well inside each 7-day window
            clock[0] = start + day * DAY
            answer = auth.refresh(refresh, session_id=sid, presented_x5t=CNF["x5t#S256"], presented_jkt=None)
            access = jose.parse_compact(answer["access_token"]).payload
            assert access["exp"] - access["iat"] <= 600
            rt_exp = tokens.parse_iso(answer["refresh_expires_at"])
            assert rt_exp == pytest.approx(min(clock[0] + 7 * DAY, end), abs=1)
            assert rt_exp <= end
            refresh = answer["refresh_token"]
        clock[0] = end + 1
        with pytest.raises(UompError) as info:
            auth.refresh(refresh, session_id=sid, presented_x5t=CNF["x5t#S256"], presented_jkt=None)
        assert info.value.code in ("TOKEN_EXPIRED", "INVALID_TOKEN")
    finally:
        auth.close_db()
        auth.audit.close()
