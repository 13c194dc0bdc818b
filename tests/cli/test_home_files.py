"""A set-up home whose keys or certificates went missing or broke: `uomp gateway start` refuses with the file
and the safe fix instead of making them anew; `uomp doctor` parses each one and names the broken file; a CA
whose registry is gone never gets an empty one (that would un-revoke every revoked certificate)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from portkit import own_ports_env

from gateway import ca_store
from gateway.config import Paths
from gateway.errors import UompError

UOMP = [sys.executable, "-m", "gateway.cli.main"]


def uomp(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=60, env=own_ports_env()
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("pristine") / "home"
    assert uomp(home, "init").returncode == 0
    return home


def copy_of(pristine: Path, tmp_path: Path) -> Path:
    home = tmp_path / "home"
    subprocess.run(["cp", "-a", str(pristine), str(home)], check=True)
    return home


CASES = [
    ("ca/ca.crt", "missing", "CA_ERROR: CA certificate", "run: uomp init (re-makes it from your CA"),
    ("ca/gateway.crt", "missing", "CA_ERROR: gateway certificate", "run: uomp init"),
    ("ca/crl.pem", "missing", "CA_ERROR: CRL", "run: uomp init"),
    ("ca/gateway.key", "garbage", "KEY_ERROR: gateway key", "move it and ca/gateway.crt aside"),
    ("ca/ca.key", "missing", "KEY_ERROR: CA key", "restore it from your backup"),
    ("ca/ca.key", "garbage", "KEY_ERROR: CA key", "restore it from your backup"),
    ("ca/issued.db", "missing", "CA_ERROR: CA registry", "a new one would forget every revocation"),
    ("ca/gateway.crt", "other", "CA_ERROR: gateway certificate", "does not match ca/gateway.key"),
    (".secrets/admin-token", "garbage", "KEY_ERROR: admin credential", "restore it"),
]


@pytest.mark.parametrize(("name", "damage", "error", "fix"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_start_refuses_a_damaged_home_and_doctor_names_the_file(
    pristine: Path, tmp_path: Path, name: str, damage: str, error: str, fix: str
) -> None:
    home = copy_of(pristine, tmp_path)
    target = home / name
    if damage == "missing":
        target.unlink()
    elif damage == "garbage":
        target.write_bytes(b"garbage\n")
    else:  # another (valid) certificate in its place: the CA's own
        target.write_bytes((home / "ca" / "ca.crt").read_bytes())
    before = sorted(p.name for p in (home / "ca").iterdir())
    res = uomp(home, "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port")
    assert res.returncode == 1 and res.stderr.startswith(f"error {error} {target}"), res.stderr
    assert fix in res.stderr and "--listen" not in res.stderr
    assert sorted(p.name for p in (home / "ca").iterdir()) == before  # nothing made anew
    doc = uomp(home, "doctor")
    assert doc.returncode == 1 and f"{target}" in doc.stdout and "PROBLEM" in doc.stdout
    assert f"ok       {error.split(': ', 1)[1]} {target}" not in doc.stdout


def test_the_safe_repairs_are_one_command_away(pristine: Path, tmp_path: Path) -> None:
    home = copy_of(pristine, tmp_path)
    ca_before = (home / "ca" / "ca.key").read_bytes()
    for name in ("ca/ca.crt", "ca/gateway.crt", "ca/crl.pem"):
        (home / name).unlink()
    assert uomp(home, "init").returncode == 0
    assert (home / "ca" / "ca.key").read_bytes() == ca_before  # the same CA: agents keep working
    doc = uomp(home, "doctor")
    assert "PROBLEM" not in doc.stdout, doc.stdout
    assert "ok       gateway certificate " in doc.stdout and "(parsed)" in doc.stdout


def test_a_lost_registry_is_never_replaced_by_an_empty_one(pristine: Path, tmp_path: Path) -> None:
    home = copy_of(pristine, tmp_path)
    paths = Paths(home)
    files = ca_store.issue_with_key(paths, "agent_a", tmp_path / "a")
    ca_store.revoke(paths, f"serial:{files.serial}")
    assert int(files.serial, 16) in ca_store.revoked_serials(paths)
    paths.ca_registry.unlink()
    for call in (
        lambda: ca_store.list_agents(paths),
        lambda: ca_store.refresh_crl(paths),
        lambda: ca_store.issue_with_key(paths, "agent_b", tmp_path / "b"),
        lambda: ca_store.init_all(paths),
    ):
        with pytest.raises(UompError) as err:
            call()
        assert err.value.code == "CA_ERROR" and "would forget every revocation" in err.value.message
    assert not paths.ca_registry.exists()
    assert uomp(home, "init").returncode == 1
