"""The user's two whole-item reads, export (gateway/guard/exchange.py) and history
(gateway/guard/history.py), hand out a row the same way (gateway/guard/items.py ``stored_fields``):
a high item's per-item seal opened (never the sealed blob), tags parsed, ``description`` only when
set and last; each keeps its own fields, in its own order (the export's ``created_at`` /
``version`` / ``history``, the history's ``current`` / ``replaced_at`` and ``at`` of a deletion)."""

from __future__ import annotations

from typing import Any

import pytest
from test_sealed_keys import make_home

from gateway.atrest import itemseal, vault
from gateway.guard import exchange, history
from gateway.guard.items import timestamp_problem
from gateway.guard.store import MemoryItem, MemoryStore
from gateway.guard.stores import open_user_store

T1, T2, T3 = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z"
HIGH = {"pin": "shape-high-marker-5e1d"}


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()


def filled() -> MemoryStore:
    """bank.pin (high, no description, two versions), note (low, a description, two versions), gone
    (written, then deleted)."""
    store = open_user_store(make_home())
    store.put(MemoryItem("bank.pin", {"pin": "old"}, ("bank",), "high", "user", T1, T1))
    store.put(MemoryItem("bank.pin", HIGH, ("bank", "pin"), "high", "agent", T1, T2), replace=True)
    store.put(MemoryItem("note", "first", ("misc",), "low", "user", T1, T1, "said once"))
    store.put(MemoryItem("note", "second", (), "low", "user", T1, T3, "said twice"), replace=True)
    store.put(MemoryItem("gone", 1, (), "medium", "user", T1, T1))
    store.delete("gone")
    return store


def stored_value(store: MemoryStore, key: str) -> str:
    with store.reading() as conn:
        return str(conn.execute("SELECT value FROM items WHERE key = ?", (key,)).fetchone()[0])


def times_ok(entries: list[dict[str, Any]], *fields: str) -> None:
    for e in entries:
        for f in fields:
            if f in e:
                assert timestamp_problem(e.pop(f), f) is None


def test_export_entries_keep_their_shape_with_a_high_item_opened() -> None:
    store = filled()
    try:
        assert itemseal.is_sealed_text(stored_value(store, "bank.pin"))  # sealed in the file
        entries = {e["key"]: e for e in exchange.export_items(store)}
    finally:
        store.close()
    pin = entries["bank.pin"]
    assert list(pin) == [
        "key", "value", "tags", "sensitivity", "source", "created_at", "updated_at", "version", "history",
    ]  # fmt: skip
    assert pin["value"] == HIGH and pin["tags"] == ["bank", "pin"] and pin["source"] == "agent"
    assert (pin["sensitivity"], pin["created_at"], pin["updated_at"], pin["version"]) == ("high", T1, T2, 2)
    [old] = pin["history"]
    assert list(old) == [
        "version", "deleted", "value", "tags", "sensitivity", "source", "created_at", "updated_at", "replaced_at",
    ]  # fmt: skip
    times_ok([old], "replaced_at")
    assert old == {
        "version": 1, "deleted": False, "value": {"pin": "old"}, "tags": ["bank"], "sensitivity": "high",
        "source": "user", "created_at": T1, "updated_at": T1,
    }  # fmt: skip
    note = entries["note"]
    assert list(note)[-1] == "description" and note["description"] == "said twice"
    assert note["value"] == "second" and note["tags"] == []
    assert note["history"][0]["description"] == "said once" and list(note["history"][0])[-1] == "description"
    gone = entries["gone"]
    assert list(gone) == ["key", "deleted", "version", "history"] and gone["deleted"] is True
    assert [(h["version"], h["deleted"]) for h in gone["history"]] == [(1, False), (2, True)]
    assert list(gone["history"][1]) == ["version", "deleted", "replaced_at"]


def test_history_entries_keep_their_shape_with_a_high_item_opened() -> None:
    store = filled()
    try:
        pin = history.history(store, "bank.pin")
        note = history.history(store, "note")
        gone = history.history(store, "gone")
    finally:
        store.close()
    assert [list(e) for e in pin] == [
        ["version", "current", "deleted", "value", "tags", "sensitivity", "source", "updated_at"],
        ["version", "deleted", "value", "tags", "sensitivity", "source", "updated_at", "replaced_at"],
    ]
    times_ok(pin, "replaced_at")
    assert pin == [
        {"version": 2, "current": True, "deleted": False, "value": HIGH, "tags": ["bank", "pin"],
         "sensitivity": "high", "source": "agent", "updated_at": T2},
        {"version": 1, "deleted": False, "value": {"pin": "old"}, "tags": ["bank"], "sensitivity": "high",
         "source": "user", "updated_at": T1},
    ]  # fmt: skip
    assert [e["description"] for e in note] == ["said twice", "said once"]
    assert all(list(e)[-1] == "description" for e in note)
    assert list(gone[0]) == ["version", "deleted", "at"] and gone[0]["deleted"] is True
    assert "current" not in gone[1] and gone[1]["value"] == 1
