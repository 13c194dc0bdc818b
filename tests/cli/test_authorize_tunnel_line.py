"""`uomp authorize --remote` prints a first read the agent can run as printed: an mTLS curl line for
the gateway's own address, and for a quick/named tunnel's URL (TLS ends at Cloudflare, agents use
DPoP) the SDK's DPoP call instead of a curl line that would only be refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway import appliance, ca_store
from gateway.config import Paths

UOMP = [sys.executable, "-m", "gateway.cli.main"]
AGENT = str(Path(__file__).parents[2] / "examples" / "calendar_agent")
TUNNEL = "https://brook-cedar-amber-17a5.trycloudflare.com"
pytestmark = pytest.mark.timeout(120)


def authorize(home: Path, out: Path, url: str) -> str:
    res = subprocess.run(
        [*UOMP, "--home", str(home), "authorize", AGENT, "--remote", "--yes", "--out", str(out), "--gateway-url", url],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize(
    ("mode", "url", "dpop"),
    [
        pytest.param("quick", TUNNEL, True, id="quick-tunnel-url"),
        pytest.param("named", TUNNEL, True, id="named-tunnel-url"),
        pytest.param("quick", "https://localhost:9443", False, id="local-url-beside-a-tunnel"),
        pytest.param("tcp", TUNNEL, False, id="tcp-tunnel-is-mtls"),
    ],
)
def test_the_first_read_line_fits_the_url(home: Paths, tmp_path: Path, mode: str, url: str, dpop: bool) -> None:
    ca_store.init_all(home)
    appliance.set_tunnel(home, mode, TUNNEL)
    text = authorize(home.home, tmp_path / "files", url)
    curl = [x for x in text.splitlines() if x.strip().startswith("curl ")]
    if dpop:
        assert curl == [], text
        assert "--dpop" in text and 'mode="dpop"' in text and str(tmp_path / "files" / "bundle.json") in text
    else:
        assert len(curl) == 1 and "--cert" in curl[0] and curl[0].endswith(f"{url}/v1/memory/KEY"), text
        assert "--dpop" not in text
