"""test_tls_reads again on uvloop, the product's loop: its native TLS protocol reads into the
server's buffer too (a copying protocol there allocates 256 KiB per read)."""

from __future__ import annotations

import pytest

uvloop = pytest.importorskip("uvloop")

from test_tls_reads import (  # noqa: E402,F401  (collected again here, on uvloop)
    test_a_request_costs_no_read_sized_allocation,
    test_connections_sharing_the_read_buffer_keep_their_own_bytes,
)
from uvloopkit import event_loop_policy, pytestmark, test_loop_is_uvloop  # noqa: E402,F401
