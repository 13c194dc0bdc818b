"""What authorize shows before the user says yes is true for the session being granted: token and certificate
lifetimes that fit the session, and the read quota."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli.main import main
from gateway.config import Paths

MANIFEST = {
    "uomp_version": "1.0",
    "agent": {"id": "cal_agent", "name": "Cal", "version": "1.0.0"},
    "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
    "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
}


def consent(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    d = tmp_path / "agent"
    d.mkdir(exist_ok=True)
    (d / "uom.json").write_text(json.dumps(MANIFEST))
    assert main(["--home", str(home.home), "init"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "--home",
                str(home.home),
                "authorize",
                str(d),
                "--yes",
                "--remote",
                "--out",
                str(tmp_path / f"af{len(extra)}"),
                *extra,
            ]
        )
        == 0
    )
    return capsys.readouterr().out


def test_a_one_minute_session_does_not_promise_ten_minute_tokens(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = consent(home, tmp_path, capsys, "--session-ttl", "1m", "--max-reads", "7")
    assert "access tokens last 1 minute, the whole session" in out and "10 minutes" not in out
    assert "at most 7 reads in the session (--max-reads)" in out
    assert "certificate lasts" not in out  # 24 h outlives a minute: nothing to renew


def test_a_long_session_says_tokens_refresh_and_the_certificate_must_be_renewed(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = consent(home, tmp_path, capsys)
    assert "access tokens last 10 minutes; the agent renews them with a refresh token of 7 days" in out
    assert "the agent's certificate lasts 24 h (--cert-hours), less than the session" in out
    assert "at most 100 reads in the session (--max-reads)" in out
