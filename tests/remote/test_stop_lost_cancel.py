"""The gateway stops even when a background task lost its cancellation (Python 3.11's
``asyncio.wait_for`` can swallow one that arrives as its inner wait completes: a `uomp gateway start`
was seen ignoring SIGTERM for ever, its upstream monitor "cancelling" and still looping)."""

from __future__ import annotations

import asyncio

from gateway.eventloop import cancel_all


async def _loses_one_cancel(ended: list[str]) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass  # the cancellation is lost, as wait_for can lose it; the loop goes on
    try:
        while True:
            await asyncio.sleep(0.05)
    finally:
        ended.append("stubborn")


async def test_cancel_all_repeats_a_lost_cancellation() -> None:
    ended: list[str] = []
    stubborn = asyncio.get_running_loop().create_task(_loses_one_cancel(ended))
    plain = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_all([stubborn, plain], seconds=5), 10)
    assert stubborn.done() and plain.cancelled() and ended == ["stubborn"]
