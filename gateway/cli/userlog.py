"""The user's own changes as events of the one audit log: memory added, replaced and
deleted, imports (counts, never values), agent certificates issued and revoked, signing keys rotated.

Agents' reads are not the only thing worth a record: a user (or someone at the user's keyboard)
changing what agents can read or who they are must leave a trace in the same verifiable log. The
events carry ``session_id`` ``"user"``, ``via`` ``"cli"`` (or ``"dashboard"``), and the agent the change
concerns where there is one, so ``uomp audit --session user`` lists them and ``--agent X`` shows an
agent's certificates beside its reads.

Every change runs inside :func:`change`: the audit log is opened and one write transaction is tried
*before* the change is made, so a log that another process holds locked, that cannot be written or
that is inconsistent refuses the command with nothing changed. The event is durable before the
command reports success. What is left: a disk that fills up between the change and its event (the
change and the log share ``$UOMP_HOME``); the command then says the change was made and its event
is missing.

The check at open costs the same whatever the log's size: the counts, the tree against the witness
record, the newest checkpoint's signature and every event after it, and
:data:`~gateway.ledger.integrity.CHANGE_TAIL_EVENTS` events before it in full
(:mod:`gateway.ledger.integrity`; the guard's check at its start reads a longer tail). So one approval
after a thousand others costs what the first did, and a log that fails any of it is still refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.atrest import writers
from gateway.config import GuardConfig, Paths, load_section
from gateway.errors import UompError

USER_SESSION = "user"
USER_AGENT = "user"


@dataclass
class UserEvent:
    """What the change inside :func:`change` did; no ``action``: nothing changed, no event."""

    action: str | None = None
    reason: str = ""
    agent_id: str = USER_AGENT
    key: str | None = None
    detail: str | None = None
    count: int | None = None
    extra: dict[str, Any] | None = None  # more event fields (gateway.guard.audit.EXTRA_FIELDS only)


@contextlib.contextmanager
def change(paths: Paths, *, via: str = "cli") -> Iterator[UserEvent]:
    """Around one change the user makes (see the module docstring). The block makes the change and
    fills in the event it yields; an exception from the block records nothing and goes on."""
    cfg = load_section(GuardConfig, "guard", file=paths.config_file)
    with writers.writing(paths):  # no seal rewrites audit.db while this change writes it
        yield from _change(paths, cfg, via)


def _change(paths: Paths, cfg: GuardConfig, via: str) -> Iterator[UserEvent]:
    from gateway.guard.audit import open_audit  # (the audit log's code: only for a command that changes something)
    from gateway.ledger.integrity import CHANGE_TAIL_EVENTS

    audit = open_audit(paths, cfg, tail=CHANGE_TAIL_EVENTS)
    try:
        audit.writer.probe_sync()  # a write transaction now: refused here, before anything changes
        event = UserEvent()
        yield event
        if event.action is None:
            return
        extra: dict[str, Any] = {"origin": via}
        if event.count is not None:
            extra["count"] = event.count
        for name, value in (event.extra or {}).items():
            extra.setdefault(name, value)
        ticket = audit.record(
            session_id=USER_SESSION,
            agent_id=event.agent_id,
            action=event.action,
            allowed=True,
            reason=event.reason,
            key=event.key,
            detail=event.detail,
            via=via,
            extra=extra,
        )
        try:
            audit.flush_sync(ticket)
        except UompError as exc:
            raise UompError(
                exc.code,
                f"the change WAS made, but its audit event could not be written "
                f"({exc.message}); free space on the disk of {paths.home}, then check the log with "
                "'uomp audit verify'",
            ) from exc
    finally:
        audit.close()
