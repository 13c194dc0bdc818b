"""The token and binding checks, written once, run by the gateway and by the Auth Service (pure).

A request's token passes, in this order (the first failure is the answer):

0. ``check_kid`` — the header's ``kid`` names a trusted, not retired key (run by
   :func:`gateway.core.tokens.verify_token` before the signature; retired keys are dropped from
   the trusted set once no token they signed can still be alive). Then signature, claim shapes,
   the §7.2 MUST claims, ``exp``/``expires_at`` (``verify_token``).
1. ``check_token_use`` — an access token on a memory route, a refresh token on the refresh route;
2. ``check_profile`` — the profile this listener serves (§7.3: remote behind the gateway, local on
   the Local Profile listener);
3. ``check_audience`` — the audience is one of this listener's endpoints (§7.3, §15.4);
4. ``check_allowed_endpoint`` — ``allowed_endpoints`` names the endpoint the request arrived on, as
   the *listener* established it (never the client's Host header alone);
5. ``check_agents`` — token agent == ``X-UOMP-Agent-Id`` == certificate agent (or the agent the
   gateway asserts, on the guard's socket);
6. ``check_binding`` — ``cnf`` (RFC 8705 ``x5t#S256`` / RFC 9449 ``jkt``) matches what the client
   proved, compared in constant time.

Session status, blacklist and quota come after, where the storage is (the Auth Service).
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.core.capability import Capability
from gateway.errors import ErrorCode, UompError

# binding modes
BIND_EITHER = "either"  # mTLS (or the gateway's assertion): x5t#S256 or jkt matches; an unbound token passes
BIND_JKT = "jkt"  # DPoP: the token must be bound to the proven key (cnf.jkt)
BIND_NONE = "none"  # Local Profile: nothing is proven, so a bound token cannot be used here


@dataclass(frozen=True, slots=True)
class Presented:
    """What the listener established about a request before its token is looked at."""

    token_use: str  # "access" or "refresh": what the route takes
    profile: str  # "remote" or "local": what the listener serves
    audiences: Collection[str] | None  # normalised endpoints (norm_endpoint); None: audience not compared
    audience_required: bool
    endpoint: str | None  # host[:port] the listener matched the request to; None: unknown
    check_endpoint: bool  # False where allowed_endpoints cannot apply (the Local Profile)
    header_agent: str | None  # X-UOMP-Agent-Id (or the gateway's verified agent)
    require_header_agent: bool
    proven_agent: str | None  # the certificate's agent, or the one the gateway asserts
    x5t: str | None  # thumbprints of what the client proved it holds
    jkt: str | None
    binding: str  # BIND_EITHER, BIND_JKT or BIND_NONE
    host: str = ""  # the Host header as sent (named in refusals only, never trusted)


@functools.lru_cache(maxsize=1024)  # per request (audience, Host): pure, bounded
def norm_endpoint(url: str) -> str:
    """``scheme://host[:port]/path`` lower-cased, default port and trailing slash dropped."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    try:
        port = parts.port
    except ValueError:
        port = -1
    default = {"https": 443, "http": 80}.get(scheme)
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port in (None, default) else f"{host}:{port}"
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


@functools.lru_cache(maxsize=1024)
def endpoint_netloc(url: str) -> str:
    """The ``host[:port]`` part of a normalised endpoint (what a Host header must equal)."""
    return urlsplit(norm_endpoint(url)).netloc


def check_kid(kid: object, keys: Mapping[str, object]) -> str:
    """0. The token's key id is one of the trusted, not retired keys."""
    if not isinstance(kid, str) or kid not in keys:
        raise UompError(ErrorCode.INVALID_TOKEN, "token key id is unknown")
    return kid


def check_token_use(cap: Capability, p: Presented) -> None:
    """1. A refresh token never reads memory; the refresh route takes nothing else."""
    if p.token_use == "access" and cap.is_refresh:
        raise UompError(ErrorCode.INVALID_TOKEN, "a refresh token never reads memory", session_id=cap.session_id)
    if p.token_use == "refresh" and not cap.is_refresh:
        raise UompError(ErrorCode.INVALID_TOKEN, "this route needs a refresh token", session_id=cap.session_id)


def check_profile(cap: Capability, p: Presented) -> None:
    """2. §7.3: the profile matches the deployment profile of this listener."""
    if cap.profile != p.profile:
        if p.profile == "local":
            raise UompError(
                ErrorCode.INVALID_TOKEN,
                "a remote-profile token must come through the gateway",
                session_id=cap.session_id,
            )
        raise UompError(ErrorCode.INVALID_TOKEN, f"token profile is not {p.profile}", session_id=cap.session_id)


def check_audience(cap: Capability, p: Presented) -> None:
    """3. §7.3: the audience is this listener's endpoint (REQUIRED for the Remote Profile)."""
    if cap.audience is None:
        if p.audience_required:
            raise UompError(ErrorCode.INVALID_TOKEN, "token has no audience", session_id=cap.session_id)
        return
    if p.audiences is not None and norm_endpoint(cap.audience) not in p.audiences:
        # Name what was expected (a user must tell a wrong --gateway-url from an attack); the
        # signature was checked, so the audience is ours to quote.
        accepts = ", ".join(sorted(p.audiences)[:8]) or "nothing yet"
        raise UompError(
            ErrorCode.INVALID_TOKEN,
            f"token audience {cap.audience[:200]!r} is not an endpoint of this "
            f"listener (it accepts {accepts}); authorize the agent with one of those as --gateway-url",
            session_id=cap.session_id,
        )


# The names of this machine's loopback interface: one endpoint for a given port. Only a process on
# this machine reaches them, and a request that arrived at the listener under one of them would
# arrive at the same listener under another, so telling them apart protects nothing and refuses the
# URL a user copied from the banner.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def _split_endpoint(endpoint: str) -> tuple[str, str | None]:
    """``host[:port]`` (``[v6]:port`` too) -> (host, port or None), the host's loopback names as one."""
    if endpoint.startswith("["):
        host, _, rest = endpoint.partition("]")
        host += "]"
        port = rest[1:] if rest.startswith(":") else None
    elif endpoint.count(":") == 1:
        host, port = endpoint.rsplit(":", 1)
    else:
        host, port = endpoint, None
    return ("localhost" if host in LOOPBACK_NAMES else host), port


def endpoint_allowed(allowed: tuple[str, ...], endpoint: str) -> bool:
    """``endpoint`` (host[:port], lower case) is named by an ``allowed_endpoints`` entry: a URL, a
    ``host:port`` or a bare host (any port). Loopback names are one host (:data:`LOOPBACK_NAMES`)."""
    host, port = _split_endpoint(endpoint)
    for entry in allowed:
        e = entry.strip().lower()
        if "://" in e:
            e = endpoint_netloc(e)
        if not e:
            continue
        e_host, e_port = _split_endpoint(e)
        if e_host == host and (e_port is None or e_port == port):
            return True
    return False


def check_allowed_endpoint(cap: Capability, p: Presented) -> None:
    """4. ``allowed_endpoints`` against the endpoint the listener matched (not the client's Host)."""
    if cap.allowed_endpoints is None or not p.check_endpoint:
        return
    if p.endpoint is None or not endpoint_allowed(cap.allowed_endpoints, p.endpoint):
        came = (p.endpoint or p.host)[:100]
        meant = cap.audience or cap.allowed_endpoints[0]
        raise UompError(
            ErrorCode.ACCESS_DENIED,
            f"token is not allowed on this endpoint: it is for "
            f"{', '.join(cap.allowed_endpoints[:4])[:200]}, this request came to host {came!r}; "
            f"send it to {meant[:200]} (the URL it was authorized for), or authorize the agent "
            f"again with --gateway-url https://{came}",
            session_id=cap.session_id,
        )


def check_agents(cap: Capability, p: Presented) -> None:
    """5. Token agent, header agent and the proven (certificate / asserted) agent are one."""
    if p.header_agent is None:
        if p.require_header_agent:
            raise UompError(ErrorCode.INVALID_REQUEST, "X-UOMP-Agent-Id header is required", session_id=cap.session_id)
    elif p.header_agent != cap.agent_id:
        raise UompError(
            ErrorCode.AGENT_MISMATCH,
            "token agent, certificate agent and X-UOMP-Agent-Id must be the same",
            session_id=cap.session_id,
        )
    if p.proven_agent is not None and p.proven_agent != cap.agent_id:
        raise UompError(
            ErrorCode.AGENT_MISMATCH,
            "token agent, certificate agent and X-UOMP-Agent-Id must be the same",
            session_id=cap.session_id,
        )


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


def check_binding(cap: Capability, p: Presented) -> None:
    """6. RFC 8705 / RFC 9449 sender constraint. Either thumbprint proves possession: ``x5t#S256``
    names the certificate, ``jkt`` its key (a certificate renewed for the same key keeps working)."""
    if p.binding == BIND_NONE:
        if cap.cnf_x5t is not None or cap.cnf_jkt is not None:
            raise UompError(
                ErrorCode.TOKEN_BINDING_MISMATCH,
                "a key-bound token cannot be used without its key",
                session_id=cap.session_id,
            )
        return
    if p.binding == BIND_JKT:
        if cap.cnf_jkt is None or not _same(cap.cnf_jkt, p.jkt):
            raise UompError(
                ErrorCode.TOKEN_BINDING_MISMATCH, "token is not bound to the DPoP key", session_id=cap.session_id
            )
        return
    if p.x5t is None and p.jkt is None:
        raise UompError(ErrorCode.CERT_REQUIRED, "no proof of possession for this token", session_id=cap.session_id)
    check_possession(cap, p.x5t, p.jkt)


def check_possession(cap: Capability, x5t: str | None, jkt: str | None) -> None:
    """A bound token (either ``cnf`` member) matches the presented certificate or key thumbprint."""
    if cap.cnf_x5t is None and cap.cnf_jkt is None:
        return
    if not (_same(cap.cnf_x5t, x5t) or _same(cap.cnf_jkt, jkt)):
        raise UompError(ErrorCode.TOKEN_BINDING_MISMATCH, "token is bound to another key", session_id=cap.session_id)


CHECKS: tuple[Callable[[Capability, Presented], None], ...] = (
    check_token_use,
    check_profile,
    check_audience,
    check_allowed_endpoint,
    check_agents,
    check_binding,
)


def run_checks(cap: Capability, presented: Presented) -> None:
    """Steps 1-6 in order; raises the first failure."""
    for check in CHECKS:
        check(cap, presented)
