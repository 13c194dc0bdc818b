"""CSV / JSON import (spec §12): table-driven cases against real SQLite stores under tmp_path."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.memory import ProgressBar
from gateway.errors import UompError
from gateway.guard import bulk as bulk_mod
from gateway.guard import importer
from gateway.guard.importer import ImportLimits, import_file, readers
from gateway.guard.items import MemoryItem
from gateway.guard.store import MemoryStore

NOW_ISH = "20"  # timestamps defaulted to the import time start with the century


@pytest.fixture
def store(tmp_path: Path) -> MemoryStore:
    s = MemoryStore(tmp_path / "memory.db")
    yield s
    s.close()


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)
    return path


def items(store: MemoryStore, *, stamps: bool = False) -> list[dict[str, Any]]:
    out = []
    for it in store.list(limit=10_000):
        d = it.to_dict()
        if not stamps:
            assert d.pop("created_at").startswith(NOW_ISH) and d.pop("updated_at").startswith(NOW_ISH)
        out.append(d)
    return out


def run(store: MemoryStore, tmp_path: Path, name: str, content: str | bytes, **kw: Any) -> importer.ImportReport:
    return import_file(store, write(tmp_path, name, content), **kw)


def refused(store: MemoryStore, tmp_path: Path, name: str, content: str | bytes, **kw: Any) -> UompError:
    before = [it.to_dict() for it in store.list(limit=10_000)]
    with pytest.raises(UompError) as e:
        run(store, tmp_path, name, content, **kw)
    assert [it.to_dict() for it in store.list(limit=10_000)] == before, "a refused import wrote something"
    return e.value


SPEC_CSV = """\
key,tags,sensitivity,value.title,value.content
note-1,notes,low,Shopping list,Buy milk
contact-1,contacts,medium,Alice,alice@example.com
"""

SPEC_JSON = """\
[
  {
    "key": "note-1",
    "tags": ["notes"],
    "sensitivity": "low",
    "value": {
      "title": "Shopping list",
      "content": "Buy milk"
    }
  },
  {
    "key": "contact-1",
    "tags": ["contacts"],
    "sensitivity": "medium",
    "value": {
      "name": "Alice",
      "email": "alice@example.com"
    }
  }
]
"""


def spec_item(key: str, tags: list[str], sensitivity: str, value: Any, **extra: Any) -> dict[str, Any]:
    return {"key": key, "value": value, "tags": tags, "sensitivity": sensitivity, "source": "user", **extra}


# ------------------------------------------------------------------------------------ accepted files
# (name, file name, content, import_file kwargs, expected items ordered by key (timestamps aside))

ACCEPTED: list[tuple[str, str, str, dict[str, Any], list[dict[str, Any]]]] = [
    (
        "spec 12.10 csv",
        "in.csv",
        SPEC_CSV,
        {},
        [
            spec_item("contact-1", ["contacts"], "medium", {"title": "Alice", "content": "alice@example.com"}),
            spec_item("note-1", ["notes"], "low", {"title": "Shopping list", "content": "Buy milk"}),
        ],
    ),
    (
        "spec 12.10 json",
        "in.json",
        SPEC_JSON,
        {},
        [
            spec_item("contact-1", ["contacts"], "medium", {"name": "Alice", "email": "alice@example.com"}),
            spec_item("note-1", ["notes"], "low", {"title": "Shopping list", "content": "Buy milk"}),
        ],
    ),
    (
        "csv aliases",
        "in.csv",
        "ID,Tag,Level,Origin,Desc,title\nn1,a;b,HIGH,agent,About it,T\n",
        {},
        [spec_item("n1", ["a", "b"], "high", {"title": "T"}, source="agent", description="About it")],
    ),
    (
        "csv item_id and record_id aliases",
        "in.csv",
        "item_id,tags,title\nx,t,T\n",
        {"sensitivity": "low"},
        [spec_item("x", ["t"], "low", {"title": "T"})],
    ),
    (
        "json aliases, value from the other fields",
        "in.json",
        '{"record_id": "r1", "tag": "a|b", "level": "medium", "desc": "d", "origin": "user", "name": "Bob", "age": 31}',
        {},
        [spec_item("r1", ["a", "b"], "medium", {"name": "Bob", "age": 31}, description="d")],
    ),
    (
        "--map",
        "in.csv",
        "name,category,amount,note\nk1,food,12.5,x\n",
        {"mappings": {"name": "key", "category": "tags", "amount": "value.money.amount"}, "sensitivity": "low"},
        [spec_item("k1", ["food"], "low", {"money": {"amount": 12.5}, "note": "x"})],
    ),
    (
        "--map a column onto the whole value",
        "in.csv",
        "key,tags,sensitivity,theme\npref,ui,low,dark\n",
        {"mappings": {"theme": "value"}},
        [spec_item("pref", ["ui"], "low", "dark")],
    ),
    (
        "--map in json adds to an explicit value",
        "in.json",
        '[{"key": "k", "tags": "t", "sensitivity": "low", "value": {"a": 1}, "extra": 2}]',
        {"mappings": {"extra": "value.b.c"}},
        [spec_item("k", ["t"], "low", {"a": 1, "b": {"c": 2}})],
    ),
    (
        "value.* nesting",
        "in.csv",
        "key,tags,sensitivity,value.a.b,value.a.c,value.d,e\nk,t,low,1,x,y,z\n",
        {},
        [spec_item("k", ["t"], "low", {"a": {"b": 1, "c": "x"}, "d": "y", "e": "z"})],
    ),
    (
        "a value column is the whole value",
        "in.csv",
        "key,tags,sensitivity,value\nk,t,low,dark\n",
        {},
        [spec_item("k", ["t"], "low", "dark")],
    ),
    (
        "semicolon delimiter, quoted fields",
        "in.csv",
        'key;tags;sensitivity;title\nk;"a;b";low;"x;y ""quoted"" and\na new line"\n',
        {"delimiter": ";"},
        [spec_item("k", ["a", "b"], "low", {"title": 'x;y "quoted" and\na new line'})],
    ),
    (
        "tab delimiter by name",
        "in.csv",
        "key\ttags\tsensitivity\ttitle\nk\tt\tlow\tA, B\n",
        {"delimiter": "tab"},
        [spec_item("k", ["t"], "low", {"title": "A, B"})],
    ),
    (
        "tab delimiter from .tsv",
        "in.tsv",
        "key\ttags\tsensitivity\ttitle\nk\tt\tlow\tA\n",
        {},
        [spec_item("k", ["t"], "low", {"title": "A"})],
    ),
    (
        "pipe delimiter",
        "in.csv",
        "key|tags|sensitivity|title\nk|t|low|A\n",
        {"delimiter": "|"},
        [spec_item("k", ["t"], "low", {"title": "A"})],
    ),
    (
        "empty lines and blank rows skipped",
        "in.csv",
        "\n\nkey,tags,sensitivity,title\n\nk1,t,low,A\n,,,\n\r\nk2,t,low,B\n\n",
        {},
        [spec_item("k1", ["t"], "low", {"title": "A"}), spec_item("k2", ["t"], "low", {"title": "B"})],
    ),
    (
        "byte order mark ignored",
        "in.csv",
        "\ufeffkey,tags,sensitivity,title\nk,t,low,A\n",
        {},
        [spec_item("k", ["t"], "low", {"title": "A"})],
    ),
    (
        "tags split on , ; | plus --tag, repeats dropped",
        "in.csv",
        'key,tags,sensitivity,title\nk," a, b;c |a ",low,A\n',
        {"extra_tags": ["extra", "b"]},
        [spec_item("k", ["a", "b", "c", "extra"], "low", {"title": "A"})],
    ),
    (
        "--tag alone is enough",
        "in.csv",
        "key,sensitivity,title\nk,low,A\n",
        {"extra_tags": ["t"]},
        [spec_item("k", ["t"], "low", {"title": "A"})],
    ),
    (
        "--sensitivity fills missing cells only",
        "in.csv",
        "key,tags,sensitivity,title\na,t,,A\nb,t,high,B\n",
        {"sensitivity": "medium"},
        [spec_item("a", ["t"], "medium", {"title": "A"}), spec_item("b", ["t"], "high", {"title": "B"})],
    ),
    (
        "json single object with tags string",
        "in.json",
        '{"key": "k", "tags": "x,y", "sensitivity": "low", "value": [1, 2]}',
        {},
        [spec_item("k", ["x", "y"], "low", [1, 2])],
    ),
    ("json empty array", "in.json", "[ ]", {}, []),
    (
        "json numeric key becomes text",
        "in.json",
        '[{"id": 7, "tags": ["t"], "sensitivity": "low", "v": 1}]',
        {},
        [spec_item("7", ["t"], "low", {"v": 1})],
    ),
    (
        "json values are never cleaned",
        "in.json",
        '[{"key": "k", "tags": ["t"], "sensitivity": "low", "value": {"p": "$1,234.50", "z": "00123", '
        '"d": "05/01/2026"}}]',
        {},
        [spec_item("k", ["t"], "low", {"p": "$1,234.50", "z": "00123", "d": "05/01/2026"})],
    ),
]


@pytest.mark.parametrize(("name", "fname", "content", "kw", "expected"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted(
    store: MemoryStore,
    tmp_path: Path,
    name: str,
    fname: str,
    content: str,
    kw: dict[str, Any],
    expected: list[dict[str, Any]],
) -> None:
    report = run(store, tmp_path, fname, content, **kw)
    assert items(store) == expected
    assert report.rows_written == len(expected) == report.rows_valid


# ------------------------------------------------------------------------------------ cleaning

CLEAN_CSV = "".join(
    line + "\n"
    for line in [
        "key,tags,sensitivity,price,qty,ratio,zip,phone_number,card,plus,sci,pct,eu,neg,when,named,iso,bad_date",
        '00123,t,low,"$1,234.50","12,000",0.5,02134'
        ',5551234,4111111111111111,+15,1e5,12%,"1.234,50",-$5,13/01/2026,Jan 5 2026,2026-01-05,31/02/2026',
        "124,t,low,€5,7,-1.25,90210"
        ',5551235,1,+16,2e5,13%,"2,5",$-6.5,05/01/2026,"March 3rd, 2026",2026-01-06T10:00:00Z,',
        '125,t,low,99 £,"1,000,000",10,10001,5551236,2,+17,3e5,14%,1 234,-7,05/01/2026 14:30,5-Jan-2026,2026-01-07,',
    ]
)


def test_cleaning_is_done_conservatively_and_announced(store: MemoryStore, tmp_path: Path) -> None:
    report = run(store, tmp_path, "in.csv", CLEAN_CSV)
    got = {d["key"]: d["value"] for d in items(store)}
    assert got["00123"] == {
        "price": 1234.5,
        "qty": 12000,
        "ratio": 0.5,
        "zip": "02134",
        "phone_number": "5551234",
        "card": "4111111111111111",
        "plus": "+15",
        "sci": "1e5",
        "pct": "12%",
        "eu": "1.234,50",
        "neg": -5,
        "when": "2026-01-13",
        "named": "2026-01-05",
        "iso": "2026-01-05",
        "bad_date": "31/02/2026",
    }
    assert got["124"]["price"] == 5 and got["124"]["neg"] == -6.5 and got["124"]["eu"] == "2,5"
    assert got["124"]["when"] == "2026-01-05" and got["124"]["named"] == "2026-03-03"
    assert got["124"]["iso"] == "2026-01-06T10:00:00Z" and "bad_date" not in got["124"]
    assert got["125"]["price"] == 99 and got["125"]["qty"] == 1000000
    assert got["125"]["when"] == "2026-01-05T14:30:00" and got["125"]["named"] == "2026-01-05"
    assert got["124"]["card"] == "1" and got["125"]["card"] == "2"  # one long number: the column is text
    notices = set(report.notices)
    for expected in [
        "value.price: removed currency symbols ($, €, £) in 3 rows",
        "value.qty: removed thousands separators in 2 rows",
        "value.qty: read text as numbers in 1 row",
        "value.ratio: read text as numbers in 3 rows",
        "value.zip: kept 3 number- or date-like values as text (the column name looks like an identifier)",
        "value.phone_number: kept 3 number- or date-like values as text (the column name looks like an identifier)",
        "value.card: kept 3 number- or date-like values as text (some values are numbers of more than 15 "
        "digits, so the column holds identifiers)",
        "value.when: converted day-first dates (DD/MM/YYYY) to ISO 8601 in 3 rows",
        "value.named: converted dates to ISO 8601 in 3 rows",
        "value.bad_date: kept 1 value shaped like dates but not real dates as text",
        "value.bad_date: left out 2 blank cells",
    ]:
        assert expected in notices, (expected, report.notices)
    assert any(n.startswith("value.price: WARNING") for n in notices)
    assert not any(n.startswith(("value.iso", "value.plus", "value.sci", "value.pct", "value.eu")) for n in notices)


def test_leading_zeros_keep_the_whole_column_text(store: MemoryStore, tmp_path: Path) -> None:
    report = run(
        store, tmp_path, "in.csv", "key,tags,sensitivity,area,amount\n00007,t,low,02134,0.5\nk2,t,low,90210,007\n"
    )
    got = {d["key"]: d["value"] for d in items(store)}
    assert got == {"00007": {"area": "02134", "amount": "0.5"}, "k2": {"area": "90210", "amount": "007"}}
    assert (
        "value.area: kept 2 number- or date-like values as text (some values have leading zeros, "
        "so the column holds identifiers)"
    ) in report.notices


def test_keep_text_option(store: MemoryStore, tmp_path: Path) -> None:
    report = run(store, tmp_path, "in.csv", "key,tags,sensitivity,n,m\nk,t,low,12,12\n", keep_text=["n"])
    assert items(store)[0]["value"] == {"n": "12", "m": 12}
    assert "value.n: kept 1 number- or date-like value as text (--keep-text)" in report.notices


DATES: list[tuple[str, str, dict[str, Any], list[Any], str | None]] = [
    # (name, cells of one column, kwargs, expected values, a notice that must appear)
    (
        "day-first evidence settles the column",
        "13/01/2026|05/01/2026|01/02/2026",
        {},
        ["2026-01-13", "2026-01-05", "2026-02-01"],
        "value.d: converted day-first dates (DD/MM/YYYY) to ISO 8601 in 3 rows",
    ),
    (
        "month-first evidence settles the column",
        "01/13/2026|05/01/2026",
        {},
        ["2026-01-13", "2026-05-01"],
        "value.d: converted month-first dates (MM/DD/YYYY) to ISO 8601 in 2 rows",
    ),
    (
        "no evidence: kept as text",
        "05/01/2026|03/04/2026|07/07/2026",
        {},
        ["05/01/2026", "03/04/2026", "2026-07-07"],
        "value.d: kept 2 dates as text: day and month could be "
        "swapped and the column does not tell (pass --date-order dmy or mdy)",
    ),
    ("--date-order mdy", "05/01/2026|03/04/2026", {"date_order": "mdy"}, ["2026-05-01", "2026-03-04"], None),
    (
        "--date-order dmy and an impossible cell",
        "05/01/2026|01/13/2026",
        {"date_order": "dmy"},
        ["2026-01-05", "01/13/2026"],
        "value.d: kept 1 value shaped like dates but not real dates as text",
    ),
    (
        "year first and dotted",
        "2026/01/05|2026.1.6|2026-1-7",
        {},
        ["2026-01-05", "2026-01-06", "2026-01-07"],
        "value.d: converted dates to ISO 8601 in 3 rows",
    ),
    (
        "month names",
        "Jan 5 2026|January 5th, 2026|5 Jan 2026|05-Jan-2026|Sept 1 2026",
        {},
        ["2026-01-05"] * 4 + ["2026-09-01"],
        None,
    ),
    ("two-digit years never guessed", "05/01/26|Jan 5 26", {}, ["05/01/26", "Jan 5 26"], None),
]


@pytest.mark.parametrize(("name", "cells", "kw", "expected", "notice"), DATES, ids=[d[0] for d in DATES])
def test_value_dates(
    store: MemoryStore,
    tmp_path: Path,
    name: str,
    cells: str,
    kw: dict[str, Any],
    expected: list[Any],
    notice: str | None,
) -> None:
    rows = "".join(f'k{i},t,low,"{c}"\n' for i, c in enumerate(cells.split("|")))
    report = run(store, tmp_path, "in.csv", "key,tags,sensitivity,value.d\n" + rows, **kw)
    assert [d["value"]["d"] for d in items(store)] == expected
    if notice:
        assert notice in report.notices


def test_mixed_day_and_month_first_is_refused(store: MemoryStore, tmp_path: Path) -> None:
    err = refused(store, tmp_path, "in.csv", "key,tags,sensitivity,value.d\nk1,t,low,13/01/2026\nk2,t,low,01/13/2026\n")
    assert err.code == "IMPORT_INVALID"
    assert err.details is not None
    assert err.details["lines"] == [
        "row 1: column value.d has day-first dates (row 2) and month-first dates (row 3); pass --date-order dmy or mdy"
    ]


TIMESTAMPS: list[tuple[str, str, dict[str, Any], str]] = [
    ("canonical kept", "2026-07-01T10:00:00Z", {}, "2026-07-01T10:00:00Z"),
    ("offset converted to UTC", "2026-07-01T10:00:00+02:00", {}, "2026-07-01T08:00:00Z"),
    ("no zone read as UTC", "2026-07-01 10:00:00", {}, "2026-07-01T10:00:00Z"),
    ("date only is midnight", "2026-07-01", {}, "2026-07-01T00:00:00Z"),
    ("year first slashes", "2026/07/01", {}, "2026-07-01T00:00:00Z"),
    ("month name with time", "Jul 1 2026 09:05", {}, "2026-07-01T09:05:00Z"),
    ("unambiguous day-first", "25/12/2026", {}, "2026-12-25T00:00:00Z"),
    ("ambiguous with --date-order", "01/02/2026", {"date_order": "mdy"}, "2026-01-02T00:00:00Z"),
    ("fraction kept", "2026-07-01T10:00:00.250Z", {}, "2026-07-01T10:00:00.25Z"),
]


@pytest.mark.parametrize(("name", "cell", "kw", "expected"), TIMESTAMPS, ids=[t[0] for t in TIMESTAMPS])
def test_timestamps(
    store: MemoryStore, tmp_path: Path, name: str, cell: str, kw: dict[str, Any], expected: str
) -> None:
    report = run(store, tmp_path, "in.csv", f'key,tags,sensitivity,created,title\nk,t,low,"{cell}",A\n', **kw)
    got = store.get("k")
    assert got is not None and got.created_at == expected
    if cell != expected:
        assert "created_at: converted to ISO 8601 UTC in 1 row" in report.notices


def test_timestamp_defaults(store: MemoryStore, tmp_path: Path) -> None:
    run(
        store,
        tmp_path,
        "in.csv",
        "key,tags,sensitivity,updated_at,title\nk,t,low,2026-07-12T10:00:00Z,A\nk2,t,low,,B\n",
    )
    k, k2 = store.get("k"), store.get("k2")
    assert k is not None and k.created_at == k.updated_at == "2026-07-12T10:00:00Z"
    assert k2 is not None and k2.created_at == k2.updated_at and k2.created_at.startswith(NOW_ISH)


def test_column_evidence_applies_to_timestamps(store: MemoryStore, tmp_path: Path) -> None:
    run(store, tmp_path, "in.csv", "key,tags,sensitivity,created,t\nk1,t,low,01/02/2026,x\nk2,t,low,01/13/2026,y\n")
    k1 = store.get("k1")
    assert k1 is not None and k1.created_at == "2026-01-02T00:00:00Z"


# ------------------------------------------------------------------------------------ refusals


def test_missing_sensitivity_column_refuses_the_import(store: MemoryStore, tmp_path: Path) -> None:
    err = refused(store, tmp_path, "in.csv", "key,tags,title\nk,t,A\n")
    assert err.code == "IMPORT_INVALID"
    assert err.details is not None and any("--sensitivity" in line for line in err.details["lines"])
    err = refused(store, tmp_path, "in.json", '[{"key": "k", "tags": "t", "value": 1}]')
    assert err.details is not None
    assert err.details["lines"] == ["item [0]: sensitivity is missing (give --sensitivity)"]


SECRET = "s3cr3t-VALUE"

BAD_CSV = f"""\
key,tags,sensitivity,created_at,title
ok-1,t,low,,fine
,t,low,,{SECRET}
ok-2,t,low,,fine

bad-sens,t,{SECRET},,x
no-tags,,low,,x
bad-date,t,low,{SECRET},x
ok-1,t,low,,duplicate
short,t,low
ambiguous,t,low,01/02/2026,x
"""


def test_every_bad_row_is_reported_with_its_line(store: MemoryStore, tmp_path: Path) -> None:
    err = refused(store, tmp_path, "in.csv", BAD_CSV)
    assert err.code == "IMPORT_INVALID" and err.status == 400
    assert err.message == "7 rows are invalid; nothing was written"
    assert err.details is not None
    assert err.details["lines"] == [
        "row 3: key is empty",
        "row 6: sensitivity must be low, medium or high",
        "row 7: tags are empty (give a tags column or --tag)",
        "row 8: created_at is not a valid ISO 8601 timestamp or a recognised date",
        "row 9: key repeats the key of row 2",
        "row 10: the row has 3 fields, the header has 5",
        "row 11: created_at is an ambiguous date (day and month could be swapped); use YYYY-MM-DD or pass --date-order",
    ]
    assert [(e["row"], e["field"]) for e in err.details["errors"]] == [
        (3, "key"),
        (6, "sensitivity"),
        (7, "tags"),
        (8, "created_at"),
        (9, "key"),
        (10, "row"),
        (11, "created_at"),
    ]
    assert SECRET not in json.dumps(err.details) and SECRET not in err.message
    assert store.count() == 0


def test_row_numbers_count_physical_lines(store: MemoryStore, tmp_path: Path) -> None:
    content = 'key,tags,sensitivity,note\na,t,low,"three\nline\nnote"\n\n,t,low,x\nb,t,low,"two\nlines"\nc,t,bad,x\n'
    err = refused(store, tmp_path, "in.csv", content)
    assert err.details is not None
    assert err.details["lines"] == ["row 6: key is empty", "row 9: sensitivity must be low, medium or high"]


def test_one_bad_row_writes_nothing(store: MemoryStore, tmp_path: Path) -> None:
    rows = "".join(f"k{i},t,low,v{i}\n" for i in range(500)) + "k500,t,nope,v\n"
    err = refused(store, tmp_path, "in.csv", "key,tags,sensitivity,title\n" + rows)
    assert err.details is not None
    assert err.details["lines"] == ["row 502: sensitivity must be low, medium or high"]
    assert store.count() == 0


BAD_JSON_ITEMS = """\
[
  {"key": "a", "tags": ["t"], "sensitivity": "low", "value": 1},
  "not an object",
  {"key": "", "tags": ["t"], "sensitivity": "low", "value": 1},
  {"key": "b", "tags": [], "sensitivity": "low", "value": 1},
  {"key": "c", "tags": ["t"], "sensitivity": "low", "value": 1, "stray": 2},
  {"key": "d", "tags": ["t"], "sensitivity": "low"},
  {"key": "e", "tags": ["t"], "sensitivity": "low", "value": NaN},
  {"key": "f", "key": "g", "tags": ["t"], "sensitivity": "low", "value": 1},
  {"key": "a", "tags": ["t"], "sensitivity": "low", "value": 1},
  {"key": "h", "tags": [5], "sensitivity": "low", "value": 1},
  {"key": "i", "tags": ["t"], "sensitivity": "low", "value": 1, "created_at": 5}
]
"""


def test_json_bad_items_reported_by_index(store: MemoryStore, tmp_path: Path) -> None:
    err = refused(store, tmp_path, "in.json", BAD_JSON_ITEMS)
    assert err.details is not None
    rows = sorted({e["row"] for e in err.details["errors"]})
    assert rows == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert "item [1]: the item is not a JSON object" in err.details["lines"]
    assert "item [8]: key repeats the key of item [0]" in err.details["lines"]
    assert any(line.startswith("item [4]: fields outside value (stray)") for line in err.details["lines"])
    assert err.message == "10 rows are invalid; nothing was written"


FILE_REFUSALS: list[tuple[str, str, str | bytes, dict[str, Any], str]] = [
    ("no header", "in.csv", "\n\n", {}, "the file is empty (no header row)"),
    ("no key column", "in.csv", "tags,sensitivity,title\nt,low,A\n", {}, "no key column"),
    ("two key columns", "in.csv", "key,id,tags,sensitivity,t\nk,1,t,low,A\n", {}, "columns key, id all give key"),
    (
        "value and a field overlap",
        "in.csv",
        "key,tags,sensitivity,value,title\nk,t,low,v,A\n",
        {},
        "columns value and title give the same part of the value",
    ),
    (
        "nested overlap",
        "in.csv",
        "key,tags,sensitivity,value.a,value.a.b\nk,t,low,v,A\n",
        {},
        "give the same part of the value",
    ),
    ("no value column", "in.csv", "key,tags,sensitivity\nk,t,low\n", {}, "no value columns"),
    ("unnamed column", "in.csv", "key,tags,sensitivity,,t\nk,t,low,x,A\n", {}, "header column 4 has no name"),
    ("no tags and no --tag", "in.csv", "key,sensitivity,t\nk,low,A\n", {}, "no tags column and no --tag"),
    (
        "--map of a missing column",
        "in.csv",
        "key,tags,sensitivity,t\nk,t,low,A\n",
        {"mappings": {"nope": "value.x"}},
        "--map nope: no column has this name",
    ),
    ("bad utf-8", "in.csv", b"key,tags,sensitivity,t\nk,t,low,\xff\xfe\n", {}, "line 2 is not valid UTF-8"),
    ("bad quoting", "in.csv", 'key,tags,sensitivity,t\nk,t,low,"abc"def\n', {}, "malformed CSV at line 2"),
    ("invalid json", "in.json", '[{"key": "a"}, {"key": ]', {}, "invalid JSON in item [1]"),
    ("json root not an object", "in.json", '"hello"', {}, "the JSON root must be an object or an array"),
    (
        "json trailing garbage",
        "in.json",
        '[{"key": "a", "tags": "t", "sensitivity": "low", "value": 1}] x',
        {},
        "unexpected data after the array",
    ),
    ("json missing comma", "in.json", '[{"a": 1} {"b": 2}]', {}, "invalid JSON after item [0]"),
]


@pytest.mark.parametrize(
    ("name", "fname", "content", "kw", "fragment"), FILE_REFUSALS, ids=[f[0] for f in FILE_REFUSALS]
)
def test_file_refusals(
    store: MemoryStore, tmp_path: Path, name: str, fname: str, content: str | bytes, kw: dict[str, Any], fragment: str
) -> None:
    err = refused(store, tmp_path, fname, content, **kw)
    assert err.code == "IMPORT_INVALID"
    assert err.details is not None
    assert any(fragment in line for line in err.details["lines"]), err.details["lines"]


OPTION_REFUSALS: list[tuple[str, str, dict[str, Any]]] = [
    ("bad --map destination", "in.csv", {"mappings": {"a": "somewhere"}}),
    ("bad --sensitivity", "in.csv", {"sensitivity": "secret"}),
    ("bad --tag", "in.csv", {"extra_tags": ["a\nb"]}),
    ("bad --date-order", "in.csv", {"date_order": "ymd"}),
    ("two-character delimiter", "in.csv", {"delimiter": ";;"}),
    ("quote as delimiter", "in.csv", {"delimiter": '"'}),
    ("delimiter for json", "in.json", {"delimiter": ";"}),
    ("unknown format", "in.csv", {"fmt": "xml"}),
    ("unknown extension", "in.dat", {}),
]


@pytest.mark.parametrize(("name", "fname", "kw"), OPTION_REFUSALS, ids=[o[0] for o in OPTION_REFUSALS])
def test_option_refusals(store: MemoryStore, tmp_path: Path, name: str, fname: str, kw: dict[str, Any]) -> None:
    err = refused(store, tmp_path, fname, SPEC_CSV if fname.endswith("csv") else SPEC_JSON, **kw)
    assert err.code == "INVALID_REQUEST"


def test_missing_file(store: MemoryStore, tmp_path: Path) -> None:
    with pytest.raises(UompError) as e:
        import_file(store, tmp_path / "nope.csv")
    assert e.value.code == "INVALID_REQUEST"


def test_format_option_overrides_the_extension(store: MemoryStore, tmp_path: Path) -> None:
    run(store, tmp_path, "in.dat", SPEC_JSON, fmt="json")
    assert store.count() == 2


# ------------------------------------------------------------------------------------ existing keys


def test_existing_key_needs_replace(store: MemoryStore, tmp_path: Path) -> None:
    store.put(
        MemoryItem(
            key="note-1",
            value="old",
            tags=("old",),
            sensitivity="high",
            source="user",
            created_at="2020-01-01T00:00:00Z",
            updated_at="2020-01-01T00:00:00Z",
        )
    )
    err = refused(store, tmp_path, "in.csv", SPEC_CSV)
    assert err.details is not None and err.details["lines"] == [
        "row 2: an item with this key is already in the store (--replace overwrites it)"
    ]
    report = run(store, tmp_path, "in.csv", SPEC_CSV, replace=True)
    assert report.rows_written == 2 and report.replaced == 1
    note = store.get("note-1")
    assert note is not None and note.value == {"title": "Shopping list", "content": "Buy milk"}
    assert note.created_at == "2020-01-01T00:00:00Z" and note.updated_at != "2020-01-01T00:00:00Z"
    assert "created_at: not given, kept the existing item's creation time in 1 row" in report.notices
    assert store.by_tag("old") == []


def test_dry_run_writes_nothing(store: MemoryStore, tmp_path: Path) -> None:
    report = run(store, tmp_path, "in.csv", SPEC_CSV, dry_run=True)
    assert report.dry_run and report.rows_valid == 2 and report.rows_written == 0
    assert store.count() == 0


# ------------------------------------------------------------------------------------ bounds, streaming


def test_value_size_limit(store: MemoryStore, tmp_path: Path) -> None:
    limits = ImportLimits(max_value_bytes=100)
    content = "key,tags,sensitivity,t\nk1,t,low,short\nk2,t,low," + "x" * 200 + "\n"
    err = refused(store, tmp_path, "in.csv", content, limits=limits)
    assert err.details is not None and err.details["lines"] == ["row 3: value is larger than 100 bytes"]
    err = refused(
        store,
        tmp_path,
        "in.json",
        '[{"key": "k", "tags": "t", "sensitivity": "low", "value": "' + "x" * 200 + '"}]',
        limits=limits,
    )
    assert err.details is not None and err.details["lines"] == ["item [0]: value is larger than 100 bytes"]


def test_file_and_line_size_limits(store: MemoryStore, tmp_path: Path) -> None:
    err = refused(store, tmp_path, "in.csv", SPEC_CSV, limits=ImportLimits(max_file_bytes=20))
    assert err.code == "IMPORT_INVALID" and "larger than 20 bytes" in err.message
    err = refused(store, tmp_path, "in.csv", SPEC_CSV, limits=ImportLimits(max_line_bytes=30))
    assert err.details is not None and "line 1 is longer than 30 bytes" in err.details["lines"][0]
    err = refused(store, tmp_path, "in.json", SPEC_JSON, limits=ImportLimits(max_line_bytes=60))
    assert err.details is not None and "item [0] is larger than 60 bytes" in err.details["lines"][0]


def test_row_count_limit(store: MemoryStore, tmp_path: Path) -> None:
    err = refused(store, tmp_path, "in.csv", SPEC_CSV, limits=ImportLimits(max_rows=1))
    assert err.details is not None and "more than 1 rows" in err.details["lines"][0]


def test_reported_errors_are_bounded(store: MemoryStore, tmp_path: Path) -> None:
    rows = "".join(f",t,low,v{i}\n" for i in range(50))
    err = refused(
        store, tmp_path, "in.csv", "key,tags,sensitivity,t\n" + rows, limits=ImportLimits(max_reported_errors=10)
    )
    assert err.message == "50 rows are invalid; nothing was written"
    assert err.details is not None and len(err.details["errors"]) == 10
    assert err.details["lines"][-1] == "... and 40 more problems"


def test_json_is_parsed_across_tiny_chunks(store: MemoryStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = [
        {
            "key": f"k{i}",
            "tags": ["t"],
            "sensitivity": "low",
            "value": {"n": 12345 + i, "f": 1.25, "ok": True, "none": None, "s": "é ✓ \u00e9" * (i % 3)},
        }
        for i in range(40)
    ]
    monkeypatch.setattr(readers.JsonElements, "CHUNK", 7)
    run(store, tmp_path, "in.json", json.dumps(data, indent=1, ensure_ascii=False))
    expected = [d["value"] for d in sorted(data, key=lambda d: str(d["key"]))]
    assert [it.value for it in store.list()] == expected


def test_progress_bar_when_asked(store: MemoryStore, tmp_path: Path) -> None:
    """The importer reports progress through the callback; the CLI's bar draws it (the importer never
    prints: without a callback nothing reaches stderr)."""
    out = io.StringIO()
    run(store, tmp_path, "in.csv", SPEC_CSV, progress=ProgressBar(out))
    assert "100%" in out.getvalue() and out.getvalue().endswith("\n")
    assert out.getvalue().count("\n") == 1


def test_progress_callback_counts_both_csv_passes(
    store: MemoryStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[int, int]] = []
    path = write(tmp_path, "in.csv", SPEC_CSV)
    import_file(store, path, progress=lambda done, total: calls.append((done, total)))
    size = len(SPEC_CSV.encode())
    assert calls[0] == (0, 2 * size) and calls[-1] == (2 * size, 2 * size)
    assert all(t == 2 * size for _d, t in calls)
    assert [d for d, _t in calls] == sorted(d for d, _t in calls)
    quiet = run(store, tmp_path, "in2.csv", SPEC_CSV.replace("note-1", "n2").replace("contact-1", "c2"))
    assert quiet.rows_written == 2
    assert capsys.readouterr() == ("", "")


def test_progress_reaches_the_end_when_the_file_is_refused(store: MemoryStore, tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    with pytest.raises(UompError):
        run(store, tmp_path, "bad.json", b'[{"key": "a"', progress=lambda d, t: calls.append((d, t)))
    assert calls[0][0] == 0 and calls[-1][0] == calls[-1][1]


# ------------------------------------------------------------------------------------ atomicity


def test_store_failure_on_the_last_row_leaves_the_store_as_it_was(store: MemoryStore, tmp_path: Path) -> None:
    before = [
        MemoryItem(
            key=f"k{i}",
            value="old",
            tags=("old",),
            sensitivity="low",
            source="user",
            created_at="2020-01-01T00:00:00Z",
            updated_at="2020-01-01T00:00:00Z",
        )
        for i in range(3)
    ]
    store.put_many(before)
    store._conn.execute(
        "CREATE TRIGGER fail_last BEFORE INSERT ON items WHEN NEW.key = 'k99' "
        "BEGIN SELECT RAISE(ABORT, 'injected'); END"
    )
    rows = "".join(f"k{i},new,low,v{i}\n" for i in range(100))
    with pytest.raises(UompError) as e:
        run(store, tmp_path, "in.csv", "key,tags,sensitivity,t\n" + rows, replace=True)
    assert e.value.code == "STORE_UNAVAILABLE"
    assert store.list() == before
    assert store.by_tag("new") == []


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from gateway.guard import bulk as bulk_mod
    from gateway.guard.importer import import_file
    from gateway.guard.store import MemoryStore

    store = MemoryStore(Path(sys.argv[1]))
    store._conn.execute("PRAGMA cache_size = 8")  # spill dirty pages to the WAL before COMMIT
    stall_at = int(sys.argv[3])
    real_add = bulk_mod.BulkWriter.add

    def add(self, item):
        real_add(self, item)
        if self.written == stall_at:
            self.flush()  # every row so far is inside the open transaction
            print("MID-TRANSACTION", flush=True)
            time.sleep(120)

    bulk_mod.BulkWriter.add = add
    import_file(store, Path(sys.argv[2]), sensitivity="low", extra_tags=["bulk"], replace=True)
    print("FINISHED", flush=True)
""")


def test_killed_mid_import_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    """SIGKILL while the import transaction is open, after 15,000 of 20,000 rows were inserted (and
    spilled to the WAL): the store is as before, openable, intact. Meanwhile another connection
    reads the old state, and another writer is turned away after its busy timeout."""
    db = tmp_path / "memory.db"
    with MemoryStore(db) as s:
        s.put_many(
            [
                MemoryItem(
                    key=f"r{i}",
                    value={"old": i},
                    tags=("old",),
                    sensitivity="low",
                    source="user",
                    created_at="2020-01-01T00:00:00Z",
                    updated_at="2020-01-01T00:00:00Z",
                )
                for i in range(10)
            ]
        )
        before = s.list()
    rows = "".join(f"r{i},new,{'x' * 200}\n" for i in range(20_000))
    src = write(tmp_path, "big.csv", "key,tags,title\n" + rows)
    script = write(tmp_path, "kill.py", KILL_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(db), str(src), "15000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "MID-TRANSACTION", proc.stderr.read() if proc.stderr else ""
        wal = Path(str(db) + "-wal")
        assert wal.stat().st_size > 2 * 1024 * 1024  # thousands of rows really were written to the WAL
        with MemoryStore(db, create=False) as reader:  # the running guard's view: the old state
            assert reader.count() == 10 and reader.list() == before and reader.by_tag("new") == []
        with MemoryStore(db, create=False, busy_timeout=0.2) as writer, pytest.raises(UompError) as e:
            writer.put(
                MemoryItem(
                    key="other",
                    value=1,
                    tags=("t",),
                    sensitivity="low",
                    source="user",
                    created_at="2020-01-01T00:00:00Z",
                    updated_at="2020-01-01T00:00:00Z",
                )
            )
        assert e.value.code == "STORE_UNAVAILABLE" and e.value.details == {"reason": "SQLITE_BUSY"}
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    with MemoryStore(db, create=False) as s:
        assert s.count() == 10
        assert s.list() == before
        assert s.by_tag("new") == [] and s.by_tag("bulk") == []
        assert s._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        s.put(
            MemoryItem(
                key="after",
                value=1,
                tags=("t",),
                sensitivity="low",
                source="user",
                created_at="2020-01-01T00:00:00Z",
                updated_at="2020-01-01T00:00:00Z",
            )
        )
        assert s.count() == 11


# ------------------------------------------------------------------------------------ streaming writes


def old_items(n: int, prefix: str = "k") -> list[MemoryItem]:
    return [
        MemoryItem(
            key=f"{prefix}{i}",
            value={"old": i},
            tags=("old",),
            sensitivity="low",
            source="user",
            created_at="2020-01-01T00:00:00Z",
            updated_at="2020-01-01T00:00:00Z",
        )
        for i in range(n)
    ]


def count_adds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the items the importer hands to the store's bulk writer."""
    added = [0]
    real = bulk_mod.BulkWriter.add

    def add(self: bulk_mod.BulkWriter, item: MemoryItem) -> None:
        added[0] += 1
        real(self, item)

    monkeypatch.setattr(bulk_mod.BulkWriter, "add", add)
    return added


def test_bad_rows_near_the_end_are_all_reported_and_nothing_is_written(
    store: MemoryStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thousands of rows stream into the transaction before the first bad row; then writing stops,
    checking goes on to the end, every bad row is reported and the transaction is rolled back."""
    store.put_many(old_items(3, prefix="old"))
    added = count_adds(monkeypatch)
    lines = [f"k{i},t,low,v{i}\n" for i in range(5000)]
    lines[2600] = "old1,t,low,clash\n"  # already in the store (line 2602)
    lines[4990] = "k4990,t,secret,v\n"  # line 4992
    lines[4998] = ",t,low,v\n"  # line 5000
    lines[4999] = "k7,t,low,again\n"  # line 5001: repeats line 9
    err = refused(store, tmp_path, "in.csv", "key,tags,sensitivity,title\n" + "".join(lines))
    assert err.message == "4 rows are invalid; nothing was written"
    assert err.details is not None and err.details["lines"] == [
        "row 2602: an item with this key is already in the store (--replace overwrites it)",
        "row 4992: sensitivity must be low, medium or high",
        "row 5000: key is empty",
        "row 5001: key repeats the key of row 9",
    ]
    assert 2000 <= added[0] < 3000  # written up to the chunk with the first bad row, not beyond
    assert store.count() == 3 and store.get("k0") is None


def test_json_bad_item_at_the_end_writes_nothing(
    store: MemoryStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    added = count_adds(monkeypatch)
    data: list[Any] = [{"key": f"k{i}", "tags": ["t"], "sensitivity": "low", "value": i} for i in range(3000)]
    data[-1] = {"key": "last", "tags": [], "sensitivity": "low", "value": 1}
    err = refused(store, tmp_path, "in.json", json.dumps(data))
    assert err.details is not None and err.details["lines"] == [
        "item [2999]: tags are empty (give a tags column or --tag)"
    ]
    assert added[0] >= 2000 and store.count() == 0


def test_many_chunks_with_replace(store: MemoryStore, tmp_path: Path) -> None:
    store.put_many(old_items(1500))
    rows = "".join(f"k{i},new,low,v{i}\n" for i in range(2500))
    report = run(store, tmp_path, "in.csv", "key,tags,sensitivity,title\n" + rows, replace=True)
    assert report.rows_written == report.rows_valid == 2500 and report.replaced == 1500
    assert store.count() == 2500 and store.by_tag("old") == [] and len(store.by_tag("new", limit=5000)) == 2500
    k1, k2000 = store.get("k1"), store.get("k2000")
    assert k1 is not None and k1.created_at == "2020-01-01T00:00:00Z" and k1.value == {"title": "v1"}
    assert k2000 is not None and k2000.created_at == k2000.updated_at != "2020-01-01T00:00:00Z"
    assert report.notices[-3:] == [
        "updated_at: not given, set to the import time in 2500 rows",
        "created_at: not given, kept the existing item's creation time in 1500 rows",
        "created_at: not given, set to the import time in 1000 rows",
    ]


def test_reader_sees_the_old_state_during_the_import(
    store: MemoryStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put_many(old_items(5))
    seen: list[tuple[int, Any, list[str]]] = []
    real = bulk_mod.BulkWriter.add

    def add(self: bulk_mod.BulkWriter, item: MemoryItem) -> None:
        real(self, item)
        if self.written == 2500:
            self.flush()
            with MemoryStore(store.path, create=False) as reader:
                k0 = reader.get("k0")
                seen.append((reader.count(), k0.value if k0 else None, [i.key for i in reader.by_tag("new")]))

    monkeypatch.setattr(bulk_mod.BulkWriter, "add", add)
    rows = "".join(f"k{i},new,low,v{i}\n" for i in range(3000))
    run(store, tmp_path, "in.csv", "key,tags,sensitivity,title\n" + rows, replace=True)
    assert seen == [(5, {"old": 0}, [])]
    with MemoryStore(store.path, create=False) as reader:
        assert reader.count() == 3000 and reader.get("k0") is not None
        assert len(reader.by_tag("new", limit=5000)) == 3000


def test_dry_run_takes_no_write_lock(store: MemoryStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run reads one snapshot and writes nothing: another writer is not blocked meanwhile."""
    store.put_many(old_items(2))
    real = bulk_mod.BulkWriter.add
    wrote: list[bool] = []

    def add(self: bulk_mod.BulkWriter, item: MemoryItem) -> None:
        real(self, item)
        if self.dry_run and not wrote:  # (other.put goes through a BulkWriter too)
            with MemoryStore(store.path, create=False, busy_timeout=0.2) as other:
                other.put(
                    MemoryItem(
                        key="during",
                        value=1,
                        tags=("t",),
                        sensitivity="low",
                        source="user",
                        created_at="2020-01-01T00:00:00Z",
                        updated_at="2020-01-01T00:00:00Z",
                    )
                )
                wrote.append(True)

    monkeypatch.setattr(bulk_mod.BulkWriter, "add", add)
    rows = "".join(f"k{i},new,low,v{i}\n" for i in range(1500))
    report = run(store, tmp_path, "in.csv", "key,tags,sensitivity,title\n" + rows, dry_run=True, replace=True)
    assert wrote == [True]
    assert report.rows_written == 0 and report.rows_valid == 1500 and report.replaced == 2
    assert store.count() == 3 and store.by_tag("new") == []


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, tracemalloc
    from pathlib import Path
    from gateway.guard.store import MemoryStore
    from gateway.guard.importer import import_file

    with MemoryStore(Path(sys.argv[1])) as store:
        tracemalloc.start()
        report = import_file(store, Path(sys.argv[2]))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert store.count() == report.rows_written
    print(json.dumps({"peak": peak, "rows": report.rows_written}))
""")


def test_peak_memory_does_not_grow_with_the_row_count(tmp_path: Path) -> None:
    """The tracemalloc peak of a 4x bigger import (CSV and JSON) is about the same, not 4x. (Keeping
    every row, as the importer once did, took ~1.2 KiB per row: 24 MiB for 20,000 rows. Now the peak
    is one chunk of rows, ~1.3 MiB for CSV from 5,000 to 100,000 rows. 5,000 vs 20,000 keeps the test
    short: tracemalloc makes an import about five times slower.)"""
    script = write(tmp_path, "mem.py", MEMORY_SCRIPT)
    procs = {}
    small_n, big_n = 5_000, 20_000
    for n in (small_n, big_n):
        csv_rows = "".join(
            f"item-{i},t{i % 7};all,low,Title {i},${i % 1000}.25,{i % 28 + 1:02d}/01/2026\n" for i in range(n)
        )
        csv_src = write(tmp_path, f"m{n}.csv", "key,tags,sensitivity,title,price,when\n" + csv_rows)
        json_src = write(
            tmp_path,
            f"m{n}.json",
            "["
            + ",".join(
                json.dumps({"key": f"item-{i}", "tags": [f"t{i % 7}"], "sensitivity": "low", "title": f"T {i}"})
                for i in range(n)
            )
            + "]",
        )
        for kind, src in (("csv", csv_src), ("json", json_src)):
            procs[kind, n] = subprocess.Popen(
                [sys.executable, str(script), str(tmp_path / f"{kind}{n}.db"), str(src)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
    peaks = {}
    for key, proc in procs.items():
        out, errs = proc.communicate(timeout=120)
        assert proc.returncode == 0, errs
        result = json.loads(out)
        assert result["rows"] == key[1]
        peaks[key] = result["peak"]
    for kind in ("csv", "json"):
        small, big = peaks[kind, small_n], peaks[kind, big_n]
        assert big < 1.5 * small, (kind, small, big)
        assert big < 8 * 1024 * 1024, (kind, big)  # a few MiB, where keeping the rows took ~24 MiB
