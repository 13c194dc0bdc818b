"""The conformance suite: its cases (``cases_*.py``, on :mod:`.harness`) and their runner (black-box: HTTP(S) only).

Setup contract (docs/conformance.md): the target holds the items of ``fixture.json`` and gives the
suite either an admin credential (``POST /v1/sessions`` + ``/grant`` on the management API: the
target itself in guard mode, ``admin_url`` in gateway mode), or a hand-made token for the
``conf.pref`` tag. Gateway mode also needs the user's CA certificate and one agent certificate and
key. A case whose setup piece is missing is skipped with the reason; a case never passes unseen.
"""

from __future__ import annotations

import ssl
import time

import aiohttp

from gateway.conformance.harness import (
    CASES,
    FIXTURE,
    Answer,
    Case,
    Fail,
    Runner,
    Skip,
    Target,
    case,
)
from gateway.conformance.report import Result

# Importing the case modules registers their cases, in this order (the report's order).
# isort: off
from gateway.conformance import cases_auth  # noqa: F401  (§8.4, §7.3)
from gateway.conformance import cases_reads  # noqa: F401  (§10.4, §10.5, §21)
from gateway.conformance import cases_gateway  # noqa: F401  (§15.2, §15.5, §15.6)
# isort: on

# ---------------------------------------------------------------------- runner


def selected(mode: str) -> list[Case]:
    """The cases that run in ``mode`` (guard or gateway)."""
    return [c for c in CASES if mode in c.modes]


async def run(target: Target, *, only: list[str] | None = None) -> list[Result]:
    """Runs the selected cases (or ``only``) against ``target``, one result per case."""
    if target.mode not in ("guard", "gateway"):
        raise ValueError("mode must be guard or gateway")
    runner = Runner(target)
    out: list[Result] = []
    try:
        for c in selected(target.mode):
            if only and not any(c.id.startswith(p) for p in only):
                continue
            start = time.monotonic()
            try:
                await c.fn(runner)
                verdict, reason = "pass", ""
            except Skip as exc:
                verdict, reason = "skip", str(exc)
            except Fail as exc:
                verdict, reason = "fail", str(exc)
            except (TimeoutError, aiohttp.ClientError, OSError, ssl.SSLError) as exc:
                verdict, reason = "fail", f"transport error: {type(exc).__name__}: {str(exc)[:160]}"
            except Exception as exc:  # a case must never pass unseen; report and go on
                verdict, reason = "fail", f"unexpected {type(exc).__name__}: {str(exc)[:160]}"
            out.append(Result(c.id, c.section, c.expectation, verdict, reason, time.monotonic() - start))
    finally:
        await runner.close()
    return out


__all__ = ["CASES", "FIXTURE", "Answer", "Case", "Fail", "Runner", "Skip", "Target", "case", "run", "selected"]
