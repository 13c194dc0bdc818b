"""Import adapters: other memory stores' exports as Memory Items (pure data conversion).

Each adapter turns the bytes of one file into :class:`~gateway.guard.items.MemoryItem` objects and
nothing else: no store, no network, no model. A file that is not what the adapter expects is
``IMPORT_INVALID`` naming the adapter and what is missing (never the file's text); the caller
validates every item (spec §12) and writes all of them in one transaction or none.

* ``mem0``: mem0's export JSON: a list of memories, or ``{"results": [...]}`` / ``{"memories":
  [...]}``; each with ``id`` and ``memory`` (text), optional ``categories``, ``metadata``,
  ``created_at``/``updated_at``. Key ``mem0.<id>``, value the text (with ``metadata`` when present:
  ``{"text", "metadata"}``), tags ``mem0`` and the categories.
* ``claude-md``: Claude Code memory markdown (``CLAUDE.md``, memory files): every list item
  (``-``, ``*``, ``1.``) is one memory, under the heading it sits below. Key
  ``claude.<heading slug>.<first 12 hex of the text's SHA-256>`` (stable across re-imports), value the
  text, tags ``claude-code`` and the heading slug.
* ``dsh-export``: the dsh-memory-protocol ``memory-export-v1`` envelope (``{"schema":
  "memory-export-v1", "entries": [...]}``): key ``dsh.<id>``, value the ``text``, tags the entry's
  tags, ``dsh`` and ``track:<track>``, times from its epoch milliseconds.

Sensitivity: none of these formats has one; the caller's ``--sensitivity`` (default ``medium``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from gateway.errors import ErrorCode, UompError
from gateway.guard.items import MemoryItem, utc_now

MAX_ADAPTER_ITEMS = 1_000_000
_SLUG = re.compile(r"[^a-z0-9]+")
_LIST_ITEM = re.compile(r"^\s{0,3}(?:[-*+]|\d{1,3}[.)])\s+(?P<text>\S.*)$")
_HEADING = re.compile(r"^\s{0,3}(?P<hashes>#{1,6})\s+(?P<text>.+?)\s*#*\s*$")


def _refuse(adapter: str, what: str) -> UompError:
    return UompError(
        ErrorCode.IMPORT_INVALID,
        f"the file is not a {adapter} export: {what}; check the --adapter you chose",
        details={"adapter": adapter},
    )


def _slug(text: str) -> str:
    return _SLUG.sub("-", text.lower()).strip("-")[:64] or "general"


def _iso(value: Any, adapter: str, field: str) -> str | None:
    """An ISO 8601 timestamp with a zone from ``value`` (ISO text, or epoch seconds / ms)."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int | float):
            seconds = value / 1000 if value > 10**11 else value
            dt = datetime.fromtimestamp(seconds, tz=UTC)
        elif isinstance(value, str):
            dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
            if dt.tzinfo is None:
                dt = dt.replace(tzinfo=UTC)
        else:
            raise ValueError
    except (ValueError, OverflowError, OSError) as exc:
        raise _refuse(adapter, f"{field} is not a timestamp") from exc
    return dt.astimezone(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json(data: bytes, adapter: str) -> Any:
    try:
        return json.loads(data.decode("utf-8-sig"), parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _refuse(adapter, "it is not UTF-8 JSON") from exc


def _tags(values: Any, adapter: str) -> list[str]:
    if values is None:
        return []
    if not isinstance(values, list) or not all(isinstance(t, str) for t in values):
        raise _refuse(adapter, "tags/categories must be a list of strings")
    return [t.strip() for t in values if t.strip()]


def _dedup(tags: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(tags))


def mem0(data: bytes, *, sensitivity: str) -> Iterator[MemoryItem]:
    """Items of a mem0 export (a list, or ``results`` / ``memories``), each with ``sensitivity``."""
    doc = _json(data, "mem0")
    rows = doc.get("results", doc.get("memories")) if isinstance(doc, dict) else doc
    if not isinstance(rows, list):
        raise _refuse("mem0", "no list of memories (a list, or results / memories)")
    now = utc_now()
    for n, row in enumerate(rows[:MAX_ADAPTER_ITEMS]):
        if not isinstance(row, dict) or not isinstance(row.get("memory"), str) or not row.get("id"):
            raise _refuse("mem0", f"memory {n} has no id and memory text")
        text = row["memory"]
        metadata = row.get("metadata")
        value: Any = {"text": text, "metadata": metadata} if isinstance(metadata, dict) and metadata else text
        created = _iso(row.get("created_at"), "mem0", f"memory {n} created_at") or now
        updated = _iso(row.get("updated_at"), "mem0", f"memory {n} updated_at") or created
        yield MemoryItem(
            key=f"mem0.{row['id']}",
            value=value,
            tags=_dedup(["mem0", *_tags(row.get("categories"), "mem0")]),
            sensitivity=sensitivity,
            source="user",
            created_at=created,
            updated_at=updated,
        )


def claude_md(data: bytes, *, sensitivity: str) -> Iterator[MemoryItem]:
    """Items of a Claude Code memory markdown file (CLAUDE.md), each with ``sensitivity``."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _refuse("claude-md", "it is not UTF-8 text") from exc
    if "\x00" in text:
        raise _refuse("claude-md", "it is binary, not markdown")
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            json.loads(stripped)
        except ValueError:
            pass
        else:
            raise _refuse("claude-md", "it is JSON, not markdown")
    heading = "general"
    now = utc_now()
    found = 0
    seen: set[str] = set()
    in_code = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        h = _HEADING.match(line)
        if h:
            heading = _slug(h.group("text"))
            continue
        m = _LIST_ITEM.match(line)
        if not m:
            continue
        memory = m.group("text").strip()
        key = f"claude.{heading}.{hashlib.sha256(memory.encode()).hexdigest()[:12]}"
        if key in seen:
            continue  # the same line twice under one heading is one memory
        seen.add(key)
        found += 1
        yield MemoryItem(key, memory, _dedup(["claude-code", heading]), sensitivity, "user", now, now)
    if not found:
        raise _refuse("claude-md", "no list items (- ...) to import")


def dsh_export(data: bytes, *, sensitivity: str) -> Iterator[MemoryItem]:
    """Items of a dsh ``memory-export-v1`` envelope, each with ``sensitivity``."""
    doc = _json(data, "dsh-export")
    if not isinstance(doc, dict) or doc.get("schema") != "memory-export-v1":
        got = doc.get("schema") if isinstance(doc, dict) else None
        raise _refuse(
            "dsh-export", "its schema is not memory-export-v1" + (f" (it says {str(got)[:40]!r})" if got else "")
        )
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise _refuse("dsh-export", "no entries list")
    for n, e in enumerate(entries[:MAX_ADAPTER_ITEMS]):
        if not isinstance(e, dict) or not isinstance(e.get("text"), str) or not e["text"] or not e.get("id"):
            raise _refuse("dsh-export", f"entry {n} has no id and text")
        track = e.get("track", "user")
        if track not in ("user", "agent"):
            raise _refuse("dsh-export", f"entry {n} has an unknown track")
        created = _iso(e.get("createdAt"), "dsh-export", f"entry {n} createdAt") or utc_now()
        updated = _iso(e.get("updatedAt"), "dsh-export", f"entry {n} updatedAt") or created
        yield MemoryItem(
            key=f"dsh.{e['id']}",
            value=e["text"],
            tags=_dedup([*_tags(e.get("tags"), "dsh-export"), "dsh", f"track:{track}"]),
            sensitivity=sensitivity,
            source="user",
            created_at=created,
            updated_at=updated,
        )


ADAPTERS: dict[str, Callable[..., Iterator[MemoryItem]]] = {
    "mem0": mem0,
    "claude-md": claude_md,
    "dsh-export": dsh_export,
}
