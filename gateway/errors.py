"""The one error type of the project.

Every refusal carries a stable ``code`` (the spec §8.4 names, plus a few of ours) and an HTTP
status. The mapping code -> status lives here and nowhere else; the HTTP layers turn a
:class:`UompError` into the §8.4 body with :meth:`UompError.body`, the CLI prints
``code: message`` and exits non-zero.

Messages are written for people and must never contain a token, a key or a memory value:
callers pass fixed sentences and identifiers only.
"""

from __future__ import annotations

from typing import Any

# code -> HTTP status. Spec §8.4 codes first, then ours (documented in README "Error codes").
STATUS: dict[str, int] = {
    # spec §8.4
    "INVALID_TOKEN": 401,
    "TOKEN_EXPIRED": 401,
    "SESSION_REVOKED": 401,
    "ACCESS_DENIED": 403,
    "QUOTA_EXCEEDED": 429,
    "WRITE_NOT_AVAILABLE": 403,
    "STORE_UNAVAILABLE": 503,
    "SESSION_NOT_FOUND": 404,
    "INVALID_REQUEST": 400,
    # ours
    "UNAUTHORIZED": 401,  # management API without the user's admin credential
    "CERT_REQUIRED": 401,  # mTLS listener: no (acceptable) client certificate
    "AGENT_MISMATCH": 403,  # token agent != certificate agent != X-UOMP-Agent-Id
    "TOKEN_BINDING_MISMATCH": 401,  # cnf x5t#S256 / jkt does not match the presented key
    "DPOP_INVALID": 401,  # RFC 9449 proof missing or wrong
    "REFRESH_REUSED": 401,  # a spent refresh token came back: family revoked
    "NOT_FOUND": 404,  # no such route (never used for memory keys: those answer ACCESS_DENIED)
    "METHOD_NOT_ALLOWED": 405,
    "PAYLOAD_TOO_LARGE": 413,
    "NOT_IMPLEMENTED": 501,
    "INVALID_STATE": 409,  # session transition not allowed from its current state
    "STORE_BUSY": 503,  # a database stayed locked by another process past its bounded wait: retry shortly
    "UPSTREAM_ERROR": 502,
    "UPSTREAM_TIMEOUT": 504,
    "CONFIG_ERROR": 500,
    "KEY_ERROR": 500,  # a key file is missing, unreadable or malformed
    "IMPORT_INVALID": 400,
    "MANIFEST_INVALID": 400,
    "CA_ERROR": 400,
    "RENEWAL_TOO_EARLY": 409,  # certificate renewal before the last part of the certificate's life
    "RATE_LIMITED": 429,  # too many certificate renewals for one agent in the configured window
    "UNSAFE_PERMISSIONS": 500,  # data directory owned by someone else or group/other-writable
    "ANCHOR_UNAVAILABLE": 503,  # chain RPC unreachable, timed out or not final yet: retry later
    "ANCHOR_REJECTED": 502,  # the chain refused or reverted the anchor (not retryable as is)
    "ANCHOR_MISMATCH": 409,  # the chain does not show the anchor that was claimed
    "INTERNAL": 500,
    # payload relay (gateway/payloads/store.py, gateway/remote/payload_routes.py)
    "PAYLOAD_HASH_MISMATCH": 400,  # the ciphertext received is not what the envelope's hash names
    "PAYLOAD_SIZE_MISMATCH": 400,  # the ciphertext received is not as long as the envelope's size
    "PAYLOAD_EXISTS": 409,  # a payload with this payload_id is already stored
    "PAYLOAD_QUOTA_EXCEEDED": 429,  # this session already has too many payloads (or bytes) waiting
    "PAYLOAD_STORE_FULL": 507,  # the payload store's disk is full; nothing was kept
    "UPLOAD_URL_INVALID": 403,  # a single-use upload URL that is unknown, spent or expired
    "PAYLOAD_INVALID": 400,  # a sealed payload that does not open: wrong key, tampered, truncated
    # CLI-side (``uomp`` prints ``error CODE: what happened; what to do``)
    "ALREADY_RUNNING": 409,  # an appliance already holds this data directory's lock
    "PORT_IN_USE": 500,  # a listener's port is taken (or not allowed)
    "HOME_UNWRITABLE": 500,  # the data directory cannot be created or written
    "IO_ERROR": 500,  # a file could not be read or written
    "USAGE": 400,  # bad command-line arguments
    "TUNNEL_ERROR": 500,  # the tunnel cannot be set up as configured
}


class UompError(Exception):
    """A refusal or failure with a stable code.

    ``session_id`` is echoed in the §8.4 body when known; ``details`` carries extra,
    non-secret, machine-readable facts (row numbers of a bad import, for example).
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        session_id: str | None = None,
        details: dict[str, Any] | None = None,
        status: int | None = None,
    ) -> None:
        if code not in STATUS:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.session_id = session_id
        self.details = details
        self.status = status if status is not None else STATUS[code]

    def body(self) -> dict[str, Any]:
        """The spec §8.4 error body."""
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.session_id:
            err["session_id"] = self.session_id
        if self.details:
            err["details"] = self.details
        return {"error": err}


def error_body(code: str, message: str, session_id: str | None = None) -> dict[str, Any]:
    """Shortcut for places that build a body without raising."""
    return UompError(code, message, session_id=session_id).body()
