"""What ``uomp registry`` does: the configured registries, the search index, show and install.

Spec §17.2/§17.3: a registry only finds agents and fetches their files; it never takes part in an
authorization decision, and nothing needs one (none is configured by default).

Files (``Paths``): ``registries.json`` (0600: an RPC URL may carry an API key) lists the
registries the user added; ``registry-cache/<chain>-<address>.json`` is what search indexed
(the last block read, and per agent its owner, token URI and the searchable part of its
registration file). The cache only speeds up search: ``show`` and ``install`` read the chain and
fetch the files again, and every check of install is made on what it fetched itself.

Install, in order (each step refuses with its own code, nothing is written before the last):
the node is on the registry's chain and the address is an ERC-721 registry; the agent exists
(``ownerOf``); its token URI gives the registration file (``data:`` read in place, else fetched
under :mod:`gateway.registry.fetch`'s rules); when the registry records a content hash for it (the
on-chain metadata ``registrationHash``: 32 bytes, KECCAK-256 of the file, as ERC-8004 hashes its
off-chain files) the bytes must match it (``CONTENT_HASH_MISMATCH``); the file must list this
agent id in this registry (``REGISTRATION_INVALID``); its ``UOMP`` service names the uom.json,
fetched the same way and checked against its ``manifestHash`` when given; the manifest must be
valid (``MANIFEST_INVALID``). Then ``DIR/uom.json`` (the bytes as fetched) and ``DIR/registry.json``
(where it came from, what was checked) are written atomically.

Longer than ~500 lines on purpose: the registry commands (add, search, install, the install record
authorize reads) share one file set and one fetch policy.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.anchor.base import check_rpc_url, redact_url
from gateway.config import Paths, RegistryConfig
from gateway.core import manifest as manifest_mod
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write
from gateway.registry import card
from gateway.registry.chain import Chain
from gateway.registry.fetch import FetchPolicy, decode_data_uri, fetch, shown

REGISTRIES_VERSION = 1
CACHE_VERSION = 1
PROVENANCE_FILE = "registry.json"
PROVENANCE_VERSION = 1
HASH_METADATA_KEY = "registrationHash"
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_REGISTRIES = 64


@dataclass(frozen=True)
class RegistryEntry:
    """A registry the user added: its chain, address, RPC and optional reputation registry."""

    id: str  # eip155:<chain>:<address>
    chain_id: int
    address: str
    rpc_url: str
    added_at: str
    from_block: int = 0
    reputation: str = ""  # its Reputation Registry (0x address); "" = none: nothing is ever reported
    feedback_key_file: str = ""  # the 0600 key file of the account that reports (uomp registry report)

    def chain(self, cfg: RegistryConfig) -> Chain:
        return Chain(self.rpc_url, self.chain_id, self.address, timeout_s=cfg.rpc_timeout_seconds)


def now_iso() -> str:
    """The current time as an ISO 8601 UTC timestamp."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def policy(cfg: RegistryConfig) -> FetchPolicy:
    """The fetch bounds of the ``[registry]`` settings."""
    return FetchPolicy(
        max_bytes=cfg.fetch_max_bytes,
        timeout_s=cfg.fetch_timeout_seconds,
        max_redirects=cfg.fetch_max_redirects,
        allow_internal=cfg.allow_internal,
        ca_file=Path(cfg.ca_file) if cfg.ca_file else None,
    )


def _read_json(path: Path, what: str) -> Any:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid != os.getuid():
        raise UompError(ErrorCode.UNSAFE_PERMISSIONS, f"{path} is writable by others or not yours; chmod 600 {path}")
    if st.st_size > MAX_FILE_BYTES:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{path} is larger than {MAX_FILE_BYTES} bytes; remove it")
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{path} is not a valid {what}; fix or remove it") from exc


# ------------------------------------------------------------------------------ the registries


def load_registries(paths: Paths) -> list[RegistryEntry]:
    """The registries the user added."""
    doc = _read_json(paths.registries_file, "registry list")
    if doc is None:
        return []
    try:
        if doc.get("uomp_registries") != REGISTRIES_VERSION:
            raise ValueError
        return [RegistryEntry(**e) for e in doc["registries"]]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise UompError(
            ErrorCode.CONFIG_ERROR, f"{paths.registries_file} is not a valid registry list; fix or remove it"
        ) from exc


def _save_registries(paths: Paths, entries: list[RegistryEntry]) -> None:
    doc = {"uomp_registries": REGISTRIES_VERSION, "registries": [e.__dict__ for e in entries]}
    atomic_write(paths.registries_file, (json.dumps(doc, indent=2) + "\n").encode(), mode=0o600)


def add_registry(
    paths: Paths,
    cfg: RegistryConfig,
    spec: str,
    rpc_url: str,
    *,
    from_block: int = 0,
    reputation: str = "",
    feedback_key_file: str = "",
) -> RegistryEntry:
    """Add (or update the RPC of) a registry after checking that the node is on its chain and the
    address holds an ERC-721 registry."""
    chain_id, address = card.parse_registry_id(spec)
    try:
        check_rpc_url(rpc_url)
    except ValueError as exc:
        raise UompError(ErrorCode.INVALID_REQUEST, f"--rpc: {exc}") from exc
    entry = RegistryEntry(
        id=card.registry_id(chain_id, address),
        chain_id=chain_id,
        address=address,
        rpc_url=rpc_url,
        added_at=now_iso(),
        from_block=max(0, from_block),
        reputation=reputation.lower(),
        feedback_key_file=str(Path(feedback_key_file).resolve()) if feedback_key_file else "",
    )
    if reputation and not (len(reputation) == 42 and reputation.startswith("0x")):
        raise UompError(ErrorCode.INVALID_REQUEST, "--reputation must be the 0x address of a Reputation Registry")
    if bool(reputation) != bool(feedback_key_file):
        raise UompError(ErrorCode.INVALID_REQUEST, "--reputation and --feedback-key go together (opt-in reporting)")
    entry.chain(cfg).check()
    entries = [e for e in load_registries(paths) if e.id != entry.id]
    if len(entries) >= MAX_REGISTRIES:
        raise UompError(ErrorCode.INVALID_REQUEST, f"at most {MAX_REGISTRIES} registries; remove one first")
    _save_registries(paths, [*entries, entry])
    return entry


def remove_registry(paths: Paths, spec: str) -> RegistryEntry:
    """Removes the registry ``spec`` names; its entry."""
    entry = find_registry(paths, spec)
    _save_registries(paths, [e for e in load_registries(paths) if e.id != entry.id])
    _cache_path(paths, entry).unlink(missing_ok=True)
    return entry


def find_registry(paths: Paths, spec: str | None) -> RegistryEntry:
    """The registry ``spec`` names (the only one when None); CONFIG_ERROR otherwise."""
    entries = load_registries(paths)
    if spec is None:
        if len(entries) == 1:
            return entries[0]
        if not entries:
            raise UompError(
                ErrorCode.REGISTRY_UNKNOWN,
                "no registry is configured; add one with: uomp registry add CHAIN_ID:0xADDRESS --rpc URL",
            )
        raise UompError(ErrorCode.REGISTRY_UNKNOWN, "several registries are configured; name one with --registry ID")
    chain_id, address = card.parse_registry_id(spec)
    wanted = card.registry_id(chain_id, address)
    for e in entries:
        if e.id == wanted:
            return e
    raise UompError(
        ErrorCode.REGISTRY_UNKNOWN,
        f"registry {wanted} is not configured; add it with: uomp registry add {chain_id}:{address} --rpc URL",
    )


# ------------------------------------------------------------------------------ fetching


def _get(uri: str, pol: FetchPolicy) -> bytes:
    if uri.startswith("data:"):
        return decode_data_uri(uri, pol.max_bytes)
    return fetch(uri, pol).body


def redact(rpc_url: str) -> str:
    """The node as messages may name it: scheme://host:port (RPC URLs often carry API keys)."""
    return redact_url(rpc_url)


def khex(data: bytes) -> str:
    """``0x`` + KECCAK-256 of ``data`` (ERC-8004's hash of off-chain files)."""
    try:
        from Crypto.Hash import keccak  # pycryptodome: the [registry] extra
    except ImportError as exc:
        raise UompError(
            ErrorCode.CONFIG_ERROR, "keccak-256 needs pycryptodome: pip install 'uomp-gateway[registry]'"
        ) from exc
    return "0x" + keccak.new(data=data, digest_bits=256).hexdigest()


# ------------------------------------------------------------------------------ search


@dataclass
class SearchResult:
    """One agent a search found, with what its card says."""

    registry: str
    agent_id: int
    owner: str | None
    name: str
    description: str
    services: list[str]
    trust: list[str]


@dataclass
class SearchReport:
    """A search's results and how much of the registry the index covered."""

    results: list[SearchResult] = field(default_factory=list)
    indexed: int = 0  # agents with a readable registration file in the index
    pending: int = 0  # agents whose file was not fetched yet (search_max_fetches)
    failed: int = 0  # agents whose file could not be fetched or is invalid
    new_blocks: int = 0


def _cache_path(paths: Paths, entry: RegistryEntry) -> Path:
    return paths.registry_cache_dir / f"{entry.chain_id}-{entry.address}.json"


def _load_cache(paths: Paths, entry: RegistryEntry) -> dict[str, Any]:
    doc = _read_json(_cache_path(paths, entry), "registry cache")
    fresh = {"uomp_registry_cache": CACHE_VERSION, "id": entry.id, "scanned_to": entry.from_block - 1, "agents": {}}
    if not isinstance(doc, dict) or doc.get("uomp_registry_cache") != CACHE_VERSION or doc.get("id") != entry.id:
        return fresh
    if not isinstance(doc.get("agents"), dict) or not isinstance(doc.get("scanned_to"), int):
        return fresh
    return doc


def index(
    paths: Paths, cfg: RegistryConfig, entry: RegistryEntry, *, refresh: bool = False
) -> tuple[dict[str, Any], int, int]:
    """Bring the cache of ``entry`` up to the chain's head; fetch at most ``search_max_fetches``
    registration files. Returns (cache, new blocks read, fetches done)."""
    chain = entry.chain(cfg)
    chain.check()
    cache = _load_cache(paths, entry)
    head = chain.block_number()
    start = int(cache["scanned_to"]) + 1
    agents: dict[str, Any] = cache["agents"]
    for ev in chain.events(max(start, entry.from_block), head, cfg.log_block_range) if start <= head else ():
        a = agents.setdefault(
            str(ev.agent_id), {"owner": None, "uri": "", "card": None, "error": None, "card_uri": None}
        )
        if ev.kind in ("registered", "uri"):
            a["uri"] = ev.uri or ""
        if ev.owner is not None and ev.kind in ("registered", "transfer"):
            a["owner"] = ev.owner
    new_blocks = max(0, head - start + 1)
    cache["scanned_to"] = max(head, int(cache["scanned_to"]))
    pol = policy(cfg)
    fetches = 0
    for agent_id in sorted(agents, key=int):
        a = agents[agent_id]
        if not a["uri"] or (a["card_uri"] == a["uri"] and not (refresh and a["error"])):
            continue
        is_data = a["uri"].startswith("data:")
        if not is_data and fetches >= cfg.search_max_fetches:
            continue
        fetches += 0 if is_data else 1
        a["card_uri"] = a["uri"]
        try:
            reg = card.parse_registration(_get(a["uri"], pol))
            if not reg.names(int(agent_id), entry.id):
                raise UompError(ErrorCode.REGISTRATION_INVALID, "the registration file names another agent")
        except UompError as exc:
            a["card"], a["error"] = None, f"{exc.code}: {exc.message}"[:300]
            continue
        a["card"] = {
            "name": reg.name,
            "description": reg.description,
            "services": [s.name for s in reg.services],
            "trust": list(reg.supported_trust),
            "text": reg.search_text(),
        }
        a["error"] = None
    paths.registry_cache_dir.mkdir(mode=0o700, exist_ok=True)
    atomic_write(_cache_path(paths, entry), json.dumps(cache, separators=(",", ":")).encode(), mode=0o600)
    return cache, new_blocks, fetches


def search(
    paths: Paths, cfg: RegistryConfig, keyword: str, *, registry: str | None = None, refresh: bool = False
) -> SearchReport:
    """Agents whose name, description, service names or supported trust contain ``keyword``
    (case-insensitive), over every configured registry (or the one named)."""
    entries = [find_registry(paths, registry)] if registry else load_registries(paths)
    if not entries:
        find_registry(paths, None)  # raises REGISTRY_UNKNOWN with the how-to
    needle = keyword.casefold().strip()
    report = SearchReport()
    for entry in entries:
        cache, new_blocks, _ = index(paths, cfg, entry, refresh=refresh)
        report.new_blocks += new_blocks
        for agent_id, a in sorted(cache["agents"].items(), key=lambda kv: int(kv[0])):
            c = a.get("card")
            if c is None:
                if a.get("uri") and a.get("card_uri") != a.get("uri"):
                    report.pending += 1
                elif a.get("error"):
                    report.failed += 1
                continue
            report.indexed += 1
            if needle and needle not in c["text"] and needle != agent_id:
                continue
            report.results.append(
                SearchResult(
                    entry.id, int(agent_id), a.get("owner"), c["name"], c["description"], c["services"], c["trust"]
                )
            )
    return report


# ------------------------------------------------------------------------------ show and install


@dataclass(frozen=True)
class Fetched:
    """An agent's registration file and manifest, fetched and checked."""

    registry: RegistryEntry
    agent_id: int
    owner: str
    registration_uri: str
    registration: card.Registration
    registration_hash: str
    registration_pinned: str  # "chain-metadata" | "data-uri" | "none"
    manifest_uri: str | None
    manifest_bytes: bytes | None
    manifest_hash: str | None
    manifest_pinned: bool


def parse_agent(text: str) -> tuple[str | None, int]:
    """``N`` or ``CHAIN:0xADDRESS:N`` / ``eip155:CHAIN:0xADDRESS:N`` -> (registry spec or None, agent id)."""
    head, sep, tail = text.rpartition(":")
    if not tail.isdigit() or len(tail) > 78:
        raise UompError(
            ErrorCode.INVALID_REQUEST, f"{text[:80]!r} is not an agent: give its number N or CHAIN:0xADDRESS:N"
        )
    return (head if sep else None), int(tail)


def lookup(paths: Paths, cfg: RegistryConfig, registry: str | None, agent_id: int, *, with_manifest: bool) -> Fetched:
    """Read agent ``agent_id`` of the registry from the chain, fetch and check its files (module docstring)."""
    entry = find_registry(paths, registry)
    chain = entry.chain(cfg)
    chain.check()
    owner = chain.owner_of(agent_id)
    if owner is None:
        raise UompError(
            ErrorCode.NOT_FOUND, f"registry {entry.id} has no agent {agent_id}; check the number (uomp registry search)"
        )
    uri = chain.token_uri(agent_id)
    if not uri:
        raise UompError(
            ErrorCode.REGISTRATION_INVALID, f"agent {agent_id} of {entry.id} has no registration file (empty token URI)"
        )
    pol = policy(cfg)
    body = _get(uri, pol)
    digest = khex(body)
    recorded = chain.metadata(agent_id, HASH_METADATA_KEY)
    if recorded:
        if len(recorded) != 32:
            raise UompError(
                ErrorCode.REGISTRATION_INVALID,
                f"agent {agent_id}'s on-chain {HASH_METADATA_KEY} is not 32 bytes; the publisher must fix it",
            )
        if "0x" + recorded.hex() != digest:
            raise UompError(
                ErrorCode.CONTENT_HASH_MISMATCH,
                f"the registration file at {shown(uri)} is not the one registry {entry.id} records for agent "
                f"{agent_id} (keccak-256 {digest[:18]}…, recorded 0x{recorded.hex()[:16]}…): "
                "changed or replaced; not installed",
            )
        pinned = "chain-metadata"
    else:
        pinned = "data-uri" if uri.startswith("data:") else "none"
    reg = card.parse_registration(body)
    if not reg.names(agent_id, entry.id):
        listed = ", ".join(f"{r} #{n}" for n, r in reg.registrations[:4]) or "none"
        raise UompError(
            ErrorCode.REGISTRATION_INVALID,
            f"the registration file of agent {agent_id} does not name agent {agent_id} of {entry.id} "
            f"(it names: {listed}): it belongs to another agent; not installed",
        )
    m_uri = m_bytes = m_hash = None
    svc = reg.uomp()
    if with_manifest:
        if svc is None:
            raise UompError(
                ErrorCode.REGISTRATION_INVALID,
                f"agent {agent_id}'s registration file has no UOMP service naming its uom.json; it is not a UOMP agent",
            )
        m_uri = svc.endpoint
        m_bytes = _get(m_uri, pol)
        m_hash = khex(m_bytes)
        if svc.manifest_hash is not None and svc.manifest_hash != m_hash:
            raise UompError(
                ErrorCode.CONTENT_HASH_MISMATCH,
                f"the uom.json at {shown(m_uri)} is not the one agent {agent_id}'s registration file names "
                f"(manifestHash {svc.manifest_hash[:18]}…, fetched {m_hash[:18]}…): changed or replaced; not installed",
            )
    return Fetched(
        registry=entry,
        agent_id=agent_id,
        owner=owner,
        registration_uri=uri,
        registration=reg,
        registration_hash=digest,
        registration_pinned=pinned,
        manifest_uri=m_uri,
        manifest_bytes=m_bytes,
        manifest_hash=m_hash,
        manifest_pinned=svc is not None and svc.manifest_hash is not None,
    )


def install(
    paths: Paths, cfg: RegistryConfig, registry: str | None, agent_id: int, out: Path, *, force: bool = False
) -> tuple[Fetched, manifest_mod.Manifest]:
    """Fetches, checks and writes an agent's registration file and uom.json into ``out``; records the install."""
    got = lookup(paths, cfg, registry, agent_id, with_manifest=True)
    assert got.manifest_bytes is not None
    m = manifest_mod.parse_manifest(got.manifest_bytes)
    target = out / "uom.json"
    if out.exists() and not out.is_dir():
        raise UompError(ErrorCode.INVALID_REQUEST, f"--out {out} exists and is not a directory")
    if target.exists() and not force:
        try:
            same = target.read_bytes() == got.manifest_bytes
        except OSError:
            same = False
        if not same:
            raise UompError(
                ErrorCode.INVALID_REQUEST, f"{target} exists with other content; pass --force to replace it"
            )
    doc = {
        "uomp_registry_install": PROVENANCE_VERSION,
        "registry": got.registry.id,
        "agent_id": got.agent_id,
        "owner": got.owner,
        "registration_uri": shown(got.registration_uri) if not got.registration_uri.startswith("data:") else "data:",
        "registration_keccak256": got.registration_hash,
        "registration_pinned": got.registration_pinned,
        "manifest_uri": shown(got.manifest_uri or ""),
        "manifest_keccak256": got.manifest_hash,
        "manifest_pinned": got.manifest_pinned,
        "manifest_agent_id": m.agent.id,
        "installed_at": now_iso(),
    }
    record = (json.dumps(doc, indent=2) + "\n").encode()
    paths.registry_installs_dir.mkdir(mode=0o700, exist_ok=True)
    # the user's own record first: authorize trusts only it; the copy beside uom.json is for people
    atomic_write(paths.registry_installs_dir / f"{got.manifest_hash}.json", record, mode=0o600)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(target, got.manifest_bytes, mode=0o644)
    atomic_write(out / PROVENANCE_FILE, record, mode=0o644)
    return got, m


# ------------------------------------------------------------------------------ what authorize shows


@dataclass(frozen=True)
class Provenance:
    """What ``uomp authorize`` may say of an agent's registry listing, from the user's install record."""

    lines: tuple[str, ...]
    warnings: tuple[str, ...]


def provenance(paths: Paths, manifest_path: Path, manifest_bytes: bytes) -> Provenance | None:
    """What ``uomp authorize`` says of a manifest installed by ``uomp registry install`` (None: not installed so).

    Only the user's own record (``Paths.registry_installs_dir``, by the manifest's keccak-256) counts:
    a ``registry.json`` that came with an agent's files could claim any listing."""
    beside = manifest_path.parent / PROVENANCE_FILE
    try:
        digest = khex(manifest_bytes)
    except UompError:
        return None
    path = paths.registry_installs_dir / f"{digest}.json"
    if not path.exists():
        if beside.exists():
            return Provenance(
                (),
                (
                    f"{beside} claims a registry listing, but `uomp registry install` did not install this "
                    "uom.json (or it changed since): no listing is shown",
                ),
            )
        return None
    try:
        raw = path.read_bytes()[: 64 * 1024]
        doc = json.loads(raw)
        reg, agent_id, owner = str(doc["registry"]), int(doc["agent_id"]), str(doc["owner"])
        want = str(doc["manifest_keccak256"])
        installed = str(doc.get("installed_at", "?"))
        pinned = str(doc.get("registration_pinned", "none"))
        m_pinned = bool(doc.get("manifest_pinned"))
    except (OSError, ValueError, KeyError, TypeError):
        return Provenance((), (f"{path} is not a registry install record; ignored",))
    if not all(manifest_mod.is_display_safe(t) for t in (reg, owner, installed, pinned)) or want != digest:
        return Provenance((), (f"{path} is not a valid registry install record; ignored",))
    how = {
        "chain-metadata": "registration file pinned by its on-chain hash",
        "data-uri": "registration file stored on chain",
        "none": "registration file NOT pinned by the registry",
    }.get(pinned, "registration file pinning unknown")
    lines = (
        f"Registry:  listed in registry {reg} as agent {agent_id}, owner {owner}",
        f"           installed {installed}; {how}; uom.json "
        + ("pinned by its manifestHash" if m_pinned else "NOT pinned by a hash"),
        "           (the registry only lists agents: it takes no part in this decision)",
    )
    return Provenance(lines, ())
