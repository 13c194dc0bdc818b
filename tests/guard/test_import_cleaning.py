"""Case tables for the importer's value cleaning (gateway/guard/importer/cleaning.py): pure functions,
one row a test, each row named. Every accepted form has refused partners next to it."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any

import pytest

from gateway.guard.importer.cleaning import (
    clean_text,
    definite_date,
    identifier_like,
    identifier_values,
    numeric_date,
    parse_amount,
    parse_timestamp,
    utc_text,
)

# ------------------------------------------------------------------------------------ amounts

AMOUNTS: list[tuple[str, str, Any]] = [
    # (id, cell, (number, had_thousands, currency) | "long" | None)
    ("integer", "42", (42, False, None)),
    ("zero", "0", (0, False, None)),
    ("negative", "-7", (-7, False, None)),
    ("decimal", "3.25", (3.25, False, None)),
    ("zero-decimal", "0.5", (0.5, False, None)),
    ("thousands", "1,234,567", (1234567, True, None)),
    ("thousands-decimal", "1,234,567.89", (1234567.89, True, None)),
    ("dollar-prefix", "$12", (12, False, "$")),
    ("euro-suffix", "12€", (12, False, "€")),
    ("euro-suffix-space", "12 €", (12, False, "€")),
    ("pound-prefix-space", "£ 5.50", (5.5, False, "£")),
    ("yen-thousands", "¥1,000", (1000, True, "¥")),
    ("minus-before-symbol", "-$3", (-3, False, "$")),
    ("minus-after-symbol", "$-3", (-3, False, "$")),
    ("fifteen-digits", "123456789012345", (123456789012345, False, None)),
    ("sixteen-digits-long", "1234567890123456", "long"),
    ("fifteen-plus-fraction-long", "12345678901234.56", "long"),
    ("card-number-long", "4111111111111111", "long"),
    # refused: stays text
    ("leading-zero", "0123", None),
    ("plus-sign", "+5", None),
    ("exponent", "1e5", None),
    ("bare-fraction", ".5", None),
    ("percent", "50%", None),
    ("european-grouping", "1.234,50", None),
    ("bad-grouping", "12,34", None),
    ("space-grouping", "1 234", None),
    ("two-minus", "-$-3", None),
    ("symbol-both-sides", "$3€", None),
    ("space-without-symbol", "3 ", None),
    ("minus-after-no-symbol", "--3", None),
    ("two-symbols", "$$3", None),
    ("other-currency-sign", "₹3", None),
    ("word", "twelve", None),
    ("empty", "", None),
]


@pytest.mark.parametrize(("cell", "expected"), [pytest.param(c, e, id=i) for i, c, e in AMOUNTS])
def test_amount(cell: str, expected: Any) -> None:
    got = parse_amount(cell)
    assert got == expected
    if isinstance(expected, tuple):
        assert type(got[0]) is type(expected[0])  # type: ignore[index]  # 3 stays int, 3.0 float


# ------------------------------------------------------------------------------------ dates

DATES: list[tuple[str, str, Any]] = [
    # (id, text, date | datetime | None (not a definite form) | False (the form, but no such date))
    ("ymd-slash", "2026/01/05", date(2026, 1, 5)),
    ("ymd-dot", "2026.1.5", date(2026, 1, 5)),
    ("ymd-dash-short", "2026-1-5", date(2026, 1, 5)),
    ("ymd-with-time", "2026/01/05 14:30", datetime(2026, 1, 5, 14, 30)),
    ("ymd-with-seconds", "2026/01/05T14:30:09", datetime(2026, 1, 5, 14, 30, 9)),
    ("month-day-year", "Jan 5 2026", date(2026, 1, 5)),
    ("month-day-comma-year", "Jan 5, 2026", date(2026, 1, 5)),
    ("full-month-ordinal", "January 5th, 2026", date(2026, 1, 5)),
    ("sept", "Sept 30 2026", date(2026, 9, 30)),
    ("day-month-year", "5 Jan 2026", date(2026, 1, 5)),
    ("day-month-year-dashes", "05-Jan-2026", date(2026, 1, 5)),
    ("month-name-case", "JAN 5 2026", date(2026, 1, 5)),
    # refused or not a date
    ("ymd-mixed-separators", "2026/01-05", None),
    ("ymd-feb-31", "2026/02/31", False),
    ("ymd-month-13", "2026/13/01", False),
    ("month-name-feb-30", "Feb 30 2026", False),
    ("unknown-month-word", "Foo 5 2026", None),
    ("two-digit-year", "Jan 5 26", None),
    ("numeric-is-not-definite", "05/01/2026", None),
    ("day-month-mixed-separators", "5 Jan-2026", None),
    ("time-out-of-range", "2026/01/05 25:00", False),
]


@pytest.mark.parametrize(("text", "expected"), [pytest.param(t, e, id=i) for i, t, e in DATES])
def test_definite_date(text: str, expected: Any) -> None:
    assert definite_date(text) == expected


NUMERIC: list[tuple[str, str, Any]] = [
    ("slash", "05/01/2026", (5, 1, 2026, None)),
    ("dot", "5.1.2026", (5, 1, 2026, None)),
    ("dash-with-time", "13-01-2026 08:05:07", (13, 1, 2026, (8, 5, 7))),
    ("mixed-separators", "05/01-2026", None),
    ("two-digit-year", "05/01/26", None),
    ("three-digit-part", "105/01/2026", None),
]


@pytest.mark.parametrize(("text", "expected"), [pytest.param(t, e, id=i) for i, t, e in NUMERIC])
def test_numeric_date(text: str, expected: Any) -> None:
    assert numeric_date(text) == expected


# ------------------------------------------------------------------------------------ CSV value cells

CELLS: list[tuple[str, str, dict[str, Any], Any, list[tuple[str, str | None]]]] = [
    # (id, cell, column options, value, changes announced)
    ("number", "42", {}, 42, [("number", None)]),
    ("currency-and-thousands", "$1,234.50", {}, 1234.5, [("currency", "$"), ("thousands", None)]),
    ("currency-only", "12 €", {}, 12, [("currency", "€")]),
    ("thousands-only", "12,000", {}, 12000, [("thousands", None)]),
    ("long-number-kept", "4111111111111111", {}, "4111111111111111", [("long_number", None)]),
    ("text-untouched", "hello", {}, "hello", []),
    ("iso-date-untouched", "2026-01-05", {}, "2026-01-05", []),
    ("iso-datetime-untouched", "2026-01-05T10:00:00Z", {}, "2026-01-05T10:00:00Z", []),
    ("month-name-date", "Jan 5 2026", {}, "2026-01-05", [("date", None)]),
    ("date-with-time", "2026/01/05 14:30", {}, "2026-01-05T14:30:00", [("date", None)]),
    ("not-a-real-date", "31/02/2026", {"date_order": "dmy"}, "31/02/2026", [("not_a_date", None)]),
    ("not-a-real-ymd", "2026/02/31", {}, "2026/02/31", [("not_a_date", None)]),
    ("day-first-evidence", "13/01/2026", {}, "2026-01-13", [("date_dmy", None)]),
    ("month-first-evidence", "01/13/2026", {}, "2026-01-13", [("date_mdy", None)]),
    ("ambiguous-kept", "05/01/2026", {}, "05/01/2026", [("ambiguous", None)]),
    ("ambiguous-column-dmy", "05/01/2026", {"date_order": "dmy"}, "2026-01-05", [("date_dmy", None)]),
    ("ambiguous-column-mdy", "05/01/2026", {"date_order": "mdy"}, "2026-05-01", [("date_mdy", None)]),
    ("same-day-and-month", "05/05/2026", {}, "2026-05-05", [("date", None)]),
    ("short-date-like-text", "1/2/3", {}, "1/2/3", []),
    ("dates-off-number-stays", "42", {"dates": False}, 42, [("number", None)]),
    ("numbers-off-date-stays", "Jan 5 2026", {"numbers": False}, "2026-01-05", [("date", None)]),
    ("numbers-off-number-text", "42", {"numbers": False}, "42", []),
    (
        "text-column-number",
        "42",
        {"numbers": False, "dates": False, "text_reason": "--keep-text"},
        "42",
        [("kept_text", "--keep-text")],
    ),
    (
        "text-column-date",
        "Jan 5 2026",
        {"numbers": False, "dates": False, "text_reason": "x"},
        "Jan 5 2026",
        [("kept_text", "x")],
    ),
    (
        "text-column-leading-zero",
        "02134",
        {"numbers": False, "dates": False, "text_reason": "zip"},
        "02134",
        [("kept_text", "zip")],
    ),
    ("text-column-plain-text", "hello", {"numbers": False, "dates": False, "text_reason": "x"}, "hello", []),
    ("spaces-kept-in-value", " 7 ", {}, 7, [("number", None)]),
    ("spaces-kept-in-text", " hi ", {}, " hi ", []),
]


@pytest.mark.parametrize(
    ("cell", "options", "value", "changes"), [pytest.param(c, o, v, ch, id=i) for i, c, o, v, ch in CELLS]
)
def test_clean_text(cell: str, options: dict[str, Any], value: Any, changes: list[tuple[str, str | None]]) -> None:
    opts: dict[str, Any] = {"numbers": True, "dates": True, "text_reason": None, "date_order": None, **options}
    got, got_changes = clean_text(cell.strip(), cell, **opts)
    assert got == value and type(got) is type(value)
    assert list(got_changes) == changes


IDENTIFIER_VALUES: list[tuple[str, str, bool]] = [
    ("zip-leading-zero", "02134", True),
    ("negative-leading-zero", "-0123", True),
    ("currency-leading-zero", "$01", True),
    ("card-number", "4111111111111111", True),
    ("plain-number", "90210", False),
    ("zero-point-five", "0.5", False),
    ("zero", "0", False),
    ("fifteen-digits", "123456789012345", False),
    ("long-text", "abcdefghijklmnopq", False),
]


@pytest.mark.parametrize(("value", "is_id"), [pytest.param(v, e, id=i) for i, v, e in IDENTIFIER_VALUES])
def test_identifier_values(value: str, is_id: bool) -> None:
    assert (identifier_values(value) is not None) is is_id


IDENTIFIER_NAMES: list[tuple[str, bool]] = [
    ("id", True),
    ("customer_id", True),
    ("customerId", True),
    ("UUID", True),
    ("phone", True),
    ("zip", True),
    ("postcode", True),
    ("iban", True),
    ("sku", True),
    ("phone_number", True),
    ("account no", True),
    ("order-nr", True),
    ("promo code", True),
    ("number", False),
    ("amount", False),
    ("ideas", False),
    ("zipper", False),
    ("identity", False),
    ("", False),
    ("__", False),
]


@pytest.mark.parametrize(("name", "is_id"), [pytest.param(n, e, id=n or "empty") for n, e in IDENTIFIER_NAMES])
def test_identifier_like(name: str, is_id: bool) -> None:
    assert identifier_like(name) is is_id


# ------------------------------------------------------------------------------------ timestamps

TIMESTAMPS: list[tuple[str, str, str | None, Any]] = [
    # (id, text, date order, (UTC text, zone assumed) | problem)
    ("iso-utc", "2026-01-05T10:00:00Z", None, ("2026-01-05T10:00:00Z", False)),
    ("iso-offset", "2026-01-05T10:00:00+02:00", None, ("2026-01-05T08:00:00Z", False)),
    ("iso-no-zone", "2026-01-05T10:00:00", None, ("2026-01-05T10:00:00Z", True)),
    ("iso-date-only", "2026-01-05", None, ("2026-01-05T00:00:00Z", True)),
    ("iso-fraction", "2026-01-05T10:00:00.250Z", None, ("2026-01-05T10:00:00.25Z", False)),
    ("iso-space", "2026-01-05 10:00", None, ("2026-01-05T10:00:00Z", True)),
    ("month-name", "Jan 5 2026", None, ("2026-01-05T00:00:00Z", True)),
    ("ymd-slash-time", "2026/01/05 14:30", None, ("2026-01-05T14:30:00Z", True)),
    ("numeric-evidence", "13/01/2026", None, ("2026-01-13T00:00:00Z", True)),
    ("numeric-same", "05/05/2026", None, ("2026-05-05T00:00:00Z", True)),
    ("numeric-order-dmy", "05/01/2026", "dmy", ("2026-01-05T00:00:00Z", True)),
    ("numeric-order-mdy", "05/01/2026", "mdy", ("2026-05-01T00:00:00Z", True)),
    ("numeric-ambiguous", "05/01/2026", None, "ambiguous"),
    ("iso-bad-day", "2026-02-31", None, "invalid"),
    ("iso-garbage-tail", "2026-01-05xyz", None, "invalid"),
    ("not-a-date", "yesterday", None, "invalid"),
    ("numeric-impossible", "31/02/2026", "dmy", "invalid"),
    ("month-name-impossible", "Feb 30 2026", None, "invalid"),
    ("two-digit-year", "05/01/26", "dmy", "invalid"),
]


@pytest.mark.parametrize(("text", "order", "expected"), [pytest.param(t, o, e, id=i) for i, t, o, e in TIMESTAMPS])
def test_parse_timestamp(text: str, order: str | None, expected: Any) -> None:
    got = parse_timestamp(text, order)
    if isinstance(expected, str):
        assert got == expected
        return
    assert not isinstance(got, str)
    dt, assumed = got
    assert (utc_text(dt), assumed) == expected


@pytest.mark.parametrize(
    ("dt", "text"),
    [
        pytest.param(datetime(2026, 1, 5, tzinfo=UTC), "2026-01-05T00:00:00Z", id="utc"),
        pytest.param(
            datetime(2026, 1, 5, 1, tzinfo=timezone(timedelta(hours=3))),
            "2026-01-04T22:00:00Z",
            id="offset-crosses-midnight",
        ),
        pytest.param(
            datetime(2026, 1, 5, microsecond=120000, tzinfo=UTC), "2026-01-05T00:00:00.12Z", id="fraction-trimmed"
        ),
    ],
)
def test_utc_text(dt: datetime, text: str) -> None:
    assert utc_text(dt) == text
