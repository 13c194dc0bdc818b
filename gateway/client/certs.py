"""The agent certificate in the agent SDK (mTLS): loading the agent key, checking certificate and key
belong together and name this agent, renewing at ``renew_at_fraction`` of its life (or on demand,
optionally onto a new key), moving new connections to the renewed certificate and saving it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gateway.bundle import AgentBundle
from gateway.client.errors import CertificateError, ConfigError, ProtocolError, UompClientError, error_from_answer
from gateway.client.options import AgentKey, JSONObject, RenewedCertificate, log
from gateway.client.tokens import ClientTokens
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


class ClientCertificates(ClientTokens):
    """The certificate layer of :class:`~gateway.client.sdk.UompClient`."""

    @property
    def certificate_serial(self) -> str | None:
        return ca.serial_hex(self._cert.serial_number) if self._cert is not None else None

    @property
    def certificate_not_after(self) -> dt.datetime | None:
        return self._cert.not_valid_after_utc if self._cert is not None else None

    def _set_certificate(self, pem: str, key: AgentKey) -> None:
        try:
            cert = x509.load_pem_x509_certificate(pem.encode())
        except ValueError as exc:
            raise ConfigError("CONFIG_ERROR", "the agent certificate is not a PEM certificate") from exc
        if spki(cert.public_key()) != spki(key.public_key()):
            raise ConfigError("CONFIG_ERROR", "the agent certificate and the agent key do not belong together")
        cert_agent = ca.agent_id_from_cert(cert)
        if cert_agent != self._agent_id:
            raise ConfigError("CONFIG_ERROR", "the agent certificate names another agent than the bundle")
        self._cert, self._cert_pem, self._key = cert, pem, key
        nb = cert.not_valid_before_utc.timestamp()
        na = cert.not_valid_after_utc.timestamp()
        self._renew_at = nb + (na - nb) * self._opts.renew_at_fraction

    def _check_not_expired(self) -> None:
        if self._cert is None:
            return
        if self._clock() >= self._cert.not_valid_after_utc.timestamp():
            na = self._cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
            raise CertificateError(
                "CERT_EXPIRED",
                f"the agent certificate (serial {self.certificate_serial}) expired at {na}; a certificate is "
                "renewed with itself, so it is too late to renew: ask the user for a new one ('uomp agent issue "
                f"{self._agent_id}' or 'uomp authorize --remote')",
                None,
                self._session_id,
            )

    async def _ensure_certificate(self) -> None:
        self._check_not_expired()
        now = self._clock()
        if now < self._renew_at or now < self._renew_blocked_until:
            return
        async with self._cert_lock:
            now = self._clock()
            if now < self._renew_at or now < self._renew_blocked_until:
                return
            try:
                await self._renew(None)
            except UompClientError as exc:
                self._renew_blocked_until = self._clock() + self._opts.renew_retry_seconds
                log.warning(
                    "automatic renewal of the agent certificate failed (%s: %s); the current one stays in use until %s",
                    exc.code,
                    exc.message,
                    self.certificate_not_after,
                )

    async def _renew(self, csr_key: AgentKey | None) -> RenewedCertificate:
        assert self._key is not None and self._ca_cert is not None
        body: JSONObject | None = None
        if csr_key is not None:
            csr = ca.make_csr(csr_key, self._agent_id)
            body = {"csr": csr.public_bytes(serialization.Encoding.PEM).decode()}
        status, answer = await self._send(
            "POST", "/v1/certificates/renew", None, body if body is not None else {}, None
        )
        if status >= 300:
            raise error_from_answer(status, answer, session_id=self._session_id, secrets=self._recent)
        pem = answer.get("certificate") if isinstance(answer, dict) else None
        if not isinstance(pem, str):
            raise ProtocolError("BAD_RESPONSE", "the renewal answer has no certificate", status, self._session_id)
        new_key = csr_key if csr_key is not None else self._key
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
            self._set_certificate(pem, new_key)
        except ConfigError as exc:
            raise ProtocolError(
                "BAD_RESPONSE", f"the renewed certificate is unusable: {exc.message}", status, self._session_id
            ) from None
        # New connections use the new certificate; calls in flight finish on the old pool.
        old, self._conn = self._conn, self._new_conn()
        self._retired = [c for c in self._retired if not c.session.closed]
        if old is not None:
            old.retired = True
            if old.inflight == 0:
                await old.session.close()
            else:
                self._retired.append(old)
        rotated = csr_key is not None
        key_pem = ca.key_pem(new_key).decode() if rotated else None

        def update(b: AgentBundle) -> AgentBundle:
            if key_pem is None:
                return dataclasses.replace(b, agent_cert=pem)
            return dataclasses.replace(b, agent_cert=pem, agent_key=key_pem, agent_key_file=None)

        async with self._bundle_lock():
            await self._persist(update, "the renewed certificate")
        serial = ca.serial_hex(cert.serial_number)
        log.info(
            "agent certificate renewed for %s: serial %s valid until %s%s",
            self._agent_id,
            serial,
            cert.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
            " (new key)" if rotated else "",
        )
        return RenewedCertificate(serial=serial, not_after=cert.not_valid_after_utc, certificate=pem, new_key=rotated)
