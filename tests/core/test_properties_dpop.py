"""Properties of the DPoP htu normaliser (gateway/core/dpop.py).

Documented error: ValueError. A URI that normalises normalises to itself again (idempotent), so
the proof's htu and the request URI are compared in one canonical form.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import dpop


@pytest.mark.parametrize(
    "url",
    ["https://x/%e%32E", "https://x/a%%41", "https://x/%", "https://x/%4", "https://x/%g1", "https://x/a%2"],
    ids=["stray-then-escape", "double", "bare", "short", "non-hex", "short-end"],
)
def test_malformed_percent_encoding_refused(url: str) -> None:
    """Found by scripts/fuzz.sh (dpop target): '%e%32E' normalised to '%e2E', then to '%E2E'."""
    with pytest.raises(ValueError):
        dpop.normalise_htu(url)


PATH = st.text(alphabet="abcAZ09-._~%/:@!$&'()*+,;=2eE", max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    host=st.sampled_from(["x", "EXAMPLE.org", "127.0.0.1", "[::1]"]),
    port=st.sampled_from(["", ":443", ":8443"]),
    path=PATH,
)
def test_normalise_htu_idempotent(host: str, port: str, path: str) -> None:
    try:
        n = dpop.normalise_htu(f"https://{host}{port}/{path}")
    except ValueError:
        return
    assert dpop.normalise_htu(n) == n
    assert dpop.htu_matches(n, f"https://{host}{port}/{path}")
