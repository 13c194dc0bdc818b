"""Small charts as inline SVG, drawn on the server: no script, no external asset, colours from
the stylesheet (classes only: the CSP forbids inline styles)."""

from __future__ import annotations

from markupsafe import Markup, escape

BAR = 10
HEIGHT = 48


def activity_svg(agent: str, series: list[tuple[int, int]]) -> Markup:
    """Reads (allowed) and refusals per hour, oldest left; a title and description for screen readers."""
    peak = max([ok + bad for ok, bad in series] + [1])
    reads = sum(ok for ok, _ in series)
    refused = sum(bad for _, bad in series)
    width = BAR * len(series)
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {HEIGHT + 2}" width="{width}" height="{HEIGHT + 2}" '
        f'role="img" aria-labelledby="t-{escape(agent)}">',
        f'<title id="t-{escape(agent)}">{escape(agent)}: {reads} reads and {refused} refusals in the last '
        f"{len(series)} hours</title>",
        f'<line class="axis" x1="0" y1="{HEIGHT + 1}" x2="{width}" y2="{HEIGHT + 1}"/>',
    ]
    for i, (ok, bad) in enumerate(series):
        x = i * BAR + 1
        h_ok = round(HEIGHT * ok / peak)
        h_bad = round(HEIGHT * bad / peak)
        if ok:
            parts.append(
                f'<rect class="bar-ok" x="{x}" y="{HEIGHT - h_ok - h_bad}" width="{BAR - 2}" '
                f'height="{h_ok}"><title>{ok} reads</title></rect>'
            )
        if bad:
            parts.append(
                f'<rect class="bar-bad" x="{x}" y="{HEIGHT - h_bad}" width="{BAR - 2}" height="{h_bad}">'
                f"<title>{bad} refusals</title></rect>"
            )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - built from numbers and escaped text only
