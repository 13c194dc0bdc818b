"""TLS for the agent SDK: the client context (TLS 1.3, the given CA only, host name checked), the
context of each transport, and short failure descriptions that never carry headers or tokens.

:func:`build_client_context` lives here, client side, so an agent installs the client without the
server (the gateway's server context is :mod:`gateway.remote.tls`).
"""

from __future__ import annotations

import os
import ssl
import tempfile
from pathlib import Path

import aiohttp

from gateway.client.errors import ConfigError
from gateway.client.options import AgentKey, Mode
from gateway.core import ca

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


def transport_context(
    mode: Mode, *, ca_cert: str | None, cert_pem: str | None, key: AgentKey | None, ca_file: Path | None
) -> ssl.SSLContext:
    """The context of one transport: mTLS with the bundle's CA, certificate and key; else ``ca_file``
    when given; else the system trust store, TLS 1.3 (spec §15.2)."""
    if mode == "mtls":
        assert ca_cert is not None and cert_pem is not None and key is not None
        # ssl loads certificates and keys from files only: a private directory (0700) that lives
        # for the duration of this call, the key file 0600.
        with tempfile.TemporaryDirectory(prefix="uomp-sdk-") as d:
            ca_f, cert_f, key_f = Path(d, "ca.crt"), Path(d, "agent.crt"), Path(d, "agent.key")
            ca_f.write_text(ca_cert)
            cert_f.write_text(cert_pem)
            fd = os.open(key_f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(ca.key_pem(key))
            try:
                return build_client_context(ca_f, cert_f, key_f)
            except (ssl.SSLError, ValueError) as exc:
                raise ConfigError(
                    "CONFIG_ERROR", f"the bundle's CA, certificate or key cannot be loaded ({describe(exc)})"
                ) from None
    if ca_file is not None:
        try:
            return build_client_context(ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("CONFIG_ERROR", f"cannot load ca_file {ca_file} ({describe(exc)})") from None
    # dpop through a public tunnel / bearer over https: the system trust store, TLS 1.3 (spec §15.2).
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def describe(exc: BaseException) -> str:
    """A short reason for a transport failure (type and SSL reason; never headers or tokens)."""
    seen: list[str] = []
    cur: BaseException | None = exc
    for _ in range(4):
        if cur is None:
            break
        reason = getattr(cur, "reason", None) if isinstance(cur, ssl.SSLError) else None
        seen.append(f"{type(cur).__name__}" + (f" {reason}" if isinstance(reason, str) else ""))
        nxt = getattr(cur, "os_error", None) or cur.__cause__ or cur.__context__
        cur = nxt if isinstance(nxt, BaseException) and nxt is not cur else None
    return ", ".join(seen)


def ssl_in_chain(exc: BaseException) -> bool:
    """Whether a TLS error is among the causes of ``exc`` (a few levels deep)."""
    cur: BaseException | None = exc
    for _ in range(6):
        if cur is None:
            return False
        if isinstance(cur, ssl.SSLError | aiohttp.ClientSSLError):
            return True
        nxt = getattr(cur, "os_error", None) or cur.__cause__ or cur.__context__
        cur = nxt if isinstance(nxt, BaseException) and nxt is not cur else None
    return False
