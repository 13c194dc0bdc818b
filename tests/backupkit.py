"""Test helpers for ``uomp backup`` (gateway/atrest/backup.py): a home with a marked item, fresh
restore targets, and the seven kinds of damage every reader of a backup must refuse."""

from __future__ import annotations

from pathlib import Path

from shortdir import short_dir

from gateway.atrest import backup, memdb
from gateway.config import Paths
from gateway.errors import ErrorCode
from gateway.guard.store import MemoryItem, MemoryStore

TS = "2026-01-01T00:00:00Z"
MARKED_KEY = "note.secret"
DAMAGES = ["flip_middle", "flip_last", "truncate", "drop_last_chunk", "trailing", "foreign", "header"]


def new_home() -> Path:
    """A restore target that does not exist yet, in a fresh directory of its own (short path)."""
    return short_dir("uomp-bk-") / "home"


def put_marked(paths: Paths, mark: str) -> Paths:
    """``paths`` with one more item, :data:`MARKED_KEY` = ``mark`` (low, tag ``preference``), in
    its store as the home opens it (SQLCipher in a sealed home)."""
    with MemoryStore(paths.memory_db, key=memdb.key_for(paths)) as store:
        store.put(MemoryItem(MARKED_KEY, mark, ("preference",), "low", "user", TS, TS))
    return paths


def marked_value(paths: Paths, key: str = MARKED_KEY) -> object:
    """The value of ``key`` (:data:`MARKED_KEY`) in the (restored) home's store, as the home opens it."""
    with MemoryStore(paths.memory_db, key=memdb.key_for(paths), create=False) as store:
        item = store.get(key)
    assert item is not None
    return item.value


def damaged(data: bytes, damage: str) -> bytes:
    """``data`` (a whole backup file) with one of :data:`DAMAGES`."""
    b = bytearray(data)
    if damage == "flip_middle":
        b[len(b) // 2] ^= 1
    elif damage == "flip_last":
        b[-1] ^= 1
    elif damage == "truncate":
        del b[len(b) * 2 // 3 :]
    elif damage == "drop_last_chunk":
        # the chunks are [len][ct]; walk them and drop the last one: a clean cut between chunks
        header_end = b.index(b"\n", len(backup.MAGIC)) + 1
        pos, last = header_end, header_end
        while pos < len(b):
            last = pos
            pos += 4 + int.from_bytes(b[pos : pos + 4], "big")
        del b[last:]
    elif damage == "trailing":
        b += b"\x00"
    elif damage == "foreign":
        b = bytearray(b"PK\x03\x04 not ours" * 10)
    elif damage == "header":
        b[len(backup.MAGIC) + 5] ^= 1
    else:
        raise ValueError(damage)
    return bytes(b)


def refusals(damage: str) -> set[ErrorCode]:
    """The codes a reader may answer ``damage`` with (a changed header may read as a wrong
    passphrase: its check value no longer matches)."""
    if damage == "header":
        return {ErrorCode.BACKUP_INVALID, ErrorCode.PASSPHRASE_WRONG}
    return {ErrorCode.BACKUP_INVALID}


def no_restore_stage(target: Path) -> bool:
    """No ``<home>.restore-*`` stage left beside ``target``."""
    return not [p for p in target.parent.iterdir() if ".restore-" in p.name]
