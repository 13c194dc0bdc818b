"""The dashboard's Memory pages (docs/writes.md): browse and search the items by key and tag, one
item with its value, its kept versions and the agents that read it by key (from the audit log), and
the user's own delete and roll back, under the dashboard's gate and confirmation step (as revoke).

Reads open ``memory.db`` read-only through the store; a delete or rollback is the CLI's change
(:mod:`gateway.guard.history`, the store's delete), audited as a user event with origin
``dashboard``. Values are the user's own data, shown to the user only; agent-written text is
JSON-escaped before it is HTML-escaped.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from gateway import httpd, sqldriver
from gateway.atrest import auditdb
from gateway.cli import userlog
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError
from gateway.guard import history
from gateway.guard.items import key_problem, tag_problem
from gateway.guard.stores import open_user_store

if TYPE_CHECKING:
    from gateway.dashboard.server import Dashboard

PAGE = 200
MAX_READERS = 50


def _safe(value: Any) -> str:
    return json.dumps(value, ensure_ascii=True, sort_keys=True)


def browse(paths: Paths, *, q: str, tag: str) -> tuple[list[dict[str, Any]], int]:
    """Items whose key starts with ``q`` (and that carry ``tag``), first :data:`PAGE`, and the total."""
    with open_user_store(paths) as store, store.reading() as conn:
        where, args = ["i.key >= ? AND i.key < ?"], [q, q + "\U0010ffff"]
        if tag:
            where.append("EXISTS (SELECT 1 FROM item_tags t WHERE t.item_key = i.key AND t.tag = ?)")
            args.append(tag)
        sql = " AND ".join(where)
        rows = conn.execute(
            f"SELECT key, tags, sensitivity, source, updated_at, version FROM items i WHERE {sql} ORDER BY key LIMIT ?",
            (*args, PAGE),
        ).fetchall()
        total = conn.execute(f"SELECT count(*) FROM items i WHERE {sql}", args).fetchone()[0]
    return [
        {
            "key": k,
            "key_shown": _safe(k)[1:-1],
            "tags": ", ".join(json.loads(t)),
            "sensitivity": s,
            "source": src,
            "updated_at": u,
            "version": v,
        }
        for k, t, s, src, u, v in rows
    ], int(total)


def readers(paths: Paths, key: str) -> list[tuple[str, int]]:
    """Agents that read ``key`` by key, allowed, with how many times (newest events first, bounded)."""
    if not paths.audit_db.exists():
        return []
    conn = auditdb.connect(paths.audit_db, readonly=True, timeout=5.0)
    try:
        rows = conn.execute(
            "SELECT json_extract(body, '$.agent_id'), count(*) FROM ledger_events WHERE body IS NOT NULL "
            "AND json_extract(body, '$.key') = ? AND json_extract(body, '$.action') = 'read' "
            "AND json_extract(body, '$.allowed') IN (1, 'true') GROUP BY 1 ORDER BY 2 DESC LIMIT ?",
            (key, MAX_READERS),
        ).fetchall()
    except sqldriver.OPERATIONAL:
        return []
    finally:
        conn.close()
    return [(str(a), int(n)) for a, n in rows]


def one(paths: Paths, key: str) -> dict[str, Any]:
    """One key as the item page shows it: its current item (if any) and kept versions, escaped."""
    with open_user_store(paths) as store:
        entries = history.history(store, key)
    if not entries:
        raise UompError(ErrorCode.NOT_FOUND, "no item and no history for this key")
    for e in entries:
        if not e["deleted"]:
            e["value_shown"] = _safe(e["value"])
            e["tags_shown"] = ", ".join(e["tags"])
    current = entries[0] if entries[0].get("current") else None
    return {"key": key, "key_shown": _safe(key)[1:-1], "current": current, "entries": entries}


def rollback(paths: Paths, key: str, version: int) -> int:
    """Make ``version`` current again (a new version, audited with origin dashboard); the new version."""
    with open_user_store(paths) as store, userlog.change(paths, via="dashboard") as event:
        new = history.rollback(store, key, version)
        event.action, event.key = "memory_rolled_back", key
        event.reason = "the user rolled a memory item back to an earlier version"
        event.detail = f"version {version} made current as version {new}"
    return new


def delete(paths: Paths, key: str) -> None:
    """Delete the item (its history is kept), audited with origin dashboard."""
    with open_user_store(paths) as store, userlog.change(paths, via="dashboard") as event:
        if not store.delete(key):
            raise UompError(ErrorCode.NOT_FOUND, "no item with this key")
        event.action, event.key, event.reason = "memory_deleted", key, "the user deleted a memory item"


def _key(raw: Any) -> str:
    if not isinstance(raw, str) or key_problem(raw):
        raise UompError(ErrorCode.INVALID_REQUEST, "not a memory key")
    return raw


class MemoryPages:
    """The Memory page's handlers: browse, one item, and its changes (delete, rollback)."""

    def __init__(self, dash: Dashboard) -> None:
        self.dash = dash

    async def page(self, request: httpd.Request) -> httpd.AnyResponse:
        q = request.query.get("q", "")[:256]
        tag = request.query.get("tag", "")[:128]
        if tag and tag_problem(tag):
            tag = ""
        rows, total = await asyncio.to_thread(browse, self.dash.paths, q=q, tag=tag)
        return self.dash._render(request, "memory.html", title="Memory", rows=rows, total=total, q=q, tag=tag)

    async def item(self, request: httpd.Request) -> httpd.AnyResponse:
        key = _key(request.query.get("key"))
        got, who = await asyncio.gather(
            asyncio.to_thread(one, self.dash.paths, key), asyncio.to_thread(readers, self.dash.paths, key)
        )
        return self.dash._render(request, "memory_item.html", title="Memory item", item=got, readers=who)

    async def change(self, request: httpd.Request) -> httpd.AnyResponse:
        from gateway.dashboard.server import FORM_KEY

        how = request.match_info["how"]
        form = request[FORM_KEY]
        key = _key(form.get("key"))
        version = None
        if how == "rollback":
            raw = form.get("version", "")
            if not isinstance(raw, str) or not raw.isascii() or not raw.isdigit() or len(raw) > 15:
                raise UompError(ErrorCode.INVALID_REQUEST, "not a version")
            version = int(raw)
        fields = {"key": key, **({"version": str(version)} if version is not None else {})}
        if form.get("confirmed") != "yes":
            return self.dash._render(
                request,
                "confirm.html",
                title="Confirm",
                action=f"/memory/{how}",
                question=(f"Roll {key} back to version {version}?" if how == "rollback" else f"Delete {key}?"),
                consequence="It becomes a new version; the current one stays in the history."
                if how == "rollback"
                else "Agents can no longer read it; its last version stays in the history.",
                button="Roll back" if how == "rollback" else "Delete",
                fields=fields,
                cancel="/memory",
            )
        if version is not None:
            new = await asyncio.to_thread(rollback, self.dash.paths, key, version)
            message = f"Rolled {key} back: version {version} is now current as version {new}."
        else:
            await asyncio.to_thread(delete, self.dash.paths, key)
            message = f"Deleted {key}."
        return self.dash._back(request, "/memory", message)
