"""Outputs of a conformance run: a readable table, JUnit XML and JSON."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Any

VERDICTS = ("pass", "fail", "skip")


@dataclasses.dataclass(frozen=True)
class Result:
    """One case's verdict (pass, fail or skip), with the reason and how long it took."""

    id: str
    section: str
    expectation: str
    verdict: str  # pass | fail | skip
    reason: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def counts(results: list[Result]) -> dict[str, int]:
    """How many results have each verdict."""
    c = Counter(r.verdict for r in results)
    return {v: c.get(v, 0) for v in VERDICTS}


def by_section(results: list[Result]) -> dict[str, int]:
    """How many results each spec section has."""
    return dict(sorted(Counter(r.section for r in results).items()))


def table(results: list[Result], *, target: str, mode: str) -> str:
    """The results as a plain-text table for a terminal."""
    wid = max([len(r.id) for r in results] + [4])
    sec = max([len(r.section) for r in results] + [7])
    lines = [
        f"UOMP conformance: {target} ({mode} mode)",
        "",
        f"{'case'.ljust(wid)}  {'section'.ljust(sec)}  verdict  expectation / reason",
    ]
    for r in results:
        lines.append(f"{r.id.ljust(wid)}  {r.section.ljust(sec)}  {r.verdict.upper().ljust(7)}  {r.expectation}")
        if r.reason and r.verdict != "pass":
            lines.append(f"{''.ljust(wid)}  {''.ljust(sec)}           -> {r.reason}")
    c = counts(results)
    lines += ["", f"{len(results)} cases: {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped"]
    return "\n".join(lines) + "\n"


def junit(results: list[Result], *, target: str, mode: str) -> str:
    """The results as JUnit XML for CI systems."""
    c = counts(results)
    suite = ET.Element(
        "testsuite",
        name=f"uomp-conformance-{mode}",
        tests=str(len(results)),
        failures=str(c["fail"]),
        skipped=str(c["skip"]),
        errors="0",
        time=f"{sum(r.seconds for r in results):.3f}",
    )
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="target", value=target)
    for r in results:
        tc = ET.SubElement(
            suite, "testcase", classname=f"uomp.{r.section}", name=f"{r.id}: {r.expectation}", time=f"{r.seconds:.3f}"
        )
        if r.verdict == "fail":
            ET.SubElement(tc, "failure", message=r.reason).text = r.reason
        elif r.verdict == "skip":
            ET.SubElement(tc, "skipped", message=r.reason)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + str(ET.tostring(suite, encoding="unicode")) + "\n"


def to_json(results: list[Result], *, target: str, mode: str) -> str:
    """The results as a JSON document."""
    return (
        json.dumps(
            {
                "target": target,
                "mode": mode,
                "counts": counts(results),
                "by_section": by_section(results),
                "cases": [r.to_dict() for r in results],
            },
            indent=2,
        )
        + "\n"
    )
