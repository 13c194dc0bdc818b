"""``uomp proposals ...`` and ``uomp memory history|rollback`` against a real data directory:
approve-what-you-see (the change applied is the change shown, bound by its hash), stale bases,
decided / withdrawn / expired proposals, racing approvals, kill -9 inside an approval or a rollback,
and every decision in the audit log (docs/writes.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gatewaykit import ledger_events
from guardkit import seed

from gateway.cli.main import main
from gateway.config import Paths
from gateway.core.capability import Scope
from gateway.errors import UompError
from gateway.guard import history
from gateway.guard.proposal_rules import WriteBudgets
from gateway.guard.proposals import ProposalBook
from gateway.guard.store import MemoryStore

SCOPE = Scope(tags=("preference",), keys=())


@pytest.fixture
def seeded(home: Paths) -> Paths:
    seed(home)
    return home


def uomp(paths: Paths, *args: str) -> int:
    return main(["--home", str(paths.home), *args])


def propose(paths: Paths, key: str = "preference.theme", op: str = "put", clock: Any = time.time, **body: Any) -> str:
    with MemoryStore(paths.memory_db) as store:
        p, _ = ProposalBook(store, clock=clock).propose(
            scope=SCOPE,
            session_id="sess_test",
            agent_id="writer",
            op=op,
            key=key,
            body=body or ({"value": "light"} if op == "put" else None),
            if_match=None,
            via="local",
        )
    return p.proposal_id


def state(paths: Paths, key: str = "preference.theme") -> tuple[Any, ...]:
    with MemoryStore(paths.memory_db) as store:
        item = store.get(key)
        with store.reading() as conn:
            version = conn.execute("SELECT version FROM items WHERE key = ?", (key,)).fetchone()
            props = conn.execute("SELECT proposal_id, status FROM proposals ORDER BY created_at").fetchall()
    return (item.to_dict() if item else None), (version[0] if version else None), props


def shown_hash(out: str) -> str:
    return next(line.split()[-1] for line in out.splitlines() if "change hash:" in line)


def test_approve_applies_exactly_what_was_shown(seeded: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    pid = propose(seeded, value={"mode": "light"}, tags=["preference", "ui"], sensitivity="low")
    assert uomp(seeded, "proposals", "list") == 0
    assert pid in capsys.readouterr().out
    assert uomp(seeded, "proposals", "show", pid) == 0
    out = capsys.readouterr().out
    assert 'value:       "dark"' in out and 'value:       {"mode": "light"}' in out
    assert state(seeded)[1] == 1  # nothing applied by showing
    assert uomp(seeded, "proposals", "approve", pid, "--hash", shown_hash(out)) == 0
    item, version, props = state(seeded)
    assert item["value"] == {"mode": "light"} and item["source"] == "agent" and version == 2
    assert props == [(pid, "approved")]
    [event] = ledger_events(seeded, action="proposal_approved")
    assert event["proposal_id"] == pid and event["change_hash"] == shown_hash(out) and event["agent_id"] == "writer"
    assert event["key"] == "preference.theme" and "light" not in seeded.audit_db.read_bytes().decode("latin-1")
    # history: the replaced version, and who made the current one
    capsys.readouterr()
    assert uomp(seeded, "memory", "history", "preference.theme") == 0
    out = capsys.readouterr().out
    assert "v2" in out and "by agent writer" in out and 'value "dark"' in out
    # approving again: already decided
    assert uomp(seeded, "proposals", "approve", pid, "--yes") == 1
    assert "INVALID_STATE" in capsys.readouterr().err
    assert state(seeded)[1] == 2


def test_wrong_hash_changes_nothing(seeded: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    pid = propose(seeded)
    other = propose(seeded, value="blue")
    uomp(seeded, "proposals", "show", other)
    other_hash = shown_hash(capsys.readouterr().out)
    before = state(seeded)
    for bad in (other_hash, "sha256:" + "0" * 64, "junk"):
        assert uomp(seeded, "proposals", "approve", pid, "--hash", bad) == 1
        assert "APPROVAL_MISMATCH" in capsys.readouterr().err
    assert state(seeded) == before
    assert ledger_events(seeded, action="proposal_approved") == []


def test_base_changed_is_stale(seeded: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    pid = propose(seeded)
    uomp(seeded, "proposals", "show", pid)
    h = shown_hash(capsys.readouterr().out)
    assert uomp(seeded, "memory", "add", "preference.theme", "--value", '"sepia"', "--tag", "preference",
                "--sensitivity", "low", "--replace") == 0  # fmt: skip
    capsys.readouterr()
    assert uomp(seeded, "proposals", "show", pid) == 0
    assert "STALE" in capsys.readouterr().out
    assert uomp(seeded, "proposals", "approve", pid, "--hash", h) == 1
    assert "VERSION_CONFLICT" in capsys.readouterr().err
    item, version, props = state(seeded)
    assert item["value"] == "sepia" and version == 2 and props == [(pid, "stale")]
    assert [e["proposal_id"] for e in ledger_events(seeded, action="proposal_stale")] == [pid]


def test_decided_withdrawn_expired_unknown(seeded: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    rejected = propose(seeded)
    assert uomp(seeded, "proposals", "reject", rejected) == 0
    withdrawn = propose(seeded)
    with MemoryStore(seeded.memory_db) as store:
        ProposalBook(store).withdraw(withdrawn, "sess_test")
    lifetime = WriteBudgets().lifetime_seconds
    expired = propose(seeded, clock=lambda: time.time() - lifetime - 5)
    capsys.readouterr()
    for pid, status in ((rejected, "rejected"), (withdrawn, "withdrawn"), (expired, "expired")):
        assert uomp(seeded, "proposals", "approve", pid, "--yes") == 1
        err = capsys.readouterr().err
        assert "INVALID_STATE" in err and status in err, (pid, err)
    assert uomp(seeded, "proposals", "approve", "prop_unknown", "--yes") == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert state(seeded)[0]["value"] == "dark" and state(seeded)[1] == 1
    assert [e["proposal_id"] for e in ledger_events(seeded, action="proposal_rejected")] == [rejected]
    assert [e["proposal_id"] for e in ledger_events(seeded, action="proposal_expired")] == [expired]


def test_racing_approvals_apply_once(seeded: Paths) -> None:
    pid = propose(seeded)
    with MemoryStore(seeded.memory_db) as store:
        h = ProposalBook(store).show(pid)["change_hash"]
    results: list[str] = []
    barrier = threading.Barrier(4)

    def approve() -> None:
        with MemoryStore(seeded.memory_db) as store:  # a connection each, as separate processes have
            barrier.wait()
            try:
                ProposalBook(store).approve(pid, h)
                results.append("ok")
            except UompError as exc:
                results.append(str(exc.code))

    threads = [threading.Thread(target=approve) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["INVALID_STATE"] * 3 + ["ok"]
    assert state(seeded)[1] == 2  # one new version, not four


def test_terminal_cannot_be_repainted(seeded: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    pid = propose(seeded, value="\x1b[2J\x1b[Hharmless\u202e", description="line\nnext\u2066")
    assert uomp(seeded, "proposals", "show", pid) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\u2066" not in out
    assert "\\u001b[2J" in out


def test_delete_then_rollback(seeded: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    pid = propose(seeded, op="delete")
    uomp(seeded, "proposals", "show", pid)
    out = capsys.readouterr().out
    assert "(deleted)" in out
    assert uomp(seeded, "proposals", "approve", pid, "--hash", shown_hash(out)) == 0
    assert state(seeded)[0] is None
    with MemoryStore(seeded.memory_db) as store:
        entries = history.history(store, "preference.theme")
    assert [(e["version"], e["deleted"]) for e in entries] == [(2, True), (1, False)]
    capsys.readouterr()
    assert uomp(seeded, "memory", "rollback", "preference.theme", "--to", "2") == 1  # a deletion
    assert uomp(seeded, "memory", "rollback", "preference.theme", "--to", "9") == 1  # not kept
    assert capsys.readouterr().err.count("INVALID_REQUEST") == 2
    assert uomp(seeded, "memory", "rollback", "preference.theme", "--to", "1") == 0
    item, version, _ = state(seeded)
    assert item["value"] == "dark" and item["source"] == "user" and version == 3
    assert item["tags"] == ["preference", "ui"]
    [event] = ledger_events(seeded, action="memory_rolled_back")
    assert event["key"] == "preference.theme" and "version 1 made current as version 3" in event["detail"]
    # the agent can read it again through its tags (item_tags restored)
    with MemoryStore(seeded.memory_db) as store:
        assert [i.key for i in store.list(tag="ui")] == ["preference.theme"]


def test_every_writer_keeps_history_and_retention(seeded: Paths) -> None:
    with MemoryStore(seeded.memory_db) as store:
        history.set_retention(store, 3)
        item = store.get("preference.lang")
        assert item is not None
        for n in range(6):
            store.put(type(item)(**{**item.__dict__, "value": f"v{n}"}), replace=True)
        entries = history.history(store, "preference.lang")
        assert [e["version"] for e in entries] == [7, 6, 5, 4]  # the current one and 3 earlier
        assert entries[1]["value"] == "v4"
        with pytest.raises(UompError):
            history.set_retention(store, -1)


CRASH = """
import sys
from gateway.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("point", ["proposal_apply", "rollback_apply"])
def test_kill_9_inside_the_transaction(seeded: Paths, point: str, capsys: pytest.CaptureFixture[str]) -> None:
    if point == "proposal_apply":
        pid = propose(seeded)
        uomp(seeded, "proposals", "show", pid)
        args = ["proposals", "approve", pid, "--hash", shown_hash(capsys.readouterr().out)]
    else:
        uomp(seeded, "memory", "add", "preference.theme", "--value", '"sepia"', "--tag", "preference",
             "--sensitivity", "low", "--replace")  # fmt: skip
        args = ["memory", "rollback", "preference.theme", "--to", "1"]
    before = state(seeded)
    events = len(ledger_events(seeded)) if seeded.audit_db.exists() else 0
    arm = Path(seeded.home) / "arm"
    arm.write_text("")
    env = {**os.environ, "UOMP_FAULT": point, "UOMP_FAULT_ARM": str(arm)}
    proc = subprocess.run([sys.executable, "-c", CRASH, "--home", str(seeded.home), *args], env=env, timeout=60)
    assert proc.returncode == -9
    assert state(seeded) == before  # the item, its version and the proposal: all as they were
    assert (len(ledger_events(seeded)) if seeded.audit_db.exists() else 0) == events
    proc = subprocess.run([sys.executable, "-c", CRASH, "--home", str(seeded.home), *args], env=env, timeout=60)
    assert proc.returncode == 0
    assert state(seeded)[1] == before[1] + 1


def test_rm_keeps_history_and_purge_removes_it(seeded: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    assert uomp(seeded, "memory", "rm", "preference.lang") == 0
    assert "its history is kept" in capsys.readouterr().out
    with MemoryStore(seeded.memory_db) as store:
        assert [e["version"] for e in history.history(store, "preference.lang")] == [2, 1]
    assert uomp(seeded, "memory", "rm", "preference.lang", "--purge") == 0  # no item left, its history goes
    with MemoryStore(seeded.memory_db) as store:
        assert history.history(store, "preference.lang") == []
    assert uomp(seeded, "memory", "rm", "preference.lang", "--purge") == 1  # nothing left to purge
    assert uomp(seeded, "memory", "rm", "preference.theme", "--purge") == 0  # item and history at once
    with MemoryStore(seeded.memory_db) as store:
        assert store.get("preference.theme") is None and history.history(store, "preference.theme") == []
    assert [e["action"] for e in ledger_events(seeded) if e["key"].startswith("preference.")] == [
        "memory_deleted",
        "memory_purged",
        "memory_purged",
    ]


def test_agent_side_sees_expiry_and_cannot_withdraw_an_expired_one(seeded: Paths) -> None:
    lifetime = WriteBudgets().lifetime_seconds
    pid = propose(seeded, clock=lambda: time.time() - lifetime - 5)
    fresh = propose(seeded)
    with MemoryStore(seeded.memory_db) as store:
        book = ProposalBook(store)
        assert {p.proposal_id: p.status for p in book.for_session("sess_test")} == {pid: "expired", fresh: "pending"}
        with pytest.raises(UompError) as err:
            book.withdraw(pid, "sess_test")
        assert err.value.code == "INVALID_STATE" and err.value.details == {"status": "expired"}
        assert book.withdraw(fresh, "sess_test").status == "withdrawn"
    assert [p[1] for p in state(seeded)[2]] == ["pending", "withdrawn"]  # the expiry is the user's side to record


def test_cli_applies_the_configured_retention(seeded: Paths) -> None:
    (seeded.home / "config.toml").write_text("[guard]\nhistory_max_versions = 2\n")
    for n in range(4):
        assert uomp(seeded, "memory", "add", "preference.lang", "--value", f'"v{n}"', "--tag", "preference",
                    "--sensitivity", "low", "--replace") == 0  # fmt: skip
    with MemoryStore(seeded.memory_db) as store:
        assert [e["version"] for e in history.history(store, "preference.lang")] == [5, 4, 3]
