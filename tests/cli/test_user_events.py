"""The user's own changes are events of the one log: memory add/replace/rm and imports
(counts, never values), agent certificates issued and revoked, signing keys rotated. A command that
is refused changes nothing and records nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gatewaykit import ledger_events, verify_ledger
from guardkit import held_lock

from gateway.cli.main import main
from gateway.config import Paths

SECRET_VALUE = "dark-and-private-7f3a"
TAGS = ("--tag", "preference", "--sensitivity", "low")


def uomp(paths: Paths, *args: str) -> int:
    return main(["--home", str(paths.home), *args])


def user_events(paths: Paths) -> list[dict[str, object]]:
    return [e for e in ledger_events(paths) if e["session_id"] == "user"]


def test_memory_changes_and_imports_are_events_without_values(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert uomp(home, "init") == 0
    assert uomp(home, "memory", "add", "preference.theme", "--value", json.dumps(SECRET_VALUE), *TAGS) == 0
    assert uomp(home, "memory", "add", "preference.theme", "--value", '"x"', *TAGS) != 0  # exists: refused
    assert uomp(home, "memory", "add", "preference.theme", "--value", '"light"', "--replace", *TAGS) == 0
    assert uomp(home, "memory", "rm", "preference.nope") != 0  # no such item: refused
    assert uomp(home, "memory", "rm", "preference.theme") == 0
    src = tmp_path / "items.csv"
    src.write_text(f"key,value,tags\nh.a,{SECRET_VALUE},holding\nh.b,2,holding\n")
    assert uomp(home, "import", str(src), "--sensitivity", "low", "--dry-run") == 0  # writes nothing: no event
    assert uomp(home, "import", str(src), "--sensitivity", "low") == 0
    events = user_events(home)
    assert [e["action"] for e in events] == ["memory_added", "memory_replaced", "memory_deleted", "memory_imported"]
    assert [e.get("key") for e in events[:3]] == ["preference.theme"] * 3
    assert events[3]["count"] == 2 and all(e["allowed"] is True and e["via"] == "cli" for e in events)
    raw = home.audit_db.read_bytes()
    assert SECRET_VALUE.encode() not in raw and b"light" not in raw  # counts and keys, never values
    assert verify_ledger(home).ok
    capsys.readouterr()
    assert uomp(home, "audit", "--session", "user", "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert [e["action"] for e in shown] == [e["action"] for e in events]


def test_certificates_and_key_rotation_are_events(home: Paths, tmp_path: Path) -> None:
    assert uomp(home, "init") == 0
    assert uomp(home, "agent", "issue", "calendar_agent", "--out", str(tmp_path / "cal")) == 0
    assert uomp(home, "agent", "revoke", "calendar_agent") == 0
    assert uomp(home, "agent", "revoke", "calendar_agent") == 0  # nothing new to revoke: no event
    assert uomp(home, "keys", "rotate") == 0
    events = user_events(home)
    assert [e["action"] for e in events] == ["cert_issued", "cert_revoked", "key_rotated"]
    issued, revoked, rotated = events
    assert issued["agent_id"] == revoked["agent_id"] == "calendar_agent"
    assert str(issued["detail"]).startswith("serial ") and revoked["count"] == 1
    assert str(rotated["detail"]).startswith("new kid ")
    assert verify_ledger(home).ok


def test_a_log_that_cannot_be_written_refuses_the_change_before_it_is_made(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another process holds audit.db locked: every command that changes something is refused with
    STORE_BUSY and changes nothing (before: the item was added, then the command failed on its
    event). Commands that change nothing (a dry-run import) still work. Released: the same command
    works and records its event."""
    from gateway import ca_store
    from gateway.guard.store import MemoryStore

    assert uomp(home, "init") == 0
    with home.config_file.open("a") as f:
        f.write("\n[guard]\ndb_busy_timeout_seconds = 0.3\n")
    src = home.home / "items.csv"
    src.write_text("key,value,tags\nh.a,1,holding\n")
    assert uomp(home, "memory", "add", "preference.lang", "--value", '"en"', *TAGS) == 0  # one event before
    assert uomp(home, "agent", "issue", "calendar_agent", "--out", str(tmp_path / "cal")) == 0
    jwks = home.home / ".secrets" / "jwks.json"  # the trusted public keys: a rotation adds one
    crl, public_keys = ca_store.crl_path(home).read_bytes(), jwks.read_bytes()
    with held_lock(home.audit_db):
        capsys.readouterr()
        assert uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', *TAGS) != 0
        assert uomp(home, "import", str(src), "--sensitivity", "low") != 0
        assert "STORE_BUSY" in capsys.readouterr().err
        assert uomp(home, "import", str(src), "--sensitivity", "low", "--dry-run") == 0  # changes nothing
        assert uomp(home, "memory", "rm", "preference.lang") != 0
        assert uomp(home, "keys", "rotate") != 0
        assert uomp(home, "agent", "issue", "travel_agent", "--out", str(tmp_path / "travel")) != 0
        assert uomp(home, "agent", "revoke", "calendar_agent") != 0
    assert not (tmp_path / "travel" / "agent.crt").exists()  # no certificate issued
    assert ca_store.crl_path(home).read_bytes() == crl  # nothing revoked
    assert jwks.read_bytes() == public_keys  # no key rotated
    store = MemoryStore(home.memory_db)
    try:
        assert store.get("preference.theme") is None and store.get("h.a") is None  # nothing was changed
        assert store.get("preference.lang") is not None
    finally:
        store.close()
    assert [e["action"] for e in user_events(home)] == ["memory_added", "cert_issued"]  # and recorded nothing
    assert uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', *TAGS) == 0
    assert uomp(home, "agent", "revoke", "calendar_agent") == 0
    assert [e["action"] for e in user_events(home)] == ["memory_added", "cert_issued", "memory_added", "cert_revoked"]
    assert ca_store.crl_path(home).read_bytes() != crl
    assert uomp(home, "keys", "rotate") == 0 and jwks.read_bytes() != public_keys
