"""The appliance's own state: where the gateway is (one source of truth), and whether it runs.

Where the gateway is
    The public addresses agents use live in two places that are read together, here and nowhere
    else: ``[gateway] endpoints`` in ``config.toml`` (written by the user) and
    ``$UOMP_HOME/gateway/addresses.json`` (0600, written by ``uomp init --hostname``,
    ``uomp gateway start --public-url`` and the tunnel supervisor)::

        {"public_urls": ["https://my-box.example:9443"],
         "tunnel": {"mode": "quick", "url": "https://a-b-c.trycloudflare.com", "since": "...Z"}}

    :func:`accepted_endpoints` (the audiences the gateway accepts), :func:`cert_hostnames` (the
    gateway certificate's names) and :func:`default_gateway_url` (``authorize --remote``'s
    default ``--gateway-url``) all derive from them, so they cannot disagree. A quick tunnel's URL
    is an endpoint but never a certificate name: TLS for it ends at Cloudflare's edge.

Whether it runs
    ``uomp gateway start`` holds an exclusive ``flock`` on ``$UOMP_HOME/gateway/appliance.lock``
    for its whole life (the kernel drops it when the process dies, however it dies), and writes
    ``$UOMP_HOME/gateway/appliance.json`` (pid, listeners, URLs). A second start on the same home
    is refused with the first one's pid and URLs; ``uomp status`` asks the lock, not the pid file,
    whether it is running.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.config import GatewayConfig, Paths
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write


def addresses_path(paths: Paths) -> Path:
    """Where the running appliance keeps its public addresses (the tunnel URL, public URLs)."""
    return paths.appliance_addresses


def lock_path(paths: Paths) -> Path:
    """The lock one running appliance per home holds."""
    return paths.appliance_lock


def run_path(paths: Paths) -> Path:
    """Where the running appliance says what it runs (pids, ports, started)."""
    return paths.appliance_run


def iso(ts: float) -> str:
    """``ts`` (seconds since the epoch) as an ISO 8601 UTC timestamp."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


# ----------------------------------------------------------------------------- addresses


def normalize_public_url(value: str, *, default_port: int | None = None) -> str:
    """``my-box.example`` / ``https://my-box.example:9443/`` -> ``https://my-box.example[:port]``.

    A bare host name gets ``default_port`` (the mTLS listen port) unless it is 443."""
    raw = value.strip()
    if not raw:
        raise UompError(ErrorCode.CONFIG_ERROR, "an empty public URL; give a host name or an https:// URL")
    if "://" not in raw:
        raw = "https://" + raw + (f":{default_port}" if default_port and default_port != 443 and ":" not in raw else "")
    parts = urlsplit(raw)
    try:
        port = parts.port
    except ValueError as exc:
        raise UompError(
            ErrorCode.CONFIG_ERROR, f"{value!r} has a bad port; use https://HOST[:PORT] with PORT 1-65535"
        ) from exc
    if (
        parts.scheme != "https"
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
        or parts.username
        or parts.password
    ):
        raise UompError(
            ErrorCode.CONFIG_ERROR, f"{value!r} is not a public gateway URL; use https://HOST[:PORT] (no path, no user)"
        )
    host = parts.hostname.lower()
    shown = f"[{host}]" if ":" in host else host
    return f"https://{shown}" + (f":{port}" if port and port != 443 else "")


def load_addresses(paths: Paths) -> dict[str, Any]:
    """The appliance's recorded addresses; none when it never recorded any."""
    p = addresses_path(paths)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return {"public_urls": [], "tunnel": None}
    except (OSError, ValueError) as exc:
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            f"cannot read {p} ({exc}); fix or delete it (uomp gateway start --public-url re-creates it)",
        ) from exc
    if not isinstance(data, dict):
        raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is not a JSON object; delete it and set the address again")
    urls = data.get("public_urls") or []
    tunnel = data.get("tunnel")
    return {
        "public_urls": [u for u in urls if isinstance(u, str)],
        "tunnel": tunnel if isinstance(tunnel, dict) else None,
    }


def _save_addresses(paths: Paths, data: dict[str, Any]) -> None:
    paths.gateway_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(addresses_path(paths), (json.dumps(data, indent=1) + "\n").encode(), mode=0o600)


def add_public_urls(paths: Paths, urls: list[str]) -> list[str]:
    """Record public URLs (already normalized); returns the ones that were new."""
    data = load_addresses(paths)
    new = [u for u in urls if u not in data["public_urls"]]
    if new:
        data["public_urls"] = [*data["public_urls"], *new]
        _save_addresses(paths, data)
    return new


def set_tunnel(paths: Paths, mode: str, url: str | None) -> None:
    """Record the tunnel's current public URL (None: no tunnel URL)."""
    data = load_addresses(paths)
    data["tunnel"] = {"mode": mode, "url": url, "since": iso(time.time())} if url else None
    _save_addresses(paths, data)


def public_urls(paths: Paths, cfg: GatewayConfig) -> list[str]:
    """The addresses agents use over mTLS: configured endpoints, then recorded public URLs."""
    out: list[str] = []
    for u in [*cfg.endpoints, *load_addresses(paths)["public_urls"]]:
        u = u.rstrip("/")
        if u and u not in out:
            out.append(u)
    return out


def tunnel_url(paths: Paths) -> str | None:
    """The current tunnel's public URL, if a tunnel is up."""
    t = load_addresses(paths)["tunnel"]
    url = t.get("url") if t else None
    return url if isinstance(url, str) else None


def local_urls(port: int) -> list[str]:
    """The loopback URLs of the mTLS listener on ``port`` (one endpoint: localhost and 127.0.0.1)."""
    return [f"https://localhost:{port}", f"https://127.0.0.1:{port}"]


def accepted_endpoints(paths: Paths, cfg: GatewayConfig, port: int | None = None) -> list[str]:
    """Every audience the gateway accepts: public URLs, the tunnel URL, and the local URLs."""
    out = public_urls(paths, cfg)
    t = tunnel_url(paths)
    if t and t not in out:
        out.append(t)
    for u in local_urls(port if port else cfg.listen_port):
        if u not in out:
            out.append(u)
    return out


def cert_hostnames(paths: Paths, cfg: GatewayConfig, extra: list[str] | None = None) -> list[str]:
    """Names for the gateway certificate: the listen host, the public URLs' hosts, and ``extra``."""
    out: list[str] = []
    for v in [cfg.listen_host, *public_urls(paths, cfg), *(extra or [])]:
        v = v.strip()
        host = (urlsplit(v).hostname or "") if "://" in v else v
        if host and host not in ("0.0.0.0", "::") and host not in out:  # noqa: S104 - not binding
            out.append(host)
    return out


def default_gateway_url(paths: Paths, cfg: GatewayConfig) -> str:
    """``authorize --remote``'s default: the first public URL, else this host on the port the
    running appliance listens on (else the configured listen port)."""
    urls = public_urls(paths, cfg)
    if urls:
        return urls[0]
    run = read_run(paths) if is_running(paths) else None
    local = (run or {}).get("local_urls") or []
    return str(local[0]) if local else f"https://localhost:{cfg.listen_port}"


# ----------------------------------------------------------------------------- running


class ApplianceLock:
    """The exclusive lock a running ``uomp gateway start`` holds (see the module docstring)."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self._fd: int | None = None

    def acquire(self) -> None:
        self.paths.gateway_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(lock_path(self.paths), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = read_run(self.paths) or {}
            where = ", ".join(info.get("local_urls", [])[:1] + info.get("public_urls", []))
            raise UompError(
                ErrorCode.ALREADY_RUNNING,
                f"the appliance is already running on {self.paths.home} "
                f"(pid {info.get('pid', '?')}{', ' + where if where else ''}); see 'uomp status', "
                "stop it with Ctrl-C or 'kill PID', or use another --home",
            ) from None
        self._fd = fd

    def write(self, info: dict[str, Any]) -> None:
        atomic_write(run_path(self.paths), (json.dumps(info, indent=1) + "\n").encode(), mode=0o600)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            run_path(self.paths).unlink()
        os.close(self._fd)
        self._fd = None


def read_run(paths: Paths) -> dict[str, Any] | None:
    """What the running appliance recorded about itself, or None."""
    try:
        data = json.loads(run_path(paths).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_running(paths: Paths) -> bool:
    """True while some process holds the appliance lock of this home."""
    try:
        fd = os.open(lock_path(paths), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


# ----------------------------------------------------------------------------- preflight


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    """Refuse a port something else already listens on, before any process starts."""
    if port <= 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise port_error(host, port, what, flag, exc) from None


def port_error(host: str, port: int, what: str, flag: str, exc: OSError) -> UompError:
    """The error for a listener that could not bind: in use (PORT_IN_USE, with how to find the
    user) or another OS error."""
    if exc.errno == errno.EADDRINUSE:
        return UompError(
            ErrorCode.PORT_IN_USE,
            f"{what} cannot listen on {host}:{port}: the port is already in use; "
            f"stop what uses it (e.g. `ss -ltnp 'sport = :{port}'`) or choose another with {flag}",
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return UompError(
            ErrorCode.CONFIG_ERROR,
            f"{what} cannot listen on {host}:{port}: no such address on this "
            f"machine; use 127.0.0.1 or an address of this host with {flag}",
        )
    if exc.errno == errno.EACCES:
        return UompError(
            ErrorCode.PORT_IN_USE,
            f"{what} may not listen on {host}:{port} (permission denied: ports "
            f"below 1024 need privileges); choose a port above 1023 with {flag}",
        )
    return UompError(ErrorCode.CONFIG_ERROR, f"{what} cannot listen on {host}:{port} ({exc.strerror}); check {flag}")


def check_home_writable(home: Path) -> None:
    """A data directory this process can create and write, or one clear error."""
    probe = home
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UompError(
            ErrorCode.HOME_UNWRITABLE,
            f"the data directory {home} cannot be created: {probe} is a file; choose another with --home or UOMP_HOME",
        )
    test = probe / f".uomp-write-test-{os.getpid()}"
    try:
        fd = os.open(test, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(test)
    except OSError as exc:
        try:
            st = probe.stat()
            owner = f" (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}; this process runs as uid {os.getuid()})"
        except OSError:
            owner = ""
        raise UompError(
            ErrorCode.HOME_UNWRITABLE,
            f"cannot write the data directory {probe}{owner}: {exc.strerror}; "
            f"make it writable (chown {os.getuid()} {probe}) or choose another with --home or "
            "UOMP_HOME",
        ) from None


def check_gateway_url(paths: Paths, cfg: GatewayConfig, url: str) -> list[str]:
    """Is ``url`` an address this gateway accepts, and (for mTLS) named by its certificate?

    Returns the problems, each with its fix (empty: fine). ``authorize --remote`` refuses on them
    while the appliance runs (it knows exactly what it accepts) and warns otherwise."""
    from cryptography import x509

    from gateway import ca_store
    from gateway.core import ca

    problems: list[str] = []
    url = url.rstrip("/")
    accepted = set(accepted_endpoints(paths, cfg))
    run = read_run(paths) if is_running(paths) else None
    if run:
        accepted |= set(run.get("endpoints") or [])
    tunnel = tunnel_url(paths)
    if url not in accepted:
        problems.append(
            f"{url} is not an endpoint this gateway accepts (it accepts: {', '.join(sorted(accepted))}); "
            f"the agent's requests would be refused as 'token audience is not this gateway'. Use one of "
            f"those, or record it: uomp init --hostname {url} (then restart the gateway)"
        )
        return problems
    host = (urlsplit(url).hostname or "").lower()
    if host.endswith(".trycloudflare.com"):
        return problems  # a quick tunnel: TLS ends at Cloudflare's edge, our certificate is not involved
    t = load_addresses(paths)["tunnel"]
    if url == tunnel and t and t.get("mode") == "named":
        return problems
    try:
        cert = x509.load_pem_x509_certificate(ca_store.server_cert_path(paths).read_bytes())
    except (OSError, ValueError):
        return problems  # no certificate yet: `uomp init` makes it with the recorded names
    if host not in ca.server_cert_names(cert):
        problems.append(
            f"the gateway certificate does not name {host} (it names: "
            f"{', '.join(sorted(ca.server_cert_names(cert)))}); agents would fail the TLS name check. "
            f"Run: uomp init --hostname {url} (re-issues the certificate), then restart the gateway "
            "or send it SIGHUP"
        )
    return problems
