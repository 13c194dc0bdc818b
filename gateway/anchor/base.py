"""The anchoring seam: what an anchor is, what a backend does with it, and how it fails.

An :class:`Anchor` is one signed audit checkpoint (RFC 9162 root, tree size, and the SHA-256 of
the signed checkpoint note) plus, optionally, the spec §18.4.1 events it covers, each reduced to
the hashes the spec names (:mod:`gateway.anchor.encoding` computes them). Nothing else: no memory
key, value or payload plaintext can be expressed in it.

An :class:`AnchorBackend` writes anchors to a chain and reads them back:

* ``submit(anchor)`` sends it (idempotent: an anchor already on chain is found, not sent again)
  and returns a :class:`Submitted` (the transaction hash);
* ``status(submitted)`` says how far it got (:class:`Confirmation`);
* ``verify(anchor, receipt_ref)`` re-reads the chain (receipt and event log) and raises
  :class:`AnchorMismatch` unless it shows exactly this anchor;
* ``find(anchor)`` looks for the anchor on chain (after a crash between send and record);
* ``check_contract()`` checks, from the chain, that the node is on the configured chain and the
  configured address holds the expected contract code (AnchorMismatch / AnchorRejected if not);
* ``describe()`` names the chain, contract and account (never a key or a secret URL).

The anchor's id is its checkpoint hash: a checkpoint is anchored at most once per contract.
Methods are coroutines; they never block the event loop for long (RPC is async I/O, signing is
microseconds), but a caller on a request path should still run anchoring in its own task.
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Concatenate, Literal, ParamSpec, Protocol, TypeVar, runtime_checkable

from gateway.anchor.encoding import HASH_SIZE, checkpoint_hash
from gateway.errors import ErrorCode, UompError

MAX_TREE_SIZE = (1 << 64) - 1  # uint64 on chain
MAX_EXPIRES_AT = (1 << 64) - 1  # Unix seconds; the contract field is uint256, we bound it lower
MAX_EVENTS_PER_ANCHOR = 256  # all kinds together; more must be split over checkpoints
MAX_INFLIGHT = 1024  # transactions a backend remembers for resubmission (oldest forgotten first)


class AnchorError(UompError):
    """Base of the anchoring errors. ``retryable``: the same call may succeed later as it is."""

    retryable = False


class AnchorUnavailable(AnchorError):
    """The chain could not be reached (refused, timed out, answered an error), or not final yet."""

    retryable = True

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ANCHOR_UNAVAILABLE, message)


class AnchorRejected(AnchorError):
    """The chain (or the backend's own checks) refused the anchor: reverted, not the owner,
    out of funds, wrong chain id, malformed. Retrying the same thing will not help."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ANCHOR_REJECTED, message)


class AnchorMismatch(AnchorError):
    """``verify``: the chain does not show the claimed anchor (or shows a different one)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ANCHOR_MISMATCH, message)


def _check_hash(name: str, value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != HASH_SIZE:
        raise ValueError(f"{name} must be {HASH_SIZE} bytes")


@dataclass(frozen=True)
class SessionGranted:
    """§18.4.1 SessionGranted: hashes of the session and agent, and when the grant ends."""

    session_hash: bytes
    agent_hash: bytes
    expires_at: int  # Unix seconds

    def __post_init__(self) -> None:
        _check_hash("session_hash", self.session_hash)
        _check_hash("agent_hash", self.agent_hash)
        if isinstance(self.expires_at, bool) or not 0 <= self.expires_at <= MAX_EXPIRES_AT:
            raise ValueError("expires_at must be Unix seconds in [0, 2**64)")


@dataclass(frozen=True)
class SessionRevoked:
    """§18.4.1 SessionRevoked: hashes of the session and agent."""

    session_hash: bytes
    agent_hash: bytes

    def __post_init__(self) -> None:
        _check_hash("session_hash", self.session_hash)
        _check_hash("agent_hash", self.agent_hash)


@dataclass(frozen=True)
class GatewayAccess:
    """§18.4.1 GatewayAccess: hashes of the session, agent and endpoint, and whether it was allowed."""

    session_hash: bytes
    agent_hash: bytes
    endpoint_hash: bytes
    allowed: bool

    def __post_init__(self) -> None:
        _check_hash("session_hash", self.session_hash)
        _check_hash("agent_hash", self.agent_hash)
        _check_hash("endpoint_hash", self.endpoint_hash)
        if not isinstance(self.allowed, bool):
            raise ValueError("allowed must be a bool")


@dataclass(frozen=True)
class PayloadAnchored:
    """§18.4.1 PayloadAnchored: hashes of the payload, session and agent."""

    payload_hash: bytes
    session_hash: bytes
    agent_hash: bytes

    def __post_init__(self) -> None:
        _check_hash("payload_hash", self.payload_hash)
        _check_hash("session_hash", self.session_hash)
        _check_hash("agent_hash", self.agent_hash)


@dataclass(frozen=True)
class DataDeletionProofSubmitted:
    """§18.4.1 DataDeletionProofSubmitted: hashes of the session, agent and deletion proof."""

    session_hash: bytes
    agent_hash: bytes
    deletion_proof_hash: bytes

    def __post_init__(self) -> None:
        _check_hash("session_hash", self.session_hash)
        _check_hash("agent_hash", self.agent_hash)
        _check_hash("deletion_proof_hash", self.deletion_proof_hash)


@dataclass(frozen=True)
class Anchor:
    """One checkpoint and the §18.4.1 events it carries, grouped by kind (the order on chain)."""

    root: bytes
    tree_size: int
    checkpoint_hash: bytes
    granted: tuple[SessionGranted, ...] = ()
    revoked: tuple[SessionRevoked, ...] = ()
    access: tuple[GatewayAccess, ...] = ()
    payloads: tuple[PayloadAnchored, ...] = ()
    deletions: tuple[DataDeletionProofSubmitted, ...] = ()
    # A verifier that knows the checkpoint but not which §18.4.1 events its transaction carried (a
    # proof bundle): ``verify`` then checks the CheckpointAnchored event and only the kinds of the others.
    checkpoint_only: bool = False

    def __post_init__(self) -> None:
        _check_hash("root", self.root)
        _check_hash("checkpoint_hash", self.checkpoint_hash)
        if isinstance(self.tree_size, bool) or not isinstance(self.tree_size, int):
            raise ValueError("tree_size must be an integer")
        if not 0 <= self.tree_size <= MAX_TREE_SIZE:
            raise ValueError("tree_size must fit in uint64")
        kinds: tuple[tuple[tuple[object, ...], type], ...] = (
            (self.granted, SessionGranted),
            (self.revoked, SessionRevoked),
            (self.access, GatewayAccess),
            (self.payloads, PayloadAnchored),
            (self.deletions, DataDeletionProofSubmitted),
        )
        for items, kind in kinds:
            if not isinstance(items, tuple) or not all(type(e) is kind for e in items):
                raise ValueError(f"events must be a tuple of {kind.__name__}")
        if self.event_count > MAX_EVENTS_PER_ANCHOR:
            raise ValueError(f"more than {MAX_EVENTS_PER_ANCHOR} events in one anchor")
        if self.checkpoint_only and self.event_count:
            raise ValueError("a checkpoint-only anchor names no events")

    @property
    def anchor_id(self) -> bytes:
        """The idempotency key: the checkpoint hash (one checkpoint is anchored once)."""
        return self.checkpoint_hash

    @property
    def event_count(self) -> int:
        return len(self.granted) + len(self.revoked) + len(self.access) + len(self.payloads) + len(self.deletions)

    @classmethod
    def for_checkpoint(cls, signed_note: str, **events: Any) -> Anchor:
        """The anchor of a signed C2SP checkpoint note (origin, size, base64 root, ... signatures).

        Reads the size and root lines only; checking the note's signature is the caller's job
        (gateway.core.checkpoint). ``events``: the keyword fields ``granted`` ... ``deletions``.
        """
        lines = signed_note.split("\n")
        if len(lines) < 4 or "\n\n" not in signed_note:
            raise ValueError("not a signed checkpoint note")
        size_s, root_b64 = lines[1], lines[2]
        if not size_s.isascii() or not size_s.isdigit() or (len(size_s) > 1 and size_s[0] == "0"):
            raise ValueError("checkpoint tree size is not a decimal")
        try:
            root = base64.b64decode(root_b64, validate=True)
        except binascii.Error:
            raise ValueError("checkpoint root is not base64") from None
        return cls(root=root, tree_size=int(size_s), checkpoint_hash=checkpoint_hash(signed_note), **events)


@dataclass(frozen=True)
class Submitted:
    """What ``submit`` returns; the caller records it durably before relying on it."""

    backend: str
    anchor_id: bytes  # = anchor.checkpoint_hash
    ref: str  # transaction hash, 0x-hex ("" for the none backend)
    nonce: int | None = None  # the account nonce the transaction used, when known
    found_on_chain: bool = False  # submit found the anchor already on chain and sent nothing


ConfirmationState = Literal["not_anchored", "pending", "confirmed", "failed", "dropped"]


@dataclass(frozen=True)
class Confirmation:
    """``pending``: sent, in no block yet. ``confirmed``: in a block, ``confirmations`` deep
    (1 = in the newest block); ``final`` once that reaches the backend's configured depth.
    ``failed``: included but reverted. ``dropped``: the node knows no such transaction (resubmit).
    ``not_anchored``: the none backend (signed checkpoints only)."""

    state: ConfirmationState
    confirmations: int = 0
    final: bool = False
    block_number: int | None = None
    ref: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class AnchorBackend(Protocol):
    """What anchoring needs of a chain: submit an anchor, read its confirmation, check it on the chain."""

    name: str

    async def submit(self, anchor: Anchor) -> Submitted: ...

    async def status(self, submitted: Submitted) -> Confirmation: ...

    async def verify(self, anchor: Anchor, receipt_ref: str) -> None: ...

    async def find(self, anchor: Anchor) -> str | None: ...

    async def check_contract(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


_P = ParamSpec("_P")
_R = TypeVar("_R")


class _HasWhere(Protocol):
    @property
    def _where(self) -> str: ...


_S = TypeVar("_S", bound=_HasWhere)


def answers_checked(
    fn: Callable[Concatenate[_S, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[_S, _P], Coroutine[Any, Any, _R]]:
    """A node's malformed answer (missing fields, wrong types, undecodable values) becomes
    AnchorUnavailable naming the node, never a stray KeyError/TypeError from a backend method."""

    @functools.wraps(fn)
    async def wrapper(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await fn(self, *args, **kwargs)
        except AnchorError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise AnchorUnavailable(f"chain RPC {self._where} gave an unusable answer ({type(exc).__name__})") from None

    return wrapper


def check_rpc_url(url: str) -> None:
    """An http(s) URL with a host, or ValueError (never echoing the URL: it may carry a key)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # raises on a malformed port
    except ValueError:
        ok = False
    if not ok:
        raise ValueError("rpc_url must be an http:// or https:// URL with a host")


def plain_http_remote(url: str) -> bool:
    """True when ``url`` is plain ``http://`` to a host that is not loopback: anyone on the path
    can then answer for the chain (the appliance still checks every answer, but can be stalled)."""
    import ipaddress
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return False
    if parts.scheme != "http":
        return False
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def redact_url(url: str) -> str:
    """``scheme://host:port`` of an RPC URL: paths and queries often carry API keys."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid url>"
    return f"{parts.scheme}://{host}{port}"
