"""The UOMP agent SDK (Python): mTLS or DPoP to the gateway, automatic refresh and renewal.

See :mod:`gateway.client.sdk` for the transports, the refresh and renewal rules, and what is
written back to the agent bundle; :mod:`gateway.client.errors` for the error classes.
"""

from gateway.client.errors import (
    AccessDenied,
    AuditCheckpointInvalid,
    AuditLogError,
    AuditLogForked,
    AuthError,
    CertificateError,
    ConfigError,
    InvalidRequest,
    PayloadRejected,
    ProtocolError,
    QuotaExceeded,
    Unavailable,
    UompClientError,
)
from gateway.client.options import AGGREGATE_OPS, ClientOptions, Mode, RenewedCertificate
from gateway.client.sdk import UompClient, memory_hash

__all__ = [
    "AGGREGATE_OPS",
    "AccessDenied",
    "AuditCheckpointInvalid",
    "AuditLogError",
    "AuditLogForked",
    "AuthError",
    "CertificateError",
    "ClientOptions",
    "ConfigError",
    "InvalidRequest",
    "Mode",
    "PayloadRejected",
    "ProtocolError",
    "QuotaExceeded",
    "RenewedCertificate",
    "Unavailable",
    "UompClient",
    "UompClientError",
    "memory_hash",
]
