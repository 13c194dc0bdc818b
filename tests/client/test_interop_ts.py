"""Interop with the TypeScript reference's token library: the real npm ``jose`` package, run by Node.

``interop/ts_tokens.mjs`` makes keys, mints and verifies exactly as the public TypeScript reference
(0xaicrypto/uomp-core) does with ``jose`` (EdDSA/Ed25519, kid ``uomp-auth-key-1``, header
``{alg, kid}``, ``jwtVerify`` with ``algorithms: ['EdDSA']``). These tests cross the language
boundary both ways: our tokens checked by their verifier, their keys and tokens accepted by our
loader, our verifier and our running guard, and each side's refusals.

``scripts/setup-interop.sh`` installs ``interop/node_modules`` from the lock file when missing.
Node is spawned a handful of times in all (tokens are batched per invocation).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from guardkit import admin_headers, call, grant, running_guard, seed, unix_session

from gateway import keys
from gateway.config import Paths
from gateway.core import capability, jose, tokens
from gateway.errors import UompError

ROOT = Path(__file__).resolve().parents[2]
INTEROP = ROOT / "interop"
SCRIPT = INTEROP / "ts_tokens.mjs"
SETUP = ROOT / "scripts" / "setup-interop.sh"
NODE = shutil.which("node")

TS_KID = "uomp-auth-key-1"  # what the reference stamps on every key it makes
TS_AUDIENCE = "http://127.0.0.1:9374"  # the reference's local-profile audience
# Our grant (snake_case on the wire) and the same rules as the reference writes them (camelCase).
READ = {"tags": ["preference"], "keys": ["user.passport"], "deny_tags": ["private"], "deny_keys": ["preference.lang"]}
TS_READ = {"tags": ["preference"], "keys": ["user.passport"], "denyTags": ["private"], "denyKeys": ["preference.lang"]}
TS_NO_WRITE = {"tags": [], "keys": [], "denyTags": [], "denyKeys": []}


@pytest.fixture(scope="module", autouse=True)
def _interop_harness() -> None:
    if NODE is None:
        pytest.skip(
            "Node.js is not installed: these tests run the npm 'jose' library the TypeScript "
            "reference uses (install node and npm, then scripts/setup-interop.sh)"
        )
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not (INTEROP / "node_modules" / "jose" / "package.json").is_file():
        pytest.fail(
            f"scripts/setup-interop.sh did not install interop/node_modules (rc={proc.returncode}):\n"
            f"{proc.stdout}{proc.stderr}"
        )


# ------------------------------------------------------------------------------------ helpers


def _ts(*args: str, umask: int = -1) -> subprocess.CompletedProcess[str]:
    assert NODE is not None
    return subprocess.run([NODE, str(SCRIPT), *args], capture_output=True, text=True, timeout=60, umask=umask)


def ts_keygen(*dirs: Path) -> list[dict[str, Any]]:
    """The reference's key files in each ``dir/.secrets``; returns the public JWKs.

    Run under umask 022, a typical user's: the reference passes no file mode, so that is what decides.
    """
    proc = _ts("keygen", *map(str, dirs), umask=0o022)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def ts_mint(data_dir: Path, claims: list[dict[str, Any]]) -> list[str]:
    """One token per claims object, signed by ``data_dir``'s TS-written private JWK."""
    fd, name = tempfile.mkstemp(suffix=".json", prefix="ts-claims-")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(claims, fh)
        proc = _ts("mint", str(data_dir), name)
    finally:
        os.unlink(name)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split()
    assert len(out) == len(claims)
    return out


def ts_verify(data_dir: Path, toks: list[str]) -> list[dict[str, Any]]:
    """jwtVerify of each token with ``data_dir``'s ed25519-public.jwk: {payload, protectedHeader} or {error}."""
    proc = _ts("verify", str(data_dir), *toks)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(toks), proc.stderr
    assert proc.returncode == (1 if any("error" in r for r in results) else 0), proc.stderr
    return results


def js_iso(ts: float) -> str:
    """``Date.prototype.toISOString()``: what the reference writes in issued_at/expires_at."""
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(ts * 1000) % 1000:03d}Z"


def ts_claims(session_id: str, agent_id: str, *, read: dict[str, Any], lifetime: float = 600) -> dict[str, Any]:
    """Claims in the shape the reference's Auth Service issues (camelCase inside scopes and limits)."""
    now = time.time()
    return {
        "version": "1.0",
        "session_id": session_id,
        "agent_id": agent_id,
        "issued_at": js_iso(now),
        "expires_at": js_iso(now + lifetime),
        "scopes": {"read": read, "write": TS_NO_WRITE},
        "limits": {"maxReadQueries": 100, "maxWriteQueries": 0},
        "profile": "local",
        "audience": TS_AUDIENCE,
        "aggregation_only": False,
        "task_bound": False,
    }


def _payload(token: str) -> dict[str, Any]:
    return dict(json.loads(jose.b64u_decode(token.split(".")[1])))


def _reencode(
    token: str,
    *,
    header: dict[str, Any] | None = None,
    payload: dict[str, Any] | None = None,
    signature: str | None = None,
) -> str:
    h, p, s = token.split(".")
    if header is not None:
        h = jose.b64u_encode(json.dumps(header, separators=(",", ":")).encode())
    if payload is not None:
        p = jose.b64u_encode(json.dumps(payload, separators=(",", ":")).encode())
    return f"{h}.{p}.{s if signature is None else signature}"


def stranger_token(claims: dict[str, Any]) -> str:
    """The same claims signed by some other Ed25519 key, under the reference's kid."""
    now = int(time.time())
    return tokens.sign_token({**claims, "iat": now, "exp": now + 600}, ed25519.Ed25519PrivateKey.generate(), TS_KID)


@pytest.fixture
def seeded(home: Paths) -> Paths:
    seed(home)
    return home


# --------------------------------------------------------------------------------------- tests


async def test_ours_to_theirs_guard_token_verifies_with_ts_jose(seeded: Paths) -> None:
    """(a) A token from our Auth Service verifies with jose and our ed25519-public.jwk, claims intact."""
    async with running_guard(seeded), unix_session(seeded) as s:
        g = await grant(s, seeded, read=READ, limits={"max_read_queries": 7})
    ours = keys.load_signing_key(seeded)

    [result] = ts_verify(seeded.home, [g["token"]])

    assert "error" not in result, result
    assert result["protectedHeader"] == {"alg": "EdDSA", "kid": ours.kid}
    payload = result["payload"]
    assert payload == _payload(g["token"])  # jose sees exactly the claims we signed
    assert payload["version"] == "1.0"
    assert payload["session_id"] == g["session_id"] and payload["agent_id"] == "calendar_agent"
    read = payload["scopes"]["read"]
    assert read["tags"] == ["preference"] and read["keys"] == ["user.passport"]
    assert read["deny_tags"] == ["private"] and read["deny_keys"] == ["preference.lang"]
    assert "denyTags" not in read and "denyKeys" not in read  # we write snake_case inside scopes
    assert payload["limits"] == {"max_read_queries": 7, "max_write_queries": 0}
    assert payload["profile"] == "local" and payload["aggregation_only"] is False
    assert payload["task_bound"] is False
    assert isinstance(payload["iat"], int) and isinstance(payload["exp"], int)
    assert tokens.parse_iso(payload["expires_at"]) == payload["exp"]
    assert payload["jti"].startswith("jti_")


def test_theirs_to_ours_ts_keys_and_token_in_python(tmp_path: Path) -> None:
    """(b) A TS-written data dir (two JWK files, no jwks.json) and a TS token in the reference shape."""
    data = tmp_path / "ts-home"
    [pub] = ts_keygen(data)
    paths = Paths(data)
    assert paths.public_jwk.is_file() and paths.private_jwk.is_file() and not paths.jwks.exists()
    assert pub["kid"] == TS_KID and pub["alg"] == "EdDSA" and "d" not in pub

    trusted = keys.load_public_keys(paths)
    assert list(trusted) == [TS_KID]
    assert jose.public_jwk(trusted[TS_KID])["x"] == pub["x"]

    claims = ts_claims("sess_ts_1", "calendar_agent", read={**TS_READ, "allowedFields": ["key", "value"]})
    [tok] = ts_mint(data, [claims])
    header = json.loads(jose.b64u_decode(tok.split(".")[0]))
    assert header == {"alg": "EdDSA", "kid": TS_KID}

    cap = tokens.verify_token(tok, trusted, now=time.time())
    assert (cap.session_id, cap.agent_id, cap.kid, cap.token_use) == ("sess_ts_1", "calendar_agent", TS_KID, "access")
    assert cap.read.tags == ("preference",) and cap.read.keys == ("user.passport",)
    assert cap.read.deny_tags == ("private",) and cap.read.deny_keys == ("preference.lang",)
    assert cap.read.allowed_fields == ("key", "value") and cap.allowed_fields == ("key", "value")
    assert cap.write == capability.EMPTY_SCOPE
    assert (cap.max_read_queries, cap.max_write_queries) == (100, 0)
    assert (cap.profile, cap.audience, cap.jti) == ("local", TS_AUDIENCE, None)  # the reference sets no jti
    # millisecond ISO timestamps (Date.toISOString) parse; jose's exp is expires_at floored to the second
    assert abs(cap.expires_at - tokens.parse_iso(claims["expires_at"])) < 1e-6
    assert _payload(tok)["exp"] == int(cap.expires_at)

    # parse_claims alone maps the camelCase spellings
    parsed = jose.parse_compact(tok)
    direct = tokens.parse_claims(parsed.header, parsed.payload)
    assert direct.read.deny_tags == ("private",) and direct.max_read_queries == 100
    assert direct.max_write_queries == 0

    # and the TS key is the only one trusted: a token from any other key is refused
    stranger = stranger_token(claims)
    with pytest.raises(UompError) as err:
        tokens.verify_token(stranger, trusted, now=time.time())
    assert err.value.code == "INVALID_TOKEN"


async def test_theirs_to_our_running_guard(home: Paths, tmp_path: Path) -> None:
    """(c) Our guard on the reference's key files; TS tokens read through the Unix socket."""
    seed(home)
    for ours in (home.private_jwk, home.public_jwk, home.jwks):
        ours.unlink()
    other = tmp_path / "other-ts-home"
    [pub, _] = ts_keygen(home.home, other)

    # The reference writes the private key with no mode: world-readable under umask 022. Our loader
    # refuses such a key until the user restricts it.
    assert stat.S_IMODE(home.private_jwk.stat().st_mode) == 0o644
    with pytest.raises(UompError) as err:
        keys.load_signing_key(home)
    assert err.value.code == "KEY_ERROR" and "chmod 600" in err.value.message
    os.chmod(home.private_jwk, 0o600)
    signing = keys.load_signing_key(home)
    assert signing.kid == TS_KID and jose.public_jwk(signing.key)["x"] == pub["x"]

    async with running_guard(home), unix_session(home) as s:
        g = await grant(s, home, read=READ)
        sid = g["session_id"]
        claims = ts_claims(sid, "calendar_agent", read=TS_READ)
        [ts_tok] = ts_mint(home.home, [claims])
        [forged] = ts_mint(other, [claims])  # a different TS key, the same kid
        assert forged != ts_tok

        status, body, hdrs = await call(s, "GET", "/v1/memory/preference.theme", token=ts_tok)
        assert status == 200 and body["value"] == "dark", body
        assert (
            hdrs["X-UOMP-Quota-Remaining"] == "99"
        )  # the grant's quota (100 by default) applies, whatever the token says
        # the camelCase deny lists are enforced, not silently dropped
        status, body, _ = await call(s, "GET", "/v1/memory/preference.lang", token=ts_tok)
        assert status == 403 and body["error"]["message"] == "key explicitly denied"
        status, body, _ = await call(s, "GET", "/v1/memory?tag=private", token=ts_tok)
        assert status == 403 and body["error"]["message"] == "tag explicitly denied"

        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=forged)
        assert status == 401 and body["error"]["code"] == "INVALID_TOKEN", body

        status, body, _ = await call(s, "POST", f"/v1/sessions/{sid}/revoke", headers=admin_headers(home))
        assert (status, body["status"]) == (200, "revoked")
        [after] = ts_mint(home.home, [{**claims, "issued_at": js_iso(time.time())}])
        for tok in (after, ts_tok):
            status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=tok)
            assert status == 401 and body["error"]["code"] == "SESSION_REVOKED", body

    # the guard ran on the reference's two files alone: nothing of ours was written next to them
    # The reference's key files were used as they are; the only new secrets are the audit log's own
    # (its checkpoint signing key, which the guard makes on first start, and its witness record) and
    # the key that seals high-sensitivity values, made when the store first opens. Beside them is the
    # home's writers' lock, which a running guard holds shared: an empty file, no secret in it.
    lock = home.secrets / ".writers.lock"
    assert lock.stat().st_size == 0
    assert sorted(p.name for p in home.secrets.iterdir() if p != lock) == [
        "admin-token",
        "audit-ed25519.key",
        "audit-witness.json",
        "ed25519-private.jwk",
        "ed25519-public.jwk",
        "items.key",
    ]


async def test_ts_jose_refuses_our_tampered_and_unsigned_tokens(seeded: Paths) -> None:
    """(d) jose rejects our token with one claim changed, and alg-none forms of it; so do we."""
    async with running_guard(seeded), unix_session(seeded) as s:
        tok = (await grant(s, seeded, read={"tags": ["preference"], "keys": []}))["token"]
    kid = keys.load_signing_key(seeded).kid
    widened = _payload(tok)
    widened["scopes"]["read"]["tags"].append("identity")
    tampered = _reencode(tok, payload=widened)
    none_header = {"alg": "none", "kid": kid}
    unsigned = _reencode(tok, header=none_header, signature="")
    unsigned_kept_sig = _reencode(tok, header=none_header)

    control, *bad = ts_verify(seeded.home, [tok, tampered, unsigned, unsigned_kept_sig])

    assert "payload" in control and control["payload"]["scopes"]["read"]["tags"] == ["preference"]
    assert bad[0]["error"]["code"] == "ERR_JWS_SIGNATURE_VERIFICATION_FAILED", bad[0]
    assert bad[1]["error"]["code"] == "ERR_JOSE_ALG_NOT_ALLOWED", bad[1]
    assert bad[2]["error"]["code"] == "ERR_JOSE_ALG_NOT_ALLOWED", bad[2]
    trusted = keys.load_public_keys(seeded)
    for forged in (tampered, unsigned, unsigned_kept_sig):
        with pytest.raises(UompError) as err:
            tokens.verify_token(forged, trusted, now=time.time())
        assert err.value.code == "INVALID_TOKEN"
