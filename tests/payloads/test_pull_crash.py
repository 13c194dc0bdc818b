"""``uomp payload pull`` killed, interrupted, or left alone by a dying guard: no plaintext is left
anywhere, ``--out`` appears only after ``payload_opened`` is durable, and the plain retry works.

Real processes: the guard runs as ``uomp guard serve --no-tcp``, the pull as the ``uomp`` command,
each in its own subprocess; the payload is sealed to the user's key and stored in the relay's
store. Test-only fault points (``UOMP_FAULT`` + an arm file, gateway.payloads.store.fault_hold)
stop a process at a named point and write ``<arm>.held``; the test sends the signal there. After
each case the data directory and the output directory are searched for the plaintext's marker."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from guardkit import admin_headers, call, seed, unix_session

from gateway import ca_store
from gateway.client import payloads as sdk_payloads
from gateway.config import Paths
from gateway.core import envelope, sealing
from gateway.payloads import userkey
from gateway.payloads.store import PayloadStore

pytestmark = pytest.mark.timeout(120)

UOMP = [sys.executable, "-m", "gateway.cli.main"]
MARK = b"PLAINTEXT-MARKER-5c1e9d"
PLAIN = (MARK + b" quarterly figures " + b"." * 4000 + b"\n") * 1500  # ~6 MB, the marker in every 4 KB
FALLBACK = (
    "import sys; import gateway.payloads.pulltemp as t; t.ANONYMOUS = False; "
    "from gateway.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


def _env(fault: str | None = None, arm: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("UOMP_FAULT", "UOMP_FAULT_ARM")}
    if fault:
        assert arm is not None
        arm.write_text("armed")
        env.update(UOMP_FAULT=fault, UOMP_FAULT_ARM=str(arm))
    return env


def plaintext_files(*roots: Path) -> list[Path]:
    """Every file under ``roots`` holding the plaintext's marker."""
    found = []
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                p = Path(dirpath) / name
                with contextlib.suppress(OSError):
                    if not p.is_symlink() and MARK in p.read_bytes():
                        found.append(p)
    return found


def opened_events(paths: Paths) -> list[dict[str, Any]]:
    from gateway.ledger.query import MAX_LIMIT, AuditFilter, query_events

    conn = sqlite3.connect(paths.audit_db)
    try:
        return query_events(conn, AuditFilter(action=("payload_opened",), limit=MAX_LIMIT)).events
    finally:
        conn.close()


def store_payload(paths: Paths, data: bytes = PLAIN, *, recipient: Any = None) -> str:
    """A sealed payload in the relay's store, as an upload leaves it."""
    pub = recipient or envelope.parse_public_key(userkey.public_b64(paths))
    pid = sdk_payloads.new_payload_id()
    enc, sealed = sealing.seal_bytes(pub, sealing.Binding(pid, "sess_pullcrash1", "calendar_agent", "text/plain"), data)
    store = PayloadStore.open(paths.payload_dir)
    try:
        up = store.begin(
            payload_id=pid, session_id="sess_pullcrash1", agent_id="calendar_agent", format="text/plain", encryption=enc
        )
        up.write(sealed)
        up.commit(declared_hash="sha256:" + hashlib.sha256(sealed).hexdigest(), declared_size=len(sealed))
    finally:
        store.close()
    return pid


async def _wait(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class Guard:
    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, env: dict[str, str] | None = None) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *UOMP,
            "--home",
            str(self.paths.home),
            "guard",
            "serve",
            "--no-tcp",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env=env or _env(),
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, aiohttp.ClientError):
                async with unix_session(self.paths) as s:
                    st, _, _ = await call(s, "GET", "/v1/payloads", headers=admin_headers(self.paths))
                    if st == 200:
                        return
            assert self.proc.returncode is None, "the guard exited"
            await asyncio.sleep(0.1)
        raise AssertionError("the guard did not start")

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 30)
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()


@contextlib.asynccontextmanager
async def guard(home: Paths) -> AsyncIterator[Guard]:
    ca_store.init_all(home)
    seed(home)
    userkey.ensure(home)
    g = Guard(home)
    await g.start()
    try:
        yield g
    finally:
        await g.stop()


async def pull(
    paths: Paths, pid: str, out: Path, *extra: str, env: dict[str, str] | None = None, fallback: bool = False
) -> asyncio.subprocess.Process:
    head = [sys.executable, "-c", FALLBACK] if fallback else UOMP
    return await asyncio.create_subprocess_exec(
        *head,
        "--home",
        str(paths.home),
        "payload",
        "pull",
        pid,
        "--out",
        str(out),
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env or _env(),
    )


async def pull_done(paths: Paths, pid: str, out: Path, *extra: str) -> tuple[int, str]:
    proc = await pull(paths, pid, out, *extra)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


def _part_in(directory: Path) -> bool:
    """A named temporary plaintext file of at least 1 MiB beside --out (how an older pull kept it)."""
    return any(p.name.endswith(".part") and p.stat().st_size >= 1 << 20 for p in directory.iterdir() if p.is_file())


@pytest.mark.parametrize(
    "sig",
    [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
    ids=["SIGKILL", "SIGTERM", "SIGINT", "SIGHUP"],
)
async def test_pull_ended_mid_decrypt_leaves_no_plaintext_and_the_retry_works(
    home: Paths, tmp_path: Path, sig: signal.Signals
) -> None:
    out_dir = tmp_path / "reports"
    out_dir.mkdir()
    out = out_dir / "report.md"
    arm = tmp_path / "arm"
    async with guard(home):
        pid = store_payload(home)
        proc = await pull(home, pid, out, env=_env("pull_mid_decrypt", arm))
        held = Path(str(arm) + ".held")
        await _wait(
            lambda: held.exists() or _part_in(out_dir) or proc.returncode is not None, "the pull to be mid-decrypt"
        )
        proc.send_signal(sig)
        await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode != 0
        assert not out.exists()
        assert plaintext_files(home.home, tmp_path) == []
        assert opened_events(home) == []
        if sig != signal.SIGKILL:
            assert proc.returncode == -sig  # cleaned up, then ended by the signal as asked
        # the plain retry: no --force needed, one payload_opened
        rc, err = await pull_done(home, pid, out)
        assert rc == 0, err
        assert out.read_bytes() == PLAIN and oct(out.stat().st_mode & 0o777) == "0o600"
        assert [e["key"] for e in opened_events(home)] == [pid]
        assert plaintext_files(home.home, tmp_path) == [out]
        assert sorted(p.name for p in out_dir.iterdir()) == ["report.md"]


async def test_guard_killed_before_the_open_is_recorded_gives_no_output_and_the_retry_works(
    home: Paths, tmp_path: Path
) -> None:
    out = tmp_path / "report.md"
    arm = tmp_path / "arm"
    ca_store.init_all(home)
    seed(home)
    userkey.ensure(home)
    pid = store_payload(home)
    g = Guard(home)
    await g.start(_env("payload_opened_received", arm))
    try:
        proc = await pull(home, pid, out)
        held = Path(str(arm) + ".held")
        await _wait(
            lambda: held.exists() or out.exists() or proc.returncode is not None,
            "the pull to ask the guard to record the opening",
        )
        await g.kill()  # the appliance dies mid-pull
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert not out.exists()
        assert plaintext_files(home.home, tmp_path) == []
        assert opened_events(home) == []
        assert proc.returncode == 1, err
        assert "STORE_UNAVAILABLE" in err.decode() and "nothing was written" in err.decode()
        await g.start()
        rc, err2 = await pull_done(home, pid, out)  # the plain retry, without --force
        assert rc == 0, err2
        assert out.read_bytes() == PLAIN
        assert [e["key"] for e in opened_events(home)] == [pid]
        async with unix_session(home) as s:
            st, meta, _ = await call(s, "GET", f"/v1/payloads/{pid}", headers=admin_headers(home))
        assert st == 200 and meta["opened"] is True
    finally:
        await g.stop()


async def test_refusals_stay_an_existing_file_and_a_foreign_key(home: Paths, tmp_path: Path) -> None:
    async with guard(home):
        pid = store_payload(home, MARK + b" small report\n")
        out = tmp_path / "mine.txt"
        out.write_bytes(b"the user's own file\n")
        rc, err = await pull_done(home, pid, out)
        assert rc == 1 and "INVALID_REQUEST" in err and "--force" in err, err
        assert out.read_bytes() == b"the user's own file\n"
        assert opened_events(home) == []
        rc, err = await pull_done(home, pid, out, "--force")
        assert rc == 0, err
        assert out.read_bytes() == MARK + b" small report\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
        stranger = store_payload(home, recipient=X25519PrivateKey.generate().public_key())
        other = tmp_path / "stranger.txt"
        rc, err = await pull_done(home, stranger, other)
        assert rc == 1 and "PAYLOAD_INVALID" in err, err
        assert not other.exists() and plaintext_files(home.home, tmp_path) == [out]
        assert [e["key"] for e in opened_events(home)] == [pid]


async def test_named_fallback_killed_is_swept_by_the_next_pull_and_by_the_guard_start(
    home: Paths, tmp_path: Path
) -> None:
    """Without O_TMPFILE the plaintext has a recognisable name until it is published; a SIGKILL
    leaves it, and the next pull or the guard's start-up removes it (its journal's lock is free)."""
    out = tmp_path / "report.md"
    arm = tmp_path / "arm"
    async with guard(home) as g:
        pid = store_payload(home)
        for sweeper in ("next pull", "guard start"):
            proc = await pull(home, pid, out, env=_env("pull_mid_decrypt", arm), fallback=True)
            held = Path(str(arm) + ".held")
            await _wait(held.exists, "the pull to be mid-decrypt")
            held.unlink()
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            left = plaintext_files(home.home, tmp_path)
            assert [p.parent for p in left] == [tmp_path] and left[0].name.startswith(".uomp-pull-"), left
            assert len(list((home.payload_dir / "pulls").glob("*.pull"))) == 1
            if sweeper == "next pull":
                rc, err = await pull_done(home, pid, out)
                assert rc == 0, err
                assert plaintext_files(home.home, tmp_path) == [out]
                out.unlink()
            else:
                await g.stop()
                await g.start()
                assert plaintext_files(home.home, tmp_path) == []
            assert list((home.payload_dir / "pulls").iterdir()) == []
