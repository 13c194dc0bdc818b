"""Contract tests for the seams: what ANY memory store or payload store must do, run against every
implementation (one each today). Behaviour, not signatures: mypy checks the signatures against the
Protocols (gateway.guard.storage.MemoryStorage, gateway.payloads.store.PayloadStorage).

A memory store is run here once it is in the production table (gateway.guard.stores.MEMORY_STORES,
chosen by ``[guard] store``), opened the way the guard opens it; a payload store is added to
PAYLOAD_STORES. The anchoring seam
(gateway.anchor.base.AnchorBackend) has its contract test in tests/anchor/test_anchor_contract.py, run over
the none, evm and starknet backends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.anchor.base import AnchorBackend
from gateway.anchor.none import NoneBackend
from gateway.config import GuardConfig, Paths
from gateway.errors import ErrorCode, UompError
from gateway.guard.items import MemoryItem
from gateway.guard.storage import MemoryStorage, ReadFilter, json_path
from gateway.guard.store import MemoryStore
from gateway.guard.stores import MEMORY_STORES, open_memory_store
from gateway.payloads.store import Limits, PayloadError, PayloadStorage, PayloadStore

TS = "2026-07-12T10:00:00Z"

PAYLOAD_STORES: dict[str, Callable[[Path, Limits], PayloadStorage]] = {
    "files+sqlite": lambda d, limits: PayloadStore.open(d / "payloads", limits=limits),
}


def item(key: str, value: Any = "v", tags: tuple[str, ...] = ("t",), sensitivity: str = "low") -> MemoryItem:
    return MemoryItem(key, value, tags, sensitivity, "user", TS, TS)


SEALED = "sqlite, sealed home (SQLCipher)"  # the production store as a sealed home opens it (gateway/atrest/memdb.py)


@pytest.fixture(params=[*sorted(MEMORY_STORES), SEALED])
def mem(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MemoryStorage]:
    if request.param == SEALED:
        store: MemoryStorage = MemoryStore(Paths(tmp_path).memory_db, key=hashlib.sha256(b"seam test key").digest())
    else:
        store = open_memory_store(Paths(tmp_path), GuardConfig(store=request.param))
    yield store
    store.close()


def test_the_configured_store_is_the_one_opened_and_an_unknown_name_is_refused(tmp_path: Path) -> None:
    default = open_memory_store(Paths(tmp_path), GuardConfig())
    try:
        assert GuardConfig().store == "sqlite" and isinstance(default, MemoryStore)
        assert default.path == Paths(tmp_path).memory_db
    finally:
        default.close()
    for name in ("", "SQLite", "postgres", "sqlite "):
        with pytest.raises(UompError) as e:
            open_memory_store(Paths(tmp_path / "other"), GuardConfig(store=name))
        assert e.value.code == ErrorCode.CONFIG_ERROR
        assert "guard.store" in e.value.message and all(n in e.value.message for n in MEMORY_STORES)
    assert not (tmp_path / "other").exists()  # nothing was created for a refused name


def code_of(excinfo: pytest.ExceptionInfo[Any]) -> str:
    return str(excinfo.value.code)


# ------------------------------------------------------------------------------ memory store


def test_memory_put_get_replace_delete(mem: MemoryStorage) -> None:
    assert mem.get("a") is None and mem.count() == 0
    mem.put(item("a", {"n": 1}))
    assert mem.get("a") == item("a", {"n": 1})
    with pytest.raises(UompError) as e:
        mem.put(item("a", "other"))
    assert code_of(e) == ErrorCode.INVALID_REQUEST
    assert mem.get("a") == item("a", {"n": 1})  # the refused write changed nothing
    mem.put(item("a", "other"), replace=True)
    assert mem.get("a") == item("a", "other")
    assert mem.delete("a") is True
    assert mem.delete("a") is False
    assert mem.get("a") is None and mem.count() == 0


def test_memory_meta_has_no_value(mem: MemoryStorage) -> None:
    mem.put(item("k", "secret", ("x", "y"), "high"))
    meta = mem.get_meta("k")
    assert meta is not None and set(meta.tags) == {"x", "y"} and meta.sensitivity == "high"
    assert "secret" not in repr(meta)
    assert mem.get_meta("absent") is None


def test_memory_get_if_reads_the_value_only_when_allowed(mem: MemoryStorage) -> None:
    mem.put(item("k", "secret", ("x",), "high"))
    seen: list[Any] = []

    def allow(ok: bool) -> Callable[[Any], bool]:
        def decide(meta: Any) -> bool:
            seen.append(meta)
            return ok

        return decide

    meta, got = mem.get_if("k", allow(True))
    assert meta is not None and meta.sensitivity == "high" and got == item("k", "secret", ("x",), "high")
    meta, got = mem.get_if("k", allow(False))  # refused: metadata only
    assert meta is not None and got is None
    assert mem.get_if("absent", allow(True)) == (None, None)  # missing: the decision sees None, no value
    assert seen[-1] is None and len(seen) == 3
    if isinstance(mem, MemoryStore):
        before = mem.value_loads
        mem.get_if("k", allow(False))
        mem.get_if("absent", allow(False))
        assert mem.value_loads == before  # a refused and a missing key never load a value
        mem.get_if("k", allow(True))
        assert mem.value_loads == before + 1


def test_memory_put_many_is_all_or_nothing(mem: MemoryStorage) -> None:
    assert mem.put_many([item("a"), item("b")]) == 2
    with pytest.raises(UompError) as e:
        mem.put_many([item("c"), item("d", sensitivity="bogus")])
    assert code_of(e) == ErrorCode.INVALID_REQUEST
    with pytest.raises(UompError):
        mem.put_many([item("e"), item("a")])  # an existing key without replace
    assert [i.key for i in mem.list()] == ["a", "b"]


def test_memory_list_by_tag_with_paging(mem: MemoryStorage) -> None:
    mem.put_many([item(f"k{i}", tags=("even",) if i % 2 == 0 else ("odd",)) for i in range(6)])
    assert [i.key for i in mem.list(tag="even")] == ["k0", "k2", "k4"]
    assert [i.key for i in mem.list(limit=2, offset=1)] == ["k1", "k2"]
    assert mem.list(tag="none") == []
    assert mem.count() == 6


def test_memory_tag_page_applies_the_grant_rules(mem: MemoryStorage) -> None:
    mem.put_many(
        [
            item("a", tags=("t",)),
            item("b", tags=("t", "private")),
            item("c", tags=("t",), sensitivity="high"),
            item("d", tags=("t",), sensitivity="high"),
            item("e", tags=("t",)),
            item("z", tags=("other",)),
        ]
    )
    flt = ReadFilter(keys=("d",), deny_keys=("e",), deny_tags=("private",))
    items, more = mem.tag_page("t", flt, after=None, limit=10, max_bytes=1 << 20)
    assert [i.key for i in items] == ["a", "d"] and more is False  # b: denied tag; c: high, not named; e: denied
    # keyset paging: stable order, "more" says whether another page follows
    open_flt = ReadFilter()
    first, more = mem.tag_page("t", open_flt, after=None, limit=2, max_bytes=1 << 20)
    assert [i.key for i in first] == ["a", "b"] and more is True
    rest, more = mem.tag_page("t", open_flt, after="b", limit=10, max_bytes=1 << 20)
    assert [i.key for i in rest] == ["e"] and more is False  # high items need their key granted
    tiny, more = mem.tag_page("t", open_flt, after=None, limit=10, max_bytes=1)
    assert len(tiny) == 1 and more is True  # a byte budget still yields one item


def test_memory_aggregate_counts_only_granted_numbers(mem: MemoryStorage) -> None:
    mem.put_many(
        [
            item("a", {"n": 5}, ("h",)),
            item("b", {"n": 7}, ("h",)),
            item("c", {"n": "x"}, ("h",)),
            item("d", {"n": 100}, ("h",), sensitivity="high"),
            item("e", {"n": 1000}, ("other",)),
        ]
    )
    path = json_path("value.n")
    assert path is not None
    row = mem.aggregate("h", ReadFilter(), path=path)
    assert (row.count, row.total, row.minimum, row.maximum) == (2, 12, 5, 7)
    assert mem.aggregate("h", ReadFilter(), path=None).count == 3
    # a high item the grant reaches by key: counted, never summed (sealed per item, docs/security.md)
    assert mem.aggregate("h", ReadFilter(keys=("d",)), path=None).count == 4
    with pytest.raises(UompError) as refused:
        mem.aggregate("h", ReadFilter(keys=("d",)), path=path)
    assert refused.value.code is ErrorCode.AGGREGATE_HIGH_SENSITIVITY
    assert mem.aggregate("h", ReadFilter(deny_keys=("a",)), path=path).total == 7
    assert mem.aggregate("nothing", ReadFilter(), path=path).count == 0


def test_memory_atoms_partition_by_tags(mem: MemoryStorage) -> None:
    mem.put_many([item("a", {"n": 1}, ("x",)), item("b", {"n": 2}, ("x", "y")), item("c", {"n": 4}, ("y",))])
    path = json_path("value.n")
    assert path is not None
    keys = (3, 5, 7, 11)
    atoms = mem.atoms(["x", "y"], ReadFilter(), path=path, keys=keys, max_atoms=10)
    assert atoms is not None
    assert {a.pattern: (a.count, a.total) for a in atoms} == {0b01: (1, 1), 0b11: (1, 2), 0b10: (1, 4)}
    assert mem.atoms(["x", "y"], ReadFilter(), path=path, keys=keys, max_atoms=2) is None  # too many groups
    before = {a.pattern: (a.h1, a.h2) for a in atoms}
    mem.put(item("a", {"n": 9}, ("x",)), replace=True)
    after = mem.atoms(["x", "y"], ReadFilter(), path=path, keys=keys, max_atoms=10)
    assert after is not None and {a.pattern: (a.h1, a.h2) for a in after}[0b01] != before[0b01]


def test_memory_bulk_writer_is_all_or_nothing(mem: MemoryStorage) -> None:
    mem.put(item("old"))
    with mem.bulk_writer() as w:
        w.add(item("n1"))
        assert set(w.existing(["old", "n1", "absent"])) == {"old", "n1"}
        # leaving without commit: nothing was written
    assert mem.get("n1") is None
    with mem.bulk_writer() as w:
        w.add(item("n1"))
        w.add(item("n2"))
        assert w.commit() == 2
    assert mem.count() == 3
    with mem.bulk_writer(dry_run=True) as w:
        w.add(item("n3"))
        with pytest.raises(RuntimeError):
            w.commit()
    assert mem.get("n3") is None
    with pytest.raises(UompError), mem.bulk_writer() as w:
        w.add(item("bad", sensitivity="bogus"))
    with mem.bulk_writer() as w:
        w.add(item("old"))  # an existing key without replace
        with pytest.raises(UompError):
            w.commit()
    assert mem.count() == 3


def test_memory_read_snapshot_sees_one_state(mem: MemoryStorage) -> None:
    mem.put(item("a", {"n": 1}, ("h",)))
    path = json_path("value.n")
    assert path is not None
    with mem.read_snapshot():
        assert mem.aggregate("h", ReadFilter(), path=path).count == 1
        assert mem.aggregate("h", ReadFilter(), path=path).total == 1


def test_memory_closed_store_refuses(tmp_path: Path) -> None:
    for name in sorted(MEMORY_STORES):
        (tmp_path / name).mkdir()
        store = open_memory_store(Paths(tmp_path / name), GuardConfig(store=name))
        store.put(item("a"))
        store.close()
        with pytest.raises(UompError) as e:
            store.get("a")
        assert code_of(e) == ErrorCode.STORE_UNAVAILABLE


# ------------------------------------------------------------------------------ payload store

LIMITS = Limits(max_bytes=1000, max_per_session=2, max_bytes_per_session=1500, ttl_seconds=100.0)


@pytest.fixture(params=sorted(PAYLOAD_STORES))
def pay(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PayloadStorage]:
    store = PAYLOAD_STORES[request.param](tmp_path, LIMITS)
    yield store
    store.close()


def upload(
    store: PayloadStorage,
    pid: str,
    data: bytes,
    *,
    session: str = "s1",
    now: float | None = None,
    declared_hash: str | None = None,
    declared_size: int | None = None,
) -> Any:
    up = store.begin(payload_id=pid, session_id=session, agent_id="ag", format="json", encryption={"alg": "x"})
    up.write(data[: len(data) // 2])
    up.write(data[len(data) // 2 :])
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return up.commit(
        declared_hash=declared_hash or digest,
        declared_size=len(data) if declared_size is None else declared_size,
        now=now,
    )


def payload_code(fn: Callable[[], Any]) -> str:
    with pytest.raises(PayloadError) as e:
        fn()
    return str(e.value.code)


def test_payload_roundtrip(pay: PayloadStorage) -> None:
    meta = upload(pay, "pay_aaaaaaaa", b"ciphertext")
    assert (meta.payload_id, meta.session_id, meta.agent_id, meta.size) == ("pay_aaaaaaaa", "s1", "ag", 10)
    assert meta.hash == "sha256:" + hashlib.sha256(b"ciphertext").hexdigest()
    assert pay.get("pay_aaaaaaaa") == meta
    assert b"".join(pay.read("pay_aaaaaaaa", block=3)) == b"ciphertext"
    with pay.open_blob("pay_aaaaaaaa") as fh:
        assert fh.read() == b"ciphertext"
    assert [m.payload_id for m in pay.list(session_id="s1")] == ["pay_aaaaaaaa"]
    assert pay.list(session_id="other") == []
    assert meta.opened_at is None
    pay.mark_opened("pay_aaaaaaaa", now=5.0)
    assert pay.get("pay_aaaaaaaa").opened_at == 5.0
    assert pay.delete("pay_aaaaaaaa") is True and pay.delete("pay_aaaaaaaa") is False
    assert payload_code(lambda: pay.get("pay_aaaaaaaa")) == ErrorCode.NOT_FOUND
    assert payload_code(lambda: pay.open_blob("pay_aaaaaaaa")) == ErrorCode.NOT_FOUND


@pytest.mark.parametrize(
    ("declared", "code"),
    [
        ({"declared_hash": "sha256:" + "0" * 64}, ErrorCode.PAYLOAD_HASH_MISMATCH),
        ({"declared_size": 3}, ErrorCode.PAYLOAD_SIZE_MISMATCH),
    ],
    ids=["hash", "size"],
)
def test_payload_mismatch_keeps_nothing(pay: PayloadStorage, declared: dict[str, Any], code: str) -> None:
    assert payload_code(lambda: upload(pay, "pay_bbbbbbbb", b"ciphertext", **declared)) == code
    assert payload_code(lambda: pay.get("pay_bbbbbbbb")) == ErrorCode.NOT_FOUND
    assert pay.list() == []
    upload(pay, "pay_bbbbbbbb", b"ciphertext")  # the id is still free


def test_payload_refusals(pay: PayloadStorage) -> None:
    assert payload_code(lambda: upload(pay, "pay_cccccccc", b"x" * 1001)) == ErrorCode.PAYLOAD_TOO_LARGE
    assert payload_code(lambda: upload(pay, "bad id", b"x")) == ErrorCode.INVALID_REQUEST
    upload(pay, "pay_cccccccc", b"x" * 900)
    assert payload_code(lambda: upload(pay, "pay_cccccccc", b"y")) == ErrorCode.PAYLOAD_EXISTS
    assert payload_code(lambda: upload(pay, "pay_dddddddd", b"x" * 700)) == ErrorCode.PAYLOAD_QUOTA_EXCEEDED
    assert payload_code(lambda: pay.check_caps("s1", extra_bytes=601)) == ErrorCode.PAYLOAD_QUOTA_EXCEEDED
    pay.check_caps("s1", extra_bytes=600)
    upload(pay, "pay_dddddddd", b"x" * 600)
    assert payload_code(lambda: upload(pay, "pay_eeeeeeee", b"z")) == ErrorCode.PAYLOAD_QUOTA_EXCEEDED  # count
    upload(pay, "pay_eeeeeeee", b"z", session="s2")  # another session has its own caps
    assert payload_code(lambda: pay.get("pay_zzzzzzzz")) == ErrorCode.NOT_FOUND


def test_payload_aborted_upload_leaves_nothing(pay: PayloadStorage) -> None:
    up = pay.begin(payload_id="pay_ffffffff", session_id="s1", agent_id="ag", format="json", encryption={})
    up.write(b"half")
    assert up.size == 4 and up.hash == "sha256:" + hashlib.sha256(b"half").hexdigest()
    up.abort()
    assert pay.list() == []
    assert payload_code(lambda: pay.get("pay_ffffffff")) == ErrorCode.NOT_FOUND


def test_upload_url_is_single_use_and_bounded(pay: PayloadStorage) -> None:
    token, expires = pay.issue_upload_url(session_id="s1", agent_id="ag", max_size=500, ttl=60, now=1000.0)
    assert expires == 1060.0
    assert pay.consume_upload_url(token, now=1001.0) == ("s1", "ag", 500)
    assert payload_code(lambda: pay.consume_upload_url(token, now=1002.0)) == ErrorCode.UPLOAD_URL_INVALID
    late, _ = pay.issue_upload_url(session_id="s1", agent_id="ag", max_size=500, ttl=60, now=1000.0)
    assert payload_code(lambda: pay.consume_upload_url(late, now=1060.0)) == ErrorCode.UPLOAD_URL_INVALID
    assert payload_code(lambda: pay.consume_upload_url("never-issued", now=1000.0)) == ErrorCode.UPLOAD_URL_INVALID
    assert (
        payload_code(lambda: pay.issue_upload_url(session_id="s1", agent_id="ag", max_size=500, ttl=601))
        == ErrorCode.INVALID_REQUEST
    )
    assert (
        payload_code(lambda: pay.issue_upload_url(session_id="s1", agent_id="ag", max_size=1001, ttl=60))
        == ErrorCode.PAYLOAD_TOO_LARGE
    )


def test_payload_gc_removes_only_expired(pay: PayloadStorage) -> None:
    upload(pay, "pay_gggggggg", b"old", now=1000.0)
    upload(pay, "pay_hhhhhhhh", b"new", now=1050.0)
    assert pay.gc(now=1099.0) == 0
    assert pay.gc(now=1100.0) == 1  # ttl 100 s
    assert [m.payload_id for m in pay.list()] == ["pay_hhhhhhhh"]
    assert payload_code(lambda: pay.open_blob("pay_gggggggg")) == ErrorCode.NOT_FOUND


# ------------------------------------------------------------------------------ anchoring


def test_anchor_backends_are_the_protocol() -> None:
    """The behaviour is tests/anchor/test_anchor_contract.py's; here only that the seam is the one Protocol."""
    assert isinstance(NoneBackend(), AnchorBackend)
    assert not isinstance(object(), AnchorBackend)
