"""Before `uomp init`: every command that needs a set-up data directory says "run 'uomp init'" and creates
nothing there; the commands that set one up or report on one still work."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.main import main

EXAMPLES = Path(__file__).parents[2] / "examples"

NEEDS_INIT = [
    ["keys", "rotate"],
    ["memory", "add", "k", "--value", "1", "--tag", "t", "--sensitivity", "low"],
    ["memory", "show", "k"],
    ["memory", "list"],
    ["memory", "rm", "k"],
    ["import", str(EXAMPLES / "holdings.csv"), "--map", "ticker=key", "--tag", "x", "--sensitivity", "low"],
    ["guard", "serve"],
    ["sessions", "list"],
    ["sessions", "revoke", "ses_x"],
    ["audit"],
    ["audit", "verify"],
    ["audit", "proof", "log_x"],
    ["anchor", "status"],
    ["authorize", str(EXAMPLES / "calendar_agent"), "--yes", "--remote"],
    ["trust", "list"],
    ["ca", "init"],
    ["agent", "issue", "a1", "--out", "agent-files"],
    ["agent", "list"],
    ["agent", "revoke", "a1"],
    ["gateway", "serve"],
    ["payload", "pubkey"],
    ["payload", "list"],
    ["payload", "pull", "pl_x", "--out", "out.bin"],
    ["payload", "rm", "pl_x"],
    ["dashboard"],
]


@pytest.fixture(params=["missing", "empty"])
def home(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # where relative --out paths would land
    h = tmp_path / "home"
    if request.param == "empty":
        h.mkdir(mode=0o700)
    return h


def listing(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*")) if home.exists() else ["<none>"]


@pytest.mark.parametrize("argv", NEEDS_INIT, ids=[" ".join(a[:2]) for a in NEEDS_INIT])
def test_commands_that_need_a_home_say_init_and_create_nothing(
    home: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    before = listing(home)
    rc = main(["--home", str(home), *argv])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error NOT_INITIALISED: data directory ") and "run 'uomp init' first" in err, err
    assert listing(home) == before


def test_init_status_and_doctor_work_on_a_new_home(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--home", str(home), "status"]) != 0
    out = capsys.readouterr().out
    assert out.startswith(f"data directory {home} has not been set up: run 'uomp init'")
    assert main(["--home", str(home), "doctor"]) == 1
    assert "fix: run: uomp init" in capsys.readouterr().out
    assert main(["--home", str(home), "gateway", "stop"]) == 0
    assert main(["--home", str(home), "init"]) == 0
    capsys.readouterr()
    assert main(["--home", str(home), "memory", "list"]) == 0  # the denied partner, once set up
    assert main(["--home", str(home), "status"]) == 3
    assert "has not been set up" not in capsys.readouterr().out
