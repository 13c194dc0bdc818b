"""Refused TLS handshakes: one log line each (rate-limited) and a labelled counter.

A client that fails the handshake (foreign certificate, wrong purpose, TLS 1.2 or older, plain
HTTP sent to the TLS port), or whose certificate of our CA is refused once the handshake is done
(revoked, expired, not yet valid: :class:`gateway.remote.tls.CertRefused`, told by the registry's
``check_peer``), is never silent for the operator.
:class:`HandshakeLog` is told of each by the listener's
:class:`gateway.remote.transport.ConnectionRegistry` (``on_handshake_failed``) and

* counts it in ``uomp_gateway_tls_handshakes_rejected_total{listener, reason}``;
* logs one line: ``TLS handshake refused on mtls from 203.0.113.7: unknown_ca (unable to get local
  issuer certificate)``, or for a certificate of ours ``TLS client certificate refused on mtls from
  203.0.113.7: revoked (agent mail_agent, serial 0x3f...)``,
  at most ``per_second`` lines a second after a burst of ``burst`` (a handshake flood must not
  become a log flood); the lines not written are counted and reported in the next line written.

* and, with ``events`` (the gateway's :class:`gateway.remote.event_sink.EventSink`), writes one
  ``tls_handshake`` event into the guard's one log: ``allowed`` false, code
  ``TLS_HANDSHAKE_REFUSED``, ``detail`` the reason label, ``reason`` OpenSSL's words, ``listener``,
  ``client`` (address), and for a certificate of ours ``agent_id`` and ``cert_serial``. Rate-limited
  per client address like every event without a session (beyond the rate: counted, and the count
  is an event).

``reason`` is one of :data:`REASONS`. A certificate refused by OpenSSL cannot be named: Python's
``ssl`` module gives no access to a peer certificate whose verification failed (no verify callback,
and ``getpeercert`` needs a finished handshake). That is why time and revocation are not checked by
OpenSSL (:mod:`gateway.remote.tls`): those certificates finish the handshake and are named here.
Plain HTTP on the TLS port also gets a short plain-text 400 answer saying "use https://" (transport.py).
No log line carries bytes the client sent: only the address, the label and OpenSSL's message.
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import Any, Protocol

from gateway.errors import UompError
from gateway.remote.tls import CertRefused

log = logging.getLogger("uomp.gateway")

REASONS = (
    "revoked",
    "expired",
    "not_yet_valid",
    "ca_invalid",
    "crl_expired",
    "unknown_ca",
    "bad_purpose",
    "cert_invalid",
    "tls_version",
    "plain_http",
    "no_certificate",
    "client_refused_server_cert",
    "other",
)

_VERIFY = {
    "certificate revoked": "revoked",
    "certificate has expired": "expired",
    "certificate is not yet valid": "not_yet_valid",
    "unable to get local issuer certificate": "unknown_ca",
    "unable to get issuer certificate": "unknown_ca",
    "self-signed certificate": "unknown_ca",
    "self signed certificate": "unknown_ca",
    "self-signed certificate in certificate chain": "unknown_ca",
    "self signed certificate in certificate chain": "unknown_ca",
    "unsuitable certificate purpose": "bad_purpose",
}
_REASON = {
    "UNSUPPORTED_PROTOCOL": "tls_version",
    "WRONG_VERSION_NUMBER": "tls_version",
    "NO_PROTOCOLS_AVAILABLE": "tls_version",
    "TLSV1_ALERT_PROTOCOL_VERSION": "tls_version",
    "HTTP_REQUEST": "plain_http",
    "HTTPS_PROXY_REQUEST": "plain_http",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "no_certificate",
    "TLSV1_ALERT_UNKNOWN_CA": "client_refused_server_cert",
    "SSLV3_ALERT_BAD_CERTIFICATE": "client_refused_server_cert",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "client_refused_server_cert",
}
_HINTS = {
    "plain_http": "; plain HTTP on the TLS port: the client must use https://",
    "tls_version": "; this gateway speaks TLS 1.3 only",
    "unknown_ca": "; the certificate is not from this appliance's agent CA",
    "revoked": "; the agent's certificate is on the CRL (uomp agent list); it is told so in a 401",
    "expired": "; it is told so in a 401",
    "not_yet_valid": "; it is told so in a 401 (check the clocks)",
    "ca_invalid": "; the agent CA is outside its validity period: renew the CA",
    "crl_expired": "; the CRL is past its nextUpdate: refresh it",
}


class Counter(Protocol):
    """Where refused handshakes are counted (the metrics)."""

    def tls_handshake_rejected(self, listener: str, reason: str) -> None: ...


class Events(Protocol):
    """Where refused handshakes are recorded (the one log)."""

    def append(self, event: dict[str, Any], *, source: str | None = None) -> Any: ...


HANDSHAKE_CODE = "TLS_HANDSHAKE_REFUSED"


def classify(exc: BaseException) -> tuple[str, str]:
    """``(reason label, OpenSSL's words)`` for a failed server-side handshake (the gateway's own
    words, naming the certificate, for a :class:`CertRefused`)."""
    if isinstance(exc, CertRefused):
        return exc.reason, f"agent {exc.identity.agent_id}, serial 0x{exc.identity.serial}"
    if isinstance(exc, UompError):  # chains to our CA, but is no agent's (no clientAuth EKU, no agent URI SAN)
        return "cert_invalid", exc.message
    if isinstance(exc, ssl.SSLCertVerificationError):
        msg = str(exc.verify_message or exc.reason or "certificate verification failed")
        return _VERIFY.get(msg, "cert_invalid"), msg
    reason = str(getattr(exc, "reason", "") or "")
    return _REASON.get(reason, "other"), (reason or type(exc).__name__)


def _retrieve(fut: Any) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("TLS handshake refusal could not be recorded (%s)", type(fut.exception()).__name__)


class HandshakeLog:
    """The ``on_handshake_failed`` hook of one listener (see the module docstring)."""

    def __init__(
        self, metrics: Counter, listener: str, *, per_second: float = 5.0, burst: int = 20, events: Events | None = None
    ) -> None:
        self.metrics = metrics
        self.events = events
        self.listener = listener
        self.per_second = max(0.0, float(per_second))
        self.burst = max(1, int(burst))
        self._tokens = float(self.burst)
        self._last = time.monotonic()
        self.suppressed = 0

    def __call__(self, exc: BaseException, ip: str) -> None:
        label, detail = classify(exc)
        self.metrics.tls_handshake_rejected(self.listener, label)
        ours = exc if isinstance(exc, CertRefused) else None
        if self.events is not None:
            # Named only when ours: Python's ssl does not show a certificate that failed verification.
            event: dict[str, Any] = {
                "action": "tls_handshake",
                "allowed": False,
                "code": HANDSHAKE_CODE,
                "detail": label,
                "reason": exc.message if isinstance(exc, UompError) else f"TLS handshake refused: {detail[:200]}",
                "listener": self.listener,
                "client": ip or None,
                "via": f"gateway:{self.listener}",
            }
            if ours is not None:
                event["agent_id"] = ours.identity.agent_id
                event["cert_serial"] = ours.identity.serial
            done = self.events.append(event, source=ip or "unknown")
            if done is not None and hasattr(done, "add_done_callback"):
                done.add_done_callback(_retrieve)
        now = time.monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.per_second)
        self._last = now
        if self._tokens < 1.0:
            self.suppressed += 1
            return
        self._tokens -= 1.0
        more = ""
        if self.suppressed:
            more = f" ({self.suppressed} more refused handshakes not logged; see the metric)"
            self.suppressed = 0
        log.warning(
            "TLS %s refused on %s from %s: %s (%s)%s%s",
            "client certificate" if isinstance(exc, UompError) else "handshake",
            self.listener,
            ip or "?",
            label,
            detail[:200],
            _HINTS.get(label, ""),
            more,
        )
