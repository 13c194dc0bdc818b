"""``payloads.seal_to_file`` (the SDK's sealing of a large payload into a private temporary file while
a worker thread hashes it): the same bytes, size and hash as one serial pass of the same sealer at
every block and chunk boundary, from bytes and from a file; and on a real failure part-way (disk
full, an interrupt or an error while reading the source, the hashing thread failing) the temporary
file is gone, no thread is left behind and the original error is raised."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
import types
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gateway.client import payloads
from gateway.client.payloads import READ_BLOCK
from gateway.core import sealing
from gateway.core.sealing import CHUNK

SK = X25519PrivateKey.generate()
PK = SK.public_key()
B = sealing.Binding("pay_seal2file", "sess_a", "agent_a", "application/octet-stream")
FIXED: dict[str, Any] = {"file_key": bytes(range(32)), "nonce": bytes(range(16))}
EPH = bytes(range(100, 132))
SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, READ_BLOCK, READ_BLOCK + 1, 3 * READ_BLOCK + READ_BLOCK // 2]
ROOT = Path(__file__).resolve().parents[2]


def _sealer() -> sealing.Sealer:
    return sealing.Sealer(PK, B, eph=X25519PrivateKey.from_private_bytes(EPH), **FIXED)


def _serial(data: bytes) -> bytes:
    s = _sealer()
    return b"".join((s.prefix, s.update(data), s.finish()))


def _ours(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("uomp-payload-"))


@pytest.mark.parametrize("kind", ["bytes", "file"])
@pytest.mark.parametrize("size", SIZES)
def test_same_file_size_and_hash_as_a_serial_pass(
    size: int, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random.Random(size).randbytes(size)
    source: bytes | Path = data
    if kind == "file":
        source = tmp_path / "plain.bin"
        source.write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(
        payloads.sealing,
        "Sealer",
        functools.partial(sealing.Sealer, eph=X25519PrivateKey.from_private_bytes(EPH), **FIXED),
    )
    sealed = payloads.seal_to_file(PK, B, source, directory=str(out))
    try:
        got = sealed.path.read_bytes()
        assert got == _serial(data)
        assert sealed.envelope.size == len(got)
        assert sealed.envelope.hash == "sha256:" + hashlib.sha256(got).hexdigest()
        assert sealed.envelope.encryption == _sealer().encryption()
        assert sealing.open_bytes(SK, B, sealed.envelope.encryption, got) == data
        assert stat.S_IMODE(sealed.path.stat().st_mode) == 0o600
    finally:
        sealed.remove()
    assert _ours(out) == []


def test_a_bytearray_and_a_memoryview_seal_like_bytes(tmp_path: Path) -> None:
    data = random.Random(7).randbytes(2 * READ_BLOCK + 3)
    for source in (bytearray(data), memoryview(data)):
        sealed = payloads.seal_to_file(PK, B, source, directory=str(tmp_path))
        got = sealed.path.read_bytes()
        sealed.remove()
        assert sealed.envelope.hash == "sha256:" + hashlib.sha256(got).hexdigest()
        assert sealing.open_bytes(SK, B, sealed.envelope.encryption, got) == data


def seal_traced(src: Path, tmp_path: Path) -> tuple[payloads.SealedFile, int]:
    """``src`` sealed, and the peak of the Python allocations while it was."""
    tracemalloc.start()
    try:
        sealed = payloads.seal_to_file(PK, B, src, directory=str(tmp_path))
        return sealed, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_stays_a_few_blocks_whatever_the_size(tmp_path: Path) -> None:
    src = tmp_path / "plain.bin"
    with open(src, "wb") as fh:
        for _ in range(48):
            fh.write(os.urandom(READ_BLOCK))
    sealed, peak = seal_traced(src, tmp_path)
    sealed.remove()
    assert peak < (payloads.HASH_AHEAD + 4) * READ_BLOCK, peak


# Disk full, for real: the child process may write files of at most 2.5 MiB (RLIMIT_FSIZE, with
# SIGXFSZ ignored), so the write that crosses it fails with EFBIG part-way through the payload.
_DISK_FULL = """
import json, os, resource, signal, sys, threading
from pathlib import Path
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from gateway.client import payloads
from gateway.core import sealing
out, source = sys.argv[1], sys.argv[2]
pk = X25519PrivateKey.generate().public_key()
b = sealing.Binding("pay_full", "s", "a", "application/octet-stream")
data = os.urandom(8 << 20) if source == "-" else Path(source)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (5 << 19, resource.RLIM_INFINITY))
before = threading.active_count()
try:
    payloads.seal_to_file(pk, b, data, directory=out)
    got = {"error": None}
except BaseException as e:
    got = {"error": type(e).__name__, "errno": getattr(e, "errno", None)}
got.update(threads=[before, threading.active_count()], left=os.listdir(out))
print(json.dumps(got))
"""


@pytest.mark.parametrize("kind", ["bytes", "file"])
def test_disk_full_part_way_removes_the_file_and_raises_the_write_error(kind: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    source = "-"
    if kind == "file":
        (tmp_path / "plain.bin").write_bytes(os.urandom(8 << 20))
        source = str(tmp_path / "plain.bin")
    run = subprocess.run(
        [sys.executable, "-c", _DISK_FULL, str(out), source], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got == {"error": "OSError", "errno": errno.EFBIG, "threads": [1, 1], "left": []}


class SourceFailed(Exception):
    pass


def _raise_source_failed(signum: int, frame: object) -> None:
    raise SourceFailed("the source broke off")


@pytest.mark.parametrize(
    ("signum", "handler", "expected"),
    [
        (signal.SIGINT, signal.default_int_handler, KeyboardInterrupt),
        (signal.SIGUSR1, _raise_source_failed, SourceFailed),
    ],
)
def test_an_interrupt_or_error_while_reading_removes_the_file_and_stops_the_worker(
    signum: int, handler: Any, expected: type[BaseException], tmp_path: Path
) -> None:
    """The source is a FIFO: a feeder thread writes 3 MiB, waits until the sealed file holds over
    2 MiB (the seal is part-way, blocked reading the fourth block), then signals the main thread,
    whose handler raises inside the read."""
    fifo = tmp_path / "source.fifo"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    out.mkdir()
    main = threading.get_ident()
    seen: list[int] = []

    def feed() -> None:
        with open(fifo, "wb") as fh:
            fh.write(os.urandom(3 * READ_BLOCK))
            fh.flush()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                sizes = [(out / n).stat().st_size for n in _ours(out)]
                if sizes and sizes[0] > 2 * READ_BLOCK:
                    seen.append(sizes[0])
                    break
                time.sleep(0.01)
            signal.pthread_kill(main, signum)
            time.sleep(0.5)  # the writing end stays open until the signal has been handled

    before = threading.active_count()
    old = signal.signal(signum, handler)
    feeder = threading.Thread(target=feed)
    try:
        feeder.start()
        with pytest.raises(expected):
            payloads.seal_to_file(PK, B, fifo, directory=str(out))
    finally:
        feeder.join()
        signal.signal(signum, old)
    assert seen, "the sealed file never passed 2 MiB"
    assert _ours(out) == []
    assert threading.active_count() == before


def test_a_source_that_cannot_be_opened_leaves_nothing(tmp_path: Path) -> None:
    before = threading.active_count()
    with pytest.raises(FileNotFoundError):
        payloads.seal_to_file(PK, B, tmp_path / "missing.bin", directory=str(tmp_path))
    assert _ours(tmp_path) == []
    assert threading.active_count() == before


class _Digest:
    """SHA-256 that takes its time (a slow, busy core), and fails at one chosen block: hashlib could
    only under memory exhaustion."""

    fail_on: Any = None

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._rng = random.Random(5)
        self.calls = 0

    def update(self, b: bytes) -> None:
        self.calls += 1
        time.sleep(self._rng.uniform(0, 0.01))
        if self.fail_on is not None and self.fail_on(self.calls, b):
            raise MemoryError("no memory for the hash")
        self._h.update(b)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def test_a_slow_hash_keeps_the_order_and_a_few_blocks_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sealing thread runs ahead of the hashing thread by a few blocks, never more."""
    monkeypatch.setattr(payloads, "hashlib", types.SimpleNamespace(sha256=_Digest))
    src = tmp_path / "plain.bin"
    src.write_bytes(os.urandom(24 * READ_BLOCK + 5))
    sealed, peak = seal_traced(src, tmp_path)
    got = sealed.path.read_bytes()
    sealed.remove()
    assert sealed.envelope.hash == "sha256:" + hashlib.sha256(got).hexdigest()
    assert peak < (payloads.HASH_AHEAD + 4) * READ_BLOCK, peak


@pytest.mark.parametrize("where", ["fourth block", "last block"])
def test_the_hashing_thread_failing_removes_the_file_and_raises_its_error(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if where == "fourth block":
        monkeypatch.setattr(_Digest, "fail_on", staticmethod(lambda calls, b: calls == 4))
    else:  # the sealer's final chunk: the 5 bytes left over and the tag
        monkeypatch.setattr(_Digest, "fail_on", staticmethod(lambda calls, b: len(b) == 5 + sealing.TAG))
    monkeypatch.setattr(payloads, "hashlib", types.SimpleNamespace(sha256=_Digest))
    before = threading.active_count()
    with pytest.raises(MemoryError, match="no memory for the hash"):
        payloads.seal_to_file(PK, B, os.urandom(16 * READ_BLOCK + 5), directory=str(tmp_path))
    assert _ours(tmp_path) == []
    assert threading.active_count() == before
