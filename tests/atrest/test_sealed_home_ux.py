"""A sealed home used without its passphrase: ``uomp doctor`` says the keys are locked (and how to
give the passphrase) instead of calling them unusable; ``uomp init`` run again needs no passphrase
when there is nothing to make, and is SECRETS_LOCKED naming what needs the keys otherwise. Each
with its partners: the right passphrase (checked, no "locked"), a wrong one (a problem)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_sealed_cli import env, pp_file, uomp
from test_sealed_keys import FAST, PASSPHRASE, make_home

from gateway.atrest import migrate, vault
from gateway.config import Paths
from gateway.guard.stores import open_user_store


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()


def sealed_home() -> Paths:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    open_user_store(paths).close()  # memory.db, as uomp init makes it
    vault.forget()
    return paths


def digest(home: Path) -> dict[str, str]:
    return {
        str(p.relative_to(home)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(home.rglob("*"))
        if p.is_file() and not p.name.endswith(("-wal", "-shm", ".lock"))
    }


def test_doctor_says_locked_with_the_fix_not_unusable(tmp_path: Path) -> None:
    paths = sealed_home()
    res = uomp(paths.home, "doctor")
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "cannot be used" not in out and "PROBLEM" not in out
    locked = [line for line in out.splitlines() if line.startswith("locked")]
    assert len(locked) == 2, out
    assert "the keys are locked" in locked[0]
    assert "signing key" in locked[1] and "CA key" in locked[1]
    assert "UOMP_PASSPHRASE_FILE=FILE uomp doctor" in out
    # the partner: with the passphrase the keys are opened and checked, nothing is locked
    res = uomp(paths.home, "doctor", e=env(UOMP_PASSPHRASE_FILE=str(pp_file(tmp_path))))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "locked" not in res.stdout
    assert "signing key" in res.stdout and "(parsed)" in res.stdout
    # and a wrong one is a problem, said as such
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-passphrase\n")
    wrong.chmod(0o600)
    res = uomp(paths.home, "doctor", e=env(UOMP_PASSPHRASE_FILE=str(wrong)))
    assert res.returncode == 1
    assert "PROBLEM  PASSPHRASE_WRONG" in res.stdout and "locked " not in res.stdout


def test_init_again_on_a_locked_sealed_home_needs_no_passphrase_when_nothing_is_made(tmp_path: Path) -> None:
    paths = sealed_home()
    before = digest(paths.home)
    res = uomp(paths.home, "init")
    assert res.returncode == 0, res.stdout + res.stderr
    assert ".secrets/admin-token: kept" in res.stdout and "sealed and locked" in res.stdout
    assert digest(paths.home) == before  # nothing made, nothing opened
    # the partners: --hostname (a new certificate from the sealed CA key) is SECRETS_LOCKED ...
    res = uomp(paths.home, "init", "--hostname", "uomp.example.org")
    assert res.returncode == 1
    assert res.stderr.startswith("error SECRETS_LOCKED") and "--hostname" in res.stderr
    assert "UOMP_PASSPHRASE_FILE=FILE uomp init" in res.stderr
    assert digest(paths.home) == before
    # ... and so is a file to make, named
    paths.memory_db.unlink()
    res = uomp(paths.home, "init")
    assert res.returncode == 1
    assert res.stderr.startswith("error SECRETS_LOCKED") and "memory.db" in res.stderr
    assert not paths.memory_db.exists()
    # with the passphrase it makes it
    res = uomp(paths.home, "init", e=env(UOMP_PASSPHRASE_FILE=str(pp_file(tmp_path))))
    assert res.returncode == 0, res.stderr
    assert "memory store: created" in res.stdout and paths.memory_db.exists()
