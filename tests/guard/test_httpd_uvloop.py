"""The guard's HTTP server (gateway/guard/httpd.py) on uvloop, the loop the guard runs on
(gateway/eventloop.py): every case of test_httpd again, with uvloop's transports."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

uvloop = pytest.importorskip("uvloop")

from test_httpd import *  # noqa: E402,F403  (collected again here, on uvloop)
from test_httpd import h  # noqa: E402,F401  (the fixture)

pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture')


@pytest.fixture
def event_loop_policy() -> Iterator[asyncio.AbstractEventLoopPolicy]:
    yield uvloop.EventLoopPolicy()


async def test_loop_is_uvloop() -> None:
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
