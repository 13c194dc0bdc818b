"""The gateway's listeners on uvloop (the product's loop, gateway/eventloop.py): TLS is uvloop's
native protocol there, started by :class:`gateway.remote.transport.TLSAcceptProtocol`. The suite runs
on asyncio's loop; the cases here run the same defences again on uvloop."""

from __future__ import annotations

import pytest

uvloop = pytest.importorskip("uvloop")

from test_floods import (  # noqa: E402,F401  (collected again here, on uvloop)
    test_eviction_order_silent_then_stalled_never_the_request,
    test_mtls_flood_does_not_starve_a_verified_agent,
)
from test_handshake_log import test_refused_handshake_is_logged_and_counted  # noqa: E402,F401
from test_tls import test_returning_agent_resumes_and_a_revoked_one_is_refused_at_its_next_request  # noqa: E402,F401
from test_transport_tls import test_tls_runs_in_the_loops_own_protocol  # noqa: E402,F401
from uvloopkit import event_loop_policy, pytestmark, test_loop_is_uvloop  # noqa: E402,F401
