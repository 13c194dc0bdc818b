"""``uomp gateway start`` as one supervised process tree, as a user runs it: a subprocess, real
files and sockets, the stand-in cloudflared (tests/fake_cloudflared.py) as the tunnel; and the
failures a newcomer meets (port taken, bad port, unwritable home, second start, closed pipe)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from portkit import own_ports_env
from shortdir import short_dir

from gateway.client import UompClient
from gateway.client.errors import AuthError

UOMP = [sys.executable, "-m", "gateway.cli.main"]
FAKE = str(Path(__file__).parents[1] / "fake_cloudflared.py")

pytestmark = pytest.mark.timeout(120)


def uomp(
    home: Path, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=90, env=env)
    if check and res.returncode != 0:
        raise AssertionError(f"uomp {' '.join(args)} -> {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


def write_config(home: Path, text: str) -> None:
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    (home / "config.toml").write_text(text)


class Running:
    """A ``uomp gateway start`` subprocess whose stdout lines are collected by a thread."""

    def __init__(self, home: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.proc = subprocess.Popen(
            [*UOMP, "--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream: object, into: list[str]) -> None:
        for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
            into.append(line)

    def wait_line(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            for line in list(self.out):
                if m := rx.search(line):
                    return m
            if self.proc.poll() is not None and not any(rx.search(x) for x in self.out):
                time.sleep(0.2)
                raise AssertionError(f"exited {self.proc.returncode}:\n{''.join(self.out)}\n{''.join(self.err)}")
            time.sleep(0.05)
        raise AssertionError(f"no line {pattern!r}:\n{''.join(self.out)}\n{''.join(self.err)}")

    @property
    def port(self) -> int:
        return int(self.wait_line(r"^gateway: https://localhost:(\d+) ").group(1))

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        for t in self._threads:
            t.join(5)
        return rc


@pytest.fixture
def home() -> Iterator[Path]:
    # short path: Unix socket names are limited to ~100 bytes
    d = short_dir("uomp-ap-")
    yield d / "home"


def status(home: Path) -> dict[str, object]:
    res = uomp(home, "status", "--json", check=False)
    assert res.returncode in (0, 1, 3), res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def until(pred, timeout: float = 60.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout} s")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


MANIFEST = {
    "uomp_version": "1.0",
    "agent": {"id": "calendar_agent", "name": "Calendar", "version": "1.0.0"},
    "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
    "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
}


def agent_dir(tmp: Path) -> Path:
    d = tmp / "agent"
    d.mkdir(parents=True, exist_ok=True)
    (d / "uom.json").write_text(json.dumps(MANIFEST))
    return d


# ----------------------------------------------------------------------------- the quick tunnel, end to end


async def test_quick_tunnel_appliance_end_to_end(home: Path, tmp_path: Path) -> None:
    edge_file = tmp_path / "edge"
    env = {**os.environ, "FAKE_CF_EDGE_FILE": str(edge_file)}
    uomp(home, "init")
    uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    app = Running(home, "--tunnel", "quick", "--cloudflared", FAKE, env=env)
    try:
        port = app.port
        url = app.wait_line(r"^public URL: (https://\S+\.trycloudflare\.com) \(quick tunnel").group(1)
        app.wait_line(r"^next, in another terminal:")
        assert any("authorize examples/calendar_agent --remote --gateway-url " + url in x for x in app.out)
        assert any(x.startswith("tunnel origin: http://127.0.0.1:") for x in app.out)
        endpoints = app.wait_line(r"^endpoints \(token audiences accepted\): (.*)$").group(1).split(", ")
        assert url in endpoints and f"https://localhost:{port}" in endpoints
        assert not [e for e in endpoints if e.endswith(":0")]
        # the URL is recorded (one source of truth) and uomp status reports it all
        recorded = json.loads((home / "gateway" / "addresses.json").read_text())
        assert recorded["tunnel"]["url"] == url and recorded["tunnel"]["mode"] == "quick"
        s = status(home)
        assert s["running"] is True and s["healthy"] is True and s["pid"] == app.proc.pid
        assert s["tunnel"]["public_url"] == url and s["tunnel"]["status"] == "running"  # type: ignore[index]
        assert s["guard"]["reachable"] is True  # type: ignore[index]
        cf_pid = s["tunnel"]["pid"]  # type: ignore[index]
        guard_pid = s["guard"]["pid"]  # type: ignore[index]
        assert isinstance(cf_pid, int) and alive(cf_pid) and isinstance(guard_pid, int) and alive(guard_pid)
        # a second start on the same home: refused, naming the first
        second = uomp(home, "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port", check=False)
        assert second.returncode == 1 and "Traceback" not in second.stderr
        assert second.stderr.startswith(
            f"error ALREADY_RUNNING: the appliance is already running on {home} (pid {app.proc.pid}"
        )
        # authorize for the tunnel URL (accepted, not a certificate name: TLS ends at the edge) and read
        # through the stand-in edge with DPoP
        res = uomp(
            home,
            "authorize",
            str(agent_dir(tmp_path)),
            "--remote",
            "--gateway-url",
            url,
            "--out",
            str(tmp_path / "agent-files"),
            "--yes",
        )
        assert "not an endpoint" not in res.stdout and "does not name" not in res.stdout
        bundle = tmp_path / "agent-files" / "bundle.json"  # --out puts the bundle there too
        edge_port = int(edge_file.read_text().split()[0])
        async with UompClient.from_bundle(
            bundle, mode="dpop", base_url=f"http://127.0.0.1:{edge_port}", public_url=url
        ) as c:
            assert (await c.get("preference.theme"))["value"] == "dark"
        # and over mTLS on the local URL with the same bundle's key and certificate
        async with UompClient.from_bundle(bundle, mode="mtls", base_url=f"https://localhost:{port}") as c:
            # the token names the tunnel URL, which the mTLS listener does not serve
            with pytest.raises(AuthError) as refused:
                await c.get("preference.theme")
            assert f"token audience {url!r} is not an endpoint of this listener" in refused.value.message
            assert f"https://localhost:{port}" in refused.value.message
        # a URL the gateway does not accept: refused while it runs, naming what it accepts
        bad = uomp(
            home,
            "authorize",
            str(agent_dir(tmp_path)),
            "--remote",
            "--gateway-url",
            "https://my-box.example:9443",
            "--yes",
            check=False,
        )
        assert bad.returncode == 1 and "is not an endpoint this gateway accepts" in bad.stderr
        assert url in bad.stderr and "uomp init --hostname https://my-box.example:9443" in bad.stderr
    finally:
        rc = app.stop()
    assert rc == 0, "".join(app.err)
    # nothing left behind: no cloudflared, no guard, no socket, no lock
    until(lambda: not alive(cf_pid) and not alive(guard_pid), 20, "children gone")
    assert not (home / "guard.sock").exists()
    s = status(home)
    assert s["running"] is False
    assert uomp(home, "status", check=False).returncode == 3


def test_tunnel_dies_and_its_new_url_is_accepted_at_once(home: Path, tmp_path: Path) -> None:
    write_config(home, "[tunnel]\nbackoff_initial_seconds = 0.2\nbackoff_max_seconds = 0.5\n")
    env = {**os.environ, "FAKE_CF_MODE": "die-after:2"}
    app = Running(home, "--tunnel", "quick", "--cloudflared", FAKE, env=env)
    try:
        first = app.wait_line(r"^public URL: (https://\S+\.trycloudflare\.com)").group(1)
        changed = app.wait_line(r"^tunnel: the public URL changed: (https://\S+\.trycloudflare\.com) \(was (\S+)\)")
        new = changed.group(1)
        assert changed.group(2) == first and new != first
        line = next(x for x in app.out if x.startswith("tunnel: the public URL changed"))
        assert "It is accepted now" in line and f"--gateway-url {new}" in line
        until(
            lambda: json.loads((home / "gateway" / "addresses.json").read_text())["tunnel"]["url"] != first,
            30,
            "new URL recorded",
        )
        s = status(home)
        assert s["tunnel"]["restarts"] >= 1  # type: ignore[index]
        # the new URL is an accepted endpoint: authorize for it is not refused
        cur = json.loads((home / "gateway" / "addresses.json").read_text())["tunnel"]["url"]
        res = uomp(
            home,
            "authorize",
            str(agent_dir(tmp_path)),
            "--remote",
            "--gateway-url",
            cur,
            "--out",
            str(tmp_path / "files"),
            "--yes",
            check=False,
        )
        assert res.returncode == 0, res.stderr
    finally:
        assert app.stop() == 0


@pytest.mark.parametrize(
    ("mode", "config", "expect"),
    [
        (
            "exit",
            "backoff_initial_seconds = 0.2\nbackoff_max_seconds = 0.5\nready_wait_seconds = 2.0\n",
            "exit status 1",
        ),
        (
            "no-url",
            "url_timeout_seconds = 1.0\nbackoff_initial_seconds = 0.2\nready_wait_seconds = 0.5\n",
            "no public URL within",
        ),
    ],
    ids=["cloudflared-exits-at-once", "no-url-before-time-out"],
)
def test_a_failing_tunnel_never_stops_the_gateway(home: Path, mode: str, config: str, expect: str) -> None:
    write_config(home, "[tunnel]\n" + config)
    app = Running(home, "--tunnel", "quick", "--cloudflared", FAKE, env={**os.environ, "FAKE_CF_MODE": mode})
    try:
        app.wait_line(r"^tunnel: quick: \S+, no public URL yet")
        port = app.port

        def retried() -> bool:
            t = status(home)["tunnel"] or {}
            return expect in (t.get("last_error") or "") and t.get("restarts", 0) >= 1  # type: ignore[union-attr]

        until(retried, 60, "tunnel retried")
        s = status(home)
        assert s["running"] is True and s["guard"]["reachable"] is True  # type: ignore[index]
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # the gateway still serves locally
    finally:
        assert app.stop() == 0


def test_missing_cloudflared_is_one_clear_message(home: Path) -> None:
    app = Running(home, "--tunnel", "quick", "--cloudflared", "/nonexistent/cloudflared")
    try:
        line = app.wait_line(r"^tunnel: quick: NOT RUNNING").string
        assert "install cloudflared" in line
        assert app.port
        assert status(home)["tunnel"]["status"] == "missing"  # type: ignore[index]
    finally:
        assert app.stop() == 0
    assert sum("cloudflared not found" in x for x in app.err) == 1


# ----------------------------------------------------------------------------- one source of truth


def test_init_hostname_drives_certificate_endpoints_and_authorize(home: Path, tmp_path: Path) -> None:
    out = uomp(home, "init", "--hostname", "my-box.example").stdout
    assert "public URL recorded: https://my-box.example:9443" in out
    from cryptography import x509

    from gateway.core import ca

    cert = x509.load_pem_x509_certificate((home / "ca" / "gateway.crt").read_bytes())
    assert "my-box.example" in ca.server_cert_names(cert)
    s = status(home)
    assert s["endpoints"][0] == "https://my-box.example:9443"  # type: ignore[index]
    # authorize's default --gateway-url is the recorded address
    uomp(home, "authorize", str(agent_dir(tmp_path)), "--remote", "--out", str(tmp_path / "f"), "--yes")
    b = json.loads((tmp_path / "f" / "bundle.json").read_text())
    assert b["gateway_url"] == "https://my-box.example:9443"
    # a URL neither recorded nor in the certificate: warned about (the appliance is not running)
    res = uomp(
        home,
        "authorize",
        str(agent_dir(tmp_path)),
        "--remote",
        "--gateway-url",
        "https://other.example",
        "--out",
        str(tmp_path / "g"),
        "--yes",
    )
    assert "!! https://other.example is not an endpoint this gateway accepts" in res.stdout
    # doctor: coherent now; an address recorded without re-issuing the certificate is a problem with its fix
    assert uomp(home, "doctor", env=own_ports_env()).returncode == 0
    addr = home / "gateway" / "addresses.json"
    data = json.loads(addr.read_text())
    data["public_urls"].append("https://late.example:9443")
    addr.write_text(json.dumps(data))
    doc = uomp(home, "doctor", check=False, env=own_ports_env())
    assert doc.returncode == 1
    assert "the gateway certificate does not name late.example" in doc.stdout
    assert "fix: run: uomp init --hostname https://late.example:9443" in doc.stdout
    uomp(home, "init", "--hostname", "https://late.example:9443")
    assert uomp(home, "doctor", env=own_ports_env()).returncode == 0


def test_doctor_names_each_problem_with_its_fix(home: Path) -> None:
    uomp(home, "init")
    os.chmod(home / ".secrets" / "ed25519-private.jwk", 0o644)
    (home / "config.toml").write_text("[gateway]\nlisten_prot = 1\n")
    res = uomp(home, "doctor", check=False, env=own_ports_env())
    assert res.returncode == 1
    assert "PROBLEM  signing key" in res.stdout and "fix: chmod 600" in res.stdout
    assert "unknown setting(s) in [gateway]: 'listen_prot' (did you mean 'listen_port'?)" in res.stdout
    assert "2 problem(s) found" in res.stdout
    os.chmod(home / ".secrets" / "ed25519-private.jwk", 0o600)
    (home / "config.toml").write_text("[gatway]\nlisten_port = 1\n")  # a misspelled section: said once
    res = uomp(home, "doctor", check=False, env=own_ports_env())
    assert res.returncode == 1 and "ok config" not in res.stdout
    assert res.stdout.count("unknown section(s) in the config file: 'gatway' (did you mean 'gateway'?)") == 1
    assert "1 problem(s) found" in res.stdout
    start = uomp(home, "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port", check=False)
    assert start.returncode == 1 and start.stderr.startswith("error CONFIG_ERROR: unknown section(s)")


# ----------------------------------------------------------------------------- clear failures


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["gateway", "start", "--listen", "127.0.0.1:99999"], "CONFIG_ERROR", "--listen port 99999 is out of range"),
        (["gateway", "start", "--listen", "nonsense"], "CONFIG_ERROR", "is not HOST:PORT"),
        (["gateway", "start", "--metrics-port", "70000"], "CONFIG_ERROR", "--metrics-port 70000 is out of range"),
        (["gateway", "start", "--tunnel", "named"], "TUNNEL_ERROR", "needs its public host name"),
        (["gateway", "start", "--tunnel", "bogus"], "USAGE", "invalid choice"),
        (["gateway", "start", "--public-url", "http://x.example"], "CONFIG_ERROR", "is not a public gateway URL"),
        (["memory", "show"], "USAGE", "required: KEY"),
    ],
    ids=[
        "port-out-of-range",
        "listen-not-host-port",
        "metrics-port-range",
        "named-without-host",
        "bad-tunnel-mode",
        "public-url-not-https",
        "missing-argument",
    ],
)
def test_bad_arguments_are_one_line(home: Path, args: list[str], code: str, words: str) -> None:
    res = uomp(home, *args, check=False)
    assert res.returncode in (1, 2)
    assert res.stderr.startswith(f"error {code}: "), res.stderr
    assert words in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (home / "gateway" / "appliance.json").exists()


def test_port_already_taken(home: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = uomp(home, "gateway", "start", "--listen", f"127.0.0.1:{port}", "--no-local-port", check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith(
        f"error PORT_IN_USE: the gateway cannot listen on 127.0.0.1:{port}: the port is already in use; "
    )
    assert "--listen HOST:PORT" in res.stderr
    assert not (home / "guard.sock").exists()
    assert status(home)["running"] is False


@pytest.mark.parametrize("command", [["gateway", "start", "--listen", "127.0.0.1:0"], ["init"]], ids=["start", "init"])
def test_unwritable_home(tmp_path: Path, command: list[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = uomp(blocker / "home", *command, check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    # refused by the permission check of every command, or by the writability check of start/init
    assert res.stderr.startswith(("error HOME_UNWRITABLE: ", "error UNSAFE_PERMISSIONS: ")), res.stderr
    assert "--home or UOMP_HOME" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_closed_pipe_is_silent(home: Path) -> None:
    uomp(home, "init")
    big = json.dumps("x" * 60_000)
    for i in range(4):  # more than a pipe buffer: the writer meets the closed pipe
        uomp(home, "memory", "add", f"note.n{i}", "--value", big, "--tag", "note", "--sensitivity", "low")
    cmd = " ".join([*map(str, UOMP), "--home", str(home), "memory", "list", "--json", "|", "head", "-c", "10"])
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert res.stderr == "" and res.returncode == 0 and len(res.stdout) == 10


def test_memory_show_is_get(home: Path) -> None:
    uomp(home, "init")
    uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    assert json.loads(uomp(home, "memory", "show", "preference.theme").stdout)["value"] == "dark"


# ----------------------------------------------------------------------------- SIGTERM under load


async def test_sigterm_under_load_drains_and_loses_no_acknowledged_event(home: Path, tmp_path: Path) -> None:
    import asyncio

    import aiohttp

    from gateway.bundle import load_bundle
    from gateway.client.tls import build_client_context

    uomp(home, "init")
    uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    app = Running(home)
    port = app.port
    files = tmp_path / "files"
    uomp(home, "authorize", str(agent_dir(tmp_path)), "--remote", "--out", str(files), "--yes", "--max-reads", "100000")
    b = load_bundle(files / "bundle.json")
    ctx = build_client_context(files / "ca.crt", files / "agent.crt", files / "agent.key")
    headers = {"Authorization": f"Bearer {b.access_token}", "X-UOMP-Agent-Id": "calendar_agent"}
    statuses: list[int] = []
    errors: list[str] = []
    sent_after_term = asyncio.Event()

    async def worker() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=1)) as s:
            while True:
                try:
                    async with s.get(
                        f"https://localhost:{port}/v1/memory/preference.theme",
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=30),
                    ) as resp:
                        await resp.read()
                        statuses.append(resp.status)
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    errors.append(type(exc).__name__)  # refused or closed by the stopping gateway: never acked
                    if sent_after_term.is_set():
                        return

    workers = [asyncio.create_task(worker()) for _ in range(8)]
    try:
        until_n = time.monotonic() + 60
        while len(statuses) < 200 and time.monotonic() < until_n:
            await asyncio.sleep(0.05)
        assert len(statuses) >= 200, (statuses[-5:], errors[-5:])
        app.proc.send_signal(signal.SIGTERM)
        sent_after_term.set()
        await asyncio.wait_for(asyncio.gather(*workers), 90)
    finally:
        for w in workers:
            w.cancel()
        rc = app.stop()
    assert rc == 0, "".join(app.err)
    assert all(st == 200 for st in statuses), sorted(set(statuses))  # no 5xx, during the drain or before
    # every acknowledged read has its audit event (acknowledged means durable)
    log = json.loads(uomp(home, "audit", "--session", b.session_id, "--json", "--limit", "1000000").stdout)
    rows = log if isinstance(log, list) else log.get("logs", [])
    reads = [
        r for r in rows if r.get("action") in ("read", "read_key", "memory.read") or "preference.theme" in json.dumps(r)
    ]
    assert len(reads) >= len(statuses), (len(reads), len(statuses), rows[:2])
    assert not (home / "guard.sock").exists()


# ----------------------------------------------------------------------------- named tunnels


def test_named_tunnel_token_from_a_private_file_never_on_a_command_line(home: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "tunnel-token"
    token_file.write_text("eyJhIjoiZmFrZS10dW5uZWwtdG9rZW4ifQ\n")
    os.chmod(token_file, 0o600)
    write_config(home, f'[tunnel]\ntoken_file = "{token_file}"\nhostname = "gw.example.test"\n')
    app = Running(
        home, "--tunnel", "named", "--cloudflared", FAKE, env={**os.environ, "FAKE_CF_HOSTNAME": "gw.example.test"}
    )
    try:
        app.wait_line(r"^public URL: https://gw\.example\.test \(named tunnel, DPoP\)")
        s = status(home)
        assert "https://gw.example.test" in s["endpoints"]  # type: ignore[operator]
        cf_pid = s["tunnel"]["pid"]  # type: ignore[index]
        argv = Path(f"/proc/{cf_pid}/cmdline").read_bytes().split(b"\0")
        assert b"run" in argv and not any(b"fake-tunnel-token" in a or b"eyJhIjoi" in a for a in argv)
        assert not any("eyJhIjoi" in x for x in app.out + app.err)
    finally:
        assert app.stop() == 0


@pytest.mark.parametrize(
    ("mode", "content", "words"),
    [
        (0o644, "tok", "is readable by others (mode 644); run chmod 600"),
        (0o600, "", "is empty"),
    ],
    ids=["group-readable", "empty"],
)
def test_named_tunnel_token_file_refused(home: Path, tmp_path: Path, mode: int, content: str, words: str) -> None:
    token_file = tmp_path / "tunnel-token"
    token_file.write_text(content)
    os.chmod(token_file, mode)
    write_config(home, f'[tunnel]\nmode = "named"\ntoken_file = "{token_file}"\nhostname = "gw.example.test"\n')
    res = uomp(home, "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port", check=False)
    assert res.returncode == 1 and res.stderr.startswith("error TUNNEL_ERROR: ") and words in res.stderr
    assert not (home / "gateway" / "appliance.json").exists()


def test_tcp_tunnel_runs_without_an_origin_listener(home: Path) -> None:
    env = {**os.environ, "FAKE_CF_HOSTNAME": "gw.example.test", "UOMP_TUNNEL_TOKEN": "eyJ0Y3AtdG9rZW4ifQ"}
    app = Running(home, "--tunnel", "tcp", "--tunnel-hostname", "gw.example.test", "--cloudflared", FAKE, env=env)
    try:
        app.wait_line(r"^public URL: https://gw\.example\.test \(TCP tunnel, end-to-end mTLS")
        app.wait_line(r"^next, in another terminal:")
        assert not any(x.startswith("tunnel origin:") for x in app.out)  # agents come in on the mTLS port
        s = status(home)
        assert "tunnel_origin" not in s["listeners"] and s["tunnel"]["mode"] == "tcp"  # type: ignore[index,operator]
    finally:
        assert app.stop() == 0
