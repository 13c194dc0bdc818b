"""Checkpoint timing against a wall clock that steps, on a real guard process under Debian's
libfaketime (``scripts/setup-faketime.sh``): the wall clock is read from a file the test rewrites
mid-run (``FAKETIME_TIMESTAMP_FILE``, no cache), the monotonic clock is left real
(``FAKETIME_DONT_FAKE_MONOTONIC=1``). Stepped back, checkpoints keep coming (the interval runs on
the monotonic clock) and their timestamps do not go back; stepped forward between an event and its
checkpoint, ``uomp audit verify`` warns and stays green."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from integritykit import UOMP, Guard

from gateway.config import Paths
from gateway.core.checkpoint import Checkpoint

pytestmark = pytest.mark.timeout(120)

LIBS = [
    Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"),
    Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"),
]


def _lib() -> Path:
    for lib in LIBS:
        if lib.exists():
            return lib
    if os.environ.get("CI"):
        pytest.fail("libfaketime is missing: run scripts/setup-faketime.sh")
    pytest.skip("libfaketime is missing (scripts/setup-faketime.sh installs it)")


@pytest.fixture
def clock(home: Paths) -> Iterator[tuple[Path, dict[str, str]]]:
    lib = _lib()
    offset = home.home / "faketime"
    offset.write_text("+0\n")
    # libfaketime 0.9.10 makes clock_nanosleep fail (EINVAL) when it leaves the monotonic clock real;
    # the guard's paths here never call time.sleep (asyncio waits on epoll), the test process is not faked.
    yield (
        offset,
        {
            "LD_PRELOAD": str(lib),
            "FAKETIME_TIMESTAMP_FILE": str(offset),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        },
    )


def _step(offset: Path, value: str) -> None:
    tmp = offset.with_suffix(".tmp")
    tmp.write_text(value + "\n")
    os.replace(tmp, offset)  # the guard never reads half a file


def _state(paths: Paths) -> tuple[int, list[Checkpoint]]:
    with sqlite3.connect(paths.audit_db) as conn:
        size = int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM ledger_events").fetchone()[0])
        cps = [
            Checkpoint.parse(str(n).split("\n\n")[0] + "\n")
            for (n,) in conn.execute("SELECT note FROM ledger_checkpoints ORDER BY size")
        ]
    return size, cps


def _signed(paths: Paths, within: float) -> bool:
    """True once a checkpoint covers every event (polled)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        size, cps = _state(paths)
        if cps and cps[-1].size == size:
            return True
        time.sleep(0.05)
    return False


def _event(g: Guard) -> str:
    status, body = g.call(
        "POST",
        "/v1/sessions",
        {"agent_id": "a", "agent_name": "A", "requested_scopes": {"read": {"tags": ["x"]}}},
        admin=True,
    )
    assert status == 201, body  # session_created: not an urgent action, signed by the timer
    return str(body["session_id"])


def _urgent(g: Guard, sid: str) -> None:
    status, body = g.call("POST", f"/v1/sessions/{sid}/revoke", {}, admin=True)
    assert status == 200, body  # session_revoked: signed in the same write, whatever the timer


def test_checkpoints_keep_coming_after_the_wall_clock_steps_back(
    home: Paths, clock: tuple[Path, dict[str, str]]
) -> None:
    offset, env = clock
    home.config_file.write_text(
        "[guard]\naudit_checkpoint_seconds = 0.3\naudit_checkpoint_events = 1000\naudit_full_verify_at_start = false\n"
    )
    g = Guard(home, env)
    try:
        assert g.health == {"status": "ok"}
        _event(g)
        assert _signed(home, 5)
        before = _state(home)[1][-1]
        _step(offset, "-1h")  # what NTP does after a forward step
        for _ in range(3):
            _event(g)
            assert _signed(home, 5), "no checkpoint after the clock stepped back"
        cps = _state(home)[1]
        stamps = [c.timestamp for c in cps]
        assert stamps == sorted(stamps)  # never backwards
        assert cps[-1].timestamp == before.timestamp  # clamped to the previous one, not an hour back
    finally:
        g.stop()
    ver = subprocess.run(
        [*UOMP, "--home", str(home.home), "audit", "verify", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ver.returncode == 0, ver.stdout
    assert json.loads(ver.stdout)["warnings"] == []


def test_a_forward_jump_between_an_event_and_its_checkpoint_is_a_verify_warning(
    home: Paths, clock: tuple[Path, dict[str, str]]
) -> None:
    offset, env = clock
    # No timer-signed checkpoint within the test: the checkpoints come from urgent events alone, so
    # which side of the jump each one falls on does not depend on how loaded the machine is.
    home.config_file.write_text(
        "[guard]\naudit_checkpoint_seconds = 600\naudit_checkpoint_events = 1000\naudit_full_verify_at_start = false\n"
    )
    g = Guard(home, env)
    try:
        _urgent(g, _event(g))
        assert _signed(home, 8)  # (the step-back test above is the partner: no jump, no warning)
        _event(g)  # not signed yet: its checkpoint comes after the jump
        assert not _signed(home, 0.5)
        _step(offset, "+2h")
        _urgent(g, _event(g))  # (the pending session expired with the jump: a new one is revoked)
        assert _signed(home, 8)
        cps = _state(home)[1]
        assert cps[-1].timestamp - cps[-2].timestamp > 3600
    finally:
        g.stop()
    ver = subprocess.run(
        [*UOMP, "--home", str(home.home), "audit", "verify", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out = json.loads(ver.stdout)
    assert ver.returncode == 0 and out["ok"] is True  # a clock is not the log's integrity
    assert any("jumped forward" in w for w in out["warnings"]), out
