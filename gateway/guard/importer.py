"""Import Memory Items from CSV or JSON files (spec §12).

Entry point: :func:`import_file`. Nothing is written unless every row is valid: the rows stream into
ONE SQLite transaction (:meth:`MemoryStore.bulk_writer`) that is committed only after the last row
has been read and no row was bad, so an import that fails or is killed half-way leaves the store
exactly as it was. Memory does not grow with the number of rows (see "Memory" below).

Input
-----
* CSV: UTF-8 (a leading byte-order mark is ignored), the first non-blank row is the header,
  delimiter ``,`` by default (``\\t`` for ``.tsv`` files; any single character with ``delimiter``,
  ``"tab"`` also accepted), fields containing the delimiter, quotes or new lines in double
  quotes. Blank lines and rows whose cells are all empty are skipped (and counted in a notice).
* JSON: one object or an array of objects, read incrementally (one array element at a time).

Fields (§12.6, §12.7)
---------------------
Header names / top-level JSON fields are matched case-insensitively against the reserved fields
``key tags sensitivity source description created_at updated_at`` and their aliases (``id``,
``item_id``, ``record_id``; ``tag``; ``level``; ``origin``; ``desc``; ``created``; ``updated``).
``mappings`` (``--map SRC=DST``) come first: SRC is an exact header / field name, DST a reserved
field, ``value`` or ``value.a.b``. ``value.a.b`` names build a nested value. In CSV every other
column becomes a field of the value object (a column named ``value`` is the whole value). In JSON
a ``value`` field is the value; without one, every non-reserved top-level field is a field of the
value object; an object with a ``value`` and other unmapped fields is refused (nothing is dropped
silently). Two names that land on the same field, or a field and one nested under it, are refused.

tags: a JSON list, or a string split on ``,`` ``;`` ``|``; pieces are trimmed, empty pieces
dropped, repeats removed; ``extra_tags`` are added to every row. A row must end up with a tag.
sensitivity: required (§12.8). ``sensitivity=`` fills rows that have none (announced); with no
sensitivity column and no default the whole import is refused. Case is folded (announced).
source defaults to ``user``. Keys are trimmed (announced); JSON integer keys become text
(announced). Key uniqueness is checked across the whole store, not per tag (the store's key is
its primary key), which is stricter than §12.9 asks.

Timestamps
----------
created_at / updated_at must be ISO 8601 or one of the date formats below; they are stored as UTC
``YYYY-MM-DDTHH:MM:SSZ``. A date alone means midnight UTC, a time without a zone is read as UTC;
both are announced. Missing updated_at = the import time; missing created_at = the existing
item's created_at when replacing it, else updated_at.

Cleaning of CSV value cells (JSON values are typed already and are never changed)
---------------------------------------------------------------------------------
Each kind of change is counted per field and announced in ``ImportReport.notices``.

* Blank cells (empty or only spaces) are left out of the value object.
* Numbers: ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?`` becomes a JSON number. Thousands separators are
  removed only in the exact ``1,234,567.89`` grouping (comma groups of three); a currency symbol
  ``$ € £ ¥`` before or after the number is removed (one symbol, optional single space). Anything
  else stays text: leading zeros (``00123``, ``0123``), ``+`` signs, exponents (``1e5``), ``.5``,
  percentages, spaces or dots as group separators (``1.234,50``), and numbers of more than 15
  digits (beyond exact double precision: card and account numbers).
* A column keeps ALL its cells as text (no number or date conversion, announced) when any cell has
  a leading zero (zip codes: ``02134`` and ``90210`` stay alike) or is a number of more than 15
  digits (card and account numbers), when its name looks like an
  identifier (last word ``id``, ``uuid``, ``phone``, ``tel``, ``mobile``, ``fax``, ``zip``,
  ``postcode``, ``postal``, ``sku``, ``iban``, ``ssn``, ``pin``, ``isbn``, ``ean``, ``upc``,
  ``code``, or ``<anything> number|no|num|nr`` such as ``phone_number``), or when it is named in
  ``keep_text`` (``--keep-text``).
* Dates become ISO 8601 (``2026-01-05``, or ``2026-01-05T14:30:00`` with a time, no zone invented)
  from: ``YYYY/MM/DD``, ``YYYY.MM.DD``, ``YYYY-M-D``; ``Jan 5 2026``, ``Jan 5, 2026``,
  ``January 5th, 2026``, ``5 Jan 2026``, ``05-Jan-2026`` (English month names); and
  ``A/B/YYYY`` (also ``.`` or ``-``), each optionally followed by `` HH:MM[:SS]``. Text already in
  ISO 8601 is left alone. Two-digit years are never guessed.
  ``A/B/YYYY`` is day-first or month-first by these rules: ``date_order`` (``--date-order dmy|mdy``)
  decides when given; otherwise the column decides: a first pass over the file collects every
  cell with A > 12 (day-first evidence) or B > 12 (month-first evidence). One kind of evidence
  settles the whole column; both kinds refuse the import; none leaves ambiguous cells (A, B <= 12,
  A != B) as text in values (announced) and makes them an error in created_at / updated_at.
  Something shaped like a date that is not a real date (``31/02/2026``) stays text (announced).

Validation (§12.9): every row is checked and every bad row is reported with its number (CSV: the
file line the record starts on; JSON: the 0-based array index) in
``UompError(ErrorCode.IMPORT_INVALID, ...).details`` = ``{"errors": [{"row", "field", "message"}],
"lines": ["row 3: key is empty", ...]}`` (the first :attr:`ImportLimits.max_reported_errors`).
Messages name fields and rows, never the values in them.

Memory and the transaction
--------------------------
CSV files are read twice from disk (pass 1: header and the per-column profile that settles date
order and text columns; pass 2: conversion) and never held whole; JSON is parsed one array element
at a time (an element is bounded by ``max_line_bytes``). In pass 2 / the JSON pass, each valid row
is queued; every :data:`~gateway.guard.store.BULK_CHUNK` rows the queue's keys are looked up in the
store inside the import transaction (existing key: an error unless ``replace``; with ``replace``
the old ``created_at`` is kept), then the rows are handed to the store's bulk writer, which
inserts them into the open ``BEGIN IMMEDIATE`` transaction. Once any row is bad nothing more is
written, but every later row is still checked, so every bad row is reported; then the transaction
is rolled back. ``dry_run`` does the same with a read-only snapshot and never writes.
Duplicate keys within the file are found with an index of the keys seen so far (and the row that
gave each) kept in a private temporary SQLite database (an unnamed file in the temporary directory
that SQLite unlinks at once and deletes on close; only a keyed hash of each key goes there, never a
key or a value; its page cache is bounded). So memory is bounded by one chunk of rows, one CSV
record / JSON element and the reported errors, not by the row count (benchmarks/bench_import.py, tests/test_import.py).
While the import transaction is open the running guard (another connection) keeps reading the
store as it was before the import (WAL); another writer (``uomp memory add``) waits up to the
store's busy timeout and then fails with STORE_UNAVAILABLE, so run large imports when nothing else
writes. The transaction is opened after CSV pass 1, when the first chunk of rows is ready.

Bounds: :class:`ImportLimits` (file size, value size, line / JSON element size, row count,
reported errors).
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import hashlib
import hmac
import itertools
import json
import os
import re
import secrets
import sqlite3
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import IO, Any, BinaryIO, ClassVar

from gateway.errors import ErrorCode, UompError
from gateway.guard.store import (
    BULK_CHUNK,
    MAX_TAGS,
    MAX_VALUE_BYTES,
    SENSITIVITIES,
    BulkWriter,
    MemoryItem,
    MemoryStore,
    description_problem,
    key_problem,
    source_problem,
    tags_problem,
    utc_now,
)

RESERVED = ("key", "tags", "sensitivity", "source", "description", "created_at", "updated_at")
ALIASES: dict[str, str] = {
    "key": "key", "id": "key", "item_id": "key", "record_id": "key",
    "tags": "tags", "tag": "tags",
    "sensitivity": "sensitivity", "level": "sensitivity",
    "source": "source", "origin": "source",
    "description": "description", "desc": "description",
    "created_at": "created_at", "created": "created_at",
    "updated_at": "updated_at", "updated": "updated_at",
}
TIMESTAMP_FIELDS = ("created_at", "updated_at")
DATE_ORDERS = ("dmy", "mdy")
FORMATS = ("csv", "json")
PROGRESS_MIN_BYTES = 1024 * 1024  # the CLI shows a bar on a terminal only for files at least this big

_TAG_SPLIT = re.compile(r"[,;|]")


@dataclass(frozen=True)
class ImportLimits:
    """Bounds on one import. Memory does not depend on ``max_rows`` (rows stream into the store's
    transaction); it bounds how big, and how long, one import transaction can get."""

    max_file_bytes: int = 1024 * 1024 * 1024
    max_value_bytes: int = MAX_VALUE_BYTES  # one item's value, as JSON
    max_line_bytes: int = 4 * 1024 * 1024  # one CSV physical line, or one JSON array element
    max_rows: int = 1_000_000
    max_reported_errors: int = 1000


@dataclass
class ImportReport:
    """What an import did. ``notices``: every kind of cleaning or defaulting, one sentence each
    (field, what, how many rows). ``rows_valid``: rows that passed validation (= written unless
    ``dry_run``); ``replaced``: keys that were already in the store (overwritten with --replace)."""

    rows_written: int
    notices: list[str] = field(default_factory=list)
    rows_valid: int = 0
    replaced: int = 0
    dry_run: bool = False
    format: str = "csv"


# ============================================================================ value paths

# A destination: a reserved field name (str) or a path inside the value (tuple; () = whole value).
Dest = str | tuple[str, ...]


def _parse_value_path(text: str) -> tuple[str, ...] | None:
    """``value`` -> (), ``value.a.b`` -> ("a", "b"); None when not a value path."""
    if text.lower() == "value":
        return ()
    if text[:6].lower() != "value.":
        return None
    parts = tuple(text[6:].split("."))
    if any(not p for p in parts):
        raise _FileError(f"{text}: a value path has an empty part")
    return parts


def _parse_mapping_dst(dst: str) -> Dest:
    d = dst.strip()
    if d in RESERVED:
        return d
    try:
        path = _parse_value_path(d)
    except _FileError:
        path = None
    if path is None:
        raise UompError(ErrorCode.INVALID_REQUEST, f"--map destination {d!r} must be one of {', '.join(RESERVED)}, "
                        "value or value.<field>[.<field>...]")
    return path


def _label(dest: Dest) -> str:
    if isinstance(dest, str):
        return dest
    return "value" + "".join("." + p for p in dest)


def _overlaps(paths: Sequence[tuple[tuple[str, ...], str]]) -> list[tuple[str, str]]:
    """Pairs of names whose value paths collide (equal, or one nested under the other)."""
    out: list[tuple[str, str]] = []
    ordered = sorted(paths)
    for (p, a), (q, b) in itertools.pairwise(ordered):
        if q[: len(p)] == p:
            out.append((a, b))
    return out


def _set_path(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        nxt = obj.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            obj[part] = nxt
        obj = nxt
    obj[path[-1]] = value


class _FileError(Exception):
    """The file as a whole cannot be imported (header, encoding, syntax, size)."""

    def __init__(self, message: str, row: int | None = None, field_name: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.row = row
        self.field_name = field_name


# ============================================================================ dates and numbers

def _month_names() -> dict[str, int]:
    names = ("january", "february", "march", "april", "may", "june", "july", "august", "september",
             "october", "november", "december")
    out = {n: i for i, n in enumerate(names, start=1)}
    out.update({n[:3]: i for i, n in enumerate(names, start=1)})
    out["sept"] = 9
    return out


_MONTHS = _month_names()

_TIME = r"(?:[ T](\d{1,2}):(\d{2})(?::(\d{2}))?)?"
_ISO_VALUE = re.compile(r"\d{4}-\d{2}-\d{2}"
                        r"(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}(?::?\d{2})?)?)?")
_ISO_PREFIX = re.compile(r"\d{4}-\d{2}-\d{2}")
_YMD = re.compile(r"(\d{4})([/.-])(\d{1,2})\2(\d{1,2})" + _TIME)
_NUMERIC = re.compile(r"(\d{1,2})([/.-])(\d{1,2})\2(\d{4})" + _TIME)
_MONTH_DAY = re.compile(r"([A-Za-z]{3,9})\.? (\d{1,2})(?:st|nd|rd|th)?,? (\d{4})" + _TIME)
_DAY_MONTH = re.compile(r"(\d{1,2})(?:st|nd|rd|th)?([ -])([A-Za-z]{3,9})\.?,?\2(\d{4})" + _TIME)

_AMOUNT = re.compile(
    r"(?P<neg1>-)?(?P<pre>[$€£¥])?(?P<sp1> )?(?P<neg2>-)?"
    r"(?P<int>[1-9]\d{0,2}(?:,\d{3})+|0|[1-9]\d*)(?P<frac>\.\d+)?"
    r"(?P<sp2> )?(?P<post>[$€£¥])?"
)
_LEADING_ZERO = re.compile(r"[-$€£¥]?0\d[\d,]*(?:\.\d+)?")
MAX_NUMBER_DIGITS = 15

_Time = tuple[int, int, int] | None


def _time_of(h: str | None, m: str | None, s: str | None) -> _Time:
    if h is None or m is None:
        return None
    return int(h), int(m), int(s) if s else 0


def _numeric_date(text: str) -> tuple[int, int, int, _Time] | None:
    """``A/B/YYYY`` -> (A, B, year, time) without deciding which of A, B is the day."""
    m = _NUMERIC.fullmatch(text)
    if not m:
        return None
    return int(m.group(1)), int(m.group(3)), int(m.group(4)), _time_of(m.group(5), m.group(6), m.group(7))


def _evidence(a: int, b: int) -> str | None:
    if a > 12 >= b:
        return "dmy"
    if b > 12 >= a:
        return "mdy"
    return None


def _ambiguous(a: int, b: int) -> bool:
    return a != b and a <= 12 and b <= 12


def _build(y: int, mo: int, d: int, t: _Time) -> datetime | date | None:
    try:
        if t is None:
            return date(y, mo, d)
        return datetime(y, mo, d, *t)
    except ValueError:
        return None


def _definite_date(text: str) -> datetime | date | bool | None:
    """YMD and month-name forms. A date, None (not such a form), or False (such a form, invalid)."""
    m = _YMD.fullmatch(text)
    if m:
        return _build(int(m.group(1)), int(m.group(3)), int(m.group(4)),
                      _time_of(m.group(5), m.group(6), m.group(7))) or False
    m = _MONTH_DAY.fullmatch(text)
    if m:
        month = _MONTHS.get(m.group(1).lower())
        if month is None:
            return None
        return _build(int(m.group(3)), month, int(m.group(2)),
                      _time_of(m.group(4), m.group(5), m.group(6))) or False
    m = _DAY_MONTH.fullmatch(text)
    if m:
        month = _MONTHS.get(m.group(3).lower())
        if month is None:
            return None
        return _build(int(m.group(4)), month, int(m.group(1)),
                      _time_of(m.group(5), m.group(6), m.group(7))) or False
    return None


def _resolve_numeric(parts: tuple[int, int, int, _Time], order: str) -> datetime | date | None:
    a, b, y, t = parts
    day, month = (a, b) if order == "dmy" else (b, a)
    return _build(y, month, day, t)


def _iso_value(d: datetime | date) -> str:
    if isinstance(d, datetime):
        return d.strftime("%Y-%m-%dT%H:%M:%S")
    return d.isoformat()


def _utc_text(dt: datetime) -> str:
    dt = dt.astimezone(UTC)
    text = dt.strftime("%Y-%m-%dT%H:%M:%S")
    if dt.microsecond:
        text += f".{dt.microsecond:06d}".rstrip("0")
    return text + "Z"


def _amount(text: str) -> tuple[int | float, bool, str | None] | str | None:
    """Parse a number cell. (number, had_thousands, currency) | "long" | None (not a number)."""
    m = _AMOUNT.fullmatch(text)
    if not m:
        return None
    pre, post = m.group("pre"), m.group("post")
    if m.group("neg1") and m.group("neg2"):
        return None
    if pre and post:
        return None
    if (m.group("sp1") and not pre) or (m.group("sp2") and not post):
        return None
    if m.group("neg2") and not pre:
        return None
    digits = m.group("int").replace(",", "")
    frac = m.group("frac") or ""
    if len(digits) + max(0, len(frac) - 1) > MAX_NUMBER_DIGITS:
        return "long"
    negative = bool(m.group("neg1") or m.group("neg2"))
    number: int | float = float(digits + frac) if frac else int(digits)
    if negative:
        number = -number
    return number, "," in m.group("int"), pre or post


_ID_LAST = frozenset(("id", "ids", "uuid", "guid", "phone", "tel", "telephone", "mobile", "fax", "zip",
                      "zipcode", "postcode", "postal", "sku", "iban", "ssn", "pin", "isbn", "ean", "upc",
                      "code"))
_NUMBER_WORDS = frozenset(("number", "no", "num", "nr"))


def _identifier_like(name: str) -> bool:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    words = [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]
    if not words:
        return False
    return words[-1] in _ID_LAST or (len(words) >= 2 and words[-1] in _NUMBER_WORDS)


# ============================================================================ notices

class _Notices:
    """Counts of each kind of change, per field; rendered as sentences in first-seen order."""

    # {n}: the count; {rows}: "1 row" / "N rows"; {s}: plural ending for {n}; {extra}: details.
    _TEXT: ClassVar[dict[str, str]] = {
        "blank": "left out {n} blank cell{s}",
        "number": "read text as numbers in {rows}",
        "thousands": "removed thousands separators in {rows}",
        "currency": "removed currency symbols ({extra}) in {rows}",
        "date": "converted dates to ISO 8601 in {rows}",
        "date_dmy": "converted day-first dates (DD/MM/YYYY) to ISO 8601 in {rows}",
        "date_mdy": "converted month-first dates (MM/DD/YYYY) to ISO 8601 in {rows}",
        "ambiguous": "kept {n} date{s} as text: day and month could be swapped and the column does not "
                     "tell (pass --date-order dmy or mdy)",
        "not_a_date": "kept {n} value{s} shaped like dates but not real dates as text",
        "long_number": "kept {n} number{s} longer than 15 digits as text",
        "kept_text": "kept {n} number- or date-like value{s} as text ({extra})",
        "ts_converted": "converted to ISO 8601 UTC in {rows}",
        "ts_assumed_utc": "no time zone given, read as UTC in {rows}",
        "ts_default_now": "not given, set to the import time in {rows}",
        "ts_default_updated": "not given, set to updated_at in {rows}",
        "ts_kept_existing": "not given, kept the existing item's creation time in {rows}",
        "trimmed": "removed surrounding white space in {rows}",
        "lowercased": "changed to lower case in {rows}",
        "default_sensitivity": "not given, set to {extra} (--sensitivity) in {rows}",
        "default_source": "not given, set to user in {rows}",
        "numeric_key": "converted numeric keys to text in {rows}",
    }

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}  # (label, kind) -> count, in first-seen order
        self.extra: dict[tuple[str, str], list[str]] = {}
        self.plain: list[str] = []

    def add(self, label: str, kind: str, extra: str | None = None) -> None:
        k = (label, kind)
        self.counts[k] = self.counts.get(k, 0) + 1
        if extra is not None:
            seen = self.extra.setdefault(k, [])
            if extra not in seen:
                seen.append(extra)

    def merge(self, other: _Notices) -> None:
        """Add ``other``'s counts after this one's (its new kinds come last, in its order)."""
        for k, n in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + n
        for k, extras in other.extra.items():
            seen = self.extra.setdefault(k, [])
            seen.extend(e for e in extras if e not in seen)
        self.plain.extend(other.plain)

    def render(self) -> list[str]:
        """Plain notices, then per field (fields in first-seen order) each kind of change."""
        by_label: dict[str, list[tuple[str, int]]] = {}
        for (label, kind), n in self.counts.items():
            by_label.setdefault(label, []).append((kind, n))
        out = list(self.plain)
        for label, kinds in by_label.items():
            for kind, n in kinds:
                extras = self.extra.get((label, kind), [])
                extra = ", ".join(extras)
                rows = "1 row" if n == 1 else f"{n} rows"
                out.append(f"{label}: " + self._TEXT[kind].format(n=n, s="" if n == 1 else "s", rows=rows,
                                                                  extra=extra))
                if kind == "currency" and len(extras) > 1:
                    out.append(f"{label}: WARNING: amounts in several currencies ({extra}) are now plain "
                               "numbers and no longer comparable")
        return out


# ============================================================================ errors

class _Errors:
    def __init__(self, limit: int, json_rows: bool) -> None:
        self.limit = limit
        self.json_rows = json_rows
        self.items: list[dict[str, Any]] = []
        self.bad_count = 0  # distinct bad rows
        self._last_bad: int | None = None
        self.total = 0

    def add(self, row: int, field_name: str, message: str) -> None:
        # Rows are checked in file order and a row's errors are added together while it is read; the
        # one later error (key already in the store) only ever goes to a row that had none before.
        # So a row number other than the last one is a new bad row: no set that grows with the file.
        if row != self._last_bad:
            self._last_bad = row
            self.bad_count += 1
        self.total += 1
        if len(self.items) < self.limit:
            self.items.append({"row": row, "field": field_name, "message": message})

    def where(self, row: int | None) -> str:
        if row is None:
            return "file"
        return f"item [{row}]" if self.json_rows else f"row {row}"

    def raise_if_any(self) -> None:
        err = self.error()
        if err is not None:
            raise err

    def error(self, file_errors: Sequence[_FileError] = ()) -> UompError | None:
        if not self.items and not file_errors:
            return None
        errors: list[dict[str, Any]] = [
            {"row": fe.row, "field": fe.field_name, "message": fe.message} for fe in file_errors]
        errors += sorted(self.items, key=lambda e: (e["row"], e["field"]))
        lines = [f"{self.where(e['row'])}: {e['message']}" for e in errors]
        if self.total > len(self.items):
            lines.append(f"... and {self.total - len(self.items)} more problems")
        n = self.bad_count
        if n:
            message = f"{n} rows are invalid" if n != 1 else "1 row is invalid"
            message += "; nothing was written"
        else:
            message = "the file cannot be imported; nothing was written"
        return UompError(ErrorCode.IMPORT_INVALID, message, details={"errors": errors, "lines": lines})


# ============================================================================ progress

class _Progress:
    WIDTH = 30

    def __init__(self, total: int, enabled: bool, stream: IO[str] | None) -> None:
        self.total = max(total, 1)
        self.enabled = enabled
        self.stream = stream
        self.done = 0
        self.last = 0.0
        self.drawn = False

    def add(self, n: int) -> None:
        self.done += n
        if self.enabled:
            now = time.monotonic()
            if now - self.last >= 0.1:
                self.last = now
                self._draw()

    def _draw(self) -> None:
        stream = self.stream or sys.stderr
        frac = min(1.0, self.done / self.total)
        filled = int(frac * self.WIDTH)
        mib = 1024 * 1024
        stream.write(f"\rimport [{'#' * filled}{'.' * (self.WIDTH - filled)}] {int(frac * 100):3d}% "
                     f"{self.done / mib:.1f}/{self.total / mib:.1f} MiB")
        stream.flush()
        self.drawn = True

    def finish(self) -> None:
        if self.enabled:
            self.done = self.total
            self._draw()
            (self.stream or sys.stderr).write("\n")


# ============================================================================ reading

class _Source:
    """The open file, read twice for CSV (profile pass, then conversion pass), bounded in size."""

    def __init__(self, path: Path, limits: ImportLimits) -> None:
        self.path = path
        self.limits = limits
        try:
            self.fh: BinaryIO = open(path, "rb")  # closed by close()
        except OSError as exc:
            raise UompError(ErrorCode.INVALID_REQUEST, f"cannot open {path}: {exc.strerror}") from exc
        st = os.fstat(self.fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            self.fh.close()
            raise UompError(ErrorCode.INVALID_REQUEST, f"{path} is not a regular file")
        if st.st_size > limits.max_file_bytes:
            self.fh.close()
            raise UompError(ErrorCode.IMPORT_INVALID, f"the file is larger than {limits.max_file_bytes} bytes")
        self.size = st.st_size
        self.stamp = (st.st_size, st.st_mtime_ns)
        self.read_bytes = 0

    def rewind(self) -> None:
        st = os.fstat(self.fh.fileno())
        if (st.st_size, st.st_mtime_ns) != self.stamp:
            raise _FileError("the file changed while it was being imported")
        self.fh.seek(0)
        self.read_bytes = 0

    def count(self, n: int) -> None:
        self.read_bytes += n
        if self.read_bytes > self.limits.max_file_bytes:
            raise _FileError(f"the file is larger than {self.limits.max_file_bytes} bytes")

    def close(self) -> None:
        self.fh.close()


def _csv_lines(src: _Source, progress: _Progress, state: dict[str, int]) -> Iterator[str]:
    """Physical lines, decoded strictly as UTF-8, each bounded; counts lines in ``state``."""
    limit = src.limits.max_line_bytes
    first = True
    while True:
        raw = src.fh.readline(limit + 1)
        if not raw:
            return
        state["line"] += 1
        if len(raw) > limit:
            raise _FileError(f"line {state['line']} is longer than {limit} bytes", state["line"])
        src.count(len(raw))
        progress.add(len(raw))
        if first:
            first = False
            if raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _FileError(f"line {state['line']} is not valid UTF-8", state["line"]) from exc


def _csv_records(src: _Source, delimiter: str, progress: _Progress,
                 blank: list[int] | None = None) -> Iterator[tuple[int, list[str]]]:
    """(start line, cells) for each non-blank record."""
    state = {"line": 0}
    reader = csv.reader(_csv_lines(src, progress, state), delimiter=delimiter, quotechar='"',
                        doublequote=True, strict=True)
    consumed = 0
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise _FileError(f"malformed CSV at line {state['line']} ({exc})", state["line"]) from exc
        start = consumed + 1
        consumed = reader.line_num
        if not cells or all(not c.strip() for c in cells):
            if blank is not None:
                blank[0] += 1
            continue
        yield start, cells


class _JsonElements:
    """Iterate the elements of a JSON array (or the one root object) without loading the file."""

    CHUNK = 256 * 1024

    def __init__(self, src: _Source, progress: _Progress) -> None:
        self.src = src
        self.progress = progress
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.buf = ""
        self.pos = 0
        self.dropped = 0
        self.eof = False
        self.flags: dict[str, bool] = {}
        self.json = json.JSONDecoder(object_pairs_hook=self._pairs, parse_constant=self._constant)
        self.first_chunk = True

    def _pairs(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            self.flags["duplicate"] = True
        return out

    def _constant(self, name: str) -> Any:
        self.flags["constant"] = True
        return None

    def _offset(self) -> int:
        return self.dropped + self.pos

    def _fill(self) -> bool:
        if self.eof:
            return False
        raw = self.src.fh.read(self.CHUNK)
        if self.pos > self.CHUNK:
            self.dropped += self.pos
            self.buf = self.buf[self.pos:]
            self.pos = 0
        if not raw:
            self.eof = True
            try:
                self.buf += self.decoder.decode(b"", final=True)
            except UnicodeDecodeError as exc:
                raise _FileError("the file is not valid UTF-8 (at its end)") from exc
            return False
        self.src.count(len(raw))
        self.progress.add(len(raw))
        if self.first_chunk:
            self.first_chunk = False
            if raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
        try:
            self.buf += self.decoder.decode(raw)
        except UnicodeDecodeError as exc:
            raise _FileError(f"the file is not valid UTF-8 (near byte {self.src.read_bytes})") from exc
        return True

    def _skip_ws(self) -> str:
        """The next non-white-space character ('' at end of file), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                return ""

    def _value(self, index: int) -> Any:
        limit = self.src.limits.max_line_bytes
        while True:
            try:
                value, end = self.json.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                if len(self.buf) - self.pos > limit:
                    raise _FileError(f"item [{index}] is larger than {limit} bytes", index) from exc
                if self._fill():
                    continue
                raise _FileError(f"invalid JSON in item [{index}] (character {self.dropped + exc.pos})",
                                 index) from exc
            except RecursionError as exc:
                raise _FileError(f"item [{index}] is nested too deeply", index) from exc
            if end == len(self.buf) and self._fill():
                continue  # a number or literal may go on in the next chunk: decode again
            if end - self.pos > limit:
                raise _FileError(f"item [{index}] is larger than {limit} bytes", index)
            self.pos = end
            return value

    def __iter__(self) -> Iterator[tuple[int, Any, dict[str, bool]]]:
        ch = self._skip_ws()
        if ch == "{":
            self.flags = {}
            obj = self._value(0)
            yield 0, obj, self.flags
            if self._skip_ws() != "":
                raise _FileError(f"unexpected data after the root object (character {self._offset()})")
            return
        if ch != "[":
            raise _FileError("the JSON root must be an object or an array of objects")
        self.pos += 1
        index = 0
        if self._skip_ws() == "]":
            self.pos += 1
        else:
            while True:
                self.flags = {}
                yield index, self._value(index), self.flags
                index += 1
                ch = self._skip_ws()
                self.pos += 1
                if ch == "]":
                    break
                if ch != ",":
                    where = self._offset() - 1
                    raise _FileError(f"invalid JSON after item [{index - 1}] (character {where})", index - 1)
                self._skip_ws()
        if self._skip_ws() != "":
            raise _FileError(f"unexpected data after the array (character {self._offset()})")


# ============================================================================ the import

class _KeyIndex:
    """The keys seen so far in the file, each with the row that first gave it, for the duplicate-key
    check. Kept in a private temporary SQLite database (``sqlite3.connect("")``: an unnamed file in
    the temporary directory, unlinked by SQLite when opened and gone on close; page cache bounded,
    no journal, no fsync), so memory does not grow with the number of rows. Not even the keys go
    there: only an HMAC-SHA-256 of each key under a random per-import secret that never leaves
    memory, so pages that reach the temporary file reveal nothing about the user's keys."""

    CACHE_KIB = 2048

    def __init__(self) -> None:
        try:
            self.conn = sqlite3.connect("", isolation_level=None)
            self.conn.execute("PRAGMA journal_mode = OFF")
            self.conn.execute("PRAGMA synchronous = OFF")
            self.conn.execute(f"PRAGMA cache_size = -{self.CACHE_KIB}")
            self.conn.execute("CREATE TABLE seen (key BLOB NOT NULL PRIMARY KEY, row INTEGER NOT NULL) "
                              "WITHOUT ROWID")
            self._secret = secrets.token_bytes(32)
            self.conn.execute("BEGIN")  # one transaction for the whole file
        except sqlite3.Error as exc:
            raise self._failed(exc) from exc

    @staticmethod
    def _failed(exc: sqlite3.Error) -> UompError:
        name = str(getattr(exc, "sqlite_errorname", "") or type(exc).__name__)
        return UompError(ErrorCode.INTERNAL, "the import's temporary key index failed (is the temporary "
                         "directory full or not writable?)", details={"reason": name})

    def claim(self, key: str, row: int) -> int | None:
        """Record that ``row`` gives ``key``; None if no earlier row did, else that row."""
        digest = hmac.new(self._secret, key.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
        try:
            cur = self.conn.execute("INSERT INTO seen (key, row) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                                    (digest, row))
            if cur.rowcount == 1:
                return None
            found = self.conn.execute("SELECT row FROM seen WHERE key = ?", (digest,)).fetchone()
        except sqlite3.Error as exc:
            raise self._failed(exc) from exc
        return int(found[0])

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.conn.close()


class _Rec:
    __slots__ = ("created_at", "created_given", "description", "key", "mark", "row", "sensitivity",
                 "source", "tags", "updated_at", "value")

    def __init__(self, row: int, mark: int = 0) -> None:
        self.row = row
        self.mark = mark  # the error count when the row was started: more at the end = a bad row
        self.key = ""
        self.value: Any = None
        self.tags: list[str] = []
        self.sensitivity = ""
        self.source = "user"
        self.description: str | None = None
        self.created_at: str | None = None
        self.updated_at: str | None = None
        self.created_given = False


@dataclass
class _Column:
    name: str
    dest: Dest
    label: str
    numbers: bool = True
    dates: bool = True
    text_reason: str | None = None
    date_order: str | None = None
    evidence: dict[str, int] = field(default_factory=dict)  # "dmy"/"mdy" -> first row seen


class _Importer:
    def __init__(self, *, mappings: dict[str, str] | None, extra_tags: Sequence[str],
                 sensitivity: str | None, replace: bool, date_order: str | None,
                 keep_text: Sequence[str], limits: ImportLimits, json_rows: bool, keys: _KeyIndex,
                 open_writer: Callable[[], BulkWriter]) -> None:
        self.mappings: dict[str, Dest] = {}
        for src, dst in (mappings or {}).items():
            if not isinstance(src, str) or not src.strip():
                raise UompError(ErrorCode.INVALID_REQUEST, "--map source must not be empty")
            self.mappings[src.strip()] = _parse_mapping_dst(dst)
        self.extra_tags: list[str] = []
        for tag in extra_tags:
            tag = tag.strip() if isinstance(tag, str) else tag
            problem = tags_problem([tag])
            if problem:
                raise UompError(ErrorCode.INVALID_REQUEST, f"--tag: {problem}")
            if tag not in self.extra_tags:
                self.extra_tags.append(tag)
        if sensitivity is not None and sensitivity not in SENSITIVITIES:
            raise UompError(ErrorCode.INVALID_REQUEST, "--sensitivity must be low, medium or high")
        if date_order is not None and date_order not in DATE_ORDERS:
            raise UompError(ErrorCode.INVALID_REQUEST, "--date-order must be dmy or mdy")
        self.default_sensitivity = sensitivity
        self.replace = replace
        self.date_order = date_order
        self.keep_text = {k.strip() for k in keep_text}
        self.limits = limits
        self.notices = _Notices()
        self.errors = _Errors(limits.max_reported_errors, json_rows)
        self.now = utc_now()
        self.keys = keys
        self.open_writer = open_writer
        self.writer: BulkWriter | None = None  # opened when the first chunk of rows is ready
        self.pending: list[_Rec] = []  # valid rows not yet checked against the store and written
        self.late_notices = _Notices()  # defaults decided when writing: announced after the others
        self.rows = 0
        self.valid = 0
        self.replaced = 0
        self.mapped_seen: set[str] = set()

    # ------------------------------------------------------------------ naming

    def resolve(self, name: str) -> tuple[Dest, bool]:
        """Where a header / field name goes, and whether that was said explicitly (map or value.*)."""
        raw = name.strip()
        if raw in self.mappings:
            return self.mappings[raw], True
        low = raw.lower()
        if low in ALIASES:
            return ALIASES[low], True
        path = _parse_value_path(raw)
        if path is not None:
            return path, True
        return (raw,), False

    # ------------------------------------------------------------------ shared field handling

    def set_key(self, rec: _Rec, raw: Any, from_json: bool) -> None:
        if from_json and isinstance(raw, int) and not isinstance(raw, bool):
            raw = str(raw)
            self.notices.add("key", "numeric_key")
        if not isinstance(raw, str):
            self.errors.add(rec.row, "key", "key must be a string")
            return
        key = raw.strip()
        if key != raw and key:
            self.notices.add("key", "trimmed")
        problem = key_problem(key)
        if problem:
            self.errors.add(rec.row, "key", problem)
            return
        first = self.keys.claim(key, rec.row)
        if first is not None:
            where = self.errors.where(first)
            self.errors.add(rec.row, "key", f"key repeats the key of {where}")
            return
        rec.key = key

    def set_tags(self, rec: _Rec, raw: Any) -> None:
        pieces: list[Any]
        if raw is None:
            pieces = []
        elif isinstance(raw, str):
            pieces = _TAG_SPLIT.split(raw)
        elif isinstance(raw, list):
            pieces = raw
        else:
            self.errors.add(rec.row, "tags", "tags must be a string or a list of strings")
            return
        tags: list[str] = []
        for piece in [*pieces, *self.extra_tags]:
            if not isinstance(piece, str):
                self.errors.add(rec.row, "tags", "tags must be a string or a list of strings")
                return
            tag = piece.strip()
            if tag and tag not in tags:
                tags.append(tag)
        if not tags:
            self.errors.add(rec.row, "tags", "tags are empty (give a tags column or --tag)")
            return
        if len(tags) > MAX_TAGS:
            self.errors.add(rec.row, "tags", f"more than {MAX_TAGS} tags")
            return
        problem = tags_problem(tags)
        if problem:
            self.errors.add(rec.row, "tags", problem)
            return
        rec.tags = tags

    def set_sensitivity(self, rec: _Rec, raw: Any) -> None:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            if self.default_sensitivity is None:
                self.errors.add(rec.row, "sensitivity", "sensitivity is missing (give --sensitivity)")
                return
            rec.sensitivity = self.default_sensitivity
            self.notices.add("sensitivity", "default_sensitivity", self.default_sensitivity)
            return
        if not isinstance(raw, str):
            self.errors.add(rec.row, "sensitivity", "sensitivity must be low, medium or high")
            return
        value = raw.strip().lower()
        if value not in SENSITIVITIES:
            self.errors.add(rec.row, "sensitivity", "sensitivity must be low, medium or high")
            return
        if value != raw.strip():
            self.notices.add("sensitivity", "lowercased")
        rec.sensitivity = value

    def set_source(self, rec: _Rec, raw: Any) -> None:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            self.notices.add("source", "default_source")
            return
        if not isinstance(raw, str):
            self.errors.add(rec.row, "source", "source must be user or agent")
            return
        value = raw.strip().lower()
        problem = source_problem(value)
        if problem:
            self.errors.add(rec.row, "source", problem)
            return
        if value != raw.strip():
            self.notices.add("source", "lowercased")
        rec.source = value

    def set_description(self, rec: _Rec, raw: Any) -> None:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return
        problem = description_problem(raw)
        if problem:
            self.errors.add(rec.row, "description", problem)
            return
        rec.description = raw

    def set_timestamp(self, rec: _Rec, fld: str, raw: Any, column: _Column | None) -> None:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return
        if not isinstance(raw, str):
            self.errors.add(rec.row, fld, f"{fld} must be an ISO 8601 timestamp")
            return
        text = raw.strip()
        order = self.date_order or (column.date_order if column else None)
        dt: datetime | date | None = None
        if _ISO_PREFIX.match(text):
            try:
                dt = datetime.fromisoformat(text)
            except ValueError:
                dt = None
            if dt is not None and len(text) == 10:
                dt = dt.date()
        else:
            found = _definite_date(text)
            if found is False:
                dt = None
            elif found is not None:
                assert not isinstance(found, bool)
                dt = found
            else:
                parts = _numeric_date(text)
                if parts is not None:
                    a, b = parts[0], parts[1]
                    if order is None and _ambiguous(a, b):
                        self.errors.add(rec.row, fld, f"{fld} is an ambiguous date (day and month could be "
                                        "swapped); use YYYY-MM-DD or pass --date-order")
                        return
                    dt = _resolve_numeric(parts, order or _evidence(a, b) or "dmy")
        if dt is None:
            self.errors.add(rec.row, fld, f"{fld} is not a valid ISO 8601 timestamp or a recognised date")
            return
        if not isinstance(dt, datetime):
            dt = datetime(dt.year, dt.month, dt.day)
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
            self.notices.add(fld, "ts_assumed_utc")
        out = _utc_text(dt)
        if out != raw:
            self.notices.add(fld, "ts_converted")
        if fld == "created_at":
            rec.created_at = out
            rec.created_given = True
        else:
            rec.updated_at = out

    def check_value_size(self, rec: _Rec, rough_chars: int | None) -> None:
        limit = self.limits.max_value_bytes
        if rough_chars is not None and rough_chars * 6 + 64 < limit:
            return  # cannot exceed the limit even if every character were escaped
        try:
            size = len(json.dumps(rec.value, ensure_ascii=False, allow_nan=False).encode("utf-8"))
        except (TypeError, ValueError, RecursionError):
            self.errors.add(rec.row, "value", "value is not a JSON value")
            return
        if size > limit:
            self.errors.add(rec.row, "value", f"value is larger than {limit} bytes")

    def new_rec(self, row: int) -> _Rec:
        return _Rec(row, self.errors.total)

    def add_record(self, rec: _Rec) -> None:
        """The row has been read: queue it for writing if it had no error."""
        if self.rows >= self.limits.max_rows:
            raise _FileError(f"the file has more than {self.limits.max_rows} rows")
        self.rows += 1
        if self.errors.total == rec.mark:
            self.pending.append(rec)
            if len(self.pending) >= BULK_CHUNK:
                self.flush_pending()

    def flush_pending(self) -> None:
        """Check the queued rows' keys against the store (inside the import transaction), then hand
        them to the bulk writer, unless some row was bad: then only check, write nothing more."""
        if not self.pending:
            return
        if self.writer is None:
            self.writer = self.open_writer()
        pending, self.pending = self.pending, []
        existing = self.writer.existing(r.key for r in pending)
        for r in pending:
            old_created = existing.get(r.key)
            if old_created is not None:
                if not self.replace:
                    self.errors.add(r.row, "key", "an item with this key is already in the store "
                                    "(--replace overwrites it)")
                    continue
                self.replaced += 1
            self.valid += 1
            if self.errors.total:
                continue  # the import will be refused: keep checking, stop writing
            self.writer.add(self.item_of(r, old_created))

    def item_of(self, r: _Rec, old_created: str | None) -> MemoryItem:
        """The Memory Item for a valid row, with its timestamps defaulted (and announced)."""
        updated = r.updated_at
        if updated is None:
            updated = self.now
            self.late_notices.add("updated_at", "ts_default_now")
        created = r.created_at
        if created is None:
            if old_created is not None:
                created = old_created
                self.late_notices.add("created_at", "ts_kept_existing")
            elif r.updated_at is not None:
                created = r.updated_at
                self.late_notices.add("created_at", "ts_default_updated")
            else:
                created = self.now
                self.late_notices.add("created_at", "ts_default_now")
        return MemoryItem(key=r.key, value=r.value, tags=tuple(r.tags), sensitivity=r.sensitivity,
                          source=r.source, created_at=created, updated_at=updated, description=r.description)

    # ------------------------------------------------------------------ CSV

    def csv_header(self, cells: list[str], line: int) -> list[_Column]:
        columns: list[_Column] = []
        problems: list[_FileError] = []
        for i, name in enumerate(cells):
            if not name.strip():
                problems.append(_FileError(f"header column {i + 1} has no name", line))
                continue
            try:
                dest, _explicit = self.resolve(name)
            except _FileError as exc:
                problems.append(_FileError(f"header: {exc.message}", line, name.strip()))
                continue
            columns.append(_Column(name=name.strip(), dest=dest, label=_label(dest)))
        for src in self.mappings:
            if src not in {c.name for c in columns}:
                problems.append(_FileError(f"--map {src}: no column has this name", line, src))
        by_dest: dict[str, list[str]] = {}
        for c in columns:
            if isinstance(c.dest, str):
                by_dest.setdefault(c.dest, []).append(c.name)
        for dest, names in by_dest.items():
            if len(names) > 1:
                problems.append(_FileError(f"columns {', '.join(names)} all give {dest}; map all but one "
                                           "elsewhere with --map NAME=value.NAME", line, dest))
        paths = [(c.dest, c.name) for c in columns if isinstance(c.dest, tuple)]
        for a, b in _overlaps(paths):
            problems.append(_FileError(f"columns {a} and {b} give the same part of the value", line, b))
        if "key" not in by_dest:
            problems.append(_FileError("no key column (key, id, item_id or record_id; or --map NAME=key)",
                                       line, "key"))
        if "tags" not in by_dest and not self.extra_tags:
            problems.append(_FileError("no tags column and no --tag", line, "tags"))
        if "sensitivity" not in by_dest and self.default_sensitivity is None:
            problems.append(_FileError("no sensitivity column: pass --sensitivity low|medium|high "
                                       "(spec §12.8: sensitivity must be explicit)", line, "sensitivity"))
        if not paths:
            problems.append(_FileError("no value columns", line, "value"))
        if problems:
            raise _MultiFileError(problems)
        for c in columns:
            if isinstance(c.dest, tuple):
                last = c.dest[-1] if c.dest else c.name
                if c.name in self.keep_text or _label(c.dest) in self.keep_text:
                    c.numbers = c.dates = False
                    c.text_reason = "--keep-text"
                elif _identifier_like(last):
                    c.numbers = c.dates = False
                    c.text_reason = "the column name looks like an identifier"
        return columns

    def csv_profile(self, index: list[tuple[int, _Column]], cells: list[str], row: int) -> None:
        for i, col in index:
            if i >= len(cells):
                continue
            s = cells[i].strip()
            if not s:
                continue
            if isinstance(col.dest, tuple) and col.numbers:
                if s[0] in "-0$€£¥" and _LEADING_ZERO.fullmatch(s):
                    col.numbers = col.dates = False
                    col.text_reason = "some values have leading zeros, so the column holds identifiers"
                elif len(s) > MAX_NUMBER_DIGITS and _amount(s) == "long":
                    col.numbers = col.dates = False
                    col.text_reason = (f"some values are numbers of more than {MAX_NUMBER_DIGITS} digits, "
                                       "so the column holds identifiers")
            if self.date_order is None and s[0].isdigit() and len(s) >= 8:
                parts = _numeric_date(s)
                if parts is not None:
                    ev = _evidence(parts[0], parts[1])
                    if ev is not None and ev not in col.evidence:
                        col.evidence[ev] = row

    def csv_settle_dates(self, columns: list[_Column], line: int) -> None:
        problems: list[_FileError] = []
        for col in columns:
            if self.date_order is not None:
                col.date_order = self.date_order
            elif len(col.evidence) == 1:
                col.date_order = next(iter(col.evidence))
            elif len(col.evidence) == 2 and (col.dates or col.dest in TIMESTAMP_FIELDS):
                problems.append(_FileError(
                    f"column {col.name} has day-first dates (row {col.evidence['dmy']}) and month-first "
                    f"dates (row {col.evidence['mdy']}); pass --date-order dmy or mdy", line, col.label))
        if problems:
            raise _MultiFileError(problems)

    def clean_cell(self, col: _Column, cell: str) -> tuple[bool, Any]:
        """(keep?, value) for one CSV value cell; counts what was done."""
        s = cell.strip()
        label = col.label
        if not s:
            self.notices.add(label, "blank")
            return False, None
        if not col.numbers and not col.dates:
            if _amount(s) is not None or _LEADING_ZERO.fullmatch(s) or _looks_like_date(s):
                self.notices.add(label, "kept_text", col.text_reason)
            return True, cell
        if col.numbers:
            amount = _amount(s)
            if amount == "long":
                self.notices.add(label, "long_number")
                return True, cell
            if isinstance(amount, tuple):
                number, thousands, currency = amount
                if currency:
                    self.notices.add(label, "currency", currency)
                if thousands:
                    self.notices.add(label, "thousands")
                if not currency and not thousands:
                    self.notices.add(label, "number")
                return True, number
        if col.dates and len(s) >= 8:
            if _ISO_VALUE.fullmatch(s):
                return True, cell
            found = _definite_date(s)
            if found is False:
                self.notices.add(label, "not_a_date")
                return True, cell
            if found is not None:
                assert not isinstance(found, bool)
                self.notices.add(label, "date")
                return True, _iso_value(found)
            parts = _numeric_date(s)
            if parts is not None:
                a, b = parts[0], parts[1]
                order = col.date_order or _evidence(a, b)
                if order is None:
                    if _ambiguous(a, b):
                        self.notices.add(label, "ambiguous")
                        return True, cell
                    order = "dmy"  # a == b: both readings agree
                d = _resolve_numeric(parts, order)
                if d is None:
                    self.notices.add(label, "not_a_date")
                    return True, cell
                self.notices.add(label, "date" if a == b else f"date_{order}")
                return True, _iso_value(d)
        return True, cell

    def csv_row(self, columns: list[_Column], cells: list[str], row: int) -> None:
        rec = self.new_rec(row)
        if len(cells) != len(columns):
            self.errors.add(row, "row", f"the row has {len(cells)} fields, the header has {len(columns)}")
            return
        reserved: dict[str, str] = {}
        value: Any = {}
        whole = False
        for col, cell in zip(columns, cells, strict=True):
            if isinstance(col.dest, str):
                reserved[col.dest] = cell
                if col.dest in TIMESTAMP_FIELDS:
                    self.set_timestamp(rec, col.dest, cell, col)
                continue
            keep, cleaned = self.clean_cell(col, cell)
            if not keep:
                continue
            if col.dest == ():
                value = cleaned
                whole = True
            else:
                _set_path(value, col.dest, cleaned)
        self.set_key(rec, reserved.get("key"), from_json=False)
        self.set_tags(rec, reserved.get("tags"))
        self.set_sensitivity(rec, reserved.get("sensitivity"))
        self.set_source(rec, reserved.get("source"))
        self.set_description(rec, reserved.get("description"))
        if not whole and value == {}:
            self.errors.add(row, "value", "the value is empty (every value cell is blank)")
        rec.value = value
        self.check_value_size(rec, sum(len(c) for c in cells))
        self.add_record(rec)

    def read_csv(self, src: _Source, delimiter: str, progress: _Progress) -> None:
        # Pass 1: header and per-column profile (leading zeros, day/month evidence).
        records = _csv_records(src, delimiter, progress)
        first = next(records, None)
        if first is None:
            raise _FileError("the file is empty (no header row)")
        header_line, header = first
        columns = self.csv_header(header, header_line)
        profiled = [(i, c) for i, c in enumerate(columns)
                    if isinstance(c.dest, tuple) or c.dest in TIMESTAMP_FIELDS]
        for row, cells in records:
            self.csv_profile(profiled, cells, row)
        self.csv_settle_dates(columns, header_line)
        # Pass 2: build the records and stream the valid ones into the import transaction.
        src.rewind()
        blank = [0]
        records = _csv_records(src, delimiter, progress, blank)
        next(records, None)  # the header again
        for row, cells in records:
            self.csv_row(columns, cells, row)
        if blank[0]:
            self.notices.plain.append(f"skipped {blank[0]} blank line{'' if blank[0] == 1 else 's'}")

    # ------------------------------------------------------------------ JSON

    def json_item(self, obj: Any, index: int, flags: dict[str, bool]) -> None:
        rec = self.new_rec(index)
        if not isinstance(obj, dict):
            self.errors.add(index, "item", "the item is not a JSON object")
            return
        if flags.get("duplicate"):
            self.errors.add(index, "item", "an object in the item has the same field twice")
        if flags.get("constant"):
            self.errors.add(index, "value", "the item contains NaN or Infinity, which JSON does not allow")
        reserved: dict[str, Any] = {}
        reserved_names: dict[str, str] = {}
        whole: Any = None
        has_whole = False
        explicit: list[tuple[tuple[str, ...], str, Any]] = []
        implicit: list[tuple[tuple[str, ...], str, Any]] = []
        for name, v in obj.items():
            try:
                dest, is_explicit = self.resolve(name)
            except _FileError as exc:
                self.errors.add(index, name, exc.message)
                continue
            if name.strip() in self.mappings:
                self.mapped_seen.add(name.strip())
            if isinstance(dest, str):
                if dest in reserved_names:
                    self.errors.add(index, dest, f"fields {reserved_names[dest]} and {name} both give {dest}")
                    continue
                reserved_names[dest] = name
                reserved[dest] = v
            elif dest == ():
                if has_whole:
                    self.errors.add(index, "value", "two fields give the value")
                    continue
                whole, has_whole = v, True
            else:
                (explicit if is_explicit else implicit).append((dest, name, v))
        self.set_key(rec, reserved.get("key"), from_json=True)
        self.set_tags(rec, reserved.get("tags"))
        self.set_sensitivity(rec, reserved.get("sensitivity"))
        self.set_source(rec, reserved.get("source"))
        self.set_description(rec, reserved.get("description"))
        for fld in TIMESTAMP_FIELDS:
            self.set_timestamp(rec, fld, reserved.get(fld), None)
        if has_whole and implicit:
            names = ", ".join(n for _, n, _ in implicit)
            self.errors.add(index, "value", f"fields outside value ({names}) have no place: move them into "
                            "value or map them with --map NAME=value.NAME")
        paths = [(p, n) for p, n, _ in explicit + implicit]
        for a, b in _overlaps(paths):
            self.errors.add(index, "value", f"fields {a} and {b} give the same part of the value")
        value: Any
        if has_whole:
            value = whole
            if explicit:
                if not isinstance(value, dict):
                    self.errors.add(index, "value", "value is not an object, so mapped fields cannot be "
                                    "added to it")
                else:
                    for path, name, v in explicit:
                        if _path_taken(value, path):
                            self.errors.add(index, "value", f"field {name} would overwrite part of value")
                        else:
                            _set_path(value, path, v)
        else:
            value = {}
            for path, _name, v in explicit + implicit:
                _set_path(value, path, v)
            if not value:
                self.errors.add(index, "value", "the item has no value")
        rec.value = value
        self.check_value_size(rec, None)
        self.add_record(rec)

    def read_json(self, src: _Source, progress: _Progress) -> None:
        for index, obj, flags in _JsonElements(src, progress):
            self.json_item(obj, index, flags)
        for src_name in self.mappings:
            if src_name not in self.mapped_seen:
                self.notices.plain.append(f"--map {src_name}: no item has this field")

    # ------------------------------------------------------------------ finishing

    def finish(self, dry_run: bool) -> int:
        """After the last row: check the last chunk, refuse the import if any row was bad (the
        transaction is then rolled back by the caller), else commit. Returns how many were written."""
        self.flush_pending()
        self.errors.raise_if_any()
        self.notices.merge(self.late_notices)
        if dry_run or self.writer is None:
            return 0
        return self.writer.commit()


class _MultiFileError(Exception):
    def __init__(self, problems: list[_FileError]) -> None:
        super().__init__(problems[0].message)
        self.problems = problems


def _looks_like_date(s: str) -> bool:
    return bool(_definite_date(s) or _numeric_date(s) or _ISO_VALUE.fullmatch(s))


def _path_taken(value: dict[str, Any], path: tuple[str, ...]) -> bool:
    obj: Any = value
    for part in path:
        if not isinstance(obj, dict):
            return True
        if part not in obj:
            return False
        obj = obj[part]
    return True


def _pick_format(path: Path, fmt: str | None) -> str:
    if fmt is not None:
        f = fmt.lower()
        if f not in FORMATS:
            raise UompError(ErrorCode.INVALID_REQUEST, "--format must be csv or json")
        return f
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv", ".txt"):
        return "csv"
    if suffix == ".json":
        return "json"
    raise UompError(ErrorCode.INVALID_REQUEST, f"cannot tell the format of {path.name}; pass --format csv or json")


def _pick_delimiter(path: Path, delimiter: str | None) -> str:
    if delimiter is None:
        return "\t" if path.suffix.lower() == ".tsv" else ","
    names = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";", "pipe": "|"}
    d = names.get(delimiter.lower(), delimiter)
    if len(d) != 1 or d in "\"\r\n" or d.isalnum():
        raise UompError(ErrorCode.INVALID_REQUEST, "--delimiter must be one character (not a letter, digit, quote or "
                        "new line), or tab")
    return d


def import_file(
    store: MemoryStore,
    path: Path,
    *,
    fmt: str | None = None,
    delimiter: str | None = None,
    mappings: dict[str, str] | None = None,
    extra_tags: Sequence[str] = (),
    sensitivity: str | None = None,
    replace: bool = False,
    dry_run: bool = False,
    progress: bool = False,
    date_order: str | None = None,
    keep_text: Sequence[str] = (),
    limits: ImportLimits | None = None,
    progress_stream: IO[str] | None = None,
) -> ImportReport:
    """Validate the whole file while streaming its rows into one transaction, committed only if every
    row is valid (see the module docstring).

    Raises ``UompError(ErrorCode.IMPORT_INVALID)`` listing every bad row (nothing written),
    ``INVALID_REQUEST`` for bad options or an unreadable file, ``STORE_UNAVAILABLE`` from the store.
    """
    path = Path(path)
    limits = limits or ImportLimits()
    kind = _pick_format(path, fmt)
    if kind == "json" and delimiter is not None:
        raise UompError(ErrorCode.INVALID_REQUEST, "--delimiter applies to CSV files only")
    delim = _pick_delimiter(path, delimiter) if kind == "csv" else ","
    with contextlib.ExitStack() as stack:  # closed in reverse: the transaction is rolled back first
        def open_writer() -> BulkWriter:
            return stack.enter_context(store.bulk_writer(replace=replace, dry_run=dry_run))

        keys = _KeyIndex()
        stack.callback(keys.close)
        imp = _Importer(mappings=mappings, extra_tags=extra_tags, sensitivity=sensitivity,
                        replace=replace, date_order=date_order, keep_text=keep_text, limits=limits,
                        json_rows=kind == "json", keys=keys, open_writer=open_writer)
        src = _Source(path, limits)
        stack.callback(src.close)
        old_limit = csv.field_size_limit()
        csv.field_size_limit(max(old_limit, limits.max_value_bytes))
        stack.callback(csv.field_size_limit, old_limit)
        bar = _Progress(src.size * (2 if kind == "csv" else 1), progress, progress_stream)
        try:
            try:
                if kind == "csv":
                    imp.read_csv(src, delim, bar)
                else:
                    imp.read_json(src, bar)
            finally:
                bar.finish()
        except (_FileError, _MultiFileError) as exc:
            problems = exc.problems if isinstance(exc, _MultiFileError) else [exc]
            err = _Errors(1, kind == "json").error(problems)
            assert err is not None
            raise err from None
        if imp.extra_tags:
            imp.notices.plain.append(f"tags: added {', '.join(imp.extra_tags)} (--tag) to every row")
        written = imp.finish(dry_run)
    return ImportReport(rows_written=written, notices=imp.notices.render(), rows_valid=imp.valid,
                        replaced=imp.replaced, dry_run=dry_run, format=kind)
