"""Readers for the importer: the source file (bounded, read twice for CSV), CSV records and the
elements of a JSON array, decoded strictly as UTF-8; the format and delimiter from the options.

Readers yield raw records (cells, or parsed JSON elements) and count the bytes they read into a
:class:`Progress`; they know nothing about fields, values or the store.
"""

from __future__ import annotations

import codecs
import csv
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from gateway.errors import ErrorCode, UompError
from gateway.guard.importer.report import FileError, ImportLimits

FORMATS = ("csv", "json")

# progress(done_bytes, total_bytes): called with 0 when reading starts, after each read, and with
# done_bytes == total_bytes when reading ends (also when it fails).
ProgressCallback = Callable[[int, int], None]


class Progress:
    """Bytes read so far, handed to the caller's callback (the CLI draws the bar; nothing here does)."""

    __slots__ = ("callback", "done", "total")

    def __init__(self, total: int, callback: ProgressCallback | None) -> None:
        self.total = max(total, 1)
        self.callback = callback
        self.done = 0
        if callback is not None:
            callback(0, self.total)

    def add(self, n: int) -> None:
        self.done += n
        if self.callback is not None:
            self.callback(self.done, self.total)

    def end(self) -> None:
        if self.callback is not None:
            self.done = self.total
            self.callback(self.total, self.total)


class Source:
    """The open file, read twice for CSV (profile pass, then conversion pass), bounded in size."""

    def __init__(self, path: Path, limits: ImportLimits) -> None:
        self.path = path
        self.limits = limits
        try:
            self.fh: BinaryIO = open(path, "rb")  # closed by close()
        except OSError as exc:
            raise UompError(ErrorCode.INVALID_REQUEST, f"cannot open {path}: {exc.strerror}") from exc
        st = os.fstat(self.fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            self.fh.close()
            raise UompError(ErrorCode.INVALID_REQUEST, f"{path} is not a regular file")
        if st.st_size > limits.max_file_bytes:
            self.fh.close()
            raise UompError(ErrorCode.IMPORT_INVALID, f"the file is larger than {limits.max_file_bytes} bytes")
        self.size = st.st_size
        self.stamp = (st.st_size, st.st_mtime_ns)
        self.read_bytes = 0

    def rewind(self) -> None:
        st = os.fstat(self.fh.fileno())
        if (st.st_size, st.st_mtime_ns) != self.stamp:
            raise FileError("the file changed while it was being imported")
        self.fh.seek(0)
        self.read_bytes = 0

    def count(self, n: int) -> None:
        self.read_bytes += n
        if self.read_bytes > self.limits.max_file_bytes:
            raise FileError(f"the file is larger than {self.limits.max_file_bytes} bytes")

    def close(self) -> None:
        self.fh.close()


def _csv_lines(src: Source, progress: Progress, state: dict[str, int]) -> Iterator[str]:
    """Physical lines, decoded strictly as UTF-8, each bounded; counts lines in ``state``."""
    limit = src.limits.max_line_bytes
    first = True
    while True:
        raw = src.fh.readline(limit + 1)
        if not raw:
            return
        state["line"] += 1
        if len(raw) > limit:
            raise FileError(f"line {state['line']} is longer than {limit} bytes", state["line"])
        src.count(len(raw))
        progress.add(len(raw))
        if first:
            first = False
            if raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FileError(f"line {state['line']} is not valid UTF-8", state["line"]) from exc


def csv_records(
    src: Source, delimiter: str, progress: Progress, blank: list[int] | None = None
) -> Iterator[tuple[int, list[str]]]:
    """(start line, cells) for each non-blank record."""
    state = {"line": 0}
    reader = csv.reader(
        _csv_lines(src, progress, state), delimiter=delimiter, quotechar='"', doublequote=True, strict=True
    )
    consumed = 0
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise FileError(f"malformed CSV at line {state['line']} ({exc})", state["line"]) from exc
        start = consumed + 1
        consumed = reader.line_num
        if not cells or all(not c.strip() for c in cells):
            if blank is not None:
                blank[0] += 1
            continue
        yield start, cells


class JsonElements:
    """Iterate the elements of a JSON array (or the one root object) without loading the file."""

    CHUNK = 256 * 1024

    def __init__(self, src: Source, progress: Progress) -> None:
        self.src = src
        self.progress = progress
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.buf = ""
        self.pos = 0
        self.dropped = 0
        self.eof = False
        self.flags: dict[str, bool] = {}
        self.json = json.JSONDecoder(object_pairs_hook=self._pairs, parse_constant=self._constant)
        self.first_chunk = True

    def _pairs(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            self.flags["duplicate"] = True
        return out

    def _constant(self, name: str) -> Any:
        self.flags["constant"] = True
        return None

    def _offset(self) -> int:
        return self.dropped + self.pos

    def _fill(self) -> bool:
        if self.eof:
            return False
        raw = self.src.fh.read(self.CHUNK)
        if self.pos > self.CHUNK:
            self.dropped += self.pos
            self.buf = self.buf[self.pos :]
            self.pos = 0
        if not raw:
            self.eof = True
            try:
                self.buf += self.decoder.decode(b"", final=True)
            except UnicodeDecodeError as exc:
                raise FileError("the file is not valid UTF-8 (at its end)") from exc
            return False
        self.src.count(len(raw))
        self.progress.add(len(raw))
        if self.first_chunk:
            self.first_chunk = False
            if raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
        try:
            self.buf += self.decoder.decode(raw)
        except UnicodeDecodeError as exc:
            raise FileError(f"the file is not valid UTF-8 (near byte {self.src.read_bytes})") from exc
        return True

    def _skip_ws(self) -> str:
        """The next non-white-space character ('' at end of file), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                return ""

    def _value(self, index: int) -> Any:
        limit = self.src.limits.max_line_bytes
        while True:
            try:
                value, end = self.json.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                if len(self.buf) - self.pos > limit:
                    raise FileError(f"item [{index}] is larger than {limit} bytes", index) from exc
                if self._fill():
                    continue
                raise FileError(f"invalid JSON in item [{index}] (character {self.dropped + exc.pos})", index) from exc
            except RecursionError as exc:
                raise FileError(f"item [{index}] is nested too deeply", index) from exc
            if end == len(self.buf) and self._fill():
                continue  # a number or literal may go on in the next chunk: decode again
            if end - self.pos > limit:
                raise FileError(f"item [{index}] is larger than {limit} bytes", index)
            self.pos = end
            return value

    def __iter__(self) -> Iterator[tuple[int, Any, dict[str, bool]]]:
        ch = self._skip_ws()
        if ch == "{":
            self.flags = {}
            obj = self._value(0)
            yield 0, obj, self.flags
            if self._skip_ws() != "":
                raise FileError(f"unexpected data after the root object (character {self._offset()})")
            return
        if ch != "[":
            raise FileError("the JSON root must be an object or an array of objects")
        self.pos += 1
        index = 0
        if self._skip_ws() == "]":
            self.pos += 1
        else:
            while True:
                self.flags = {}
                yield index, self._value(index), self.flags
                index += 1
                ch = self._skip_ws()
                self.pos += 1
                if ch == "]":
                    break
                if ch != ",":
                    where = self._offset() - 1
                    raise FileError(f"invalid JSON after item [{index - 1}] (character {where})", index - 1)
                self._skip_ws()
        if self._skip_ws() != "":
            raise FileError(f"unexpected data after the array (character {self._offset()})")


def pick_format(path: Path, fmt: str | None) -> str:
    if fmt is not None:
        f = fmt.lower()
        if f not in FORMATS:
            raise UompError(ErrorCode.INVALID_REQUEST, "--format must be csv or json")
        return f
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv", ".txt"):
        return "csv"
    if suffix == ".json":
        return "json"
    raise UompError(ErrorCode.INVALID_REQUEST, f"cannot tell the format of {path.name}; pass --format csv or json")


def pick_delimiter(path: Path, delimiter: str | None) -> str:
    if delimiter is None:
        return "\t" if path.suffix.lower() == ".tsv" else ","
    names = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";", "pipe": "|"}
    d = names.get(delimiter.lower(), delimiter)
    if len(d) != 1 or d in '"\r\n' or d.isalnum():
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            "--delimiter must be one character (not a letter, digit, quote or new line), or tab",
        )
    return d
