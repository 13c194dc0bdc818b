"""The agent bundle: what ``uomp authorize --remote`` hands a remote agent, in one 0600 JSON file.

::

    {"uomp_bundle": 1, "agent_id": ..., "session_id": ..., "gateway_url": "https://...",
     "access_token": ..., "access_expires_at": ISO, "refresh_token": ..., "refresh_expires_at": ISO,
     "session_expires_at": ISO (when the session ends: no refresh goes past it),
     "ca_cert": PEM (the gateway's CA), "agent_cert": PEM,
     "agent_key": PEM (only when the user made the key: ``--out``) or "agent_key_file": path,
     "payload_public_key": the user's X25519 payload key, base64 of 32 bytes (agents seal payloads to it;
     gateway/payloads/userkey.py, docs/payloads.md),
     "audit_verifier_key": the audit log's verifier key, name+keyid+base64 (the SDK checks every checkpoint
     against it; docs/audit.md "Agents as witnesses")}

The SDK rewrites the token fields atomically after every refresh: refresh tokens rotate, and an
agent that restarts with a spent one would revoke its own session (reuse detection).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write

BUNDLE_VERSION = 1
MAX_BUNDLE_BYTES = 256 * 1024


@dataclass(frozen=True)
class AgentBundle:
    """What an authorized remote agent holds: its ids, the gateway URL, its tokens and certificate files."""

    agent_id: str
    session_id: str
    gateway_url: str
    access_token: str = field(repr=False)
    access_expires_at: str
    refresh_token: str | None = field(repr=False)
    refresh_expires_at: str | None
    ca_cert: str
    agent_cert: str | None = None
    agent_key: str | None = field(default=None, repr=False)
    agent_key_file: str | None = None
    payload_public_key: str | None = None
    session_expires_at: str | None = None
    audit_verifier_key: str | None = None

    def with_tokens(self, answer: dict[str, Any]) -> AgentBundle:
        return replace(
            self,
            access_token=answer["access_token"],
            access_expires_at=answer["expires_at"],
            refresh_token=answer.get("refresh_token", self.refresh_token),
            refresh_expires_at=answer.get("refresh_expires_at", self.refresh_expires_at),
        )

    def to_json(self) -> bytes:
        doc = {"uomp_bundle": BUNDLE_VERSION, **asdict(self)}
        return (json.dumps(doc, indent=2) + "\n").encode()


def write_bundle(path: Path, bundle: AgentBundle) -> None:
    """Writes the bundle atomically, readable by its owner only (it holds live tokens)."""
    atomic_write(Path(path), bundle.to_json(), mode=0o600)


def load_bundle(path: Path) -> AgentBundle:
    """The bundle at ``path``, refused unless only its owner can read it."""
    p = Path(path)
    try:
        if p.stat().st_mode & 0o077:
            raise UompError(
                ErrorCode.CONFIG_ERROR, f"{p} holds tokens and must not be readable by others; chmod 600 it"
            )
        raw = p.read_bytes()
    except FileNotFoundError as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, f"no agent bundle at {p}") from exc
    if len(raw) > MAX_BUNDLE_BYTES:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is too large to be an agent bundle")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is not valid JSON") from exc
    if not isinstance(doc, dict) or doc.get("uomp_bundle") != BUNDLE_VERSION:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is not a version {BUNDLE_VERSION} UOMP agent bundle")
    fields = {f for f in AgentBundle.__dataclass_fields__}
    required = ("agent_id", "session_id", "gateway_url", "access_token", "access_expires_at", "ca_cert")
    missing = [f for f in required if not isinstance(doc.get(f), str) or not doc[f]]
    if missing:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{p} is missing {', '.join(missing)}")
    return AgentBundle(**{k: v for k, v in doc.items() if k in fields})
