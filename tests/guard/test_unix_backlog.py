"""The guard's Unix socket takes a burst of connections while its loop is busy.

A non-blocking ``connect()`` to a Unix socket whose listen backlog is full fails at once with
EAGAIN (TCP would wait), so a burst larger than the backlog, arriving while the guard's loop has
not yet accepted, must fit in it: here the connections are made without yielding to the loop (it
accepts none of them until all are made). The denied partner: past the backlog the connect is
refused, not queued without bound. Real guard, real Unix socket.
"""

from __future__ import annotations

import socket

from guardkit import running_guard

from gateway.config import Paths
from gateway.guard import server

BURST = 600  # above aiohttp's default backlog (128), under UNIX_BACKLOG


def _connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
    except BlockingIOError:  # the backlog is full
        s.close()
        return None
    return s


async def test_a_burst_larger_than_the_default_backlog_is_queued(home: Paths) -> None:
    async with running_guard(home, serve_tcp=False):
        path = str(home.guard_sock)
        socks = [_connect(path) for _ in range(BURST)]  # no await: the loop accepts none meanwhile
        try:
            refused = sum(1 for s in socks if s is None)
            assert refused == 0, f"{refused} of {BURST} connects refused (EAGAIN)"
            # the denied partner: the backlog is bounded (somaxconn caps UNIX_BACKLOG)
            more = [_connect(path) for _ in range(server.UNIX_BACKLOG + 64)]
            assert any(s is None for s in more)
            for s in more:
                if s is not None:
                    s.close()
        finally:
            for s in socks:
                if s is not None:
                    s.close()
