"""The commands that change what a running appliance holds in memory (the CRL, the signing keys)
tell it, and it reloads at once: the fallback looks at the files are set to 600 s here, so
nothing but the signal can explain a refusal within the short bounded wait.

* ``uomp agent revoke``: the gateway's own 401 (CERT_REQUIRED, reason revoked, not the guard's
  "at home" refusal) for the revoked agent; another agent's requests go on;
* ``uomp keys rotate``: without ``--revoke-old`` the old token still works; with it, the old token
  is refused by the gateway and by the guard asked directly (the gateway's assertion, on guard.sock);
* who is told (gateway/reloads.py): the appliance's own pid, not its guard child; a guard serving
  on its own, found by its socket; nobody when nothing runs.

The appliance (``uomp gateway start``) and the guard (``uomp guard serve``) run as real processes."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from guardkit import call, unix_session
from shortdir import short_dir

from gateway import contract
from gateway.bundle import load_bundle
from gateway.client.tls import build_client_context
from gateway.config import Paths
from gateway.core import ca, jose
from gateway.reloads import notify_running, socket_owner

pytestmark = pytest.mark.timeout(120)

UOMP = [sys.executable, "-m", "gateway.cli.main"]
NO_FALLBACK = 600  # seconds: the fallback looks never run within a test
AT_ONCE_SECONDS = 5.0  # bound on "at once": a signal, a reload in a worker thread (a loaded machine)


def uomp(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=90)
    if res.returncode != 0:
        raise AssertionError(f"uomp {' '.join(args)} -> {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


class Proc:
    """A uomp subprocess whose output lines are collected by threads."""

    def __init__(self, home: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*UOMP, "--home", str(home), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(s,), daemon=True) for s in (self.proc.stdout, self.proc.stderr)
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream: Any) -> None:
        for line in iter(stream.readline, ""):
            self.lines.append(line)

    def wait_line(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline, rx = time.monotonic() + timeout, re.compile(pattern)
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := rx.search(line):
                    return m
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise AssertionError(f"exited {self.proc.returncode}:\n{''.join(self.lines)}")
            time.sleep(0.05)
        raise AssertionError(f"no line {pattern!r}:\n{''.join(self.lines)}")

    def count(self, pattern: str) -> int:
        rx = re.compile(pattern)
        return sum(1 for line in list(self.lines) if rx.search(line))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for t in self._threads:
            t.join(5)


@pytest.fixture
def home() -> Iterator[Path]:
    top = short_dir("uomp-rl-")  # short: Unix socket names
    yield top / "home"
    shutil.rmtree(top, ignore_errors=True)


def prepare(home: Path, config: str) -> None:
    uomp(home, "init")
    uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    (home / "config.toml").write_text(config)


class Authorized:
    """An agent authorized with `uomp authorize --remote`: its certificate and bundle."""

    def __init__(self, home: Path, tmp: Path, agent_id: str, port: int) -> None:
        d = tmp / agent_id
        d.mkdir()
        (d / "uom.json").write_text(
            json.dumps(
                {
                    "uomp_version": "1.0",
                    "agent": {"id": agent_id, "name": agent_id, "version": "1.0.0"},
                    "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
                    "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
                }
            )
        )
        files, bundle = d / "files", d / "bundle.json"
        uomp(home, "authorize", str(d), "--yes", "--remote", "--gateway-url", f"https://localhost:{port}",
             "--out", str(files), "--bundle", str(bundle))  # fmt: skip
        self.agent_id, self.base = agent_id, f"https://localhost:{port}"
        self.token = load_bundle(bundle).access_token
        self.ctx: ssl.SSLContext = build_client_context(files / "ca.crt", files / "agent.crt", files / "agent.key")
        cert = x509.load_pem_x509_certificate((files / "agent.crt").read_bytes())
        self.serial = ca.serial_hex(cert.serial_number)
        self.x5t = jose.cert_thumbprint(cert.public_bytes(serialization.Encoding.DER))
        self.jkt = jose.key_thumbprint(cert.public_key())  # type: ignore[arg-type]

    async def read(self) -> tuple[int, dict[str, Any]]:
        """GET a key through the gateway (a new connection: the CRL is judged per connection too)."""
        headers = {"Authorization": f"Bearer {self.token}", "X-UOMP-Agent-Id": self.agent_id}
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.ctx)) as s,
            s.get(f"{self.base}/v1/memory/preference.theme", headers=headers) as resp,
        ):
            return resp.status, await resp.json(content_type=None)

    async def read_at_guard(self, paths: Paths) -> tuple[int, dict[str, Any]]:
        """The same read as the gateway forwards it, straight to guard.sock."""
        headers = contract.assertion_headers(
            token=self.token,
            agent_id=self.agent_id,
            listener="mtls",
            via=f"gateway:mtls:{self.serial}",
            serial=self.serial,
            x5t=self.x5t,
            jkt=self.jkt,
        )
        async with unix_session(paths) as s:
            status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", headers=headers)
        return status, body


async def until_status(read: Any, want: int, what: str) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + AT_ONCE_SECONDS
    while True:
        status, body = await read()
        if status == want:
            return status, body
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still {status} {body} {AT_ONCE_SECONDS} s after the command")
        await asyncio.sleep(0.05)


def start_appliance(home: Path) -> tuple[Proc, int]:
    app = Proc(home, "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port")
    port = int(app.wait_line(r"^gateway: https://localhost:(\d+) ").group(1))
    return app, port


async def test_agent_revoke_is_refused_by_the_gateway_itself_at_once(home: Path, tmp_path: Path) -> None:
    prepare(home, f"[gateway]\ntls_watch_interval_seconds = {NO_FALLBACK}\n")
    app, port = start_appliance(home)
    try:
        a, b = Authorized(home, tmp_path, "agent_a", port), Authorized(home, tmp_path, "agent_b", port)
        assert (await a.read())[0] == 200 and (await b.read())[0] == 200
        uomp(home, "agent", "revoke", "agent_a", "--keep-sessions")  # the session kept: only the CRL refuses

        def by_gateway(res: tuple[int, dict[str, Any]]) -> bool:
            err = res[1].get("error") or {}
            return res[0] == 401 and err.get("reason") == "revoked" and "at home" not in err.get("message", "")

        deadline = time.monotonic() + AT_ONCE_SECONDS
        while not by_gateway(res := await a.read()):
            assert res[0] in (200, 401), res  # the guard's own refusal may come first; never anything else
            assert time.monotonic() < deadline, f"no refusal by the gateway itself: {res}"
            await asyncio.sleep(0.05)
        err = res[1]["error"]
        assert err["code"] == "CERT_REQUIRED" and f"serial 0x{a.serial.lower()}" in err["message"].lower()
        assert "dark" not in json.dumps(res[1])
        # the denied partner: B's certificate is not revoked, its requests go on
        assert (await b.read())[0] == 200
        assert app.count(r"TLS certificates, CA and CRL reloaded") >= 1
    finally:
        app.stop()


async def test_keys_rotate_revoke_old_is_refused_by_gateway_and_guard_at_once(home: Path, tmp_path: Path) -> None:
    prepare(
        home,
        f"[gateway]\ntls_watch_interval_seconds = {NO_FALLBACK}\n[guard]\nkey_watch_fallback_seconds = {NO_FALLBACK}\n",
    )
    paths = Paths(home)
    app, port = start_appliance(home)
    try:
        a = Authorized(home, tmp_path, "agent_a", port)
        assert (await a.read())[0] == 200 and (await a.read_at_guard(paths))[0] == 200
        reloads = app.count(r"signing keys reloaded")

        # a plain rotation: told, reloaded, and the old key stays trusted (retired) for live tokens
        uomp(home, "keys", "rotate")
        deadline = time.monotonic() + AT_ONCE_SECONDS
        while app.count(r"signing keys reloaded") <= reloads:
            assert time.monotonic() < deadline, "the guard was not told of the rotation"
            await asyncio.sleep(0.05)
        assert (await a.read())[0] == 200 and (await a.read_at_guard(paths))[0] == 200

        # --revoke-old: refused at once, by the gateway and by the guard on its own
        uomp(home, "keys", "rotate", "--revoke-old", "--keep-sessions")
        _, body = await until_status(a.read, 401, "through the gateway")
        assert body["error"]["code"] in ("INVALID_TOKEN", "TOKEN_REVOKED"), body
        _, body = await until_status(lambda: a.read_at_guard(paths), 401, "at the guard")
        assert body["error"]["code"] in ("INVALID_TOKEN", "TOKEN_REVOKED"), body
        assert "dark" not in json.dumps(body)
    finally:
        app.stop()


async def test_who_is_told(home: Path) -> None:
    prepare(home, "")
    paths = Paths(home)
    assert notify_running(paths) == []  # nothing runs: nobody told, no error

    guard = Proc(home, "guard", "serve", "--no-tcp")
    try:
        guard.wait_line(r"guard listening on unix:")
        assert socket_owner(paths.guard_sock) == guard.proc.pid
        assert notify_running(paths) == [guard.proc.pid]  # a guard serving on its own, by its socket
        guard.wait_line(r"signing keys reloaded", timeout=AT_ONCE_SECONDS)
        assert guard.proc.poll() is None  # a reload, not the default action of SIGHUP
    finally:
        guard.stop()

    app, _port = start_appliance(home)
    try:
        child = int(app.wait_line(r"^guard: .*\(process (\d+)").group(1))
        assert socket_owner(paths.guard_sock) == child
        assert notify_running(paths) == [app.proc.pid]  # the appliance, which forwards to its child
        app.wait_line(r"signing keys reloaded", timeout=AT_ONCE_SECONDS)  # the child's log, relayed
        assert app.proc.poll() is None
    finally:
        app.stop()


def test_a_process_that_does_not_catch_sighup_is_never_signalled(home: Path) -> None:
    """A guard embedded in a process without a SIGHUP handler (a test's, a program's): left alone,
    where the signal's default action would end it."""
    prepare(home, "")
    paths = Paths(home)
    code = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from gateway.config import GuardConfig, Paths\n"
        "from gateway.guard.server import GuardRunner\n"
        "async def main():\n"
        "    r = GuardRunner(Paths(Path(sys.argv[1])), GuardConfig(), serve_tcp=False)\n"
        "    await r.start()\n"
        "    print('serving', flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(home)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "serving"
        assert socket_owner(paths.guard_sock) == proc.pid
        assert notify_running(paths) == []
        time.sleep(0.3)
        assert proc.poll() is None  # still serving
    finally:
        proc.kill()
        proc.wait()
