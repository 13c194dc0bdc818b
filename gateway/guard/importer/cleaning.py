"""Value cleaning for the importer: numbers, amounts with currency symbols, dates, timestamps.

Pure functions of text: no I/O, no store, no notices. Each answers what a cell or field *is*; the
caller (:mod:`gateway.guard.importer.records`) decides what to announce. The rules are the ones
documented in :mod:`gateway.guard.importer` ("Cleaning of CSV value cells", "Timestamps").
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime
from typing import Any

DATE_ORDERS = ("dmy", "mdy")
MAX_NUMBER_DIGITS = 15
CURRENCY_SYMBOLS = "$€£¥"


def _month_names() -> dict[str, int]:
    names = (
        "january",
        "february",
        "march",
        "april",
        "may",
        "june",
        "july",
        "august",
        "september",
        "october",
        "november",
        "december",
    )
    out = {n: i for i, n in enumerate(names, start=1)}
    out.update({n[:3]: i for i, n in enumerate(names, start=1)})
    out["sept"] = 9
    return out


_MONTHS = _month_names()

_TIME = r"(?:[ T](\d{1,2}):(\d{2})(?::(\d{2}))?)?"
ISO_VALUE = re.compile(
    r"\d{4}-\d{2}-\d{2}"
    r"(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}(?::?\d{2})?)?)?"
)
ISO_PREFIX = re.compile(r"\d{4}-\d{2}-\d{2}")
_YMD = re.compile(r"(\d{4})([/.-])(\d{1,2})\2(\d{1,2})" + _TIME)
_NUMERIC = re.compile(r"(\d{1,2})([/.-])(\d{1,2})\2(\d{4})" + _TIME)
_MONTH_DAY = re.compile(r"([A-Za-z]{3,9})\.? (\d{1,2})(?:st|nd|rd|th)?,? (\d{4})" + _TIME)
_DAY_MONTH = re.compile(r"(\d{1,2})(?:st|nd|rd|th)?([ -])([A-Za-z]{3,9})\.?,?\2(\d{4})" + _TIME)

_AMOUNT = re.compile(
    r"(?P<neg1>-)?(?P<pre>[$€£¥])?(?P<sp1> )?(?P<neg2>-)?"
    r"(?P<int>[1-9]\d{0,2}(?:,\d{3})+|0|[1-9]\d*)(?P<frac>\.\d+)?"
    r"(?P<sp2> )?(?P<post>[$€£¥])?"
)
LEADING_ZERO = re.compile(r"[-$€£¥]?0\d[\d,]*(?:\.\d+)?")

Time = tuple[int, int, int] | None
NumericDate = tuple[int, int, int, Time]


def _time_of(h: str | None, m: str | None, s: str | None) -> Time:
    if h is None or m is None:
        return None
    return int(h), int(m), int(s) if s else 0


def numeric_date(text: str) -> NumericDate | None:
    """``A/B/YYYY`` -> (A, B, year, time) without deciding which of A, B is the day."""
    m = _NUMERIC.fullmatch(text)
    if not m:
        return None
    return int(m.group(1)), int(m.group(3)), int(m.group(4)), _time_of(m.group(5), m.group(6), m.group(7))


def evidence(a: int, b: int) -> str | None:
    """What ``A/B/YYYY`` says about the column's order: "dmy" (A > 12), "mdy" (B > 12) or nothing."""
    if a > 12 >= b:
        return "dmy"
    if b > 12 >= a:
        return "mdy"
    return None


def ambiguous(a: int, b: int) -> bool:
    """Both readings of ``A/B`` are real and differ."""
    return a != b and a <= 12 and b <= 12


def _build(y: int, mo: int, d: int, t: Time) -> datetime | date | None:
    try:
        if t is None:
            return date(y, mo, d)
        return datetime(y, mo, d, *t)
    except ValueError:
        return None


def definite_date(text: str) -> datetime | date | bool | None:
    """YMD and month-name forms. A date, None (not such a form), or False (such a form, invalid)."""
    m = _YMD.fullmatch(text)
    if m:
        return (
            _build(int(m.group(1)), int(m.group(3)), int(m.group(4)), _time_of(m.group(5), m.group(6), m.group(7)))
            or False
        )
    m = _MONTH_DAY.fullmatch(text)
    if m:
        month = _MONTHS.get(m.group(1).lower())
        if month is None:
            return None
        return _build(int(m.group(3)), month, int(m.group(2)), _time_of(m.group(4), m.group(5), m.group(6))) or False
    m = _DAY_MONTH.fullmatch(text)
    if m:
        month = _MONTHS.get(m.group(3).lower())
        if month is None:
            return None
        return _build(int(m.group(4)), month, int(m.group(1)), _time_of(m.group(5), m.group(6), m.group(7))) or False
    return None


def resolve_numeric(parts: NumericDate, order: str) -> datetime | date | None:
    a, b, y, t = parts
    day, month = (a, b) if order == "dmy" else (b, a)
    return _build(y, month, day, t)


def iso_value(d: datetime | date) -> str:
    """A date as it goes into a value: ``YYYY-MM-DD`` or ``YYYY-MM-DDTHH:MM:SS`` (no zone invented)."""
    if isinstance(d, datetime):
        return d.strftime("%Y-%m-%dT%H:%M:%S")
    return d.isoformat()


def utc_text(dt: datetime) -> str:
    """An aware datetime as the store's ``YYYY-MM-DDTHH:MM:SS[.ffffff]Z``."""
    dt = dt.astimezone(UTC)
    text = dt.strftime("%Y-%m-%dT%H:%M:%S")
    if dt.microsecond:
        text += f".{dt.microsecond:06d}".rstrip("0")
    return text + "Z"


def looks_like_date(s: str) -> bool:
    return bool(definite_date(s) or numeric_date(s) or ISO_VALUE.fullmatch(s))


def parse_amount(text: str) -> tuple[int | float, bool, str | None] | str | None:
    """Parse a number cell. (number, had_thousands, currency) | "long" | None (not a number)."""
    m = _AMOUNT.fullmatch(text)
    if not m:
        return None
    pre, post = m.group("pre"), m.group("post")
    if m.group("neg1") and m.group("neg2"):
        return None
    if pre and post:
        return None
    if (m.group("sp1") and not pre) or (m.group("sp2") and not post):
        return None
    if m.group("neg2") and not pre:
        return None
    digits = m.group("int").replace(",", "")
    frac = m.group("frac") or ""
    if len(digits) + max(0, len(frac) - 1) > MAX_NUMBER_DIGITS:
        return "long"
    negative = bool(m.group("neg1") or m.group("neg2"))
    number: int | float = float(digits + frac) if frac else int(digits)
    if negative:
        number = -number
    return number, "," in m.group("int"), pre or post


_ID_LAST = frozenset(
    (
        "id",
        "ids",
        "uuid",
        "guid",
        "phone",
        "tel",
        "telephone",
        "mobile",
        "fax",
        "zip",
        "zipcode",
        "postcode",
        "postal",
        "sku",
        "iban",
        "ssn",
        "pin",
        "isbn",
        "ean",
        "upc",
        "code",
    )
)
_NUMBER_WORDS = frozenset(("number", "no", "num", "nr"))


def identifier_like(name: str) -> bool:
    """A column name whose values are identifiers (``id``, ``zip``, ``phone_number``, ``customerId``)."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    words = [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]
    if not words:
        return False
    return words[-1] in _ID_LAST or (len(words) >= 2 and words[-1] in _NUMBER_WORDS)


def identifier_values(s: str) -> str | None:
    """Why a column holding the (stripped, non-empty) value ``s`` must stay text, or None."""
    if s[0] in "-0$€£¥" and LEADING_ZERO.fullmatch(s):
        return "some values have leading zeros, so the column holds identifiers"
    if len(s) > MAX_NUMBER_DIGITS and parse_amount(s) == "long":
        return f"some values are numbers of more than {MAX_NUMBER_DIGITS} digits, so the column holds identifiers"
    return None


# What one cleaning did: (notice kind, extra detail or None); see records.Notices for the kinds.
Change = tuple[str, str | None]


def clean_text(
    s: str, cell: str, *, numbers: bool, dates: bool, text_reason: str | None, date_order: str | None
) -> tuple[Any, tuple[Change, ...]]:
    """The value of a non-blank CSV cell (``s`` = ``cell`` stripped) and what was changed.

    ``numbers`` / ``dates``: whether the column may hold them (False: identifier-like or
    ``--keep-text``, then ``text_reason`` says why); ``date_order``: the column's settled order.
    """
    if not numbers and not dates:
        if parse_amount(s) is not None or LEADING_ZERO.fullmatch(s) or looks_like_date(s):
            return cell, (("kept_text", text_reason),)
        return cell, ()
    if numbers:
        amount = parse_amount(s)
        if amount == "long":
            return cell, (("long_number", None),)
        if isinstance(amount, tuple):
            number, thousands, currency = amount
            changes: list[Change] = []
            if currency:
                changes.append(("currency", currency))
            if thousands:
                changes.append(("thousands", None))
            if not currency and not thousands:
                changes.append(("number", None))
            return number, tuple(changes)
    if dates and len(s) >= 8:
        if ISO_VALUE.fullmatch(s):
            return cell, ()
        found = definite_date(s)
        if found is False:
            return cell, (("not_a_date", None),)
        if found is not None:
            assert not isinstance(found, bool)
            return iso_value(found), (("date", None),)
        parts = numeric_date(s)
        if parts is not None:
            a, b = parts[0], parts[1]
            order = date_order or evidence(a, b)
            if order is None:
                if ambiguous(a, b):
                    return cell, (("ambiguous", None),)
                order = "dmy"  # a == b: both readings agree
            d = resolve_numeric(parts, order)
            if d is None:
                return cell, (("not_a_date", None),)
            return iso_value(d), (("date" if a == b else f"date_{order}", None),)
    return cell, ()


def parse_timestamp(text: str, order: str | None) -> tuple[datetime, bool] | str:
    """A created_at / updated_at text (stripped) -> (aware datetime, zone_assumed), or the problem:
    ``"ambiguous"`` (``A/B/YYYY`` both ways possible, no order known) or ``"invalid"``.

    ISO 8601 first, then the date forms of values; a date alone is midnight, no zone means UTC.
    ``order``: ``--date-order`` or the column's settled order; without one an ``A/B/YYYY`` with a
    part over 12 decides for itself and ``A == B`` reads the same both ways.
    """
    dt: datetime | date | None = None
    if ISO_PREFIX.match(text):
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            dt = None
        if dt is not None and len(text) == 10:
            dt = dt.date()
    else:
        found = definite_date(text)
        if found is False:
            dt = None
        elif found is not None:
            assert not isinstance(found, bool)
            dt = found
        else:
            parts = numeric_date(text)
            if parts is not None:
                a, b = parts[0], parts[1]
                if order is None and ambiguous(a, b):
                    return "ambiguous"
                dt = resolve_numeric(parts, order or evidence(a, b) or "dmy")
    if dt is None:
        return "invalid"
    if not isinstance(dt, datetime):
        dt = datetime(dt.year, dt.month, dt.day)
    if dt.tzinfo is None:
        return dt.replace(tzinfo=UTC), True
    return dt, False
