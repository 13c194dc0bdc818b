"""Answers that say something: an empty audit listing names its filters; a CSV with another delimiter and a
JSON file wrapping its list get the hint that fixes them, and the fixed command works."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.main import main
from gateway.config import Paths


def run(home: Paths, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["--home", str(home.home), *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_an_empty_audit_listing_says_which_filters_matched_nothing(
    home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run(home, capsys, "audit", "--since", "2h", "--until", "1h")
    assert rc == 0 and out == ""
    assert err.startswith("no audit events match (since ") and "; until " in err
    rc, out, err = run(home, capsys, "audit", "--agent", "nobody", "--refused")
    assert (rc, out) == (0, "") and "no audit events match (agent nobody; refused only)" in err
    rc, out, err = run(home, capsys, "audit", "--json")  # JSON stays JSON: an empty list, nothing else
    assert (rc, out.strip(), err) == (0, "[]", "")
    assert run(home, capsys, "memory", "add", "k", "--value", "1", "--tag", "t", "--sensitivity", "low")[0] == 0
    rc, out, err = run(home, capsys, "audit")
    assert rc == 0 and "memory_added" in out and "no audit events" not in err


@pytest.mark.parametrize(("delimiter", "shown"), [(";", ";"), ("\t", "tab"), ("|", "|")])
def test_a_csv_with_another_delimiter_gets_the_flag_that_reads_it(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str], delimiter: str, shown: str
) -> None:
    f = tmp_path / "holdings.csv"
    f.write_text(f"ticker{delimiter}shares\nAAPL{delimiter}3\n")
    rc, _, err = run(home, capsys, "import", str(f), "--map", "ticker=key", "--tag", "t", "--sensitivity", "low")
    assert rc == 1 and f"the file looks delimited by {shown!r}; pass --delimiter '{shown}'" in err
    rc, _, err = run(
        home,
        capsys,
        "import",
        str(f),
        "--map",
        "ticker=key",
        "--tag",
        "t",
        "--sensitivity",
        "low",
        "--delimiter",
        shown,
    )
    assert rc == 0, err
    # a one-column file with no other delimiter in its header gets no such hint
    g = tmp_path / "one.csv"
    g.write_text("title\nA\n")
    rc, _, err = run(home, capsys, "import", str(g), "--tag", "t", "--sensitivity", "low")
    assert rc == 1 and "looks delimited" not in err and "no key column" in err


def test_a_json_wrapper_is_named_and_a_plain_missing_key_is_not_called_a_type_error(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "export.json"
    f.write_text('{"items": [{"key": "a", "value": 1}, {"key": "b", "value": 2}]}')
    rc, _, err = run(home, capsys, "import", str(f), "--tag", "t", "--sensitivity", "low")
    assert rc == 1 and "the file is one object whose 'items' holds a list of objects; the root must be that list" in err
    g = tmp_path / "nokey.json"
    g.write_text('[{"value": 1}]')
    rc, _, err = run(home, capsys, "import", str(g), "--tag", "t", "--sensitivity", "low")
    assert rc == 1 and "the item has no key (a key field" in err and "must be a string" not in err
    h = tmp_path / "badkey.json"
    h.write_text('[{"key": [1], "value": 1}]')
    rc, _, err = run(home, capsys, "import", str(h), "--tag", "t", "--sensitivity", "low")
    assert rc == 1 and "key must be a string" in err
    f.write_text('[{"key": "a", "value": 1}, {"key": "b", "value": 2}]')
    assert run(home, capsys, "import", str(f), "--tag", "t", "--sensitivity", "low")[0] == 0
