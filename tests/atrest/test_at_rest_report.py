"""``uomp doctor`` and ``uomp status`` say how the keys are kept: sealed (by a passphrase, a
passphrase file, a systemd credential or the keychain) or plain 0600 files that anyone running as
the user can read; doctor never says a plain key is ``ok`` without saying it is not sealed. Real
processes on real homes; nothing is unlocked to say it (no passphrase is asked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_sealed_cli import env, uomp
from test_sealed_keys import FAST, PASSPHRASE, make_home

from gateway.atrest import migrate, vault

pytestmark = pytest.mark.timeout(60)


def _lines(out: str, word: str) -> list[str]:
    return [line for line in out.splitlines() if word in line]


def test_plain_home_is_said_unsealed_by_doctor_and_status() -> None:
    paths = make_home()
    doc = uomp(paths.home, "doctor")
    assert "keys NOT sealed" in doc.stdout and vault.PLAIN_WARNING in doc.stdout, doc.stdout
    for name in ("ed25519-private.jwk", "ca.key", "gateway.key"):
        oks = [line for line in _lines(doc.stdout, name) if line.startswith("ok") and "is private" in line]
        assert oks and all("NOT sealed" in line for line in oks), doc.stdout
    st = uomp(paths.home, "status", "--json")
    state = json.loads(st.stdout)["keys_at_rest"]
    assert state == {"sealed": False, "sealed_by": "none", "warning": vault.PLAIN_WARNING}
    assert vault.PLAIN_WARNING in uomp(paths.home, "status").stdout


@pytest.mark.parametrize("how", ["passphrase", "passphrase-file", "credential"])
def test_sealed_home_says_by_what_without_unlocking(tmp_path: Path, how: str) -> None:
    paths = make_home()
    master = migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    pp = tmp_path / "uomp-passphrase"
    pp.write_text(PASSPHRASE + "\n")
    pp.chmod(0o600)
    extra = {"passphrase": {}, "passphrase-file": {vault.PASSPHRASE_FILE_ENV: str(pp)}}.get(
        how, {"CREDENTIALS_DIRECTORY": str(tmp_path)}
    )
    e = env(**extra)
    doc = uomp(paths.home, "doctor", e=e)
    line = next(x for x in doc.stdout.splitlines() if "keys sealed by" in x)
    assert line.startswith("ok") and master.home_id in line
    assert {"passphrase": "terminal", "passphrase-file": vault.PASSPHRASE_FILE_ENV}.get(how, "credential") in line
    assert "keys NOT sealed" not in doc.stdout
    for name in ("ed25519-private.jwk", "ca.key", "gateway.key"):
        assert not [x for x in _lines(doc.stdout, name) if "NOT sealed" in x], doc.stdout
    state = json.loads(uomp(paths.home, "status", "--json", e=e).stdout)["keys_at_rest"]
    assert state["sealed"] is True and state["sealed_by"] == how and state["master_key_id"] == master.home_id
    assert PASSPHRASE not in doc.stdout + doc.stderr
    assert "salt" not in json.dumps(state)


def test_keychain_slot_is_said_and_a_damaged_slot_is_a_problem() -> None:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    master = vault.master(paths)
    from gateway.atrest import sealing

    paths.master_slot.write_bytes(sealing.keyring_slot(master))
    assert vault.at_rest_state(paths)["sealed_by"] == "keychain"
    assert "the OS keychain" in vault.describe_state(vault.at_rest_state(paths))
    paths.master_slot.write_bytes(b'{"v": 1, "id": "zz"}')
    doc = uomp(paths.home, "doctor")
    assert doc.returncode == 1
    assert [x for x in doc.stdout.splitlines() if x.startswith("PROBLEM") and "master key slot" in x], doc.stdout


def test_doctor_cli_runs_without_a_terminal_prompt() -> None:
    """No stdin terminal and no passphrase: doctor still reports (it never unlocks to say sealed)."""
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    p = subprocess.run(
        [sys.executable, "-m", "gateway.cli.main", "--home", str(paths.home), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
        stdin=subprocess.DEVNULL,
    )
    assert json.loads(p.stdout)["keys_at_rest"]["sealed_by"] == "passphrase"


def test_the_admin_token_is_sealed_with_the_other_keys_and_a_planted_one_is_refused() -> None:
    from gateway import keys
    from gateway.atrest import sealing
    from gateway.errors import ErrorCode, UompError

    paths = make_home()
    token = keys.load_admin(paths)
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    raw = paths.admin_credential.read_bytes()
    assert raw.startswith(sealing.SEALED_MAGIC) and token.encode() not in raw
    vault.forget()
    with pytest.raises(UompError) as locked:
        keys.load_admin(paths)  # nothing unlocked it: the token is not readable
    assert locked.value.code == ErrorCode.SECRETS_LOCKED
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    assert keys.load_admin(paths) == token
    paths.admin_credential.write_text("uadm_" + "p" * 43 + "\n")  # planted in plaintext
    paths.admin_credential.chmod(0o600)
    with pytest.raises(UompError) as planted:
        keys.load_admin(paths)
    assert planted.value.code == ErrorCode.KEY_ERROR
    paths.admin_credential.write_bytes(raw)
    migrate.unseal(paths, vault.master(paths))
    assert paths.admin_credential.read_text().strip() == token
