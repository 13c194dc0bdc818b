"""``python -m gateway.cli.native build|status``: compile the request path with mypyc
(:mod:`gateway.native`), or say what this interpreter runs. ``scripts/setup.sh`` runs ``build``; a
failed build leaves the appliance on plain Python, which behaves the same, slower."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gateway import native


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit status: 0 built (or up to date) / running compiled."""
    ap = argparse.ArgumentParser(
        prog="python -m gateway.cli.native",
        description="Compile the request path with mypyc (build: nothing to do when these sources are "
        "built already), or say whether this interpreter runs it compiled (status: exit 0 when it does).",
    )
    ap.add_argument("command", choices=("build", "status"))
    args = ap.parse_args(argv)
    if args.command == "status":
        print(native.status)
        return 0 if native.status.startswith("compiled") else 1
    try:
        native.build(print)
    except (Exception, SystemExit) as exc:  # whatever stops it (no compiler, no mypy, a type error)
        why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, SystemExit) else "mypyc refused the sources"
        print(f"native: not built ({why}); the appliance runs as plain Python", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
