"""Sealed keys as a user meets them, in real processes: ``uomp secrets seal`` / ``unseal`` killed
(-9) at each step of the journal, the appliance started on a sealed home (TLS with the sealed
gateway key, the guard child unlocked through a pipe), the terminal prompt on a real pty, the
keychain path on keyrings.alt's file backend, and no passphrase or key in any log, argv,
environment or leftover file."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from portkit import own_ports_env
from test_sealed_keys import FAST, PASSPHRASE, loaded, make_home, scan, secret_markers

from gateway.atrest import journal, migrate, sealing, vault
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError

UOMP = [sys.executable, "-m", "gateway.cli.main"]
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()


def env(**extra: str) -> dict[str, str]:
    out = own_ports_env()
    for k in (vault.PASSPHRASE_FILE_ENV, vault.MASTER_FD_ENV, "CREDENTIALS_DIRECTORY", "PYTHON_KEYRING_BACKEND"):
        out.pop(k, None)
    out.update(extra)
    return out


def uomp(
    home: Path, *args: str, e: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*UOMP, "--home", str(home), *args],
        capture_output=True,
        text=True,
        timeout=90,
        env=e if e is not None else env(),
        input=stdin,
        cwd=REPO,
    )


def pp_file(tmp: Path, text: str = PASSPHRASE) -> Path:
    p = tmp / "passphrase"
    p.write_text(text + "\n")
    p.chmod(0o600)
    return p


def leftovers(paths: Paths) -> list[str]:
    return [n for n in os.listdir(paths.secrets) if n.startswith(".atrest-")]


# --------------------------------------------------------------------------- kill -9 at each step


@pytest.mark.parametrize(
    ("point", "sealed_after"),
    [("atrest.before_commit", False), ("atrest.after_commit", True), ("atrest.apply", True)],
)
def test_seal_killed_at_each_step_leaves_the_old_keys_or_the_new(
    tmp_path: Path, point: str, sealed_after: bool
) -> None:
    paths = make_home()
    before = loaded(paths)
    markers = secret_markers(paths)
    arm = tmp_path / "arm"
    arm.touch()
    res = uomp(
        paths.home,
        "secrets",
        "seal",
        "--passphrase-file",
        str(pp_file(tmp_path)),
        e=env(UOMP_FAULT=point, UOMP_FAULT_ARM=str(arm)),
    )
    assert res.returncode == -9, res.stderr
    # the next process that opens the home (this one) finishes or undoes it before reading anything
    assert vault.is_sealed_home(paths) is sealed_after
    assert leftovers(paths) == []
    if sealed_after:
        assert scan(paths.home, markers) == []
        vault.unlock_with_passphrase(paths, PASSPHRASE)
    else:
        for f, _role in journal.sealed_files(paths):
            assert not f.read_bytes().startswith(sealing.SEALED_MAGIC)
    assert loaded(paths) == before
    if not sealed_after:  # and a seal run again completes
        migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
        assert scan(paths.home, markers) == []


@pytest.mark.parametrize(
    ("point", "sealed_after"),
    [("atrest.before_commit", True), ("atrest.after_commit", False), ("atrest.apply", False)],
)
def test_unseal_killed_at_each_step_leaves_the_old_keys_or_the_new(
    tmp_path: Path, point: str, sealed_after: bool
) -> None:
    paths = make_home()
    before = loaded(paths)
    markers = secret_markers(paths)
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    vault.forget()
    arm = tmp_path / "arm"
    arm.touch()
    res = uomp(
        paths.home,
        "secrets",
        "unseal",
        "--passphrase-file",
        str(pp_file(tmp_path)),
        e=env(UOMP_FAULT=point, UOMP_FAULT_ARM=str(arm)),
    )
    assert res.returncode == -9, res.stderr
    assert vault.is_sealed_home(paths) is sealed_after
    assert leftovers(paths) == []  # an unseal's uncommitted stage held plaintext: it is gone
    if sealed_after:
        assert scan(paths.home, markers) == []
        vault.unlock_with_passphrase(paths, PASSPHRASE)
    assert loaded(paths) == before


def test_seal_refused_without_a_passphrase_or_a_keychain(tmp_path: Path) -> None:
    paths = make_home()
    res = uomp(paths.home, "secrets", "seal", stdin="")
    assert res.returncode == 1 and res.stderr.startswith("error USAGE: no passphrase"), res.stderr
    assert not paths.master_slot.exists()
    no_keychain = uomp(paths.home, "secrets", "seal", "--keyring")
    assert no_keychain.returncode == 1 and "error CONFIG_ERROR" in no_keychain.stderr, no_keychain.stderr
    assert "plain files" in no_keychain.stderr
    assert not paths.master_slot.exists()
    unseal = uomp(paths.home, "secrets", "unseal")
    assert unseal.returncode == 1 and "error INVALID_STATE" in unseal.stderr


# --------------------------------------------------------------------------- the terminal prompt


def _pty_run(home: Path, args: list[str], answers: list[str]) -> tuple[int, str]:
    pid, fd = pty.fork()
    if pid == 0:  # the child: the uomp command with the pty as its terminal
        os.chdir(REPO)
        os.execvpe(UOMP[0], [*UOMP, "--home", str(home), *args], env())
    out = b""
    pending = list(answers)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
            if out.rstrip().endswith(b":") and pending and out.count(b"passphrase") > len(answers) - len(pending):
                os.write(fd, (pending.pop(0) + "\n").encode())
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_the_passphrase_is_asked_in_the_terminal_without_echo(tmp_path: Path) -> None:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    rc, out = _pty_run(paths.home, ["secrets", "unseal"], ["wrong", "wrong", "wrong"])
    assert rc == 1 and "error PASSPHRASE_WRONG" in out, out
    assert out.count("passphrase for the keys of") == vault.PROMPT_ATTEMPTS
    assert paths.master_slot.exists()
    rc, out = _pty_run(paths.home, ["secrets", "unseal"], ["wrong", PASSPHRASE])
    assert rc == 0, out
    assert PASSPHRASE not in out and "wrong" not in out  # no echo
    assert not paths.master_slot.exists()


# --------------------------------------------------------------------------- the keychain path


def test_the_keychain_path_on_keyrings_alt_file_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What this proves: our use of keyring's API against a real backend (keyrings.alt's
    PlaintextKeyring, named explicitly, a file under XDG_DATA_HOME). Not an OS keychain: there is
    none on this headless machine (Secret Service, macOS Keychain, Windows Credential Locker)."""
    paths = make_home()
    before = loaded(paths)
    kenv = env(PYTHON_KEYRING_BACKEND="keyrings.alt.file.PlaintextKeyring", XDG_DATA_HOME=str(tmp_path / "xdg"))
    res = uomp(paths.home, "secrets", "seal", "--keyring", e=kenv)
    assert res.returncode == 0, res.stderr
    assert "PlaintextKeyring" in res.stdout
    slot = json.loads(paths.master_slot.read_bytes())
    assert slot["method"] == "keyring" and "wrapped" not in slot

    # another key under this home's entry is refused; a missing entry or a damaged store is SECRETS_LOCKED
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    from keyrings.alt.file import PlaintextKeyring

    backend = PlaintextKeyring()
    good = backend.get_password(slot["service"], slot["id"])
    assert good is not None and len(bytes.fromhex(good)) == 32
    backend.set_password(slot["service"], slot["id"], sealing.MasterKey.generate().key.hex())
    monkeypatch.setenv("PYTHON_KEYRING_BACKEND", "keyrings.alt.file.PlaintextKeyring")

    def refusal() -> ErrorCode:
        vault.forget()
        with pytest.raises(UompError) as exc:
            vault.master(paths)
        return exc.value.code

    assert refusal() == ErrorCode.KEY_ERROR
    backend.delete_password(slot["service"], slot["id"])
    assert refusal() == ErrorCode.SECRETS_LOCKED
    store = Path(backend.file_path)
    store.write_text("not a keyring file")
    assert refusal() == ErrorCode.SECRETS_LOCKED
    store.unlink()
    backend.set_password(slot["service"], slot["id"], good)
    ok = uomp(paths.home, "secrets", "unseal", e=kenv)
    assert ok.returncode == 0, ok.stderr
    assert loaded(paths) == before
