"""``uomp proposals list|show|approve|reject``: the user's decision on agents' staged writes
(docs/writes.md).

``show`` prints the change exactly as it would be applied: the item as it is now and as proposed
(value, tags, sensitivity, description), the agent, its session, how it came in, and the change
hash. ``approve`` shows the same and applies that change only: the hash of what was printed goes
with the approval, and the store applies it only if the hash of the change is still the same and the
item is still at the proposal's base version (else APPROVAL_MISMATCH / VERSION_CONFLICT, nothing
applied). ``--hash`` approves without a prompt the change a previous ``show`` printed.

Everything an agent wrote is printed as JSON with every non-ASCII and control character escaped,
so a proposal cannot repaint the terminal or reorder what the user reads.

Every decision is an event of the one audit log (``proposal_approved``, ``proposal_rejected``,
``proposal_stale``, ``proposal_expired``), with the agent, the key and the proposal id; never a value.
These commands open ``memory.db`` directly, like ``uomp memory``: they work with the guard running
or not.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gateway.cli import userlog
from gateway.cli.main import paths_from
from gateway.config import GuardConfig, Paths, load_section
from gateway.errors import ErrorCode, UompError
from gateway.guard.proposal_rules import WriteBudgets
from gateway.guard.proposals import STATUSES, Proposal, ProposalBook
from gateway.guard.store import MemoryStore
from gateway.guard.stores import open_user_store


def _book(paths: Paths) -> tuple[MemoryStore, ProposalBook]:
    cfg = load_section(GuardConfig, "guard", file=paths.config_file)
    return (store := open_user_store(paths, cfg)), ProposalBook(store, WriteBudgets.from_config(cfg))


def _safe(value: Any) -> str:
    """JSON text of ``value`` with every non-ASCII and control character escaped (one line)."""
    return json.dumps(value, ensure_ascii=True, sort_keys=True)


def _expire(paths: Paths, book: ProposalBook) -> None:
    """Proposals past their lifetime become expired, each one audited."""
    for p in book.expire_due():
        with userlog.change(paths) as event:
            event.action, event.agent_id, event.key = "proposal_expired", p.agent_id, p.key
            event.reason = "an agent's proposal expired undecided"
            event.detail = p.proposal_id
            event.extra = {"proposal_id": p.proposal_id}


def _line(p: Proposal) -> str:
    created = p.summary()["created_at"]
    return f"{p.proposal_id}  {p.status:<9}  {p.op:<6}  {_safe(p.key)[1:-1]:<30}  {p.agent_id:<20}  {created}"


def _list(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    store, book = _book(paths)
    with store:
        _expire(paths, book)
        found = book.list(status=None if args.all else args.status, limit=args.limit)
        if args.json:
            print(json.dumps([book.show(p.proposal_id) for p in found], indent=2, ensure_ascii=True))
            return 0
    if not found:
        print("no proposals" + ("" if args.all else f" {args.status}") + "; agents with a write grant make them")
        return 0
    print(f"{'PROPOSAL':<27}  {'STATUS':<9}  {'OP':<6}  {'KEY':<30}  {'AGENT':<20}  CREATED")
    for p in found:
        print(_line(p))
    print(f"{len(found)} shown; 'uomp proposals show ID' prints the change")
    return 0


def _side(view: dict[str, Any] | None) -> list[str]:
    if view is None:
        return ["(no item)"]
    lines = [f"value:       {_safe(view['value'])}", f"tags:        {_safe(view['tags'])}"]
    lines.append(f"sensitivity: {view['sensitivity']}")
    if view.get("description") is not None:
        lines.append(f"description: {_safe(view['description'])}")
    return lines


def render(view: dict[str, Any]) -> str:
    """The change as the user is shown it (``show`` and ``approve`` print this)."""
    what = {"put": "create" if view["old"] is None else "replace", "delete": "delete"}[view["op"]]
    out = [
        f"proposal {view['proposal_id']}: {what} {_safe(view['key'])}",
        f"  by agent {view['agent_id']}, session {view['session_id']}, via {view.get('via') or 'local'}",
        f"  status {view['status']}; based on version {view['base_version']}, the item is at {view['current_version']}",
        "  now:",
        *("    " + line for line in _side(view["old"])),
        "  proposed:",
        *("    " + line for line in (_side(view["new"]) if view["op"] == "put" else ["(deleted)"])),
    ]
    if view["stale"]:
        out.append("  STALE: the item changed since the proposal; it cannot be approved (the agent may propose again)")
    elif view["change_hash"]:
        out.append(f"  change hash: {view['change_hash']}")
    return "\n".join(out)


def _show(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    store, book = _book(paths)
    with store:
        _expire(paths, book)
        view = book.show(args.proposal_id)
    print(json.dumps(view, indent=2, ensure_ascii=True) if args.json else render(view))
    return 0


def approve_shown(paths: Paths, book: ProposalBook, pid: str, shown: str, *, via: str = "cli") -> dict[str, Any]:
    """Apply proposal ``pid`` if ``shown`` is the hash of its change as it is now, and audit the
    outcome: ``proposal_approved``, or ``proposal_stale`` / ``proposal_expired`` before the refusal
    is raised. The CLI and the dashboard both decide through here."""
    view = book.show(pid)
    try:
        with userlog.change(paths, via=via) as event:
            done = book.approve(pid, shown)
            event.action, event.agent_id, event.key = "proposal_approved", done["agent_id"], view["key"]
            event.reason = "the user approved an agent's proposal"
            event.detail = pid
            event.extra = {"proposal_id": pid, "change_hash": shown}
    except UompError as exc:
        if exc.code == ErrorCode.VERSION_CONFLICT or (
            exc.code == ErrorCode.INVALID_STATE and (exc.details or {}).get("status") == "expired"
        ):
            action = "proposal_stale" if exc.code == ErrorCode.VERSION_CONFLICT else "proposal_expired"
            with userlog.change(paths, via=via) as event:
                event.action, event.agent_id, event.key = action, view["agent_id"], view["key"]
                event.reason = "an agent's proposal could not be approved: " + exc.message.split(";")[0]
                event.detail = pid
                event.extra = {"proposal_id": pid}
        raise
    return {**done, "key": view["key"]}


def reject(paths: Paths, book: ProposalBook, pid: str, *, via: str = "cli") -> dict[str, Any]:
    """Reject one pending proposal, audited with its origin ``via`` (the CLI or the dashboard)."""
    view = book.show(pid)
    with userlog.change(paths, via=via) as event:
        done = book.reject(pid)
        event.action, event.agent_id, event.key = "proposal_rejected", done["agent_id"], view["key"]
        event.reason = "the user rejected an agent's proposal"
        event.detail = pid
        event.extra = {"proposal_id": pid}
    return {**done, "key": view["key"]}


def _decide_one(paths: Paths, book: ProposalBook, pid: str, args: argparse.Namespace) -> str:
    view = book.show(pid)
    if view["status"] != "pending":
        raise UompError(ErrorCode.INVALID_STATE, f"proposal {pid} is {view['status']}, not pending")
    if args.decision != "approve":
        reject(paths, book, pid)
        return f"{pid}: rejected"
    shown = args.hash
    if shown is None:
        print(render(view))
        if view["stale"] or not view["change_hash"]:
            shown = ""
        else:
            if not args.yes:
                if not sys.stdin.isatty():
                    raise UompError(
                        ErrorCode.USAGE,
                        "approval needs an answer on a terminal; pass --hash (from 'uomp proposals show') or --yes",
                    )
                if input("Approve this change? [y/N] ").strip().lower() not in ("y", "yes"):
                    return f"{pid}: left pending"
            shown = view["change_hash"]
    done = approve_shown(paths, book, pid, shown)
    return f"{pid}: approved; {view['key']} is now at version {done['applied_version']}"


def _decide(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    if args.hash is not None and len(args.proposal_ids) != 1:
        raise UompError(ErrorCode.USAGE, "--hash names the change of one proposal; give one ID with it")
    store, book = _book(paths)
    failed: UompError | None = None
    with store:
        _expire(paths, book)
        for pid in args.proposal_ids:
            try:
                print(_decide_one(paths, book, pid, args))
            except UompError as exc:
                if len(args.proposal_ids) == 1:
                    raise
                print(f"{pid}: error {exc.code}: {exc.message}", file=sys.stderr)
                failed = exc
    if failed is not None:
        raise UompError(failed.code, "some proposals were not decided (see above); the others were")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp proposals list|show|approve|reject``."""
    p = sub.add_parser(
        "proposals",
        help="agents' proposed memory changes: list, show, approve, reject",
        description="An agent with a write grant proposes changes; nothing changes until you approve one.",
    )
    psub = p.add_subparsers(dest="proposals_command", metavar="ACTION", required=True)
    ls = psub.add_parser("list", help="list proposals (pending by default)")
    ls.add_argument("--status", choices=STATUSES, default="pending", help="only proposals in this state")
    ls.add_argument("--all", action="store_true", help="every proposal, whatever its state")
    ls.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    ls.add_argument("--json", action="store_true", help="the changes as JSON (values included)")
    ls.set_defaults(func=_list)
    sh = psub.add_parser("show", help="print one proposal's change (now and proposed) and its change hash")
    sh.add_argument("proposal_id", metavar="ID")
    sh.add_argument("--json", action="store_true", help="as JSON")
    sh.set_defaults(func=_show)
    ap = psub.add_parser(
        "approve",
        help="apply exactly the change shown",
        description="Show each change and apply it once you say yes; the change applied is the one shown.",
    )
    ap.add_argument("proposal_ids", metavar="ID", nargs="+")
    ap.add_argument("--hash", help="approve without a prompt the change whose hash 'uomp proposals show' printed")
    ap.add_argument("--yes", action="store_true", help="approve what is printed without asking")
    ap.set_defaults(func=_decide, decision="approve")
    rj = psub.add_parser("reject", aliases=["deny"], help="refuse proposals (nothing changes)")
    rj.add_argument("proposal_ids", metavar="ID", nargs="+")
    rj.set_defaults(func=_decide, decision="reject", hash=None, yes=False)
