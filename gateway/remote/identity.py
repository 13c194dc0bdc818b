"""Who is calling, per listener: the client certificate on the mTLS listener (:func:`mtls_identity`),
the RFC 9449 DPoP proof on the tunnel-origin listener (:func:`dpop_identity`)."""

from __future__ import annotations

import ssl
import time

from aiohttp import web

from gateway.core import dpop
from gateway.errors import ErrorCode, UompError
from gateway.remote.call import bearer_token
from gateway.remote.request import MEMO_ATTRIBUTE, Call, ConnMemo
from gateway.remote.state import STATE, GatewayState


async def mtls_identity(call: Call) -> None:
    """The request's identity from its client certificate (verified in the handshake, checked again against the CRL)."""
    ssl_obj = call.request.transport.get_extra_info("ssl_object") if call.request.transport else None
    der = ssl_obj.getpeercert(binary_form=True) if isinstance(ssl_obj, ssl.SSLObject) else None
    if not der:
        raise UompError(ErrorCode.CERT_REQUIRED, "a client certificate issued by the user's agent CA is required")
    state = call.request.app[STATE]
    # The CRL is checked at the handshake; a keep-alive connection made before a revocation is
    # refused here too, on its next request.
    revoked = state.revoked_serials()
    memo: ConnMemo | None = getattr(ssl_obj, MEMO_ATTRIBUTE, None)
    if memo is not None and memo.der == der:
        # The same certificate as this connection's earlier requests: its parsed identity is kept,
        # its validity period and the CRL are checked again now (as ClientCertChecker.check does).
        now = time.time()
        if now < memo.not_before:
            raise UompError(ErrorCode.CERT_REQUIRED, "the client certificate is not valid yet")
        if now > memo.not_after:
            raise UompError(ErrorCode.CERT_REQUIRED, "the client certificate has expired")
        if memo.identity.serial in revoked:
            raise UompError(ErrorCode.CERT_REQUIRED, "the client certificate has been revoked")
    else:
        memo = ConnMemo(der, state.certs.check(der, revoked=revoked))
        setattr(ssl_obj, MEMO_ATTRIBUTE, memo)
    call.identity = memo.identity
    call.memo = memo


def public_url(state: GatewayState, request: web.Request, path: str) -> str:
    """The URL the agent addressed, as it must appear in the proof's ``htu``.

    Behind cloudflared the Host header is the public tunnel host name; it must be one of the
    tunnel listener's endpoints (the same list tokens' ``audience`` is checked against there).
    """
    host = state.match_endpoint("tunnel", request.headers.get("Host", ""))
    if host is None:
        raise UompError(ErrorCode.DPOP_INVALID, "request host is not one of this gateway's tunnel endpoints")
    return f"https://{host}" + path


def verify_proof(call: Call) -> dpop.DpopResult:
    """The tunnel request's token signature and DPoP proof (RFC 9449), checked and not yet recorded:
    the caller records the proof once the token and the session passed their checks."""
    state = call.request.app[STATE]
    request = call.request
    assert call.target is not None
    if call.route is not None and call.route.token_use == "none":
        raise UompError(ErrorCode.CERT_REQUIRED, "this route needs a client certificate (mTLS listener)")
    cap = state.verify(bearer_token(request))  # signature first: a proof is only checked for a real token
    if cap.cnf_jkt is None:
        raise UompError(
            ErrorCode.TOKEN_BINDING_MISMATCH,
            "tokens used through the tunnel must be bound to a DPoP key",
            session_id=cap.session_id,
        )
    result = dpop.verify_dpop(
        request.headers.getall("DPoP", []),
        method=request.method,
        url=public_url(state, request, call.target.upstream_path),
        access_token=bearer_token(request),
        now=time.time(),
        window_seconds=state.cfg.dpop_window_seconds,
        replay=state.replay,
        expected_jkt=cap.cnf_jkt,
        record=False,
    )
    call.jkt = result.jkt
    return result


async def dpop_identity(call: Call) -> None:
    """The request's identity from its DPoP proof (RFC 9449) on the tunnel listener, its proof
    recorded in this process's replay cache."""
    state = call.request.app[STATE]
    result = verify_proof(call)
    # recorded only once the token and the session passed their checks (a revoked agent records nothing)
    call.on_authenticated.append(lambda: dpop.record_proof(state.replay, result, now=time.time()))
