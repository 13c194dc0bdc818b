"""Request-target normalisation for the gateway: one decode, one canonical spelling upstream.

The gateway checks the token's scope against the *decoded* path and forwards a path to the guard,
which decodes again. If the two sides could read the same bytes differently (``%2F`` becoming a
separator, ``%252F`` surviving one decode as ``%2F``, ``..`` collapsing somewhere on the way),
an agent could be granted ``/v1/memory/a`` and be served ``/v1/memory/b``. So the gateway
refuses every spelling that has more than one reading, and re-encodes what it accepted so the
guard sees exactly one spelling of it.

:func:`normalize_target` takes the request-target exactly as it came off the wire
(``request.raw_path`` of :mod:`gateway.httpd`: path plus optional ``?query``, with a ``#fragment``
or the absolute form ``http://host/...`` as sent, both refused here) and returns a :class:`Target`. Each
rule refused is a ``UompError(ErrorCode.INVALID_REQUEST, <fixed sentence>)`` whose ``details["rule"]``
names the rule; the message never echoes the target (it may hold a memory key).

Rules for the path (RFC 3986 §3.3, RFC 9112 §3.2):

* ``origin``: origin-form only: starts with ``/``; no absolute-form, authority-form or ``*``;
* ``length``: raw path at most :data:`MAX_PATH_LENGTH` characters, raw query at most
  :data:`MAX_QUERY_LENGTH`;
* ``fragment``: no ``#`` (a client never sends a fragment);
* ``control`` / ``backslash`` / ``non_ascii`` / ``character``: raw characters are the RFC 3986
  ``pchar`` set and ``/`` only (unreserved, sub-delims, ``:``, ``@``, ``%``);
* ``percent``: every ``%`` starts a well-formed ``%XX`` escape;
* ``empty_segment``: no empty segment anywhere: ``//`` and a trailing ``/`` are refused (the
  API has no route ending in ``/``; ``//host`` is how a scheme-relative reference starts). The
  bare root ``/`` is accepted with no segments (routing answers it NOT_FOUND);
* decoded exactly once, segment by segment, then in each decoded segment:
  ``encoded_slash`` (``%2F``), ``encoded_backslash`` (``%5C``), ``double_encoding`` (``%25``: a
  literal ``%`` after one decode), ``control`` (``%00``-``%1F``, ``%7F`` and the C1 controls
  ``%C2%80``-``%C2%9F``), ``utf8`` (the bytes must be valid UTF-8), ``dot_segment`` (``.`` or
  ``..``, however spelled: ``%2e%2E`` too).

No Unicode normalisation is applied: ``é`` precomposed and decomposed are different memory keys,
as they are in the store.

The query is kept raw (``request.query`` holds it parsed) but validated: same length
bound, RFC 3986 query characters only (``pchar``, ``/`` and ``?``), well-formed escapes, and once
decoded (``+`` as space, as ``request.query`` does) valid UTF-8 with no control character and no backslash.
A ``%25`` is allowed in the query: query values are data that is decoded once, never a path.

Pure: no I/O.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from urllib.parse import quote, unquote_to_bytes

from gateway.errors import ErrorCode, UompError, caused_by

MAX_PATH_LENGTH = 2048  # characters of the raw (still encoded) path
MAX_QUERY_LENGTH = 2048  # characters of the raw query string, without the "?"

# What quote() leaves alone when re-encoding a decoded segment: unreserved (quote() always keeps
# ALPHA / DIGIT / "-._~") plus the sub-delims, ":" and "@" that RFC 3986 allows in a segment.
SEGMENT_SAFE = "!$&'()*+,;=:@-._~"

# RFC 3986 pchar without pct-encoded (handled by _PERCENT) plus "/" (the separator).
_PATH_CHAR = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*")
# The query adds "?" (RFC 3986 §3.4).
_QUERY_CHAR = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/?%]*")
# A "%" not followed by two hex digits.
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


@dataclass(frozen=True, slots=True)
class Target:
    """An accepted request-target.

    ``path``: the path decoded once (what routing and the scope check look at);
    ``upstream_path``: the same path re-encoded in its one canonical spelling (what the guard gets);
    ``query``: the raw query string, validated, without the ``?`` ("" when there is none);
    ``segments``: the decoded segments of ``path`` (``()`` for ``/``).
    """

    path: str
    upstream_path: str
    query: str
    segments: tuple[str, ...]

    @property
    def upstream_target(self) -> str:
        """``upstream_path`` plus ``?query`` when there is a query."""
        return f"{self.upstream_path}?{self.query}" if self.query else self.upstream_path


def _refuse(rule: str, message: str) -> UompError:
    return UompError(ErrorCode.INVALID_REQUEST, message, details={"rule": rule})


def _is_control(ch: str) -> bool:
    # Cc covers C0 (U+0000-U+001F), DEL (U+007F) and C1 (U+0080-U+009F).
    return unicodedata.category(ch) == "Cc"


def _check_raw_chars(raw: str, allowed: re.Pattern[str], where: str) -> None:
    """Raw characters: the most specific rule first, so the message says what was wrong."""
    if allowed.fullmatch(raw):
        return
    for ch in raw:
        if _is_control(ch):
            raise _refuse("control", f"control character in the request {where}")
    if "\\" in raw:
        raise _refuse("backslash", f"backslash in the request {where}")
    if not raw.isascii():
        raise _refuse("non_ascii", f"non-ASCII character in the request {where}; percent-encode it")
    raise _refuse("character", f"character not allowed in the request {where}; percent-encode it")


def _check_percent(raw: str, where: str) -> None:
    if _BAD_PERCENT.search(raw):
        raise _refuse("percent", f"malformed percent-escape in the request {where}")


def _decode_segment(raw_segment: str) -> str:
    decoded_bytes = unquote_to_bytes(raw_segment)
    try:
        seg = decoded_bytes.decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        raise caused_by(_refuse("utf8", "request path is not valid UTF-8 once decoded"), None)
    if "/" in seg:
        raise _refuse("encoded_slash", "encoded slash (%2F) in the request path")
    if "\\" in seg:
        raise _refuse("encoded_backslash", "encoded backslash (%5C) in the request path")
    if "%" in seg:
        raise _refuse("double_encoding", "encoded percent sign (%25) in the request path: double encoding")
    if any(_is_control(ch) for ch in seg):
        raise _refuse("control", "encoded control character in the request path")
    if seg in (".", ".."):
        raise _refuse("dot_segment", "dot segment ('.' or '..') in the request path")
    return seg


def _check_query(query: str) -> None:
    if len(query) > MAX_QUERY_LENGTH:
        raise _refuse("length", f"request query longer than {MAX_QUERY_LENGTH} characters")
    if not query:
        return
    _check_raw_chars(query, _QUERY_CHAR, "query")
    _check_percent(query, "query")
    try:
        decoded = unquote_to_bytes(query.replace("+", " ")).decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        raise caused_by(_refuse("utf8", "request query is not valid UTF-8 once decoded"), None)
    if any(_is_control(ch) for ch in decoded):
        raise _refuse("control", "encoded control character in the request query")
    if "\\" in decoded:
        raise _refuse("encoded_backslash", "encoded backslash (%5C) in the request query")


def normalize_target(raw_target: str) -> Target:
    """Validate the request-target as received and decode its path exactly once.

    Raises ``UompError(ErrorCode.INVALID_REQUEST, ...)`` for every rule in the module docstring.
    """
    if not isinstance(raw_target, str) or not raw_target:
        raise _refuse("origin", "empty request-target")
    if len(raw_target) > MAX_PATH_LENGTH + 1 + MAX_QUERY_LENGTH:
        raise _refuse("length", "request-target too long")
    if "#" in raw_target:
        raise _refuse("fragment", "fragment ('#') in the request-target")
    if not raw_target.startswith("/"):
        raise _refuse("origin", "request-target must be origin-form (start with '/')")

    raw_path, _sep, query = raw_target.partition("?")
    if len(raw_path) > MAX_PATH_LENGTH:
        raise _refuse("length", f"request path longer than {MAX_PATH_LENGTH} characters")
    _check_raw_chars(raw_path, _PATH_CHAR, "path")
    _check_percent(raw_path, "path")
    _check_query(query)

    if raw_path == "/":
        return Target(path="/", upstream_path="/", query=query, segments=())

    raw_segments = raw_path[1:].split("/")
    if any(not s for s in raw_segments):
        raise _refuse("empty_segment", "empty path segment ('//' or a trailing '/') in the request path")
    if "%" not in raw_path:
        # Nothing escaped (every request of a well-behaved agent): each segment decodes to itself and
        # quote() keeps every pchar but "%", so the canonical spelling is the path as received; only
        # the dot segments are left to refuse (the raw characters were checked above).
        if "." in raw_path and any(s in (".", "..") for s in raw_segments):
            raise _refuse("dot_segment", "dot segment ('.' or '..') in the request path")
        return Target(path=raw_path, upstream_path=raw_path, query=query, segments=tuple(raw_segments))
    segments = tuple(_decode_segment(s) for s in raw_segments)
    return Target(
        path="/" + "/".join(segments),
        upstream_path="/" + "/".join(quote(s, safe=SEGMENT_SAFE) for s in segments),
        query=query,
        segments=segments,
    )
