"""The agent certificate in the agent SDK (mTLS): loading the agent key, checking certificate and key
belong together and name this agent, renewing at ``renew_at_fraction`` of its life (or on demand,
optionally onto a new key), moving new connections to the renewed certificate and saving it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gateway.bundle import AgentBundle
from gateway.client.errors import CertificateError, ConfigError, ProtocolError, UompClientError, error_from_answer
from gateway.client.options import AgentKey, ClientOptions, JSONObject, RenewedCertificate, log
from gateway.client.tokens import BundleFile
from gateway.client.transport import ClientTransport
from gateway.core import ca


def spki(key: Any) -> bytes:
    """A public key's DER SubjectPublicKeyInfo (what a certificate binds)."""
    return bytes(key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))


def load_key_pem(data: bytes, what: str) -> AgentKey:
    """A P-256 or Ed25519 private key from PEM; CONFIG_ERROR naming ``what`` otherwise."""
    try:
        return ca.load_private_key(data)
    except (ValueError, TypeError) as exc:
        raise ConfigError("CONFIG_ERROR", f"{what} is not a P-256 or Ed25519 PEM private key") from exc


def bundle_key(bundle: AgentBundle, bundle_path: Path) -> AgentKey | None:
    """The agent's private key from its bundle (inline or its key file), or None when it has none."""
    if bundle.agent_key:
        return load_key_pem(bundle.agent_key.encode(), "the bundle's agent_key")
    if not bundle.agent_key_file:
        return None
    path = Path(bundle.agent_key_file).expanduser()
    if not path.is_absolute():
        path = bundle_path.parent / path
    try:
        if path.stat().st_mode & 0o077:
            raise ConfigError(
                "CONFIG_ERROR", f"{path} holds the agent key and must not be readable by others; chmod 600 it"
            )
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError("CONFIG_ERROR", f"cannot read the agent key file {path}: {exc.strerror}") from exc
    return load_key_pem(data, f"{path}")


class CertificateRenewer:
    """The agent certificate part of :class:`~gateway.client.sdk.UompClient` (mTLS): the current
    certificate (``cert``; None in the other modes), when it is due (``renew_at_fraction`` of its
    life) and its renewal over the transport, saved to the bundle and moved onto the transport.
    ``secrets`` are the session's recent tokens, kept out of error messages."""

    def __init__(
        self,
        transport: ClientTransport,
        bundle: BundleFile,
        *,
        agent_id: str,
        session_id: str,
        options: ClientOptions,
        clock: Callable[[], float],
        ca_cert: str | None,
        secrets: Collection[str],
    ) -> None:
        self._transport = transport
        self._bundle = bundle
        self._agent_id = agent_id
        self._session_id = session_id
        self._opts = options
        self._clock = clock
        self._ca_cert = ca_cert
        self._secrets = secrets
        self.cert: x509.Certificate | None = None
        self._renew_at = float("inf")
        self._renew_blocked_until = 0.0
        self.lock = asyncio.Lock()  # one renewal at a time

    @property
    def serial(self) -> str | None:
        return ca.serial_hex(self.cert.serial_number) if self.cert is not None else None

    @property
    def not_after(self) -> dt.datetime | None:
        return self.cert.not_valid_after_utc if self.cert is not None else None

    def set_certificate(self, pem: str, key: AgentKey) -> None:
        try:
            cert = x509.load_pem_x509_certificate(pem.encode())
        except ValueError as exc:
            raise ConfigError("CONFIG_ERROR", "the agent certificate is not a PEM certificate") from exc
        if spki(cert.public_key()) != spki(key.public_key()):
            raise ConfigError("CONFIG_ERROR", "the agent certificate and the agent key do not belong together")
        cert_agent = ca.agent_id_from_cert(cert)
        if cert_agent != self._agent_id:
            raise ConfigError("CONFIG_ERROR", "the agent certificate names another agent than the bundle")
        self.cert = cert
        self._transport.set_certificate(pem, key)
        nb = cert.not_valid_before_utc.timestamp()
        na = cert.not_valid_after_utc.timestamp()
        self._renew_at = nb + (na - nb) * self._opts.renew_at_fraction

    def check_not_expired(self) -> None:
        if self.cert is None:
            return
        if self._clock() >= self.cert.not_valid_after_utc.timestamp():
            na = self.cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
            raise CertificateError(
                "CERT_EXPIRED",
                f"the agent certificate (serial {self.serial}) expired at {na}; a certificate is "
                "renewed with itself, so it is too late to renew: ask the user for a new one ('uomp agent issue "
                f"{self._agent_id}' or 'uomp authorize --remote')",
                None,
                self._session_id,
            )

    async def ensure(self) -> None:
        self.check_not_expired()
        now = self._clock()
        if now < self._renew_at or now < self._renew_blocked_until:
            return
        async with self.lock:
            now = self._clock()
            if now < self._renew_at or now < self._renew_blocked_until:
                return
            try:
                await self.renew(None)
            except UompClientError as exc:
                self._renew_blocked_until = self._clock() + self._opts.renew_retry_seconds
                log.warning(
                    "automatic renewal of the agent certificate failed (%s: %s); the current one stays in use until %s",
                    exc.code,
                    exc.message,
                    self.not_after,
                )

    async def renew(self, csr_key: AgentKey | None) -> RenewedCertificate:
        assert self._transport.key is not None and self._ca_cert is not None
        body: JSONObject | None = None
        if csr_key is not None:
            csr = ca.make_csr(csr_key, self._agent_id)
            body = {"csr": csr.public_bytes(serialization.Encoding.PEM).decode()}
        status, answer = await self._transport.send(
            "POST", "/v1/certificates/renew", None, body if body is not None else {}, None
        )
        if status >= 300:
            raise error_from_answer(status, answer, session_id=self._session_id, secrets=self._secrets)
        pem = answer.get("certificate") if isinstance(answer, dict) else None
        if not isinstance(pem, str):
            raise ProtocolError("BAD_RESPONSE", "the renewal answer has no certificate", status, self._session_id)
        new_key = csr_key if csr_key is not None else self._transport.key
        try:
            cert = x509.load_pem_x509_certificate(pem.encode())
            ca_cert = x509.load_pem_x509_certificate(self._ca_cert.encode())
        except ValueError:
            raise ProtocolError(
                "BAD_RESPONSE", "the renewed certificate is not PEM", status, self._session_id
            ) from None
        if not ca.is_issued_by(cert, ca_cert):
            raise ProtocolError(
                "BAD_RESPONSE", "the renewed certificate was not issued by the bundle's CA", status, self._session_id
            )
        try:
            self.set_certificate(pem, new_key)
        except ConfigError as exc:
            raise ProtocolError(
                "BAD_RESPONSE", f"the renewed certificate is unusable: {exc.message}", status, self._session_id
            ) from None
        await self._transport.use_certificate(pem, new_key)  # calls in flight finish on the old pool
        rotated = csr_key is not None
        key_pem = ca.key_pem(new_key).decode() if rotated else None

        def update(b: AgentBundle) -> AgentBundle:
            if key_pem is None:
                return dataclasses.replace(b, agent_cert=pem)
            return dataclasses.replace(b, agent_cert=pem, agent_key=key_pem, agent_key_file=None)

        async with self._bundle.lock():
            await self._bundle.persist(update, "the renewed certificate")
        serial = ca.serial_hex(cert.serial_number)
        log.info(
            "agent certificate renewed for %s: serial %s valid until %s%s",
            self._agent_id,
            serial,
            cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
            " (new key)" if rotated else "",
        )
        return RenewedCertificate(serial=serial, not_after=cert.not_valid_after_utc, certificate=pem, new_key=rotated)
