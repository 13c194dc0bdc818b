"""The user's certificate authority on disk, under ``$UOMP_HOME/ca`` (0700).

Files:

* ``ca.key`` (0600), ``ca.crt``: the CA (:func:`gateway.core.ca.create_ca`). Made once; never
  regenerated: a CA key that exists but cannot be read is a ``KEY_ERROR`` naming the file, because
  a new CA would orphan every agent certificate and the gateway certificate;
* ``gateway.key`` (0600), ``gateway.crt``: the gateway's TLS server certificate;
* ``crl.pem``: the CRL. Always present once the CA exists (an empty CRL at first), because the
  gateway's TLS context checks every client certificate against it and fails closed without one.
  Re-signed on every revocation and whenever it gets within :data:`CRL_REFRESH_BEFORE` of its
  ``nextUpdate`` (:func:`refresh_crl`; the gateway calls it from its TLS watcher);
* ``issued.json`` (0600): the registry of issued agent certificates (serial hex, agent id,
  validity, status ``active``/``revoked``, ``revoked_at``) and the last CRL number;
* ``.lock``: an ``fcntl`` lock held around every read-modify-write of the registry and the CRL,
  so two ``uomp`` processes (or the CLI and the gateway's renewal route) never lose an update.

Every write is atomic (:func:`gateway.fsutil.atomic_write`). The registry is written before the CRL:
the registry is the truth, and :func:`refresh_crl` rebuilds a CRL that disagrees with it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509

from gateway.config import Paths
from gateway.core import ca
from gateway.errors import UompError
from gateway.fsutil import atomic_write, ensure_private_dir

REGISTRY_VERSION = 1
# Re-sign the CRL when less than this is left before its nextUpdate (CRL validity is 7 days).
CRL_REFRESH_BEFORE = dt.timedelta(days=4)
# Re-issue the gateway certificate when less than this is left.
SERVER_CERT_RENEW_BEFORE = dt.timedelta(days=30)
# Registry rows are dropped this long after their certificate expired (they can no longer be used
# or renewed, and an expired certificate needs no CRL entry).
REGISTRY_RETENTION = dt.timedelta(days=30)
# A revoked certificate stays on the CRL until this long after its notAfter (clock skew margin).
CRL_KEEP_AFTER_EXPIRY = dt.timedelta(days=1)
_RESTORE_KEY = (
    "restore the CA key (or remove the ca directory deliberately: every certificate it issued dies)"
)


# ------------------------------------------------------------------------------------ paths


def ca_key_path(paths: Paths) -> Path:
    return paths.ca_dir / "ca.key"


def ca_cert_path(paths: Paths) -> Path:
    return paths.ca_dir / "ca.crt"


def server_key_path(paths: Paths) -> Path:
    return paths.ca_dir / "gateway.key"


def server_cert_path(paths: Paths) -> Path:
    return paths.ca_dir / "gateway.crt"


def crl_path(paths: Paths) -> Path:
    return paths.ca_dir / "crl.pem"


def registry_path(paths: Paths) -> Path:
    return paths.ca_dir / "issued.json"


@contextlib.contextmanager
def _locked(paths: Paths) -> Iterator[None]:
    ensure_private_dir(paths.ca_dir)
    fd = os.open(paths.ca_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


# ------------------------------------------------------------------------------ file loading


def _read(path: Path, code: str, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UompError(code, f"cannot read {what} {path}: {exc.strerror}") from exc


def _load_key_file(path: Path, what: str) -> ca.CAPrivateKey:
    data = _read(path, "KEY_ERROR", what)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise UompError("KEY_ERROR", f"{path} is readable by others (mode {mode:o}); chmod 600 it")
    try:
        return ca.load_private_key(data)
    except (ValueError, TypeError) as exc:
        raise UompError(
            "KEY_ERROR",
            f"{path} exists but is not a readable P-256/Ed25519 PEM private key; fix or restore it: "
            f"the {what} is never regenerated silently",
        ) from exc


def _load_cert_file(path: Path, what: str) -> x509.Certificate:
    data = _read(path, "CA_ERROR", what)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise UompError("CA_ERROR", f"{path} exists but is not a readable PEM certificate ({what})") from exc


def load_ca(paths: Paths) -> tuple[ca.CAPrivateKey, x509.Certificate]:
    """The CA key and certificate; CA_ERROR/KEY_ERROR naming the file when missing or broken."""
    kp, cp = ca_key_path(paths), ca_cert_path(paths)
    if not kp.exists() and not cp.exists():
        raise UompError("CA_ERROR", f"no CA in {paths.ca_dir}; run 'uomp ca init' (or 'uomp init')")
    try:
        key = _load_key_file(kp, "CA key")
    except FileNotFoundError as exc:
        raise UompError("KEY_ERROR", f"{kp} is missing but {cp} exists; {_RESTORE_KEY}") from exc
    try:
        cert = _load_cert_file(cp, "CA certificate")
    except FileNotFoundError as exc:
        raise UompError("CA_ERROR", f"{cp} is missing; run 'uomp ca init' to re-make it from {kp}") from exc
    try:
        ca.check_ca_pair(key, cert)
    except UompError as exc:
        raise UompError("CA_ERROR", f"{cp} and {kp}: {exc.message}") from exc
    return key, cert


def load_ca_cert(paths: Paths) -> x509.Certificate:
    """The CA certificate alone (no private key read)."""
    try:
        return _load_cert_file(ca_cert_path(paths), "CA certificate")
    except FileNotFoundError as exc:
        raise UompError("CA_ERROR", f"no CA in {paths.ca_dir}; run 'uomp ca init' (or 'uomp init')") from exc


# --------------------------------------------------------------------------------- registry


def _ts(value: dt.datetime) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_ts(value: Any) -> dt.datetime:
    if not isinstance(value, str):
        raise ValueError("timestamp is not a string")
    parsed = dt.datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise ValueError("timestamp has no time zone")
    return parsed


@dataclass
class _Entry:
    serial: str
    agent_id: str
    not_before: str
    not_after: str
    issued_at: str
    status: str  # "active" | "revoked"
    revoked_at: str | None = None
    renewed_from: str | None = None


@dataclass
class _Registry:
    crl_number: int
    entries: list[_Entry]

    def by_serial(self, serial: str) -> _Entry | None:
        for e in self.entries:
            if e.serial == serial:
                return e
        return None


def _load_registry(paths: Paths) -> _Registry:
    path = registry_path(paths)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return _Registry(0, [])
    except OSError as exc:
        raise UompError("CA_ERROR", f"cannot read {path}: {exc.strerror}") from exc
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("version") != REGISTRY_VERSION:
            raise ValueError("unknown registry version")
        number = doc.get("crl_number", 0)
        certs = doc.get("certs", [])
        if not isinstance(number, int) or not isinstance(certs, list):
            raise ValueError("bad registry shape")
        entries: list[_Entry] = []
        for row in certs:
            if not isinstance(row, dict):
                raise ValueError("registry row is not an object")
            entry = _Entry(**row)
            if entry.status not in ("active", "revoked"):
                raise ValueError("bad status")
            ca.parse_serial(entry.serial)
            _parse_ts(entry.not_after)
            entries.append(entry)
    except (ValueError, TypeError, UompError) as exc:
        raise UompError("CA_ERROR", f"{path} is not a valid certificate registry; fix or restore it") from exc
    return _Registry(number, entries)


def _save_registry(paths: Paths, reg: _Registry, now: dt.datetime) -> None:
    cutoff = now - REGISTRY_RETENTION
    reg.entries = [e for e in reg.entries if _parse_ts(e.not_after) >= cutoff]
    doc = {
        "version": REGISTRY_VERSION,
        "crl_number": reg.crl_number,
        "certs": [e.__dict__ for e in reg.entries],
    }
    atomic_write(registry_path(paths), (json.dumps(doc, indent=1) + "\n").encode(), mode=0o600)


def _revoked_for_crl(reg: _Registry, now: dt.datetime) -> list[tuple[int, dt.datetime]]:
    out: list[tuple[int, dt.datetime]] = []
    for e in reg.entries:
        if e.status == "revoked" and _parse_ts(e.not_after) + CRL_KEEP_AFTER_EXPIRY >= now:
            out.append((ca.parse_serial(e.serial), _parse_ts(e.revoked_at or e.issued_at)))
    return out


def _write_crl(paths: Paths, key: ca.CAPrivateKey, cert: x509.Certificate, reg: _Registry,
               now: dt.datetime) -> None:
    """Sign and write a new CRL from the registry; the CRL number only ever goes up."""
    number = reg.crl_number + 1
    with contextlib.suppress(OSError, ValueError):
        current = x509.load_pem_x509_crl(crl_path(paths).read_bytes())
        number = max(number, ca.crl_number(current) + 1)
    reg.crl_number = number
    crl = ca.build_crl(key, cert, _revoked_for_crl(reg, now), now, number=number)
    _save_registry(paths, reg, now)
    atomic_write(crl_path(paths), ca.crl_pem(crl), mode=0o644)


def _crl_needs_refresh(paths: Paths, cert: x509.Certificate, reg: _Registry, now: dt.datetime,
                       min_remaining: dt.timedelta) -> bool:
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
    wanted = {serial for serial, _ in _revoked_for_crl(reg, now)}
    return not wanted <= listed  # a revocation the CRL does not show yet (crash between writes)


def refresh_crl(paths: Paths, *, now: dt.datetime | None = None,
                min_remaining: dt.timedelta = CRL_REFRESH_BEFORE) -> bool:
    """Re-sign the CRL if it is missing, stale-soon, or behind the registry. True when re-signed.

    Cheap when nothing is due (reads two small files, one signature check), so the gateway can call
    it from its TLS watcher every few seconds.
    """
    now = ca.aware_utc(now)
    cert = load_ca_cert(paths)
    if not _crl_needs_refresh(paths, cert, _load_registry(paths), now, min_remaining):
        return False
    with _locked(paths):
        key, cert = load_ca(paths)
        reg = _load_registry(paths)
        if not _crl_needs_refresh(paths, cert, reg, now, min_remaining):
            return False
        _write_crl(paths, key, cert, reg, now)
    return True


# ------------------------------------------------------------------------------------ init


def _ensure_server_cert(paths: Paths, key: ca.CAPrivateKey, cert: x509.Certificate,
                        hostnames: Sequence[str], now: dt.datetime) -> bool:
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
        server_key = _load_key_file(kp, "gateway key")
    else:
        server_key = ca.new_key("p256")
        atomic_write(kp, ca.key_pem(server_key), mode=0o600)
    server_cert = ca.issue_server_cert(key, cert, server_key.public_key(), names, now=now)
    atomic_write(cp, ca.cert_pem(server_cert), mode=0o644)
    return True


def init_all(paths: Paths, hostnames: Sequence[str] = (), *, now: dt.datetime | None = None,
             key_type: ca.KeyType = "p256") -> dict[str, bool]:
    """Create what is missing: CA, gateway certificate, CRL, registry. ``{what: created?}``.

    Idempotent. Never regenerates an existing CA key; a file that exists but cannot be read is an
    error naming it. A missing ``ca.crt`` next to a good ``ca.key`` is re-made from that key (same
    subject, same key identifier: everything it issued still chains to it).
    """
    now = ca.aware_utc(now)
    ca.wanted_server_names(hostnames)  # validate before touching anything
    ensure_private_dir(paths.home)
    with _locked(paths):
        kp, cp = ca_key_path(paths), ca_cert_path(paths)
        created = False
        if kp.exists():
            if not cp.exists():
                key = _load_key_file(kp, "CA key")
                _, remade = ca.create_ca(key, now=now)
                atomic_write(cp, ca.cert_pem(remade), mode=0o644)
            key, cert = load_ca(paths)
        elif cp.exists():
            raise UompError("KEY_ERROR", f"{kp} is missing but {cp} exists; {_RESTORE_KEY}")
        else:
            key, cert = ca.create_ca(key_type=key_type, now=now)
            # Key first: a crash after it leaves a key whose certificate the next init re-makes.
            atomic_write(kp, ca.key_pem(key), mode=0o600)
            atomic_write(cp, ca.cert_pem(cert), mode=0o644)
            created = True
        server = _ensure_server_cert(paths, key, cert, hostnames, now)
        reg = _load_registry(paths)
        crl_new = False
        if _crl_needs_refresh(paths, cert, reg, now, CRL_REFRESH_BEFORE):
            _write_crl(paths, key, cert, reg, now)
            crl_new = True
        elif not registry_path(paths).exists():
            _save_registry(paths, reg, now)
    return {"agent CA": created, "gateway server certificate": server, "CRL": crl_new}


def init_ca(paths: Paths, hostnames: Sequence[str] = (), *, now: dt.datetime | None = None) -> bool:
    """:func:`init_all`; True when a new CA was created."""
    return init_all(paths, hostnames, now=now)["agent CA"]


# ---------------------------------------------------------------------------------- issuing


def _issue(paths: Paths, agent_id: str, subject_key: x509.CertificateSigningRequest | ca.AgentPublicKey,
           lifetime: dt.timedelta, now: dt.datetime, renewed_from: str | None = None,
           precheck: Callable[[_Registry], None] | None = None) -> x509.Certificate:
    with _locked(paths):
        key, cert = load_ca(paths)
        reg = _load_registry(paths)
        if precheck is not None:
            precheck(reg)  # under the lock: a revocation cannot slip in between check and issue
        issued = ca.issue_agent_cert(key, cert, subject_key, agent_id, lifetime, now)
        reg.entries.append(
            _Entry(
                serial=ca.serial_hex(issued.serial_number),
                agent_id=agent_id,
                not_before=_ts(issued.not_valid_before_utc),
                not_after=_ts(issued.not_valid_after_utc),
                issued_at=_ts(now),
                status="active",
                renewed_from=renewed_from,
            )
        )
        _save_registry(paths, reg, now)
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


def issue_with_key(paths: Paths, agent_id: str, out_dir: Path | str,
                   lifetime: dt.timedelta = ca.AGENT_CERT_LIFETIME, *, key_type: ca.KeyType = "p256",
                   now: dt.datetime | None = None) -> IssuedFiles:
    """Make (or reuse) ``out_dir/agent.key`` and write ``agent.crt`` and ``ca.crt`` beside it.

    An existing ``agent.key`` is reused, so running this again renews the certificate for the same
    key; an unreadable one is a KEY_ERROR, never silently replaced.
    """
    now = ca.aware_utc(now)
    ca.validate_agent_id(agent_id)
    out = ensure_private_dir(Path(out_dir))
    kf, cf, caf = out / "agent.key", out / "agent.crt", out / "ca.crt"
    new_key = not kf.exists()
    if new_key:
        agent_key = ca.new_key(key_type)
    else:
        agent_key = _load_key_file(kf, "agent key")
    cert = _issue(paths, agent_id, agent_key.public_key(), lifetime, now)
    if new_key:
        atomic_write(kf, ca.key_pem(agent_key), mode=0o600)
    atomic_write(cf, ca.cert_pem(cert), mode=0o644)
    atomic_write(caf, ca.cert_pem(load_ca_cert(paths)), mode=0o644)
    return IssuedFiles(out, kf, cf, caf, ca.serial_hex(cert.serial_number), cert.not_valid_after_utc, new_key)


def renew(paths: Paths, presented: bytes, csr: bytes | None = None,
          lifetime: dt.timedelta = ca.AGENT_CERT_LIFETIME, now: dt.datetime | None = None) -> bytes:
    """A new certificate for the agent of ``presented`` (PEM or DER): the certificate, PEM.

    ``presented`` must be an agent certificate issued by this CA, in the registry, not revoked and
    valid now. The new certificate has the same agent id and, without a CSR, the same public key;
    with a CSR (signature verified) the CSR's key (key rotation).
    """
    now = ca.aware_utc(now)
    old = ca.load_cert(presented)
    _, ca_cert = load_ca(paths)
    if not ca.is_issued_by(old, ca_cert):
        raise UompError("CA_ERROR", "renewal refused: the presented certificate was not issued by this CA")
    agent_id = ca.agent_id_from_cert(old)
    if agent_id is None or not ca.has_client_auth(old):
        raise UompError("CA_ERROR", "renewal refused: the presented certificate is not an agent certificate")
    serial = ca.serial_hex(old.serial_number)

    def registered_and_not_revoked(reg: _Registry) -> None:
        entry = reg.by_serial(serial)
        if entry is None:
            raise UompError("CA_ERROR", f"renewal refused: certificate {serial} is not in this CA's registry")
        if entry.agent_id != agent_id:
            raise UompError("CA_ERROR", f"renewal refused: certificate {serial} does not match the registry")
        if entry.status == "revoked":
            raise UompError("CA_ERROR", f"renewal refused: certificate {serial} was revoked")

    registered_and_not_revoked(_load_registry(paths))  # fail early, before parsing a CSR
    if now < old.not_valid_before_utc:
        raise UompError("CA_ERROR", "renewal refused: the presented certificate is not valid yet")
    if now > old.not_valid_after_utc:
        raise UompError("CA_ERROR", "renewal refused: the presented certificate has expired; "
                        "issue a new one with 'uomp agent issue'")
    subject_key: x509.CertificateSigningRequest | ca.AgentPublicKey
    if csr is not None:
        subject_key = ca.load_csr(csr)
    else:
        pub = old.public_key()
        if not isinstance(pub, ca.AgentPublicKey):
            raise UompError("CA_ERROR", "renewal refused: unsupported key type")
        subject_key = pub
    return ca.cert_pem(_issue(paths, agent_id, subject_key, lifetime, now, renewed_from=serial,
                              precheck=registered_and_not_revoked))


# --------------------------------------------------------------------------------- revoking


def revoke(paths: Paths, target: str, *, now: dt.datetime | None = None) -> list[str]:
    """Revoke by agent id (all its active certificates) or serial; the serials revoked (hex).

    ``target`` may be prefixed ``agent:`` or ``serial:`` to remove any doubt; bare, it is an agent
    id if some certificate was issued to that id, else a serial. A new CRL is signed and written on
    every call (atomically), even when nothing new was revoked.
    """
    now = ca.aware_utc(now)
    kind: str | None = None
    value = target.strip()
    for prefix in ("agent:", "serial:"):
        if value.startswith(prefix):
            kind, value = prefix[:-1], value[len(prefix):]
    with _locked(paths):
        key, cert = load_ca(paths)
        reg = _load_registry(paths)
        agent_rows = [e for e in reg.entries if e.agent_id == value] if kind != "serial" else []
        serial_rows: list[_Entry] = []
        if kind != "agent":
            try:
                wanted = ca.serial_hex(ca.parse_serial(value))
            except UompError:
                if kind == "serial":
                    raise
            else:
                serial_rows = [e for e in reg.entries if e.serial == wanted]
        if agent_rows and serial_rows:
            raise UompError("CA_ERROR", f"{value!r} is both an agent id and a serial; "
                            f"say 'agent:{value}' or 'serial:{value}'")
        rows = agent_rows or serial_rows
        if not rows:
            raise UompError("CA_ERROR", f"no certificate issued to agent or with serial {value!r}")
        done: list[str] = []
        for e in rows:
            if e.status == "active":
                e.status = "revoked"
                e.revoked_at = _ts(now)
                done.append(e.serial)
        _write_crl(paths, key, cert, reg, now)
    return done


# ---------------------------------------------------------------------------------- listing


@dataclass(frozen=True)
class AgentRow:
    agent_id: str
    serial: str
    not_after: dt.datetime
    status: str  # "active", "revoked", or "expired" (active in the registry but past notAfter)
    revoked_at: dt.datetime | None


def list_agents(paths: Paths, *, now: dt.datetime | None = None) -> list[AgentRow]:
    """Every certificate in the registry, by agent id then expiry."""
    now = ca.aware_utc(now)
    load_ca_cert(paths)
    rows: list[AgentRow] = []
    for e in _load_registry(paths).entries:
        not_after = _parse_ts(e.not_after)
        status = e.status
        if status == "active" and not_after < now:
            status = "expired"
        rows.append(AgentRow(e.agent_id, e.serial, not_after, status,
                             _parse_ts(e.revoked_at) if e.revoked_at else None))
    rows.sort(key=lambda r: (r.agent_id, r.not_after))
    return rows


def revoked_serials(paths: Paths) -> set[int]:
    """Serials on the current CRL file (what a gateway that reloaded it now refuses)."""
    crl = x509.load_pem_x509_crl(_read(crl_path(paths), "CA_ERROR", "CRL"))
    return {r.serial_number for r in crl}


def hostnames_from(values: Iterable[str]) -> list[str]:
    """Host names/addresses from config values (plain names or URLs such as https://host:9443)."""
    out: list[str] = []
    for v in values:
        v = v.strip()
        if not v:
            continue
        if "://" in v:
            host = urlsplit(v).hostname or ""
        else:
            host = v
        if host and host not in ("0.0.0.0", "::") and host not in out:  # noqa: S104 - not binding
            out.append(host)
    return out
