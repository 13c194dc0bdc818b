"""The ERC-8004 agent registration file (the "agent card" a token URI points at), pure.

What is read (everything else is ignored, nothing is executed or followed):

* ``type`` must be ``https://eips.ethereum.org/EIPS/eip-8004#registration-v1``;
* ``name`` (required), ``description``, ``image``: display text, no control or bidirectional
  characters (the same rule as uom.json's);
* ``services`` (the current name; ``endpoints`` in earlier drafts, one of them): a list of
  ``{"name", "endpoint", "version"?}``. The UOMP service is the one named ``UOMP``: its
  ``endpoint`` is the URL of the agent's ``uom.json`` and its optional ``manifestHash``
  (``0x`` + 64 hex, the KECCAK-256 of the file's bytes, as ERC-8004 hashes its off-chain files)
  pins it;
* ``registrations``: ``[{"agentId": N, "agentRegistry": "eip155:CHAIN:0xADDRESS"}]``. The
  on-chain / off-chain join: a file is accepted for agent N of registry R only when it lists
  exactly that pair (address compared case-insensitively), so a file copied from another agent,
  or from the same number in another registry, is refused;
* ``supportedTrust``: list of strings.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.core.manifest import is_display_safe
from gateway.errors import ErrorCode, UompError

REGISTRATION_TYPE = "https://eips.ethereum.org/EIPS/eip-8004#registration-v1"
UOMP_SERVICE = "UOMP"
MAX_TEXT = 4000
MAX_SERVICES = 64
MAX_REGISTRATIONS = 64
_HASH = re.compile(r"0x[0-9a-fA-F]{64}")
_REGISTRY = re.compile(r"eip155:([0-9]{1,20}):(0x[0-9a-fA-F]{40})")


@dataclass(frozen=True)
class Service:
    """One service a registration file lists: its name and endpoint."""

    name: str
    endpoint: str
    version: str | None
    manifest_hash: str | None  # UOMP service only: 0x keccak-256 of uom.json


@dataclass(frozen=True)
class Registration:
    """A checked ERC-8004 registration file (the agent's card)."""

    name: str
    description: str
    image: str | None
    services: tuple[Service, ...]
    registrations: tuple[tuple[int, str], ...]  # (agentId, "eip155:chain:0xaddress" lower-cased)
    supported_trust: tuple[str, ...]

    def uomp(self) -> Service | None:
        found = [s for s in self.services if s.name == UOMP_SERVICE]
        return found[0] if len(found) == 1 else None

    def names(self, agent_id: int, registry: str) -> bool:
        return (agent_id, registry.lower()) in self.registrations

    def search_text(self) -> str:
        parts = [self.name, self.description, *(s.name for s in self.services), *self.supported_trust]
        return "\n".join(parts).casefold()


def registry_id(chain_id: int, address: str) -> str:
    """The ERC-8004 registry identifier ``eip155:<chainId>:<address>`` (address lower-cased here)."""
    return f"eip155:{chain_id}:{address.lower()}"


def parse_registry_id(text: str) -> tuple[int, str]:
    """``eip155:CHAIN:0xADDRESS`` (or ``CHAIN:0xADDRESS``) -> (chain id, lower-case address)."""
    candidate = text if text.startswith("eip155:") else f"eip155:{text}"
    m = _REGISTRY.fullmatch(candidate)
    if m is None:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"{text[:80]!r} is not a registry id; write it as CHAIN_ID:0xADDRESS "
            "(e.g. 1:0x8004A169FB4a3325136EB29fA0ceB6D2e539a432)",
        )
    return int(m.group(1)), m.group(2).lower()


def _bad(what: str) -> UompError:
    return UompError(ErrorCode.REGISTRATION_INVALID, f"the registration file {what}; the agent's publisher must fix it")


def _text(obj: dict[str, Any], key: str, *, required: bool, max_len: int = MAX_TEXT) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise _bad(f"has no {key}")
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise _bad(f"has a {key} that is not a string of at most {max_len} characters")
    if not is_display_safe(value.replace("\n", " ").replace("\t", " ")):
        raise _bad(f"has a {key} with control or bidirectional-override characters")
    return value


def _service(raw: Any) -> Service:
    if not isinstance(raw, dict):
        raise _bad("lists a service that is not an object")
    name = _text(raw, "name", required=True, max_len=64) or ""
    endpoint = _text(raw, "endpoint", required=True, max_len=2048) or ""
    version = _text(raw, "version", required=False, max_len=64) if isinstance(raw.get("version"), str) else None
    manifest_hash = None
    if name == UOMP_SERVICE and raw.get("manifestHash") is not None:
        h = raw.get("manifestHash")
        if not isinstance(h, str) or not _HASH.fullmatch(h):
            raise _bad("has a UOMP manifestHash that is not 0x + 64 hex digits (keccak-256)")
        manifest_hash = h.lower()
    return Service(name=name, endpoint=endpoint, version=version, manifest_hash=manifest_hash)


def _registration(raw: Any) -> tuple[int, str]:
    if not isinstance(raw, dict):
        raise _bad("lists a registration that is not an object")
    agent_id, registry = raw.get("agentId"), raw.get("agentRegistry")
    if isinstance(agent_id, bool) or not isinstance(agent_id, int) or agent_id < 0 or agent_id >= 2**256:
        raise _bad("lists a registration whose agentId is not a token id")
    if not isinstance(registry, str) or not _REGISTRY.fullmatch(registry):
        raise _bad("lists a registration whose agentRegistry is not eip155:CHAIN:0xADDRESS")
    return agent_id, registry.lower()


def parse_registration(data: bytes) -> Registration:
    """Validate a registration file's bytes (already bounded by the fetch) into a :class:`Registration`."""
    try:
        obj = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _bad("is not JSON") from exc
    if not isinstance(obj, dict):
        raise _bad("is not a JSON object")
    if obj.get("type") != REGISTRATION_TYPE:
        raise _bad(f'has no "type": "{REGISTRATION_TYPE}"')
    if "services" in obj and "endpoints" in obj:
        raise _bad('has both "services" and "endpoints"')
    services_raw = obj.get("services", obj.get("endpoints", []))
    if not isinstance(services_raw, list) or len(services_raw) > MAX_SERVICES:
        raise _bad(f"has services that are not a list of at most {MAX_SERVICES}")
    services = tuple(_service(s) for s in services_raw)
    if sum(1 for s in services if s.name == UOMP_SERVICE) > 1:
        raise _bad("names more than one UOMP service")
    regs_raw = obj.get("registrations", [])
    if not isinstance(regs_raw, list) or len(regs_raw) > MAX_REGISTRATIONS:
        raise _bad(f"has registrations that are not a list of at most {MAX_REGISTRATIONS}")
    trust_raw = obj.get("supportedTrust", [])
    if not isinstance(trust_raw, list) or not all(isinstance(t, str) and len(t) <= 64 for t in trust_raw):
        raise _bad("has a supportedTrust that is not a list of short strings")
    if not all(is_display_safe(t) for t in trust_raw):
        raise _bad("has a supportedTrust entry with control characters")
    return Registration(
        name=_text(obj, "name", required=True, max_len=200) or "",
        description=_text(obj, "description", required=False) or "",
        image=_text(obj, "image", required=False, max_len=2048),
        services=services,
        registrations=tuple(_registration(r) for r in regs_raw),
        supported_trust=tuple(trust_raw[:32]),
    )
