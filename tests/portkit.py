"""Ports of a test's own: a `uomp doctor` (or any command that checks the configured ports) run by a test
must not see the ports of an appliance the user runs beside the suite (9443, 9374, 9380 by default)."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def own_ports_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the gateway, Local Profile and dashboard
    ports moved to free ones, through the settings' ``UOMP_<SECTION>_<FIELD>`` variables."""
    env = dict(os.environ if base is None else base)
    env.update(
        UOMP_GATEWAY_LISTEN_PORT=str(free_port()),
        UOMP_GUARD_TCP_PORT=str(free_port()),
        UOMP_DASHBOARD_PORT=str(free_port()),
    )
    return env
