"""The agent SDK's options, shared types and constants (:class:`ClientOptions`, :data:`Mode`,
:class:`RenewedCertificate`, the limits and retry rules the client's parts share).

:class:`~gateway.client.sdk.UompClient` is built from parts, one module each: :mod:`.transport`
(URLs, TLS, the connection pools, one HTTP exchange), :mod:`.tokens` (token times, refresh, the
bundle file and its lock), :mod:`.certs` (the agent certificate and its renewal).
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any, Literal

from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from gateway.client.errors import ConfigError

log = logging.getLogger("uomp.client")

Mode = Literal["mtls", "dpop", "bearer"]
AgentKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
JSONObject = dict[str, Any]

LOCAL_BASE_URL = "http://127.0.0.1:9374"
# Characters left unescaped in a path segment: the gateway's canonical spelling (pathnorm.SEGMENT_SAFE).
SEGMENT_SAFE = "!$&'()*+,;=:@-._~"
AGGREGATE_OPS = ("sum", "avg", "count", "min", "max")
READ_CHUNK = 64 * 1024
# A refresh that got no answer is tried again on these (see _post_refresh).
RETRY_REFRESH_CODES = ("TIMEOUT", "CONNECTION_FAILED", "CONNECTION_CLOSED")
RETRY_REFRESH_STATUSES = (502, 503, 504)
# A payload upload that got no answer, or an answer that says the relay may yet accept it, is sent
# again: the same sealed envelope (payload_id and bytes), which the relay answers idempotently.
RETRY_UPLOAD_CODES = RETRY_REFRESH_CODES
RETRY_UPLOAD_STATUSES = RETRY_REFRESH_STATUSES
# Recently held tokens, scrubbed from any message the gateway sends back.
REMEMBERED_SECRETS = 8


@dataclass(frozen=True)
class ClientOptions:
    """Limits and schedules, each with its unit."""

    timeout_seconds: float = 30.0  # one call, from connecting to the last byte of the answer
    connect_timeout_seconds: float = 10.0  # TCP connect + TLS handshake
    max_response_bytes: int = 8 * 1024 * 1024  # answers larger than this are refused (RESPONSE_TOO_LARGE)
    refresh_before_seconds: float = 60.0  # refresh when less than this is left of the access token ...
    refresh_before_fraction: float = 0.2  # ... or less than this share of its life (never more than half)
    renew_at_fraction: float = 2 / 3  # renew the certificate once this share of its life has passed
    renew_retry_seconds: float = 60.0  # after a failed automatic renewal, wait this long before the next try
    lock_timeout_seconds: float = 30.0  # wait at most this long for another process refreshing the bundle
    max_connections: int = 16  # connection pool size
    refresh_retry_attempts: int = 6  # a refresh that got no answer (closed, timed out, 502/503/504) is tried again
    refresh_retry_initial_seconds: float = 0.5  # first back-off, doubled after each try ...
    refresh_retry_max_seconds: float = 8.0  # ... up to this (docs/security.md "Refresh rule")
    payload_timeout_seconds: float = 1800.0  # one streamed payload upload, start to answer
    # an upload that got no answer (closed, timed out, 502/503/504) is sent again, the same sealed
    # bytes under the same payload_id, at most this many tries in all (back-off: refresh_retry_*)
    payload_retry_attempts: int = 4

    def __post_init__(self) -> None:
        if self.timeout_seconds <= 0 or self.connect_timeout_seconds <= 0 or self.max_response_bytes <= 0:
            raise ConfigError("CONFIG_ERROR", "time-outs and the response size limit must be positive")
        if not 0 < self.renew_at_fraction < 1 or not 0 <= self.refresh_before_fraction < 1:
            raise ConfigError("CONFIG_ERROR", "renew_at_fraction and refresh_before_fraction must lie in (0, 1)")
        if (
            self.refresh_retry_attempts < 1
            or self.payload_retry_attempts < 1
            or not 0 <= self.refresh_retry_initial_seconds <= self.refresh_retry_max_seconds
        ):
            raise ConfigError(
                "CONFIG_ERROR",
                "refresh_retry_attempts and payload_retry_attempts must be >= 1 and the back-off 0 <= initial <= max",
            )


@dataclass(frozen=True)
class RenewedCertificate:
    """What :meth:`UompClient.renew_certificate` got (public facts only)."""

    serial: str
    not_after: dt.datetime
    certificate: str  # PEM
    new_key: bool
