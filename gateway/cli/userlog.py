"""The user's own changes as events of the one audit log (issue 10): memory added, replaced and
deleted, imports (counts, never values), agent certificates issued and revoked, signing keys rotated.

Agents' reads are not the only thing worth a record: a user (or someone at the user's keyboard)
changing what agents can read or who they are must leave a trace in the same verifiable log. The
events carry ``session_id`` ``"user"``, ``via`` ``"cli"`` (or ``"dashboard"``), and the agent the change
concerns where there is one, so ``uomp audit --session user`` lists them and ``--agent X`` shows an
agent's certificates beside its reads. The event is durable before the command reports success.
"""

from __future__ import annotations

from typing import Any

from gateway.config import GuardConfig, Paths, load_section
from gateway.guard.audit import open_audit

USER_SESSION = "user"
USER_AGENT = "user"


def record(paths: Paths, action: str, reason: str, *, agent_id: str = USER_AGENT, key: str | None = None,
           detail: str | None = None, count: int | None = None, via: str = "cli") -> None:
    """Write one allowed event for a change the user made, and wait until it is durable."""
    cfg = load_section(GuardConfig, "guard", file=paths.config_file)
    audit = open_audit(paths, cfg)
    try:
        extra: dict[str, Any] = {"origin": via}
        if count is not None:
            extra["count"] = count
        ticket = audit.record(session_id=USER_SESSION, agent_id=agent_id, action=action, allowed=True,
                              reason=reason, key=key, detail=detail, via=via, extra=extra)
        audit.flush_sync(ticket)
    finally:
        audit.close()
