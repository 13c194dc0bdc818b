"""The container and systemd pieces, as far as they can be checked without a container engine:
the Dockerfile's promises (pinned base, non-root, volume, HEALTHCHECK through `uomp status`), the
entry point run for real (UOMP_HOSTNAME, an unwritable volume), and the systemd unit's install
substitution. The image itself was not built here (no engine, no registry)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shortdir import short_dir

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "config" / "docker-entrypoint.sh"

pytestmark = pytest.mark.timeout(120)


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UOMP_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["UOMP_HOME"] = str(home)
    env.update(extra)
    return env


def test_dockerfile_promises() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:[\w.-]+slim[\w.-]*@sha256:[0-9a-f]{64}$", text, re.M)
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}$", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r'^VOLUME \["/data"\]$', text, re.M) and "ENV PYTHONDONTWRITEBYTECODE" in text
    assert re.search(r'^HEALTHCHECK .* CMD \["uomp", "status"\]$', text, re.M)
    assert "NOT BUILT HERE" in text
    ignore = (ROOT / ".dockerignore").read_text()
    assert ignore.splitlines()[1] == "*" and "!gateway/" in ignore


def test_entrypoint_names_the_host_and_the_healthcheck_follows_the_guard() -> None:
    home = short_dir("uomp-ct-") / "data"
    env = env_for(
        home, UOMP_HOSTNAME="my-box.example, backup.example", UOMP_GATEWAY_GUARD_HEALTH_FAILURES="1000"
    )  # the supervisor leaves a stopped guard alone
    proc = subprocess.Popen(
        ["sh", str(ENTRY), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    status = [sys.executable, "-m", "gateway.cli.main", "status"]  # the HEALTHCHECK command
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(status, env=env, capture_output=True).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
        from cryptography import x509

        from gateway.core import ca

        names = ca.server_cert_names(x509.load_pem_x509_certificate((home / "ca" / "gateway.crt").read_bytes()))
        assert {"my-box.example", "backup.example"} <= names
        out = subprocess.run(status, env=env, capture_output=True, text=True).stdout
        assert "public URL: https://my-box.example:9443 (mTLS)" in out
        # the guard stops answering: the health check fails; it answers again: healthy again
        import json

        guard_pid = json.loads((home / "gateway" / "status.json").read_text())["guard"]["pid"]
        os.kill(guard_pid, 19)  # SIGSTOP
        try:
            deadline = time.monotonic() + 60
            while (res := subprocess.run(status, env=env, capture_output=True, text=True)).returncode == 0:
                assert time.monotonic() < deadline, "uomp status still healthy with a stopped guard"
                time.sleep(0.2)
            assert res.returncode == 1 and "guard: NOT REACHABLE" in res.stdout
        finally:
            os.kill(guard_pid, 18)  # SIGCONT
        deadline = time.monotonic() + 60
        while subprocess.run(status, env=env, capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, "not healthy again"
            time.sleep(0.2)
    finally:
        subprocess.run(
            [sys.executable, "-m", "gateway.cli.main", "gateway", "stop"], env=env, capture_output=True, timeout=60
        )
        proc.wait(30)
    assert proc.returncode == 0


def test_entrypoint_unwritable_volume_is_one_clear_line(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    res = subprocess.run(
        ["sh", str(ENTRY), "gateway", "start"],
        env=env_for(blocker / "data"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert res.stderr.startswith(("error HOME_UNWRITABLE: ", "error UNSAFE_PERMISSIONS: ")), res.stderr
    assert "--home or UOMP_HOME" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_systemd_unit_installs_as_documented() -> None:
    unit = (ROOT / "config" / "uomp.service").read_text()
    installed = unit.replace("@UOMP@", "/home/me/uomp/.venv/bin/uomp")  # the documented sed
    assert "ExecStart=/home/me/uomp/.venv/bin/uomp gateway start" in installed and "@UOMP@" not in installed
    for line in ("KillMode=mixed", "Restart=on-failure", "WantedBy=default.target", "Environment=UOMP_HOME=%h/.uomp"):
        assert line in unit
    assert 'sed "s#@UOMP@#$PWD/.venv/bin/uomp#" config/uomp.service' in unit
    assert "systemctl --user enable --now uomp" in (ROOT / "README.md").read_text()
