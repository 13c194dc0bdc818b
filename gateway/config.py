"""Configuration: TOML file + ``UOMP_*`` environment -> frozen dataclasses.

Precedence, lowest first: the defaults below, ``$UOMP_HOME/config.toml`` (or ``--config``), the
environment (``UOMP_GUARD_<FIELD>``, ``UOMP_GATEWAY_<FIELD>``), command-line flags. Every limit is
named, with its unit in the name.

Longer than ~500 lines on purpose: every setting is named here and nowhere else, with its unit and
default.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from gateway.errors import ErrorCode, UompError

DEFAULT_HOME = "~/.uomp"
LOCAL_PORT = 9374
MAX_CONNECTION_BUDGET = 65536  # the largest connection budget a listener's setting may name

# The words a boolean setting or switch may be spelled with (case and surrounding blanks ignored).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(value: str) -> bool | None:
    """``True``/``False`` for one of :data:`TRUE_WORDS`/:data:`FALSE_WORDS`, ``None`` for anything else."""
    word = value.strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def switch_on(name: str) -> bool:
    """A speed switch of the environment (``UOMP_UVLOOP``, ``UOMP_ORJSON``, ``UOMP_SESSION_CACHE``):
    on unless set to one of :data:`FALSE_WORDS`. Each only changes speed, never behaviour, so a value
    that is not a boolean word leaves it on rather than stopping a server at import."""
    return parse_bool(os.environ.get(name, "1")) is not False


def resolve_home(cli_home: str | None = None) -> Path:
    """The data directory: ``--home``, else ``$UOMP_HOME``, else ``~/.uomp``, resolved."""
    raw = cli_home or os.environ.get("UOMP_HOME") or DEFAULT_HOME
    return Path(raw).expanduser().resolve()


@dataclass(frozen=True)
class Paths:
    """Where everything lives under the data directory (created 0700 by ``uomp init``).

    Every file and directory under ``$UOMP_HOME`` is named here and nowhere else
    (tests/e2e/test_layering.py refuses ``home / "name"`` joins elsewhere). Exception: a store's own
    layout inside its directory (``payloads/index.db``, ``blobs/``; the access log's segments)."""

    home: Path

    @property
    def secrets(self) -> Path:
        return self.home / ".secrets"

    @property
    def private_jwk(self) -> Path:
        return self.secrets / "ed25519-private.jwk"

    @property
    def public_jwk(self) -> Path:
        return self.secrets / "ed25519-public.jwk"

    @property
    def jwks(self) -> Path:
        """Every public key still accepted (current + rotated-out, until their tokens are dead)."""
        return self.secrets / "jwks.json"

    @property
    def admin_credential(self) -> Path:
        return self.secrets / "admin-token"

    @property
    def items_key(self) -> Path:
        """The root key of the high-sensitivity items' per-item sealing (gateway/atrest/itemseal.py)."""
        return self.secrets / "items.key"

    @property
    def memory_db(self) -> Path:
        return self.home / "memory.db"

    @property
    def memory_db_convert(self) -> Path:
        """memory.db being encrypted or decrypted (gateway/atrest/memdb.py), renamed over it when done."""
        return self.home / "memory.db.convert"

    @property
    def auth_db(self) -> Path:
        return self.home / "auth.db"

    @property
    def audit_db(self) -> Path:
        return self.home / "audit.db"

    @property
    def reads_db(self) -> Path:
        """The guard's state about agents' reads: cursor key, per-session aggregate history."""
        return self.home / "reads.db"

    @property
    def enroll_db(self) -> Path:
        """One-time enrollment codes and agents' enrollment requests (gateway/enrollment.py)."""
        return self.home / "enroll.db"

    @property
    def guard_sock(self) -> Path:
        return self.home / "guard.sock"

    @property
    def config_file(self) -> Path:
        return self.home / "config.toml"

    @property
    def ca_dir(self) -> Path:
        return self.home / "ca"

    @property
    def gateway_dir(self) -> Path:
        return self.home / "gateway"

    @property
    def dashboard_links(self) -> Path:
        """One-time dashboard login links handed to the running appliance (hashes and expiry only)."""
        return self.gateway_dir / "dashboard-links"

    @property
    def dashboard_links_lock(self) -> Path:
        return self.gateway_dir / "dashboard-links.lock"

    @property
    def gateway_status(self) -> Path:
        """The running gateway's health report (upstream guard reachable, supervisor), JSON."""
        return self.gateway_dir / "status.json"

    @property
    def crl_state(self) -> Path:
        """The highest CRL Number and thisUpdate the gateway has accepted (refuses older CRLs)."""
        return self.gateway_dir / "crl-state.json"

    @property
    def agents_dir(self) -> Path:
        return self.home / "agents"

    @property
    def memtrace_dir(self) -> Path:
        """Memory-trace snapshots of a run with ``UOMP_TRACEMALLOC=1`` (gateway/memtrace.py)."""
        return self.home / "memtrace"

    @property
    def payload_dir(self) -> Path:
        """Sealed payloads the gateway relays (ciphertext only), see gateway/payloads/store.py."""
        return self.home / "payloads"

    @property
    def audit_key(self) -> Path:
        """The Ed25519 key that signs the audit log's checkpoints (0600), see gateway/ledger/auditkey.py."""
        return self.secrets / "audit-ed25519.key"

    @property
    def audit_witness(self) -> Path:
        """The latest signed checkpoint, kept beside the audit key and outside audit.db (0600), see
        gateway/ledger/integrity.py."""
        return self.secrets / "audit-witness.json"

    @property
    def payload_private_key(self) -> Path:
        """The user's X25519 payload key (0600, never leaves this machine), see gateway/payloads/userkey.py."""
        return self.secrets / "payload-x25519.key"

    @property
    def payload_public_key(self) -> Path:
        return self.secrets / "payload-x25519.pub"

    @property
    def trust_file(self) -> Path:
        """The user's trust list of publisher identities (spec §16.4), see gateway/trust.py."""
        return self.home / "trust.json"

    @property
    def registries_file(self) -> Path:
        """The agent registries the user added (``uomp registry add``), see gateway/registry/store.py."""
        return self.home / "registries.json"

    @property
    def registry_cache_dir(self) -> Path:
        """What ``uomp registry search`` indexed of each registry (events and registration files)."""
        return self.home / "registry-cache"

    @property
    def registry_installs_dir(self) -> Path:
        """What ``uomp registry install`` verified, one record per installed uom.json (by its keccak-256):
        ``uomp authorize`` shows a listing only from here, never from a file beside the manifest."""
        return self.home / "registry-installs"

    @property
    def registry_reports(self) -> Path:
        """Abnormal sessions already reported to a Reputation Registry (``uomp registry report``)."""
        return self.home / "registry-reports.json"

    @property
    def trust_lock(self) -> Path:
        return self.home / ".trust.lock"

    @property
    def master_slot(self) -> Path:
        """The sealed master key that protects the private keys at rest (0600), see gateway/atrest/vault.py."""
        return self.secrets / "master.json"

    @property
    def backup_stage(self) -> Path:
        """Database snapshots of a backup being written (gateway/atrest/backup.py), removed when done."""
        return self.home / ".backup-stage"

    @property
    def atrest_lock(self) -> Path:
        return self.secrets / ".atrest.lock"

    @property
    def atrest_journal(self) -> Path:
        """A committed seal / unseal, rolled forward by the next process that opens the home."""
        return self.secrets / ".atrest-journal"

    def atrest_stage(self, tag: str) -> Path:
        """A seal / unseal being prepared (not committed: removed by the next process)."""
        return self.secrets / f".atrest-stage-{tag}"

    @property
    def revoked_keys(self) -> Path:
        """Signing keys the user revoked (never trusted again), see gateway/keys.py."""
        return self.secrets / "revoked-keys.json"

    # ---- the outbound uplink (gateway/uplink/): at home the uplink CA and the home identity, on
    # the VPS the uplink listener's identity and the pin of the home side

    @property
    def uplink_dir(self) -> Path:
        return self.home / "uplink"

    @property
    def uplink_ca_key(self) -> Path:
        """The dedicated uplink CA's key (home only, 0600; never copied to the VPS)."""
        return self.uplink_dir / "uplink-ca.key"

    @property
    def uplink_ca_cert(self) -> Path:
        return self.uplink_dir / "uplink-ca.crt"

    @property
    def uplink_home_key(self) -> Path:
        """The home side's client key (home only, 0600)."""
        return self.uplink_dir / "home.key"

    @property
    def uplink_home_cert(self) -> Path:
        return self.uplink_dir / "home.crt"

    @property
    def uplink_server_key(self) -> Path:
        """The uplink listener's key (VPS only, 0600)."""
        return self.uplink_dir / "server.key"

    @property
    def uplink_server_cert(self) -> Path:
        return self.uplink_dir / "server.crt"

    @property
    def uplink_pins(self) -> Path:
        """The SHA-256 SPKI pins of the peer: at home the VPS's uplink certificate, on the VPS the
        home side's (JSON, 0600)."""
        return self.uplink_dir / "pins.json"

    # ---- the user's CA (gateway/ca_store.py)

    @property
    def ca_key(self) -> Path:
        return self.ca_dir / "ca.key"

    @property
    def ca_cert(self) -> Path:
        return self.ca_dir / "ca.crt"

    @property
    def gateway_key(self) -> Path:
        return self.ca_dir / "gateway.key"

    @property
    def gateway_cert(self) -> Path:
        return self.ca_dir / "gateway.crt"

    @property
    def crl(self) -> Path:
        return self.ca_dir / "crl.pem"

    @property
    def ca_registry(self) -> Path:
        """Every certificate the CA issued (SQLite)."""
        return self.ca_dir / "issued.db"

    @property
    def ca_registry_legacy(self) -> Path:
        """The JSON registry of earlier versions: migrated into :attr:`ca_registry` when first seen."""
        return self.ca_dir / "issued.json"

    @property
    def ca_lock(self) -> Path:
        return self.ca_dir / ".lock"

    # ---- the gateway (gateway/remote/, gateway/appliance.py)

    @property
    def access_log(self) -> Path:
        """The active hash-chained access log; closed segments lie next to it."""
        return self.gateway_dir / "access.jsonl"

    @property
    def quota_db(self) -> Path:
        return self.gateway_dir / "quota.db"

    @property
    def appliance_addresses(self) -> Path:
        return self.gateway_dir / "addresses.json"

    @property
    def appliance_lock(self) -> Path:
        return self.gateway_dir / "appliance.lock"

    @property
    def appliance_run(self) -> Path:
        return self.gateway_dir / "appliance.json"

    @property
    def cloudflared_home(self) -> Path:
        """A private HOME for cloudflared (it must not read the user's ~/.cloudflared)."""
        return self.gateway_dir / "cloudflared-home"


@dataclass(frozen=True)
class GuardConfig:
    """Auth Service + Memory Guard (``[guard]``, ``UOMP_GUARD_*``)."""

    tcp_host: str = "127.0.0.1"
    tcp_port: int = LOCAL_PORT
    serve_tcp: bool = True
    allow_non_loopback: bool = False
    # The Memory Store implementation, by name (gateway/guard/stores.py MEMORY_STORES; an unknown
    # name is refused when the guard opens it): "sqlite" is memory.db under $UOMP_HOME.
    store: str = "sqlite"
    token_lifetime_seconds: int = 30 * 60
    remote_token_lifetime_seconds: int = 10 * 60
    refresh_lifetime_seconds: int = 7 * 24 * 3600
    refresh_reuse_grace_seconds: int = 10  # no longer used (kept so old config files load): see guard/auth.py
    default_max_read_queries: int = 100
    aggregate_min_items: int = 3
    # k: no combination of one session's aggregates may isolate fewer than this many items (the
    # effective value is never below aggregate_min_items); docs/aggregates.md
    aggregate_min_group: int = 3
    aggregate_max_sets_per_session: int = 32  # distinct (field, tag) sets one session may aggregate
    aggregate_max_groups: int = 4096  # overlap groups of a session's aggregated tags, then refused
    aggregate_history_max_rows: int = 100_000  # recorded sets, all sessions (expired ones pruned)
    audit_retention_days: int = 90
    max_body_bytes: int = 64 * 1024
    max_tag_results: int = 1000  # items per tag-read page at most (the agent may ask fewer: limit=)
    tag_page_max_bytes: int = 4 * 1024 * 1024  # value+tag text per page; a page ends early past it
    tag_cursor_lifetime_seconds: int = 3600  # a tag-read cursor (next) is refused after this
    token_cache_entries: int = 4096
    session_max_minutes: int = 24 * 60  # Local Profile sessions
    remote_session_max_minutes: int = 30 * 24 * 60  # Remote Profile sessions (they live on refresh tokens)
    # Bounded waits on the guard's SQLite files (another process may hold a lock): one statement
    # waits at most db_busy_timeout_seconds for it; a call queued behind others on a database's
    # worker thread waits at most db_queue_timeout_seconds for its turn. Past either: 503 STORE_BUSY.
    db_busy_timeout_seconds: float = 2.0
    db_queue_timeout_seconds: float = 5.0
    # The verifiable audit log (docs/audit.md): a signed checkpoint every audit_checkpoint_events
    # events or audit_checkpoint_seconds seconds, whichever comes first; session grants,
    # revocations and deletion proofs get one in the same write (near real time).
    audit_checkpoint_events: int = 1000
    audit_checkpoint_seconds: float = 10.0
    # Beside the bounded start-up check, the guard verifies the whole audit log once after it starts,
    # in the background (`uomp audit verify --no-chain` in a process of its own, niced; one pass,
    # ~15 s per 1,000,000 events on 2 cores; docs/audit.md): a failure refuses service.
    audit_full_verify_at_start: bool = True
    # An external witness's directory (`uomp audit witness --dir`, on another disk or machine;
    # docs/audit.md, "External witness"): `uomp audit verify` (and so the background verify) then
    # holds the log to the newest checkpoint it cosigned. Empty: none. A directory that is absent
    # (not mounted) or has cosigned nothing yet is a warning; a tampered one is red.
    audit_witness_dir: str = ""
    # Connection budgets of the guard's two listeners (docs/security.md, "Limits"): past one, a
    # newcomer takes the place of the longest-idle connection, and is closed when every connection is
    # busy. The Unix socket's carries the gateway's connections (up to 256 exchanges at once) and the
    # CLI's; the Local Profile port's, local agents'. Each is lowered to fit the process's descriptor
    # limit (gateway/guard/server.py, connection_budgets).
    unix_max_connections: int = 4096
    tcp_max_connections: int = 256
    # Housekeeping, off the event loop: each session is closed at its expiry (the sweeper sleeps
    # until the next one, at most sweep_interval_seconds and 60 s, the shortest session); audit
    # retention and auth.db pruning run every purge_interval_seconds.
    sweep_interval_seconds: float = 60.0
    purge_interval_seconds: float = 3600.0
    # The key files are looked at this often (four stats) for a change made by hand; the commands
    # that change them signal the running guard, which reloads at once (gateway/reloads.py).
    key_watch_fallback_seconds: float = 30.0
    # Agent write proposals (docs/writes.md): budgets per session and per agent, each refusal
    # BUDGET_EXCEEDED with its numbers; a proposal nobody decided expires after its lifetime.
    write_max_pending_per_session: int = 20  # undecided proposals of one session at once
    write_max_per_session: int = 100  # proposals one session may ever make (the token's max_write_queries)
    write_max_per_agent_hour: int = 60  # proposals of one agent (all its sessions) in the last hour
    write_max_pending_total: int = 1000  # undecided proposals in the store, all agents
    write_max_value_bytes: int = 16 * 1024  # one proposed value as JSON (UTF-8); never truncated
    write_proposal_lifetime_seconds: int = 7 * 24 * 3600
    # Version history: earlier versions kept per key (0: all of them), for every writer alike.
    history_max_versions: int = 50

    def __post_init__(self) -> None:
        _check_port(self.tcp_port, "guard.tcp_port", low=0)
        for name in ("unix_max_connections", "tcp_max_connections"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_CONNECTION_BUDGET:
                raise UompError(
                    ErrorCode.CONFIG_ERROR, f"guard.{name} = {value} is out of range; use 1-{MAX_CONNECTION_BUDGET}"
                )


@dataclass(frozen=True)
class AnchorConfig:
    """Anchoring the audit log's checkpoints on a chain (``[anchor]``, ``UOMP_ANCHOR_*``; docs/anchoring.md).

    ``backend = "none"`` (the default): signed checkpoints only, verifiable offline."""

    backend: str = "none"  # none | evm | starknet
    rpc_url: str = ""
    contract: str = ""
    chain_id: int = 0  # 0: evm takes the node's chain id on first use; starknet needs it
    key_file: str = ""  # 0600 file with the 0x-hex private key of the anchoring account
    account: str = ""  # starknet account address
    confirmations: int = 2  # blocks deep before an anchor counts as final
    poll_seconds: float = 5.0  # how often the anchoring worker looks at the backlog
    backoff_max_seconds: float = 300.0  # retry delay cap while the chain is unreachable
    code_hash: str = ""  # evm: 0x keccak-256 of the contract's runtime code (uomp anchor deploy prints it)
    recheck_seconds: float = 600.0  # how often confirmed anchors are read from the chain again
    recheck_count: int = 32  # how many of the newest confirmed anchors each recheck reads

    def __post_init__(self) -> None:
        if self.recheck_seconds <= 0 or self.recheck_count < 1:
            raise UompError(ErrorCode.CONFIG_ERROR, "anchor.recheck_seconds must be > 0 and recheck_count >= 1")
        if self.backend not in ("none", "evm", "starknet"):
            raise UompError(
                ErrorCode.CONFIG_ERROR, f"anchor.backend must be none, evm or starknet, not {self.backend!r}"
            )
        if self.confirmations < 1 or self.poll_seconds <= 0 or self.backoff_max_seconds <= 0:
            raise UompError(ErrorCode.CONFIG_ERROR, "anchor.confirmations must be >= 1 and the intervals > 0")


@dataclass(frozen=True)
class RegistryConfig:
    """Agent registries (``[registry]``, ``UOMP_REGISTRY_*``; docs/registry.md): the bounds of every
    chain call and every fetch of a registration file, manifest or DID document.

    Fetches are https only, to public addresses only; ``allow_internal`` lets them reach loopback
    and private addresses (and plain http on loopback), for a registry you run yourself."""

    fetch_max_bytes: int = 256 * 1024  # one registration file / uom.json / DID document
    fetch_timeout_seconds: float = 10.0  # one whole fetch, connect to last byte, redirects included
    fetch_max_redirects: int = 3
    rpc_timeout_seconds: float = 10.0  # one JSON-RPC call to the registry's chain
    log_block_range: int = 10_000  # blocks per eth_getLogs call while indexing Registered events
    search_max_fetches: int = 200  # registration files fetched by one search (the rest on the next)
    ca_file: str = ""  # extra CA certificates (PEM) for https fetches; "" = the system's
    allow_internal: bool = False

    def __post_init__(self) -> None:
        if self.fetch_max_bytes < 1024 or self.fetch_timeout_seconds <= 0 or self.rpc_timeout_seconds <= 0:
            raise UompError(ErrorCode.CONFIG_ERROR, "registry: fetch_max_bytes >= 1024 and the timeouts > 0")
        if not 0 <= self.fetch_max_redirects <= 10 or self.log_block_range < 1 or self.search_max_fetches < 0:
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                "registry: fetch_max_redirects 0-10, log_block_range >= 1, search_max_fetches >= 0",
            )


PUBLISHER_METHODS = ("did:key", "did:web", "x509", "gpg")


@dataclass(frozen=True)
class TrustConfig:
    """Publisher policy (``[trust]``, ``UOMP_TRUST_*``; spec §16.4, docs/registry.md).

    ``require``: when not empty, ``uomp authorize`` grants only to agents whose publisher verified by
    one of these methods against the trust list; every other agent gets no session and no token."""

    require: list[str] = field(default_factory=list)  # of did:key, did:web, x509, gpg

    def __post_init__(self) -> None:
        bad = [m for m in self.require if m not in PUBLISHER_METHODS]
        if bad:
            raise UompError(
                ErrorCode.CONFIG_ERROR, f"trust.require: {bad[0]!r} is not one of {', '.join(PUBLISHER_METHODS)}"
            )


LOOPBACK_HOSTS = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class DashboardConfig:
    """The local dashboard (``[dashboard]``, ``UOMP_DASHBOARD_*``; docs/dashboard.md).

    Loopback only: a non-loopback ``host`` is refused, there is no override."""

    enabled: bool = True  # served by `uomp gateway start`
    host: str = "127.0.0.1"
    port: int = 9380  # 0: any free port
    login_ttl_seconds: float = 120.0  # the one-time login link's life
    idle_timeout_seconds: float = 900.0  # a dashboard session ends after this long unused
    max_session_seconds: float = 43200.0  # and at the latest after this long

    def __post_init__(self) -> None:
        _check_port(self.port, "dashboard.port", low=0)
        if self.host not in LOOPBACK_HOSTS:
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                f"dashboard.host must be a loopback address (127.0.0.1, ::1), not "
                f"{self.host!r}: the dashboard is never served beyond this machine",
            )
        if min(self.login_ttl_seconds, self.idle_timeout_seconds, self.max_session_seconds) <= 0:
            raise UompError(ErrorCode.CONFIG_ERROR, "dashboard timeouts must be > 0")


@dataclass(frozen=True)
class GatewayConfig:
    """Remote gateway (``[gateway]``, ``UOMP_GATEWAY_*``)."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 9443
    allow_non_loopback: bool = False
    tunnel_origin_host: str = "127.0.0.1"
    tunnel_origin_port: int = -1  # -1 = no tunnel-origin (DPoP) listener; 0 = any free port
    metrics_port: int = -1  # -1 = no Prometheus listener; 0 = any free port; always 127.0.0.1
    upstream: str = ""  # "" = unix:$UOMP_HOME/guard.sock; or http://127.0.0.1:9374
    server_cert: str = ""  # "" = $UOMP_HOME/ca/gateway.crt
    server_key: str = ""
    agent_ca: str = ""
    agent_crl: str = ""
    endpoints: list[str] = field(default_factory=list)  # mTLS listener's URLs; [] -> https://localhost:<port>
    tunnel_endpoints: list[str] = field(default_factory=list)  # the tunnel-origin listener's public URLs
    max_header_bytes: int = 8 * 1024
    max_body_bytes: int = 1024 * 1024
    # Connection limits (gateway/remote/transport.py, docs/security.md "Limits"). A connection is
    # counted from accept, before any TLS byte. "Unverified": no verified client certificate yet
    # (mTLS listener) / no authenticated request yet (tunnel-origin listener); when their budget is
    # full the unverified connection getting least far (idle, then silent, then stalled) is closed.
    max_connections: int = 1024  # mTLS listener: connections with a verified client certificate
    max_unverified_connections: int = 128  # mTLS listener: handshaking or certificate-less connections
    max_unverified_connections_per_ip: int = 32  # mTLS listener: unverified connections from one address
    tunnel_max_connections: int = 256  # tunnel-origin listener: connections that carried an authenticated request
    tunnel_max_unverified_connections: int = 64  # tunnel-origin listener: not (yet) authenticated
    metrics_max_connections: int = 16  # metrics listener (loopback, unauthenticated)
    fd_reserve: int = 256  # file descriptors kept free for everything but client connections
    upstream_timeout_seconds: float = 10.0
    # The outbound uplink (gateway/uplink/, docs/vps.md): a port >= 0 makes this a gateway whose
    # guard is at home, reached over the one mTLS HTTP/2 connection the home side dials in here
    # (instead of `upstream`). -1 = off; 0 = any free port.
    uplink_listen_host: str = "127.0.0.1"
    uplink_listen_port: int = -1
    uplink_max_in_flight: int = 256  # requests on the uplink at once (also capped by the home side's streams)
    uplink_max_queue: int = 1024  # requests waiting for a place; beyond: 503 STORE_BUSY
    uplink_keepalive_seconds: float = 5.0  # PING interval; a link silent for 3 intervals is dropped
    # Replicas (gateway/remote/shared_state.py, docs/vps.md): with a Redis URL every gateway process
    # keeps the DPoP replay cache and the DPoP per-key rate in Redis, under this appliance's prefix.
    shared_redis_url: str = ""  # "" = in-process state (one gateway); e.g. redis://127.0.0.1:6379/0
    shared_key_prefix: str = "uomp:"  # one prefix per appliance sharing a Redis
    shared_timeout_seconds: float = 1.0  # one Redis operation; past it: SHARED_STATE_UNAVAILABLE
    # Deadlines (seconds). The first three count from accept.
    tls_handshake_timeout_seconds: float = 10.0  # accept -> TLS handshake complete
    tls_shutdown_timeout_seconds: float = 5.0  # wait for the peer's close_notify before dropping
    # TLS 1.3 session tickets sent after each full handshake (0: no resumption). A returning agent
    # resumes (PSK + (EC)DHE, RFC 8446 §2.2) without the certificate exchange; revocation and expiry
    # are still checked on every request against the live CRL (gateway/remote/tls.py).
    tls_session_tickets: int = 1
    # SO_REUSEPORT on the mTLS listener: lets a second gateway process (its own home copy, the same
    # guard as upstream) share the port. Off: one gateway process (benchmarks/README.md, bench_levers:
    # a second worker does not pay on 2 cores, and quota, DPoP replay cache and status cache would
    # have to be shared first).
    listen_reuse_port: bool = False
    first_byte_timeout_seconds: float = 10.0  # accept -> first request byte; also unverified keep-alive idle
    client_timeout_seconds: float = 30.0  # accept (or a keep-alive request's first byte) -> headers complete
    body_timeout_seconds: float = 60.0  # end of headers -> whole request body received
    min_body_bytes_per_second: int = 1024  # average body rate a client must keep up after the grace
    body_rate_grace_seconds: float = 5.0  # how long the body may lag behind the minimum rate at first
    keepalive_timeout_seconds: float = 75.0  # idle keep-alive of a verified connection
    # A connection's whole life (accept -> close), busy or not: once past it, the answer in progress
    # is its last (Connection: close), so it ends between requests, never during one.
    connection_max_lifetime_seconds: float = 6 * 3600.0
    status_cache_seconds: float = 0.5
    status_cache_entries: int = 16384  # sessions whose status is remembered; beyond, expired ones go, then all
    token_cache_entries: int = 4096  # verified access tokens remembered (expiry re-checked on every hit)
    # certificate, key, CA and CRL files (and the CA registry, the key files) are looked at this
    # often for a change made by hand; the commands that change them signal the gateway (SIGHUP,
    # gateway/reloads.py), which reloads at once
    tls_watch_interval_seconds: float = 30.0
    dpop_window_seconds: int = 60
    dpop_replay_cache_entries: int = 100_000  # all DPoP keys together
    dpop_max_proofs_per_second_per_key: float = 50.0  # sizes one key's replay partition (x 2 windows)
    # The gateway's own check of the guard behind it: GET /v1/health on a new connection every
    # interval (a removed or dead socket is noticed even while pooled connections still work);
    # /v1/health answers 503 while it fails. Upstream failures are logged at most once per
    # upstream_failure_log_seconds (with a count of those not logged).
    upstream_health_interval_seconds: float = 2.0
    upstream_health_timeout_seconds: float = 2.0
    upstream_failure_log_seconds: float = 30.0
    # `uomp gateway start` only: the supervisor's health check of its guard child; after
    # guard_health_failures failures in a row the child is stopped and restarted.
    guard_health_interval_seconds: float = 1.0
    guard_health_timeout_seconds: float = 2.0
    guard_health_failures: int = 3
    # Certificate renewal (POST /v1/certificates/renew): only in the last renew_window_fraction of
    # the presented certificate's life (the SDK renews at 2/3), at most renew_max_per_agent
    # renewals per agent per renew_rate_window_seconds, one at a time per agent.
    renew_window_fraction: float = 1 / 3
    renew_max_per_agent: int = 12
    renew_rate_window_seconds: int = 3600
    # Enrollment (POST /v1/enroll, docs/enrollment.md): at most enroll_max_failures_per_source
    # refused attempts (a code that does not open a request, a malformed request, a wrong poll
    # secret) per client address, and enroll_max_failures in all, per enroll_failure_window_seconds;
    # beyond them every attempt is refused (RATE_LIMITED) before any code is looked at.
    enroll_max_failures_per_source: int = 10
    enroll_max_failures: int = 100
    enroll_failure_window_seconds: float = 600.0
    access_log_segment_bytes: int = 64 * 1024 * 1024  # access.jsonl is closed into a segment beyond this
    access_log_max_total_bytes: int = 4 * 1024 * 1024 * 1024  # kept segments + active file, oldest go first
    access_log_retention_days: float = 90.0  # closed segments older than this go (index lines stay)
    access_log_unauth_events_per_second: float = 2.0  # events without a verified session, per source
    access_log_unauth_burst: int = 20
    access_log_summary_interval_seconds: float = 60.0  # one access_log_suppressed event at most this often
    # Payload relay (spec §15.6; docs/payloads.md). Sizes are of the sealed bytes (ciphertext).
    payload_max_bytes: int = 64 * 1024 * 1024  # one payload
    payload_max_json_bytes: int = 1024 * 1024  # the JSON envelope form (parsed in memory); larger: streaming form
    payload_max_per_session: int = 100  # payloads waiting per session
    payload_max_bytes_per_session: int = 256 * 1024 * 1024  # bytes waiting per session
    payload_ttl_seconds: float = 7 * 86400.0  # a payload not removed by the user is deleted after this
    payload_gc_interval_seconds: float = 600.0  # how often expired payloads are collected (off the event loop)
    payload_upload_url_seconds: float = 600.0  # lifetime of a single-use upload URL (at most 600)
    payload_body_idle_timeout_seconds: float = 30.0  # an upload body that sends nothing this long is dropped

    # Refused TLS handshakes: each counted; logged at most this many lines a second after a burst
    # (remote/handshake_log.py).
    handshake_log_per_second: float = 5.0
    handshake_log_burst: int = 20

    def __post_init__(self) -> None:
        _check_port(self.listen_port, "gateway.listen_port", low=0)
        _check_port(self.tunnel_origin_port, "gateway.tunnel_origin_port", low=-1)
        _check_port(self.metrics_port, "gateway.metrics_port", low=-1)
        _check_port(self.uplink_listen_port, "gateway.uplink_listen_port", low=-1)
        if self.uplink_max_in_flight < 1 or self.uplink_max_queue < 0 or self.uplink_keepalive_seconds <= 0:
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                "gateway.uplink_max_in_flight must be >= 1, uplink_max_queue >= 0, uplink_keepalive_seconds > 0",
            )


@dataclass(frozen=True)
class TunnelSettings:
    """``uomp gateway start --tunnel`` (``[tunnel]``, ``UOMP_TUNNEL_*``). The named-tunnel token is
    never a setting here: it comes from ``token_file`` (mode 0600) or the ``UOMP_TUNNEL_TOKEN``
    environment variable, and reaches cloudflared in its environment, never on a command line."""

    mode: str = "none"  # quick | named | tcp | none
    cloudflared: str = ""  # "" = cloudflared on PATH
    token_file: str = ""  # named / tcp: a file (0600) holding the tunnel token
    hostname: str = ""  # named / tcp: the tunnel's public host name
    url_timeout_seconds: float = 45.0  # quick: no URL printed within this -> restart cloudflared
    ready_wait_seconds: float = 20.0  # start waits this long for the first URL before printing the banner
    backoff_initial_seconds: float = 1.0  # restarts of a dead tunnel: first delay, doubling...
    backoff_max_seconds: float = 60.0  # ...up to this
    rate_limit_backoff_seconds: float = 300.0  # Cloudflare said 429 / error 1015: wait at least this
    stop_timeout_seconds: float = 5.0  # SIGTERM, then SIGKILL after this

    def __post_init__(self) -> None:
        if self.mode not in ("quick", "named", "tcp", "none"):
            raise UompError(ErrorCode.CONFIG_ERROR, f"tunnel.mode must be quick, named, tcp or none, not {self.mode!r}")


def _check_port(value: int, name: str, *, low: int) -> None:
    if not (low <= value <= 65535):
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            f"{name} = {value} is out of range; use 1-65535"
            + (" (0 = any free port)" if low <= 0 else "")
            + (" or -1 (off)" if low < 0 else ""),
        )


T = TypeVar("T")


def _coerce(value: Any, typ: Any, name: str) -> Any:
    origin = get_origin(typ)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(typ) if a is not type(None)]
        return _coerce(value, args[0], name)
    if origin is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise UompError(ErrorCode.CONFIG_ERROR, f"{name} must be a list of strings")
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            word = parse_bool(value) if isinstance(value, str) else None
            if word is None:
                raise ValueError
            return word
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if typ is float:
            return float(value)
        if typ is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError) as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{name} has the wrong type (want {typ.__name__})") from exc
    raise UompError(ErrorCode.CONFIG_ERROR, f"{name}: unsupported type")


_SWITCH_ON = ("1", "true", "yes", "on")
_SWITCH_OFF = ("0", "false", "no", "off", "")


def env_switch(name: str, default: bool) -> bool:
    """An on/off environment switch (``1/true/yes/on``, ``0/false/no/off``); anything else is a
    CONFIG_ERROR naming the variable, so a mistyped value never silently picks a side."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _SWITCH_ON:
        return True
    if value in _SWITCH_OFF:
        return False
    raise UompError(ErrorCode.CONFIG_ERROR, f"{name}={raw!r} is not a switch; set it to 1 or 0")


def env_seconds(name: str, default: float, *, minimum: float = 0.0, maximum: float = 86400.0) -> float:
    """A bounded number of seconds from the environment; out of range or not a number: CONFIG_ERROR."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not minimum <= value <= maximum:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{name}={raw!r} must be seconds between {minimum:g} and {maximum:g}")
    return value


def _read_toml(path: Path | None) -> dict[str, Any]:
    if path is None or not path.exists():
        return {}
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, f"cannot read config file {path}: {exc}") from exc


def _unknown(kind: str, unknown: set[str], known: set[str], where: str) -> UompError:
    """CONFIG_ERROR naming each unknown name and, where one is close, the valid name meant."""
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    valid = f"valid: {', '.join(sorted(known))}; " if len(known) <= 8 else ""
    return UompError(
        ErrorCode.CONFIG_ERROR,
        f"unknown {kind} {where}: {', '.join(parts)} ({valid}every setting: config/uomp.example.toml)",
    )


def check_sections(doc: dict[str, Any]) -> None:
    """Every top-level name of a config file is a known section: a misspelled ``[gatway]`` would
    otherwise leave its settings silently unused."""
    unknown = set(doc) - set(CONFIG_SECTIONS)
    if unknown:
        raise _unknown("section(s)", unknown, set(CONFIG_SECTIONS), "in the config file")


def load_section(cls: type[T], section: str, *, file: Path | None, overrides: dict[str, Any] | None = None) -> T:
    """Build ``cls`` from defaults, the TOML ``[section]``, ``UOMP_<SECTION>_<FIELD>`` and overrides.

    The whole file is checked, not only ``[section]``: an unknown section or setting anywhere is
    refused by every reader, so no command runs on a file another command would refuse."""
    doc = _read_toml(file)
    check_sections(doc)
    data = doc.get(section, {})
    if not isinstance(data, dict):
        raise UompError(ErrorCode.CONFIG_ERROR, f"[{section}] must be a table")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for other, other_cls in CONFIG_SECTIONS.items():
        table = doc.get(other, {})
        if other != section and isinstance(table, dict):
            other_names = {f.name for f in dataclasses.fields(other_cls)}
            if set(table) - other_names:
                raise _unknown("setting(s)", set(table) - other_names, other_names, f"in [{other}]")
    unknown = set(data) - names
    if unknown:
        raise _unknown("setting(s)", unknown, names, f"in [{section}]")
    values: dict[str, Any] = {}
    for name in names:
        env = os.environ.get(f"UOMP_{section.upper()}_{name.upper()}")
        if name in data:
            values[name] = _coerce(data[name], hints[name], f"{section}.{name}")
        if env is not None:
            values[name] = _coerce(env, hints[name], f"UOMP_{section.upper()}_{name.upper()}")
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _coerce(value, hints[name], f"--{name.replace('_', '-')}")
    return cls(**values)


# Every section a config file may hold, and the settings class it fills (load_section checks
# a whole file against it).
CONFIG_SECTIONS: dict[str, Any] = {
    "guard": GuardConfig,
    "gateway": GatewayConfig,
    "tunnel": TunnelSettings,
    "anchor": AnchorConfig,
    "dashboard": DashboardConfig,
    "registry": RegistryConfig,
    "trust": TrustConfig,
}
