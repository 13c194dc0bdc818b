"""Certificates revoked at home, as the guard holds them to the gateway's assertion.

The gateway refuses a revoked client certificate in the TLS handshake and again per request
(remote/identity.py). A gateway elsewhere (a VPS behind the uplink, docs/vps.md) has only a copy of
the CRL, possibly stale; so the guard also refuses an asserted request whose certificate is revoked
in this home's registry, by its thumbprint (``X-UOMP-Verified-X5t``) or its serial. This holds an
honest gateway with a stale CRL; a gateway that lies in its assertion is the threat docs/vps.md
describes (it can claim any certificate), and session revocation is what holds against it.

The revoked set is read from the CA registry only when the registry or the CRL file changed (every
revocation rewrites the CRL), looked at most once per ``recheck_seconds``: a revocation holds at the
guard within that time. A home without a CA registry has issued no certificate: nothing is revoked.
"""

from __future__ import annotations

import time
from pathlib import Path

from gateway import ca_registry
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import Stamps, stamps

RECHECK_SECONDS = 1.0


class RevokedCertificates:
    """The serials and thumbprints of this home's revoked agent certificates, reloaded on change."""

    def __init__(self, paths: Paths, *, recheck_seconds: float = RECHECK_SECONDS) -> None:
        self.paths = paths
        self.recheck_seconds = recheck_seconds
        self._looked = -float("inf")
        self._stamp: Stamps | None = None
        self.serials: frozenset[str] = frozenset()
        self.thumbprints: frozenset[str] = frozenset()
        # serial -> (agent id, revoked at, epoch seconds or None); thumbprint -> serial
        self._named: dict[str, tuple[str, int | None]] = {}
        self._serial_of: dict[str, str] = {}

    def _files(self) -> tuple[Path, ...]:
        return (ca_registry.registry_path(self.paths), self.paths.crl)

    def refresh(self, now: float | None = None) -> None:
        """Reload the sets if a file changed since the last look (at most once per ``recheck_seconds``)."""
        now = time.monotonic() if now is None else now
        if now - self._looked < self.recheck_seconds:
            return
        self._looked = now
        stamp = stamps(self._files())
        if stamp == self._stamp:
            return
        revoked: list[ca_registry.Entry] = []
        if stamp[0] is not None:  # no registry: no certificate was ever issued here
            with ca_registry.registry(self.paths) as reg:
                revoked = [e for e in reg.all() if e.status == "revoked"]
        self._named = {e.serial.lower(): (e.agent_id, e.revoked_at) for e in revoked}
        self._serial_of = {e.x5t: e.serial.lower() for e in revoked if e.x5t}
        self.serials, self.thumbprints = frozenset(self._named), frozenset(self._serial_of)
        self._stamp = stamp

    def check(self, *, serial: str | None, x5t: str | None) -> None:
        """Refuse a certificate revoked here, found by its thumbprint or serial: 401 CERT_REQUIRED,
        reason ``revoked``, the certificate named as the gateway names it (remote/tls.py judge)."""
        self.refresh()
        found = self._serial_of.get(x5t) if x5t else None
        if found is None and serial and serial.lower() in self._named:
            found = serial.lower()
        if found is None:
            return
        agent_id, revoked_at = self._named[found]
        on = time.strftime(" on %Y-%m-%d %H:%M:%S UTC", time.gmtime(revoked_at)) if revoked_at else ""
        raise UompError(
            ErrorCode.CERT_REQUIRED,
            f"the client certificate (agent {agent_id}, serial 0x{found}) was revoked{on} (by the user, at home); "
            "ask the user for a new one",
            details={"agent_id": agent_id, "serial": found},
            reason="revoked",
        )
