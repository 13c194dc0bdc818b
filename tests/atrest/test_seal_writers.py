"""``uomp secrets seal`` / ``unseal`` rewrite memory.db and audit.db whole, so they never run while
another process's tool writes them (gateway/atrest/writers.py), with real processes: a ``uomp
import`` that has its store open (held on a FIFO it reads) makes the seal (and the unseal) refuse
with STORE_BUSY, nothing changed; the import then finishes, its items and its audit event are in
the files the seal converts afterwards. The other way round: a tool that starts while a seal holds
the lock waits for it, then writes into the converted store."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from guardkit import guard_config, running_guard, seed
from test_sealed_cli import UOMP, env, pp_file, uomp
from test_sealed_keys import make_home

from gateway.atrest import memdb, vault, writers
from gateway.config import Paths

REPO = Path(__file__).resolve().parents[2]
# A user's tool in a process of its own, as `uomp memory add` opens the home (its store and the
# audit log's change); it writes once told to on stdin.
TOOL = """
import sys
from pathlib import Path
from gateway.cli import userlog
from gateway.config import Paths
from gateway.guard.items import MemoryItem, utc_now
from gateway.guard.stores import open_user_store
paths = Paths(Path(sys.argv[1]))
with open_user_store(paths) as store, userlog.change(paths) as event:
    print("open", flush=True)
    sys.stdin.readline()
    now = utc_now()
    store.put(MemoryItem("tool.key", 1, ("t",), "low", "user", now, now))
    event.action, event.key, event.reason = "memory_added", "tool.key", "the user added an item"
"""
BOUND = 60.0  # a wait past this is the defect (a process that never gets there)


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()


def until(cond: object, what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def lock_taken(paths: Paths) -> bool:
    """Someone holds the writers' lock (tried from here without waiting, let go at once)."""
    lock = writers.lock_path(paths)
    if not lock.exists():
        return False
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def has_open(pid: int, path: str) -> bool:
    """Whether process ``pid`` has ``path`` open (its /proc fd links; one may close meanwhile)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # it ended
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                return True
    return False


def keys_in(paths: Paths) -> set[str]:
    """The item keys in memory.db, read with SQL (SQLCipher under the home's key when sealed)."""
    key = memdb.key_for(paths)
    conn = memdb.connect(str(paths.memory_db), key) if key else sqlite3.connect(paths.memory_db)
    try:
        return {row[0] for row in conn.execute("SELECT key FROM items").fetchall()}
    finally:
        conn.close()


@pytest.mark.parametrize("command", ["seal", "unseal"])
def test_a_seal_is_refused_while_a_tool_writes_and_the_tools_writes_survive(command: str, tmp_path: Path) -> None:
    paths = make_home()
    seed(paths)
    pp = pp_file(tmp_path)
    e = env(UOMP_PASSPHRASE_FILE=str(pp))
    if command == "unseal":
        res = uomp(paths.home, "secrets", "seal", "--passphrase-file", str(pp))
        assert res.returncode == 0, res.stderr
    tool = subprocess.Popen(
        [*UOMP[:1], "-c", TOOL, str(paths.home)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=e,
        cwd=REPO,
    )
    try:
        assert tool.stdout is not None and tool.stdout.readline().strip() == "open", tool.stderr
        assert lock_taken(paths)
        refused = uomp(paths.home, "secrets", command, "--passphrase-file", str(pp), e=e)
        assert refused.returncode == 1 and "error STORE_BUSY" in refused.stderr, refused.stdout + refused.stderr
        assert "run this again when it has finished" in refused.stderr
        assert paths.master_slot.exists() == (command == "unseal")  # nothing changed
        assert memdb.is_plaintext(paths.memory_db) == (command == "seal")
        out, err = tool.communicate("write\n", timeout=BOUND)  # the tool writes its item and its event
        assert tool.returncode == 0, out + err
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.wait()
    ok = uomp(paths.home, "secrets", command, "--passphrase-file", str(pp), e=e)
    assert ok.returncode == 0, ok.stderr
    assert memdb.is_plaintext(paths.memory_db) == (command == "unseal")
    if command == "seal":
        vault.unlock_with_passphrase(paths, pp.read_text().strip())
    assert "tool.key" in keys_in(paths)  # the write landed in the file the seal converted
    audit = uomp(paths.home, "audit", "--session", "user", "--json", e=e)
    assert audit.returncode == 0 and "tool.key" in audit.stdout, audit.stdout + audit.stderr


HOLDER = """
import sys
from gateway.atrest import writers
from pathlib import Path
from gateway.config import Paths
with writers.sealing(Paths(Path(sys.argv[1]))):
    print("held", flush=True)
    sys.stdin.read()
"""


def run_during_a_seal(paths: Paths, argv: list[str], while_held: Callable[[], None] = lambda: None) -> str:
    """``uomp ARGV`` started while another process holds the seal's lock: it asks for the writers'
    lock and waits (``while_held`` checks the files meanwhile); once the seal ends it runs to
    exit 0. Its standard output."""
    holder = subprocess.Popen(
        [*UOMP[:1], "-c", HOLDER, str(paths.home)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    tool = None
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        tool = subprocess.Popen(
            [*UOMP, "--home", str(paths.home), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
            cwd=REPO,
        )
        lock = str(writers.lock_path(paths))
        until(lambda: has_open(tool.pid, lock), "the command asks for the writers' lock")
        time.sleep(0.3)
        assert tool.poll() is None  # waiting: the seal holds the lock
        while_held()
        assert holder.stdin is not None
        holder.stdin.close()  # the seal ends
        assert holder.wait(timeout=BOUND) == 0
        out, err = tool.communicate(timeout=BOUND)
        assert tool.returncode == 0, out + err
        return out
    finally:
        for p in (holder, tool):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_tool_started_during_a_seal_waits_for_it(tmp_path: Path) -> None:
    paths = make_home()
    seed(paths)

    def not_yet() -> None:
        assert "waited.key" not in keys_in(paths)

    add = ["memory", "add", "waited.key", "--value", "1", "--tag", "t", "--sensitivity", "low"]
    run_during_a_seal(paths, add, not_yet)
    assert "waited.key" in keys_in(paths)


async def test_a_seal_is_refused_while_a_guard_serves_the_home_on_its_own(tmp_path: Path) -> None:
    paths = make_home()
    seed(paths)
    pp = pp_file(tmp_path)
    async with running_guard(paths, guard_config(), serve_tcp=False):  # no appliance lock: a guard alone
        refused = await asyncio.to_thread(uomp, paths.home, "secrets", "seal", "--passphrase-file", str(pp))
        assert refused.returncode == 1 and "error ALREADY_RUNNING" in refused.stderr, refused.stdout + refused.stderr
        assert not paths.master_slot.exists() and memdb.is_plaintext(paths.memory_db)
    ok = uomp(paths.home, "secrets", "seal", "--passphrase-file", str(pp))  # the partner: once it stopped
    assert ok.returncode == 0, ok.stderr


# A command that opens the Auth Service (``uomp authorize``, ``enroll``, ``run``: their events go to
# audit.db), held open until told to close on stdin.
AUTH_TOOL = """
import sys
from pathlib import Path
from gateway.cli.guard import open_auth
from gateway.config import GuardConfig, Paths
paths = Paths(Path(sys.argv[1]))
auth = open_auth(paths, GuardConfig())
print("open", flush=True)
sys.stdin.readline()
auth.close_db()
auth.audit.close()
print("closed", flush=True)
sys.stdin.readline()
"""


def test_a_seal_is_refused_while_a_command_has_the_auth_service_open(tmp_path: Path) -> None:
    paths = make_home()
    seed(paths)
    pp = pp_file(tmp_path)
    tool = subprocess.Popen(
        [*UOMP[:1], "-c", AUTH_TOOL, str(paths.home)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        cwd=REPO,
    )
    try:
        assert tool.stdout is not None and tool.stdin is not None
        assert tool.stdout.readline().strip() == "open"
        refused = uomp(paths.home, "secrets", "seal", "--passphrase-file", str(pp))
        assert refused.returncode == 1 and "error STORE_BUSY" in refused.stderr, refused.stdout + refused.stderr
        assert not paths.master_slot.exists()
        tool.stdin.write("\n")
        tool.stdin.flush()
        assert tool.stdout.readline().strip() == "closed"  # its audit log closed: the lock let go
        ok = uomp(paths.home, "secrets", "seal", "--passphrase-file", str(pp))
        assert ok.returncode == 0, ok.stderr
        tool.stdin.close()
        assert tool.wait(timeout=BOUND) == 0
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.wait()


async def test_a_running_guard_holds_the_writers_lock_until_it_stops(tmp_path: Path) -> None:
    # the guard's databases are open from before its socket is bound: the lock, not the socket, is what
    # stops a seal in that window
    paths = make_home()
    seed(paths)
    assert not lock_taken(paths)
    async with running_guard(paths, guard_config(), serve_tcp=False):
        assert lock_taken(paths)
    assert not lock_taken(paths)  # the partner: let go at the stop


def test_a_guard_started_during_a_seal_waits_for_it_then_serves(tmp_path: Path) -> None:
    paths = make_home()
    seed(paths)
    holder = subprocess.Popen(
        [*UOMP[:1], "-c", HOLDER, str(paths.home)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    guard = None
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        guard = subprocess.Popen(
            [*UOMP, "--home", str(paths.home), "guard", "serve", "--no-tcp"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
            cwd=REPO,
        )
        lock = str(writers.lock_path(paths))
        until(lambda: has_open(guard.pid, lock), "the guard asks for the writers' lock")
        assert guard.poll() is None
        # waiting before any database: neither file is open in the guard yet
        assert not has_open(guard.pid, str(paths.audit_db)) and not has_open(guard.pid, str(paths.memory_db))
        assert holder.stdin is not None
        holder.stdin.close()  # the seal ends
        assert holder.wait(timeout=BOUND) == 0
        until(lambda: has_open(guard.pid, str(paths.audit_db)), "the guard opens its databases after the seal")
        assert guard.poll() is None
        assert lock_taken(paths)  # and holds the lock while it serves
    finally:
        for p in (holder, guard):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=BOUND)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.mark.parametrize("what", ["show", "proof"])
def test_audit_commands_that_write_the_log_wait_for_a_seal(what: str, tmp_path: Path) -> None:
    """``uomp audit`` (it migrates an older table at open) and ``uomp audit proof`` (it signs a
    checkpoint when no guard runs) write audit.db: started during a seal they wait for it, then run
    on the converted file."""
    paths = make_home()
    seed(paths)
    added = uomp(paths.home, "memory", "add", "proof.key", "--value", "1", "--tag", "t", "--sensitivity", "low")
    assert added.returncode == 0, added.stderr
    listed = uomp(paths.home, "audit", "--session", "user", "--json")
    assert listed.returncode == 0, listed.stderr
    event_id = next(e["id"] for e in json.loads(listed.stdout) if e.get("key") == "proof.key")
    argv = ["audit", "--session", "user", "--json"] if what == "show" else ["audit", "proof", event_id]
    assert event_id in run_during_a_seal(paths, argv)
