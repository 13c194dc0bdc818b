"""The guard on a sealed home: its background full audit verification runs in a child process,
which gets the master key on a pipe (no passphrase source in its environment) and verifies the
audit log, encrypted at rest under the key the child derives from it."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from guardkit import guard_config, running_guard
from test_sealed_keys import FAST, PASSPHRASE, make_home

from gateway.atrest import auditdb, migrate, vault


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()
    os.environ.pop(vault.PASSPHRASE_FILE_ENV, None)


async def test_the_background_full_verify_opens_the_sealed_audit_key(caplog: pytest.LogCaptureFixture) -> None:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    vault.forget()
    vault.unlock_with_passphrase(paths, PASSPHRASE)  # as `uomp guard serve` does at start
    caplog.set_level(logging.INFO)
    async with running_guard(paths, guard_config(audit_full_verify_at_start=True), serve_tcp=False):
        for _ in range(600):
            said = [r.getMessage() for r in caplog.records if "audit log" in r.getMessage()]
            if any("verified in full" in m or "did not run" in m for m in said):
                break
            await asyncio.sleep(0.05)
    assert auditdb.is_encrypted(paths.audit_db)
    assert any("verified in full" in m for m in said), said
    assert not any("did not run to its end" in m for m in said), said
