"""``uomp export`` / ``uomp import`` of the whole store (our envelope, lossless: values, versions,
history) and the import adapters (mem0, Claude Code memory markdown, dsh memory-export-v1), against
real data directories; every bad file is refused with nothing written (docs/writes.md)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from guardkit import seed
from shortdir import short_dir

from gateway.atrest import itemseal
from gateway.cli.main import main
from gateway.config import Paths
from gateway.keys import init_home

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "adapters"


@pytest.fixture
def other() -> Iterator[Paths]:
    import shutil

    d = short_dir("uomp-imp-")
    paths = Paths(d)
    init_home(paths)
    yield paths
    shutil.rmtree(d, ignore_errors=True)


def uomp(paths: Paths, *args: str) -> int:
    return main(["--home", str(paths.home), *args])


def dump(paths: Paths) -> tuple[list[Any], list[Any], list[Any]]:
    """Every row of the store, high values opened (each home seals them under its own item key)."""
    sealer = itemseal.sealer_for(paths)
    conn = sqlite3.connect(f"file:{paths.memory_db}?mode=ro", uri=True)
    try:
        items = conn.execute(
            "SELECT key, value, tags, sensitivity, source, created_at, updated_at, description, version "
            "FROM items ORDER BY key"
        ).fetchall()
        versions = conn.execute(
            "SELECT key, version, deleted, value, tags, sensitivity, source, created_at, updated_at, description "
            "FROM item_versions ORDER BY key, version"
        ).fetchall()
        return (
            [(r[0], sealer.open(r[0], r[3], r[1]), *r[2:]) for r in items],
            [(*r[:3], None if r[3] is None else sealer.open(r[0], r[5], r[3]), *r[4:]) for r in versions],
            conn.execute("SELECT tag, item_key FROM item_tags ORDER BY tag, item_key").fetchall(),
        )
    finally:
        conn.close()


def test_round_trip_is_lossless(home: Paths, other: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed(home)
    assert uomp(home, "memory", "add", "preference.theme", "--value", '{"mode": "sepia", "n": 1.5}', "--tag",
                "preference", "--tag", "ünï", "--sensitivity", "low", "--replace") == 0  # fmt: skip
    assert uomp(home, "memory", "rm", "h.tiny") == 0
    out = tmp_path / "backup.json"
    assert uomp(home, "export", "--out", str(out)) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    doc = json.loads(out.read_text())
    assert doc["schema"] == "uomp-memory-export" and doc["schema_version"] == 1 and doc["count"] == len(doc["items"])
    assert uomp(home, "export", "--out", str(out)) == 1  # exists: refused without --force
    assert uomp(other, "import", str(out)) == 0  # recognised by its schema, no --adapter needed
    assert dump(other) == dump(home)
    assert uomp(other, "import", str(out)) == 1  # every key exists now: refused, nothing changed
    assert "IMPORT_INVALID" in capsys.readouterr().err
    assert dump(other) == dump(home)


def _envelope(tmp_path: Path, change: Any) -> Path:
    doc: dict[str, Any] = {
        "schema": "uomp-memory-export",
        "schema_version": 1,
        "exported_at": "2026-07-12T10:00:00Z",
        "count": 1,
        "items": [
            {
                "key": "a",
                "value": 1,
                "tags": ["t"],
                "sensitivity": "low",
                "source": "user",
                "created_at": "2026-07-12T10:00:00Z",
                "updated_at": "2026-07-12T10:00:00Z",
                "version": 1,
                "history": [],
            }
        ],
    }
    change(doc)
    path = tmp_path / "e.json"
    path.write_text(json.dumps(doc))
    return path


BAD_ENVELOPES = [
    pytest.param(lambda d: d.update(schema_version=2), id="newer-schema-version"),
    pytest.param(lambda d: d.update(count=2), id="count-mismatch-cut-short"),
    pytest.param(lambda d: d["items"][0].update(sensitivity="secret"), id="bad-sensitivity"),
    pytest.param(lambda d: d["items"][0].pop("value"), id="no-value"),
    pytest.param(lambda d: d["items"][0].update(key=" a"), id="bad-key"),
    pytest.param(lambda d: d["items"][0].update(version=-1), id="bad-version"),
    pytest.param(lambda d: d["items"][0].update(history=[{"version": 1, "deleted": True}]), id="history-above-current"),
    pytest.param(lambda d: d.update(count=2, items=d["items"] * 2), id="key-twice"),
]


@pytest.mark.parametrize("change", BAD_ENVELOPES)
def test_bad_envelopes_write_nothing(
    other: Paths, tmp_path: Path, change: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    seed(other)
    good = _envelope(tmp_path, lambda d: None)
    assert uomp(other, "import", str(good), "--dry-run") == 0
    before = dump(other)
    assert uomp(other, "import", str(_envelope(tmp_path, change))) == 1
    assert "IMPORT_INVALID" in capsys.readouterr().err
    assert dump(other) == before


def test_adapters_import_the_examples(other: Paths) -> None:
    assert uomp(other, "import", str(EXAMPLES / "mem0-export.json"), "--adapter", "mem0", "--sensitivity", "low") == 0
    assert uomp(other, "import", str(EXAMPLES / "CLAUDE.md"), "--adapter", "claude-md") == 0
    assert uomp(other, "import", str(EXAMPLES / "dsh-memory-export.json"), "--adapter", "dsh-export") == 0
    items = {row[0]: row for row in dump(other)[0]}
    mem = items["mem0.5e3f1c2a-9b1d-4c8e-a0f2-7d6b8c9e0a11"]
    assert json.loads(mem[1]) == "Prefers meetings after 10am" and json.loads(mem[2]) == [
        "mem0",
        "preference",
        "schedule",
    ]
    assert mem[3] == "low" and mem[5] == "2026-06-01T16:15:00Z"  # the zone kept, written in UTC
    assert json.loads(items["mem0.a1b2c3d4-0000-4000-8000-000000000002"][1]) == {
        "text": "Vegetarian",
        "metadata": {"confidence": 0.9},
    }
    claude = sorted(json.loads(r[1]) for k, r in items.items() if k.startswith("claude."))
    assert claude == sorted(
        [
            "Use ruff format; line length 120",
            "Prefer dataclasses over dicts for records",
            "Answer in English, short",
            "Run only the tests of the area you touched",
        ]
    )  # the fenced code block is not a memory
    dsh = items["dsh.0b6f4b8e-2a7c-4d8f-9a51-3f2e6c1d0a01"]
    assert json.loads(dsh[1]) == "Likes terse answers with code first" and "track:user" in json.loads(dsh[2])
    assert dsh[3] == "medium"
    # re-importing the same file: the keys exist (stable keys), refused without --replace
    assert uomp(other, "import", str(EXAMPLES / "CLAUDE.md"), "--adapter", "claude-md") == 1
    assert uomp(other, "import", str(EXAMPLES / "CLAUDE.md"), "--adapter", "claude-md", "--replace") == 0


BAD_ADAPTER_FILES = [
    pytest.param("mem0", b'{"schema": "memory-export-v1", "entries": []}', id="mem0-given-dsh"),
    pytest.param("mem0", b"- a markdown line\n", id="mem0-given-markdown"),
    pytest.param("mem0", b'[{"id": "1"}]', id="mem0-without-memory-text"),
    pytest.param("mem0", b'[{"id": "1", "memory": "x", "created_at": "yesterday"}]', id="mem0-bad-time"),
    pytest.param("claude-md", b'{"results": []}', id="claude-given-json"),
    pytest.param("claude-md", b"# Heading only\n\nsome prose\n", id="claude-without-items"),
    pytest.param("claude-md", b"\x00\x01binary", id="claude-given-binary"),
    pytest.param("dsh-export", b'{"schema": "memory-export-v2", "entries": []}', id="dsh-other-schema"),
    pytest.param("dsh-export", b'{"results": [{"id": "1", "memory": "x"}]}', id="dsh-given-mem0"),
    pytest.param(
        "dsh-export",
        b'{"schema": "memory-export-v1", "entries": [{"id": "1", "text": "x", "track": "x"}]}',
        id="dsh-bad-track",
    ),
    pytest.param("mem0", b'[{"id": "1", "memory": "x"}, {"id": "1", "memory": "y"}]', id="mem0-id-twice"),
    pytest.param("mem0", b'[{"id": "1", "memory": "x", "categories": ["a\\u0000b"]}]', id="mem0-control-tag"),
]


@pytest.mark.parametrize(("adapter", "data"), BAD_ADAPTER_FILES)
def test_a_file_that_is_not_what_it_claims(
    other: Paths, tmp_path: Path, adapter: str, data: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    seed(other)
    before = dump(other)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert uomp(other, "import", str(path), "--adapter", adapter) == 1
    err = capsys.readouterr().err
    assert "IMPORT_INVALID" in err or "INVALID_REQUEST" in err, err
    assert dump(other) == before
