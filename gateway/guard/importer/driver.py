"""The import driver: reads the file, builds records, and streams the valid ones into ONE store
transaction (:meth:`MemoryStore.bulk_writer`), committed only when no row was bad.

:func:`import_file` is the entry point (documented in :mod:`gateway.guard.importer`). Progress is
reported through a callback (``progress(done_bytes, total_bytes)``); drawing it is the CLI's job.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import hmac
import secrets
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

from gateway.errors import ErrorCode, UompError
from gateway.guard.bulk import BULK_CHUNK, BulkWriter
from gateway.guard.importer.mapping import TIMESTAMP_FIELDS, Rec
from gateway.guard.importer.readers import (
    JsonElements,
    Progress,
    ProgressCallback,
    Source,
    csv_records,
    pick_delimiter,
    pick_format,
)
from gateway.guard.importer.records import RecordBuilder
from gateway.guard.importer.report import Errors, FileError, ImportLimits, ImportReport, MultiFileError, Notices
from gateway.guard.items import MemoryItem, utc_now
from gateway.guard.store import MemoryStore

PROGRESS_MIN_BYTES = 1024 * 1024  # the CLI shows a bar on a terminal only for files at least this big


class _KeyIndex:
    """The keys seen so far in the file, each with the row that first gave it, for the duplicate-key
    check. Kept in a private temporary SQLite database (``sqlite3.connect("")``: an unnamed file in
    the temporary directory, unlinked by SQLite when opened and gone on close; page cache bounded,
    no journal, no fsync), so memory does not grow with the number of rows. Not even the keys go
    there: only an HMAC-SHA-256 of each key under a random per-import secret that never leaves
    memory, so pages that reach the temporary file reveal nothing about the user's keys."""

    CACHE_KIB = 2048

    def __init__(self) -> None:
        try:
            self.conn = sqlite3.connect("", isolation_level=None)
            self.conn.execute("PRAGMA journal_mode = OFF")
            self.conn.execute("PRAGMA synchronous = OFF")
            self.conn.execute(f"PRAGMA cache_size = -{self.CACHE_KIB}")
            self.conn.execute("CREATE TABLE seen (key BLOB NOT NULL PRIMARY KEY, row INTEGER NOT NULL) WITHOUT ROWID")
            self._secret = secrets.token_bytes(32)
            self.conn.execute("BEGIN")  # one transaction for the whole file
        except sqlite3.Error as exc:
            raise self._failed(exc) from exc

    @staticmethod
    def _failed(exc: sqlite3.Error) -> UompError:
        name = str(getattr(exc, "sqlite_errorname", "") or type(exc).__name__)
        return UompError(
            ErrorCode.INTERNAL,
            "the import's temporary key index failed (is the temporary directory full or not writable?)",
            details={"reason": name},
        )

    def claim(self, key: str, row: int) -> int | None:
        """Record that ``row`` gives ``key``; None if no earlier row did, else that row."""
        digest = hmac.new(self._secret, key.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
        try:
            cur = self.conn.execute(
                "INSERT INTO seen (key, row) VALUES (?, ?) ON CONFLICT (key) DO NOTHING", (digest, row)
            )
            if cur.rowcount == 1:
                return None
            found = self.conn.execute("SELECT row FROM seen WHERE key = ?", (digest,)).fetchone()
        except sqlite3.Error as exc:
            raise self._failed(exc) from exc
        return int(found[0])

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.conn.close()


class _Importer(RecordBuilder):
    """The record builder plus the write side: the queue of valid rows and the store's bulk writer."""

    def __init__(
        self,
        *,
        mappings: dict[str, str] | None,
        extra_tags: Sequence[str],
        sensitivity: str | None,
        replace: bool,
        date_order: str | None,
        keep_text: Sequence[str],
        limits: ImportLimits,
        json_rows: bool,
        keys: _KeyIndex,
        open_writer: Callable[[], BulkWriter],
    ) -> None:
        super().__init__(
            mappings=mappings,
            extra_tags=extra_tags,
            sensitivity=sensitivity,
            date_order=date_order,
            keep_text=keep_text,
            limits=limits,
            json_rows=json_rows,
            claim=keys.claim,
        )
        self.replace = replace
        self.now = utc_now()
        self.open_writer = open_writer
        self.writer: BulkWriter | None = None  # opened when the first chunk of rows is ready
        self.pending: list[Rec] = []  # valid rows not yet checked against the store and written
        self.late_notices = Notices()  # defaults decided when writing: announced after the others
        self.rows = 0
        self.valid = 0
        self.replaced = 0

    # ------------------------------------------------------------------ writing

    def add_record(self, rec: Rec) -> None:
        """The row has been read: queue it for writing if it had no error."""
        if self.rows >= self.limits.max_rows:
            raise FileError(f"the file has more than {self.limits.max_rows} rows")
        self.rows += 1
        if self.errors.total == rec.mark:
            self.pending.append(rec)
            if len(self.pending) >= BULK_CHUNK:
                self.flush_pending()

    def flush_pending(self) -> None:
        """Check the queued rows' keys against the store (inside the import transaction), then hand
        them to the bulk writer, unless some row was bad: then only check, write nothing more."""
        if not self.pending:
            return
        if self.writer is None:
            self.writer = self.open_writer()
        pending, self.pending = self.pending, []
        existing = self.writer.existing(r.key for r in pending)
        for r in pending:
            old_created = existing.get(r.key)
            if old_created is not None:
                if not self.replace:
                    self.errors.add(
                        r.row, "key", "an item with this key is already in the store (--replace overwrites it)"
                    )
                    continue
                self.replaced += 1
            self.valid += 1
            if self.errors.total:
                continue  # the import will be refused: keep checking, stop writing
            self.writer.add(self.item_of(r, old_created))

    def item_of(self, r: Rec, old_created: str | None) -> MemoryItem:
        """The Memory Item for a valid row, with its timestamps defaulted (and announced)."""
        updated = r.updated_at
        if updated is None:
            updated = self.now
            self.late_notices.add("updated_at", "ts_default_now")
        created = r.created_at
        if created is None:
            if old_created is not None:
                created = old_created
                self.late_notices.add("created_at", "ts_kept_existing")
            elif r.updated_at is not None:
                created = r.updated_at
                self.late_notices.add("created_at", "ts_default_updated")
            else:
                created = self.now
                self.late_notices.add("created_at", "ts_default_now")
        return MemoryItem(
            key=r.key,
            value=r.value,
            tags=tuple(r.tags),
            sensitivity=r.sensitivity,
            source=r.source,
            created_at=created,
            updated_at=updated,
            description=r.description,
        )

    # ------------------------------------------------------------------ reading

    def read_csv(self, src: Source, delimiter: str, progress: Progress) -> None:
        # Pass 1: header and per-column profile (leading zeros, day/month evidence).
        records = csv_records(src, delimiter, progress)
        first = next(records, None)
        if first is None:
            raise FileError("the file is empty (no header row)")
        header_line, header = first
        columns = self.csv_header(header, header_line)
        profiled = [(i, c) for i, c in enumerate(columns) if isinstance(c.dest, tuple) or c.dest in TIMESTAMP_FIELDS]
        for row, cells in records:
            self.csv_profile(profiled, cells, row)
        self.csv_settle_dates(columns, header_line)
        # Pass 2: build the records and stream the valid ones into the import transaction.
        src.rewind()
        blank = [0]
        records = csv_records(src, delimiter, progress, blank)
        next(records, None)  # the header again
        for row, cells in records:
            rec = self.csv_row(columns, cells, row)
            if rec is not None:
                self.add_record(rec)
        if blank[0]:
            self.notices.plain.append(f"skipped {blank[0]} blank line{'' if blank[0] == 1 else 's'}")

    def read_json(self, src: Source, progress: Progress) -> None:
        for index, obj, flags in JsonElements(src, progress):
            rec = self.json_item(obj, index, flags)
            if rec is not None:
                self.add_record(rec)
        for src_name in self.mappings:
            if src_name not in self.mapped_seen:
                self.notices.plain.append(f"--map {src_name}: no item has this field")

    # ------------------------------------------------------------------ finishing

    def finish(self, dry_run: bool) -> int:
        """After the last row: check the last chunk, refuse the import if any row was bad (the
        transaction is then rolled back by the caller), else commit. Returns how many were written."""
        self.flush_pending()
        self.errors.raise_if_any()
        self.notices.merge(self.late_notices)
        if dry_run or self.writer is None:
            return 0
        return self.writer.commit()


def import_file(
    store: MemoryStore,
    path: Path,
    *,
    fmt: str | None = None,
    delimiter: str | None = None,
    mappings: dict[str, str] | None = None,
    extra_tags: Sequence[str] = (),
    sensitivity: str | None = None,
    replace: bool = False,
    dry_run: bool = False,
    progress: ProgressCallback | None = None,
    date_order: str | None = None,
    keep_text: Sequence[str] = (),
    limits: ImportLimits | None = None,
) -> ImportReport:
    """Validate the whole file while streaming its rows into one transaction, committed only if every
    row is valid (see the module docstring).

    Raises ``UompError(ErrorCode.IMPORT_INVALID)`` listing every bad row (nothing written),
    ``INVALID_REQUEST`` for bad options or an unreadable file, ``STORE_UNAVAILABLE`` from the store.
    ``progress(done_bytes, total_bytes)``, when given, is called once with 0 as reading starts and
    after every read (CSV is read twice, so ``total_bytes`` is twice the file's size).
    """
    path = Path(path)
    limits = limits or ImportLimits()
    kind = pick_format(path, fmt)
    if kind == "json" and delimiter is not None:
        raise UompError(ErrorCode.INVALID_REQUEST, "--delimiter applies to CSV files only")
    delim = pick_delimiter(path, delimiter) if kind == "csv" else ","
    with contextlib.ExitStack() as stack:  # closed in reverse: the transaction is rolled back first

        def open_writer() -> BulkWriter:
            return stack.enter_context(store.bulk_writer(replace=replace, dry_run=dry_run))

        keys = _KeyIndex()
        stack.callback(keys.close)
        imp = _Importer(
            mappings=mappings,
            extra_tags=extra_tags,
            sensitivity=sensitivity,
            replace=replace,
            date_order=date_order,
            keep_text=keep_text,
            limits=limits,
            json_rows=kind == "json",
            keys=keys,
            open_writer=open_writer,
        )
        src = Source(path, limits)
        stack.callback(src.close)
        old_limit = csv.field_size_limit()
        csv.field_size_limit(max(old_limit, limits.max_value_bytes))
        stack.callback(csv.field_size_limit, old_limit)
        bar = Progress(src.size * (2 if kind == "csv" else 1), progress)
        try:
            try:
                if kind == "csv":
                    imp.read_csv(src, delim, bar)
                else:
                    imp.read_json(src, bar)
            finally:
                bar.end()
        except (FileError, MultiFileError) as exc:
            problems = exc.problems if isinstance(exc, MultiFileError) else [exc]
            err = Errors(1, kind == "json").error(problems)
            assert err is not None
            raise err from None
        if imp.extra_tags:
            imp.notices.plain.append(f"tags: added {', '.join(imp.extra_tags)} (--tag) to every row")
        written = imp.finish(dry_run)
    return ImportReport(
        rows_written=written,
        notices=imp.notices.render(),
        rows_valid=imp.valid,
        replaced=imp.replaced,
        dry_run=dry_run,
        format=kind,
    )
