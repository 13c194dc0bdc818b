"""Memory Items (spec §11.1) and the rules every stored item obeys, without the database.

The limits, :class:`MemoryItem`, and one ``*_problem`` check per field (each None when the input
is fine, else a fixed sentence that names the field but never repeats the offending text, which
may be a misplaced secret). The storage seam (:mod:`gateway.guard.storage`), the importer
and the bulk writer use them too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from gateway import jsonio
from gateway.errors import ErrorCode, UompError

SENSITIVITIES = ("low", "medium", "high")
SOURCES = ("user", "agent")

MAX_KEY_CHARS = 256
MAX_TAG_CHARS = 128
MAX_TAGS = 64
MAX_DESCRIPTION_CHARS = 4096
MAX_TIMESTAMP_CHARS = 64
MAX_VALUE_BYTES = 1024 * 1024  # serialised JSON, UTF-8


def utc_now() -> str:
    """The current time as the store writes it: ``2026-07-12T10:00:00Z``."""
    return datetime.now(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class MemoryItem:
    """One Memory Item (spec §11.1). ``value`` is any JSON value."""

    key: str
    value: Any
    tags: tuple[str, ...]
    sensitivity: str
    source: str
    created_at: str
    updated_at: str
    description: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The spec §11.1 object: tags as a list, ``description`` left out when None."""
        out: dict[str, Any] = {
            "key": self.key,
            "value": self.value,
            "tags": list(self.tags),
            "sensitivity": self.sensitivity,
            "source": self.source,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }
        if self.description is not None:
            out["description"] = self.description
        return out


# --------------------------------------------------------------------------- validation
# Each ``*_problem`` returns None when the input is fine, else a fixed sentence that names the
# field but never repeats the offending text (it may be a misplaced secret).


# Unicode category Cc (C0, DEL, C1), lone surrogates (Cs) and the line/paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029]")
_CONTROL_BUT_NEWLINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029]")


def _has_control(text: str, *, allow_newlines: bool = False) -> bool:
    pattern = _CONTROL_BUT_NEWLINES if allow_newlines else _CONTROL
    return pattern.search(text) is not None


def key_problem(key: object) -> str | None:
    if not isinstance(key, str):
        return "key must be a string"
    if not key:
        return "key is empty"
    if len(key) > MAX_KEY_CHARS:
        return f"key is longer than {MAX_KEY_CHARS} characters"
    if key != key.strip():
        return "key has leading or trailing white space"
    if _has_control(key):
        return "key contains control characters"
    return None


def tag_problem(tag: object) -> str | None:
    if not isinstance(tag, str):
        return "each tag must be a string"
    if not tag:
        return "a tag is empty"
    if len(tag) > MAX_TAG_CHARS:
        return f"a tag is longer than {MAX_TAG_CHARS} characters"
    if tag != tag.strip():
        return "a tag has leading or trailing white space"
    if _has_control(tag):
        return "a tag contains control characters"
    return None


def tags_problem(tags: object) -> str | None:
    if not isinstance(tags, tuple | list):
        return "tags must be a list of strings"
    if len(tags) > MAX_TAGS:
        return f"more than {MAX_TAGS} tags"
    for tag in tags:
        problem = tag_problem(tag)
        if problem:
            return problem
    if len(set(tags)) != len(tags):
        return "a tag is repeated"
    return None


def sensitivity_problem(sensitivity: object) -> str | None:
    if sensitivity not in SENSITIVITIES:
        return "sensitivity must be low, medium or high"
    return None


def source_problem(source: object) -> str | None:
    if source not in SOURCES:
        return "source must be user or agent"
    return None


def timestamp_problem(value: object, field: str) -> str | None:
    """``value`` must be an ISO 8601 date-time with a time zone (the store writes UTC ``Z``)."""
    if not isinstance(value, str) or not value or len(value) > MAX_TIMESTAMP_CHARS:
        return f"{field} must be an ISO 8601 timestamp"
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return f"{field} must be an ISO 8601 timestamp"
    if "T" not in value.upper() or parsed.tzinfo is None:
        return f"{field} must be an ISO 8601 timestamp with a time zone"
    return None


def description_problem(description: object) -> str | None:
    if description is None:
        return None
    if not isinstance(description, str):
        return "description must be a string"
    if len(description) > MAX_DESCRIPTION_CHARS:
        return f"description is longer than {MAX_DESCRIPTION_CHARS} characters"
    if _has_control(description, allow_newlines=True):
        return "description contains control characters"
    return None


def encode_value(value: Any) -> str:
    """``value`` as the JSON text the store keeps; INVALID_REQUEST if it is not JSON or too big."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise UompError(ErrorCode.INVALID_REQUEST, "value is not a JSON value") from exc
    if len(text) > MAX_VALUE_BYTES // 4 and len(text.encode("utf-8")) > MAX_VALUE_BYTES:
        raise UompError(ErrorCode.INVALID_REQUEST, f"value is larger than {MAX_VALUE_BYTES} bytes")
    return text


def item_problem(item: MemoryItem) -> str | None:
    """The first thing wrong with ``item`` (value excepted: see :func:`encode_value`), or None."""
    return (
        key_problem(item.key)
        or tags_problem(item.tags)
        or sensitivity_problem(item.sensitivity)
        or source_problem(item.source)
        or timestamp_problem(item.created_at, "created_at")
        or timestamp_problem(item.updated_at, "updated_at")
        or description_problem(item.description)
    )


# One ``items`` row, in column order (key, value, tags, sensitivity, source, created_at, updated_at,
# description).
Row = tuple[str, str, str, str, str, str, str, str | None]


def row_of(item: MemoryItem) -> Row:
    problem = item_problem(item)
    if problem:
        raise UompError(ErrorCode.INVALID_REQUEST, problem)
    return (
        item.key,
        encode_value(item.value),
        json.dumps(list(item.tags), ensure_ascii=False, separators=(",", ":")),
        item.sensitivity,
        item.source,
        item.created_at,
        item.updated_at,
        item.description,
    )


class ValueOpener(Protocol):
    """What turns a stored value text back into its JSON text (the store: a high item's per-item
    seal opened, see :mod:`gateway.atrest.itemseal`)."""

    def open_text(self, key: str, sensitivity: str, text: str) -> str: ...


def stored_fields(
    opener: ValueOpener,
    key: str,
    stored: tuple[str, str, str, str, str | None],
    **fields: Any,
) -> dict[str, Any]:
    """One ``items`` or ``item_versions`` row as the user's reads hand it out (export, history):
    ``stored`` is the row's (value, tags, sensitivity, source, description); the value opened by
    ``opener`` and parsed, the tags parsed, then the caller's ``fields`` (times, versions) in their
    order, and ``description`` last, only when the row has one. Call it only for a read the caller
    has authorized (it opens sealed values)."""
    value, tags, sensitivity, source, description = stored
    out: dict[str, Any] = {
        "value": jsonio.loads(opener.open_text(key, sensitivity, value)),
        "tags": jsonio.loads(tags),
        "sensitivity": sensitivity,
        "source": source,
        **fields,
    }
    if description is not None:
        out["description"] = description
    return out
