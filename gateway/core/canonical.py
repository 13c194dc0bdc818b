"""RFC 8785 JSON Canonicalization Scheme (JCS), pure.

One function, :func:`canonical_json`, turns a JSON value (``dict``/``list``/``str``/``int``/
``float``/``bool``/``None``) into the one byte string every signer and verifier agrees on:
object members sorted by the UTF-16 code units of their names, no insignificant white space,
strings escaped minimally and emitted as UTF-8, numbers in the ECMAScript shortest form.

The work is done by the ``rfc8785`` package; this module only pins the error behaviour:
anything JCS cannot represent (NaN, infinities, integers beyond ±(2**53 - 1), lone surrogates,
non-string object keys, other Python types, nesting deep enough to exhaust the stack) is an
``INVALID_REQUEST``, never a stray ``ValueError`` or ``RecursionError``.

Used for signed manifests (``gateway.core.manifest``) and deletion proofs
(``gateway.core.deletion``).
"""

from __future__ import annotations

from typing import Any

import rfc8785

from gateway.errors import UompError


def canonical_json(obj: Any) -> bytes:
    """The RFC 8785 canonical UTF-8 serialisation of ``obj``.

    Raises ``UompError("INVALID_REQUEST")`` when ``obj`` has no canonical JSON form.
    """
    try:
        out = rfc8785.dumps(obj)
    except (rfc8785.CanonicalizationError, UnicodeError) as exc:
        # UnicodeError: a lone surrogate in an object *name* escapes the library's own check.
        raise UompError("INVALID_REQUEST", "value cannot be canonicalised as JSON (RFC 8785)") from exc
    except RecursionError as exc:
        raise UompError("INVALID_REQUEST", "value is nested too deeply to canonicalise") from exc
    if not isinstance(out, bytes):  # pragma: no cover - the library always returns bytes
        raise UompError("INVALID_REQUEST", "value cannot be canonicalised as JSON (RFC 8785)")
    return out
