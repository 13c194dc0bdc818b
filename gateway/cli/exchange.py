"""``uomp export`` and the envelope / adapter side of ``uomp import`` (docs/writes.md, "Export").

``uomp export --out FILE`` writes the whole store (items, versions, history) as one JSON document
(:mod:`gateway.guard.exchange`), 0600, atomically; ``--out -`` writes it to stdout. ``uomp import
FILE`` restores such a document (recognised by its schema) losslessly; ``uomp import FILE --adapter
mem0|claude-md|dsh-export`` converts another store's export (:mod:`gateway.guard.adapters`). Either
way every item is validated first and everything is written in one transaction, or nothing. The
import is one user event (``memory_imported``, counts only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.cli import userlog
from gateway.cli.main import paths_from
from gateway.errors import ErrorCode, UompError
from gateway.guard import exchange
from gateway.guard.adapters import ADAPTERS
from gateway.guard.stores import open_user_store

ADAPTER_CHOICES = ("uomp-export", *ADAPTERS)


def wants_envelope(args: argparse.Namespace) -> bool:
    """Whether ``uomp import`` hands this file to the envelope/adapter path."""
    adapter = getattr(args, "adapter", None)
    return adapter is not None or exchange.looks_like_export(Path(args.file))


def import_file(args: argparse.Namespace) -> int:
    """``uomp import FILE`` of our export envelope or through an ``--adapter``: all or nothing."""
    paths = paths_from(args)
    path = Path(args.file)
    adapter = args.adapter or "uomp-export"
    if args.dry_run and adapter == "uomp-export":
        exchange.parse_envelope(exchange.read_bounded(path))
        print(f"dry run: {path.name} is a valid uomp export; nothing was written")
        return 0
    data = exchange.read_bounded(path)
    with open_user_store(paths) as store:
        if adapter == "uomp-export":
            entries = exchange.parse_envelope(data)
            with userlog.change(paths) as event:
                written, replaced = exchange.restore(store, entries, replace=args.replace)
                event.action, event.count = "memory_imported", written
                event.detail = "format uomp-export"
                event.reason = f"the user restored {written} items from an export ({replaced} replaced)"
        else:
            items = exchange.adapt(adapter, data, sensitivity=args.sensitivity or "medium")
            if args.dry_run:
                print(f"dry run: {len(items)} items from {path.name} ({adapter}) are valid; nothing was written")
                return 0
            with userlog.change(paths) as event:
                written, replaced = exchange.write_items(store, items, replace=args.replace)
                event.action, event.count = "memory_imported", written
                event.detail = f"format {adapter}"
                event.reason = f"the user imported {written} items with the {adapter} adapter ({replaced} replaced)"
    print(f"imported {written} items from {path.name}" + (f" ({replaced} replaced)" if replaced else ""))
    return 0


def _export(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    with open_user_store(paths) as store:
        if args.out == "-":
            n = exchange.write_export(store, sys.stdout)
            print(f"exported {n} items", file=sys.stderr)
            return 0
        out = Path(args.out)
        if out.exists() and not args.force:
            raise UompError(ErrorCode.IO_ERROR, f"{out} exists; pass --force to replace it")
        n = exchange.export_file(store, out)
    print(f"exported {n} items to {out} (mode 0600: it holds every value)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp export``."""
    e = sub.add_parser(
        "export",
        help="write the whole memory store (items, versions, history) as one JSON document",
        description="A backup or migration: 'uomp import FILE' restores it losslessly.",
    )
    e.add_argument("--out", required=True, metavar="FILE", help="where to write it ('-': stdout)")
    e.add_argument("--force", action="store_true", help="replace FILE if it exists")
    e.set_defaults(func=_export)
