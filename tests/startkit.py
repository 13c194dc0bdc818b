"""``uomp gateway start`` as a user runs it, driven from a test: the lines of its banner, and a
remote agent (the calendar manifest, read access to ``preference``) authorized on it with the real
``uomp authorize --remote``, as its own mTLS context and headers."""

from __future__ import annotations

import json
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.bundle import load_bundle
from gateway.client.tls import build_client_context

CALENDAR = {
    "uomp_version": "1.0",
    "agent": {"id": "calendar_agent", "name": "Calendar", "version": "1.0.0"},
    "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
    "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
}


def read_until(proc: subprocess.Popen[str], prefix: str, timeout: float = 60) -> str:
    """The first line of ``proc``'s output that starts with ``prefix`` (AssertionError if none in time)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {prefix!r} line")


def remote_calendar(
    uomp: Callable[..., Any], home: Path, work: Path, port: int
) -> tuple[ssl.SSLContext, dict[str, str]]:
    """Authorize the calendar agent for the mTLS gateway on ``port`` (files under ``work``); its
    client TLS context and the headers of its reads."""
    agent_dir = work / "agent"
    agent_dir.mkdir()
    (agent_dir / "uom.json").write_text(json.dumps(CALENDAR))
    files, bundle = work / "agentfiles", work / "bundle.json"
    uomp(home, "authorize", str(agent_dir), "--yes", "--remote", "--gateway-url", f"https://localhost:{port}",
         "--out", str(files), "--bundle", str(bundle))  # fmt: skip
    b = load_bundle(bundle)
    ctx = build_client_context(files / "ca.crt", files / "agent.crt", files / "agent.key")
    return ctx, {"Authorization": f"Bearer {b.access_token}", "X-UOMP-Agent-Id": "calendar_agent"}
