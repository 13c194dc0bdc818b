"""``uomp gateway start`` on a sealed home, as a user runs it: refused when locked or given the
wrong passphrase; with ``UOMP_PASSPHRASE_FILE`` the gateway's TLS key is opened in memory, the
guard child gets the master key on a pipe, an agent reads through mTLS; and no passphrase or key
is in any output, argv, environment or file of the home afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from shortdir import short_dir
from test_sealed_cli import REPO, UOMP, env, pp_file, uomp
from test_sealed_keys import PASSPHRASE, scan, secret_markers

from gateway.atrest import memdb, vault
from gateway.client import UompClient
from gateway.config import Paths

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- the appliance, sealed


def _proc_text(pid: int, what: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d.name))
    return out


async def test_the_appliance_runs_on_a_sealed_home_and_no_secret_leaks(tmp_path: Path) -> None:
    home = short_dir("uomp-sc-") / "home"
    pp = pp_file(tmp_path)
    e = env(**{vault.PASSPHRASE_FILE_ENV: str(pp)})
    outputs: list[str] = []

    def run(*args: str, e: dict[str, str] = e) -> subprocess.CompletedProcess[str]:
        res = uomp(home, *args, e=e)
        outputs.extend([res.stdout, res.stderr])
        return res

    assert run("init").returncode == 0
    assert (
        run(
            "memory",
            "add",
            "preference.theme",
            "--value",
            '"dark-marker-7f3a"',
            "--tag",
            "preference",
            "--sensitivity",
            "low",
        ).returncode
        == 0
    )
    assert run("secrets", "seal").returncode == 0
    paths = Paths(home)

    # denied partners first: no passphrase source and no terminal, then a wrong passphrase
    locked = run("gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port", e=env())
    assert locked.returncode == 1 and "error SECRETS_LOCKED" in locked.stderr, locked.stderr
    bad = pp_file(tmp_path / "..", "not it")
    wrong = run(
        "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port", e=env(**{vault.PASSPHRASE_FILE_ENV: str(bad)})
    )
    assert wrong.returncode == 1 and "error PASSPHRASE_WRONG" in wrong.stderr, wrong.stderr
    assert not paths.guard_sock.exists()

    proc = subprocess.Popen(
        [*UOMP, "--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=e,
        cwd=REPO,
    )
    log: list[str] = []
    try:
        deadline = time.monotonic() + 60
        port = None
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line:
                log.append(line)
                if m := re.match(r"gateway: https://localhost:(\d+)", line):
                    port = int(m.group(1))
            else:
                assert proc.poll() is None, "".join(log)
                time.sleep(0.05)
        assert port is not None, "".join(log)
        auth = run(
            "authorize",
            str(REPO / "examples" / "calendar_agent"),
            "--remote",
            "--out",
            str(tmp_path / "agent"),
            "--gateway-url",
            f"https://localhost:{port}",
            "--yes",
        )
        assert auth.returncode == 0, auth.stderr
        async with UompClient.from_bundle(str(tmp_path / "agent" / "bundle.json")) as client:
            item = await client.get("preference.theme")
        assert item["value"] == "dark-marker-7f3a"
        busy = run("secrets", "unseal")
        assert busy.returncode == 1 and "error ALREADY_RUNNING" in busy.stderr, busy.stderr
        assert paths.master_slot.exists()

        vault.unlock_with_passphrase(paths, PASSPHRASE)
        master_hex = vault.unlocked(paths).key.hex().encode()  # type: ignore[union-attr]
        guards = _children(proc.pid)
        assert guards, "the guard child runs"
        for pid in [proc.pid, *guards]:
            environ = _proc_text(pid, "environ")
            cmdline = _proc_text(pid, "cmdline")
            for secret in (master_hex, PASSPHRASE.encode()):
                assert secret not in environ and secret not in cmdline
        assert any(vault.MASTER_FD_ENV.encode() in _proc_text(g, "environ") for g in guards)
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=60)
        log.append(rest or "")
    markers = [*secret_markers(paths), master_hex]
    text = "".join(log) + "".join(outputs)
    assert not [m for m in markers if m.decode("latin-1") in text], "a secret in the output"
    assert scan(home, markers) == []
    # the memory store is SQLCipher: the value is in none of memory.db, -wal, -shm
    assert not memdb.is_plaintext(paths.memory_db)
    for suffix in ("", "-wal", "-shm"):
        db = Path(str(paths.memory_db) + suffix)
        assert not db.exists() or b"dark-marker-7f3a" not in db.read_bytes(), db
    assert b"dark-marker-7f3a" not in (home / "audit.db").read_bytes()  # the log records keys, never values
    # the agent's own files hold the agent's key, never one of the home's
    assert scan(tmp_path / "agent", markers) == []
