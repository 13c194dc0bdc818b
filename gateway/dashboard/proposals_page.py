"""The dashboard's inbox of agents' proposed memory changes (docs/writes.md), ``/proposals``.

Each pending proposal is shown as the change it makes: the item as it is now and as proposed
(value, tags, sensitivity, description, every agent-written text JSON-escaped and then
HTML-escaped), the agent, its session and how it came in. Approve carries the change hash of what
the page showed; the store applies that change only, and only while the item is still at the
proposal's base version (:func:`gateway.cli.proposals.approve_shown`, the CLI's own path, audited
with ``origin`` ``dashboard``). Approve and reject are POSTs under the dashboard's gate (loopback,
Host, session cookie, Origin, CSRF token) and its confirmation step, as revoke is.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING, Any

from gateway import httpd
from gateway.cli import proposals as proposals_cli
from gateway.cli import userlog
from gateway.config import GuardConfig, Paths, load_section
from gateway.errors import ErrorCode, UompError
from gateway.guard.proposal_rules import WriteBudgets
from gateway.guard.proposals import ProposalBook
from gateway.guard.store import MemoryStore
from gateway.guard.stores import open_user_store

if TYPE_CHECKING:
    from gateway.dashboard.server import Dashboard

PID_RE = re.compile(r"^prop_[A-Za-z0-9_-]{1,40}$")
HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def _safe(value: Any) -> str:
    return json.dumps(value, ensure_ascii=True, sort_keys=True)


def _side(view: dict[str, Any] | None) -> list[tuple[str, str]] | None:
    if view is None:
        return None
    rows = [("value", _safe(view["value"])), ("tags", _safe(view["tags"])), ("sensitivity", str(view["sensitivity"]))]
    if view.get("description") is not None:
        rows.append(("description", _safe(view["description"])))
    return rows


def _open(paths: Paths) -> tuple[MemoryStore, ProposalBook]:
    cfg = load_section(GuardConfig, "guard", file=paths.config_file)
    return (store := open_user_store(paths, cfg)), ProposalBook(store, WriteBudgets.from_config(cfg))


def inbox(paths: Paths) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pending changes as shown, the last decided ones)."""
    store, book = _open(paths)
    with store:
        for p in book.expire_due():
            with userlog.change(paths, via="dashboard") as event:
                event.action, event.agent_id, event.key = "proposal_expired", p.agent_id, p.key
                event.reason = "an agent's proposal expired undecided"
                event.detail = p.proposal_id
                event.extra = {"proposal_id": p.proposal_id}
        pending = []
        for p in book.list(status="pending", limit=200):
            view = book.show(p.proposal_id)
            view["key_shown"] = _safe(view["key"])[1:-1]
            view["old_rows"] = _side(view["old"])
            view["new_rows"] = _side(view["new"]) if view["op"] == "put" else None
            pending.append(view)
        decided = [p.summary() | {"agent_id": p.agent_id} for p in book.list(status=None, limit=1000)]
    decided = [d for d in decided if d["status"] != "pending"][-20:]
    return pending, decided


def decide(paths: Paths, pid: str, how: str, shown: str) -> dict[str, Any]:
    """Approve (the change shown: ``shown`` is its hash) or reject one proposal, audited with origin dashboard."""
    store, book = _open(paths)
    with store:
        if how == "approve":
            return proposals_cli.approve_shown(paths, book, pid, shown, via="dashboard")
        return proposals_cli.reject(paths, book, pid, via="dashboard")


class ProposalPages:
    """The handlers; ``dash`` is the :class:`gateway.dashboard.server.Dashboard` (its renderer)."""

    def __init__(self, dash: Dashboard) -> None:
        self.dash = dash

    async def page(self, request: httpd.Request) -> httpd.AnyResponse:
        pending, decided = await asyncio.to_thread(inbox, self.dash.paths)
        return self.dash._render(request, "proposals.html", title="Proposals", pending=pending, decided=decided)

    async def decide(self, request: httpd.Request) -> httpd.AnyResponse:
        from gateway.dashboard.server import FORM_KEY

        pid, how = request.match_info["pid"], request.match_info["how"]
        if not PID_RE.match(pid):
            raise UompError(ErrorCode.INVALID_REQUEST, "not a proposal id")
        form = request[FORM_KEY]
        shown = form.get("change_hash", "")
        if how == "approve" and (not isinstance(shown, str) or not HASH_RE.match(shown)):
            raise UompError(ErrorCode.INVALID_REQUEST, "the approval names no change hash; reload the page")
        if form.get("confirmed") != "yes":
            return self.dash._render(
                request,
                "confirm.html",
                title="Confirm",
                action=f"/proposals/{pid}/{how}",
                question=f"{how.capitalize()} proposal {pid}?",
                consequence="The change shown on the Proposals page is applied, exactly that one."
                if how == "approve"
                else "Nothing changes; the agent sees that you rejected it.",
                button=f"{how.capitalize()} proposal",
                fields={"change_hash": shown} if how == "approve" else {},
                cancel="/proposals",
            )
        done = await asyncio.to_thread(decide, self.dash.paths, pid, how, str(shown))
        what = f"approved: {done['key']} is now version {done['applied_version']}" if how == "approve" else "rejected"
        return self.dash._back(request, "/proposals", f"Proposal {pid} {what}.")
