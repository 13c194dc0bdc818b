"""What the home side of the uplink last said about itself (``uplink/home-status.json``, written by
``uomp guard uplink``), read for ``uomp status`` and the dashboard. Standard library only: a reader
of this file loads none of the uplink's connection code."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from gateway.config import Paths

STATUS_FILE = "home-status.json"  # in the home's uplink/ directory
MAX_BYTES = 64 * 1024  # a larger file is cut there and reads as no status


def _utc(t: Any) -> str | None:
    if isinstance(t, bool) or not isinstance(t, int | float):
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _alive(pid: Any) -> bool:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read(paths: Paths) -> dict[str, Any] | None:
    """The home side's status, None when this home never ran one. A status whose process is gone
    reads as not running (it may have been killed)."""
    try:
        with open(paths.uplink_dir / STATUS_FILE, "rb") as fh:
            doc = json.loads(fh.read(MAX_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    running = doc.get("running") is True and _alive(doc.get("pid"))
    return {
        "target": str(doc.get("target") or ""),
        "running": running,
        "connected": running and doc.get("connected") is True,
        "connected_since": _utc(doc.get("connected_since")) if running else None,
        "reconnects": doc.get("reconnects") if isinstance(doc.get("reconnects"), int) else 0,
        "failures": doc.get("failures") if isinstance(doc.get("failures"), int) else 0,
        "last_error": str(doc["last_error"])[:300] if doc.get("last_error") else None,
        "crl_pushed_at": _utc(doc.get("crl_pushed_at")),
        "crl_acked_at": _utc(doc.get("crl_acked_at")),
        "vps_crl_number": doc.get("vps_crl_number") if isinstance(doc.get("vps_crl_number"), int) else None,
        "updated_at": _utc(doc.get("updated_at")),
    }
