"""Running a module's cases again on uvloop, the product's loop (gateway/eventloop.py). A module does
``uvloop = pytest.importorskip("uvloop")``, imports the cases it runs again, then
``from uvloopkit import event_loop_policy, pytestmark, test_loop_is_uvloop``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import uvloop

# pytest-asyncio 1.x deprecates overriding event_loop_policy in favour of a conftest-wide
# pytest_asyncio_loop_factories hook; the uvloop modules are the one place that wants another loop.
pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture')


@pytest.fixture
def event_loop_policy() -> Iterator[asyncio.AbstractEventLoopPolicy]:
    yield uvloop.EventLoopPolicy()


async def test_loop_is_uvloop() -> None:
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
