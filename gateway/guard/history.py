"""Version history and rollback of Memory Items, over the store's ``item_versions`` table.

The store's triggers (:mod:`gateway.guard.store`, schema 3) keep, in the same transaction as the
change, the state every write replaces: the user's ``uomp memory add --replace`` / ``rm``, imports
with ``--replace``, an approved agent proposal, a rollback. So history cannot be skipped by a writer
and a crash leaves the change and its history together or neither. ``history_settings.max_versions``
bounds what is kept per key (older versions are dropped as new ones come; 0 keeps all).

:func:`rollback` makes an earlier version the current one, as a NEW version (history is never
rewritten): rolling back to 2 from 5 gives version 6 equal to 2, and 5 stays in the history.
"""

from __future__ import annotations

import json
from typing import Any

from gateway import jsonio
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.guard.items import MemoryItem, stored_fields, utc_now
from gateway.guard.storage import MemoryStorage

MAX_HISTORY = 1000

_SQL_UPSERT = (
    "INSERT INTO items (key, value, tags, sensitivity, source, created_at, updated_at, description) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value, "
    "tags = excluded.tags, sensitivity = excluded.sensitivity, source = excluded.source, "
    "updated_at = excluded.updated_at, description = excluded.description"
)


def set_retention(store: MemoryStorage, max_versions: int) -> None:
    """How many earlier versions each key keeps from now on (0: all)."""
    if isinstance(max_versions, bool) or not isinstance(max_versions, int) or max_versions < 0:
        raise UompError(ErrorCode.CONFIG_ERROR, "history_max_versions must be an integer >= 0 (0 keeps all)")
    with store.reading() as conn:
        now = conn.execute("SELECT max_versions FROM history_settings WHERE id = 1").fetchone()
    if now is not None and int(now[0]) == max_versions:
        return
    with store.writing() as conn:
        conn.execute("UPDATE history_settings SET max_versions = ? WHERE id = 1", (max_versions,))


def _version_entry(store: MemoryStorage, key: str, row: tuple[Any, ...]) -> dict[str, Any]:
    version, deleted, value, tags, sens, source, _created, updated, desc, replaced = row
    if deleted:
        return {"version": int(version), "deleted": True, "at": replaced}
    fields = stored_fields(store, key, (value, tags, sens, source, desc), updated_at=updated, replaced_at=replaced)
    out: dict[str, Any] = {"version": int(version), "deleted": False, **fields}
    return out


def history(store: MemoryStorage, key: str, *, limit: int = 100) -> list[dict[str, Any]]:
    """Every kept version of ``key``, newest first; the current item (if any) first with
    ``"current": true``. Empty when the key was never used (or its history was not kept)."""
    limit = max(1, min(limit, MAX_HISTORY))
    with store.reading() as conn:
        cur = conn.execute(
            "SELECT version, value, tags, sensitivity, source, updated_at, description FROM items WHERE key = ?",
            (key,),
        ).fetchone()
        rows = conn.execute(
            "SELECT version, deleted, value, tags, sensitivity, source, created_at, updated_at, description, "
            "replaced_at FROM item_versions WHERE key = ? ORDER BY version DESC LIMIT ?",
            (key, limit),
        ).fetchall()
        agents = dict(
            conn.execute(
                "SELECT applied_version, agent_id FROM proposals WHERE key = ? AND status = 'approved'", (key,)
            ).fetchall()
        )
    out: list[dict[str, Any]] = []
    if cur is not None:
        version, value, tags, sens, source, updated, desc = cur
        fields = stored_fields(store, key, (value, tags, sens, source, desc), updated_at=updated)
        entry: dict[str, Any] = {"version": int(version), "current": True, "deleted": False, **fields}
        out.append(entry)
    for row in rows:
        out.append(_version_entry(store, key, row))
    for entry in out:
        if entry["version"] in agents:
            entry["agent_id"] = agents[entry["version"]]
    return out[:limit]


def rollback(store: MemoryStorage, key: str, to_version: int) -> int:
    """Make version ``to_version`` of ``key`` current again, as a new version (one transaction);
    the new version. INVALID_REQUEST for a version that is not kept, is a deletion, or is current."""
    with store.writing() as conn:
        row = conn.execute(
            "SELECT deleted, value, tags, sensitivity, source, created_at, description FROM item_versions "
            "WHERE key = ? AND version = ?",
            (key, to_version),
        ).fetchone()
        if row is None:
            current = conn.execute("SELECT version FROM items WHERE key = ?", (key,)).fetchone()
            if current is not None and int(current[0]) == to_version:
                raise UompError(ErrorCode.INVALID_REQUEST, f"version {to_version} is the current one; nothing to do")
            raise UompError(
                ErrorCode.INVALID_REQUEST,
                f"no version {to_version} of this key is kept; 'uomp memory history KEY' lists them",
            )
        deleted, value, tags, sens, _source, created, desc = row
        if deleted:
            raise UompError(
                ErrorCode.INVALID_REQUEST, f"version {to_version} is a deletion; roll back to the version before it"
            )
        # the user chose this version: the new one is the user's, whoever wrote the old one
        item = MemoryItem(key, jsonio.loads(value), tuple(jsonio.loads(tags)), sens, "user", created, utc_now(), desc)
        conn.execute("DELETE FROM item_tags WHERE item_key = ?", (key,))
        existing = conn.execute("SELECT created_at FROM items WHERE key = ?", (key,)).fetchone()
        conn.execute(
            _SQL_UPSERT,
            (
                key,
                value,
                json.dumps(list(item.tags), ensure_ascii=False, separators=(",", ":")),
                sens,
                item.source,
                existing[0] if existing is not None else created,
                item.updated_at,
                desc,
            ),
        )
        conn.executemany("INSERT INTO item_tags (tag, item_key) VALUES (?, ?)", [(t, key) for t in item.tags])
        fault_point("rollback_apply")  # crash tests: the item rewritten, not committed
        return int(conn.execute("SELECT version FROM items WHERE key = ?", (key,)).fetchone()[0])


def purge(store: MemoryStorage, key: str) -> int:
    """Remove ``key``'s item and every kept version of it, in one transaction (``secure_delete``
    overwrites their bytes); how many history rows went."""
    with store.writing() as conn:
        conn.execute("DELETE FROM item_tags WHERE item_key = ?", (key,))
        conn.execute("DELETE FROM items WHERE key = ?", (key,))  # (the trigger keeps it: removed below)
        return int(conn.execute("DELETE FROM item_versions WHERE key = ?", (key,)).rowcount)
