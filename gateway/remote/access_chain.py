"""The access log's format and its verification, apart from the writer (:mod:`gateway.remote.access_log`).

One event per line: canonical JSON (keys sorted, no whitespace, UTF-8, no NaN), with ``seq``,
``timestamp`` and ``prev`` (the hex SHA-256 of the previous line's bytes without its newline;
``"0" * 64`` for the very first line). The chain runs across rotated segments; each closed segment
has one line in the segment index (first/last seq, first ``prev``, last line hash, size, close
time), and a ``pruned`` line once retention deleted it. :func:`verify_chain` checks every kept
segment, the links between them and the active file, anchored at the index's hashes for pruned
ones. Pure functions over files: no writer state here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from gateway.errors import ErrorCode, UompError
from gateway.fsutil import fsync_dir

log = logging.getLogger("gateway.remote.access_log")

GENESIS_PREV = "0" * 64
EVENT_TYPE = "gateway_access"
MAX_EVENT_BYTES = 64 * 1024  # one encoded line, without its newline
MAX_DEPTH = 8  # nesting of dicts/lists inside one event
MAX_TYPE_LENGTH = 64

RESERVED_FIELDS = frozenset({"seq", "timestamp", "prev"})
FORBIDDEN_FIELDS = frozenset(
    {
        "token",
        "access_token",
        "refresh_token",
        "id_token",
        "bearer",
        "authorization",
        "proxy_authorization",
        "cookie",
        "set_cookie",
        "dpop",
        "value",
        "values",
        "ciphertext",
        "plaintext",
        "password",
        "passphrase",
        "secret",
        "private_key",
        "key_material",
    }
)

_SCAN_WINDOW = 64 * 1024  # below this many bytes, read() stops bisecting and scans lines
_TAIL_CHUNK = 64 * 1024


class ChainError(UompError, ValueError):
    """The access log file is damaged or was altered.

    A :class:`UompError` (code ``INTERNAL``) so the CLI reports it like any other failure, and a
    ``ValueError`` for callers that treat it as bad data. ``seq`` is the first sequence number
    that does not verify (``None`` when it cannot be known).
    """

    def __init__(self, reason: str, *, seq: int | None = None) -> None:
        where = f"at seq {seq}" if seq is not None else "at its last line"
        super().__init__(
            ErrorCode.INTERNAL,
            f"access log chain broken {where}: {reason}",
            details={"seq": seq} if seq is not None else None,
        )
        self.seq = seq
        self.reason = reason


# ------------------------------------------------------------------------------------ format


def line_hash(line: bytes) -> str:
    """Hex SHA-256 of one line's bytes, without its trailing newline (the next line's ``prev``)."""
    return hashlib.sha256(line).hexdigest()


def encode_record(record: Mapping[str, Any]) -> bytes:
    """The canonical bytes of one line (no newline)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def iso_ms(ts: float) -> str:
    """``ts`` as an ISO 8601 UTC timestamp with milliseconds."""
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _check_value(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError("access log event nested too deeply")
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("access log event holds a non-finite number")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError("access log event field names must be strings")
            norm = k.lower().replace("-", "_")
            if norm in FORBIDDEN_FIELDS or norm.endswith("_token"):
                raise ValueError(
                    f"access log event must not carry a field named {k!r} (no tokens, key material or memory values)"
                )
            _check_value(v, depth + 1)
        return
    if isinstance(value, list | tuple):
        for v in value:
            _check_value(v, depth + 1)
        return
    raise ValueError(f"access log event holds a value of type {type(value).__name__}")


def prepare(event: Mapping[str, Any]) -> dict[str, Any]:
    """An event ready for the spool: JSON-safe, bounded, without the chain's own fields; ValueError otherwise."""
    if not isinstance(event, Mapping):
        raise ValueError("access log event must be a mapping")
    reserved = RESERVED_FIELDS.intersection(event)
    if reserved:
        raise ValueError(f"access log event must not set {sorted(reserved)}: the log assigns them")
    _check_value(event, 0)
    record = dict(event)
    kind = record.setdefault("type", EVENT_TYPE)
    if not isinstance(kind, str) or not kind or len(kind) > MAX_TYPE_LENGTH:
        raise ValueError("access log event type must be a short non-empty string")
    return record


# ---------------------------------------------------------------------------- file helpers


def rfind_newline(fd: int, end: int) -> int:
    """Offset of the last ``\\n`` before ``end``, or -1."""
    pos = end
    while pos > 0:
        start = max(0, pos - _TAIL_CHUNK)
        chunk = os.pread(fd, pos - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i
        pos = start
    return -1


def parse_line(line: bytes, *, seq: int | None) -> dict[str, Any]:
    """One spool line as its record; ChainError naming ``seq`` for a line that is not one."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ChainError("line is not UTF-8 JSON", seq=seq) from None
    if not isinstance(rec, dict):
        raise ChainError("line is not a JSON object", seq=seq)
    found = rec.get("seq")
    if type(found) is not int or found < 1:
        raise ChainError("line has no valid seq", seq=seq)
    return rec


def locate(f: IO[bytes], size: int, after_seq: int) -> int:
    """A line start at or before the first line whose seq > ``after_seq`` (lines are in seq order).

    Bisects on byte offsets (O(log n) reads) until the window is small, then the caller scans.
    Invariant: ``lo`` is a line start and every line before it has seq <= after_seq; ``hi`` is a
    line start (or ``size``) at which seq > after_seq.
    """
    lo, hi = 0, size
    while hi - lo > _SCAN_WINDOW:
        mid = (lo + hi) // 2
        f.seek(mid)
        f.readline()  # skip to the next line start
        start = f.tell()
        if start >= hi:
            break
        line = f.readline()
        if parse_line(line.rstrip(b"\n"), seq=None)["seq"] <= after_seq:
            lo = start + len(line)
        else:
            hi = start
    return lo


# ---------------------------------------------------------------------------- segment index


@dataclass
class _Index:
    segments: list[dict[str, Any]] = field(default_factory=list)
    pruned: set[str] = field(default_factory=set)


def load_index(path: Path) -> _Index:
    """The spool's segment index (what each rotated segment held), empty when there is none."""
    idx = _Index()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return idx
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if n == raw.count(b"\n") + 1:  # a torn last line: never acknowledged, ignore
                break
            raise ChainError(f"segment index line {n} is not JSON") from None
        if "pruned" in rec:
            idx.pruned.add(str(rec["pruned"]))
        else:
            idx.segments.append(rec)
    return idx


def append_index(path: Path, rec: Mapping[str, Any]) -> None:
    """Appends one record to the segment index, durably."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, encode_record(rec) + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def finish_rotation(active: Path, idx: _Index) -> None:
    """A crash between the index line and the rename: finish the rename."""
    if not idx.segments:
        return
    last = idx.segments[-1]
    seg = active.with_name(last["file"])
    if seg.exists() or not active.exists():
        return
    fd = os.open(active, os.O_RDONLY | os.O_CLOEXEC)
    try:
        first = first_of(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if first is not None and first[0] == int(last["first_seq"]):
        os.rename(active, seg)
        fsync_dir(active.parent)
        log.warning("access log: finished a rotation cut short (%s)", last["file"])


def first_of(fd: int, size: int) -> tuple[int, str] | None:
    """(seq, prev) of a file's first line, or None when empty."""
    if size == 0:
        return None
    head = os.pread(fd, min(size, MAX_EVENT_BYTES + 2), 0)
    end = head.find(b"\n")
    if end < 0:
        return None
    rec = parse_line(head[:end], seq=None)
    return int(rec["seq"]), str(rec.get("prev"))


# ------------------------------------------------------------------------------ verification


def _verify_file(path: Path, expected: int, prev: str) -> tuple[int, str]:
    """Verify one file continuing from (expected seq, prev); return the next (expected, prev)."""
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                raise ChainError("last line is torn (no newline)", seq=expected)
            line = raw[:-1]
            rec = parse_line(line, seq=expected)
            if rec["seq"] != expected:
                raise ChainError(f"seq is {rec['seq']}, expected {expected}", seq=expected)
            if rec.get("prev") != prev:
                raise ChainError("prev does not match the hash of the previous line", seq=expected)
            if not isinstance(rec.get("timestamp"), str):
                raise ChainError("timestamp missing", seq=expected)
            if encode_record(rec) != line:
                raise ChainError("line is not in canonical form", seq=expected)
            prev = line_hash(line)
            expected += 1
    return expected, prev


def verify_chain(path: Path) -> int:
    """Check an access log (the active file and every kept segment); return the number of events checked.

    Raises :class:`ChainError` at the first line whose seq is not the next one, whose ``prev`` is
    not the hash of the line before (across segment boundaries too), that is not canonical JSON, or
    that has no newline; at a segment whose content does not match its index line; and at a
    segment that is missing without a ``pruned`` line. Pruned segments are skipped: the chain is
    checked from the oldest kept segment on, anchored at the hashes the index keeps."""
    path = Path(path)
    idx = load_index(path.with_name(path.stem + ".index.jsonl"))
    expected, prev = 1, GENESIS_PREV
    checked = 0
    for e in idx.segments:
        seg = path.with_name(str(e["file"]))
        first, last = int(e["first_seq"]), int(e["last_seq"])
        if e["file"] in idx.pruned and not seg.exists():
            expected, prev = last + 1, str(e["last_hash"])
            continue
        if not seg.exists():
            raise ChainError(f"segment {e['file']} is missing and was not pruned", seq=first)
        if first != expected or e["first_prev"] != prev:
            raise ChainError(f"segment {e['file']} does not continue the chain", seq=first)
        nxt, prev = _verify_file(seg, expected, prev)
        if nxt != last + 1 or prev != e["last_hash"]:
            raise ChainError(f"segment {e['file']} does not match its index line", seq=min(nxt, last + 1))
        checked += nxt - expected
        expected = nxt
    if path.exists():
        nxt, prev = _verify_file(path, expected, prev)
        checked += nxt - expected
    return checked
