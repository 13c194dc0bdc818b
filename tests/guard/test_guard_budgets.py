"""``[guard] unix_max_connections`` and ``tcp_max_connections``: the budgets of the guard's two
listeners are settings (each lowered to fit the descriptor limit), refused out of bounds, and what
a real guard enforces: past its budget a newcomer takes the longest-idle connection's place."""

from __future__ import annotations

import asyncio

import pytest
from guardkit import guard_config, running_guard

from gateway.config import MAX_CONNECTION_BUDGET, GuardConfig, Paths, load_section
from gateway.errors import UompError

pytestmark = pytest.mark.timeout(60)

HEALTH = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One keep-alive health request; its status line, or b"" when the guard closed the connection."""
    writer.write(HEALTH)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
        return b""
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)
    return head.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("budget", [1, 2])
async def test_past_the_tcp_budget_a_newcomer_takes_the_idle_connections_place(home: Paths, budget: int) -> None:
    async with running_guard(home, guard_config(tcp_max_connections=budget)) as guard:
        assert guard.tcp_port is not None
        first = await asyncio.open_connection("127.0.0.1", guard.tcp_port)
        assert (await _ask(*first)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.05)  # the first is now idle, and the longest so
        second = await asyncio.open_connection("127.0.0.1", guard.tcp_port)
        assert (await _ask(*second)).startswith(b"HTTP/1.1 200")
        again = await _ask(*first)
        if budget == 1:
            assert again == b""  # evicted for the newcomer
        else:
            assert again.startswith(b"HTTP/1.1 200")  # room for both: kept
        for _, writer in (first, second):
            writer.close()


def test_the_budgets_are_settings_with_bounds(home: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = GuardConfig()
    assert (cfg.unix_max_connections, cfg.tcp_max_connections) == (4096, 256)
    for name in ("unix_max_connections", "tcp_max_connections"):
        for bad in (0, -1, MAX_CONNECTION_BUDGET + 1):
            with pytest.raises(UompError) as exc:
                GuardConfig(**{name: bad})
            assert exc.value.code == "CONFIG_ERROR" and f"guard.{name} = {bad} is out of range" in exc.value.message
        assert getattr(GuardConfig(**{name: MAX_CONNECTION_BUDGET}), name) == MAX_CONNECTION_BUDGET
    # from the home's config file and from the environment, as every [guard] setting
    home.config_file.write_text("[guard]\ntcp_max_connections = 32\n")
    assert load_section(GuardConfig, "guard", file=home.config_file).tcp_max_connections == 32
    monkeypatch.setenv("UOMP_GUARD_UNIX_MAX_CONNECTIONS", "512")
    assert load_section(GuardConfig, "guard", file=home.config_file).unix_max_connections == 512
    monkeypatch.setenv("UOMP_GUARD_UNIX_MAX_CONNECTIONS", "0")
    with pytest.raises(UompError) as exc:
        load_section(GuardConfig, "guard", file=home.config_file)
    assert exc.value.code == "CONFIG_ERROR"
