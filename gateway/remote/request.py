"""What one gateway request is made of: its route-table row (:class:`Route`), the request as it
goes through the checks (:class:`Call`), and what its TLS connection established already
(:class:`ConnMemo`)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway import httpd
from gateway.core import http1
from gateway.core.capability import Capability
from gateway.remote import pathnorm
from gateway.remote.routenames import Listener, RouteName, TokenUse
from gateway.remote.tls import ClientIdentity

Handler = Callable[["Call"], Awaitable[httpd.AnyResponse]]


@dataclass(frozen=True)
class Route:
    """One row of the gateway's route table. The metrics label and the audit ``action`` of a request
    are its ``name``; adding a route is one row (here or beside its handler) plus its handler."""

    method: str
    pattern: re.Pattern[str]
    name: RouteName
    reads: bool = False  # counts against max_read_queries (in the guard: the one quota counter)
    auth: bool = True
    token_use: TokenUse = "access"  # "access", "refresh", or "none" (transport identity alone)
    status_check: bool = True  # ask the Auth Service about the session before the handler
    transports: tuple[Listener, ...] = ("mtls", "tunnel")  # listeners the route exists on
    handler: Handler | None = None  # None: forwarded to the guard after every check (:func:`forward`)


@dataclass(slots=True)
class Call:
    """One request as it goes through the checks; becomes the ``gateway_access`` event."""

    request: httpd.Request
    # the listener app's GatewayState (``request.app[STATE]``), looked up once per request; typed
    # where it is read (this module must not import gateway.remote.state: the layering contract)
    state: Any
    route: Route | None = None
    target: pathnorm.Target | None = None
    params: dict[str, str] = field(default_factory=dict)
    identity: ClientIdentity | None = None
    via: str = "mtls"
    cap: Capability | None = None
    token: str | None = None
    token_digest: str | None = None  # SHA-256 (hex) of ``token``, sent to the guard
    endpoint: str | None = None  # host[:port] of this listener's endpoint the request addressed
    request_id: str = field(default_factory=lambda: "req_" + secrets.token_hex(8))
    key: str | None = None
    tag: str | None = None
    jkt: str | None = None
    recorded: bool = False
    memo: ConnMemo | None = None  # what this request's TLS connection established already (mTLS)
    # the connection's ``ssl_object`` extra, read once per request by peer_check (mTLS; None: not read)
    ssl_object: object = None
    # a client certificate of our CA refused (revoked, expired...): named in the event, never an identity
    refused: ClientIdentity | None = None
    # run (and awaited when they return an awaitable) once the token and the session passed their
    # checks: the DPoP proof is recorded then, in this process or in the replicas' shared state
    on_authenticated: list[Callable[[], Awaitable[None] | None]] = field(default_factory=list)

    def event(self, *, status: int, allowed: bool, reason: str, code: str | None) -> dict[str, Any]:
        """The request's event for the guard's one log (§18.1/§18.2 fields, listener, via, code)."""
        cap = self.cap
        ident = self.identity or self.refused
        return {
            "session_id": cap.session_id if cap else None,
            "agent_id": cap.agent_id if cap else (ident.agent_id if ident else None),
            "action": self.route.name if self.route else "unknown",
            "key": self.key,
            "tag": self.tag,
            "allowed": allowed,
            "reason": reason,
            "code": code,
            "method": self.request.method,
            "path": self.target.path if self.target else None,
            "status": status,
            "cert_serial": ident.serial if ident else None,
            "cert_fp": ident.x5t_s256 if ident else None,
            "listener": self.via,
            "via": f"gateway:mtls:{ident.serial}" if ident else f"gateway:{self.via}",
            "client": self.request.remote,
            "request_id": self.request_id,
        }


MEMO_ATTRIBUTE = "_uomp_gateway_memo"  # the ConnMemo's attribute on a connection's ssl.SSLObject
MAX_MEMO_CHECKS = 8  # (route use, endpoint, agent header, Host) combinations remembered per connection


class ConnMemo:
    """What one mTLS connection's earlier requests established, so its next requests skip the work
    whose answer cannot have changed (a keep-alive agent sends the same certificate and token each
    time), never a check whose answer can:

    * the certificate's parsed identity, for the DER the connection presents now (compared byte for
      byte on every request); its validity period and the CRL are checked again on every request;
    * the last token that passed verification and the shared checks on this connection, with the
      (route use, endpoint, agent header, Host) combinations it passed them for: reused only for
      the same token string, while the token's ``exp``/``expires_at`` lie ahead, and while the
      gateway's trusted keys and listener endpoints are those it was checked against
      (``GatewayState.generation``). Anything else goes through the full verification again.
    """

    __slots__ = (
        "block",
        "block_remote",
        "cap",
        "der",
        "digest",
        "generation",
        "identity",
        "not_after",
        "not_before",
        "passed",
        "token",
    )

    def __init__(self, der: bytes, identity: ClientIdentity) -> None:
        self.der = der
        self.identity = identity
        self.not_before = identity.not_before.timestamp()
        self.not_after = identity.not_after.timestamp()
        self.generation = -1
        self.token: str | None = None
        self.cap: Capability | None = None
        self.digest = ""
        self.passed: set[tuple[str, str | None, str | None, str]] = set()
        self.block: http1.HeaderBlock | None = None  # connection_assertion's lines for ``token``
        self.block_remote: str | None = None

    def remember(
        self, generation: int, token: str, cap: Capability, digest: str, key: tuple[str, str | None, str | None, str]
    ) -> None:
        if self.token != token or self.generation != generation:
            self.generation, self.token, self.cap, self.digest = generation, token, cap, digest
            self.passed = set()
            self.block = None
        if len(self.passed) >= MAX_MEMO_CHECKS:
            self.passed.clear()
        self.passed.add(key)
