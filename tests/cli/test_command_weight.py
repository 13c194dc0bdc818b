"""What the commands a person types load, on a real home: ``uomp --help``, ``uomp status`` (appliance
stopped and running) and ``uomp memory show`` none of the server, chain or template libraries;
``uomp gateway start`` has its guard child running before it loads the gateway's own server code
(the two boot side by side), and loads the dashboard (jinja2) only when the dashboard is enabled.
Each of its two processes holds its own code only: the guard child none of the gateway's (nor the
supervisor's), the gateway none of the guard's server, of the commands' or of what a default
config does not use (the uplink's HTTP/2 stack, the chains, memory tracing).

Each command runs in a fresh interpreter whose ``sys.modules`` (and, for the start, from an audit
hook: whether the guard child was running when the gateway's server code was first imported) is
written out at its exit; the guard child's, from a ``sitecustomize`` the test puts on its
``PYTHONPATH``. No timings, no memory figures (benchmarks/bench_idle.py measures those)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
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
    "sqlcipher3",  # a plain home's files are read with the standard library's sqlite3
)
# The audit log's code: a command that only reads memory needs none of it.
AUDIT_LOG = ("gateway.guard.audit", "gateway.ledger")
# Not loaded by a command that runs no event loop: help, a read, status (of a stopped or a running appliance).
NO_LOOP = ("asyncio",)
# Never loaded by the parent of `uomp gateway start` (its own code and the init steps need none).
NOT_IN_START = ("web3", "starknet_py", "gateway.conformance", "gateway.cli.conformance", "gateway.cli.authorize")
# Not loaded by the parent of `uomp gateway start` with a default config (no uplink, no chain, no
# UOMP_TRACEMALLOC): the uplink's HTTP/2 stack, the anchor backends, memory tracing; the guard's
# audit log and Auth Service; the commands whose init steps it runs (gateway/cli/initsteps.py);
# aiohttp (the gateway's listeners and the dashboard are served by gateway/httpd.py).
NOT_IN_IDLE_GATEWAY = (
    "aiohttp",
    "h2",
    "hpack",
    "hyperframe",
    "gateway.uplink",
    "gateway.anchor",
    "gateway.ledger.anchoring",
    "tracemalloc",
    "gateway.guard.audit",
    "gateway.guard.auth",
    "gateway.guard.importer",
    "gateway.guard.exchange",
    "gateway.ledger.verify",
    "gateway.cli.memory",
    "gateway.cli.audit",
    "gateway.cli.payload",
    "gateway.cli.agent",
    "csv",
    "sqlcipher3",
)
# Not loaded by the guard child (default config): the gateway's code and the supervisor (its boot is
# gateway/childboot.py), the CA builder (cryptography.x509: its revocation check reads serials
# only), memory tracing, aiohttp (the guard's HTTP server is gateway/httpd.py).
NOT_IN_GUARD_CHILD = (
    "gateway.remote",
    "gateway.supervisor",
    "cryptography.x509",
    "tracemalloc",
    "sqlcipher3",
    "aiohttp",
    "gateway.openapi",  # loaded at the first GET /v1/openapi.json
)
# ... nor the gateway's other stacks, the commands of the gateway side, the chains or the templates.
NEVER_IN_GUARD_CHILD = (
    "h2",
    "gateway.uplink",
    "gateway.dashboard",
    "jinja2",
    "gateway.registry",
    "gateway.enrollment",
    "gateway.cli.gateway",
    "gateway.anchor",
    "web3",
    "starknet_py",
)

# On the guard child's PYTHONPATH: its modules, written at its exit.
CHILD_PROBE = """
import atexit, json, os, sys

if "guard" in sys.argv and "serve" in sys.argv and os.environ.get("WEIGHT_CHILD_OUT"):
    def _write():
        with open(os.path.join(os.environ["WEIGHT_CHILD_OUT"], f"guard-{os.getpid()}.json"), "w") as f:
            json.dump(sorted(sys.modules), f)
    atexit.register(_write)
"""

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
    return {k: v for k, v in os.environ.items() if k not in ("UOMP_HOME", "UOMP_TRACEMALLOC")}


def loaded(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(m == n or m.startswith(n + ".") for m in modules))


def probe(tmp: Path, argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    out = tmp / f"probe-{time.monotonic_ns()}.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE, json.dumps(argv), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env(), **(extra_env or {})},
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


def make_home(h: Path, *commands: list[str]) -> Path:
    """A home at ``h`` made by the CLI commands given, each in its own process."""
    for argv in commands:
        subprocess.run(
            [sys.executable, "-m", "gateway.cli.main", "--home", str(h), *argv],
            check=True,
            capture_output=True,
            env=env(),
            timeout=120,
        )
    return h


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_home(
        tmp_path_factory.mktemp("weight") / "h",
        ["init"],
        ["memory", "add", "weight.key", "--value", '"light"', "--tag", "t", "--sensitivity", "low"],
    )


def start(
    tmp: Path, home: Path, extra_env: dict[str, str] | None = None, *, until: bytes = b"gateway: https://"
) -> tuple[subprocess.Popen[bytes], str]:
    """``uomp gateway start`` in a probe, until it says ``until`` (that it is ready); (the process, its output)."""
    argv = ["--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"]
    proc = probe(tmp, argv, extra_env)
    assert proc.stdout is not None
    buf = b""
    deadline = time.monotonic() + 60
    while until not in buf and time.monotonic() < deadline:
        r, _w, _x = select.select([proc.stdout], [], [], 1.0)
        if r:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
    if until not in buf:
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

        # the partner: enabled, the dashboard is served, loaded before the gateway binds; its
        # templates (jinja2) only once a page is asked for
        set_dashboard(home, True)
        proc, out = start(tmp_path, home)
        data, rest = stop(proc)
        assert "dashboard: http://127.0.0.1:" in out + rest
        modules = data["modules"]  # type: ignore[assignment]
        assert "gateway.dashboard.server" in modules
        # the templates and the pages' code (tests/e2e/test_dashboard*.py use every page) wait for a request
        pages = ("gateway.dashboard.data", "gateway.dashboard.memory_page", "gateway.dashboard.proposals_page")
        assert loaded(modules, ("jinja2", "gateway.dashboard.charts", *pages)) == []
        assert loaded(modules, NOT_IN_START) == []
        assert loaded(modules, ("aiohttp",)) == []  # the dashboard too serves with gateway/httpd.py
        proc, out = start(tmp_path, home, until=b"dashboard: http")
        try:
            m = re.search(r"dashboard: (http://127\.0\.0\.1:\d+)", out)
            assert m, out
            with pytest.raises(urllib.error.HTTPError) as refused:  # not signed in: a page that says so
                urllib.request.urlopen(m.group(1) + "/", timeout=10)
            assert refused.value.code in (401, 403) and b"<html" in refused.value.read().lower()
        finally:
            data, rest = stop(proc)
        modules = data["modules"]  # type: ignore[assignment]
        assert "jinja2" in modules
        assert data["order"] == [["gateway.remote.server", True], ["jinja2", True]]
    finally:
        (home / "config.toml").unlink(missing_ok=True)


def child_probe(tmp: Path) -> tuple[dict[str, str], Path]:
    """The environment that makes the guard child write its modules at its exit, and where."""
    site, out = tmp / "site", tmp / "child-modules"
    site.mkdir()
    out.mkdir()
    (site / "sitecustomize.py").write_text(CHILD_PROBE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "WEIGHT_CHILD_OUT": str(out)}, out


def guard_child_modules(out: Path) -> list[str]:
    files = list(out.glob("guard-*.json"))
    assert len(files) == 1, files  # one guard child, which ran and stopped cleanly
    modules: list[str] = json.loads(files[0].read_text())
    files[0].unlink()
    return modules


def test_the_guard_child_and_the_gateway_each_hold_only_their_own_code(tmp_path: Path, home: Path) -> None:
    set_dashboard(home, False)
    extra, out = child_probe(tmp_path)
    try:
        proc, _out = start(tmp_path, home, extra)
        data, _rest = stop(proc)
        gateway: list[str] = data["modules"]  # type: ignore[assignment]
        guard = guard_child_modules(out)
        # the probes saw the servers (each process's own code is there) ...
        assert "gateway.remote.server" in gateway and "gateway.guard.server" not in gateway
        assert "gateway.guard.server" in guard and "httptools" in guard
        assert "gateway.httpd" in gateway and "httptools" in gateway  # the gateway serves with gateway.httpd
        # ... and none of the other's, nor what a default config does not use
        assert loaded(gateway, NOT_IN_IDLE_GATEWAY) == []
        assert loaded(guard, NOT_IN_GUARD_CHILD) == []
        assert loaded(guard, NEVER_IN_GUARD_CHILD) == []

        # the partner: UOMP_TRACEMALLOC=1 still traces both processes (snapshots of each in the home)
        proc, _out = start(tmp_path, home, {**extra, "UOMP_TRACEMALLOC": "1"})
        data, _rest = stop(proc)
        assert "tracemalloc" in data["modules"]  # type: ignore[operator]
        assert "tracemalloc" in guard_child_modules(out)
        snaps = {p.name.split("-")[0] for p in (home / "memtrace").glob("*.snap")}
        assert snaps == {"gateway", "guard"}
    finally:
        (home / "config.toml").unlink(missing_ok=True)


def test_a_sealed_homes_guard_child_loads_sqlcipher(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The partner of the plain home's lists above: SQLCipher is there once the files are encrypted."""
    pp = tmp_path / "pp"
    pp.write_text("correct horse battery staple\n")
    pp.chmod(0o600)
    sealed = make_home(
        tmp_path_factory.mktemp("weight-sealed") / "h", ["init"], ["secrets", "seal", "--passphrase-file", str(pp)]
    )
    set_dashboard(sealed, False)
    extra, out = child_probe(tmp_path)
    proc, _out = start(tmp_path, sealed, {**extra, "UOMP_PASSPHRASE_FILE": str(pp)})
    stop(proc)
    assert "sqlcipher3" in guard_child_modules(out)
