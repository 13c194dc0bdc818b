"""What the commands a person types load, on a real home: ``uomp --help``, ``uomp status`` (appliance
stopped and running) and ``uomp memory show`` none of the server, chain or template libraries;
``uomp gateway start`` has its guard child running before it loads the gateway's own server code
(the two boot side by side), and loads the dashboard (jinja2) only when the dashboard is enabled.

Each command runs in a fresh interpreter whose ``sys.modules`` (and, for the start, from an audit
hook: whether the guard child was running when the gateway's server code was first imported) is
written out at its exit. No timings."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Loaded by none of the quick commands: the HTTP server/client stack, the chains, the templates,
# the gateway's and the guard's server code, the conformance suite.
HEAVY = (
    "aiohttp",
    "web3",
    "starknet_py",
    "jinja2",
    "uvloop",
    "gateway.remote",
    "gateway.dashboard",
    "gateway.conformance",
    "gateway.guard.app",
    "gateway.guard.server",
    "gateway.cli.conformance",
    "gateway.cli.authorize",
)
# The audit log's code: a command that only reads memory needs none of it.
AUDIT_LOG = ("gateway.guard.audit", "gateway.ledger")
# Not loaded by a command that runs no event loop: help, a read, status (of a stopped or a running appliance).
NO_LOOP = ("asyncio",)
# Never loaded by the parent of `uomp gateway start` (its own code and the init steps need none).
NOT_IN_START = ("web3", "starknet_py", "gateway.conformance", "gateway.cli.conformance", "gateway.cli.authorize")

PROBE = """
import json, os, sys
argv, out = json.loads(sys.argv[1]), sys.argv[2]
order = []  # [module, is the guard child running when it is first imported]

def guard_child_running():
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] != me:
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"guard_child_main" in f.read():
                    return True
        except (OSError, IndexError):
            pass
    return False

def hook(event, args):
    if event == "import" and args[0] in ("gateway.remote.server", "jinja2"):
        order.append([args[0], guard_child_running()])
sys.addaudithook(hook)
from gateway.cli.main import main
try:
    rc = main(argv)
except SystemExit as exc:
    rc = exc.code
sys.stdout.flush()
with open(out, "w") as f:
    json.dump({"rc": rc, "modules": sorted(sys.modules), "order": order}, f)
"""


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "UOMP_HOME"}


def loaded(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(m == n or m.startswith(n + ".") for m in modules))


def probe(tmp: Path, argv: list[str]) -> subprocess.Popen[bytes]:
    out = tmp / f"probe-{time.monotonic_ns()}.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE, json.dumps(argv), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
        cwd=tmp,
    )
    proc.out_file = out  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen[bytes], timeout: float = 60) -> tuple[dict[str, object], str]:
    stdout, stderr = proc.communicate(timeout=timeout)
    out: Path = proc.out_file  # type: ignore[attr-defined]
    assert out.exists(), stderr.decode(errors="replace")[-2000:]
    return json.loads(out.read_text()), stdout.decode(errors="replace")


def run(tmp: Path, argv: list[str]) -> tuple[dict[str, object], str]:
    return finish(probe(tmp, argv))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    h = tmp_path_factory.mktemp("weight") / "h"
    for argv in (
        ["init"],
        ["memory", "add", "weight.key", "--value", '"light"', "--tag", "t", "--sensitivity", "low"],
    ):
        subprocess.run(
            [sys.executable, "-m", "gateway.cli.main", "--home", str(h), *argv],
            check=True,
            capture_output=True,
            env=env(),
            timeout=60,
        )
    return h


def start(tmp: Path, home: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``uomp gateway start`` in a probe, until it says it is ready; (the process, its output)."""
    proc = probe(tmp, ["--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"])
    assert proc.stdout is not None
    buf = b""
    deadline = time.monotonic() + 60
    while b"gateway: https://" not in buf and time.monotonic() < deadline:
        r, _w, _x = select.select([proc.stdout], [], [], 1.0)
        if r:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
    if b"gateway: https://" not in buf:
        proc.kill()
        _out, err = proc.communicate()
        pytest.fail(f"gateway start did not get ready: {buf[-500:]!r} {err[-1500:]!r}")
    return proc, buf.decode(errors="replace")


def stop(proc: subprocess.Popen[bytes]) -> tuple[dict[str, object], str]:
    """SIGTERM; what the probe wrote at exit, and the output after the ready line."""
    proc.send_signal(signal.SIGTERM)
    data, rest = finish(proc)
    assert data["rc"] == 0
    return data, rest


def set_dashboard(home: Path, enabled: bool) -> None:
    (home / "config.toml").write_text(f"[dashboard]\nenabled = {'true' if enabled else 'false'}\nport = 0\n")


def test_help_status_and_memory_show_load_no_heavy_module(tmp_path: Path, home: Path) -> None:
    data, out = run(tmp_path, ["--home", str(home), "--help"])
    assert data["rc"] == 0 and "COMMAND" in out
    assert loaded(data["modules"], (*HEAVY, *NO_LOOP, "cryptography", "sqlite3")) == []  # type: ignore[arg-type]

    # a read: none of them, nor the audit log's code (only a change records a user event)
    data, out = run(tmp_path, ["--home", str(home), "memory", "show", "weight.key"])
    assert data["rc"] == 0 and "light" in out  # the command did its work ...
    assert loaded(data["modules"], (*HEAVY, *AUDIT_LOG, *NO_LOOP)) == []  # type: ignore[arg-type]  # ... none of them
    data, _out = run(tmp_path, ["--home", str(home), "memory", "show", "no.such.key"])
    assert data["rc"] == 1 and loaded(data["modules"], (*HEAVY, *AUDIT_LOG)) == []  # type: ignore[arg-type]
    # the partner: a change writes its event, so it loads the audit log's code (and still no server stack)
    data, _out = run(
        tmp_path,
        ["--home", str(home), "memory", "add", "weight.other", "--value", "1", "--tag", "t", "--sensitivity", "low"],
    )
    assert data["rc"] == 0
    assert loaded(data["modules"], AUDIT_LOG) == list(AUDIT_LOG)  # type: ignore[arg-type]
    assert loaded(data["modules"], HEAVY) == []  # type: ignore[arg-type]

    data, out = run(tmp_path, ["--home", str(home), "status"])
    assert data["rc"] == 3 and "not running" in out  # exit 3: no appliance on this home
    assert loaded(data["modules"], (*HEAVY, *NO_LOOP)) == []  # type: ignore[arg-type]


def test_gateway_start_spawns_the_guard_first_and_loads_the_dashboard_only_when_enabled(
    tmp_path: Path, home: Path
) -> None:
    set_dashboard(home, False)
    try:
        proc, out = start(tmp_path, home)
        try:
            assert "dashboard:" not in out
            # while it runs, `uomp status` asks it over its sockets, still without the server stack
            data, status_out = run(tmp_path, ["--home", str(home), "status"])
            assert data["rc"] == 0, status_out
            assert loaded(data["modules"], (*HEAVY, *NO_LOOP)) == []  # type: ignore[arg-type]
        finally:
            data, rest = stop(proc)
        assert "dashboard:" not in rest
        modules: list[str] = data["modules"]  # type: ignore[assignment]
        # the gateway's server code was loaded while the guard child was already running
        assert data["order"] == [["gateway.remote.server", True]]
        assert loaded(modules, ("jinja2", "gateway.dashboard")) == []
        assert loaded(modules, NOT_IN_START) == []

        # the partner: enabled, the dashboard is served, and loaded before the gateway binds
        set_dashboard(home, True)
        proc, out = start(tmp_path, home)
        data, rest = stop(proc)
        assert "dashboard: http://127.0.0.1:" in out + rest
        modules = data["modules"]  # type: ignore[assignment]
        assert "jinja2" in modules and "gateway.dashboard.server" in modules
        assert data["order"] == [["gateway.remote.server", True], ["jinja2", True]]
        assert loaded(modules, NOT_IN_START) == []
    finally:
        (home / "config.toml").unlink(missing_ok=True)
