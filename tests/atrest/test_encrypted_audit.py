"""The audit log of a sealed home encrypted at rest (SQLCipher, gateway/atrest/auditdb.py): no
agent id or key name in audit.db, its -wal or -shm while the guard writes (a plain home's files
hold them: the partner); every opener reads it (the guard, `uomp audit`, proofs, the dashboard,
status, the anchoring metrics, userlog); a proof exported before the encryption verifies after it
without any key; a log from another home is a named refusal; the conversion at seal / unseal
killed -9 at each point leaves the old file or the new one, whole, and `uomp audit verify` says
which; a sealed home's backup restores an encrypted log that verifies."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from guardkit import call, grant, guard_config, running_guard, unix_session
from test_sealed_cli import env, pp_file, uomp
from test_sealed_keys import FAST, PASSPHRASE, make_home

from gateway import sqldriver
from gateway.atrest import auditdb, backup, memdb, migrate, vault
from gateway.cli.audit import proof_bundle
from gateway.cli.backup import verify_restored
from gateway.cli.main import main
from gateway.config import GuardConfig, Paths
from gateway.dashboard import data, memory_page
from gateway.errors import ErrorCode, UompError
from gateway.guard.audit import open_audit
from gateway.guard.store import MemoryItem, MemoryStore
from gateway.ledger import auditkey, integrity
from gateway.ledger.anchoring import counts_of

TS = "2026-01-01T00:00:00Z"
AGENT = "agent-marker-e41c"
MARK_KEY = "preference.key-marker-7d2a"
DENIED_KEY = "secret.denied-marker-90bf"
MARKS = (AGENT, MARK_KEY, DENIED_KEY)
BACKUP_PASS = b"backup-pass-audit-5e"


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()
    vault.set_prompt(None)


def home(*, sealed: bool) -> Paths:
    paths = make_home()
    with MemoryStore(paths.memory_db) as s:
        s.put(MemoryItem(MARK_KEY, {"v": 1}, ("preference",), "low", "user", TS, TS))
        s.put(MemoryItem(DENIED_KEY, {"v": 2}, ("secret",), "low", "user", TS, TS))
    if sealed:
        migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)  # leaves the home unlocked in this process
    return paths


def file_bytes(db: Path) -> dict[str, bytes]:
    """audit.db and its companions, read by another process (a second descriptor of a SQLite file
    closed in this one would drop the guard's locks on it)."""
    out = {}
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(db) + suffix)
        if p.exists():
            out[p.name] = subprocess.run(["cat", str(p)], capture_output=True, check=True).stdout
    return out


async def traffic(paths: Paths, *, backup_to: Path | None = None) -> dict[str, bytes]:
    """A session, an allowed and a refused read by :data:`AGENT`; the files of the log while the
    guard still runs (its writes in -wal frames), and a backup taken then if asked."""
    async with running_guard(paths, guard_config(), serve_tcp=False) as g, unix_session(paths) as s:
        granted = await grant(s, paths, read={"tags": ["preference"], "keys": []}, agent_id=AGENT)
        hdr = {"X-UOMP-Agent-Id": AGENT}
        assert (await call(s, "GET", f"/v1/memory/{MARK_KEY}", token=granted["token"], headers=hdr))[0] == 200
        assert (await call(s, "GET", f"/v1/memory/{DENIED_KEY}", token=granted["token"], headers=hdr))[0] in (403, 404)
        await g.services.audit.writer.probe()  # type: ignore[union-attr]
        found = file_bytes(paths.audit_db)
        if backup_to is not None:
            backup.create(paths, backup_to, BACKUP_PASS, kdf=FAST)
    return found


def cli(paths: Paths, *args: str) -> int:
    return main(["--home", str(paths.home), *args])


def first_read_id(paths: Paths) -> str:
    conn = auditdb.connect(paths.audit_db, readonly=True)
    try:
        return str(
            conn.execute("SELECT id FROM ledger_events WHERE action = 'read' ORDER BY seq LIMIT 1").fetchone()[0]
        )
    finally:
        conn.close()


@pytest.mark.parametrize("sealed", [True, False])
async def test_no_agent_id_or_key_name_in_the_audit_files_of_a_sealed_home(sealed: bool) -> None:
    paths = home(sealed=sealed)
    found = await traffic(paths)
    assert len(found.get("audit.db-wal", b"")) > 4096, "the guard's writes are in -wal frames"
    hits = [(name, m) for name, raw in found.items() for m in MARKS if m.encode() in raw]
    if sealed:
        assert hits == [], hits
        assert auditdb.is_encrypted(paths.audit_db)
        res = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('select 1 from ledger_events')",
                str(paths.audit_db),
            ],
            capture_output=True,
            text=True,
        )
        assert res.returncode != 0 and "not a database" in res.stderr
    else:  # the partner: a plain home's log is a plain SQLite file, the fields in clear
        assert {m for _n, m in hits} == set(MARKS), hits
        assert not auditdb.is_encrypted(paths.audit_db)


async def test_every_opener_reads_the_encrypted_log(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    paths = home(sealed=True)
    await traffic(paths)
    assert auditdb.is_encrypted(paths.audit_db)
    pub = auditkey.load(paths).public_key()
    state = integrity.home_state(paths.audit_db, paths.audit_witness, origin=auditkey.origin_for(pub), public_key=pub)
    assert state["ok"] is True and int(state["events"]) >= 3, state  # type: ignore[call-overload]
    assert counts_of(paths.audit_db) is not None
    agents, _sessions = data.known_agents_and_sessions(paths)
    assert AGENT in agents
    assert memory_page.readers(paths, MARK_KEY) == [(AGENT, 1)]
    audit = open_audit(paths, GuardConfig())  # userlog's opener
    try:
        assert any(e.get("key") == DENIED_KEY for e in audit.recent(limit=50))
    finally:
        audit.close()
    event_id = first_read_id(paths)
    assert proof_bundle(paths, event_id)["event"]["id"] == event_id

    assert cli(paths, "audit", "verify", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["encrypted"] is True, report
    assert cli(paths, "audit", "--agent", AGENT, "--json") == 0
    assert DENIED_KEY in capsys.readouterr().out
    bundle = tmp_path / "proof.json"
    assert cli(paths, "audit", "proof", event_id, "--out", str(bundle)) == 0
    capsys.readouterr()
    cli(paths, "status", "--json")
    assert json.loads(capsys.readouterr().out)["audit_log"]["ok"] is True
    cli(paths, "doctor")
    said = capsys.readouterr().out
    assert "is encrypted at rest" in said and "INTERNAL" not in said, said

    # the refusals: without the master key nothing opens the log, and says why ...
    vault.forget()
    for opener in (lambda: auditdb.connect(paths.audit_db, readonly=True), lambda: open_audit(paths, GuardConfig())):
        with pytest.raises(UompError) as locked:
            opener()
        assert locked.value.code == ErrorCode.SECRETS_LOCKED
    assert counts_of(paths.audit_db) is None
    state = integrity.home_state(paths.audit_db, paths.audit_witness, origin=auditkey.origin_for(pub), public_key=pub)
    assert state["ok"] is None and "SECRETS_LOCKED" not in str(state.get("code")), state
    # ... but a proof file is self-contained: verify-proof needs no key of the home
    res = uomp(paths.home, "audit", "verify-proof", str(bundle), "--key", report["verifier_key"], stdin="")
    assert res.returncode == 0 and "proof OK" in res.stdout, res.stdout + res.stderr
    res = uomp(paths.home, "audit", "--json", stdin="")
    assert res.returncode == 1 and "error SECRETS_LOCKED" in res.stderr, res.stderr
    # the guard's background verify child (`uomp audit verify` with the master key on a pipe): the
    # command a passphrase file unlocks, as the child's handover does
    res = uomp(
        paths.home, "audit", "verify", "--json", "--no-chain", e=env(UOMP_PASSPHRASE_FILE=str(pp_file(tmp_path)))
    )
    assert res.returncode == 0 and json.loads(res.stdout)["encrypted"] is True, res.stderr


async def test_a_proof_exported_before_the_encryption_verifies_after(tmp_path: Path) -> None:
    paths = home(sealed=False)
    await traffic(paths)
    event_id = first_read_id(paths)
    before = proof_bundle(paths, event_id)
    (tmp_path / "before.json").write_text(json.dumps(before))
    pp = str(pp_file(tmp_path))
    res = uomp(paths.home, "secrets", "seal", "--passphrase-file", pp)
    assert res.returncode == 0 and f"encrypted: {paths.audit_db}" in res.stdout, res.stdout + res.stderr
    assert auditdb.is_encrypted(paths.audit_db) and not auditdb.convert_path(paths.audit_db).exists()
    res = uomp(
        paths.home, "audit", "verify-proof", str(tmp_path / "before.json"), "--key", before["verifier_key"], stdin=""
    )
    assert res.returncode == 0 and "proof OK" in res.stdout, res.stdout + res.stderr
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    after = proof_bundle(paths, event_id)
    for field in ("event", "leaf_index", "tree_size", "inclusion_path", "checkpoint", "verifier_key"):
        assert after[field] == before[field], field  # leaves, tree and checkpoints: the same bytes
    vault.forget()
    res = uomp(paths.home, "secrets", "unseal", "--passphrase-file", pp)
    assert res.returncode == 0 and f"decrypted: {paths.audit_db}" in res.stdout, res.stdout + res.stderr
    assert not auditdb.is_encrypted(paths.audit_db)
    assert proof_bundle(paths, event_id)["checkpoint"] == before["checkpoint"]


@pytest.mark.parametrize("how", ["other_home", "wrong_key"])
async def test_a_log_that_does_not_open_with_the_homes_key_is_a_named_refusal(how: str, tmp_path: Path) -> None:
    a = home(sealed=True)
    await traffic(a)
    # the log's own key, not memory.db's: the memory key does not open it
    assert auditdb.audit_key(a) != memdb.memory_key(a)
    with pytest.raises(sqldriver.DATABASE, match="not a database"):
        memdb.connect(str(a.audit_db), memdb.memory_key(a)).execute("SELECT count(*) FROM ledger_events")
    if how == "other_home":  # audit.db copied into another sealed home
        target = make_home()
        migrate.seal(target, passphrase=PASSPHRASE, kdf=FAST)
        shutil.copy2(a.audit_db, target.audit_db)
    else:  # a SQLCipher file under some other key put in its place
        target = a
        conn = memdb.connect(str(tmp_path / "other.db"), os.urandom(32))
        conn.execute("CREATE TABLE ledger_events (seq INTEGER PRIMARY KEY)")
        conn.commit()
        conn.close()
        shutil.copy2(tmp_path / "other.db", a.audit_db)
    with pytest.raises(UompError) as exc:
        open_audit(target, GuardConfig())
    assert exc.value.code == ErrorCode.AUDIT_LOG_DAMAGED
    assert (exc.value.details or {}).get("reason") == "key_mismatch"
    assert "another home" in exc.value.message
    vault.forget()
    res = uomp(target.home, "audit", "verify", e=env(UOMP_PASSPHRASE_FILE=str(pp_file(tmp_path))))
    assert res.returncode == 1 and "error AUDIT_LOG_DAMAGED" in res.stderr and "INTERNAL" not in res.stderr, res.stderr
    if how == "other_home":  # the partner: its own home opens it
        vault.unlock_with_passphrase(a, PASSPHRASE)
        open_audit(a, GuardConfig()).close()


def plain_count(db: Path) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA quick_check").fetchall() == [("ok",)]
        return int(conn.execute("SELECT count(*) FROM ledger_events").fetchone()[0])
    finally:
        conn.close()


@pytest.mark.parametrize("point", ["atrest.before_commit", "atrest.after_commit", auditdb.FAULT_BEFORE_RENAME])
async def test_seal_killed_at_each_point_leaves_the_old_log_or_the_new(point: str, tmp_path: Path) -> None:
    paths = home(sealed=False)
    await traffic(paths)
    events = plain_count(paths.audit_db)
    arm = tmp_path / "arm"
    arm.touch()
    pp = str(pp_file(tmp_path))
    res = uomp(paths.home, "secrets", "seal", "--passphrase-file", pp, e=env(UOMP_FAULT=point, UOMP_FAULT_ARM=str(arm)))
    assert res.returncode == -9, res.stdout + res.stderr
    assert plain_count(paths.audit_db) == events  # the old log, whole
    sealed = point != "atrest.before_commit"
    assert vault.is_sealed_home(paths) is sealed
    # the next opener of a sealed home finishes the conversion; `uomp audit verify` says which it is
    res = uomp(paths.home, "audit", "verify", "--json", e=env(UOMP_PASSPHRASE_FILE=pp))
    report = json.loads(res.stdout)
    assert res.returncode == 0 and report["ok"] and report["events"] == events, res.stdout + res.stderr
    assert report["encrypted"] is sealed and auditdb.is_encrypted(paths.audit_db) is sealed
    assert not auditdb.convert_path(paths.audit_db).exists()


async def test_unseal_killed_before_the_logs_rename_leaves_it_encrypted_and_whole(tmp_path: Path) -> None:
    paths = home(sealed=True)
    await traffic(paths)
    vault.forget()
    pp = str(pp_file(tmp_path))
    arm = tmp_path / "arm"
    arm.touch()
    fault = env(UOMP_FAULT=auditdb.FAULT_BEFORE_RENAME, UOMP_FAULT_ARM=str(arm))
    res = uomp(paths.home, "secrets", "unseal", "--passphrase-file", pp, e=fault)
    assert res.returncode == -9, res.stdout + res.stderr
    assert auditdb.is_encrypted(paths.audit_db) and vault.is_sealed_home(paths)
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    assert verify_restored(paths).startswith("audit log verified")  # the new-old one: encrypted, whole
    vault.forget()
    res = uomp(paths.home, "secrets", "unseal", "--passphrase-file", pp)
    assert res.returncode == 0, res.stderr
    assert not auditdb.is_encrypted(paths.audit_db) and plain_count(paths.audit_db) >= 3
    assert verify_restored(paths).startswith("audit log verified")


async def test_a_sealed_homes_backup_restores_an_encrypted_log_that_verifies(tmp_path: Path) -> None:
    paths = home(sealed=True)
    out = tmp_path / "home.uompbak"
    await traffic(paths, backup_to=out)
    vault.forget()
    target = tmp_path / "restored"
    backup.restore(out, target, BACKUP_PASS)
    restored = Paths(target)
    assert auditdb.is_encrypted(restored.audit_db)
    raw = b"".join(file_bytes(restored.audit_db).values())
    assert not any(m.encode() in raw for m in MARKS)
    with pytest.raises(UompError) as locked:
        verify_restored(restored)
    assert locked.value.code == ErrorCode.SECRETS_LOCKED
    vault.unlock_with_passphrase(restored, PASSPHRASE)
    assert verify_restored(restored).startswith("audit log verified")
    assert memory_page.readers(restored, MARK_KEY) == [(AGENT, 1)]
