"""UOMP_TRACEMALLOC: off unless switched on, a mistyped value refused, snapshots private."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from gateway import memtrace
from gateway.config import Paths, env_seconds, env_switch
from gateway.errors import UompError


def test_switch_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for on in ("1", "true", "YES", " on "):
        monkeypatch.setenv("UOMP_X", on)
        assert env_switch("UOMP_X", False) is True
    for off in ("0", "false", "no", "off", ""):
        monkeypatch.setenv("UOMP_X", off)
        assert env_switch("UOMP_X", True) is False
    monkeypatch.setenv("UOMP_X", "ture")
    with pytest.raises(UompError) as e:
        env_switch("UOMP_X", False)
    assert e.value.code == "CONFIG_ERROR" and "UOMP_X" in e.value.message
    monkeypatch.setenv("UOMP_S", "-1")
    with pytest.raises(UompError):
        env_seconds("UOMP_S", 1.0)


def test_off_by_default_and_private_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UOMP_TRACEMALLOC", raising=False)
    assert memtrace.start_if_enabled(Paths(tmp_path), "test") is None
    assert not (tmp_path / "memtrace").exists()
    was = tracemalloc.is_tracing()
    tracer = memtrace.Tracer(tmp_path / "memtrace", "test", interval=0, frames=1)
    try:
        tracer.start()
        path = tracer.snapshot()
    finally:
        tracer.stop()
        if not was:
            tracemalloc.stop()
    assert (tmp_path / "memtrace").stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    lines = [json.loads(x) for x in next((tmp_path / "memtrace").glob("*.jsonl")).read_text().splitlines()]
    assert [x["n"] for x in lines] == [1, 2] and all("vmrss" in x for x in lines)
