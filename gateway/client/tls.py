"""The agent's TLS client context: TLS 1.3 only, the user's CA only, host name checked (spec §15.2).

Client side, so it lives with the SDK: an agent installs the client without the server, and the
gateway's server context (:mod:`gateway.remote.tls`) is not needed here.
"""

from __future__ import annotations

import os
import ssl

StrPath = str | os.PathLike[str]


def build_client_context(
    ca_file: StrPath,
    cert_file: StrPath | None = None,
    key_file: StrPath | None = None,
) -> ssl.SSLContext:
    """Client context for the agent SDK and tests: TLS 1.3 only, trusts ``ca_file`` only."""
    # PROTOCOL_TLS_CLIENT: verify_mode CERT_REQUIRED and check_hostname on (RFC 9525 / RFC 6125).
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # spec §15.2
    # The gateway's certificate comes from the user's CA: trust that and no system root.
    ctx.load_verify_locations(cafile=os.fspath(ca_file))
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.options |= ssl.OP_NO_COMPRESSION
    if cert_file is not None:
        ctx.load_cert_chain(
            certfile=os.fspath(cert_file), keyfile=os.fspath(key_file) if key_file is not None else None
        )
    return ctx
