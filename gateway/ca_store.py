"""The user's certificate authority on disk, under ``$UOMP_HOME/ca`` (0700).

Longer than ~500 lines on purpose: one job, the CA's rules (create, issue, renew, revoke, sign the
CRL), whose steps share one lock and one registry transaction; the rows themselves are kept by
:mod:`gateway.ca_registry`.

Files:

* ``ca.key`` (0600), ``ca.crt``: the CA (:func:`gateway.core.ca.create_ca`). Made once; never
  regenerated: a CA key that exists but cannot be read is a ``KEY_ERROR`` naming the file, because
  a new CA would orphan every agent certificate and the gateway certificate;
* ``gateway.key`` (0600), ``gateway.crt``: the gateway's TLS server certificate;
* ``crl.pem``: the CRL. Always present once the CA exists (an empty CRL at first), because the
  gateway's TLS context checks every client certificate against it and fails closed without one.
  Re-signed on every revocation and whenever it gets within :data:`CRL_REFRESH_BEFORE` of its
  ``nextUpdate`` (:func:`refresh_crl`; the gateway calls it from its TLS watcher);
* ``issued.db`` (0600, SQLite WAL): the registry of issued agent certificates (serial hex, agent
  id, validity, status ``active``/``revoked``, ``revoked_at``, the serial it was renewed from and
  its lineage, the key and certificate thumbprints tokens are bound to) and the last CRL number.
  Indexed, so an issuance or renewal adds one row instead of rewriting the file; renewal chains
  whose every certificate expired more than :data:`REGISTRY_RETENTION` ago are pruned. A
  ``issued.json`` of earlier versions is migrated into it once (and renamed ``.migrated``);
* ``.lock``: an ``fcntl`` lock held around every read-modify-write of the registry and the CRL,
  so two ``uomp`` processes (or the CLI and the gateway's renewal route) never lose an update.

Every write is atomic (:func:`gateway.fsutil.atomic_write`, SQLite transactions). The registry is
committed before the CRL is written: the registry is the truth, and :func:`refresh_crl` rebuilds a
CRL that disagrees with it. Before a CA file is trusted, the data directory and ``ca/`` must be the
user's and not group/other-writable (UNSAFE_PERMISSIONS otherwise).

Longer than ~500 lines on purpose: every change of the CA's files (init, issue, renew, revoke, the
CRL) runs under the same lock and the same atomic-write rules.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gateway.atrest import vault
from gateway.ca_registry import (
    Entry,
    Registry,
    epoch,
    from_epoch,
    legacy_registry_path,
    locked,
    registry,
    registry_path,
    ts,
)
from gateway.config import Paths
from gateway.core import ca, jose
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import Stamps, atomic_write, check_private_dir, ensure_output_dir, ensure_private_dir, stamps

# Re-sign the CRL when less than this is left before its nextUpdate (CRL validity is 7 days).
CRL_REFRESH_BEFORE = dt.timedelta(days=4)
# Re-issue the gateway certificate when less than this is left.
SERVER_CERT_RENEW_BEFORE = dt.timedelta(days=30)
# Renewal: only in the last third of a certificate's life (the SDK renews at 2/3), and at most
# RENEW_MAX_PER_AGENT renewals per agent per RENEW_RATE_WINDOW. The gateway passes its
# configured values ([gateway] renew_window_fraction, renew_max_per_agent, renew_rate_window_seconds).
RENEW_WINDOW_FRACTION = 1 / 3
RENEW_MAX_PER_AGENT = 12
RENEW_RATE_WINDOW = dt.timedelta(hours=1)
_RESTORE_KEY = "restore the CA key (or remove the ca directory deliberately: every certificate it issued dies)"


# ------------------------------------------------------------------------------------ paths


def ca_key_path(paths: Paths) -> Path:
    return paths.ca_key


def ca_cert_path(paths: Paths) -> Path:
    return paths.ca_cert


def server_key_path(paths: Paths) -> Path:
    return paths.gateway_key


def server_cert_path(paths: Paths) -> Path:
    return paths.gateway_cert


def crl_path(paths: Paths) -> Path:
    return paths.crl


# ------------------------------------------------------------------------------ file loading


def _read(path: Path, code: ErrorCode, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UompError(code, f"cannot read {what} {path}: {exc.strerror}") from exc


def load_key_file(path: Path, what: str) -> ca.CAPrivateKey:
    try:
        data = vault.read_key(path)  # sealed in a sealed home (gateway/atrest/vault.py)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UompError(ErrorCode.KEY_ERROR, f"cannot read {what} {path}: {exc.strerror}") from exc
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise UompError(ErrorCode.KEY_ERROR, f"{path} is readable by others (mode {mode:o}); chmod 600 it")
    try:
        return ca.load_private_key(data)
    except (ValueError, TypeError) as exc:
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{path} exists but is not a readable P-256/Ed25519 PEM private key; fix or restore it: "
            f"the {what} is never regenerated silently",
        ) from exc


def _load_cert_file(path: Path, what: str) -> x509.Certificate:
    data = _read(path, ErrorCode.CA_ERROR, what)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise UompError(ErrorCode.CA_ERROR, f"{path} exists but is not a readable PEM certificate ({what})") from exc


def _check_dirs(paths: Paths) -> None:
    check_private_dir(paths.home, "data directory")
    check_private_dir(paths.ca_dir, "CA directory")


def load_ca(paths: Paths) -> tuple[ca.CAPrivateKey, x509.Certificate]:
    """The CA key and certificate; CA_ERROR/KEY_ERROR naming the file when missing or broken."""
    _check_dirs(paths)
    kp, cp = ca_key_path(paths), ca_cert_path(paths)
    if not kp.exists() and not cp.exists():
        raise UompError(ErrorCode.CA_ERROR, f"no CA in {paths.ca_dir}; run 'uomp ca init' (or 'uomp init')")
    try:
        key = load_key_file(kp, "CA key")
    except FileNotFoundError as exc:
        raise UompError(ErrorCode.KEY_ERROR, f"{kp} is missing but {cp} exists; {_RESTORE_KEY}") from exc
    try:
        cert = _load_cert_file(cp, "CA certificate")
    except FileNotFoundError as exc:
        raise UompError(ErrorCode.CA_ERROR, f"{cp} is missing; run 'uomp ca init' to re-make it from {kp}") from exc
    try:
        ca.check_ca_pair(key, cert)
    except UompError as exc:
        raise UompError(ErrorCode.CA_ERROR, f"{cp} and {kp}: {exc.message}") from exc
    return key, cert


def load_ca_cert(paths: Paths) -> x509.Certificate:
    """The CA certificate alone (no private key read)."""
    _check_dirs(paths)
    try:
        return _load_cert_file(ca_cert_path(paths), "CA certificate")
    except FileNotFoundError as exc:
        raise UompError(ErrorCode.CA_ERROR, f"no CA in {paths.ca_dir}; run 'uomp ca init' (or 'uomp init')") from exc


def _prepare_crl(paths: Paths, key: ca.CAPrivateKey, cert: x509.Certificate, reg: Registry, now: dt.datetime) -> bytes:
    """A new CRL (PEM) from the registry; the CRL number only ever goes up.

    Called inside the registry's write transaction (the new CRL number and the pruning commit with
    it); the caller writes the returned CRL after the commit, still under :func:`locked`: the
    registry is the truth, and :func:`refresh_crl` repairs a CRL that is behind it."""
    number = reg.crl_number + 1
    with contextlib.suppress(OSError, ValueError):
        current = x509.load_pem_x509_crl(crl_path(paths).read_bytes())
        number = max(number, ca.crl_number(current) + 1)
    reg.crl_number = number
    reg.prune(now)
    return ca.crl_pem(ca.build_crl(key, cert, reg.revoked_for_crl(now), now, number=number))


def _crl_needs_refresh(
    paths: Paths, cert: x509.Certificate, reg: Registry, now: dt.datetime, min_remaining: dt.timedelta
) -> bool:
    try:
        crl = x509.load_pem_x509_crl(crl_path(paths).read_bytes())
    except (OSError, ValueError):
        return True
    ca_pub = cert.public_key()
    if not isinstance(ca_pub, ca.AgentPublicKey):
        return True
    if not crl.is_signature_valid(ca_pub) or crl.issuer != cert.subject:
        return True
    next_update = crl.next_update_utc
    if next_update is None or next_update - now < min_remaining:
        return True
    listed = {r.serial_number for r in crl}
    wanted = {serial for serial, _ in reg.revoked_for_crl(now)}
    return not wanted <= listed  # a revocation the CRL does not show yet (crash between writes)


def refresh_crl(
    paths: Paths, *, now: dt.datetime | None = None, min_remaining: dt.timedelta = CRL_REFRESH_BEFORE
) -> bool:
    """Re-sign the CRL if it is missing, stale-soon, or behind the registry. True when re-signed.

    Cheap when nothing is due (one indexed query, one signature check), so the gateway can call
    it from its TLS watcher every few seconds.
    """
    now = ca.aware_utc(now)
    cert = load_ca_cert(paths)
    with registry(paths) as reg:
        if not _crl_needs_refresh(paths, cert, reg, now, min_remaining):
            return False
    with locked(paths):
        key, cert = load_ca(paths)
        with registry(paths, write=True) as reg:
            if not _crl_needs_refresh(paths, cert, reg, now, min_remaining):
                return False
            pem = _prepare_crl(paths, key, cert, reg, now)
        atomic_write(crl_path(paths), pem, mode=0o644)
    return True


# How often a CrlWatch runs the whole check although none of its files changed: the CRL's
# nextUpdate comes nearer with no file changing (it is re-signed CRL_REFRESH_BEFORE, days, ahead).
CRL_RECHECK_SECONDS = 3600.0


class CrlWatch:
    """:func:`refresh_crl` for a watcher that asks every few seconds (the gateway's TLS watch).

    The check opens the registry (SQLite), reads the CA certificate and parses and verifies the
    CRL; here it runs only when a file it reads changed since the last check (mtime, size and
    inode of the CA certificate, the CRL, the registry, its WAL and the legacy registry), when
    ``recheck_seconds`` of wall time have passed (or the clock went back), or when the last check
    failed or re-signed. A revocation commits to the registry, which changes it: the next call
    re-signs a CRL that is behind it, as :func:`refresh_crl` does. The files' stamps are taken
    before the check, so a change during it is seen by the next call. Not thread-safe: one
    watcher calls it."""

    def __init__(self, paths: Paths, *, recheck_seconds: float = CRL_RECHECK_SECONDS) -> None:
        self.paths = paths
        self.recheck_seconds = recheck_seconds
        self.checks = 0  # whole checks run (diagnostics and tests)
        self._stamp: Stamps | None = None
        self._checked_at = 0.0

    def _stamps(self) -> Stamps:
        reg = registry_path(self.paths)
        return stamps(
            (
                ca_cert_path(self.paths),
                crl_path(self.paths),
                reg,
                reg.with_name(reg.name + "-wal"),
                legacy_registry_path(self.paths),
            )
        )

    def tick(self, now: float | None = None) -> bool:
        """Re-sign the CRL if it is due (see :func:`refresh_crl`); True when re-signed."""
        t = time.time() if now is None else now
        stamp = self._stamps()
        if stamp == self._stamp and self._checked_at <= t < self._checked_at + self.recheck_seconds:
            return False
        self._stamp = None  # until this check has run to its end
        self.checks += 1
        resigned = refresh_crl(self.paths)
        self._checked_at = t
        self._stamp = None if resigned else stamp  # a new CRL file: its own stamp is taken next time
        return resigned


# ------------------------------------------------------------------------------------ init


def _ensure_server_cert(
    paths: Paths, key: ca.CAPrivateKey, cert: x509.Certificate, hostnames: Sequence[str], now: dt.datetime
) -> bool:
    """Issue gateway.crt when missing, expiring soon, or lacking a requested name.

    Names are added, never dropped (the new certificate covers the old names and the requested
    ones); delete gateway.crt to start over. An existing gateway.key is kept. A gateway.crt that
    this CA did not issue was put there by the user and is left alone.
    """
    kp, cp = server_key_path(paths), server_cert_path(paths)
    wanted = ca.wanted_server_names(hostnames)
    names: list[str] = list(hostnames)
    if cp.exists():
        current = _load_cert_file(cp, "gateway certificate")
        if not ca.is_issued_by(current, cert):
            return False  # the user put another certificate there on purpose: not ours to replace
        have = ca.server_cert_names(current)
        if current.not_valid_after_utc - now > SERVER_CERT_RENEW_BEFORE and wanted <= have and kp.exists():
            return False
        names = sorted(have | wanted)
    if kp.exists():
        server_key = load_key_file(kp, "gateway key")
    else:
        server_key = ca.new_key("p256")
        vault.write_key(kp, ca.key_pem(server_key))
    server_cert = ca.issue_server_cert(key, cert, server_key.public_key(), names, now=now)
    atomic_write(cp, ca.cert_pem(server_cert), mode=0o644)
    return True


def init_all(
    paths: Paths, hostnames: Sequence[str] = (), *, now: dt.datetime | None = None, key_type: ca.KeyType = "p256"
) -> dict[str, bool]:
    """Create what is missing: CA, gateway certificate, CRL, registry. ``{what: created?}``.

    Idempotent. Never regenerates an existing CA key; a file that exists but cannot be read is an
    error naming it. A missing ``ca.crt`` next to a good ``ca.key`` is re-made from that key (same
    subject, same key identifier: everything it issued still chains to it).
    """
    now = ca.aware_utc(now)
    ca.wanted_server_names(hostnames)  # validate before touching anything
    ensure_private_dir(paths.home, "data directory")
    with locked(paths):
        kp, cp = ca_key_path(paths), ca_cert_path(paths)
        created = False
        if kp.exists():
            if not cp.exists():
                key = load_key_file(kp, "CA key")
                _, remade = ca.create_ca(key, now=now)
                atomic_write(cp, ca.cert_pem(remade), mode=0o644)
            key, cert = load_ca(paths)
        elif cp.exists():
            raise UompError(ErrorCode.KEY_ERROR, f"{kp} is missing but {cp} exists; {_RESTORE_KEY}")
        else:
            key, cert = ca.create_ca(key_type=key_type, now=now)
            # The registry before the key, the key before the certificate: a crash leaves an empty
            # registry without a CA (made again with it), or a key whose certificate the next init
            # re-makes; never a CA without its registry, which only a deletion makes.
            with registry(paths, write=True, create=True):
                pass
            vault.write_key(kp, ca.key_pem(key))
            atomic_write(cp, ca.cert_pem(cert), mode=0o644)
            created = True
        server = _ensure_server_cert(paths, key, cert, hostnames, now)
        pem: bytes | None = None
        with registry(paths, write=True) as reg:
            if _crl_needs_refresh(paths, cert, reg, now, CRL_REFRESH_BEFORE):
                pem = _prepare_crl(paths, key, cert, reg, now)
        if pem is not None:
            atomic_write(crl_path(paths), pem, mode=0o644)
        crl_new = pem is not None
    return {"agent CA": created, "gateway server certificate": server, "CRL": crl_new}


def init_ca(paths: Paths, hostnames: Sequence[str] = (), *, now: dt.datetime | None = None) -> bool:
    """:func:`init_all`; True when a new CA was created."""
    return init_all(paths, hostnames, now=now)["agent CA"]


# ---------------------------------------------------------------------------------- issuing


def _bindings(issued: x509.Certificate) -> tuple[str | None, str | None]:
    """(jkt, x5t#S256) of a certificate: what a token bound to it carries in ``cnf``."""
    pub = issued.public_key()
    jkt = jose.key_thumbprint(pub) if isinstance(pub, ca.AgentPublicKey) else None
    return jkt, jose.cert_thumbprint(issued.public_bytes(serialization.Encoding.DER))


def _issue(
    paths: Paths,
    agent_id: str,
    subject_key: x509.CertificateSigningRequest | ca.AgentPublicKey,
    lifetime: dt.timedelta,
    now: dt.datetime,
    renewed_from: str | None = None,
    precheck: Callable[[Registry], Entry | None] | None = None,
) -> x509.Certificate:
    with locked(paths):
        key, cert = load_ca(paths)
        with registry(paths, write=True) as reg:
            parent = None
            if precheck is not None:
                parent = precheck(reg)  # under the lock: a revocation cannot slip in between check and issue
            issued = ca.issue_agent_cert(key, cert, subject_key, agent_id, lifetime, now)
            serial = ca.serial_hex(issued.serial_number)
            jkt, x5t = _bindings(issued)
            reg.add(
                Entry(
                    serial=serial,
                    agent_id=agent_id,
                    not_before=epoch(issued.not_valid_before_utc),
                    not_after=epoch(issued.not_valid_after_utc),
                    issued_at=epoch(now),
                    status="active",
                    renewed_from=renewed_from,
                    lineage=parent.lineage if parent else serial,
                    jkt=jkt,
                    x5t=x5t,
                )
            )
            reg.prune(now)
    return issued


def issue_from_csr(
    paths: Paths,
    agent_id: str,
    csr_pem: bytes,
    lifetime: dt.timedelta = ca.AGENT_CERT_LIFETIME,
    *,
    now: dt.datetime | None = None,
) -> bytes:
    """Sign the agent's CSR (PEM or DER; signature verified): the certificate, PEM."""
    now = ca.aware_utc(now)
    ca.validate_agent_id(agent_id)
    csr = ca.load_csr(csr_pem)
    return ca.cert_pem(_issue(paths, agent_id, csr, lifetime, now))


@dataclass(frozen=True)
class IssuedFiles:
    out_dir: Path
    key_file: Path
    cert_file: Path
    ca_file: Path
    serial: str
    not_after: dt.datetime
    new_key: bool  # False when an existing agent.key in out_dir was reused
    reused_cert: bool = False  # True when the valid agent.crt already there was kept (no new certificate)


def renewal_opens(cert: x509.Certificate, window_fraction: float = RENEW_WINDOW_FRACTION) -> dt.datetime:
    """When renewal of ``cert`` becomes possible: the last ``window_fraction`` of its life."""
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    return cert.not_valid_after_utc - life * window_fraction


def check_renewal_window(
    not_before: dt.datetime, not_after: dt.datetime, now: dt.datetime, window_fraction: float = RENEW_WINDOW_FRACTION
) -> None:
    """RENEWAL_TOO_EARLY unless ``now`` is in the last ``window_fraction`` of the validity period.

    Pure (no I/O), so the gateway can refuse early renewals on its event loop before any work."""
    if not 0 < window_fraction <= 1:
        raise UompError(ErrorCode.CONFIG_ERROR, "the renewal window fraction must lie in (0, 1]")
    life = not_after - not_before
    opens = not_after - life * window_fraction
    # a little slack for an agent whose clock runs slightly ahead (at most the clock skew allowance)
    if now < opens - min(ca.CLOCK_SKEW, life / 50):
        raise UompError(
            ErrorCode.RENEWAL_TOO_EARLY,
            f"renewal refused: a certificate renews only in the last {window_fraction:.0%} of its life; "
            f"this one from {ts(opens)}",
        )


def _reusable(
    paths: Paths, agent_id: str, kf: Path, cf: Path, now: dt.datetime, window_fraction: float
) -> x509.Certificate | None:
    """The certificate in ``cf`` if it can serve as is: this CA's, for ``agent_id`` and the key in
    ``kf``, active in the registry, and not yet in its renewal window."""
    if not (kf.exists() and cf.exists()):
        return None
    try:
        current = ca.load_cert(cf.read_bytes())
    except (OSError, UompError):
        return None
    agent_key = load_key_file(kf, "agent key")
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if (
        not ca.is_issued_by(current, load_ca_cert(paths))
        or ca.agent_id_from_cert(current) != agent_id
        or current.public_key().public_bytes(*spki) != agent_key.public_key().public_bytes(*spki)
        or not current.not_valid_before_utc <= now < renewal_opens(current, window_fraction)
    ):
        return None
    with registry(paths) as reg:
        entry = reg.by_serial(ca.serial_hex(current.serial_number))
    if entry is None or entry.status != "active" or entry.agent_id != agent_id:
        return None
    return current


def issue_with_key(
    paths: Paths,
    agent_id: str,
    out_dir: Path | str,
    lifetime: dt.timedelta = ca.AGENT_CERT_LIFETIME,
    *,
    key_type: ca.KeyType = "p256",
    now: dt.datetime | None = None,
    reuse: bool = False,
    window_fraction: float = RENEW_WINDOW_FRACTION,
) -> IssuedFiles:
    """Make (or reuse) ``out_dir/agent.key`` and write ``agent.crt`` and ``ca.crt`` beside it (all 0600).

    An existing ``agent.key`` is reused, so running this again renews the certificate for the same
    key; an unreadable one is a KEY_ERROR, never silently replaced. ``reuse``: an ``agent.crt``
    already there that is still good (see :func:`_reusable`) is kept instead of issuing another.
    An existing ``out_dir`` keeps its mode; one that is not the user's or is group/other-writable
    is refused (UNSAFE_PERMISSIONS): the key file would be replaceable.
    """
    now = ca.aware_utc(now)
    ca.validate_agent_id(agent_id)
    out = ensure_output_dir(Path(out_dir), "agent output directory")
    kf, cf, caf = out / "agent.key", out / "agent.crt", out / "ca.crt"
    if reuse:
        kept = _reusable(paths, agent_id, kf, cf, now, window_fraction)
        if kept is not None:
            atomic_write(caf, ca.cert_pem(load_ca_cert(paths)), mode=0o600)
            return IssuedFiles(
                out,
                kf,
                cf,
                caf,
                ca.serial_hex(kept.serial_number),
                kept.not_valid_after_utc,
                new_key=False,
                reused_cert=True,
            )
    new_key = not kf.exists()
    if new_key:
        agent_key = ca.new_key(key_type)
    else:
        agent_key = load_key_file(kf, "agent key")
    cert = _issue(paths, agent_id, agent_key.public_key(), lifetime, now)
    if new_key:
        atomic_write(kf, ca.key_pem(agent_key), mode=0o600)
    atomic_write(cf, ca.cert_pem(cert), mode=0o600)
    atomic_write(caf, ca.cert_pem(load_ca_cert(paths)), mode=0o600)
    return IssuedFiles(out, kf, cf, caf, ca.serial_hex(cert.serial_number), cert.not_valid_after_utc, new_key)


def renew(
    paths: Paths,
    presented: bytes,
    csr: bytes | None = None,
    lifetime: dt.timedelta = ca.AGENT_CERT_LIFETIME,
    now: dt.datetime | None = None,
    *,
    window_fraction: float = RENEW_WINDOW_FRACTION,
    max_per_agent: int = RENEW_MAX_PER_AGENT,
    rate_window: dt.timedelta = RENEW_RATE_WINDOW,
) -> bytes:
    """A new certificate for the agent of ``presented`` (PEM or DER): the certificate, PEM.

    ``presented`` must be an agent certificate issued by this CA, in the registry, not revoked,
    valid now and in the last ``window_fraction`` of its life (else RENEWAL_TOO_EARLY); the agent
    may have had at most ``max_per_agent`` renewals in the last ``rate_window`` (else
    RATE_LIMITED). The new certificate has the same agent id and, without a CSR, the same public
    key; with a CSR (signature verified) the CSR's key (key rotation). It records the serial it was
    renewed from (revoking that serial revokes it too). Blocking (file lock, fsync): call it from a
    worker thread in a server.
    """
    now = ca.aware_utc(now)
    old = ca.load_cert(presented)
    agent_id = ca.agent_id_from_cert(old)
    if agent_id is None or not ca.has_client_auth(old):
        raise UompError(ErrorCode.CA_ERROR, "renewal refused: the presented certificate is not an agent certificate")
    if now < old.not_valid_before_utc:
        raise UompError(ErrorCode.CA_ERROR, "renewal refused: the presented certificate is not valid yet")
    if now > old.not_valid_after_utc:
        raise UompError(
            ErrorCode.CA_ERROR,
            "renewal refused: the presented certificate has expired; issue a new one with 'uomp agent issue'",
        )
    check_renewal_window(old.not_valid_before_utc, old.not_valid_after_utc, now, window_fraction)
    _, ca_cert = load_ca(paths)
    if not ca.is_issued_by(old, ca_cert):
        raise UompError(ErrorCode.CA_ERROR, "renewal refused: the presented certificate was not issued by this CA")
    serial = ca.serial_hex(old.serial_number)

    def allowed(reg: Registry) -> Entry:
        entry = reg.by_serial(serial)
        if entry is None:
            raise UompError(ErrorCode.CA_ERROR, f"renewal refused: certificate {serial} is not in this CA's registry")
        if entry.agent_id != agent_id:
            raise UompError(ErrorCode.CA_ERROR, f"renewal refused: certificate {serial} does not match the registry")
        if entry.status == "revoked":
            raise UompError(ErrorCode.CA_ERROR, f"renewal refused: certificate {serial} was revoked")
        if reg.renewals_since(agent_id, epoch(now - rate_window)) >= max_per_agent:
            raise UompError(
                ErrorCode.RATE_LIMITED,
                f"renewal refused: agent {agent_id} already renewed {max_per_agent} "
                f"times in the last {int(rate_window.total_seconds())} s",
            )
        return entry

    with registry(paths) as reg:
        allowed(reg)  # fail early, without the lock, before parsing a CSR
    subject_key: x509.CertificateSigningRequest | ca.AgentPublicKey
    if csr is not None:
        subject_key = ca.load_csr(csr)
    else:
        pub = old.public_key()
        if not isinstance(pub, ca.AgentPublicKey):
            raise UompError(ErrorCode.CA_ERROR, "renewal refused: unsupported key type")
        subject_key = pub
    return ca.cert_pem(_issue(paths, agent_id, subject_key, lifetime, now, renewed_from=serial, precheck=allowed))


# --------------------------------------------------------------------------------- revoking


@dataclass(frozen=True)
class Revocation:
    """What ``revoke`` did: the serials revoked now, and every certificate the target covers (already
    revoked ones included) with the key bindings tokens carry, so their sessions can be found."""

    revoked: list[str]
    serials: list[str]
    agent_ids: list[str]
    jkts: list[str]
    x5ts: list[str]


def revoke_target(paths: Paths, target: str, *, now: dt.datetime | None = None) -> Revocation:
    """Revoke by agent id (all its certificates) or by serial (that certificate and every
    certificate renewed from it, transitively: a thief who renewed a leaked certificate loses the
    renewals too).

    ``target`` may be prefixed ``agent:`` or ``serial:`` to remove any doubt; bare, it is an agent
    id if some certificate was issued to that id, else a serial. A new CRL is signed and written on
    every call (atomically), even when nothing new was revoked.
    """
    now = ca.aware_utc(now)
    kind: str | None = None
    value = target.strip()
    for prefix in ("agent:", "serial:"):
        if value.startswith(prefix):
            kind, value = prefix[:-1], value[len(prefix) :]
    with locked(paths):
        key, cert = load_ca(paths)
        with registry(paths, write=True) as reg:
            agent_rows = reg.of_agent(value) if kind != "serial" else []
            serial_rows: list[Entry] = []
            if kind != "agent":
                try:
                    wanted = ca.serial_hex(ca.parse_serial(value.rstrip(".…")))  # `3f…` as listed
                except UompError:
                    if kind == "serial":
                        raise
                else:
                    if reg.by_serial(wanted) is None and not agent_rows:
                        wanted = _serial_from_prefix(reg, value) or wanted
                    if reg.by_serial(wanted) is not None:
                        serial_rows = reg.descendants(wanted)
            if agent_rows and serial_rows:
                raise UompError(
                    ErrorCode.CA_ERROR,
                    f"{value!r} is both an agent id and a serial; say 'agent:{value}' or 'serial:{value}'",
                )
            rows = agent_rows or serial_rows
            if not rows:
                raise UompError(ErrorCode.CA_ERROR, f"no certificate issued to agent or with serial {value!r}")
            done = [e.serial for e in rows if e.status == "active"]
            reg.revoke(done, epoch(now))
            pem = _prepare_crl(paths, key, cert, reg, now)
        atomic_write(crl_path(paths), pem, mode=0o644)
    return Revocation(
        revoked=done,
        serials=[e.serial for e in rows],
        agent_ids=sorted({e.agent_id for e in rows}),
        jkts=sorted({e.jkt for e in rows if e.jkt}),
        x5ts=sorted({e.x5t for e in rows if e.x5t}),
    )


MIN_SERIAL_PREFIX = 4  # hex digits: fewer would too easily name a certificate nobody meant


def _serial_from_prefix(reg: Registry, value: str) -> str | None:
    """The one serial that starts with ``value`` (as ``uomp agent list`` prints them, ``3f…``), None
    when none does; CA_ERROR when several do."""
    prefix = value.lower().removeprefix("0x").rstrip(".…")
    if len(prefix) < MIN_SERIAL_PREFIX or any(c not in "0123456789abcdef" for c in prefix):
        return None
    hits = sorted(e.serial for e in reg.all() if e.serial.startswith(prefix))
    if len(hits) > 1:
        raise UompError(
            ErrorCode.CA_ERROR,
            f"serial prefix {value!r} matches {len(hits)} certificates "
            f"({', '.join(h[:12] + '…' for h in hits[:5])}); give more digits",
        )
    return hits[0] if hits else None


def revoke(paths: Paths, target: str, *, now: dt.datetime | None = None) -> list[str]:
    """:func:`revoke_target`; the serials revoked now (hex)."""
    return revoke_target(paths, target, now=now).revoked


# ---------------------------------------------------------------------------------- listing


@dataclass(frozen=True)
class AgentRow:
    agent_id: str
    serial: str
    not_after: dt.datetime
    status: str  # "active", "revoked", or "expired" (active in the registry but past notAfter)
    revoked_at: dt.datetime | None
    renewed_from: str | None = None


def list_agents(paths: Paths, *, now: dt.datetime | None = None) -> list[AgentRow]:
    """Every certificate in the registry, by agent id then expiry."""
    now = ca.aware_utc(now)
    load_ca_cert(paths)
    rows: list[AgentRow] = []
    with registry(paths) as reg:
        entries = reg.all()
    for e in entries:
        not_after = from_epoch(e.not_after)
        status = e.status
        if status == "active" and not_after < now:
            status = "expired"
        rows.append(
            AgentRow(
                e.agent_id,
                e.serial,
                not_after,
                status,
                from_epoch(e.revoked_at) if e.revoked_at is not None else None,
                e.renewed_from,
            )
        )
    rows.sort(key=lambda r: (r.agent_id, r.not_after))
    return rows


def revoked_serials(paths: Paths) -> set[int]:
    """Serials on the current CRL file (what a gateway that reloaded it now refuses)."""
    crl = x509.load_pem_x509_crl(_read(crl_path(paths), ErrorCode.CA_ERROR, "CRL"))
    return {r.serial_number for r in crl}
