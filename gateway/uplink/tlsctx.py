"""TLS 1.3 contexts of the uplink and the pin check each side runs once the handshake is done.

Both sides: TLS 1.3 only, ALPN ``h2`` only, the dedicated uplink CA as the only trust anchor, and
the peer's SPKI pin (:mod:`gateway.uplink.certs`). The gateway (TLS server) requires a client
certificate and accepts only the home role; the home side (TLS client) checks the gateway's name
as well. No session tickets: every connection is a full handshake with both certificates.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

from cryptography import x509

from gateway.uplink import certs


def server_context(cert: Path, key: Path, ca_file: Path) -> ssl.SSLContext:
    """The uplink listener's TLS 1.3 context (client certificate from the uplink CA required)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(cafile=str(ca_file))
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    ctx.num_tickets = 0
    return ctx


def client_context(cert: Path, key: Path, ca_file: Path) -> ssl.SSLContext:
    """The home side's TLS 1.3 client context (its uplink certificate; the VPS checked by the uplink CA)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=str(ca_file))
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    return ctx


def peer_check(pins: set[str], *, want_home_role: bool) -> Callable[[ssl.SSLObject | None], str | None]:
    """A check for :class:`gateway.uplink.link.Link`: None when the peer is the pinned one, else why not."""

    def check(obj: ssl.SSLObject | None) -> str | None:
        if obj is None:
            return "the uplink is not TLS"
        if obj.selected_alpn_protocol() != "h2":
            return "the peer did not agree on HTTP/2 (ALPN h2)"
        der = obj.getpeercert(binary_form=True)
        if not der:
            return "the peer presented no certificate"
        cert = x509.load_der_x509_certificate(der)
        if want_home_role and not certs.is_home_cert(cert):
            return "the peer's certificate is not an uplink home certificate"
        if certs.spki_pin(cert) not in pins:
            return "the peer's certificate is not the pinned one"
        return None

    return check
