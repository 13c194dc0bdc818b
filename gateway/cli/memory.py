"""``uomp memory add|get|list|rm`` and ``uomp import``: the user's own view of the Memory Store.

These commands open ``$UOMP_HOME/memory.db`` directly (SQLite WAL lets them run next to a live
guard). ``uomp init`` also creates the store (:func:`gateway.cli.initsteps.init_store`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from gateway.cli import exchange, history, userlog
from gateway.cli.main import paths_from
from gateway.errors import ErrorCode, UompError
from gateway.guard import history as item_history
from gateway.guard.importer import DATE_ORDERS, PROGRESS_MIN_BYTES, import_file
from gateway.guard.items import SENSITIVITIES, MemoryItem, utc_now
from gateway.guard.store import MemoryStore
from gateway.guard.stores import open_user_store

LIST_DEFAULT_LIMIT = 100


def _open_store(args: argparse.Namespace) -> MemoryStore:
    """The store, with the history retention of ``[guard] history_max_versions`` applied."""
    return open_user_store(paths_from(args))


def _parse_value(text: str) -> Any:
    def no_constants(name: str) -> Any:
        raise ValueError(name)

    try:
        return json.loads(text, parse_constant=no_constants)
    except ValueError as exc:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            "--value must be JSON: quote text as '\"dark\"', numbers as 42, objects as '{\"a\": 1}'",
        ) from exc


def _add(args: argparse.Namespace) -> int:
    value = _parse_value(args.value)
    tags: list[str] = []
    for tag in args.tags:
        if tag not in tags:
            tags.append(tag)
    with _open_store(args) as store, userlog.change(paths_from(args)) as event:
        existing = store.get(args.key)
        if existing is not None and not args.replace:
            raise UompError(
                ErrorCode.INVALID_REQUEST, "an item with this key already exists; pass --replace to overwrite it"
            )
        now = utc_now()
        item = MemoryItem(
            key=args.key,
            value=value,
            tags=tuple(tags),
            sensitivity=args.sensitivity,
            source="user",
            created_at=existing.created_at if existing else now,
            updated_at=now,
            description=args.description,
        )
        store.put(item, replace=args.replace)
        event.action, event.key = ("memory_replaced" if existing else "memory_added"), args.key
        event.reason = "the user replaced a memory item" if existing else "the user added a memory item"
    print(f"{'replaced' if existing else 'added'} {args.key}")
    return 0


def _get(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        item = store.get(args.key)
    if item is None:
        raise UompError(ErrorCode.INVALID_REQUEST, "no memory item has this key")
    print(json.dumps(item.to_dict(), indent=2, ensure_ascii=False))
    return 0


def _list(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        items = store.list(tag=args.tag, limit=args.limit, offset=args.offset)
        total = store.count()
    if args.json:
        print(json.dumps([it.to_dict() for it in items], indent=2, ensure_ascii=False))
        return 0
    width = min(40, max([len("KEY"), *(len(it.key) for it in items)]))
    print(f"{'KEY':<{width}}  {'SENSITIVITY':<11}  {'SOURCE':<6}  {'UPDATED':<20}  TAGS")
    for it in items:
        tags = ", ".join(it.tags)
        print(f"{it.key:<{width}}  {it.sensitivity:<11}  {it.source:<6}  {it.updated_at:<20}  {tags}")
    scope = f" with tag {args.tag}" if args.tag is not None else ""
    print(f"{len(items)} item{'' if len(items) == 1 else 's'}{scope} shown; {total} in the store")
    return 0


def _rm(args: argparse.Namespace) -> int:
    with _open_store(args) as store, userlog.change(paths_from(args)) as event:
        if args.purge:
            existed = store.get_meta(args.key) is not None
            dropped = item_history.purge(store, args.key)
            if not existed and not dropped:
                raise UompError(ErrorCode.INVALID_REQUEST, "no memory item or history has this key")
            event.action, event.key = "memory_purged", args.key
            event.reason = "the user deleted a memory item and every kept version of it"
        else:
            if not store.delete(args.key):
                raise UompError(ErrorCode.INVALID_REQUEST, "no memory item has this key")
            event.action, event.reason, event.key = "memory_deleted", "the user deleted a memory item", args.key
    print(
        f"{'purged' if args.purge else 'deleted'} {args.key}"
        + ("" if args.purge else " (its history is kept: --purge removes it)")
    )
    return 0


def _mappings(raw: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in raw or []:
        src, sep, dst = entry.rpartition("=")
        if not sep or not src.strip() or not dst.strip():
            raise UompError(ErrorCode.INVALID_REQUEST, "--map takes SRC=DST, e.g. --map amount=value.amount")
        if src.strip() in out:
            raise UompError(ErrorCode.INVALID_REQUEST, f"--map {src.strip()} is given twice")
        out[src.strip()] = dst.strip()
    return out


class ProgressBar:
    """The import's progress bar on a terminal: a callback for ``import_file(progress=...)``.

    Redrawn at most every :attr:`INTERVAL` seconds; drawn once more at 100 % and ended with a new
    line when the importer reports the end of reading (``done == total``).
    """

    WIDTH = 30
    INTERVAL = 0.1

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream
        self.last = 0.0
        self.ended = False

    def __call__(self, done: int, total: int) -> None:
        if self.ended:
            return
        if done >= total:
            self.ended = True
            self._draw(total, total)
            (self.stream or sys.stderr).write("\n")
            return
        now = time.monotonic()
        if now - self.last >= self.INTERVAL:
            self.last = now
            self._draw(done, total)

    def _draw(self, done: int, total: int) -> None:
        stream = self.stream or sys.stderr
        frac = min(1.0, done / total)
        filled = int(frac * self.WIDTH)
        mib = 1024 * 1024
        stream.write(
            f"\rimport [{'#' * filled}{'.' * (self.WIDTH - filled)}] {int(frac * 100):3d}% "
            f"{done / mib:.1f}/{total / mib:.1f} MiB"
        )
        stream.flush()


def _import(args: argparse.Namespace) -> int:
    if exchange.wants_envelope(args):
        return exchange.import_file(args)
    path = Path(args.file)
    progress = args.progress
    if not progress and sys.stderr.isatty():
        try:
            progress = path.stat().st_size >= PROGRESS_MIN_BYTES
        except OSError:
            progress = False
    # a dry run changes nothing: it needs no audit log (and records nothing)
    recorded = contextlib.nullcontext(userlog.UserEvent()) if args.dry_run else userlog.change(paths_from(args))
    with _open_store(args) as store, recorded as event:
        report = import_file(
            store,
            path,
            fmt=args.format,
            delimiter=args.delimiter,
            mappings=_mappings(args.map),
            extra_tags=args.tags or (),
            sensitivity=args.sensitivity,
            replace=args.replace,
            dry_run=args.dry_run,
            progress=ProgressBar() if progress else None,
            date_order=args.date_order,
            keep_text=args.keep_text or (),
        )
        if not report.dry_run:
            event.action, event.count = "memory_imported", report.rows_written
            event.detail = f"format {path.suffix[1:]}"
            event.reason = f"the user imported {report.rows_written} items ({report.replaced} replaced)"
    for notice in report.notices:
        print(f"note: {notice}")
    replaced = f" ({report.replaced} replaced)" if report.replaced else ""
    if report.dry_run:
        would = f" ({report.replaced} would be replaced)" if report.replaced else ""
        print(f"dry run: {report.rows_valid} items from {path.name} are valid{would}; nothing was written")
    else:
        print(f"imported {report.rows_written} items from {path.name}{replaced}")
    return 0


_IMPORT_EPILOG = """\
Fields (spec §12): key (aliases id, item_id, record_id), tags (tag), sensitivity (level),
source (origin), description (desc), created_at (created), updated_at (updated). CSV columns
value.a.b build a nested value; every other CSV column becomes a field of the value. JSON: one
object or an array of objects; "value" is the value, otherwise every non-reserved field is.

Nothing is written unless every row is valid: all rows go in one transaction. Every bad row
is listed with its CSV line number (or JSON array index). Cleaning of CSV value cells is
announced: "$1,234.50" -> 1234.5, "12,000" -> 12000, "Jan 5 2026" -> "2026-01-05",
blank cells left out. Leading-zero values (00123), numbers over 15 digits and columns named
like identifiers (id, phone, zip, ..._number) stay text. DD/MM vs MM/DD is read from the
column (a day over 12 settles it) or from --date-order.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp memory`` and ``uomp import`` to the command line."""
    m = sub.add_parser(
        "memory",
        help="add, show, list and delete Memory Items; their history and rollback",
        description="Manage the Memory Items in $UOMP_HOME/memory.db directly.",
    )
    msub = m.add_subparsers(dest="memory_command", metavar="ACTION", required=True)

    a = msub.add_parser(
        "add",
        help="add one Memory Item",
        description="Add one Memory Item (source: user). An existing key is refused "
        "unless --replace, which keeps the item's created_at.",
    )
    a.add_argument("key", metavar="KEY", help="the item key, e.g. preference.theme")
    a.add_argument(
        "--value",
        required=True,
        metavar="JSON",
        help="the value as JSON: '\"dark\"' (text needs the inner quotes), 42, '{\"a\": 1}'",
    )
    a.add_argument(
        "--tag",
        dest="tags",
        action="append",
        required=True,
        metavar="TAG",
        help="a tag (repeat for more; at least one)",
    )
    a.add_argument(
        "--sensitivity",
        required=True,
        choices=SENSITIVITIES,
        help="low, medium or high (high items can be granted by key only, never by tag)",
    )
    a.add_argument("--description", help="a human-readable description")
    a.add_argument("--replace", action="store_true", help="overwrite an existing item with this key")
    a.set_defaults(func=_add)

    g = msub.add_parser(
        "get",
        aliases=["show"],
        help="print one Memory Item as JSON",
        description="Print one Memory Item (spec §11.1 JSON), value included.",
    )
    g.add_argument("key", metavar="KEY")
    g.set_defaults(func=_get)

    ls = msub.add_parser(
        "list",
        help="list Memory Items (keys, tags, sensitivity; no values)",
        description="List Memory Items ordered by key. Values are shown only with --json.",
    )
    ls.add_argument("--tag", help="only items with this tag")
    ls.add_argument(
        "--limit", type=int, default=LIST_DEFAULT_LIMIT, help=f"at most this many items (default {LIST_DEFAULT_LIMIT})"
    )
    ls.add_argument("--offset", type=int, default=0, help="skip this many items first (default 0)")
    ls.add_argument("--json", action="store_true", help="print the full items, values included, as JSON")
    ls.set_defaults(func=_list)

    r = msub.add_parser(
        "rm",
        help="delete one Memory Item",
        description="Delete one Memory Item. Its last version stays in its history ('uomp memory history', "
        "rollback); --purge removes the item and every kept version (their bytes are overwritten in the file).",
    )
    r.add_argument("key", metavar="KEY")
    r.add_argument("--purge", action="store_true", help="also remove every kept version of the item")
    r.set_defaults(func=_rm)
    history.register_memory(msub)

    i = sub.add_parser(
        "import",
        help="import Memory Items from a CSV or JSON file (spec §12), an export, or another store's (--adapter)",
        description="Import Memory Items from a CSV or JSON file into $UOMP_HOME/memory.db.",
        epilog=_IMPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    i.add_argument("file", metavar="FILE", help="the CSV (UTF-8, header row) or JSON file")
    i.add_argument(
        "--format", choices=("csv", "json"), help="file format (default: from the extension .csv/.tsv/.txt or .json)"
    )
    i.add_argument(
        "--delimiter", metavar="D", help="CSV delimiter: one character, or 'tab' (default ',', tab for .tsv)"
    )
    i.add_argument(
        "--map",
        action="append",
        metavar="SRC=DST",
        help="put column/field SRC into DST: a reserved field (key, tags, sensitivity, source, "
        "description, created_at, updated_at), value or value.a.b (repeatable)",
    )
    i.add_argument("--tag", dest="tags", action="append", metavar="TAG", help="add this tag to every item (repeatable)")
    i.add_argument(
        "--sensitivity",
        choices=SENSITIVITIES,
        help="sensitivity for rows that have none; without it such rows are refused",
    )
    i.add_argument(
        "--replace", action="store_true", help="overwrite items whose key is already in the store (default: refuse)"
    )
    i.add_argument("--dry-run", action="store_true", help="validate and report, write nothing")
    i.add_argument(
        "--adapter",
        choices=exchange.ADAPTER_CHOICES,
        help="the file is another store's export: uomp-export (from 'uomp export', also recognised "
        "without this), mem0, claude-md (CLAUDE.md / memory files), dsh-export (memory-export-v1)",
    )
    i.add_argument(
        "--date-order",
        choices=DATE_ORDERS,
        help="read A/B/YYYY dates as day-first (dmy) or month-first (mdy); default: decided "
        "per column, ambiguous ones kept as text",
    )
    i.add_argument(
        "--keep-text",
        action="append",
        metavar="COLUMN",
        help="never convert this CSV column to numbers or dates (repeatable)",
    )
    i.add_argument(
        "--progress",
        action="store_true",
        help="always draw a progress bar on stderr (default: only on a terminal, for files "
        f"of {PROGRESS_MIN_BYTES // (1024 * 1024)} MiB or more)",
    )
    i.set_defaults(func=_import)
