"""Conformance cases for gateway mode: mTLS (§15.2), refresh (§15.5) and payloads (§15.6)."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import ssl
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from cryptography.x509.oid import NameOID

from gateway.client import payloads
from gateway.conformance.harness import (
    AUTH_REFUSED,
    TOKEN_CODES,
    Answer,
    Fail,
    Runner,
    Skip,
    b64,
    case,
    check_error_shape,
    claims_of,
    comparable,
    expect_error,
    expect_ok,
)
from gateway.core import sealing

# ---------------------------------------------------------------------- §15.2 gateway


def _self_signed(agent_id: str, workdir: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, agent_id)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"uomp:agent:{agent_id}")]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    cf, kf = workdir / "self.pem", workdir / "self.key"
    cf.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(kf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cf, kf


async def _refused_connection(r: Runner, ctx: ssl.SSLContext, token: str | None) -> str:
    """Returns how the gateway refused; raises Fail if a request got through."""
    try:
        a = await r.request("GET", "/v1/memory/conf.pref.theme", token=token, session=r.session(ctx))
    except (TimeoutError, aiohttp.ClientError, ssl.SSLError, OSError) as exc:
        return f"connection refused ({type(exc).__name__})"
    if a.status == 200:
        raise Fail("the request was answered 200")
    if a.status != 401:
        raise Fail(f"expected a refused handshake or 401, got {a.status}")
    check_error_shape(a)
    return f"401 {a.code()}"


@case("GW-01", "§15.2", "TLS 1.2 is refused: a client capped at TLS 1.2 gets no connection", modes=("gateway",))
async def _tls12(r: Runner) -> None:
    r.need_gateway_pieces()
    ctx = r.client_context(max_tls=ssl.TLSVersion.TLSv1_2)
    assert ctx is not None
    try:
        a = await r.request("GET", "/v1/health", session=r.session(ctx))
    except (TimeoutError, aiohttp.ClientError, ssl.SSLError, OSError):
        return
    raise Fail(f"a TLS 1.2 connection was accepted (answered {a.status})")


@case("GW-02", "§15.2", "a client with no certificate cannot read", modes=("gateway",))
async def _no_cert(r: Runner) -> None:
    r.need_gateway_pieces()
    token = await r.pref_token()
    ctx = r.client_context(with_cert=False)
    assert ctx is not None
    await _refused_connection(r, ctx, token)


@case("GW-03", "§15.2", "a self-signed client certificate (not from the user's CA) cannot read", modes=("gateway",))
async def _self_cert(r: Runner) -> None:
    r.need_gateway_pieces()
    token = await r.pref_token()
    with tempfile.TemporaryDirectory(prefix="uomp-conf-") as tmp:
        ctx = r.client_context(cert=_self_signed(r.agent_id, Path(tmp)))
    assert ctx is not None
    await _refused_connection(r, ctx, token)


@case("GW-04", "§15.2", "a token bound to another certificate is refused", modes=("gateway",))
async def _binding(r: Runner) -> None:
    other = b64(hashlib.sha256(b"another certificate").digest())
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, cnf={"x5t#S256": other, "jkt": other})
    expect_error(await r.read_key(str(g["token"]), "conf.pref.theme"), AUTH_REFUSED, TOKEN_CODES)


@case("GW-05", "§15.2", "X-UOMP-Agent-Id different from the token's agent is refused", modes=("gateway",))
async def _agent_header(r: Runner) -> None:
    token = await r.pref_token()
    a = await r.read_key(token, "conf.pref.theme", agent="someone_else")
    expect_error(a, (401, 403))


@case(
    "GW-06",
    "§15.2",
    "a token for another agent id, presented with this agent's certificate, is refused",
    modes=("gateway",),
)
async def _agent_binding(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, agent_id="conformance_other")
    a = await r.read_key(str(g["token"]), "conf.pref.theme", agent="conformance_other")
    expect_error(a, (401, 403))


@case("GW-07", "§15.2", "the management API (session create) is not reachable through the gateway", modes=("gateway",))
async def _no_mgmt(r: Runner) -> None:
    r.need_gateway_pieces()
    token = await r.pref_token()
    a = await r.request("POST", "/v1/sessions", token=token, json_body={"agent_id": "x", "agent_name": "x"})
    if a.status in (200, 201):
        raise Fail("a session was created through the gateway")
    check_error_shape(a)


# ---------------------------------------------------------------------- §15.5 refresh


async def _refresh(r: Runner, sid: str, refresh_token: str) -> Answer:
    return await r.request("POST", f"/v1/sessions/{quote(sid, safe='')}/refresh", token=refresh_token)


@case(
    "REF-01",
    "§15.5",
    "a refresh token rotates: the new access token reads, the spent refresh token is refused",
    modes=("gateway",),
)
async def _rotate(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, refresh=True)
    if "refresh_token" not in g:
        raise Skip("the target issued no refresh token for a bound remote grant")
    a = await _refresh(r, str(g["session_id"]), str(g["refresh_token"]))
    body = expect_ok(a)
    if not isinstance(body, dict) or "token" not in body or "refresh_token" not in body:
        raise Fail("refresh answer lacks token and refresh_token")
    expect_ok(await r.read_key(str(body["token"]), "conf.pref.theme"))
    again = await _refresh(r, str(g["session_id"]), str(g["refresh_token"]))
    expect_error(again, AUTH_REFUSED)
    # reuse revokes the family (§15.5): the token rotated in is refused too
    expect_error(await _refresh(r, str(g["session_id"]), str(body["refresh_token"])), AUTH_REFUSED)


@case(
    "REF-02",
    "§15.5",
    "a refresh token has no read scopes and never reads; an access token does not refresh",
    modes=("gateway",),
)
async def _kinds(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, refresh=True)
    if "refresh_token" not in g:
        raise Skip("the target issued no refresh token for a bound remote grant")
    scopes = claims_of(str(g["refresh_token"])).get("scopes")
    if scopes not in (None, {}, [], ["refresh"], "refresh") and not (
        isinstance(scopes, dict) and all(not v for v in scopes.values())
    ):
        raise Fail(f"the refresh token's scopes claim is not empty or refresh-only: {json.dumps(scopes)[:100]}")
    expect_error(await _refresh(r, str(g["session_id"]), str(g["token"])), AUTH_REFUSED)
    expect_error(await r.read_key(str(g["refresh_token"]), "conf.pref.theme"), AUTH_REFUSED)


@case("REF-03", "§15.5 §13.4", "a refresh token of a revoked session is refused", modes=("gateway",))
async def _refresh_revoked(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, refresh=True)
    if "refresh_token" not in g:
        raise Skip("the target issued no refresh token for a bound remote grant")
    await r.admin("POST", f"/v1/sessions/{g['session_id']}/revoke")
    expect_error(await _refresh(r, str(g["session_id"]), str(g["refresh_token"])), AUTH_REFUSED)


# ---------------------------------------------------------------------- §15.6 payloads


async def _relay(r: Runner) -> None:
    r.need_gateway_pieces()
    a = await r.request("POST", "/v1/payload/upload", json_body={})
    if a.status == 404:
        raise Skip("the target has no payload relay (POST /v1/payload/upload answers 404)")


def _recipient(r: Runner) -> X25519PublicKey:
    if not r.t.payload_public_key:
        raise Skip("needs the user's payload public key (--payload-public-key, `uomp payload pubkey`)")
    try:
        return X25519PublicKey.from_public_bytes(base64.b64decode(r.t.payload_public_key, validate=True))
    except ValueError as exc:
        raise Skip("--payload-public-key is not base64 of 32 raw X25519 bytes") from exc


async def _sealed(r: Runner, **override: str) -> tuple[str, dict[str, Any]]:
    """A token with a session, and a correctly sealed §15.6 envelope for it (fields overridable)."""
    recipient = _recipient(r)
    g = await r.grant({"tags": ["conf.pref"], "keys": []})
    binding = sealing.Binding(
        payload_id=override.get("payload_id", payloads.new_payload_id()),
        session_id=override.get("session_id", str(g["session_id"])),
        agent_id=override.get("agent_id", r.agent_id),
        format="text/markdown",
    )
    return str(g["token"]), payloads.seal_small(recipient, binding, b"# conformance\n" + os.urandom(64))


async def _upload(r: Runner, token: str, env: dict[str, Any]) -> Answer:
    return await r.request("POST", "/v1/payload/upload", token=token, json_body=env)


@case("PAY-01", "§15.6", "a payload upload with no token is refused 401", modes=("gateway",))
async def _pay_noauth(r: Runner) -> None:
    await _relay(r)
    expect_error(await r.request("POST", "/v1/payload/upload", json_body={}), AUTH_REFUSED)


@case("PAY-02", "§15.6", "an upload that is not a §15.6 envelope is refused 4xx", modes=("gateway",))
async def _pay_bad(r: Runner) -> None:
    await _relay(r)
    token = await r.pref_token()
    for body in ({"envelope": {"v": 1}}, {"payload_id": "pay_x", "ciphertext": "not base64!"}):
        a = await _upload(r, token, body)
        if not 400 <= a.status < 500:
            raise Fail(f"a malformed envelope answered {a.status}")
        check_error_shape(a)


@case(
    "PAY-03",
    "§15.6",
    "a sealed envelope is stored once: the same upload again is refused or answers the "
    "stored entry (an idempotent retry); other bytes under the same payload_id are refused",
    modes=("gateway",),
)
async def _pay_ok(r: Runner) -> None:
    await _relay(r)
    recipient = _recipient(r)
    g = await r.grant({"tags": ["conf.pref"], "keys": []})
    token = str(g["token"])
    binding = sealing.Binding(
        payload_id=payloads.new_payload_id(),
        session_id=str(g["session_id"]),
        agent_id=r.agent_id,
        format="text/markdown",
    )
    env = payloads.seal_small(recipient, binding, b"# conformance\n" + os.urandom(64))
    a = await _upload(r, token, env)
    if a.status not in (200, 201):
        raise Fail(f"a correctly sealed envelope answered {a.status} {a.code()}")
    again = await _upload(r, token, env)
    if 200 <= again.status < 300:  # a retry of a lost answer: the same entry, never a second payload
        first = a.body if isinstance(a.body, dict) else {}
        second = again.body if isinstance(again.body, dict) else {}
        if (second.get("payload_id"), second.get("hash")) != (first.get("payload_id"), first.get("hash")):
            raise Fail(f"the same upload again answered {again.status} with another entry")
    elif not 400 <= again.status < 500:
        raise Fail(f"the same upload again answered {again.status}")
    other = payloads.seal_small(recipient, binding, b"# other bytes\n" + os.urandom(64))
    clash = await _upload(r, token, other)
    if not 400 <= clash.status < 500:
        raise Fail(f"other bytes under a stored payload_id answered {clash.status}")


@case(
    "PAY-04",
    "§15.6",
    "an envelope whose ciphertext was altered (hash no longer matches) is refused",
    modes=("gateway",),
)
async def _pay_tampered(r: Runner) -> None:
    await _relay(r)
    token, env = await _sealed(r)
    raw = bytearray(base64.b64decode(env["ciphertext"]))
    raw[-1] ^= 0x01
    env["ciphertext"] = base64.b64encode(bytes(raw)).decode()
    a = await _upload(r, token, env)
    if not 400 <= a.status < 500:
        raise Fail(f"an altered ciphertext answered {a.status}")


@case("PAY-05", "§15.6", "an envelope naming another session or agent than the token's is refused", modes=("gateway",))
async def _pay_other(r: Runner) -> None:
    await _relay(r)
    for field, value in (("session_id", "sess_someone_else"), ("agent_id", "someone_else")):
        token, env = await _sealed(r, **{field: value})
        a = await _upload(r, token, env)
        if not 400 <= a.status < 500:
            raise Fail(f"an envelope with a foreign {field} answered {a.status}")


@case(
    "PAY-06",
    "§15.6 §21",
    "an agent cannot fetch payloads: a stored id and an unknown id answer alike",
    modes=("gateway",),
)
async def _pay_get(r: Runner) -> None:
    await _relay(r)
    token, env = await _sealed(r)
    if (await _upload(r, token, env)).status not in (200, 201):
        raise Skip("setup: the sealed upload was not accepted (see PAY-03)")
    stored = await r.request("GET", "/v1/payload/" + quote(env["payload_id"], safe=""), token=token)
    unknown = await r.request("GET", "/v1/payload/pay_" + "A" * 24, token=token)
    if stored.status == 200:
        raise Fail("an agent read a stored payload back")
    if comparable(stored) != comparable(unknown):
        raise Fail(f"stored {comparable(stored)} vs unknown {comparable(unknown)}")
