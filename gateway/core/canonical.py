"""RFC 8785 JSON Canonicalization Scheme (JCS), pure.

One function, :func:`canonical_json`, turns a JSON value (``dict``/``list``/``str``/``int``/
``float``/``bool``/``None``) into the one byte string every signer and verifier agrees on:
object members sorted by the UTF-16 code units of their names, no insignificant white space,
strings escaped minimally and emitted as UTF-8, numbers in the ECMAScript shortest form.

Values made only of ASCII-named objects, lists, strings, booleans, ``None``, integers within
±(2**53 - 1) and floats in ``[1e-4, 1e16)`` take a fast path through the stdlib ``json`` encoder,
whose output is byte-identical to JCS for exactly those values (same escapes, code-point order of
ASCII names, shortest round-trip floats in fixed notation); the audit log canonicalises every event
this way (the ``rfc8785`` package costs ~150 µs per event). Everything else goes to ``rfc8785``; a
property test holds the two to the same bytes.

The work is otherwise done by the ``rfc8785`` package; this module only pins the error behaviour:
anything JCS cannot represent (NaN, infinities, integers beyond ±(2**53 - 1), lone surrogates,
non-string object keys, other Python types, nesting deep enough to exhaust the stack) is an
``INVALID_REQUEST``, never a stray ``ValueError`` or ``RecursionError``.

Used for signed manifests (``gateway.core.manifest``) and deletion proofs
(``gateway.core.deletion``).
"""

from __future__ import annotations

import json
import math
from typing import Any

import rfc8785

from gateway.errors import ErrorCode, UompError, caused_by

_MAX_SAFE = 2**53 - 1
_FAST_DEPTH = 32
_encode = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False).encode


def _fast_ok(obj: Any, depth: int = 0) -> bool:
    """True when the stdlib encoder's output for ``obj`` is exactly its JCS form."""
    t = type(obj)
    if t is dict:
        if depth > _FAST_DEPTH:
            return False
        for k, v in obj.items():
            if type(k) is not str or not k.isascii():
                return False
            tv = type(v)
            if tv is str:
                if not v.isascii() and _has_surrogate(v):
                    return False
            elif tv is int:
                if not -_MAX_SAFE <= v <= _MAX_SAFE:
                    return False
            elif v is None or tv is bool:
                continue
            elif not _fast_ok(v, depth + 1):
                return False
        return True
    if t is list:
        return depth <= _FAST_DEPTH and all(_fast_ok(v, depth + 1) for v in obj)
    if t is str:
        return obj.isascii() or not _has_surrogate(obj)
    if t is bool or obj is None:
        return True
    if t is int:
        return bool(-_MAX_SAFE <= obj <= _MAX_SAFE)
    if t is float:
        return bool(math.isfinite(obj) and 1e-4 <= abs(obj) < 1e16 and not obj.is_integer())
    return False


def _has_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    return any(0xD800 <= ord(c) <= 0xDFFF for c in s)


def canonical_json(obj: Any) -> bytes:
    """The RFC 8785 canonical UTF-8 serialisation of ``obj``.

    Raises ``UompError(ErrorCode.INVALID_REQUEST)`` when ``obj`` has no canonical JSON form.
    """
    if _fast_ok(obj):
        return _encode(obj).encode()
    try:
        out = rfc8785.dumps(obj)
    except (rfc8785.CanonicalizationError, UnicodeError) as exc:
        # UnicodeError: a lone surrogate in an object *name* escapes the library's own check.
        raise caused_by(UompError(ErrorCode.INVALID_REQUEST, "value cannot be canonicalised as JSON (RFC 8785)"), exc)
    except RecursionError as exc:
        raise caused_by(UompError(ErrorCode.INVALID_REQUEST, "value is nested too deeply to canonicalise"), exc)
    if not isinstance(out, bytes):  # pragma: no cover - the library always returns bytes
        raise UompError(ErrorCode.INVALID_REQUEST, "value cannot be canonicalised as JSON (RFC 8785)")
    return out
