"""One address everywhere: the start banner, `uomp status`, `authorize`'s output and the token's audience name
the same URL; the curl line authorize prints works as printed; loopback names are one endpoint; a token sent to
another of the gateway's endpoints is refused with the URL it is for."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.client.tokens import token_claims

UOMP = [sys.executable, "-m", "gateway.cli.main"]
AGENT = str(Path(__file__).parents[2] / "examples" / "calendar_agent")
pytestmark = pytest.mark.timeout(120)


def uomp(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr
    return res


def curl(line: str) -> tuple[int, dict[str, object]]:
    res = subprocess.run(["bash", "-c", line + " -sS -w '\\n%{http_code}'"], capture_output=True, text=True, timeout=30)
    body, _, code = res.stdout.rpartition("\n")
    return int(code), json.loads(body)


@contextmanager
def appliance(home: Path, listen: str) -> Iterator[list[str]]:
    """`uomp gateway start` until its banner's endpoints line; yields the banner's lines."""
    proc = subprocess.Popen(
        [*UOMP, "--home", str(home), "gateway", "start", "--listen", listen, "--no-local-port"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "UOMP_DASHBOARD_ENABLED": "0"},
    )
    lines: list[str] = []
    assert proc.stdout is not None
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + 60
        while not any(x.startswith("endpoints ") for x in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            time.sleep(0.1)
        yield lines
    finally:
        proc.terminate()
        proc.wait(30)


def banner(lines: list[str]) -> tuple[str, list[str]]:
    gw = next(x for x in lines if x.startswith("gateway: "))
    m = re.match(r"gateway: (https://\S+) \(", gw)
    assert m, gw
    endpoints = next(x for x in lines if x.startswith("endpoints ")).split(": ", 1)[1].strip().split(", ")
    return m.group(1), endpoints


def authorize(home: Path, out: Path, *extra: str) -> tuple[str, str, dict[str, object]]:
    text = uomp(home, "authorize", AGENT, "--remote", "--yes", "--out", str(out), *extra).stdout
    m = re.search(r"^The agent's gateway URL \(its tokens are for this address\): (\S+)$", text, re.M)
    assert m, text
    line = next(x for x in text.splitlines() if x.strip().startswith("curl "))
    return m.group(1), line, json.loads((out / "bundle.json").read_text())


def new_home(tmp_path: Path, *init: str) -> Path:
    home = tmp_path / "home"
    uomp(home, "init", *init)
    uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    return home


def test_the_url_a_user_copies_is_the_one_tokens_are_for(tmp_path: Path) -> None:
    home = new_home(tmp_path)
    with appliance(home, "127.0.0.1:0") as lines:
        url, endpoints = banner(lines)
        port = url.rsplit(":", 1)[1]
        assert url == f"https://localhost:{port}" and endpoints[0] == url
        assert f"https://127.0.0.1:{port}" in endpoints
        said, line, bundle = authorize(home, tmp_path / "af")
        assert said == url == bundle["gateway_url"] == token_claims(str(bundle["access_token"]))["audience"]
        code, body = curl(line.replace("/v1/memory/KEY", "/v1/memory/preference.theme"))
        assert code == 200 and body["value"] == "dark"
        # the same token at the loopback address the listener is bound to: one endpoint
        code, body = curl(line.replace(f"{url}/v1/memory/KEY", f"https://127.0.0.1:{port}/v1/memory/preference.theme"))
        assert code == 200 and body["value"] == "dark"


def test_a_public_url_comes_first_and_a_token_for_another_endpoint_names_its_own(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    public = f"https://gw.example:{port}"
    home = new_home(tmp_path, "--hostname", public)
    with appliance(home, f"127.0.0.1:{port}") as lines:
        _, endpoints = banner(lines)
        assert endpoints[0] == public
        said, line, bundle = authorize(home, tmp_path / "pub")
        assert said == public == bundle["gateway_url"]
        resolve = f"curl --resolve gw.example:{port}:127.0.0.1 "
        code, body = curl(line.replace("curl ", resolve, 1).replace("/v1/memory/KEY", "/v1/memory/preference.theme"))
        assert code == 200 and body["value"] == "dark"
        # authorized for the local address, sent to the public one: refused, with the way out
        local = f"https://localhost:{port}"
        said, line, _ = authorize(home, tmp_path / "loc", "--gateway-url", local)
        assert said == local
        code, body = curl(
            line.replace("curl ", resolve, 1).replace(f"{local}/v1/memory/KEY", f"{public}/v1/memory/preference.theme")
        )
        assert code == 403, body
        err = body["error"]
        assert isinstance(err, dict) and err["code"] == "ACCESS_DENIED"
        assert f"send it to {local} (the URL it was authorized for)" in err["message"]
