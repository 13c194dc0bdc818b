"""Listening sockets, for every server of the appliance: the loopback rule, and Unix socket files.

A neutral module: ``gateway.guard``, ``gateway.remote``, the supervisor and the CLI import it; it
imports none of them (and no asyncio: every call here is short and synchronous, used at start-up).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from pathlib import Path

from gateway.errors import ErrorCode, UompError


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, allow_non_loopback: bool, what: str) -> None:
    """CONFIG_ERROR for a listener on a non-loopback host unless it was explicitly allowed."""
    if not is_loopback(host) and not allow_non_loopback:
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            f"{what} would listen on {host}, which is not loopback; "
            "pass the explicit force flag if you really mean to expose it",
        )


def socket_is_live(path: Path) -> bool:
    """True when something accepts connections on the Unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def remove_dead_socket(path: Path) -> None:
    """Remove ``path`` if it is a socket file nobody listens on (left by a killed guard)."""
    if path.exists() and not socket_is_live(path):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def claim_socket_path(path: Path) -> None:
    """Remove a stale socket file; refuse if a live server answers on it."""
    if path.exists() and socket_is_live(path):
        raise UompError(ErrorCode.CONFIG_ERROR, f"a server is already listening on {path}")
    remove_dead_socket(path)
