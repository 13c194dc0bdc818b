"""TLS for the gateway: the server context (the agent's client context is :mod:`gateway.client.tls`).

Spec §15.2: gateway and remote agent MUST use TLS 1.3, and the gateway SHOULD use mTLS with a
client certificate issued by the user. The user's own CA (:mod:`gateway.ca_store`) issues those
certificates; this module turns its files (``ca.crt``, ``crl.pem``, ``gateway.crt``/``.key``) into
``ssl.SSLContext`` objects that asyncio's (and uvloop's) TLS transports can use, and reloads them without
a restart.

Who enforces what on a client certificate:

* OpenSSL, during the handshake: chain to the user CA (and only it), signature, RFC 5280
  strictness, and the ``sslclient`` purpose: OpenSSL sets that purpose itself when a server
  verifies a client, so a certificate whose EKU lacks clientAuth (the gateway's own server
  certificate, say) fails the handshake with "unsuitable certificate purpose". It does NOT check
  time or revocation (``X509_V_FLAG_NO_CHECK_TIME``, no CRL flag): a certificate of ours that is
  revoked, expired or not yet valid completes the handshake so that its holder can be told why, by
  name, in a JSON 401 at its first request (OpenSSL's alert cannot be flushed on asyncio/uvloop,
  and Python's ``ssl`` has no verify callback to read the refused certificate);
* :func:`judge`, per connection and per request (:func:`gateway.remote.identity.judged_memo`, the one
  entry point): the validity period, the CRL's serials (:class:`Trust`, swapped whole on reload), the
  CRL's own nextUpdate and the CA's validity period (a CA that expires while the gateway runs);
  refusals are :class:`CertRefused` (code CERT_REQUIRED, a ``reason`` and the certificate named);
* :func:`check_client_cert` / :class:`ClientCertChecker`: a certificate with *no* EKU extension
  passes OpenSSL's purpose check, and Python cannot set ``X509_PURPOSE`` on a context, so the
  gateway itself requires clientAuth, exactly one ``uomp://agent/<id>`` URI SAN and a supported key
  type. It yields the agent id, the serial and the RFC 8705 ``x5t#S256`` thumbprint.
* at load (start and every reload, :meth:`TLSReloader._load`): the CA certificate must be within
  its validity period and the CRL signed by it (OpenSSL no longer reads the CRL): an expired CA or a
  foreign CRL refuses the start, and a reload keeps the previous context.

Longer than ~500 lines on purpose: the server context's flags, the judgement of what they leave
out (:func:`judge`, :class:`Trust`) and the reloader that builds both from the same CA and CRL files
change together; the split is by section below.

Reload without dropping connections (:class:`TLSReloader`): the listening socket keeps one
"front" context for its whole life; its SNI callback (which OpenSSL runs for every ClientHello,
with or without a server name) points each new handshake at the *current* inner context, whose
certificate, key, CA and CRL are then the ones used. Connections already established keep the
context they were made with, so nothing live is dropped. ``watch()`` reloads when a file changes
(``uomp agent revoke`` writes a new CRL), ``install_sighup()`` reloads on SIGHUP. A CRL older than
the newest one accepted (lower CRL Number or earlier thisUpdate: a pre-revocation backup put back)
is refused, on reload and at start; the newest (number, thisUpdate) is kept in a state file
(``$UOMP_HOME/gateway/crl-state.json``) so a restart remembers it. A CRL received from home over
the uplink (:meth:`TLSReloader.install_crl`) passes the same rule, and the agent CA's signature.

A little over ~500 lines: the server context, the client-certificate check and the reloader with
its CRL rules are one decision (who may open the agent listener); split, each part would need the
others' invariants restated.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
import math
import os
import signal
import ssl
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from gateway.atrest import vault
from gateway.core import ca, jose
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import Stamps, atomic_write, stamps

log = logging.getLogger(__name__)

StrPath = str | os.PathLike[str]

# Parsed client certificates kept per checker (keyed by SHA-256 of the DER).
CLIENT_CERT_CACHE_ENTRIES = 4096
# OpenSSL's X509_V_FLAG_NO_CHECK_TIME (x509_vfy.h): no validity-period check of any certificate or
# CRL in the chain. Python's ``ssl`` has no name for it and passes the bit through verify_flags.
X509_V_FLAG_NO_CHECK_TIME = 0x200000


# ------------------------------------------------------------------------------- contexts


def build_server_context(
    cert_file: StrPath,
    key_file: StrPath,
    ca_file: StrPath,
    crl_file: StrPath,
    *,
    require_client_cert: bool = False,
    session_tickets: int = 0,
) -> ssl.SSLContext:
    """The gateway's server context. Every setting is here and nowhere else. ``session_tickets``:
    TLS 1.3 tickets sent after a full handshake (0: no resumption; see the comment below)."""
    # Server side only; PROTOCOL_TLS_SERVER refuses to be used as a client by mistake.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # Spec §15.2: "Gateway and remote Agent MUST use TLS 1.3" (RFC 8446). Pinning both ends means a
    # TLS 1.2 ClientHello is refused with protocol_version, never downgraded.
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    # Our certificate (issued by the user CA, EKU serverAuth) and its key.
    with vault.ssl_key_file(Path(os.fspath(key_file))) as (keyfile, password):  # sealed: opened in memory only
        ctx.load_cert_chain(certfile=os.fspath(cert_file), keyfile=keyfile, password=password)
    # Trust anchors for CLIENT certificates: the user's agent CA and nothing else. A server context
    # starts with an empty store; we never call load_default_certs(), so a certificate from any
    # public CA is "unable to get local issuer certificate".
    ctx.load_verify_locations(cafile=os.fspath(ca_file))
    # No time and no revocation check in OpenSSL (see the module docstring): a certificate that
    # chains to our CA completes the handshake, and judge() refuses it by name at its first request
    # when it is revoked (RFC 5280 §6.3), expired or not yet valid. NO_CHECK_TIME also skips the
    # CA's own validity period, which TLSReloader checks at load and judge() on every connection.
    # ``crl_file`` is read by TLSReloader (its serials, signature and nextUpdate), not by OpenSSL.
    ctx.verify_flags |= X509_V_FLAG_NO_CHECK_TIME
    # RFC 5280 strictness in OpenSSL (AKI/SKI present, positive serials, well-formed extensions...):
    # our CA builds conforming certificates, so anything non-conforming is not ours.
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    # CERT_OPTIONAL (default): the server asks for a certificate (RFC 8446 §4.3.2 CertificateRequest);
    # a client that sends none still completes the handshake so the gateway can answer a JSON 401
    # CERT_REQUIRED and audit it; a client that sends one gets its chain and purpose verified and
    # the handshake fails if they are bad. CERT_REQUIRED refuses certificate-less
    # clients at the TLS layer (alert certificate_required, RFC 8446 §6.2).
    ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    # No TLS compression (CRIME); TLS 1.3 has none anyway (RFC 8446 §4.1.2), stated for older libs.
    ctx.options |= ssl.OP_NO_COMPRESSION
    # No renegotiation: TLS 1.3 removed it (RFC 8446 §4.1.2 note); set so nothing changes if the
    # version pin is ever relaxed.
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    # Session tickets (RFC 8446 §4.6.1, §2.2; GatewayConfig.tls_session_tickets, default 1): a
    # returning agent resumes with PSK + (EC)DHE (forward secrecy kept), skipping the certificate
    # exchange and its signatures (benchmarks/bench_handshake.py: the server's CPU per connection).
    # A resumed session skips client certificate *verification*: a certificate revoked (new CRL) or
    # expired since the first handshake resumes at the TLS layer. It gets no further: every request
    # re-checks the peer certificate (kept in the session) against the live CRL's serials and its
    # validity period (judge(), remote/identity.py), as it does for a full handshake, so it is
    # refused at its first request (tests/remote/test_tls.py). Ticket keys belong to the listening
    # context (the SNI switch to a reloaded context keeps them) and die with the process.
    ctx.num_tickets = max(0, int(session_tickets))
    return ctx


# -------------------------------------------------------------------- client certificates


@dataclass(frozen=True)
class ClientIdentity:
    """What the gateway learns from a verified client certificate."""

    agent_id: str
    serial: str  # lower-case hex, ca.serial_hex
    x5t_s256: str  # RFC 8705 certificate thumbprint (token cnf binding)
    jkt: str  # RFC 7638 thumbprint of the certificate's public key (token cnf / DPoP binding)
    not_before: dt.datetime
    not_after: dt.datetime


def _static_identity(der: bytes) -> ClientIdentity:
    """Everything that does not depend on the clock; raises CERT_REQUIRED."""
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise UompError(ErrorCode.CERT_REQUIRED, "the client certificate cannot be parsed") from exc
    if not ca.has_client_auth(cert):
        raise UompError(
            ErrorCode.CERT_REQUIRED,
            "the client certificate is not for client authentication (no clientAuth extended key usage)",
        )
    agent_id = ca.agent_id_from_cert(cert)
    if agent_id is None:
        raise UompError(
            ErrorCode.CERT_REQUIRED, "the client certificate names no agent (needs one uomp://agent/<id> URI SAN)"
        )
    pub = cert.public_key()
    unsupported = "the client certificate key type is not supported (P-256 or Ed25519)"
    if not isinstance(pub, ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey):
        raise UompError(ErrorCode.CERT_REQUIRED, unsupported)
    try:
        jkt = jose.key_thumbprint(pub)
    except UompError as exc:
        raise UompError(ErrorCode.CERT_REQUIRED, unsupported) from exc
    return ClientIdentity(
        agent_id=agent_id,
        serial=ca.serial_hex(cert.serial_number),
        x5t_s256=jose.cert_thumbprint(der),
        jkt=jkt,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
    )


REFUSAL_REASONS = ("revoked", "expired", "not_yet_valid", "ca_invalid", "crl_expired")


class CertRefused(UompError):
    """A client certificate of our CA refused after the handshake: CERT_REQUIRED (401) with a
    machine-readable ``reason`` (one of :data:`REFUSAL_REASONS`) and the certificate named
    (agent, serial) in the message and in ``details``."""

    reason: str

    def __init__(self, reason: str, message: str, ident: ClientIdentity) -> None:
        super().__init__(
            ErrorCode.CERT_REQUIRED,
            message,
            details={"agent_id": ident.agent_id, "serial": ident.serial},
            reason=reason,
        )
        self.identity = ident


@dataclass(frozen=True)
class Trust:
    """What :func:`judge` compares a certificate with: the CRL's revoked serials (hex) and their
    revocation dates, the CRL's nextUpdate and the CA's validity period. Replaced whole on reload."""

    revoked: frozenset[str] = frozenset()
    revoked_at: Mapping[str, dt.datetime] = field(default_factory=dict)
    crl_next_update: dt.datetime | None = None
    ca_not_before: dt.datetime | None = None
    ca_not_after: dt.datetime | None = None
    # (start, end) epoch seconds of :meth:`open_at`, computed once (it runs on every request)
    _window: tuple[float, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        start = self.ca_not_before.timestamp() if self.ca_not_before is not None else -math.inf
        ends = [t.timestamp() for t in (self.ca_not_after, self.crl_next_update) if t is not None]
        object.__setattr__(self, "_window", (start, min(ends, default=math.inf)))

    def open_at(self, now: float) -> bool:
        """The CA is within its validity period and the CRL not past its nextUpdate at ``now`` (epoch)."""
        start, end = self._window
        return start <= now <= end


NO_TRUST_LIMITS = Trust()


def _day(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def judge(ident: ClientIdentity, trust: Trust = NO_TRUST_LIMITS, now: dt.datetime | None = None) -> None:
    """Refuse (:class:`CertRefused`) a certificate that is revoked, expired or not yet valid, or
    that cannot be checked now (the CA outside its validity period, the CRL past its nextUpdate)."""
    now = ca.utcnow() if now is None else now
    named = f"the client certificate (agent {ident.agent_id}, serial 0x{ident.serial})"
    if ident.serial in trust.revoked:
        when = trust.revoked_at.get(ident.serial)
        on = f" on {_day(when)}" if when is not None else ""
        raise CertRefused("revoked", f"{named} was revoked{on}; ask the user for a new one", ident)
    if now > ident.not_after:
        raise CertRefused("expired", f"{named} expired on {_day(ident.not_after)}; ask the user for a new one", ident)
    if now < ident.not_before:
        raise CertRefused(
            "not_yet_valid",
            f"{named} is not valid before {_day(ident.not_before)}; check the clock of this machine and the gateway's",
            ident,
        )
    if (trust.ca_not_after is not None and now > trust.ca_not_after) or (
        trust.ca_not_before is not None and now < trust.ca_not_before
    ):
        raise CertRefused(
            "ca_invalid",
            f"{named} is from the user's agent CA, which is outside its validity period; the user must renew the CA",
            ident,
        )
    if trust.crl_next_update is not None and now > trust.crl_next_update:
        raise CertRefused(
            "crl_expired",
            f"{named} cannot be checked: the gateway's revocation list expired on {_day(trust.crl_next_update)}; "
            "the user must refresh it (the gateway re-signs it when it holds the CA key)",
            ident,
        )


def check_client_cert(der: bytes | None, *, now: dt.datetime | None = None) -> ClientIdentity:
    """Identity from the peer certificate whose chain OpenSSL verified; CERT_REQUIRED if unusable
    (:class:`CertRefused` when out of its validity period).

    ``der`` is ``ssl_object.getpeercert(binary_form=True)``: None means no certificate was sent.
    """
    if not der:
        raise UompError(ErrorCode.CERT_REQUIRED, "no client certificate was presented")
    ident = _static_identity(der)
    judge(ident, now=now)
    return ident


class ClientCertChecker:
    """:func:`check_client_cert` with a bounded LRU cache keyed by the DER's SHA-256.

    Parsing and thumbprints are cached (successes and refusals alike); :func:`judge` runs again on
    every call, so a cached certificate still expires (or is revoked) on time.
    """

    def __init__(self, max_entries: int = CLIENT_CERT_CACHE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._cache: OrderedDict[bytes, ClientIdentity | UompError] = OrderedDict()

    def identity(self, der: bytes) -> ClientIdentity:
        """The certificate's parsed identity (cached); CERT_REQUIRED when it is not an agent's."""
        digest = hashlib.sha256(der).digest()
        hit = self._cache.get(digest)
        if hit is None:
            try:
                hit = _static_identity(der)
            except UompError as exc:
                hit = exc
            self._cache[digest] = hit
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(digest)
        if isinstance(hit, UompError):
            raise UompError(hit.code, hit.message)
        return hit

    def check(
        self, der: bytes | None, *, now: dt.datetime | None = None, trust: Trust = NO_TRUST_LIMITS
    ) -> ClientIdentity:
        """The identity of ``der``, judged against ``trust`` (:attr:`TLSReloader.trust`) now."""
        if not der:
            raise UompError(ErrorCode.CERT_REQUIRED, "no client certificate was presented")
        ident = self.identity(der)
        judge(ident, trust, now)
        return ident


# ------------------------------------------------------------------------------- reloading


def check_agent_ca(ca_file: Path, now: dt.datetime | None = None) -> x509.Certificate:
    """The agent CA certificate of ``ca_file``; CA_ERROR, naming the file and the date, when it is
    not valid now (OpenSSL does not check the CA's validity period: :func:`build_server_context`)."""
    cert = x509.load_pem_x509_certificate(ca_file.read_bytes())
    now = ca.utcnow() if now is None else now
    if now > cert.not_valid_after_utc:
        raise UompError(
            ErrorCode.CA_ERROR,
            f"the agent CA certificate {ca_file} expired on {_day(cert.not_valid_after_utc)}: no agent certificate "
            "can be trusted; make a new agent CA and issue the agents new certificates",
        )
    if now < cert.not_valid_before_utc:
        raise UompError(
            ErrorCode.CA_ERROR,
            f"the agent CA certificate {ca_file} is not valid before {_day(cert.not_valid_before_utc)}; "
            "check this machine's clock",
        )
    return cert


SNI_ATTRIBUTE = "_uomp_server_name"


def server_name_of(ssl_object: object) -> str | None:
    """The SNI host name the client sent in this connection's handshake (None: none sent)."""
    name = getattr(ssl_object, SNI_ATTRIBUTE, None)
    return name.lower() if isinstance(name, str) else None


@dataclass(frozen=True)
class CRLMark:
    """How new a CRL is: its CRL Number (RFC 5280 §5.2.3) and thisUpdate (§5.1.2.4)."""

    number: int
    this_update: dt.datetime


def read_crl_state(path: Path | None) -> CRLMark | None:
    """The newest CRL recorded in ``path`` (JSON), or None if there is none (or it is unreadable: logged)."""
    if path is None:
        return None
    try:
        doc = json.loads(path.read_bytes())
        number = doc["crl_number"]
        this_update = dt.datetime.fromisoformat(doc["this_update"])
        if isinstance(number, bool) or not isinstance(number, int) or this_update.tzinfo is None:
            raise ValueError("bad field")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the unreadable CRL state file %s (%s)", path, type(exc).__name__)
        return None
    return CRLMark(number, this_update)


def write_crl_state(path: Path, mark: CRLMark) -> None:
    """Record ``mark`` atomically (temp file, fsync, rename; 0600)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    doc = {"crl_number": mark.number, "this_update": mark.this_update.isoformat()}
    atomic_write(path, json.dumps(doc).encode() + b"\n", mode=0o600)


@dataclass(frozen=True)
class TLSFiles:
    """The files the mTLS listener's context is built from."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    crl_file: Path


class TLSReloader:
    """A stable listening context whose handshakes use the most recently loaded files.

    Give :attr:`context` to the listener (:func:`gateway.remote.transport.listen`). :meth:`reload` builds a fresh inner
    context from the files and swaps it in; only handshakes that start afterwards see it.
    A reload that fails (unreadable key, key/cert mismatch, bad CRL) raises and keeps the previous
    context, so a bad file never takes the listener down.
    """

    def __init__(
        self,
        cert_file: StrPath,
        key_file: StrPath,
        ca_file: StrPath,
        crl_file: StrPath,
        *,
        require_client_cert: bool = False,
        crl_state: StrPath | None = None,
        session_tickets: int = 0,
    ) -> None:
        self.files = TLSFiles(Path(cert_file), Path(key_file), Path(ca_file), Path(crl_file))
        self.session_tickets = session_tickets
        self.require_client_cert = require_client_cert
        # reload() reads four files, builds a context and may fsync the CRL state file: it runs in a
        # worker thread (watch(), SIGHUP), one at a time. The event loop only reads ``_inner`` and
        # ``revoked``, each replaced by one assignment.
        self._reload_lock = threading.Lock()
        self.generation = 0
        # The newest CRL accepted so far (number, thisUpdate), remembered across restarts in
        # ``crl_state`` when given: an older CRL is refused (see _load).
        self.crl_state = Path(crl_state) if crl_state is not None else None
        self.crl_mark: CRLMark | None = read_crl_state(self.crl_state)
        self._stamp = self._stamps()
        # The CRL and CA last loaded, as judge() needs them (ClientCertChecker.check(trust=...)).
        self.trust: Trust
        self._inner, self.trust, mark = self._load()
        self._accept(mark)
        # The front context must carry the same protocol settings as the inner ones: OpenSSL copies
        # verify mode, verify flags, versions, options and ticket count into each connection when
        # it is created (before the SNI callback); switching context later swaps certificate, key
        # and trust store (CA + CRL) only. The front IS the first inner context: until the first
        # reload the callback "switches" to the context the connection already has, which OpenSSL
        # skips (SSL_set_SSL_CTX returns at once), where a real switch costs the server ~0.1-0.5 ms
        # per handshake (it copies the certificate state; benchmarks/RUNS.md, "native TLS").
        # After a reload, each new handshake switches to the newest inner context.
        self._front = self._inner
        self._front.sni_callback = self._select

    @property
    def context(self) -> ssl.SSLContext:
        """The listening context (stable for the life of the listener)."""
        return self._front

    @property
    def revoked(self) -> frozenset[str]:
        """Serials (hex) on the CRL last loaded."""
        return self.trust.revoked

    @property
    def current(self) -> ssl.SSLContext:
        """The context new handshakes are switched to."""
        return self._inner

    def _build(self) -> ssl.SSLContext:
        f = self.files
        return build_server_context(
            f.cert_file,
            f.key_file,
            f.ca_file,
            f.crl_file,
            require_client_cert=self.require_client_cert,
            session_tickets=self.session_tickets,
        )

    def _load(self) -> tuple[ssl.SSLContext, Trust, CRLMark]:
        """A fresh inner context, what judge() checks against (:class:`Trust`) and the CRL's
        (number, thisUpdate). The CA certificate must be valid now and the CRL signed by it (OpenSSL
        checks neither in the handshake: :func:`build_server_context`).

        A CRL older than the newest one accepted (lower CRL Number, RFC 5280 §5.2.3, or earlier
        thisUpdate, §5.1.2.4) is refused: a validly signed backup from before a revocation must not
        let the revoked agent back in. The CRL bytes checked are the ones the context loaded (read
        again after the build; a file replaced in between is a failed load, retried next tick)."""
        raw = self.files.crl_file.read_bytes()
        crl = x509.load_pem_x509_crl(raw)
        mark = self._not_older(crl)
        ca_cert = check_agent_ca(self.files.ca_file)
        if crl.issuer != ca_cert.subject or not crl.is_signature_valid(ca_cert.public_key()):  # type: ignore[arg-type]
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                f"the CRL {self.files.crl_file} is not signed by the agent CA {self.files.ca_file}; keeping the "
                "previous CRL. Put the CA's own CRL back (the gateway re-signs it when it holds the CA key)",
            )
        ctx = self._build()
        if self.files.crl_file.read_bytes() != raw:
            raise ValueError("the CRL file changed while it was being loaded")
        revoked_at = {ca.serial_hex(r.serial_number): r.revocation_date_utc for r in crl}
        trust = Trust(
            revoked=frozenset(revoked_at),
            revoked_at=revoked_at,
            crl_next_update=crl.next_update_utc,
            ca_not_before=ca_cert.not_valid_before_utc,
            ca_not_after=ca_cert.not_valid_after_utc,
        )
        return ctx, trust, mark

    def _not_older(self, crl: x509.CertificateRevocationList) -> CRLMark:
        """``crl``'s mark; CONFIG_ERROR when it is older than the newest CRL accepted."""
        mark, last = CRLMark(ca.crl_number(crl), crl.last_update_utc), self.crl_mark
        if last is not None and (mark.number < last.number or mark.this_update < last.this_update):
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                f"refusing an older CRL (CRL Number {mark.number}, thisUpdate {mark.this_update:%Y-%m-%dT%H:%M:%SZ}) "
                f"than the one already accepted (CRL Number {last.number}, thisUpdate "
                f"{last.this_update:%Y-%m-%dT%H:%M:%SZ}); keeping the previous CRL. Put the current CRL back "
                f"(the gateway re-signs {self.files.crl_file.name} from the CA registry when it is the CA's own)",
            )
        return mark

    def _accept(self, mark: CRLMark) -> None:
        """Remember ``mark`` as the newest CRL seen (durably, when a state file is configured)."""
        if mark == self.crl_mark:
            return
        self.crl_mark = mark
        if self.crl_state is not None:
            try:
                write_crl_state(self.crl_state, mark)
            except OSError as exc:
                log.warning("cannot record the CRL number in %s: %s", self.crl_state, exc.strerror)

    def _select(self, ssl_object: ssl.SSLObject, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        # Runs inside the handshake, after ClientHello, for every connection (server_name None when
        # the client sent no SNI, e.g. connecting to an IP address). Must not raise.
        ssl_object.context = self._inner
        setattr(ssl_object, SNI_ATTRIBUTE, server_name)  # read back by server_name_of()

    def _stamps(self) -> Stamps:
        f = self.files
        return stamps((f.cert_file, f.key_file, f.ca_file, f.crl_file))

    def reload(self) -> None:
        """Load the files again and switch new handshakes to them; UompError (old context kept) on failure.
        Blocking (file reads, an fsync): call it from a worker thread when an event loop is serving."""
        with self._reload_lock:
            self._reload()

    def _reload(self) -> None:
        stamp = self._stamps()  # before reading: a change during the build triggers another reload
        try:
            fresh, trust, mark = self._load()
        except UompError:
            self._stamp = stamp  # an older CRL: refused once, not on every tick
            raise
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._stamp = stamp  # do not retry the same broken files on every tick
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                f"TLS reload failed, keeping the previous certificates: {type(exc).__name__}: {exc}",
            ) from exc
        self._inner = fresh
        self.trust = trust
        self._accept(mark)
        self._stamp = stamp
        self.generation += 1
        log.info("TLS certificates, CA and CRL reloaded (generation %d)", self.generation)

    def install_crl(self, pem: bytes, *, now: dt.datetime | None = None) -> bool:
        """A CRL received from the CA's home (the uplink): checked, written atomically over the CRL
        file, and loaded like a changed file. False when it is the CRL already held (nothing done).

        Refused (UompError CONFIG_ERROR, the file and the context kept) when it is not a CRL, is not
        issued and signed by the agent CA this listener trusts, is past its nextUpdate, or is older
        than the newest one accepted (CRL Number or thisUpdate, as :meth:`reload` refuses it).
        Blocking (file reads, fsyncs): call it from a worker thread when an event loop is serving."""
        try:
            crl = x509.load_pem_x509_crl(pem)
            ca_cert = ca.load_cert(self.files.ca_file.read_bytes())
        except (OSError, ValueError) as exc:
            raise UompError(
                ErrorCode.CONFIG_ERROR, f"the CRL received is not a PEM CRL ({type(exc).__name__})"
            ) from exc
        pub = ca_cert.public_key()
        if crl.issuer != ca_cert.subject or not isinstance(pub, ca.AgentPublicKey) or not crl.is_signature_valid(pub):
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                f"the CRL received is not signed by the agent CA of {self.files.ca_file}; keeping the previous CRL",
            )
        next_update = crl.next_update_utc
        if next_update is None or next_update < ca.aware_utc(now):
            raise UompError(ErrorCode.CONFIG_ERROR, "the CRL received is past its nextUpdate; keeping the previous CRL")
        with self._reload_lock:
            mark = self._not_older(crl)
            try:
                if self.files.crl_file.read_bytes() == pem and mark == self.crl_mark:
                    return False
            except OSError:
                pass
            atomic_write(self.files.crl_file, pem, mode=0o644)
            self._reload()
        return True

    def changed(self) -> bool:
        return self._stamps() != self._stamp

    def reload_if_changed(self) -> bool:
        """Reload when any of the four files changed since the last (attempted) load. Blocking."""
        with self._reload_lock:
            if not self.changed():
                return False
            self._reload()
            return True

    def reload_logged(self) -> None:
        """reload(), logging instead of raising (for signal handlers)."""
        try:
            self.reload()
        except UompError as exc:
            log.warning("%s", exc.message)

    async def watch(
        self,
        interval: float,
        *,
        tick: Callable[[], object] | None = None,
    ) -> None:
        """Reload whenever a file changes; runs until cancelled.

        ``tick`` (blocking, run in a worker thread before each look) is where the gateway refreshes
        the CRL before it goes stale, e.g. ``lambda: ca_store.refresh_crl(paths)``; its errors are
        logged, never fatal.
        """
        loop = asyncio.get_running_loop()

        def step() -> None:  # one trip to a worker thread per look: file reads, fsync, off the loop
            if tick is not None:
                try:
                    tick()
                except Exception as exc:  # a failing refresh must not stop the watcher
                    log.warning("TLS watch tick failed: %s: %s", type(exc).__name__, exc)
            try:
                self.reload_if_changed()
            except UompError as exc:
                log.warning("%s", exc.message)

        while True:
            await loop.run_in_executor(None, step)
            await asyncio.sleep(interval)


def install_sighup(loop: asyncio.AbstractEventLoop, reloader: TLSReloader) -> bool:
    """Reload TLS files on SIGHUP, in a worker thread. False where signals cannot be handled (non-main
    thread, Windows)."""

    def hup() -> None:
        loop.run_in_executor(None, reloader.reload_logged)

    try:
        loop.add_signal_handler(signal.SIGHUP, hup)
    except (RuntimeError, ValueError, AttributeError):  # RuntimeError covers "not implemented" too
        return False
    return True
