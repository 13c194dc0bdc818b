"""What crosses between the remote gateway and the guard, written once (both sides import it).

Header names
    ``X-UOMP-Agent-Id`` (agent -> gateway -> guard), ``X-UOMP-Quota-Remaining`` (guard/gateway ->
    agent) and the ``X-UOMP-Verified-*`` identity headers, which only the gateway sets, on what it
    forwards over the guard's Unix socket.

The verified-identity headers (gateway -> guard)
    ``Agent``       the agent id the gateway checked (token == certificate/DPoP key == header);
    ``Via``         ``gateway:mtls:<cert serial>`` or ``gateway:<listener>`` (audit only);
    ``X5t``/``Jkt`` the thumbprints of the certificate / key the client proved it holds;
    ``Token``       the SHA-256 (hex) of exactly the token the gateway verified. The guard refuses a
                    request whose ``Authorization`` token hashes differently, so the two sides can
                    never act on different tokens.

    Audit only (one log: the guard writes the one event of a forwarded request and puts these in
    it; they decide nothing):
    ``Listener``    the gateway listener the request arrived on (``mtls`` or ``tunnel``);
    ``Client``      the client's address as the gateway saw it;
    ``Cert-Serial`` the serial (hex) of the client certificate (mTLS listener);
    ``Request-Id``  the gateway's id of the request.
    The guard answers a request whose event it wrote with :data:`EVENT_ID_HEADER` (the event's id);
    the gateway then writes nothing of its own for it, and never passes that header on.

    A client never sends any of them: the gateway refuses a request that carries one (400
    INVALID_REQUEST), the guard refuses them on its TCP listener, and on its Unix socket a
    request that carries one must carry the whole assertion (:data:`REQUIRED_VERIFIED`).

Single-valued headers
    Every header either side reads a single value from appears at most once, in any spelling or
    case, or the request is refused before anything else looks at it (:func:`header_problem`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable

AGENT_HEADER = "X-UOMP-Agent-Id"
QUOTA_HEADER = "X-UOMP-Quota-Remaining"

VERIFIED_PREFIX = "x-uomp-verified-"
VERIFIED_AGENT_HEADER = "X-UOMP-Verified-Agent"
VERIFIED_VIA_HEADER = "X-UOMP-Verified-Via"
VERIFIED_X5T_HEADER = "X-UOMP-Verified-X5t"
VERIFIED_JKT_HEADER = "X-UOMP-Verified-Jkt"
VERIFIED_TOKEN_HEADER = "X-UOMP-Verified-Token"
VERIFIED_LISTENER_HEADER = "X-UOMP-Verified-Listener"
VERIFIED_CLIENT_HEADER = "X-UOMP-Verified-Client"
VERIFIED_SERIAL_HEADER = "X-UOMP-Verified-Cert-Serial"
VERIFIED_REQUEST_ID_HEADER = "X-UOMP-Verified-Request-Id"
# guard -> gateway only (a response header): the id of the event the guard wrote for this request
EVENT_ID_HEADER = "X-UOMP-Event-Id"

# The guard's internal route for the events of requests the gateway answered alone (refusals,
# rejected TLS handshakes, spool replays): Unix socket only, never in the gateway's route table.
INTERNAL_EVENTS_PATH = "/v1/internal/events"
MAX_INTERNAL_EVENTS = 1000  # events per internal request
# Bytes of one internal request's body. The guard reads at most this much on that route (its own
# limit, not [guard] max_body_bytes) and refuses more with 413; the gateway packs its batches under
# it. Larger than one spooled event can be (gateway.remote.access_chain.MAX_EVENT_BYTES).
MAX_INTERNAL_EVENTS_BYTES = 1024 * 1024

# Every verified header the gateway may set (the guard refuses any other X-UOMP-Verified-* name).
VERIFIED_HEADERS = frozenset(
    h.lower()
    for h in (
        VERIFIED_AGENT_HEADER,
        VERIFIED_VIA_HEADER,
        VERIFIED_X5T_HEADER,
        VERIFIED_JKT_HEADER,
        VERIFIED_TOKEN_HEADER,
        VERIFIED_LISTENER_HEADER,
        VERIFIED_CLIENT_HEADER,
        VERIFIED_SERIAL_HEADER,
        VERIFIED_REQUEST_ID_HEADER,
    )
)
# The audit-only verified headers and the event field each becomes (bounded in length by the guard).
AUDIT_HEADERS = (
    (VERIFIED_LISTENER_HEADER, "listener"),
    (VERIFIED_CLIENT_HEADER, "client"),
    (VERIFIED_SERIAL_HEADER, "cert_serial"),
    (VERIFIED_X5T_HEADER, "cert_fp"),
    (VERIFIED_REQUEST_ID_HEADER, "request_id"),
)
# What a forwarded agent request always carries (X5t/Jkt as the listener proved them).
REQUIRED_VERIFIED = (VERIFIED_AGENT_HEADER, VERIFIED_VIA_HEADER, VERIFIED_TOKEN_HEADER)

# Client request headers the gateway copies upstream (lower-case). Authorization and
# X-UOMP-Agent-Id are not among them: the gateway writes those itself from what it verified.
FORWARD_REQUEST_HEADERS = ("content-type", "accept")
# Guard response headers passed back to the agent.
FORWARD_RESPONSE_HEADERS = ("content-type", "x-uomp-quota-remaining", "www-authenticate")

# Headers read as one value by the gateway or the guard (lower-case); every X-UOMP-* is too.
SINGLE_VALUED = frozenset(
    {
        "authorization",
        "dpop",
        "host",
        "content-length",
        "transfer-encoding",
        "content-type",
        "content-encoding",
    }
)
_SINGLE_VALUED_BYTES = frozenset(h.encode() for h in SINGLE_VALUED)
_UOMP_PREFIX = b"x-uomp-"
_VERIFIED_PREFIX_BYTES = VERIFIED_PREFIX.encode()


def header_problem(raw_headers: Iterable[tuple[bytes, bytes]], *, verified_allowed: bool) -> str | None:
    """Why these request headers must be refused, or None.

    ``raw_headers`` are the (name, value) pairs as received; names compare case-insensitively.
    ``verified_allowed`` is True only where the gateway's assertion is expected (the guard's Unix
    socket). One pass over the headers, no allocation for the common case beyond a small set.
    """
    seen: set[bytes] = set()
    for name, _value in raw_headers:
        low = name.lower()
        if low in _SINGLE_VALUED_BYTES or low.startswith(_UOMP_PREFIX):
            if low in seen:
                return f"header {low.decode('latin-1')} appears more than once"
            seen.add(low)
            if low.startswith(_VERIFIED_PREFIX_BYTES) and (
                not verified_allowed or low.decode("latin-1") not in VERIFIED_HEADERS
            ):
                return "X-UOMP-Verified-* headers are set by the gateway only"
    return None


def event_id_time(now: float | None = None) -> str:
    """The time part of an event id, guard's (``log_``) and gateway's (``gw_``) alike: 12 hex digits
    of the time in milliseconds, so the ids of one moment sit side by side in the log's ``id`` index
    (a random id would cost each event its own index page). The random part follows it."""
    return f"{int((time.time() if now is None else now) * 1000) & 0xFFFF_FFFF_FFFF:012x}"


def assertion_headers(
    *,
    token: str,
    agent_id: str,
    listener: str,
    via: str,
    client: str | None = None,
    serial: str | None = None,
    x5t: str | None = None,
    jkt: str | None = None,
    digest: str | None = None,
) -> dict[str, str]:
    """The headers the gateway forwards a verified request with, the request id aside (it changes per
    request; the rest is the same for every request of a connection with one token): the token, the
    agent header, the assertion (agent, via, token digest, the thumbprints the client proved) and the
    audit-only fields. ``digest`` is :func:`token_digest` of ``token`` when the caller has it."""
    headers = {
        "Authorization": f"Bearer {token}",
        AGENT_HEADER: agent_id,
        VERIFIED_AGENT_HEADER: agent_id,
        VERIFIED_VIA_HEADER: via,
        VERIFIED_TOKEN_HEADER: digest or token_digest(token),
        VERIFIED_LISTENER_HEADER: listener,  # audit only, like the client and the serial
    }
    if client:
        headers[VERIFIED_CLIENT_HEADER] = client
    if serial is not None:
        headers[VERIFIED_SERIAL_HEADER] = serial
    if x5t is not None:
        headers[VERIFIED_X5T_HEADER] = x5t
    if jkt is not None:
        headers[VERIFIED_JKT_HEADER] = jkt
    return headers


def token_digest(token: str) -> str:
    """The value of :data:`VERIFIED_TOKEN_HEADER` for ``token`` (SHA-256, hex)."""
    return hashlib.sha256(token.encode("ascii", "replace")).hexdigest()
