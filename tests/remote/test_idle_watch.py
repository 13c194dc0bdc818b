"""The gateway's TLS watch, idle: it looks at its files every interval, but opens the CA registry
(SQLite) and verifies the CRL only when one of them changed; a revocation that reached the
registry but not the CRL (a crash between the two writes) is still repaired by the next look, and
a CRL rolled back to an older file is replaced. The gateway runs for real (tests/gatewaykit.py)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gateway import ca_store
from gateway.config import Paths
from gateway.core import ca
from tests.gatewaykit import appliance

WATCH = 0.02  # seconds between the watcher's looks in these tests


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Each opening of the CA registry by ca_store (the real registry; only counted)."""
    seen: list[float] = []
    real = ca_store.registry

    @contextlib.contextmanager
    def counting(*args: Any, **kwargs: Any) -> Iterator[Any]:
        seen.append(time.monotonic())
        with real(*args, **kwargs) as reg:
            yield reg

    monkeypatch.setattr(ca_store, "registry", counting)
    return seen


async def _until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _crl_serials(paths: Paths) -> set[int]:
    crl = x509.load_pem_x509_crl(ca_store.crl_path(paths).read_bytes())
    return {r.serial_number for r in crl}


async def test_idle_watch_leaves_the_registry_alone_and_still_repairs_the_crl(home: Paths, opens: list[float]) -> None:
    paths = home
    async with appliance(paths, tls_watch_interval_seconds=WATCH) as app:
        reloader = app.gateway.reloader
        assert reloader is not None
        await asyncio.sleep(WATCH * 10)  # start-up's own openings (CA, seeding) and the first looks
        base = len(opens)
        await asyncio.sleep(WATCH * 30)  # ~30 looks with nothing changed
        idle_opens = len(opens) - base
        assert idle_opens <= 1, f"the registry was opened {idle_opens} times by an idle watcher"

        # a revocation committed to the registry, its CRL write lost (as in a crash between the two)
        key = ca.new_key("p256")
        csr = ca.make_csr(key, "bot").public_bytes(serialization.Encoding.PEM)
        serial = x509.load_pem_x509_certificate(ca_store.issue_from_csr(paths, "bot", csr)).serial_number
        old_crl = ca_store.crl_path(paths).read_bytes()
        generation = reloader.generation
        ca_store.revoke(paths, "bot")
        ca_store.crl_path(paths).write_bytes(old_crl)
        await _until(lambda: serial in _crl_serials(paths), "the watcher re-signing the CRL")
        await _until(
            lambda: ca.serial_hex(serial) in reloader.revoked and reloader.generation > generation, "the new CRL in use"
        )

        # a CRL replaced by an older file (the registry untouched): re-signed again
        ca_store.crl_path(paths).write_bytes(old_crl)
        await _until(lambda: serial in _crl_serials(paths), "the watcher replacing a rolled-back CRL")

        # and idle again: no more openings once the files are still
        await asyncio.sleep(WATCH * 10)
        settled = len(opens)
        await asyncio.sleep(WATCH * 30)
        assert len(opens) - settled <= 1


def test_crl_watch_rechecks_when_time_passes_or_the_clock_goes_back(tmp_path: Path, opens: list[float]) -> None:
    paths = Paths(tmp_path / "home")
    ca_store.init_all(paths)
    watch = ca_store.CrlWatch(paths, recheck_seconds=3600)
    t = 1_000_000.0
    assert watch.tick(now=t) is False and watch.checks == 1
    assert watch.tick(now=t + 10) is False and watch.checks == 1  # nothing changed: no check
    assert watch.tick(now=t + 3601) is False and watch.checks == 2  # an hour on: the nextUpdate may be near
    assert watch.tick(now=t + 100) is False and watch.checks == 3  # the clock went back: checked
    ca_store.crl_path(paths).unlink()
    assert watch.tick(now=t + 101) is True and watch.checks == 4  # the CRL is gone: re-signed at once
    assert watch.tick(now=t + 102) is False and watch.checks == 5  # its new stamp taken
    assert watch.tick(now=t + 103) is False and watch.checks == 5
    assert len(opens) >= 5
    assert dt.timedelta(seconds=ca_store.CRL_RECHECK_SECONDS) < ca_store.CRL_REFRESH_BEFORE
