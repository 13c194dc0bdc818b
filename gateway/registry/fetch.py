"""One bounded fetch of a small public document (a registration file, a uom.json, a DID document).

The rules, each checked again on every redirect:

* ``https://`` only. ``http://`` only when the policy allows internal addresses AND the host is a
  loopback address (a registry you run on this machine); ``data:`` is decoded by the caller
  (:func:`decode_data_uri`); every other scheme (``file:``, ``ipfs:``, ``ftp:``…) is refused.
* The host's addresses are resolved once and each must be a public address (``is_global``) unless
  ``allow_internal``; the connection goes to the address that was checked (no second lookup that
  could answer differently), TLS verifies the certificate for the host name.
* At most ``max_redirects`` redirects; a redirect to a refused URL is refused.
* At most ``max_bytes`` of body (a larger ``Content-Length`` is refused before reading); the whole
  fetch, redirects included, ends at ``timeout_s`` after it started, however slowly the server
  drips its answer.

Every refusal is ``UompError(FETCH_FAILED)`` whose message names the URL as scheme://host[:port]/path
(never the query, which may carry a key) and says what to do.
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import ErrorCode, UompError

USER_AGENT = "uomp-registry/1"
_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 16 * 1024


@dataclass(frozen=True)
class FetchPolicy:
    """The bounds of every fetch: size, time, redirects, and which addresses may be reached."""

    max_bytes: int = 256 * 1024
    timeout_s: float = 10.0
    max_redirects: int = 3
    allow_internal: bool = False
    ca_file: Path | None = None  # extra CA certificates (PEM); None: the system's


@dataclass(frozen=True)
class Fetched:
    """A fetched body and the URL it came from after redirects."""

    body: bytes
    url: str  # the URL the body came from, after redirects
    content_type: str


def shown(url: str) -> str:
    """``url`` without userinfo, query and fragment: what messages may name."""
    try:
        p = urllib.parse.urlsplit(url)
        host = p.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{p.port}" if p.port else ""
    except ValueError:
        return "(an unparsable URL)"
    if p.scheme in ("http", "https"):
        return f"{p.scheme}://{host}{port}{p.path}"[:200]
    return f"{p.scheme}:…" if p.scheme else "(a URL without a scheme)"


def _fail(url: str, what: str) -> UompError:
    return UompError(ErrorCode.FETCH_FAILED, f"{shown(url)}: {what}")


def decode_data_uri(uri: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:`` URI (base64 or percent-encoded), bounded by ``max_bytes``."""
    head, sep, payload = uri.partition(",")
    if not sep or not head.startswith("data:"):
        raise UompError(ErrorCode.FETCH_FAILED, "a data: URI without a comma; the registry entry is malformed")
    if len(payload) > max_bytes * 2:
        raise UompError(ErrorCode.FETCH_FAILED, f"a data: URI of more than {max_bytes} bytes")
    try:
        body = (
            base64.b64decode(payload, validate=True)
            if head.endswith(";base64")
            else urllib.parse.unquote_to_bytes(payload)
        )
    except ValueError as exc:
        raise UompError(ErrorCode.FETCH_FAILED, "a data: URI whose base64 does not decode") from exc
    if len(body) > max_bytes:
        raise UompError(ErrorCode.FETCH_FAILED, f"a data: URI of more than {max_bytes} bytes")
    return body


def _addresses(url: str, host: str, port: int, policy: FetchPolicy, remaining: float) -> list[str]:
    try:
        literal = ipaddress.ip_address(host)
        found = [str(literal)]
    except ValueError:
        if remaining <= 0:
            raise _fail(url, "timed out") from None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise _fail(url, "the host name does not resolve; check the URL") from exc
        found = list(dict.fromkeys(str(i[4][0]) for i in infos))
    if not found:
        raise _fail(url, "the host name does not resolve; check the URL")
    for addr in found:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
        if not ip.is_global and not policy.allow_internal:
            raise _fail(
                url,
                f"resolves to a non-public address ({ip}); refused (set [registry] allow_internal = true "
                "only for a registry you run yourself)",
            )
    return found


def _check_url(url: str, policy: FetchPolicy) -> urllib.parse.SplitResult:
    try:
        p = urllib.parse.urlsplit(url)
        _ = p.port
    except ValueError as exc:
        raise _fail(url, "not a valid URL") from exc
    if p.scheme not in ("https", "http"):
        raise _fail(url, "only https:// URLs are fetched (data: registration files are read in place)")
    if not p.hostname:
        raise _fail(url, "the URL has no host")
    if p.username is not None or p.password is not None:
        raise _fail(url, "URLs with a user name or password are refused")
    if p.scheme == "http":
        try:
            loopback = ipaddress.ip_address(p.hostname).is_loopback
        except ValueError:
            loopback = p.hostname == "localhost"
        if not (policy.allow_internal and loopback):
            raise _fail(url, "plain http is refused; the publisher must serve it over https")
    return p


def _context(policy: FetchPolicy) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if policy.ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=str(policy.ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                f"[registry] ca_file {policy.ca_file} is not a readable PEM file of CA certificates",
            ) from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class _Pinned(http.client.HTTPConnection):
    """An HTTP(S) connection to an address already checked, TLS verified for the URL's host name."""

    def __init__(self, host: str, port: int, address: str, timeout: float, tls: ssl.SSLContext | None) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address, self._tls = address, tls

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), timeout=self.timeout)
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
            except BaseException:
                sock.close()
                raise
        self.sock = sock


def fetch(url: str, policy: FetchPolicy) -> Fetched:
    """GET ``url`` under the rules of the module docstring."""
    deadline = time.monotonic() + policy.timeout_s
    tls: ssl.SSLContext | None = None
    current = url
    for _hop in range(policy.max_redirects + 1):
        p = _check_url(current, policy)
        host = p.hostname or ""
        port = p.port or (443 if p.scheme == "https" else 80)
        addresses = _addresses(current, host, port, policy, deadline - time.monotonic())
        if p.scheme == "https" and tls is None:
            tls = _context(policy)
        path = (p.path or "/") + (f"?{p.query}" if p.query else "")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _fail(current, f"no answer within {policy.timeout_s:g} s; try again later")
        conn = _Pinned(host, port, addresses[0], remaining, tls if p.scheme == "https" else None)
        try:
            try:
                conn.request("GET", path, headers={"User-Agent": USER_AGENT, "Accept": "application/json"})
                resp = conn.getresponse()
            except ssl.SSLCertVerificationError as exc:
                raise _fail(current, f"TLS certificate not trusted ({exc.verify_message}); refused") from exc
            except TimeoutError as exc:
                raise _fail(current, f"no answer within {policy.timeout_s:g} s; try again later") from exc
            except (OSError, http.client.HTTPException) as exc:
                raise _fail(current, f"cannot connect or read the answer ({type(exc).__name__})") from exc
            if resp.status in _REDIRECTS:
                location = resp.getheader("Location")
                if not location:
                    raise _fail(current, f"redirect ({resp.status}) without a Location")
                current = urllib.parse.urljoin(current, location)
                continue
            if resp.status != 200:
                raise _fail(current, f"answered HTTP {resp.status}; the document is not there")
            body = _read_body(current, resp, conn, policy, deadline)
            ctype = (resp.getheader("Content-Type") or "").split(";", 1)[0].strip().lower()
            return Fetched(body=body, url=current, content_type=ctype)
        finally:
            conn.close()
    raise _fail(current, f"more than {policy.max_redirects} redirects; refused")


def _read_body(url: str, resp: http.client.HTTPResponse, conn: _Pinned, policy: FetchPolicy, deadline: float) -> bytes:
    length = resp.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > policy.max_bytes:
        raise _fail(
            url, f"is {int(length)} bytes, more than the {policy.max_bytes} allowed ([registry] fetch_max_bytes)"
        )
    chunks: list[bytes] = []
    size = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _fail(url, f"not received within {policy.timeout_s:g} s (a server that drips); refused")
        if conn.sock is not None:
            conn.sock.settimeout(remaining)
        try:
            chunk = resp.read1(_CHUNK)
        except TimeoutError as exc:
            raise _fail(url, f"not received within {policy.timeout_s:g} s (a server that drips); refused") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise _fail(url, f"the answer broke off ({type(exc).__name__})") from exc
        if not chunk:
            break
        size += len(chunk)
        if size > policy.max_bytes:
            raise _fail(url, f"is more than the {policy.max_bytes} bytes allowed ([registry] fetch_max_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)
