"""The one error type of the project.

Every refusal carries a stable ``code`` (the spec §8.4 names, plus a few of ours) and an HTTP
status. The mapping code -> status lives here and nowhere else; the HTTP layers turn a
:class:`UompError` into the §8.4 body with :meth:`UompError.body`, the CLI prints
``code: message`` and exits non-zero.

Messages are written for people and must never contain a token, a key or a memory value:
callers pass fixed sentences and identifiers only.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, TypeVar


class ErrorCode(StrEnum):
    """Every stable error code. A member is its own wire value (``str(ErrorCode.X) == "X"``),
    so JSON bodies are unchanged; a misspelt code is an attribute error that mypy reports."""

    # spec §8.4
    INVALID_TOKEN = "INVALID_TOKEN"
    TOKEN_EXPIRED = "TOKEN_EXPIRED"
    SESSION_REVOKED = "SESSION_REVOKED"
    ACCESS_DENIED = "ACCESS_DENIED"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    WRITE_NOT_AVAILABLE = "WRITE_NOT_AVAILABLE"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    INVALID_REQUEST = "INVALID_REQUEST"
    # ours
    UNAUTHORIZED = "UNAUTHORIZED"  # management API without the user's admin credential
    CERT_REQUIRED = "CERT_REQUIRED"  # mTLS listener: no (acceptable) client certificate
    AGENT_MISMATCH = "AGENT_MISMATCH"  # token agent != certificate agent != X-UOMP-Agent-Id
    TOKEN_BINDING_MISMATCH = "TOKEN_BINDING_MISMATCH"  # cnf x5t#S256 / jkt does not match the presented key
    DPOP_INVALID = "DPOP_INVALID"  # RFC 9449 proof missing or wrong
    REFRESH_REUSED = "REFRESH_REUSED"  # a spent refresh token came back: family revoked
    NOT_FOUND = "NOT_FOUND"  # no such route (never used for memory keys: those answer ACCESS_DENIED)
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    NOT_IMPLEMENTED = "NOT_IMPLEMENTED"
    INVALID_STATE = "INVALID_STATE"  # session transition not allowed from its current state
    STORE_BUSY = "STORE_BUSY"  # a database stayed locked by another process past its bounded wait: retry shortly
    UPSTREAM_ERROR = "UPSTREAM_ERROR"
    UPSTREAM_TIMEOUT = "UPSTREAM_TIMEOUT"
    CONFIG_ERROR = "CONFIG_ERROR"
    KEY_ERROR = "KEY_ERROR"  # a key file is missing, unreadable or malformed
    SECRETS_LOCKED = "SECRETS_LOCKED"  # the keys are sealed and no passphrase (or keychain) unlocked them
    PASSPHRASE_WRONG = "PASSPHRASE_WRONG"  # the passphrase does not open this home's sealed master key
    # a high-sensitivity item's sealed value does not open (moved, relabelled, another home's, damaged)
    ITEM_SEAL_INVALID = "ITEM_SEAL_INVALID"
    BACKUP_INVALID = "BACKUP_INVALID"  # a backup file that is damaged, truncated or not a UOMP backup
    BACKUP_KEY_WRONG = "BACKUP_KEY_WRONG"  # the backup is encrypted to another recipient, or to a passphrase / identity
    HOME_NOT_EMPTY = "HOME_NOT_EMPTY"  # a restore onto a data directory that already holds files
    IMPORT_INVALID = "IMPORT_INVALID"
    MANIFEST_INVALID = "MANIFEST_INVALID"
    CA_ERROR = "CA_ERROR"
    RENEWAL_TOO_EARLY = "RENEWAL_TOO_EARLY"  # certificate renewal before the last part of the certificate's life
    RATE_LIMITED = "RATE_LIMITED"  # too many renewals for one agent, or DPoP proofs from one key, in a window
    ENROLL_CODE_INVALID = (
        "ENROLL_CODE_INVALID"  # an enrollment code that is wrong, used, expired or for another manifest
    )
    ENROLL_DENIED = "ENROLL_DENIED"  # the user denied the enrollment request, or let it expire
    UNSAFE_PERMISSIONS = "UNSAFE_PERMISSIONS"  # data directory owned by someone else or group/other-writable
    NOT_INITIALISED = "NOT_INITIALISED"  # the data directory was never set up by `uomp init`
    ANCHOR_UNAVAILABLE = "ANCHOR_UNAVAILABLE"  # chain RPC unreachable, timed out or not final yet: retry later
    ANCHOR_REJECTED = "ANCHOR_REJECTED"  # the chain refused or reverted the anchor (not retryable as is)
    ANCHOR_MISMATCH = "ANCHOR_MISMATCH"  # the chain does not show the anchor that was claimed
    PROOF_PENDING = "PROOF_PENDING"  # the audit event is not in a signed checkpoint yet: retry shortly
    AUDIT_SIZE_UNKNOWN = "AUDIT_SIZE_UNKNOWN"  # a tree size beyond the log's newest signed checkpoint (since=)
    LOG_CORRUPT = "LOG_CORRUPT"  # the audit log's events and its Merkle tree disagree: run 'uomp audit verify'
    # the audit log is not the one its witness record (the latest signed checkpoint) saw: rolled back, forked, replaced
    AUDIT_LOG_INCONSISTENT = "AUDIT_LOG_INCONSISTENT"
    AUDIT_LOG_DAMAGED = "AUDIT_LOG_DAMAGED"  # the audit log fails its own checks (edited, deleted, unreadable)
    INTERNAL = "INTERNAL"
    # an aggregate of amounts in more than one currency (docs/aggregates.md "Currencies")
    AGGREGATE_MIXED_CURRENCY = "AGGREGATE_MIXED_CURRENCY"
    # a sum, average, min or max that would include high-sensitivity items (sealed per item, read by key only)
    AGGREGATE_HIGH_SENSITIVITY = "AGGREGATE_HIGH_SENSITIVITY"
    # payload relay (gateway/payloads/store.py, gateway/remote/payload_routes.py)
    PAYLOAD_HASH_MISMATCH = "PAYLOAD_HASH_MISMATCH"  # the ciphertext received is not what the envelope's hash names
    PAYLOAD_SIZE_MISMATCH = "PAYLOAD_SIZE_MISMATCH"  # the ciphertext received is not as long as the envelope's size
    PAYLOAD_EXISTS = "PAYLOAD_EXISTS"  # a payload with this payload_id is already stored
    PAYLOAD_QUOTA_EXCEEDED = "PAYLOAD_QUOTA_EXCEEDED"  # this session already has too many payloads (or bytes) waiting
    PAYLOAD_STORE_FULL = "PAYLOAD_STORE_FULL"  # the payload store's disk is full; nothing was kept
    UPLOAD_URL_INVALID = "UPLOAD_URL_INVALID"  # a single-use upload URL that is unknown, spent or expired
    PAYLOAD_INVALID = "PAYLOAD_INVALID"  # a sealed payload that does not open: wrong key, tampered, truncated
    # agent write proposals (gateway/guard/proposals.py, docs/writes.md)
    BUDGET_EXCEEDED = "BUDGET_EXCEEDED"  # a write budget is used up: details budget, used, limit, needed
    VERSION_CONFLICT = "VERSION_CONFLICT"  # the item is not at the version the proposal was based on
    APPROVAL_MISMATCH = "APPROVAL_MISMATCH"  # the change approved is not the change the proposal makes now
    # CLI-side (``uomp`` prints ``error CODE: what happened; what to do``)
    ALREADY_RUNNING = "ALREADY_RUNNING"  # an appliance already holds this data directory's lock
    PORT_IN_USE = "PORT_IN_USE"  # a listener's port is taken (or not allowed)
    HOME_UNWRITABLE = "HOME_UNWRITABLE"  # the data directory cannot be created or written
    IO_ERROR = "IO_ERROR"  # a file could not be read or written
    USAGE = "USAGE"  # bad command-line arguments
    TUNNEL_ERROR = "TUNNEL_ERROR"  # the tunnel cannot be set up as configured
    # agent registries (gateway/registry/, `uomp registry`)
    REGISTRY_UNKNOWN = "REGISTRY_UNKNOWN"  # no registry of that id is configured (uomp registry add)
    REGISTRY_UNAVAILABLE = "REGISTRY_UNAVAILABLE"  # the registry's chain is unreachable or answers nonsense
    FETCH_FAILED = "FETCH_FAILED"  # a registration file, manifest or DID document could not be fetched within the rules
    REGISTRATION_INVALID = "REGISTRATION_INVALID"  # a registration file that is malformed or names another agent
    CONTENT_HASH_MISMATCH = "CONTENT_HASH_MISMATCH"  # fetched bytes are not those whose hash the registry records
    # gateway replicas (gateway/remote/shared_state.py)
    SHARED_STATE_UNAVAILABLE = "SHARED_STATE_UNAVAILABLE"  # Redis unreachable: DPoP proofs are refused (fail closed)


# code -> HTTP status, once. Spec §8.4 codes first, then ours (documented in docs/errors.md).
STATUS: dict[ErrorCode, int] = {
    # spec §8.4
    ErrorCode.INVALID_TOKEN: 401,
    ErrorCode.TOKEN_EXPIRED: 401,
    ErrorCode.SESSION_REVOKED: 401,
    ErrorCode.ACCESS_DENIED: 403,
    ErrorCode.QUOTA_EXCEEDED: 429,
    ErrorCode.WRITE_NOT_AVAILABLE: 403,
    ErrorCode.STORE_UNAVAILABLE: 503,
    ErrorCode.SESSION_NOT_FOUND: 404,
    ErrorCode.INVALID_REQUEST: 400,
    # ours
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.CERT_REQUIRED: 401,
    ErrorCode.AGENT_MISMATCH: 403,
    ErrorCode.TOKEN_BINDING_MISMATCH: 401,
    ErrorCode.DPOP_INVALID: 401,
    ErrorCode.REFRESH_REUSED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.NOT_IMPLEMENTED: 501,
    ErrorCode.INVALID_STATE: 409,
    ErrorCode.STORE_BUSY: 503,
    ErrorCode.SHARED_STATE_UNAVAILABLE: 503,
    ErrorCode.UPSTREAM_ERROR: 502,
    ErrorCode.UPSTREAM_TIMEOUT: 504,
    ErrorCode.CONFIG_ERROR: 500,
    ErrorCode.KEY_ERROR: 500,
    ErrorCode.SECRETS_LOCKED: 503,
    ErrorCode.PASSPHRASE_WRONG: 401,
    ErrorCode.ITEM_SEAL_INVALID: 500,
    ErrorCode.BACKUP_INVALID: 400,
    ErrorCode.BACKUP_KEY_WRONG: 401,
    ErrorCode.HOME_NOT_EMPTY: 409,
    ErrorCode.IMPORT_INVALID: 400,
    ErrorCode.MANIFEST_INVALID: 400,
    ErrorCode.CA_ERROR: 400,
    ErrorCode.RENEWAL_TOO_EARLY: 409,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.ENROLL_CODE_INVALID: 403,
    ErrorCode.ENROLL_DENIED: 403,
    ErrorCode.UNSAFE_PERMISSIONS: 500,
    ErrorCode.NOT_INITIALISED: 500,
    ErrorCode.ANCHOR_UNAVAILABLE: 503,
    ErrorCode.ANCHOR_REJECTED: 502,
    ErrorCode.ANCHOR_MISMATCH: 409,
    ErrorCode.PROOF_PENDING: 409,
    ErrorCode.AUDIT_SIZE_UNKNOWN: 400,
    ErrorCode.LOG_CORRUPT: 500,
    ErrorCode.AUDIT_LOG_INCONSISTENT: 503,
    ErrorCode.AUDIT_LOG_DAMAGED: 503,
    ErrorCode.INTERNAL: 500,
    ErrorCode.AGGREGATE_MIXED_CURRENCY: 400,
    ErrorCode.AGGREGATE_HIGH_SENSITIVITY: 403,
    # payload relay (gateway/payloads/store.py, gateway/remote/payload_routes.py)
    ErrorCode.PAYLOAD_HASH_MISMATCH: 400,
    ErrorCode.PAYLOAD_SIZE_MISMATCH: 400,
    ErrorCode.PAYLOAD_EXISTS: 409,
    ErrorCode.PAYLOAD_QUOTA_EXCEEDED: 429,
    ErrorCode.PAYLOAD_STORE_FULL: 507,
    ErrorCode.UPLOAD_URL_INVALID: 403,
    ErrorCode.PAYLOAD_INVALID: 400,
    # agent write proposals
    ErrorCode.BUDGET_EXCEEDED: 429,
    ErrorCode.VERSION_CONFLICT: 409,
    ErrorCode.APPROVAL_MISMATCH: 409,
    # CLI-side (``uomp`` prints ``error CODE: what happened; what to do``)
    ErrorCode.ALREADY_RUNNING: 409,
    ErrorCode.PORT_IN_USE: 500,
    ErrorCode.HOME_UNWRITABLE: 500,
    ErrorCode.IO_ERROR: 500,
    ErrorCode.REGISTRY_UNKNOWN: 404,
    ErrorCode.REGISTRY_UNAVAILABLE: 503,
    ErrorCode.FETCH_FAILED: 502,
    ErrorCode.REGISTRATION_INVALID: 422,
    ErrorCode.CONTENT_HASH_MISMATCH: 409,
    ErrorCode.USAGE: 400,
    ErrorCode.TUNNEL_ERROR: 500,
}


def known_code(value: object) -> ErrorCode | None:
    """The :class:`ErrorCode` named by ``value`` (a string a peer sent in JSON), or None when it is none of ours.

    Codes that come in from outside (the guard's body seen by the gateway, the gateway's body seen by
    the CLI) pass through here or :func:`parse_code`; an unknown or non-string value never becomes an
    ``ErrorCode``.
    """
    if isinstance(value, str) and value in ErrorCode.__members__:
        return ErrorCode(value)
    return None


def parse_code(value: object, default: ErrorCode) -> ErrorCode:
    """:func:`known_code`, with ``default`` for a value that is not one of our codes."""
    code = known_code(value)
    return default if code is None else code


class UompError(Exception):
    """A refusal or failure with a stable code.

    The HTTP status is ``STATUS[code]``, always: there is no per-call override.
    ``session_id`` is echoed in the §8.4 body when known; ``details`` carries extra,
    non-secret, machine-readable facts (row numbers of a bad import, for example); ``reason``, a
    machine-readable word beside ``code`` where one code has several causes a client acts on
    differently (a refused client certificate: gateway/openapi.py's CERT_REFUSAL_REASONS).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        session_id: str | None = None,
        details: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> None:
        code = ErrorCode(code)  # an unknown string is a ValueError here, for callers mypy does not see
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.session_id = session_id
        self.details = details
        self.reason = reason
        self.status = STATUS[code]

    def body(self) -> dict[str, Any]:
        """The spec §8.4 error body."""
        err: dict[str, Any] = {"code": str(self.code), "message": self.message}
        if self.reason:
            err["reason"] = self.reason
        if self.session_id:
            err["session_id"] = self.session_id
        if self.details:
            err["details"] = self.details
        return {"error": err}


_E = TypeVar("_E", bound=BaseException)


def caused_by(err: _E, cause: BaseException | None) -> _E:
    """``err`` with ``cause`` as its ``__cause__`` (``None``: no cause, the context hidden):
    ``raise caused_by(err, exc)`` is ``raise err from exc``, which the compiled modules
    (:mod:`gateway.native`) must not write: mypyc drops a ``from`` clause."""
    err.__cause__ = cause
    return err
