"""A service's log is one line per record: text a message quotes (a path, a name a peer sent, an
exception's text) cannot start a forged line of its own. ``setup_logging`` is what every ``uomp``
service (``gateway start``, ``guard serve``) logs through; run in a process of its own, as they do."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import logging
    from gateway.cli.main import setup_logging
    setup_logging(False, service=True)
    log = logging.getLogger("uomp.test")
    log.warning("refused a POST to %s", "/x\\n2026-12-07 INFO uomp.guard forged\\r\\x1b[2K\\x7f")
    log.info("plain line")
    try:
        raise ValueError("inner")
    except ValueError:
        log.exception("failed on %s", "a\\nb")
    try:
        raise ValueError("bad name\\n2026-12-07 ERROR uomp.guard forged by an exception\\r")
    except ValueError:
        log.exception("refused")
    log.warning("here", stack_info=True)
    """
)


def test_each_record_is_one_line_with_its_controls_escaped() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    lines = out.stderr.splitlines()
    records = [line for line in lines if " uomp.test " in line]
    assert [r.split(" uomp.test ", 1)[1] for r in records] == [
        "refused a POST to /x\\n2026-12-07 INFO uomp.guard forged\\r\\x1b[2K\\x7f",
        "plain line",
        "failed on a\\nb",
        "refused",
        "here",
    ]
    # a line at the left margin is a record; what follows a record (a traceback, a stack) is indented,
    # so an exception's text cannot start a line of its own
    assert all(line.startswith("20") for line in lines if not line.startswith("  "))
    assert not any("forged" in line and " uomp.test " not in line and not line.startswith("  ") for line in lines)
    assert "  ValueError: bad name" in lines and "  2026-12-07 ERROR uomp.guard forged by an exception\\r" in lines
    # the traceback still follows its record, as logging writes it (indented)
    at = lines.index(records[2])
    trace = lines[at + 1 : lines.index(records[3])]
    assert trace[0] == "  Traceback (most recent call last):" and trace[-1] == "  ValueError: inner"
    assert lines[lines.index(records[4]) + 1] == "  Stack (most recent call last):"
