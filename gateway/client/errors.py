"""Errors the agent SDK raises: one base class, one subclass per family of spec §8.4 codes.

Every refusal the gateway sends is a §8.4 body ``{"error": {"code", "message", "session_id"}}``;
:func:`error_from_answer` turns it into the subclass for its code, keeping ``code``, ``message``,
the HTTP ``status`` and ``session_id``. Failures that never reached an answer (time-outs, refused
TLS handshakes, an expired certificate noticed locally, a bad bundle) get SDK codes of their own,
listed with their class below.

A message never contains a token or a key: the SDK builds its own messages from fixed sentences,
and scrubs any secret it holds out of a message it received before it keeps it (defence in depth:
the gateway never echoes one either).

=========================  =====================================================================
class                      codes
=========================  =====================================================================
:class:`AuthError`         INVALID_TOKEN, TOKEN_EXPIRED, SESSION_REVOKED, SESSION_NOT_FOUND,
                           REFRESH_REUSED, TOKEN_BINDING_MISMATCH, DPOP_INVALID, AGENT_MISMATCH,
                           UNAUTHORIZED
:class:`CertificateError`  CERT_REQUIRED, CA_ERROR (renewal refused); SDK: CERT_EXPIRED,
(an AuthError)             TLS_HANDSHAKE_FAILED, SERVER_CERT_INVALID
:class:`AccessDenied`      ACCESS_DENIED, WRITE_NOT_AVAILABLE
:class:`QuotaExceeded`     QUOTA_EXCEEDED
:class:`InvalidRequest`    INVALID_REQUEST, NOT_FOUND, METHOD_NOT_ALLOWED, PAYLOAD_TOO_LARGE,
                           NOT_IMPLEMENTED, INVALID_STATE, AGGREGATE_MIXED_CURRENCY, and any
                           other 4xx
:class:`Unavailable`       STORE_UNAVAILABLE, UPSTREAM_ERROR, UPSTREAM_TIMEOUT, INTERNAL, any
                           other 5xx; SDK: TIMEOUT, CONNECTION_FAILED, CONNECTION_CLOSED
                           (the gateway closed the connection before answering: it
                           stopped or restarted; not a certificate refusal), LOCK_TIMEOUT
:class:`PayloadRejected`   PAYLOAD_HASH_MISMATCH, PAYLOAD_SIZE_MISMATCH, PAYLOAD_EXISTS,
(an InvalidRequest)        UPLOAD_URL_INVALID (an upload refused for what was sent);
                           PAYLOAD_QUOTA_EXCEEDED is a QuotaExceeded, PAYLOAD_STORE_FULL Unavailable
:class:`ProtocolError`     SDK: BAD_RESPONSE, RESPONSE_TOO_LARGE
:class:`ConfigError`       CONFIG_ERROR (bundle, URL, mode, key file)
:class:`AuditLogError`     SDK: AUDIT_LOG_INCONSISTENT (:class:`AuditLogForked`: the log does not extend
                           the kept checkpoint), AUDIT_CHECKPOINT_INVALID (:class:`AuditCheckpointInvalid`)
=========================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MAX_MESSAGE_CHARS = 500
REDACTED = "[redacted]"


class UompClientError(Exception):
    """Base class of every SDK error: a stable ``code``, a human ``message``, the HTTP ``status``
    (None when no answer arrived) and the ``session_id`` when known."""

    def __init__(self, code: str, message: str, status: int | None = None, session_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.session_id = session_id

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, status={self.status!r}, "
            f"session_id={self.session_id!r})"
        )


class AuthError(UompClientError):
    """The token, the session or the proof of possession was refused."""


class CertificateError(AuthError):
    """The agent's client certificate (or the gateway's) is not acceptable: expired, revoked,
    refused in the handshake, or a renewal was refused."""


class AccessDenied(UompClientError):
    """The request is outside the granted scope."""


class QuotaExceeded(UompClientError):
    """The session's read quota is exhausted."""


class InvalidRequest(UompClientError):
    """The request was malformed or names no endpoint."""


class PayloadRejected(InvalidRequest):
    """A payload upload refused for what was sent: hash or size not as declared, id taken, upload URL
    spent or expired."""


class Unavailable(UompClientError):
    """The gateway or the store behind it could not answer (or did not answer in time)."""


class ProtocolError(UompClientError):
    """The gateway's answer was not what the protocol says (not JSON, too large, wrong shape)."""


class ConfigError(UompClientError):
    """The client's own configuration is unusable: bundle, URL, mode, key."""


class AuditLogError(UompClientError):
    """The gateway's audit log failed a check this agent made itself (docs/audit.md "Agents as witnesses")."""


class AuditLogForked(AuditLogError):
    """``AUDIT_LOG_INCONSISTENT``: the log shown now is not an extension of the checkpoint this agent
    verified and kept (rolled back, forked, or the consistency proof does not hold). The kept
    checkpoint is not replaced: keep it as evidence and tell the user."""


class AuditCheckpointInvalid(AuditLogError):
    """``AUDIT_CHECKPOINT_INVALID``: a checkpoint not signed by the audit key this agent trusts (the
    bundle's ``audit_verifier_key``, else the first one it saw), or malformed."""


CODE_CLASSES: dict[str, type[UompClientError]] = {
    **dict.fromkeys(
        (
            "INVALID_TOKEN",
            "TOKEN_EXPIRED",
            "SESSION_REVOKED",
            "SESSION_NOT_FOUND",
            "REFRESH_REUSED",
            "TOKEN_BINDING_MISMATCH",
            "DPOP_INVALID",
            "AGENT_MISMATCH",
            "UNAUTHORIZED",
        ),
        AuthError,
    ),
    **dict.fromkeys(
        ("CERT_REQUIRED", "CA_ERROR", "CERT_EXPIRED", "TLS_HANDSHAKE_FAILED", "SERVER_CERT_INVALID"), CertificateError
    ),
    **dict.fromkeys(("ACCESS_DENIED", "WRITE_NOT_AVAILABLE"), AccessDenied),
    "QUOTA_EXCEEDED": QuotaExceeded,
    **dict.fromkeys(
        (
            "INVALID_REQUEST",
            "NOT_FOUND",
            "METHOD_NOT_ALLOWED",
            "PAYLOAD_TOO_LARGE",
            "NOT_IMPLEMENTED",
            "INVALID_STATE",
            "AGGREGATE_MIXED_CURRENCY",
        ),
        InvalidRequest,
    ),
    **dict.fromkeys(
        (
            "STORE_UNAVAILABLE",
            "UPSTREAM_ERROR",
            "UPSTREAM_TIMEOUT",
            "INTERNAL",
            "TIMEOUT",
            "CONNECTION_FAILED",
            "CONNECTION_CLOSED",
            "LOCK_TIMEOUT",
        ),
        Unavailable,
    ),
    **dict.fromkeys(("BAD_RESPONSE", "RESPONSE_TOO_LARGE"), ProtocolError),
    "CONFIG_ERROR": ConfigError,
    "AUDIT_LOG_INCONSISTENT": AuditLogForked,
    "AUDIT_CHECKPOINT_INVALID": AuditCheckpointInvalid,
    **dict.fromkeys(
        ("PAYLOAD_HASH_MISMATCH", "PAYLOAD_SIZE_MISMATCH", "PAYLOAD_EXISTS", "UPLOAD_URL_INVALID"), PayloadRejected
    ),
    "PAYLOAD_QUOTA_EXCEEDED": QuotaExceeded,
    "PAYLOAD_STORE_FULL": Unavailable,
}


def _class_for_status(status: int | None) -> type[UompClientError]:
    if status is None:
        return Unavailable
    if status == 401:
        return AuthError
    if status == 403:
        return AccessDenied
    if status == 429:
        return QuotaExceeded
    if status >= 500:
        return Unavailable
    return InvalidRequest


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every secret replaced by ``[redacted]``, bounded to MAX_MESSAGE_CHARS."""
    for s in secrets:
        if s and len(s) >= 8:
            text = text.replace(s, REDACTED)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + "..."
    return text


def make_error(code: str, message: str, status: int | None = None, session_id: str | None = None) -> UompClientError:
    """The subclass for ``code`` (by status when the code is unknown)."""
    cls = CODE_CLASSES.get(code) or _class_for_status(status)
    return cls(code, message, status, session_id)


def error_from_answer(
    status: int, body: Any, *, session_id: str | None, secrets: Iterable[str | None] = ()
) -> UompClientError:
    """The error for a non-2xx answer: from its §8.4 body when it has one, else from the status."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str) and err["code"]:
        code = err["code"][:64]
        raw_message = err.get("message")
        message = scrub(raw_message if isinstance(raw_message, str) else "refused", secrets)
        sid = err.get("session_id")
        return make_error(code, message, status, sid if isinstance(sid, str) else session_id)
    return make_error(
        f"HTTP_{status}", f"the gateway answered HTTP {status} without a UOMP error body", status, session_id
    )
