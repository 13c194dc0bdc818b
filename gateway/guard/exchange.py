"""``uomp export`` / ``uomp import`` of a whole Memory Store: one JSON document, our envelope.

Envelope (``schema`` :data:`SCHEMA`, ``schema_version`` :data:`SCHEMA_VERSION`)::

    {"schema": "uomp-memory-export", "schema_version": 1, "exported_at": "...Z", "generator": "uomp X",
     "count": N,
     "items": [{"key", "value", "tags", "sensitivity", "source", "created_at", "updated_at",
                "description"?, "version", "history": [{"version", "deleted", "value"?, ...}]}
               | {"key", "deleted": true, "version", "history": [...]}]}

Every item with its version and its kept history (a key whose item was deleted keeps its history
and a ``deleted`` entry), in key order, so :func:`restore` rebuilds the store losslessly (values,
tags, sensitivity, source, times, versions, history). The document is written item by item (memory
stays one item, whatever the store's size). An unknown ``schema`` or a newer ``schema_version`` is
refused loudly (IMPORT_INVALID); every item is validated (spec §12) before anything is written and
everything goes in one transaction: any error writes nothing. Keys already in the store are refused
unless ``replace`` (their earlier state then joins their history, through the store's triggers, and
the imported history is not merged into theirs).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from gateway import __version__
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import fsync_dir
from gateway.guard.items import (
    MemoryItem,
    description_problem,
    encode_value,
    item_problem,
    key_problem,
    sensitivity_problem,
    source_problem,
    stored_fields,
    tags_problem,
    timestamp_problem,
    utc_now,
)
from gateway.guard.storage import MemoryStorage

SCHEMA = "uomp-memory-export"
SCHEMA_VERSION = 1
MAX_IMPORT_BYTES = 2 * 1024 * 1024 * 1024
MAX_HISTORY_ENTRIES = 10_000


def _history_rows(store: MemoryStorage, conn: Any, key: str) -> list[dict[str, Any]]:
    out = []
    for version, deleted, value, tags, sens, source, created, updated, desc, replaced in conn.execute(
        "SELECT version, deleted, value, tags, sensitivity, source, created_at, updated_at, description, "
        "replaced_at FROM item_versions WHERE key = ? ORDER BY version",
        (key,),
    ):
        if deleted:
            out.append({"version": version, "deleted": True, "replaced_at": replaced})
            continue
        fields = stored_fields(
            store, key, (value, tags, sens, source, desc), created_at=created, updated_at=updated, replaced_at=replaced
        )
        entry = {"version": version, "deleted": False, **fields}
        out.append(entry)
    return out


def export_items(store: MemoryStorage) -> Iterator[dict[str, Any]]:
    """Every item (and deleted key with history) of ``store`` as envelope entries, in key order."""
    with store.reading() as conn:
        keys = conn.execute("SELECT key FROM items UNION SELECT DISTINCT key FROM item_versions ORDER BY 1").fetchall()
    for (key,) in keys:
        with store.reading() as conn:
            row = conn.execute(
                "SELECT value, tags, sensitivity, source, created_at, updated_at, description, version "
                "FROM items WHERE key = ?",
                (key,),
            ).fetchone()
            hist = _history_rows(store, conn, key)
        if row is None:
            top = max((h["version"] for h in hist), default=0)
            yield {"key": key, "deleted": True, "version": top, "history": hist}
            continue
        value, tags, sens, source, created, updated, desc, version = row
        fields = stored_fields(
            store,
            key,
            (value, tags, sens, source, desc),
            created_at=created,
            updated_at=updated,
            version=version,
            history=hist,
        )
        entry: dict[str, Any] = {"key": key, **fields}
        yield entry


def write_export(store: MemoryStorage, out: IO[str]) -> int:
    """Write the envelope to ``out``, one item at a time; how many entries."""
    head = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "exported_at": utc_now(),
        "generator": f"uomp {__version__}",
    }
    out.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "items": [')
    n = 0
    for entry in export_items(store):
        out.write(("\n" if n == 0 else ",\n") + json.dumps(entry, ensure_ascii=False, separators=(",", ":")))
        n += 1
    out.write(f'\n], "count": {n}}}\n')
    return n


def export_file(store: MemoryStorage, path: Path) -> int:
    """The envelope into ``path``, streamed into a 0600 temporary file beside it (it holds every
    value), flushed to disk and renamed over ``path``: a crash leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            n = write_export(store, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return n


def _bad(n: int, what: str) -> UompError:
    return UompError(ErrorCode.IMPORT_INVALID, f"export entry {n}: {what}; nothing was imported", details={"entry": n})


def parse_envelope(data: bytes) -> list[dict[str, Any]]:
    """The validated entries of an export document (IMPORT_INVALID on any problem, naming it)."""
    try:
        doc = json.loads(data.decode("utf-8-sig"), parse_constant=lambda n: (_ for _ in ()).throw(ValueError(n)))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UompError(ErrorCode.IMPORT_INVALID, "the export is not UTF-8 JSON; nothing was imported") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise UompError(
            ErrorCode.IMPORT_INVALID,
            f"not a uomp export (schema is not {SCHEMA!r}); pick the adapter of the format with --adapter",
        )
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UompError(
            ErrorCode.IMPORT_INVALID,
            f"export schema version {str(version)[:20]} is not {SCHEMA_VERSION}, the one this uomp reads; "
            "upgrade uomp (nothing was imported)",
            details={"schema_version": version},
        )
    items = doc.get("items")
    if not isinstance(items, list):
        raise UompError(ErrorCode.IMPORT_INVALID, "the export has no items list; nothing was imported")
    if doc.get("count") != len(items):
        raise UompError(ErrorCode.IMPORT_INVALID, "the export's count does not match its items (cut short?)")
    seen: set[str] = set()
    for n, e in enumerate(items):
        if not isinstance(e, dict):
            raise _bad(n, "not an object")
        problem = key_problem(e.get("key"))
        if problem:
            raise _bad(n, problem)
        if e["key"] in seen:
            raise _bad(n, "the key appears twice")
        seen.add(e["key"])
        version = e.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise _bad(n, "version must be a non-negative integer")
        hist = e.get("history", [])
        if not isinstance(hist, list) or len(hist) > MAX_HISTORY_ENTRIES:
            raise _bad(n, "history must be a list")
        versions = [version] if not e.get("deleted") else []
        for h in hist:
            if not isinstance(h, dict) or isinstance(h.get("version"), bool) or not isinstance(h.get("version"), int):
                raise _bad(n, "a history entry has no version")
            versions.append(h["version"])
            if not h.get("deleted"):
                problem = _fields_problem(h, times=("created_at", "updated_at"))
                if problem:
                    raise _bad(n, f"history version {h['version']}: {problem}")
        if len(set(versions)) != len(versions):
            raise _bad(n, "a version appears twice")
        if not e.get("deleted"):
            problem = _fields_problem(e, times=("created_at", "updated_at"))
            if problem:
                raise _bad(n, problem)
            if hist and max(h["version"] for h in hist) >= version:
                raise _bad(n, "the current version must be above its history's")
    return items


def _fields_problem(e: dict[str, Any], *, times: tuple[str, ...]) -> str | None:
    if "value" not in e:
        return "no value"
    try:
        encode_value(e["value"])
    except UompError as exc:
        return exc.message
    return (
        tags_problem(e.get("tags"))
        or sensitivity_problem(e.get("sensitivity"))
        or source_problem(e.get("source"))
        or next((p for t in times if (p := timestamp_problem(e.get(t), t))), None)
        or description_problem(e.get("description"))
    )


def _tags_text(tags: tuple[str, ...]) -> str:
    return json.dumps(list(tags), ensure_ascii=False, separators=(",", ":"))


def _item(key: str, e: dict[str, Any]) -> MemoryItem:
    return MemoryItem(
        key, e["value"], tuple(e["tags"]), e["sensitivity"], e["source"], e["created_at"], e["updated_at"],
        e.get("description"),
    )  # fmt: skip


def restore(store: MemoryStorage, entries: list[dict[str, Any]], *, replace: bool) -> tuple[int, int]:
    """Write validated envelope entries in ONE transaction: (items written, keys replaced)."""
    replaced = 0
    written = 0
    with store.writing() as conn:
        for e in entries:
            key = e["key"]
            exists = conn.execute("SELECT 1 FROM items WHERE key = ?", (key,)).fetchone() is not None
            if exists and not replace:
                raise UompError(
                    ErrorCode.IMPORT_INVALID,
                    "a key of the export is already in the store; pass --replace to overwrite (nothing was imported)",
                )
            replaced += exists
            if not exists:
                for h in e.get("history", []):
                    if h.get("deleted"):
                        conn.execute(
                            "INSERT OR REPLACE INTO item_versions (key, version, deleted, replaced_at) "
                            "VALUES (?,?,1,?)",
                            (key, h["version"], h.get("replaced_at") or utc_now()),
                        )
                    else:
                        it = _item(key, h)
                        conn.execute(
                            "INSERT OR REPLACE INTO item_versions (key, version, deleted, value, tags, sensitivity, "
                            "source, created_at, updated_at, description, replaced_at) VALUES (?,?,0,?,?,?,?,?,?,?,?)",
                            (key, h["version"], store.seal_text(key, it.sensitivity, encode_value(it.value)),
                             _tags_text(it.tags),
                             it.sensitivity, it.source, it.created_at, it.updated_at, it.description,
                             h.get("replaced_at") or utc_now()),
                        )  # fmt: skip
            if e.get("deleted"):
                continue
            item = _item(key, e)
            problem = item_problem(item)
            if problem:
                raise UompError(ErrorCode.IMPORT_INVALID, problem)
            tags_json = json.dumps(list(item.tags), ensure_ascii=False, separators=(",", ":"))
            conn.execute("DELETE FROM item_tags WHERE item_key = ?", (key,))
            conn.execute(
                "INSERT INTO items (key, value, tags, sensitivity, source, created_at, updated_at, description) "
                "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(key) DO UPDATE SET value = excluded.value, tags = excluded.tags, "
                "sensitivity = excluded.sensitivity, source = excluded.source, created_at = excluded.created_at, "
                "updated_at = excluded.updated_at, description = excluded.description",
                (key, store.seal_text(key, item.sensitivity, encode_value(item.value)), tags_json,
                 item.sensitivity, item.source, item.created_at,
                 item.updated_at, item.description),
            )  # fmt: skip
            conn.executemany("INSERT INTO item_tags (tag, item_key) VALUES (?, ?)", [(t, key) for t in item.tags])
            if not exists:
                conn.execute("UPDATE items SET version = ? WHERE key = ?", (e["version"], key))
            written += 1
    return written, replaced


def read_bounded(path: Path) -> bytes:
    """The file's bytes; IMPORT_INVALID when it is larger than :data:`MAX_IMPORT_BYTES`."""
    try:
        size = path.stat().st_size
        if size > MAX_IMPORT_BYTES:
            raise UompError(ErrorCode.IMPORT_INVALID, f"the file is larger than {MAX_IMPORT_BYTES} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise UompError(ErrorCode.IO_ERROR, f"cannot read {path.name}: {exc.strerror}") from exc


def looks_like_export(path: Path) -> bool:
    """True when ``path`` starts like our envelope (the first KiB names the schema)."""
    try:
        with path.open("rb") as f:
            head = f.read(1024)
    except OSError:
        return False
    return head.lstrip().startswith(b"{") and f'"schema": "{SCHEMA}"'.encode() in head


def adapt(adapter: str, data: bytes, *, sensitivity: str) -> list[MemoryItem]:
    """Every item an adapter makes of ``data`` (IMPORT_INVALID: not that format; unknown adapter)."""
    from gateway.guard.adapters import ADAPTERS

    fn = ADAPTERS.get(adapter)
    if fn is None:
        raise UompError(ErrorCode.IMPORT_INVALID, f"no adapter {adapter[:40]!r}; the adapters: {', '.join(ADAPTERS)}")
    items = list(fn(data, sensitivity=sensitivity))
    keys = [i.key for i in items]
    if len(set(keys)) != len(keys):
        raise UompError(ErrorCode.IMPORT_INVALID, f"the {adapter} file names one memory twice; nothing was imported")
    return items


def write_items(store: MemoryStorage, items: Iterable[MemoryItem], *, replace: bool) -> tuple[int, int]:
    """Validated items in one transaction: (written, replaced)."""
    items = list(items)
    with store.bulk_writer(replace=replace) as w:
        existing = w.existing([i.key for i in items])
        if existing and not replace:
            raise UompError(
                ErrorCode.IMPORT_INVALID,
                f"{len(existing)} keys are already in the store; pass --replace to overwrite (nothing was imported)",
            )
        for it in items:
            w.add(it)
        return w.commit(), len(existing)
