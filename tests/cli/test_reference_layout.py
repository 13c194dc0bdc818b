"""``uomp authorize --remote --layout uomp-core --out DIR`` writes the files where the reference
TypeScript SDK (``@uomp/sdk`` of github.com/0xaicrypto/uomp-core) looks, and the env file it reads.

:func:`reference_sdk_load` does in Python what that SDK does when an agent starts (its facts,
not its code): ``UompClient`` takes ``UOM_TOKEN``, ``UOMP_BASE_URL`` (default
``http://127.0.0.1:9374``) and ``UOMP_SESSION_ID`` from the environment and the agent id from the
token's ``agent_id`` claim (base64url JSON payload of a three-part JWT); its transport, for an
``https://`` base URL, uses mTLS only when ``$HOME/.uomp/.gateway-certs/client.crt`` and
``client.key`` both exist (``ca.crt`` beside them optional), read as PEM into Node's TLS (OpenSSL:
a ``CERTIFICATE`` block, a ``PRIVATE KEY`` / ``EC PRIVATE KEY`` block). Then each call is
``Authorization: Bearer <token>`` and ``X-UOMP-Agent-Id: <agent id>`` to ``/v1/memory/{key}`` or
``/v1/memory?tag=``. The files are run through exactly that, then through a real gateway."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import ssl
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from gatewaykit import appliance

from gateway.cli.main import main
from gateway.config import Paths

CALENDAR = Path(__file__).parents[2] / "examples" / "calendar_agent"
KEY_BLOCKS = (b"-----BEGIN PRIVATE KEY-----", b"-----BEGIN EC PRIVATE KEY-----")


class NoMtls(AssertionError):
    """The reference SDK would fall back to plain fetch without a client certificate."""


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            name, _, value = line.partition("=")
            out[name] = value
    return out


def reference_sdk_load(home: Path, env: dict[str, str]) -> dict[str, Any]:
    """What the reference SDK's UompClient + Transport take from ``env`` and ``$HOME``."""
    token = env.get("UOM_TOKEN", "")
    base_url = (env.get("UOMP_BASE_URL") or "http://127.0.0.1:9374").rstrip("/")
    parts = token.split(".")
    assert len(parts) == 3, "the SDK decodes the token as a three-part JWT"
    payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    agent_id = payload.get("agent_id") or "uomp-agent"
    session_id = env.get("UOMP_SESSION_ID") or payload.get("session_id", "")
    loaded: dict[str, Any] = {
        "token": token,
        "base_url": base_url,
        "agent_id": agent_id,
        "session_id": session_id,
        "payload": payload,
    }
    if not base_url.startswith("https://"):
        return loaded
    cert_dir = home / ".uomp" / ".gateway-certs"
    cert, key, ca = cert_dir / "client.crt", cert_dir / "client.key", cert_dir / "ca.crt"
    if not cert.exists() or not key.exists():
        raise NoMtls(f"no {cert} / {key}: the reference SDK would send no client certificate")
    cert_pem, key_pem = cert.read_bytes(), key.read_bytes()
    assert cert_pem.lstrip().startswith(b"-----BEGIN CERTIFICATE-----"), "client.crt must be PEM"
    assert key_pem.lstrip().startswith(KEY_BLOCKS), "client.key must be a PEM private key"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # what Node's https.Agent({cert, key, ca}) loads
    ctx.load_cert_chain(cert, key)  # OpenSSL refuses a key that does not match the certificate
    if ca.exists():
        ctx.load_verify_locations(cafile=str(ca))
    loaded["ssl"] = ctx
    loaded["cert"] = x509.load_pem_x509_certificate(cert_pem)
    return loaded


async def reference_read(loaded: dict[str, Any], path: str) -> tuple[int, Any]:
    headers = {
        "Authorization": f"Bearer {loaded['token']}",
        "Accept": "application/json",
        "X-UOMP-Agent-Id": loaded["agent_id"],
    }
    conn = aiohttp.TCPConnector(ssl=loaded.get("ssl", False))
    async with aiohttp.ClientSession(connector=conn) as s, s.get(loaded["base_url"] + path, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def uomp(home: Paths, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--home", str(home.home), *args])
    return rc, out.getvalue(), err.getvalue()


async def test_reference_layout_passes_the_reference_sdk_checks(home: Paths, tmp_path: Path) -> None:
    agent_home = tmp_path / "agent-home"
    dot_uomp = agent_home / ".uomp"
    async with appliance(home) as app:
        rc, out, err = uomp(
            home, "authorize", str(CALENDAR), "--remote", "--layout", "uomp-core", "--out", str(dot_uomp),
            "--yes", "--gateway-url", app.base, "--any-gateway-url",
        )  # fmt: skip
        assert rc == 0, out + err
        assert "UOM_TOKEN, UOMP_BASE_URL" in out
        certs = dot_uomp / ".gateway-certs"
        assert sorted(p.name for p in certs.iterdir()) == ["ca.crt", "client.crt", "client.key"]
        assert stat.S_IMODE((certs / "client.key").stat().st_mode) == 0o600
        assert stat.S_IMODE((dot_uomp / "uomp.env").stat().st_mode) == 0o600
        env = _env_file(dot_uomp / "uomp.env")
        assert set(env) == {"UOM_TOKEN", "UOMP_BASE_URL", "UOMP_SESSION_ID"}
        loaded = reference_sdk_load(agent_home, env)
        assert loaded["base_url"] == app.base and loaded["agent_id"] == "calendar_agent"
        assert loaded["session_id"] == loaded["payload"]["session_id"]
        # the certificate is the one the token is bound to, from the CA in ca.crt
        ca_cert = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
        loaded["cert"].verify_directly_issued_by(ca_cert)
        # and the reference's calls go through the real gateway with them
        status, body = await reference_read(loaded, "/v1/memory/preference.theme")
        assert (status, body.get("value")) == (200, "dark"), body
        status, body = await reference_read(loaded, "/v1/memory?tag=preference")
        assert status == 200 and {i["key"] for i in body["items"]} >= {"preference.theme", "preference.lang"}
        # denied partner: the same token without the client certificate (what the SDK sends when the
        # files are missing) is refused by the gateway
        status, body = await reference_read({**loaded, "ssl": _server_only(certs / "ca.crt")}, "/v1/memory/x")
        assert status == 401 and body["error"]["code"] == "CERT_REQUIRED"


def _server_only(ca: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    return ctx


async def test_the_default_layout_is_not_what_the_reference_reads(home: Paths, tmp_path: Path) -> None:
    agent_home = tmp_path / "agent-home"
    async with appliance(home) as app:
        rc, _, err = uomp(
            home, "authorize", str(CALENDAR), "--remote", "--out", str(agent_home / ".uomp"), "--yes",
            "--gateway-url", app.base, "--any-gateway-url",
        )  # fmt: skip
        assert rc == 0, err
    bundle = json.loads((agent_home / ".uomp" / "bundle.json").read_text())
    with pytest.raises(NoMtls):
        reference_sdk_load(agent_home, {"UOM_TOKEN": bundle["access_token"], "UOMP_BASE_URL": bundle["gateway_url"]})


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        pytest.param(["--remote"], "give --out", id="no-out"),
        pytest.param(["--remote", "--out", "X", "--bundle", "Y"], "without --cert, --csr or --bundle", id="bundle"),
        pytest.param(["--out", "X"], "add --remote", id="local-profile"),
    ],
)
def test_reference_layout_refusals_say_what_to_do(home: Paths, extra: list[str], needle: str) -> None:
    rc, out, err = uomp(home, "authorize", str(CALENDAR), "--layout", "uomp-core", "--yes", *extra)
    assert rc == 1 and "INVALID_REQUEST" in err and needle in err, out + err
    assert "Grant:" not in out  # refused before the consent panel: nothing was shown, nothing made
    assert not Path("X").exists()


def test_reference_key_is_a_pem_block_node_reads(tmp_path: Path) -> None:
    """The denied partner of the key-form check: a DER key or an encrypted PEM is not what the SDK loads."""
    from gateway.core import ca

    key = ca.new_key("p256")
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    assert not der.startswith(KEY_BLOCKS)
    assert ca.key_pem(key).startswith(KEY_BLOCKS)
