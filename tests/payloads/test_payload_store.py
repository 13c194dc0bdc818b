"""The payload store: atomic commit with an index, caps, single-use upload URLs, expiry, crash
recovery and a really full disk (a 1 MiB tmpfs when this machine lets root mount one)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.payloads.store import Limits, PayloadError, PayloadStore, new_payload_id

ENC = {"algorithm": "HPKE-X25519-SHA256-AES256GCM-STREAM64K", "sender_public_key": "AA==", "nonce": "AA=="}


def _upload(
    store: PayloadStore, data: bytes, *, session: str = "sess_a", pid: str | None = None, declared: str | None = "auto"
) -> str:
    pid = pid or new_payload_id()
    up = store.begin(payload_id=pid, session_id=session, agent_id="agent_a", format="text/plain", encryption=ENC)
    for i in range(0, len(data), 1000):
        up.write(data[i : i + 1000])
    digest = "sha256:" + hashlib.sha256(data).hexdigest() if declared == "auto" else declared
    up.commit(declared_hash=digest, declared_size=len(data))
    return pid


def test_round_trip_and_listing(tmp_path: Path) -> None:
    store = PayloadStore.open(tmp_path / "p")
    pid = _upload(store, b"x" * 5000)
    meta = store.get(pid)
    assert meta.size == 5000 and meta.hash == "sha256:" + hashlib.sha256(b"x" * 5000).hexdigest()
    assert b"".join(store.read(pid)) == b"x" * 5000
    assert [m.payload_id for m in store.list(session_id="sess_a")] == [pid]
    assert store.list(session_id="sess_b") == []
    assert oct((tmp_path / "p" / "blobs" / pid).stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "p").stat().st_mode & 0o777) == "0o700"
    assert store.delete(pid) and not store.list()
    with pytest.raises(PayloadError) as e:
        store.get(pid)
    assert e.value.code == "NOT_FOUND"


@pytest.mark.parametrize(
    ("declared", "code"),
    [
        ("sha256:" + "0" * 64, "PAYLOAD_HASH_MISMATCH"),
    ],
    ids=["hash-mismatch"],
)
def test_refused_commits_leave_nothing(tmp_path: Path, declared: str, code: str) -> None:
    store = PayloadStore.open(tmp_path / "p")
    with pytest.raises(PayloadError) as e:
        _upload(store, b"abc", declared=declared)
    assert e.value.code == code
    assert store.list() == [] and not any((tmp_path / "p" / "blobs").iterdir())
    assert not any((tmp_path / "p" / "tmp").iterdir())


def test_size_cap_and_declared_size(tmp_path: Path) -> None:
    store = PayloadStore.open(tmp_path / "p", limits=Limits(max_bytes=4096))
    with pytest.raises(PayloadError) as e:
        _upload(store, b"y" * 5000)
    assert e.value.code == "PAYLOAD_TOO_LARGE"
    up = store.begin(payload_id=new_payload_id(), session_id="s", agent_id="a", format="f", encryption=ENC)
    up.write(b"12345")
    with pytest.raises(PayloadError) as e:
        up.commit(declared_size=6)
    assert e.value.code == "PAYLOAD_SIZE_MISMATCH"
    assert store.list() == [] and not any((tmp_path / "p" / "tmp").iterdir())


def test_per_session_caps(tmp_path: Path) -> None:
    store = PayloadStore.open(tmp_path / "p", limits=Limits(max_per_session=2, max_bytes_per_session=250))
    _upload(store, b"a" * 100)
    _upload(store, b"b" * 100)
    with pytest.raises(PayloadError) as e:
        _upload(store, b"c")
    assert e.value.code == "PAYLOAD_QUOTA_EXCEEDED"
    _upload(store, b"d" * 100, session="sess_b")
    with pytest.raises(PayloadError) as e:
        _upload(store, b"e" * 200, session="sess_b")
    assert e.value.code == "PAYLOAD_QUOTA_EXCEEDED"


def test_duplicate_id_and_bad_id(tmp_path: Path) -> None:
    store = PayloadStore.open(tmp_path / "p")
    pid = _upload(store, b"one")
    with pytest.raises(PayloadError) as e:
        _upload(store, b"two", pid=pid)
    assert e.value.code == "PAYLOAD_EXISTS"
    assert b"".join(store.read(pid)) == b"one"
    for bad in ["../x", "pay_", "pay_a/b/c/d/e", "x" * 10]:
        with pytest.raises(PayloadError):
            store.begin(payload_id=bad, session_id="s", agent_id="a", format="f", encryption=ENC)


def test_crash_leftovers_are_removed_at_open(tmp_path: Path) -> None:
    store = PayloadStore.open(tmp_path / "p")
    keep = _upload(store, b"kept")
    # A crash mid-body (temp file) and a crash after the rename but before the index row.
    cut = new_payload_id()
    up = store.begin(payload_id=cut, session_id="sess_s", agent_id="a", format="f", encryption=ENC)
    up.write(b"partial")
    (tmp_path / "p" / "blobs" / "pay_orphan_orphan").write_bytes(b"no row")
    (tmp_path / "p" / "tmp" / "stray.part").write_bytes(b"not named after an upload")
    store.close()
    store = PayloadStore.open(tmp_path / "p")
    assert [m.payload_id for m in store.list()] == [keep]
    assert sorted(p.name for p in (tmp_path / "p" / "blobs").iterdir()) == [keep]
    # the cut upload's file is kept, named after it, until its removal is audited
    assert [(i.payload_id, i.session_id, i.agent_id) for i in store.interrupted] == [(cut, "sess_s", "a")]
    assert [p.name for p in (tmp_path / "p" / "tmp").iterdir()] == [store.interrupted[0].path.name]
    assert store.interrupted[0].event_id.startswith("gw_") and len(store.interrupted[0].event_id) == 35
    store.forget_interrupted(store.interrupted[0])
    assert store.interrupted == [] and not any((tmp_path / "p" / "tmp").iterdir())


def test_expiry(tmp_path: Path) -> None:
    store = PayloadStore.open(tmp_path / "p", limits=Limits(ttl_seconds=60))
    pid = _upload(store, b"soon gone")
    created = store.get(pid).created_at
    assert store.gc(now=created + 59) == 0
    assert store.gc(now=created + 61) == 1
    assert store.list() == [] and not (tmp_path / "p" / "blobs" / pid).exists()


def test_upload_urls_are_single_use_bounded_and_expire(tmp_path: Path) -> None:
    store = PayloadStore.open(tmp_path / "p", limits=Limits(max_bytes=1 << 20))
    token, _ = store.issue_upload_url(session_id="s", agent_id="a", max_size=1000, ttl=60, now=1000.0)
    assert store.consume_upload_url(token, now=1001.0) == ("s", "a", 1000)
    with pytest.raises(PayloadError) as e:
        store.consume_upload_url(token, now=1002.0)
    assert e.value.code == "UPLOAD_URL_INVALID"
    late, _ = store.issue_upload_url(session_id="s", agent_id="a", max_size=1000, ttl=60, now=1000.0)
    with pytest.raises(PayloadError):
        store.consume_upload_url(late, now=1061.0)
    with pytest.raises(PayloadError):
        store.consume_upload_url("forged-token", now=1001.0)
    with pytest.raises(PayloadError):
        store.issue_upload_url(session_id="s", agent_id="a", max_size=1000, ttl=601)
    with pytest.raises(PayloadError):
        store.issue_upload_url(session_id="s", agent_id="a", max_size=(1 << 20) + 1, ttl=60)


@contextlib.contextmanager
def small_fs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root): " + r.stderr.decode()[:100])
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_fails_cleanly_and_recovers(tmp_path: Path) -> None:
    with small_fs(tmp_path / "fs", "1m") as fs:
        store = PayloadStore.open(fs / "p", limits=Limits(max_bytes=8 << 20, max_bytes_per_session=64 << 20))
        kept = _upload(store, b"k" * 100_000)
        with pytest.raises(PayloadError) as e:
            _upload(store, os.urandom(2 << 20))
        assert e.value.code == "PAYLOAD_STORE_FULL"
        assert [m.payload_id for m in store.list()] == [kept]
        assert not any((fs / "p" / "tmp").iterdir())
        # Space returns (the kept payload is removed): the next upload goes through.
        store.delete(kept)
        again = _upload(store, b"z" * 300_000)
        assert b"".join(store.read(again)) == b"z" * 300_000
        store.close()


def test_a_pending_row_is_invisible_until_published_and_survives_recovery(tmp_path: Path) -> None:
    store = PayloadStore.open(tmp_path / "p", limits=Limits(max_per_session=1))
    pid = new_payload_id()
    up = store.begin(payload_id=pid, session_id="sess_a", agent_id="agent_a", format="text/plain", encryption=ENC)
    up.write(b"sealed")
    meta = up.commit(
        declared_hash="sha256:" + hashlib.sha256(b"sealed").hexdigest(),
        declared_size=6,
        event_id="gw_" + "0" * 32,
        origin={"X-UOMP-Verified-Listener": "mtls"},
    )
    assert meta.state == "pending" and meta.event_id == "gw_" + "0" * 32
    with pytest.raises(PayloadError) as e:
        store.get(pid)
    assert e.value.code == "NOT_FOUND"
    with pytest.raises(PayloadError):
        list(store.read(pid))
    assert store.list() == [] and [m.payload_id for m in store.pending()] == [pid]
    store.mark_opened(pid)  # not a payload yet: nothing to mark
    with pytest.raises(PayloadError) as e:  # it counts against the caps already
        store.check_caps("sess_a", extra_bytes=0)
    assert e.value.code == "PAYLOAD_QUOTA_EXCEEDED"
    store.close()
    store = PayloadStore.open(tmp_path / "p")  # a restart keeps it (complete and checked), still pending
    found = store.find(pid)
    assert found is not None and found.state == "pending" and found.origin == {"X-UOMP-Verified-Listener": "mtls"}
    assert found.same_upload(
        session_id="sess_a",
        agent_id="agent_a",
        format="text/plain",
        size=6,
        digest="sha256:" + hashlib.sha256(b"sealed").hexdigest(),
    )
    assert not found.same_upload(
        session_id="sess_a", agent_id="agent_a", format="text/plain", size=6, digest="sha256:" + "0" * 64
    )
    assert store.publish(pid).state == "stored" and store.publish(pid).state == "stored"  # idempotent
    assert [m.payload_id for m in store.list()] == [pid] and store.pending() == []
    assert store.get(pid).opened_at is None


def test_an_index_from_before_pending_rows_is_migrated(tmp_path: Path) -> None:
    root = tmp_path / "p"
    root.mkdir(mode=0o700)
    import sqlite3

    conn = sqlite3.connect(root / "index.db")
    conn.executescript(
        "CREATE TABLE payloads (payload_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, agent_id TEXT"
        " NOT NULL, format TEXT NOT NULL, size INTEGER NOT NULL, hash TEXT NOT NULL, encryption TEXT"
        " NOT NULL, created_at REAL NOT NULL, expires_at REAL NOT NULL, opened_at REAL);"
        "INSERT INTO payloads VALUES ('pay_oldoldold1', 's', 'a', 'text/plain', 3, 'sha256:"
        + "1" * 64
        + "', '{}', 1.0, 9e12, NULL);"
    )
    conn.commit()
    conn.close()
    (root / "blobs").mkdir(mode=0o700)
    (root / "blobs" / "pay_oldoldold1").write_bytes(b"abc")
    store = PayloadStore.open(root)
    assert [(m.payload_id, m.state) for m in store.list()] == [("pay_oldoldold1", "stored")]
