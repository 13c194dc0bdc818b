"""The agent SDK installs without the server: importing ``gateway.client`` (every module of it) loads
neither ``gateway.remote`` nor ``gateway.guard``."""

from __future__ import annotations

import json
import subprocess
import sys

CODE = """
import json, pkgutil, sys, importlib
import gateway.client
for m in pkgutil.iter_modules(gateway.client.__path__):
    importlib.import_module("gateway.client." + m.name)
print(json.dumps(sorted(n for n in sys.modules if n.startswith("gateway."))))
"""


def test_the_sdk_loads_no_server_package() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], check=True, capture_output=True, text=True).stdout
    loaded = json.loads(out)
    assert "gateway.client.sdk" in loaded and "gateway.client.transport" in loaded
    server = [m for m in loaded if m.split(".")[1] in ("remote", "guard", "cli", "supervisor")]
    assert server == []


def test_the_mcp_server_loads_no_server_package() -> None:
    """``uomp mcp serve`` runs on the agent's machine: the SDK under it, no guard and no gateway."""
    code = CODE.replace("gateway.client", "gateway.mcp")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded = json.loads(out)
    assert "gateway.mcp.server" in loaded and "gateway.client.sdk" in loaded
    assert [m for m in loaded if m.split(".")[1] in ("remote", "guard", "cli", "supervisor")] == []
