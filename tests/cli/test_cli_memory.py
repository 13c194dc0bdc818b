"""``uomp memory ...`` and ``uomp import`` through gateway.cli.main.main, against a real data directory."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from shortdir import short_dir

from gateway.cli import home as home_cli
from gateway.cli import initsteps
from gateway.cli.main import build_parser, main
from gateway.config import Paths
from gateway.guard.store import MemoryStore
from gateway.keys import init_home


@pytest.fixture
def home_dir() -> Iterator[str]:
    import shutil

    d = str(short_dir("uomp-mem-"))
    init_home(Paths(Path(d)))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def uomp(home_dir: str, *args: str) -> int:
    return main(["--home", home_dir, *args])


def count(home_dir: str) -> int:
    with MemoryStore(Paths(Path(home_dir)).memory_db) as s:
        return s.count()


def test_init_hook_creates_the_store(home_dir: str) -> None:
    build_parser()
    build_parser()
    assert home_cli.INIT_HOOKS.count(initsteps.init_store) == 1
    paths = Paths(Path(home_dir))
    assert initsteps.init_store(paths) == {"memory store": True, "item sealing key": True}
    assert initsteps.init_store(paths) == {"memory store": False, "item sealing key": False}
    assert paths.memory_db.stat().st_mode & 0o777 == 0o600
    assert (paths.secrets / "items.key").stat().st_mode & 0o777 == 0o600


def test_add_get_list_rm_round_trip(home_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        uomp(
            home_dir,
            "memory",
            "add",
            "preference.theme",
            "--value",
            '"dark"',
            "--tag",
            "preference",
            "--tag",
            "ui",
            "--sensitivity",
            "low",
            "--description",
            "UI theme",
        )
        == 0
    )
    assert "added preference.theme" in capsys.readouterr().out

    assert uomp(home_dir, "memory", "get", "preference.theme") == 0
    got = json.loads(capsys.readouterr().out)
    created = got.pop("created_at")
    assert got.pop("updated_at") == created
    assert got == {
        "key": "preference.theme",
        "value": "dark",
        "tags": ["preference", "ui"],
        "sensitivity": "low",
        "source": "user",
        "description": "UI theme",
    }

    assert (
        uomp(home_dir, "memory", "add", "acct", "--value", '{"n": 1}', "--tag", "money", "--sensitivity", "high") == 0
    )
    capsys.readouterr()
    assert uomp(home_dir, "memory", "list") == 0
    out = capsys.readouterr().out
    assert "acct" in out and "preference.theme" in out and "2 items shown; 2 in the store" in out
    assert '"n"' not in out  # values only with --json
    assert uomp(home_dir, "memory", "list", "--tag", "ui", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [d["key"] for d in listed] == ["preference.theme"] and listed[0]["value"] == "dark"
    assert uomp(home_dir, "memory", "list", "--limit", "1") == 0
    assert "1 item shown; 2 in the store" in capsys.readouterr().out

    assert uomp(home_dir, "memory", "rm", "acct") == 0
    assert "deleted acct" in capsys.readouterr().out
    assert uomp(home_dir, "memory", "rm", "acct") == 1
    assert "error INVALID_REQUEST" in capsys.readouterr().err
    assert uomp(home_dir, "memory", "get", "acct") == 1
    assert "error INVALID_REQUEST: no memory item has this key" in capsys.readouterr().err


def test_add_refusals(home_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["memory", "add", "k", "--tag", "t", "--sensitivity", "low"]
    assert uomp(home_dir, *base, "--value", "dark") == 1  # not JSON: text needs quotes
    assert "error INVALID_REQUEST: --value must be JSON" in capsys.readouterr().err
    assert uomp(home_dir, *base, "--value", "NaN") == 1
    capsys.readouterr()
    assert uomp(home_dir, "memory", "add", "bad\tkey", "--value", "1", "--tag", "t", "--sensitivity", "low") == 1
    assert "error INVALID_REQUEST: key contains control characters" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # sensitivity is required (spec §12.8 spirit)
        uomp(home_dir, "memory", "add", "k", "--value", "1", "--tag", "t")
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        uomp(home_dir, "memory", "add", "k", "--value", "1", "--tag", "t", "--sensitivity", "secret")
    capsys.readouterr()
    assert count(home_dir) == 0


def test_add_replace_keeps_created_at(home_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["memory", "add", "k", "--tag", "t", "--sensitivity", "low"]
    assert uomp(home_dir, *args, "--value", "1") == 0
    with MemoryStore(Paths(Path(home_dir)).memory_db) as s:
        first = s.get("k")
        assert first is not None
        s.put(dataclasses.replace(first, created_at="2020-01-01T00:00:00Z"), replace=True)
    assert uomp(home_dir, *args, "--value", "2") == 1
    assert "pass --replace" in capsys.readouterr().err
    assert uomp(home_dir, *args, "--value", "2", "--replace") == 0
    assert "replaced k" in capsys.readouterr().out
    with MemoryStore(Paths(Path(home_dir)).memory_db) as s:
        item = s.get("k")
    assert item is not None and item.value == 2 and item.created_at == "2020-01-01T00:00:00Z"
    assert item.updated_at != "2020-01-01T00:00:00Z"


def test_import_round_trip(home_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "items.csv"
    src.write_text("id;tag;price;when\n1;shop;$1,234.50;Jan 5 2026\n2;shop;€3;Feb 6 2026\n")
    assert (
        uomp(
            home_dir,
            "import",
            str(src),
            "--delimiter",
            ";",
            "--sensitivity",
            "medium",
            "--tag",
            "bulk",
            "--map",
            "when=value.bought.on",
            "--dry-run",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "dry run: 2 items from items.csv are valid; nothing was written" in out
    assert count(home_dir) == 0

    assert (
        uomp(
            home_dir,
            "import",
            str(src),
            "--delimiter",
            ";",
            "--sensitivity",
            "medium",
            "--tag",
            "bulk",
            "--map",
            "when=value.bought.on",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "note: value.price: removed currency symbols ($, €) in 2 rows" in out
    assert "note: sensitivity: not given, set to medium (--sensitivity) in 2 rows" in out
    assert "note: tags: added bulk (--tag) to every row" in out
    assert out.strip().endswith("imported 2 items from items.csv")
    assert uomp(home_dir, "memory", "get", "1") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["value"] == {"price": 1234.5, "bought": {"on": "2026-01-05"}}
    assert got["tags"] == ["shop", "bulk"] and got["sensitivity"] == "medium"

    # again: the keys exist now
    assert uomp(home_dir, "import", str(src), "--delimiter", ";", "--sensitivity", "medium") == 1
    err = capsys.readouterr().err
    assert "error IMPORT_INVALID: 2 rows are invalid; nothing was written" in err
    assert "  row 2: an item with this key is already in the store (--replace overwrites it)" in err
    assert uomp(home_dir, "import", str(src), "--delimiter", ";", "--sensitivity", "medium", "--replace") == 0
    assert "imported 2 items from items.csv (2 replaced)" in capsys.readouterr().out


def test_import_bad_rows_printed(home_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "items.json"
    src.write_text(
        '[{"key": "a", "tags": "t", "sensitivity": "low", "value": 1},'
        ' {"key": "", "tags": "t", "sensitivity": "low", "value": 2},'
        ' {"key": "c", "tags": "t", "value": 3}]'
    )
    assert uomp(home_dir, "import", str(src)) == 1
    err = capsys.readouterr().err
    assert "error IMPORT_INVALID: 2 rows are invalid; nothing was written" in err
    assert "  item [1]: key is empty" in err
    assert "  item [2]: sensitivity is missing (give --sensitivity)" in err
    assert count(home_dir) == 0


def test_missing_home_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--home", str(tmp_path / "nope"), "memory", "list"]) == 1
    assert "error NOT_INITIALISED" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()


def test_store_unavailable_is_reported(home_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    Paths(Path(home_dir)).memory_db.write_bytes(b"not a database at all" * 50)
    assert uomp(home_dir, "memory", "list") == 1
    err = capsys.readouterr().err
    assert "error STORE_UNAVAILABLE: the memory store file is not a SQLite database" in err


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["memory", "--help"], ["add", "get", "list", "rm"]),
        (["memory", "add", "--help"], ["--value", "--tag", "--sensitivity", "--description", "--replace"]),
        (["memory", "list", "--help"], ["--tag", "--limit", "--offset", "--json"]),
        (
            ["import", "--help"],
            [
                "--format",
                "--delimiter",
                "--map",
                "--tag",
                "--sensitivity",
                "--replace",
                "--dry-run",
                "--date-order",
                "--keep-text",
                "--progress",
                "SRC=DST",
                "Nothing is written unless every row is valid",
            ],
        ),
    ],
)
def test_help_lists_every_option(argv: list[str], fragments: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    for fragment in fragments:
        assert fragment in out
