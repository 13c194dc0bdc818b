"""What an import reports, and its bounds: limits, the report, notices, and row / file errors.

No I/O. :class:`Notices` counts each kind of cleaning per field and renders one sentence per kind;
:class:`Errors` collects bad rows (bounded) into one ``UompError(ErrorCode.IMPORT_INVALID)``;
:class:`FileError` / :class:`MultiFileError` are raised when the file as a whole cannot be imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gateway.errors import ErrorCode, UompError
from gateway.guard.items import MAX_VALUE_BYTES


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


class FileError(Exception):
    """The file as a whole cannot be imported (header, encoding, syntax, size)."""

    def __init__(self, message: str, row: int | None = None, field_name: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.row = row
        self.field_name = field_name


class MultiFileError(Exception):
    def __init__(self, problems: list[FileError]) -> None:
        super().__init__(problems[0].message)
        self.problems = problems


class Notices:
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

    def merge(self, other: Notices) -> None:
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
                out.append(f"{label}: " + self._TEXT[kind].format(n=n, s="" if n == 1 else "s", rows=rows, extra=extra))
                if kind == "currency" and len(extras) > 1:
                    out.append(
                        f"{label}: WARNING: amounts in several currencies ({extra}) are now plain "
                        "numbers and no longer comparable"
                    )
        return out


class Errors:
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

    def error(self, file_errors: Sequence[FileError] = ()) -> UompError | None:
        if not self.items and not file_errors:
            return None
        errors: list[dict[str, Any]] = [
            {"row": fe.row, "field": fe.field_name, "message": fe.message} for fe in file_errors
        ]
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
