"""Where each column or field of an import goes, and the rules for the reserved fields.

Destinations (``--map SRC=DST``, aliases, ``value.a.b`` paths) and the checks and defaults of
key, tags, sensitivity, source, description and the timestamps, shared by the CSV and the JSON
paths. A row being built is a :class:`Rec`; problems go to :class:`~.report.Errors`, cleaning to
:class:`~.report.Notices`. No I/O: the duplicate-key index is handed in as ``claim``.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import ErrorCode, UompError
from gateway.guard.importer.cleaning import DATE_ORDERS, parse_timestamp, utc_text
from gateway.guard.importer.report import Errors, FileError, ImportLimits, Notices
from gateway.guard.items import MAX_TAGS, SENSITIVITIES, description_problem, key_problem, source_problem, tags_problem

RESERVED = ("key", "tags", "sensitivity", "source", "description", "created_at", "updated_at")
ALIASES: dict[str, str] = {
    "key": "key",
    "id": "key",
    "item_id": "key",
    "record_id": "key",
    "tags": "tags",
    "tag": "tags",
    "sensitivity": "sensitivity",
    "level": "sensitivity",
    "source": "source",
    "origin": "source",
    "description": "description",
    "desc": "description",
    "created_at": "created_at",
    "created": "created_at",
    "updated_at": "updated_at",
    "updated": "updated_at",
}
TIMESTAMP_FIELDS = ("created_at", "updated_at")

_TAG_SPLIT = re.compile(r"[,;|]")

# claim(key, row): None if no earlier row of the file gave ``key``, else that row.
KeyClaim = Callable[[str, int], "int | None"]


# A destination: a reserved field name (str) or a path inside the value (tuple; () = whole value).
Dest = str | tuple[str, ...]


def parse_value_path(text: str) -> tuple[str, ...] | None:
    """``value`` -> (), ``value.a.b`` -> ("a", "b"); None when not a value path."""
    if text.lower() == "value":
        return ()
    if text[:6].lower() != "value.":
        return None
    parts = tuple(text[6:].split("."))
    if any(not p for p in parts):
        raise FileError(f"{text}: a value path has an empty part")
    return parts


def parse_mapping_dst(dst: str) -> Dest:
    d = dst.strip()
    if d in RESERVED:
        return d
    try:
        path = parse_value_path(d)
    except FileError:
        path = None
    if path is None:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"--map destination {d!r} must be one of {', '.join(RESERVED)}, value or value.<field>[.<field>...]",
        )
    return path


def dest_label(dest: Dest) -> str:
    if isinstance(dest, str):
        return dest
    return "value" + "".join("." + p for p in dest)


def overlaps(paths: Sequence[tuple[tuple[str, ...], str]]) -> list[tuple[str, str]]:
    """Pairs of names whose value paths collide (equal, or one nested under the other)."""
    out: list[tuple[str, str]] = []
    ordered = sorted(paths)
    for (p, a), (q, b) in itertools.pairwise(ordered):
        if q[: len(p)] == p:
            out.append((a, b))
    return out


def set_path(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        nxt = obj.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            obj[part] = nxt
        obj = nxt
    obj[path[-1]] = value


def path_taken(value: dict[str, Any], path: tuple[str, ...]) -> bool:
    obj: Any = value
    for part in path:
        if not isinstance(obj, dict):
            return True
        if part not in obj:
            return False
        obj = obj[part]
    return True


class Rec:
    __slots__ = (
        "created_at",
        "description",
        "key",
        "mark",
        "row",
        "sensitivity",
        "source",
        "tags",
        "updated_at",
        "value",
    )

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


@dataclass
class Column:
    name: str
    dest: Dest
    label: str
    numbers: bool = True
    dates: bool = True
    text_reason: str | None = None
    date_order: str | None = None
    evidence: dict[str, int] = field(default_factory=dict)  # "dmy"/"mdy" -> first row seen


class FieldRules:
    """The import's options, checked once, and the reserved-field rules applied to each row."""

    def __init__(
        self,
        *,
        mappings: dict[str, str] | None,
        extra_tags: Sequence[str],
        sensitivity: str | None,
        date_order: str | None,
        keep_text: Sequence[str],
        limits: ImportLimits,
        json_rows: bool,
        claim: KeyClaim,
    ) -> None:
        self.mappings: dict[str, Dest] = {}
        for src, dst in (mappings or {}).items():
            if not isinstance(src, str) or not src.strip():
                raise UompError(ErrorCode.INVALID_REQUEST, "--map source must not be empty")
            self.mappings[src.strip()] = parse_mapping_dst(dst)
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
        self.date_order = date_order
        self.keep_text = {k.strip() for k in keep_text}
        self.limits = limits
        self.notices = Notices()
        self.errors = Errors(limits.max_reported_errors, json_rows)
        self.claim = claim
        self.mapped_seen: set[str] = set()  # --map sources some JSON item had

    # ------------------------------------------------------------------ naming

    def resolve(self, name: str) -> tuple[Dest, bool]:
        """Where a header / field name goes, and whether that was said explicitly (map or value.*)."""
        raw = name.strip()
        if raw in self.mappings:
            return self.mappings[raw], True
        low = raw.lower()
        if low in ALIASES:
            return ALIASES[low], True
        path = parse_value_path(raw)
        if path is not None:
            return path, True
        return (raw,), False

    # ------------------------------------------------------------------ shared field handling

    def set_key(self, rec: Rec, raw: Any, from_json: bool) -> None:
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
        first = self.claim(key, rec.row)
        if first is not None:
            where = self.errors.where(first)
            self.errors.add(rec.row, "key", f"key repeats the key of {where}")
            return
        rec.key = key

    def set_tags(self, rec: Rec, raw: Any) -> None:
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

    def set_sensitivity(self, rec: Rec, raw: Any) -> None:
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

    def set_source(self, rec: Rec, raw: Any) -> None:
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

    def set_description(self, rec: Rec, raw: Any) -> None:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return
        problem = description_problem(raw)
        if problem:
            self.errors.add(rec.row, "description", problem)
            return
        rec.description = raw

    def set_timestamp(self, rec: Rec, fld: str, raw: Any, column: Column | None) -> None:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return
        if not isinstance(raw, str):
            self.errors.add(rec.row, fld, f"{fld} must be an ISO 8601 timestamp")
            return
        order = self.date_order or (column.date_order if column else None)
        parsed = parse_timestamp(raw.strip(), order)
        if parsed == "ambiguous":
            self.errors.add(
                rec.row,
                fld,
                f"{fld} is an ambiguous date (day and month could be swapped); use YYYY-MM-DD or pass --date-order",
            )
            return
        if isinstance(parsed, str):
            self.errors.add(rec.row, fld, f"{fld} is not a valid ISO 8601 timestamp or a recognised date")
            return
        dt, zone_assumed = parsed
        if zone_assumed:
            self.notices.add(fld, "ts_assumed_utc")
        out = utc_text(dt)
        if out != raw:
            self.notices.add(fld, "ts_converted")
        if fld == "created_at":
            rec.created_at = out
        else:
            rec.updated_at = out

    def check_value_size(self, rec: Rec, rough_chars: int | None) -> None:
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

    def new_rec(self, row: int) -> Rec:
        return Rec(row, self.errors.total)
