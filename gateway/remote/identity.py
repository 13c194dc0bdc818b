"""Who is calling, per listener: the client certificate on the mTLS listener (:func:`mtls_identity`,
judged at the connection's start and on every request by :func:`judged_memo`, the one place), the
RFC 9449 DPoP proof on the tunnel-origin listener (:func:`dpop_identity`)."""

from __future__ import annotations

import ssl
import time

from gateway import httpd
from gateway.core import dpop
from gateway.errors import ErrorCode, UompError
from gateway.remote import tls, transport
from gateway.remote.call import bearer_token
from gateway.remote.request import MEMO_ATTRIBUTE, Call, ConnMemo
from gateway.remote.state import STATE, GatewayState


def judged_memo(state: GatewayState, ssl_obj: ssl.SSLObject) -> ConnMemo | None:
    """The one check of an mTLS connection's client certificate, at the connection's start and on
    every request: None when the connection has no certificate, else its memo (the parsed identity,
    kept on the connection). Raises CERT_REQUIRED for a certificate that is not an agent's, and
    :class:`CertRefused` (with its reason, naming the agent and serial) for one of our CA that is
    revoked, expired, not yet valid, or that cannot be checked now (see :func:`tls.judge`).

    OpenSSL verified only the chain and purpose (``build_server_context``): time and revocation are
    judged here, against the CRL and CA loaded last (``GatewayState.tls_trust``), so a keep-alive
    connection made before a revocation (or a resumed session) is refused at its next request."""
    trust = state.tls_trust()
    memo: ConnMemo | None = getattr(ssl_obj, MEMO_ATTRIBUTE, None)
    if memo is not None:
        # The certificate of this connection's earlier requests: the listener speaks TLS 1.3 only,
        # without renegotiation or post-handshake authentication (tls.build_server_context), so a
        # connection's peer certificate is the one of its handshake; the memo lives on the
        # connection's SSLObject. Its parsed identity is kept; its validity period, the CRL and
        # the CA are judged again now (judge() words a refusal).
        now = time.time()
        if not (
            memo.not_before <= now <= memo.not_after
            and memo.identity.serial not in trust.revoked
            and trust.open_at(now)
        ):
            tls.judge(memo.identity, trust)
        return memo
    der = ssl_obj.getpeercert(binary_form=True)
    if not der:
        return None
    ident = state.certs.identity(der)
    tls.judge(ident, trust)
    memo = ConnMemo(der, ident)
    setattr(ssl_obj, MEMO_ATTRIBUTE, memo)
    return memo


def connection_refusal(state: GatewayState, ssl_obj: object) -> UompError | None:
    """:func:`judged_memo` when an mTLS handshake has completed (``ConnectionRegistry.check_peer``):
    the refusal, or None (no certificate, or one that passed: the connection may be verified)."""
    if not isinstance(ssl_obj, ssl.SSLObject):
        return None
    try:
        judged_memo(state, ssl_obj)
    except UompError as exc:
        return exc
    return None


def peer_check(call: Call) -> None:
    """Before routing, on the mTLS listener, every request: a client certificate, when the
    connection has one, passes :func:`judged_memo` or the request is refused (401 CERT_REQUIRED, the
    answer closes the connection, nothing reaches a handler or the guard); the identity it names
    is the request's (or, refused, its event's: ``Call.refused``)."""
    request = call.request
    ssl_obj = request.transport.get_extra_info("ssl_object") if request.transport else None
    call.ssl_object = ssl_obj
    if not isinstance(ssl_obj, ssl.SSLObject):
        return
    try:
        memo = judged_memo(request.app[STATE], ssl_obj)
    except UompError as exc:
        transport.close_after_answer(request)
        if isinstance(exc, tls.CertRefused):
            call.refused = exc.identity
        raise
    if memo is not None:
        call.identity = memo.identity
        call.memo = memo


async def mtls_identity(call: Call) -> None:
    """The request's identity from its client certificate (judged by :func:`peer_check` before routing)."""
    if call.memo is None:
        peer_check(call)
    if call.memo is None:
        raise UompError(ErrorCode.CERT_REQUIRED, "a client certificate issued by the user's agent CA is required")


def public_url(state: GatewayState, request: httpd.Request, path: str) -> str:
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
