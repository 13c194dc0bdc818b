"""Command-line mistakes: one line naming the (sub)command whose help to read, and the closest valid name."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.main import main


def usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["--home", str(tmp_path / "home"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "home").exists()  # a refused command line creates nothing
    return err.strip()


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["memry", "list"], "error USAGE: uomp: argument COMMAND: invalid choice: 'memry' (did you mean 'memory'?);"),
        (
            ["memory", "sho", "x"],
            "error USAGE: uomp memory: argument ACTION: invalid choice: 'sho' (did you mean 'show'?);",
        ),
        (["gateway", "strat"], "(did you mean 'start'?); choose from serve, start, stop; see 'uomp gateway --help'"),
        (
            ["audit", "--limt", "5"],
            "error USAGE: uomp audit: unrecognized arguments: --limt (did you mean --limit?); see 'uomp audit --help'",
        ),
        (
            ["audit", "--limit", "1", "--untl", "2h"],
            "uomp audit: unrecognized arguments: --untl (did you mean --until?)",
        ),
        (
            ["memory", "list", "--tga", "x"],
            "error USAGE: uomp memory list: unrecognized arguments: --tga (did you mean "
            "--tag?) x; see 'uomp memory list --help'",
        ),
        (
            ["memory", "add", "k", "--value", "1", "--sensitivty=low"],
            "uomp memory add: unrecognized arguments: --sensitivty=low (did you mean --sensitivity?)",
        ),
        (["memory", "list", "--zzzzzz"], "uomp memory list: unrecognized arguments: --zzzzzz; see"),
        (
            ["gateway", "start", "--tunnel", "bogus"],
            "invalid choice: 'bogus'; choose from quick, named, tcp, none; see 'uomp gateway start --help'",
        ),
    ],
    ids=[
        "command",
        "action",
        "gateway-action",
        "flag-before-value",
        "flag-with-value",
        "subcommand-flag",
        "flag-equals",
        "no-close-name",
        "bad-choice-no-hint",
    ],
)
def test_mistakes_name_the_fix(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], want: str) -> None:
    assert want in usage_error(capsys, tmp_path, *argv)


def test_a_right_command_line_is_not_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["memory", "list", "--help"])
    assert exc.value.code == 0 and "--tag" in capsys.readouterr().out
