"""``uomp backup create`` / ``restore`` (gateway/atrest/backup.py): a backup taken while the guard
runs restores into an empty home whole (items, keys, audit log verified against its witness
record); a changed byte, a cut-off file, trailing data, a wrong passphrase or a foreign file is
refused with nothing restored; a non-empty home is refused without --force; a restore killed -9
before its rename leaves the target as it was; a sealed home's backup stays sealed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from backupkit import DAMAGES, damaged, marked_value, new_home, no_restore_stage, put_marked, refusals
from guardkit import call, grant, guard_config, running_guard, seed, unix_session
from test_sealed_cli import env, pp_file, uomp
from test_sealed_keys import FAST, PASSPHRASE, loaded, make_home, secret_markers

from gateway.atrest import backup, memdb, migrate, vault
from gateway.cli.backup import verify_restored
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError

BACKUP_PASS = b"backup-pass-9d2c"
MARK = "backup-value-marker-31a7"


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()


async def populated(*, sealed: bool = False) -> tuple[Paths, Path]:
    """A home with items and audit events; the backup is taken while its guard runs."""
    paths = make_home()
    seed(paths)
    if sealed:
        migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    put_marked(paths, MARK)
    out = paths.home.parent / "home.uompbak"
    async with running_guard(paths, guard_config(), serve_tcp=False) as _g, unix_session(paths) as s:
        g = await grant(s, paths, read={"tags": ["preference"], "keys": []})
        for _ in range(3):
            status, body, _h = await call(s, "GET", "/v1/memory/note.secret", token=g["token"])
            assert status == 200 and body["value"] == MARK, body
        backup.create(paths, out, BACKUP_PASS, kdf=FAST)
    return paths, out


async def test_a_backup_taken_while_running_restores_whole_and_verifies(tmp_path: Path) -> None:
    paths, out = await populated()
    before = loaded(paths)
    data = out.read_bytes()
    for m in [MARK.encode(), *secret_markers(paths)]:
        assert m not in data  # encrypted: neither values nor keys readable in the file
    target = new_home()
    manifest = backup.restore(out, target, BACKUP_PASS)
    restored = Paths(target)
    assert {f["path"] for f in manifest["files"]} >= {
        "memory.db",
        "audit.db",
        ".secrets/audit-ed25519.key",
        "ca/ca.key",
    }
    assert loaded(restored) == before
    assert marked_value(restored) == MARK
    # the witness record in the backup is the one the snapshot's log extends (the original's moved on
    # since: the guard signed again at its stop)
    assert restored.audit_witness.exists()
    said = verify_restored(restored)
    assert "consistent with its witness record" in said and "0 events" not in said, said
    assert no_restore_stage(target)
    # the user's check: `uomp audit verify` on the restored home, and the restore's own message
    res = uomp(target, "audit", "verify")
    assert res.returncode == 0, res.stdout + res.stderr
    # the restored home serves: a guard starts on it (its start-up check against the witness) and answers
    async with running_guard(restored, guard_config(), serve_tcp=False) as _g, unix_session(restored) as s:
        g = await grant(s, restored, read={"tags": ["preference"], "keys": []})
        status, body, _h = await call(s, "GET", "/v1/memory/note.secret", token=g["token"])
        assert status == 200 and body["value"] == MARK


@pytest.mark.parametrize("damage", DAMAGES)
async def test_a_damaged_backup_is_refused_and_nothing_is_restored(damage: str) -> None:
    _paths, out = await populated()
    out.write_bytes(damaged(out.read_bytes(), damage))
    target = new_home()
    with pytest.raises(UompError) as exc:
        backup.restore(out, target, BACKUP_PASS)
    assert exc.value.code in refusals(damage), exc.value
    assert not target.exists()
    assert no_restore_stage(target)


async def test_wrong_passphrase_and_a_non_empty_home() -> None:
    paths, out = await populated()
    target = new_home()
    with pytest.raises(UompError) as wrong:
        backup.restore(out, target, b"not the passphrase")
    assert wrong.value.code == ErrorCode.PASSPHRASE_WRONG and not target.exists()
    target.mkdir(mode=0o700)
    (target / "mine.txt").write_text("the user's own file")
    res = uomp(
        target, "backup", "restore", str(out), "--passphrase-file", str(pp_file(target.parent, BACKUP_PASS.decode()))
    )
    assert res.returncode == 1 and "error HOME_NOT_EMPTY" in res.stderr and "--force" in res.stderr, res.stderr
    assert sorted(os.listdir(target)) == ["mine.txt"]
    forced = uomp(
        target,
        "backup",
        "restore",
        str(out),
        "--force",
        "--passphrase-file",
        str(pp_file(target.parent, BACKUP_PASS.decode())),
    )
    assert forced.returncode == 0, forced.stderr
    assert "audit log verified" in forced.stdout and "now " in forced.stdout
    aside = [p for p in target.parent.iterdir() if ".before-restore-" in p.name]
    assert len(aside) == 1 and (aside[0] / "mine.txt").read_text() == "the user's own file"
    assert loaded(Paths(target)) == loaded(paths)


async def test_a_restore_killed_before_its_rename_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    _paths, out = await populated()
    target = new_home()
    pp = pp_file(tmp_path, BACKUP_PASS.decode())
    arm = tmp_path / "arm"
    arm.touch()
    res = uomp(
        target,
        "backup",
        "restore",
        str(out),
        "--passphrase-file",
        str(pp),
        e=env(UOMP_FAULT="atrest.restore_before_rename", UOMP_FAULT_ARM=str(arm)),
    )
    assert res.returncode == -9, res.stderr
    assert not target.exists()
    ok = uomp(target, "backup", "restore", str(out), "--passphrase-file", str(pp))
    assert ok.returncode == 0, ok.stderr
    assert no_restore_stage(target), "the killed restore's stage is gone"


async def test_a_sealed_homes_backup_restores_sealed() -> None:
    paths, out = await populated(sealed=True)
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    before = loaded(paths)
    vault.forget()
    target = new_home()
    manifest = backup.restore(out, target, BACKUP_PASS)
    assert manifest["sealed"] is True
    restored = Paths(target)
    assert not memdb.is_plaintext(restored.memory_db)
    with pytest.raises(UompError) as locked:
        loaded(restored)
    assert locked.value.code == ErrorCode.SECRETS_LOCKED
    vault.unlock_with_passphrase(restored, PASSPHRASE)
    assert loaded(restored) == before
    assert marked_value(restored) == MARK
    assert json.loads(restored.master_slot.read_bytes())["id"] == json.loads(paths.master_slot.read_bytes())["id"]


async def test_a_backup_killed_midway_leaves_no_backup_and_the_next_one_works(tmp_path: Path) -> None:
    paths = make_home()
    seed(paths)
    pp = pp_file(tmp_path, BACKUP_PASS.decode())
    out = tmp_path / "b.uompbak"
    arm = tmp_path / "arm"
    arm.touch()
    res = uomp(
        paths.home,
        "backup",
        "create",
        str(out),
        "--passphrase-file",
        str(pp),
        e=env(UOMP_FAULT="atrest.backup_after_snapshot", UOMP_FAULT_ARM=str(arm)),
    )
    assert res.returncode == -9, res.stderr
    assert not out.exists()  # only a whole backup ever has the name asked for
    ok = uomp(paths.home, "backup", "create", str(out), "--passphrase-file", str(pp))
    assert ok.returncode == 0, ok.stderr
    assert not paths.backup_stage.exists()
    again = uomp(paths.home, "backup", "create", str(out), "--passphrase-file", str(pp))
    assert again.returncode == 1 and "error IO_ERROR" in again.stderr  # never overwrites a backup
    target = new_home()
    backup.restore(out, target, BACKUP_PASS)
    assert loaded(Paths(target)) == loaded(paths)
