"""JSON on the hot path: orjson when it is installed, with the standard library's exact semantics.

Two functions, and the contract each keeps (``tests/remote/test_perf_levers.py`` checks it against the
standard library on generated documents):

* :func:`loads` returns what ``json.loads`` returns for the same input, or raises what it raises.
  orjson is used when its answer is the same: it would silently turn an integer beyond 64 bits
  into a float, so an input holding a run of 19 or more digits goes to the standard library; any
  input orjson refuses (``NaN``, ``1e999``, a lone surrogate escape, nesting too deep, ...) is
  handed to the standard library too, which accepts or refuses it as it always did.
* :func:`dumps` returns what ``json.dumps(obj, ensure_ascii=False, separators=(",", ":"),
  allow_nan=False).encode()`` returns, up to the spelling of floats (orjson writes ``1e-7`` where
  Python writes ``1e-07``: the same number), or raises what it raises: integers beyond 64 bits,
  non-string keys and objects orjson would serialise but the standard library refuses
  (dataclasses, datetimes, ``str`` subclasses other than plain ``str``... are passed through and so
  go to the standard library) take the standard library's path; a NaN or infinity, which orjson
  would write as ``null``, is refused with ``ValueError`` as ``allow_nan=False`` refuses it.

Canonical JSON (RFC 8785, :mod:`gateway.core.canonical`) and RFC 7638 thumbprints never come
here: they need their exact bytes. ``UOMP_ORJSON=0`` turns orjson off (the standard library then
does all the work; what the benchmarks compare).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gateway.config import switch_on

try:  # an optional speed-up: everything works without it
    import orjson as _orjson
except ImportError:  # pragma: no cover - the dependency is declared
    _orjson = None  # type: ignore[assignment]

ENABLED = _orjson is not None and switch_on("UOMP_ORJSON")

_LONG_DIGITS = re.compile(rb"[0-9]{19}")
_LONG_DIGITS_STR = re.compile(r"[0-9]{19}")
_OPTS = 0
if _orjson is not None:
    _OPTS = _orjson.OPT_PASSTHROUGH_DATACLASS | _orjson.OPT_PASSTHROUGH_DATETIME | _orjson.OPT_PASSTHROUGH_SUBCLASS
_std_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def backend() -> str:
    """``orjson <version>`` or ``json (standard library)``: what :func:`dumps`/:func:`loads` use."""
    if ENABLED and _orjson is not None:
        return f"orjson {_orjson.__version__}"
    return "json (standard library)"


def loads(data: str | bytes | bytearray | memoryview) -> Any:
    """``json.loads(data)``, faster (see the module docstring)."""
    if ENABLED and _orjson is not None:
        pattern = _LONG_DIGITS_STR if isinstance(data, str) else _LONG_DIGITS
        try:
            if pattern.search(data) is None:  # type: ignore[arg-type]
                return _orjson.loads(data)
        except (_orjson.JSONDecodeError, TypeError):
            pass  # the standard library decides: its answer or its refusal
    if isinstance(data, memoryview):
        data = bytes(data)
    return json.loads(data)


def _non_finite(obj: Any) -> bool:
    stack = [obj]
    while stack:
        o = stack.pop()
        if type(o) is float:
            if not math.isfinite(o):
                return True
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list | tuple):
            stack.extend(o)
    return False


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON of ``obj`` (see the module docstring for the exact contract)."""
    if ENABLED and _orjson is not None:
        try:
            out: bytes = _orjson.dumps(obj, option=_OPTS)
        except TypeError:
            pass  # the standard library encodes it (big int, int keys) or refuses it
        else:
            if b"null" not in out or not _non_finite(obj):
                return out
    return _std_encode(obj).encode("utf-8")
