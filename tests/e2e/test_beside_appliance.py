"""The suite passes beside an appliance the user runs on the default ports (9443, 9374, 9380): the tests
that check ports (`uomp doctor`) run with an appliance holding them, in a pytest of their own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UOMP = [sys.executable, "-m", "gateway.cli.main"]
DEFAULT_PORTS = (9443, 9374, 9380)
PORT_SENSITIVE = [
    "tests/e2e/test_appliance.py::test_doctor_names_each_problem_with_its_fix",
    "tests/e2e/test_appliance.py::test_init_hostname_drives_certificate_endpoints_and_authorize",
    "tests/cli/test_home_files.py",
]

pytestmark = pytest.mark.timeout(300)


def held(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_port_sensitive_tests_pass_while_an_appliance_holds_the_default_ports(tmp_path: Path) -> None:
    proc = None
    if not all(held(p) for p in DEFAULT_PORTS):
        if any(held(p) for p in DEFAULT_PORTS):
            pytest.skip("some default ports are taken by something else: cannot lay out the case")
        home = Path(os.environ.get("TMPDIR", "/tmp")) / f"uomp-beside-{os.getpid()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("UOMP_")}
        proc = subprocess.Popen(
            [*UOMP, "--home", str(home), "gateway", "start"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + 60
        while not all(held(p) for p in DEFAULT_PORTS):
            assert proc.poll() is None and time.monotonic() < deadline, "the appliance did not come up"
            time.sleep(0.2)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PORT_SENSITIVE],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=280,
        )
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
        assert all(held(p) for p in DEFAULT_PORTS)  # it ran beside them the whole time
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
            subprocess.run(["rm", "-rf", str(home)], check=False)
