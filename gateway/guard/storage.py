"""The memory store seam: what the guard, the importer and the CLI need of a memory store
(:class:`MemoryStorage`, :class:`MemoryBulkWriting`) and the values that cross it (:class:`ItemMeta`,
:class:`ReadFilter`, :class:`AggregateRow`, :class:`Atom`, :func:`json_path`).

An implementation is chosen by :func:`gateway.guard.stores.open_memory_store`; the SQLite one is
:class:`gateway.guard.store.MemoryStore`, and ``tests/guard/test_seams.py`` is the behaviour any
store must show. Every method may raise ``UompError`` STORE_UNAVAILABLE (or STORE_BUSY); a bad item
is INVALID_REQUEST. The item rules (keys, tags, sensitivities, sizes) are :mod:`gateway.guard.items`.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import re
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

from gateway.guard.items import MemoryItem


@dataclass(frozen=True)
class ItemMeta:
    """What a policy decision needs about an item, and nothing else (no value)."""

    tags: tuple[str, ...]
    sensitivity: str


@dataclass(frozen=True)
class ReadFilter:
    """The key rules of a grant (spec §10.4 steps 6-8) for items reached through a tag that is
    itself granted, as SQL: not in ``deny_keys``; no tag in ``deny_tags``; ``sensitivity=high``
    only when the key is in ``keys``. Equivalent to :func:`gateway.core.policy.key_decision` for
    such items (a test checks the two agree)."""

    keys: tuple[str, ...] = ()
    deny_keys: tuple[str, ...] = ()
    deny_tags: tuple[str, ...] = ()

    def sql(self) -> tuple[str, dict[str, Any]]:
        """A WHERE fragment over ``items i`` (fixed text, named parameters only) and its parameters."""
        parts = []
        params: dict[str, Any] = {}
        if self.deny_keys:
            parts.append("i.key NOT IN (SELECT value FROM json_each(:f_deny_keys))")
            params["f_deny_keys"] = json.dumps(list(self.deny_keys))
        if self.deny_tags:
            parts.append(
                "NOT EXISTS (SELECT 1 FROM item_tags d WHERE d.item_key = i.key "
                "AND d.tag IN (SELECT value FROM json_each(:f_deny_tags)))"
            )
            params["f_deny_tags"] = json.dumps(list(self.deny_tags))
        parts.append("(i.sensitivity != 'high' OR i.key IN (SELECT value FROM json_each(:f_keys)))")
        params["f_keys"] = json.dumps(list(self.keys))
        return " AND ".join(parts), params


@dataclass(frozen=True)
class AggregateRow:
    """count of contributing items and, for a numeric field, their sum, min and max (None if none)."""

    count: int
    total: int | float | None = None
    minimum: int | float | None = None
    maximum: int | float | None = None


@dataclass(frozen=True)
class Atom:
    """One group of items that the same tags of an aggregate history select: ``pattern`` has bit j
    set for the j-th tag. ``h1``/``h2`` are keyed sums over the members (their row ids, and row ids
    with the field's value) that change when membership or a value changes; ``total`` is the sum
    of the members' values at the field (the aggregate is answered from the same pass)."""

    pattern: int
    count: int
    h1: int
    h2: int
    total: int | float = 0


# A prime below 2**31: every product in the keyed sums stays below 2**62 (SQLite integers).
HASH_PRIME = 2_147_483_647
MAX_FIELD_SEGMENTS = 16
_FIELD_SEGMENT = re.compile(r"[A-Za-z0-9_\-:@]{1,128}")


CURRENCY_MEMBER = "currency"  # the member of a value that names the currency of its amounts


def currency_path(path: str) -> str | None:
    """The JSON path of the ``currency`` member beside the number at ``path`` (``$."cost"`` ->
    ``$."currency"``, ``$."a"."b"`` -> ``$."a"."currency"``); None for the whole value or the
    currency member itself."""
    if path == "$" or not path.startswith("$."):
        return None
    head, _, last = path.rpartition(".")
    if last == f'"{CURRENCY_MEMBER}"':
        return None
    return f'{head}."{CURRENCY_MEMBER}"'


def json_path(field_path: str) -> str | None:
    """``value`` -> ``$``, ``value.a.b`` -> ``$."a"."b"``; None for a path this store will not address
    (a segment outside ``[A-Za-z0-9_-:@]``, an empty one, too many)."""
    parts = field_path.split(".")
    if not parts or parts[0] != "value":
        return None
    segments = parts[1:]
    if len(segments) > MAX_FIELD_SEGMENTS or not all(_FIELD_SEGMENT.fullmatch(p) for p in segments):
        return None
    return "$" + "".join(f'."{p}"' for p in segments)


# ============================================================================ the seam
# What the guard, the importer and the CLI need of a memory store. MemoryStore (SQLite, below) is the
# one implementation; tests/guard/test_seams.py is the behaviour any other must show. Every method may raise
# UompError STORE_UNAVAILABLE (or STORE_BUSY); bad items are INVALID_REQUEST.


class MemoryBulkWriting(Protocol):
    """Items streamed into ONE all-or-nothing write: nothing is visible before :meth:`commit`;
    leaving the ``with`` block without it (or with an exception) writes nothing."""

    written: int

    def __enter__(self) -> MemoryBulkWriting: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def add(self, item: MemoryItem) -> None:
        """Validate and queue one item (INVALID_REQUEST for a bad one, which is not queued)."""
        ...

    def existing(self, keys: Iterable[str]) -> dict[str, str]:
        """Those of ``keys`` in the store as this write sees it, each with its ``created_at``."""
        ...

    def commit(self) -> int:
        """Make everything added durable at once; how many items were written."""
        ...


class MemoryStorage(Protocol):
    """The memory store seam: items by key, pages and aggregates by tag under a grant's key rules
    (:class:`ReadFilter`), whole-item writes. Reads never return an item a filter excludes."""

    def get(self, key: str) -> MemoryItem | None: ...

    def get_meta(self, key: str) -> ItemMeta | None:
        """Tags and sensitivity only: a policy decision is made without reading the value."""
        ...

    def get_if(self, key: str, allow: Callable[[ItemMeta | None], bool]) -> tuple[ItemMeta | None, MemoryItem | None]:
        """:meth:`get_meta`, then :meth:`get` only when ``allow(meta)``: both from one state of the
        store. The value is never read for a refused (or missing) key."""
        ...

    def read_snapshot(self) -> contextlib.AbstractContextManager[None]:
        """Every read inside sees the same state."""
        ...

    def tag_page(
        self, tag: str, flt: ReadFilter, *, after: str | None, limit: int, max_bytes: int
    ) -> tuple[builtins.list[MemoryItem], bool]:
        """Items carrying ``tag`` that pass ``flt``, in key order after ``after``, at most ``limit``
        and about ``max_bytes`` (always at least one item); and whether more follow."""
        ...

    def aggregate(self, tag: str, flt: ReadFilter, *, path: str | None) -> AggregateRow: ...

    def currencies(self, tag: str, flt: ReadFilter, *, path: str) -> int:
        """How many currencies the numbers at ``path`` of the items carrying ``tag`` (through
        ``flt``) are in: the distinct values of the ``currency`` member beside ``path`` among the
        items holding a number there, an item without one counting as one more when others have
        one. 0 when none of them names a currency (see :func:`currency_path`)."""
        ...

    def atoms(
        self, tags: Sequence[str], flt: ReadFilter, *, path: str, keys: tuple[int, int, int, int], max_atoms: int
    ) -> builtins.list[Atom] | None: ...

    def list(self, *, tag: str | None = None, limit: int = 100, offset: int = 0) -> builtins.list[MemoryItem]: ...

    def count(self) -> int: ...

    def put(self, item: MemoryItem, *, replace: bool = False) -> None:
        """An existing key is INVALID_REQUEST unless ``replace``."""
        ...

    def put_many(self, items: Sequence[MemoryItem], *, replace: bool = False) -> int:
        """All of ``items`` or none."""
        ...

    def bulk_writer(self, *, replace: bool = False, dry_run: bool = False) -> MemoryBulkWriting: ...

    def delete(self, key: str) -> bool:
        """False when there was no such item."""
        ...

    def seal_text(self, key: str, sensitivity: str, text: str) -> str:
        """The text to store for an item's encoded value (high values sealed per item, see
        gateway/atrest/itemseal.py), for the modules that write ``items`` / ``item_versions`` rows
        themselves."""
        ...

    def open_text(self, key: str, sensitivity: str, text: str) -> str:
        """The encoded value behind a stored text, for a read the caller has authorized."""
        ...

    def reading(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """The store's connection for the tables kept beside the items in the same file (item
        versions and their retention, proposals: gateway/guard/history.py, proposals.py), reads."""
        ...

    def writing(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One all-or-nothing transaction on that connection: an item change, the version it
        replaced (kept by the store in the same transaction, whoever writes) and a proposal's
        decision commit together or not at all."""
        ...

    def close(self) -> None: ...
