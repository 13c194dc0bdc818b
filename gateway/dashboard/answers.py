"""What the dashboard answers with besides its pages: the security headers every answer carries,
the session cookie, a bounded urlencoded form, a 303 redirect and plain-text refusals."""

from __future__ import annotations

from http import HTTPStatus
from urllib.parse import parse_qsl

from gateway import httpd

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
MAX_FORM_BYTES = 16 * 1024


class Redirect(Exception):
    """Answer ``303 See Other`` to ``location`` (with ``headers``, e.g. ``Set-Cookie``)."""

    def __init__(self, location: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(location)
        self.response = httpd.Response(b"", 303, {"Location": location, **(headers or {})})


def session_cookie(name: str, value: str, *, max_age: int) -> str:
    """A ``Set-Cookie`` value: the dashboard's session cookie, host-only, never sent cross-site
    (``max_age`` 0: the browser drops it)."""
    expired = "; Expires=Thu, 01 Jan 1970 00:00:00 GMT" if max_age == 0 else ""
    return f"{name}={value}{expired}; HttpOnly; Max-Age={max_age}; Path=/; SameSite=Strict"


async def read_form(request: httpd.Request) -> dict[str, str]:
    """The urlencoded form of a POST, at most MAX_FORM_BYTES (413 past it); each name's first value."""
    if request.content_length is not None and request.content_length > MAX_FORM_BYTES:
        raise httpd.HTTPError(413)
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > MAX_FORM_BYTES:
            raise httpd.HTTPError(413)
        parts.append(chunk)
    if request.content_type != "application/x-www-form-urlencoded":
        return {}
    form: dict[str, str] = {}
    for name, value in parse_qsl(b"".join(parts).decode("utf-8", "replace"), keep_blank_values=True):
        form.setdefault(name, value)
    return form


def security_headers(request: httpd.Request | None, headers: dict[str, str]) -> None:
    """The headers every answer carries (an answer's own value of one of them is kept)."""
    for k, v in HEADERS.items():
        headers.setdefault(k, v)


def text_answer(status: int, text: str) -> httpd.Response:
    """``text`` as a plain-text answer of ``status``, with the security headers."""
    resp = httpd.Response(text.encode("utf-8"), status, content_type="text/plain; charset=utf-8")
    security_headers(None, resp.headers)
    return resp


def refusal(status: int) -> httpd.Response:
    """A request the server could not parse, or no route: the status and its phrase, as plain text."""
    return text_answer(status, f"{status}: {HTTPStatus(status).phrase}\n")
