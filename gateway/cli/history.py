"""``uomp memory history KEY`` and ``uomp memory rollback KEY --to N`` (docs/writes.md, "History").

Every change of an item keeps the state it replaced (the store's triggers, in the change's own
transaction); ``history`` lists the kept versions, newest first, with who made each one (the user,
or the agent whose approved proposal it was); ``rollback`` makes an earlier version current again as
a new version (audited ``memory_rolled_back``; history is never rewritten). Values are printed as
JSON with non-ASCII and control characters escaped.
"""

from __future__ import annotations

import argparse
import json

from gateway.cli import userlog
from gateway.cli.main import paths_from
from gateway.errors import ErrorCode, UompError
from gateway.guard import history
from gateway.guard.stores import open_user_store


def _history(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    with open_user_store(paths) as store:
        entries = history.history(store, args.key, limit=args.limit)
    if args.json:
        print(json.dumps(entries, indent=2, ensure_ascii=True))
        return 0
    if not entries:
        raise UompError(ErrorCode.INVALID_REQUEST, "this key has no item and no history; 'uomp memory list' shows keys")
    for e in entries:
        mark = "current" if e.get("current") else ("deleted" if e["deleted"] else "")
        if e["deleted"]:
            print(f"v{e['version']:<4} deleted   at {e['at']}")
            continue
        who = f"agent {e['agent_id']}" if e.get("agent_id") else e["source"]
        print(
            f"v{e['version']:<4} {mark:<8}  {e['updated_at']}  by {who}  sensitivity {e['sensitivity']}  "
            f"tags {json.dumps(e['tags'], ensure_ascii=True)}"
        )
        print(f"       value {json.dumps(e['value'], ensure_ascii=True, sort_keys=True)}")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    with open_user_store(paths) as store, userlog.change(paths) as event:
        new = history.rollback(store, args.key, args.to)
        event.action, event.key = "memory_rolled_back", args.key
        event.reason = "the user rolled a memory item back to an earlier version"
        event.detail = f"version {args.to} made current as version {new}"
    print(f"rolled back {args.key}: version {args.to} is now current as version {new}")
    return 0


def register_memory(msub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``history`` and ``rollback`` to ``uomp memory``."""
    h = msub.add_parser(
        "history",
        help="the kept versions of one Memory Item, newest first",
        description="Every change keeps the version it replaced ([guard] history_max_versions per key).",
    )
    h.add_argument("key", metavar="KEY")
    h.add_argument("--limit", type=int, default=100, help="at most this many versions (default 100)")
    h.add_argument("--json", action="store_true", help="as JSON")
    h.set_defaults(func=_history)
    r = msub.add_parser(
        "rollback",
        help="make an earlier version of an item current again (as a new version)",
        description="Make version N current again; it becomes a new version and the current one stays in history.",
    )
    r.add_argument("key", metavar="KEY")
    r.add_argument("--to", type=int, required=True, metavar="N", help="the version to restore")
    r.set_defaults(func=_rollback)
