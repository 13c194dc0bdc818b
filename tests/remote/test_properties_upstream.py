"""Property tests of the upstream HTTP/1.1 response-head parser (gateway/core/http1.py).

Documented error: UompError UPSTREAM_ERROR. A head that parses has a status in 100..599 (RFC 9110
§15: other values are invalid) and header values free of CR, LF and NUL; a well-formed head round
trips.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.http1 import parse_head as _parse_head
from gateway.errors import UompError


@pytest.mark.parametrize("status", [b"000", b"022", b"099", b"600", b"999"])
def test_status_outside_100_599_is_refused(status: bytes) -> None:
    """Found by scripts/fuzz.sh (upstream target): 'HTTP/1.1 022 OK' parsed as status 22."""
    with pytest.raises(UompError) as ei:
        _parse_head(b"HTTP/1.1 " + status + b" OK\r\nContent-Length: 0")
    assert ei.value.code == "UPSTREAM_ERROR"


TOKEN = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-!#$%&'*+.^_`|~", min_size=1, max_size=20
)
VALUE = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    status=st.integers(100, 599), minor=st.sampled_from([0, 1]), headers=st.lists(st.tuples(TOKEN, VALUE), max_size=10)
)
def test_well_formed_head_round_trips(status: int, minor: int, headers: list[tuple[str, str]]) -> None:
    head = f"HTTP/1.{minor} {status} Reason".encode() + b"".join(f"\r\n{n}: {v}".encode() for n, v in headers)
    got_status, keep_alive, got_headers, _framing = _parse_head(head)
    assert got_status == status and keep_alive == (minor == 1)
    assert got_headers == headers


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_upstream_error_only(data: bytes) -> None:
    try:
        status, _keep, headers, _framing = _parse_head(data)
    except UompError as exc:
        assert exc.code == "UPSTREAM_ERROR"
        return
    assert 100 <= status <= 599
    for _name, value in headers:
        assert not set(value) & {"\r", "\n", "\0"}
