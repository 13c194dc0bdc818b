"""Rows of a CSV file or elements of a JSON file turned into records (:class:`~.mapping.Rec`).

CSV: the header names the columns, a first pass profiles them (identifier-like values, day/month
evidence), then each row's value cells are cleaned (:mod:`.cleaning`) and its reserved fields
checked (:class:`~.mapping.FieldRules`). JSON: each element's fields are placed as they are
(JSON values are typed already and never cleaned). No I/O: the driver feeds the rows in and
writes the records out.
"""

from __future__ import annotations

from typing import Any

from gateway.guard.importer.cleaning import clean_text, evidence, identifier_like, identifier_values, numeric_date
from gateway.guard.importer.mapping import (
    TIMESTAMP_FIELDS,
    Column,
    FieldRules,
    Rec,
    dest_label,
    overlaps,
    path_taken,
    set_path,
)
from gateway.guard.importer.report import FileError, MultiFileError


class RecordBuilder(FieldRules):
    """Builds one record per CSV row or JSON element; None for a row too broken to be one."""

    def csv_header(self, cells: list[str], line: int) -> list[Column]:
        columns: list[Column] = []
        problems: list[FileError] = []
        for i, name in enumerate(cells):
            if not name.strip():
                problems.append(FileError(f"header column {i + 1} has no name", line))
                continue
            try:
                dest, _explicit = self.resolve(name)
            except FileError as exc:
                problems.append(FileError(f"header: {exc.message}", line, name.strip()))
                continue
            columns.append(Column(name=name.strip(), dest=dest, label=dest_label(dest)))
        for src in self.mappings:
            if src not in {c.name for c in columns}:
                problems.append(FileError(f"--map {src}: no column has this name", line, src))
        if len(cells) == 1:
            other = next((d for d in (";", "\t", "|", ",") if d in cells[0]), None)
            if other is not None:
                shown = "tab" if other == "\t" else other
                problems.insert(
                    0,
                    FileError(
                        f"the header is one column ({cells[0][:60]!r}): the file looks "
                        f"delimited by {shown!r}; pass --delimiter '{shown}'",
                        line,
                    ),
                )
        by_dest: dict[str, list[str]] = {}
        for c in columns:
            if isinstance(c.dest, str):
                by_dest.setdefault(c.dest, []).append(c.name)
        for dest, names in by_dest.items():
            if len(names) > 1:
                problems.append(
                    FileError(
                        f"columns {', '.join(names)} all give {dest}; map all but one "
                        "elsewhere with --map NAME=value.NAME",
                        line,
                        dest,
                    )
                )
        paths = [(c.dest, c.name) for c in columns if isinstance(c.dest, tuple)]
        for a, b in overlaps(paths):
            problems.append(FileError(f"columns {a} and {b} give the same part of the value", line, b))
        if "key" not in by_dest:
            problems.append(FileError("no key column (key, id, item_id or record_id; or --map NAME=key)", line, "key"))
        if "tags" not in by_dest and not self.extra_tags:
            problems.append(FileError("no tags column and no --tag", line, "tags"))
        if "sensitivity" not in by_dest and self.default_sensitivity is None:
            problems.append(
                FileError(
                    "no sensitivity column: pass --sensitivity low|medium|high "
                    "(spec §12.8: sensitivity must be explicit)",
                    line,
                    "sensitivity",
                )
            )
        if not paths:
            problems.append(FileError("no value columns", line, "value"))
        if problems:
            raise MultiFileError(problems)
        for c in columns:
            if isinstance(c.dest, tuple):
                last = c.dest[-1] if c.dest else c.name
                if c.name in self.keep_text or dest_label(c.dest) in self.keep_text:
                    c.numbers = c.dates = False
                    c.text_reason = "--keep-text"
                elif identifier_like(last):
                    c.numbers = c.dates = False
                    c.text_reason = "the column name looks like an identifier"
        return columns

    def csv_profile(self, index: list[tuple[int, Column]], cells: list[str], row: int) -> None:
        for i, col in index:
            if i >= len(cells):
                continue
            s = cells[i].strip()
            if not s:
                continue
            if isinstance(col.dest, tuple) and col.numbers:
                reason = identifier_values(s)
                if reason is not None:
                    col.numbers = col.dates = False
                    col.text_reason = reason
            if self.date_order is None and s[0].isdigit() and len(s) >= 8:
                parts = numeric_date(s)
                if parts is not None:
                    ev = evidence(parts[0], parts[1])
                    if ev is not None and ev not in col.evidence:
                        col.evidence[ev] = row

    def csv_settle_dates(self, columns: list[Column], line: int) -> None:
        problems: list[FileError] = []
        for col in columns:
            if self.date_order is not None:
                col.date_order = self.date_order
            elif len(col.evidence) == 1:
                col.date_order = next(iter(col.evidence))
            elif len(col.evidence) == 2 and (col.dates or col.dest in TIMESTAMP_FIELDS):
                problems.append(
                    FileError(
                        f"column {col.name} has day-first dates (row {col.evidence['dmy']}) and month-first "
                        f"dates (row {col.evidence['mdy']}); pass --date-order dmy or mdy",
                        line,
                        col.label,
                    )
                )
        if problems:
            raise MultiFileError(problems)

    def clean_cell(self, col: Column, cell: str) -> tuple[bool, Any]:
        """(keep?, value) for one CSV value cell; counts what was done."""
        s = cell.strip()
        if not s:
            self.notices.add(col.label, "blank")
            return False, None
        value, changes = clean_text(
            s, cell, numbers=col.numbers, dates=col.dates, text_reason=col.text_reason, date_order=col.date_order
        )
        for kind, extra in changes:
            self.notices.add(col.label, kind, extra)
        return True, value

    def csv_row(self, columns: list[Column], cells: list[str], row: int) -> Rec | None:
        rec = self.new_rec(row)
        if len(cells) != len(columns):
            self.errors.add(row, "row", f"the row has {len(cells)} fields, the header has {len(columns)}")
            return None
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
                set_path(value, col.dest, cleaned)
        self.set_key(rec, reserved.get("key"), from_json=False)
        self.set_tags(rec, reserved.get("tags"))
        self.set_sensitivity(rec, reserved.get("sensitivity"))
        self.set_source(rec, reserved.get("source"))
        self.set_description(rec, reserved.get("description"))
        if not whole and value == {}:
            self.errors.add(row, "value", "the value is empty (every value cell is blank)")
        rec.value = value
        self.check_value_size(rec, sum(len(c) for c in cells))
        return rec

    # ------------------------------------------------------------------ JSON

    def json_item(self, obj: Any, index: int, flags: dict[str, bool]) -> Rec | None:
        rec = self.new_rec(index)
        if not isinstance(obj, dict):
            self.errors.add(index, "item", "the item is not a JSON object")
            return None
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
            except FileError as exc:
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
        if "key" not in reserved:
            self.errors.add(index, "key", _no_key_hint(obj))
        else:
            self.set_key(rec, reserved.get("key"), from_json=True)
        self.set_tags(rec, reserved.get("tags"))
        self.set_sensitivity(rec, reserved.get("sensitivity"))
        self.set_source(rec, reserved.get("source"))
        self.set_description(rec, reserved.get("description"))
        for fld in TIMESTAMP_FIELDS:
            self.set_timestamp(rec, fld, reserved.get(fld), None)
        if has_whole and implicit:
            names = ", ".join(n for _, n, _ in implicit)
            self.errors.add(
                index,
                "value",
                f"fields outside value ({names}) have no place: move them into "
                "value or map them with --map NAME=value.NAME",
            )
        paths = [(p, n) for p, n, _ in explicit + implicit]
        for a, b in overlaps(paths):
            self.errors.add(index, "value", f"fields {a} and {b} give the same part of the value")
        value: Any
        if has_whole:
            value = whole
            if explicit:
                if not isinstance(value, dict):
                    self.errors.add(index, "value", "value is not an object, so mapped fields cannot be added to it")
                else:
                    for path, name, v in explicit:
                        if path_taken(value, path):
                            self.errors.add(index, "value", f"field {name} would overwrite part of value")
                        else:
                            set_path(value, path, v)
        else:
            value = {}
            for path, _name, v in explicit + implicit:
                set_path(value, path, v)
            if not value:
                self.errors.add(index, "value", "the item has no value")
        rec.value = value
        self.check_value_size(rec, None)
        return rec


def _no_key_hint(obj: dict[str, Any]) -> str:
    """An item without a key; when it is a wrapper around the list of items (``{"items": [...]}``),
    say so: the root must be the list itself."""
    lists = [name for name, v in obj.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
    if len(obj) == 1 and lists:
        return (
            f"the item has no key: the file is one object whose {lists[0]!r} holds a list of objects; the "
            f"root must be that list (e.g. jq '.{lists[0]}' FILE > items.json)"
        )
    return "the item has no key (a key field, or id, item_id, record_id; or --map NAME=key)"
