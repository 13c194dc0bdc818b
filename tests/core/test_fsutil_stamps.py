"""fsutil.stamps: what every file watcher compares (keys, CRL, TLS files, the uplink's trust bundle).
A write, a replacement, a creation and a removal each change the result; nothing else does."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.fsutil import atomic_write, stamps


def test_each_kind_of_change_changes_the_stamps_and_a_look_alone_does_not(tmp_path: Path) -> None:
    a, b, missing = tmp_path / "a", tmp_path / "b", tmp_path / "missing"
    a.write_bytes(b"one")
    b.write_bytes(b"two")
    first = stamps([a, b, missing])
    assert len(first) == 3 and first[2] is None
    assert first[0] is not None and first[0][0] == os.stat(a).st_ino and first[0][2] == 3
    assert stamps([a, b, missing]) == first  # reading, or looking again, changes nothing
    assert a.read_bytes() == b"one" and stamps([a, b, missing]) == first

    # replaced atomically with the same size and the same mtime: the inode tells
    st = os.stat(b)
    atomic_write(b, b"TWO")
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    replaced = stamps([a, b, missing])
    assert replaced[1] != first[1] and replaced[0] == first[0]

    # written in place, same size: the mtime tells
    st = os.stat(a)
    with open(a, "r+b") as fh:
        fh.write(b"ONE")
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    written = stamps([a, b, missing])
    assert written[0] != replaced[0] and written[1] == replaced[1]

    # grown, same mtime: the size tells
    st = os.stat(a)
    with open(a, "ab") as fh:
        fh.write(b"!")
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert stamps([a])[0] != written[0]

    # created, then removed
    missing.write_bytes(b"")
    assert stamps([missing])[0] is not None
    missing.unlink()
    assert stamps([missing]) == (None,)


def test_an_unreadable_path_is_none_not_an_error(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    assert stamps([f / "below-a-file", tmp_path / "no" / "dir", ""]) == (None, None, None)
    assert stamps([]) == ()
