"""The gateway's listeners on uvloop (the product's loop, gateway/eventloop.py): TLS is uvloop's
native protocol there, started by :class:`gateway.remote.transport.TLSAcceptProtocol`. The suite runs
on asyncio's loop; the cases here run the same defences again on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

uvloop = pytest.importorskip("uvloop")

from test_floods import (  # noqa: E402,F401  (collected again here, on uvloop)
    test_eviction_order_silent_then_stalled_never_the_request,
    test_mtls_flood_does_not_starve_a_verified_agent,
)
from test_handshake_log import test_refused_handshake_is_logged_and_counted  # noqa: E402,F401


@pytest.fixture
def event_loop_policy() -> Iterator[asyncio.AbstractEventLoopPolicy]:
    yield uvloop.EventLoopPolicy()


async def test_loop_is_uvloop() -> None:
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
