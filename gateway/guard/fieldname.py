"""The ``field`` of an aggregate query (§10.5) as the guard addresses it.

``value`` and ``value.NAME[.NAME...]`` are paths into the item's value. Any other ``NAME[.NAME...]``
is shorthand for ``value.NAME[.NAME...]`` (the reference SDK sends ``field=market_value``). The
shorthand reaches only the value, never an item's metadata (``field=key`` is ``value.key``), and
the expanded path is what ``allowed_fields`` and the store see, so the shorthand grants nothing
the full path would not."""

from __future__ import annotations

VALUE = "value"


def aggregate_field(raw: str | None) -> str | None:
    """The full path of an aggregate's ``field`` parameter (None stays None)."""
    if raw is None or raw == VALUE or raw.startswith(VALUE + "."):
        return raw
    return f"{VALUE}.{raw}"
