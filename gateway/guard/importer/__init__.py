"""Import Memory Items from CSV or JSON files (spec §12).

Entry point: :func:`import_file` (in :mod:`.driver`). Nothing is written unless every row is valid: the rows stream into
ONE SQLite transaction (:meth:`MemoryStore.bulk_writer`) that is committed only after the last row
has been read and no row was bad, so an import that fails or is killed half-way leaves the store
exactly as it was. Memory does not grow with the number of rows (see "Memory" below).

Input
-----
* CSV: UTF-8 (a leading byte-order mark is ignored), the first non-blank row is the header,
  delimiter ``,`` by default (``\\t`` for ``.tsv`` files; any single character with ``delimiter``,
  ``"tab"`` also accepted), fields containing the delimiter, quotes or new lines in double
  quotes. Blank lines and rows whose cells are all empty are skipped (and counted in a notice).
* JSON: one object or an array of objects, read incrementally (one array element at a time).

Fields (§12.6, §12.7)
---------------------
Header names / top-level JSON fields are matched case-insensitively against the reserved fields
``key tags sensitivity source description created_at updated_at`` and their aliases (``id``,
``item_id``, ``record_id``; ``tag``; ``level``; ``origin``; ``desc``; ``created``; ``updated``).
``mappings`` (``--map SRC=DST``) come first: SRC is an exact header / field name, DST a reserved
field, ``value`` or ``value.a.b``. ``value.a.b`` names build a nested value. In CSV every other
column becomes a field of the value object (a column named ``value`` is the whole value). In JSON
a ``value`` field is the value; without one, every non-reserved top-level field is a field of the
value object; an object with a ``value`` and other unmapped fields is refused (nothing is dropped
silently). Two names that land on the same field, or a field and one nested under it, are refused.

tags: a JSON list, or a string split on ``,`` ``;`` ``|``; pieces are trimmed, empty pieces
dropped, repeats removed; ``extra_tags`` are added to every row. A row must end up with a tag.
sensitivity: required (§12.8). ``sensitivity=`` fills rows that have none (announced); with no
sensitivity column and no default the whole import is refused. Case is folded (announced).
source defaults to ``user``. Keys are trimmed (announced); JSON integer keys become text
(announced). Key uniqueness is checked across the whole store, not per tag (the store's key is
its primary key), which is stricter than §12.9 asks.

Timestamps
----------
created_at / updated_at must be ISO 8601 or one of the date formats below; they are stored as UTC
``YYYY-MM-DDTHH:MM:SSZ``. A date alone means midnight UTC, a time without a zone is read as UTC;
both are announced. Missing updated_at = the import time; missing created_at = the existing
item's created_at when replacing it, else updated_at.

Cleaning of CSV value cells (JSON values are typed already and are never changed)
---------------------------------------------------------------------------------
Each kind of change is counted per field and announced in ``ImportReport.notices``.

* Blank cells (empty or only spaces) are left out of the value object.
* Numbers: ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?`` becomes a JSON number. Thousands separators are
  removed only in the exact ``1,234,567.89`` grouping (comma groups of three); a currency symbol
  ``$ € £ ¥`` before or after the number is removed (one symbol, optional single space). Anything
  else stays text: leading zeros (``00123``, ``0123``), ``+`` signs, exponents (``1e5``), ``.5``,
  percentages, spaces or dots as group separators (``1.234,50``), and numbers of more than 15
  digits (beyond exact double precision: card and account numbers).
* A column keeps ALL its cells as text (no number or date conversion, announced) when any cell has
  a leading zero (zip codes: ``02134`` and ``90210`` stay alike) or is a number of more than 15
  digits (card and account numbers), when its name looks like an
  identifier (last word ``id``, ``uuid``, ``phone``, ``tel``, ``mobile``, ``fax``, ``zip``,
  ``postcode``, ``postal``, ``sku``, ``iban``, ``ssn``, ``pin``, ``isbn``, ``ean``, ``upc``,
  ``code``, or ``<anything> number|no|num|nr`` such as ``phone_number``), or when it is named in
  ``keep_text`` (``--keep-text``).
* Dates become ISO 8601 (``2026-01-05``, or ``2026-01-05T14:30:00`` with a time, no zone invented)
  from: ``YYYY/MM/DD``, ``YYYY.MM.DD``, ``YYYY-M-D``; ``Jan 5 2026``, ``Jan 5, 2026``,
  ``January 5th, 2026``, ``5 Jan 2026``, ``05-Jan-2026`` (English month names); and
  ``A/B/YYYY`` (also ``.`` or ``-``), each optionally followed by `` HH:MM[:SS]``. Text already in
  ISO 8601 is left alone. Two-digit years are never guessed.
  ``A/B/YYYY`` is day-first or month-first by these rules: ``date_order`` (``--date-order dmy|mdy``)
  decides when given; otherwise the column decides: a first pass over the file collects every
  cell with A > 12 (day-first evidence) or B > 12 (month-first evidence). One kind of evidence
  settles the whole column; both kinds refuse the import; none leaves ambiguous cells (A, B <= 12,
  A != B) as text in values (announced) and makes them an error in created_at / updated_at.
  Something shaped like a date that is not a real date (``31/02/2026``) stays text (announced).

Validation (§12.9): every row is checked and every bad row is reported with its number (CSV: the
file line the record starts on; JSON: the 0-based array index) in
``UompError(ErrorCode.IMPORT_INVALID, ...).details`` = ``{"errors": [{"row", "field", "message"}],
"lines": ["row 3: key is empty", ...]}`` (the first :attr:`ImportLimits.max_reported_errors`).
Messages name fields and rows, never the values in them.

Memory and the transaction
--------------------------
CSV files are read twice from disk (pass 1: header and the per-column profile that settles date
order and text columns; pass 2: conversion) and never held whole; JSON is parsed one array element
at a time (an element is bounded by ``max_line_bytes``). In pass 2 / the JSON pass, each valid row
is queued; every :data:`~gateway.guard.bulk.BULK_CHUNK` rows the queue's keys are looked up in the
store inside the import transaction (existing key: an error unless ``replace``; with ``replace``
the old ``created_at`` is kept), then the rows are handed to the store's bulk writer, which
inserts them into the open ``BEGIN IMMEDIATE`` transaction. Once any row is bad nothing more is
written, but every later row is still checked, so every bad row is reported; then the transaction
is rolled back. ``dry_run`` does the same with a read-only snapshot and never writes.
Duplicate keys within the file are found with an index of the keys seen so far (and the row that
gave each) kept in a private temporary SQLite database (an unnamed file in the temporary directory
that SQLite unlinks at once and deletes on close; only a keyed hash of each key goes there, never a
key or a value; its page cache is bounded). So memory is bounded by one chunk of rows, one CSV
record / JSON element and the reported errors, not by the row count (benchmarks/bench_import.py,
tests/guard/test_import.py).
While the import transaction is open the running guard (another connection) keeps reading the
store as it was before the import (WAL); another writer (``uomp memory add``) waits up to the
store's busy timeout and then fails with STORE_UNAVAILABLE, so run large imports when nothing else
writes. The transaction is opened after CSV pass 1, when the first chunk of rows is ready.

Bounds: :class:`ImportLimits` (file size, value size, line / JSON element size, row count,
reported errors).

Progress: ``import_file(progress=callback)`` calls ``callback(done_bytes, total_bytes)`` as the file
is read; the importer never prints or draws (``uomp import`` draws the bar, :mod:`gateway.cli.memory`).

Layout (one job each): :mod:`.readers` (the file, CSV records, JSON elements, UTF-8, format and
delimiter), :mod:`.cleaning` (numbers, amounts, currencies, dates, timestamps: pure functions),
:mod:`.mapping` (destinations and the reserved-field rules), :mod:`.records` (CSV rows / JSON
elements to records), :mod:`.report` (limits, notices, errors, the report) and :mod:`.driver`
(the key index, the write queue into the store's transaction, :func:`import_file`).
"""

from gateway.guard.importer.cleaning import DATE_ORDERS, MAX_NUMBER_DIGITS
from gateway.guard.importer.driver import PROGRESS_MIN_BYTES, import_file
from gateway.guard.importer.mapping import ALIASES, RESERVED, TIMESTAMP_FIELDS, Dest
from gateway.guard.importer.readers import FORMATS, ProgressCallback
from gateway.guard.importer.report import ImportLimits, ImportReport

__all__ = [
    "ALIASES",
    "DATE_ORDERS",
    "FORMATS",
    "MAX_NUMBER_DIGITS",
    "PROGRESS_MIN_BYTES",
    "RESERVED",
    "TIMESTAMP_FIELDS",
    "Dest",
    "ImportLimits",
    "ImportReport",
    "ProgressCallback",
    "import_file",
]
