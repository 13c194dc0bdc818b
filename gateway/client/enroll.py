"""The agent's side of enrollment (docs/enrollment.md): with the one line the user's
``uomp agent invite`` printed, make a key here, pin the user's CA by its fingerprint, send a CSR, the
one-time code and the manifest over TLS, wait for the user's decision, and write what the approval
brings (certificate, tokens, CA) beside the key. The private key never leaves this machine; the
answer comes sealed to a one-time X25519 key that lives only in this process's memory.

Files in ``out`` (created 0700): ``agent.key`` (0600, written first), ``ca.crt``, ``agent.crt`` and
``bundle.json`` (0600; ``agent_key_file`` names ``agent.key``, no key inside), the same bundle
``uomp authorize --remote`` writes, for :meth:`gateway.client.UompClient.from_bundle`.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gateway.bundle import AgentBundle, write_bundle
from gateway.client.tls import build_client_context
from gateway.core import ca, enrolment, jose
from gateway.errors import ErrorCode, UompError, known_code
from gateway.fsutil import atomic_write

MAX_ANSWER_BYTES = 256 * 1024
REQUEST_TIMEOUT_SECONDS = 30.0
MAX_POLL_SECONDS = 30.0


@dataclass(frozen=True)
class Requested:
    """What the agent shows its operator while it waits: the request id and its key's fingerprint,
    the two things the user sees in ``uomp requests list`` to know the request is this one."""

    request_id: str
    key_fingerprint: str


def _fetch_ctx() -> ssl.SSLContext:
    """TLS 1.3 without certificate checks, for the one request that fetches the CA certificate,
    which is then checked against the pinned fingerprint before anything is sent or trusted."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def _json(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    raw = await resp.content.read(MAX_ANSWER_BYTES + 1)
    if len(raw) > MAX_ANSWER_BYTES:
        raise UompError(ErrorCode.UPSTREAM_ERROR, "the gateway's answer is too large")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise UompError(ErrorCode.UPSTREAM_ERROR, f"the gateway answered {resp.status} without JSON") from exc
    if not isinstance(doc, dict):
        raise UompError(ErrorCode.UPSTREAM_ERROR, "the gateway's answer is not a JSON object")
    if resp.status >= 400:
        err = doc.get("error") if isinstance(doc.get("error"), dict) else {}
        assert isinstance(err, dict)
        code = known_code(err.get("code")) or ErrorCode.UPSTREAM_ERROR
        raise UompError(code, str(err.get("message", f"HTTP {resp.status}"))[:300])
    return doc


async def fetch_pinned_ca(line: enrolment.Line) -> bytes:
    """The gateway's CA certificate (PEM), only if its SHA-256 is the line's fingerprint."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
    async with (
        aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(ssl=_fetch_ctx())) as s,
        s.get(line.url + "/v1/enroll/ca") as resp,
    ):
        doc = await _json(resp)
    pem = str(doc.get("ca_cert", "")).encode()
    try:
        der = ca.load_cert(pem).public_bytes(serialization.Encoding.DER)
    except UompError as exc:
        raise UompError(ErrorCode.CA_ERROR, "the gateway sent no usable CA certificate") from exc
    if not enrolment.digest_equal(enrolment.ca_fingerprint(der), line.ca_fingerprint):
        raise UompError(
            ErrorCode.CA_ERROR,
            "the gateway's CA is not the one your enrollment line names (fingerprint mismatch): this may not be "
            "the user's gateway; nothing was sent. Check the URL and ask the user for the line again",
        )
    return pem


def _prepare_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UompError(ErrorCode.CONFIG_ERROR, f"--out {out} exists and is not a directory")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in ("agent.key", "bundle.json"):
        if (out / name).exists():
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                f"{out / name} exists already; enroll into a new directory (--out) or remove the old files",
            )


async def enroll(
    line: enrolment.Line,
    manifest: bytes,
    out: Path,
    *,
    wait_seconds: float = 900.0,
    on_request: Callable[[Requested], None] | None = None,
    key_type: ca.KeyType = "p256",
) -> Path:
    """Enroll and return the bundle's path; UompError with the gateway's code on any refusal."""
    out = Path(out)
    _prepare_out(out)
    agent_id = _manifest_agent_id(manifest)
    made: list[Path] = []
    try:
        return await _enroll(line, manifest, out, agent_id, made, wait_seconds, on_request, key_type)
    except BaseException:
        for p in made:  # a refused or abandoned enrollment leaves nothing behind: the same --out works again
            p.unlink(missing_ok=True)
        raise


async def _enroll(
    line: enrolment.Line,
    manifest: bytes,
    out: Path,
    agent_id: str,
    made: list[Path],
    wait_seconds: float,
    on_request: Callable[[Requested], None] | None,
    key_type: ca.KeyType,
) -> Path:
    key = ca.new_key(key_type)
    key_file = out / "agent.key"
    made.append(key_file)
    atomic_write(key_file, ca.key_pem(key), mode=0o600)
    ca_pem = await fetch_pinned_ca(line)
    ca_file = out / "ca.crt"
    made.append(ca_file)
    atomic_write(ca_file, ca_pem, mode=0o644)
    csr = ca.make_csr(key, agent_id).public_bytes(serialization.Encoding.PEM).decode()
    seal_key = X25519PrivateKey.generate()
    seal_pub = enrolment.b64u(
        seal_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    body = {
        "code": line.code,
        "manifest": manifest.decode("utf-8"),
        "csr": csr,
        "seal_key": seal_pub,
    }
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
    connector = aiohttp.TCPConnector(ssl=build_client_context(ca_file))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
        async with s.post(line.url + "/v1/enroll", json=body) as resp:
            opened = await _json(resp)
        request_id, poll_token = str(opened["request_id"]), str(opened["poll_token"])
        if on_request is not None:
            on_request(Requested(request_id, str(opened.get("key_fingerprint", jose.key_thumbprint(key)))))
        deadline = time.monotonic() + wait_seconds
        while True:
            async with s.post(f"{line.url}/v1/enroll/{request_id}/status", json={"poll_token": poll_token}) as resp:
                answer = await _json(resp)
            if answer.get("status") == "approved":
                break
            if time.monotonic() >= deadline:
                raise UompError(
                    ErrorCode.ENROLL_DENIED,
                    f"no decision on request {request_id} within {wait_seconds:g} s; ask the user to run "
                    f"'uomp requests approve {request_id}', then enroll again with a new code",
                )
            after = answer.get("poll_after_seconds", 2)
            await asyncio.sleep(min(MAX_POLL_SECONDS, max(0.2, float(after) if isinstance(after, int | float) else 2)))
    plain = enrolment.open_sealed(seal_key, request_id, answer.get("sealed"))
    bundle = _bundle(plain, key_file, agent_id)
    cert_pem = (bundle.agent_cert or "").encode()
    _check_cert(cert_pem, key, agent_id)
    made.append(out / "agent.crt")
    atomic_write(out / "agent.crt", cert_pem, mode=0o644)
    path = out / "bundle.json"
    write_bundle(path, bundle)
    return path


def _manifest_agent_id(manifest: bytes) -> str:
    try:
        doc = json.loads(manifest)
        agent_id = doc["agent"]["id"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UompError(ErrorCode.MANIFEST_INVALID, "the manifest has no agent.id (give the agent's uom.json)") from exc
    if not isinstance(agent_id, str):
        raise UompError(ErrorCode.MANIFEST_INVALID, "agent.id must be a string")
    ca.validate_agent_id(agent_id)
    return agent_id


def _bundle(plain: bytes, key_file: Path, agent_id: str) -> AgentBundle:
    try:
        doc = json.loads(plain)
        doc.pop("uomp_bundle", None)
        bundle = AgentBundle(**doc)
    except (ValueError, TypeError) as exc:
        raise UompError(ErrorCode.UPSTREAM_ERROR, "the approved answer is not an agent bundle") from exc
    if bundle.agent_id != agent_id or bundle.agent_key is not None:
        raise UompError(ErrorCode.UPSTREAM_ERROR, "the approved answer is for another agent")
    return replace(bundle, agent_key_file=str(key_file.resolve()))


def _check_cert(pem: bytes, key: ca.AgentPrivateKey, agent_id: str) -> None:
    """The certificate is for this key and this agent (else nothing is written)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise UompError(ErrorCode.UPSTREAM_ERROR, "the approved answer holds no certificate") from exc
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    same_key = cert.public_key().public_bytes(serialization.Encoding.DER, spki) == key.public_key().public_bytes(
        serialization.Encoding.DER, spki
    )
    if not same_key or ca.agent_id_from_cert(cert) != agent_id:
        raise UompError(ErrorCode.UPSTREAM_ERROR, "the approved certificate is not for this agent's key")
