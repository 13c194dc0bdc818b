"""``uomp backup verify FILE`` checks every chunk, hash and the manifest without restoring (exit 1
and ``BACKUP_INVALID`` for each of the seven kinds of damage the restore refuses); a backup
encrypted to an X25519 recipient (``--to-recipient``, ``uomp backup keygen``) restores only with
that identity: another identity, the passphrase, or a header pointed at another recipient are
refused, and nothing secret is in argv, output or leftover files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from backupkit import DAMAGES, damaged, marked_value, new_home, put_marked, refusals
from guardkit import seed
from test_sealed_cli import env, pp_file, uomp
from test_sealed_keys import FAST, loaded, make_home, secret_markers

from gateway.atrest import backup, recipient, vault
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError

pytestmark = pytest.mark.timeout(90)

BACKUP_PASS = b"verify-pass-51be"
MARK = "verify-value-marker-7f3e"


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()


def home_with_items() -> Paths:
    paths = make_home()
    seed(paths)
    return put_marked(paths, MARK)


@pytest.fixture(scope="module")
def made() -> tuple[Path, Path]:
    paths = home_with_items()
    out = paths.home.parent / "home.uompbak"
    backup.create(paths, out, BACKUP_PASS, kdf=FAST)
    return paths.home, out


def test_verify_passes_a_whole_backup_and_writes_nothing(made: tuple[Path, Path]) -> None:
    home, out = made
    before = sorted(os.listdir(out.parent))
    manifest = backup.verify(out, BACKUP_PASS)
    assert {f["path"] for f in manifest["files"]} >= {"memory.db", "ca/ca.key"}
    res = uomp(home, "backup", "verify", str(out), "--passphrase-file", str(pp_file(home.parent, BACKUP_PASS.decode())))
    assert res.returncode == 0 and "backup verified" in res.stdout, res.stderr
    after = sorted(os.listdir(out.parent))
    assert after == sorted({*before, "passphrase"})
    with pytest.raises(UompError) as wrong:
        backup.verify(out, b"not the passphrase")
    assert wrong.value.code == ErrorCode.PASSPHRASE_WRONG


@pytest.mark.parametrize("damage", DAMAGES)
def test_verify_refuses_each_kind_of_damage(made: tuple[Path, Path], tmp_path: Path, damage: str) -> None:
    _home, out = made
    bad = tmp_path / "bad.uompbak"
    bad.write_bytes(damaged(out.read_bytes(), damage))
    with pytest.raises(UompError) as exc:
        backup.verify(bad, BACKUP_PASS)
    assert exc.value.code in refusals(damage), exc.value
    res = uomp(
        tmp_path / "h",
        "backup",
        "verify",
        str(bad),
        e=env(UOMP_BACKUP_PASSPHRASE_FILE=str(pp_file(tmp_path, BACKUP_PASS.decode()))),
    )
    assert res.returncode == 1 and f"error {exc.value.code}" in res.stderr, res.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.uompbak", "passphrase"]  # nothing written


def test_a_backup_to_a_recipient_opens_only_with_its_identity(tmp_path: Path) -> None:
    paths = home_with_items()
    before = loaded(paths)
    ident = tmp_path / "me.identity"
    kg = uomp(paths.home, "backup", "keygen", str(ident))
    assert kg.returncode == 0, kg.stderr
    pub = kg.stdout.splitlines()[0]
    assert pub.startswith(recipient.PREFIX) and (ident.stat().st_mode & 0o777) == 0o600
    assert ident.read_bytes() not in kg.stdout.encode()
    out = tmp_path / "to-me.uompbak"
    res = uomp(paths.home, "backup", "create", str(out), "--to-recipient", pub)
    assert res.returncode == 0, res.stderr
    data = out.read_bytes()
    for m in [MARK.encode(), *secret_markers(paths)]:
        assert m not in data
    assert uomp(paths.home, "backup", "verify", str(out), "--identity", str(ident)).returncode == 0
    # denied partners: another identity, the passphrase, a header that names another recipient
    other = tmp_path / "other.identity"
    recipient.new_identity(other)
    denied: list[dict[str, Any]] = [{"identity": recipient.load_identity(other)}, {"passphrase": BACKUP_PASS}]
    for kwargs in denied:
        with pytest.raises(UompError) as exc:
            backup.verify(out, **kwargs)
        assert exc.value.code == ErrorCode.BACKUP_KEY_WRONG, exc.value
        with pytest.raises(UompError) as exc:
            backup.restore(out, tmp_path / "x", **kwargs)
        assert exc.value.code == ErrorCode.BACKUP_KEY_WRONG, exc.value
    assert not (tmp_path / "x").exists()
    cli = uomp(tmp_path / "y", "backup", "restore", str(out), "--identity", str(other))
    assert cli.returncode == 1 and "error BACKUP_KEY_WRONG" in cli.stderr and pub in cli.stderr
    other_pub = recipient.recipient_text(recipient.load_identity(other).public_key()).removeprefix(recipient.PREFIX)
    mine_pub = pub.removeprefix(recipient.PREFIX)
    swapped = tmp_path / "swapped.uompbak"
    swapped.write_bytes(data.replace(mine_pub.encode(), other_pub.encode(), 1))
    with pytest.raises(UompError) as exc:
        backup.verify(swapped, identity=recipient.load_identity(other))
    assert exc.value.code == ErrorCode.BACKUP_INVALID
    flipped = tmp_path / "flipped.uompbak"
    flipped.write_bytes(damaged(data, "flip_middle"))
    with pytest.raises(UompError) as exc:
        backup.verify(flipped, identity=recipient.load_identity(ident))
    assert exc.value.code == ErrorCode.BACKUP_INVALID
    # the allowed case: restore with the identity; same keys, same items
    target = new_home()
    res = uomp(target, "backup", "restore", str(out), "--identity", str(ident))
    assert res.returncode == 0, res.stderr
    assert loaded(Paths(target)) == before
    assert marked_value(Paths(target)) == MARK


def test_a_passphrase_backup_refuses_an_identity_and_bad_recipients(made: tuple[Path, Path], tmp_path: Path) -> None:
    _home, out = made
    ident = tmp_path / "id"
    recipient.new_identity(ident)
    with pytest.raises(UompError) as exc:
        backup.verify(out, identity=recipient.load_identity(ident))
    assert exc.value.code == ErrorCode.BACKUP_KEY_WRONG
    for bad in ("uomp-x25519:abcd", "00" * 32, "uomp-x25519:" + "zz" * 32):
        with pytest.raises(UompError) as exc:
            recipient.parse_recipient(bad)
        assert exc.value.code == ErrorCode.USAGE
    ident.chmod(0o644)
    with pytest.raises(UompError) as exc:
        recipient.load_identity(ident)
    assert exc.value.code == ErrorCode.UNSAFE_PERMISSIONS
