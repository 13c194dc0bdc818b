"""The file format of a sealed home's databases (gateway/atrest/memdb.py, ``PROFILES``): a home
sealed now has memory.db and audit.db in ``sqlcipher4-sha256`` (HMAC-SHA256 page HMAC, read back
from the files themselves), recorded as ``db`` in its master key slot; a home sealed with SQLCipher's
defaults before (no record) still opens, serves, verifies, backs up and restores; unseal then seal
moves a home to the current format; a record that is missing, wrong or unknown is a named refusal
(KEY_ERROR, a stable reason) and leaves the files as they were."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import sqlcipher3.dbapi2 as cipher  # type: ignore[import-untyped]
from backupkit import marked_value
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from guardkit import call, grant, guard_config, running_guard, unix_session
from test_sealed_cli import env, pp_file, uomp
from test_sealed_keys import FAST, PASSPHRASE, make_home

from gateway.atrest import auditdb, backup, memdb, migrate, vault
from gateway.cli.backup import verify_restored
from gateway.config import Paths
from gateway.dashboard import memory_page
from gateway.errors import ErrorCode, UompError
from gateway.guard.store import MemoryItem, MemoryStore

TS = "2026-01-01T00:00:00Z"
KEY = "preference.profile-marker-3c1e"
BACKUP_PASS = b"backup-pass-profile-9a"


@pytest.fixture(autouse=True)
def _clean_vault() -> None:
    vault.forget()
    vault.set_prompt(None)


CURRENT, OLD = "sqlcipher4-sha256", "sqlcipher4"  # (names, not the module's objects: this file
# is also run against the code from before the formats, where each test but the old home's fails)


def sealed_home(profile: str = CURRENT) -> Paths:
    paths = make_home()
    with MemoryStore(paths.memory_db) as s:
        s.put(MemoryItem(KEY, {"v": 7}, ("preference",), "low", "user", TS, TS))
    if profile == CURRENT:
        migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)  # what `uomp secrets seal` does
    else:  # a home as sealed before formats were recorded: SQLCipher's defaults, no record
        migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST, profile=memdb.PROFILES[profile])
    return paths


async def serve(paths: Paths, reads: int = 3) -> None:
    """The guard serves GET by key from the home (and audits each read into audit.db)."""
    async with running_guard(paths, guard_config(), serve_tcp=False) as g, unix_session(paths) as s:
        granted = await grant(s, paths, read={"tags": ["preference"], "keys": []})
        for _ in range(reads):
            status, body, _h = await call(s, "GET", f"/v1/memory/{KEY}", token=granted["token"])
            assert status == 200 and body["value"] == {"v": 7}, body
        await g.services.audit.writer.probe()  # type: ignore[union-attr]


def opens_with(db: Path, key: bytes, hmac: str | None) -> bool:
    """Whether ``db`` reads under ``key`` with SQLCipher's defaults, or ``hmac`` as its page HMAC:
    the file's format, asked of SQLCipher itself (not of our code)."""
    conn = cipher.connect(db.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        conn.execute(f"PRAGMA key = \"x'{bytes(key).hex()}'\"")
        if hmac is not None:
            conn.execute(f"PRAGMA cipher_hmac_algorithm = {hmac}")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        return True
    except cipher.DatabaseError:
        return False
    finally:
        conn.close()


def formats(paths: Paths) -> dict[str, str]:
    """Each database's format, told by which page HMAC opens it."""
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    out = {}
    for name, db, key in (
        ("memory.db", paths.memory_db, vault.master(paths).subkey("memory-db")),
        ("audit.db", paths.audit_db, vault.master(paths).subkey("audit-db")),
    ):
        sha512, sha256 = opens_with(db, key, None), opens_with(db, key, "HMAC_SHA256")
        out[name] = "sha512" if sha512 and not sha256 else "sha256" if sha256 and not sha512 else "neither"
    return out


def slot(paths: Paths) -> dict[str, object]:
    doc: dict[str, object] = json.loads(paths.master_slot.read_bytes())
    return doc


def verify_cli(paths: Paths, tmp: Path) -> dict[str, object]:
    """`uomp audit verify --json` in its own process, unlocked by a passphrase file (as a service)."""
    res = uomp(paths.home, "audit", "verify", "--json", "--no-chain", e=env(UOMP_PASSPHRASE_FILE=str(pp_file(tmp))))
    assert res.returncode == 0, res.stdout + res.stderr
    report: dict[str, object] = json.loads(res.stdout)
    assert report["ok"] is True and report["encrypted"] is True, report
    return report


async def test_a_new_sealed_homes_databases_use_hmac_sha256(tmp_path: Path) -> None:
    paths = sealed_home()
    await serve(paths)
    assert slot(paths)["db"] == "sqlcipher4-sha256"
    assert formats(paths) == {"memory.db": "sha256", "audit.db": "sha256"}
    res = uomp(paths.home, "secrets", "status", "--json", stdin="")
    assert json.loads(res.stdout)["db_format"] == CURRENT, res.stdout + res.stderr
    conn = auditdb.connect(paths.audit_db, readonly=True)  # the product's connection reads the settings back
    try:
        assert conn.execute("PRAGMA cipher_hmac_algorithm").fetchall() == [("HMAC_SHA256",)]
        assert conn.execute("PRAGMA cipher_page_size").fetchall() == [("4096",)]
        assert conn.execute("SELECT count(*) FROM ledger_events WHERE action = 'read'").fetchone()[0] >= 3
    finally:
        conn.close()
    verify_cli(paths, tmp_path)


async def test_a_home_sealed_with_the_old_defaults_opens_serves_and_verifies(tmp_path: Path) -> None:
    paths = sealed_home(OLD)
    assert "db" not in slot(paths)  # the slot of a home sealed before formats were recorded
    res = uomp(paths.home, "secrets", "status", "--json", stdin="")
    assert json.loads(res.stdout)["db_format"] == OLD, res.stdout + res.stderr
    await serve(paths)
    assert formats(paths) == {"memory.db": "sha512", "audit.db": "sha512"}
    assert marked_value(paths, KEY) == {"v": 7}
    verify_cli(paths, tmp_path)
    # the other openers of audit.db: status, doctor, the dashboard
    e = env(UOMP_PASSPHRASE_FILE=str(pp_file(tmp_path)))
    res = uomp(paths.home, "status", "--json", e=e)
    assert json.loads(res.stdout)["audit_log"]["ok"] is True, res.stdout + res.stderr
    res = uomp(paths.home, "doctor", e=e)
    assert "is encrypted at rest" in res.stdout and "INTERNAL" not in res.stdout + res.stderr, res.stdout
    assert memory_page.readers(paths, KEY) != []
    await serve(paths)  # a second start: the files it wrote stay in their format
    assert formats(paths) == {"memory.db": "sha512", "audit.db": "sha512"}


async def test_unseal_then_seal_moves_an_old_home_to_the_current_format(tmp_path: Path) -> None:
    paths = sealed_home(OLD)
    await serve(paths)
    vault.forget()
    pp = str(pp_file(tmp_path))
    res = uomp(paths.home, "secrets", "unseal", "--passphrase-file", pp)
    assert res.returncode == 0 and f"decrypted: {paths.audit_db}" in res.stdout, res.stdout + res.stderr
    assert memdb.is_plaintext(paths.memory_db) and memdb.is_plaintext(paths.audit_db)
    res = uomp(paths.home, "secrets", "seal", "--passphrase-file", pp)
    assert res.returncode == 0 and f"encrypted: {paths.audit_db}" in res.stdout, res.stdout + res.stderr
    assert slot(paths)["db"] == "sqlcipher4-sha256"
    assert formats(paths) == {"memory.db": "sha256", "audit.db": "sha256"}
    assert marked_value(paths, KEY) == {"v": 7}
    verify_cli(paths, tmp_path)
    await serve(paths)


@pytest.mark.parametrize("profile", [CURRENT, OLD], ids=["current", "old-defaults"])
@pytest.mark.parametrize("kind", ["passphrase", "recipient"])
async def test_a_backup_restores_the_databases_in_their_format(kind: str, profile: str) -> None:
    paths = sealed_home(profile)
    await serve(paths)
    want = "sha256" if profile == CURRENT else "sha512"
    out = paths.home.parent / "home.uompbak"
    identity = X25519PrivateKey.generate()
    if kind == "passphrase":
        backup.create(paths, out, BACKUP_PASS, kdf=FAST)
    else:
        backup.create(paths, out, to=identity.public_key())
    vault.forget()
    target = paths.home.parent / "restored"
    if kind == "passphrase":
        backup.restore(out, target, BACKUP_PASS)
    else:
        backup.restore(out, target, identity=identity)
    restored = Paths(target)
    assert slot(restored).get("db") == slot(paths).get("db")
    assert formats(restored) == {"memory.db": want, "audit.db": want}
    assert marked_value(restored, KEY) == {"v": 7}
    assert verify_restored(restored).startswith("audit log verified")
    await serve(restored)


def digests(paths: Paths) -> dict[str, str]:
    out = {}
    for p in (paths.memory_db, paths.audit_db):
        for suffix in ("", "-wal"):
            f = Path(str(p) + suffix)
            if f.exists() and f.stat().st_size > 0:  # (an empty -wal an open leaves holds nothing)
                out[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def rewrite_slot(paths: Paths, db: object) -> None:
    doc = slot(paths)
    if db is None:
        doc.pop("db", None)
    else:
        doc["db"] = db
    paths.master_slot.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")


def refusal_of(paths: Paths, opener: str) -> UompError:
    vault.forget()
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    with pytest.raises(UompError) as got:
        if opener == "audit":
            auditdb.connect(paths.audit_db, readonly=True).close()
        else:
            MemoryStore(paths.memory_db, key=memdb.key_for(paths), create=False).close()
    return got.value


@pytest.mark.parametrize(
    ("profile", "record"),
    [
        pytest.param(CURRENT, None, id="current-files-record-missing"),
        pytest.param(CURRENT, OLD, id="current-files-record-says-old"),
        pytest.param(OLD, CURRENT, id="old-files-record-says-current"),
    ],
)
async def test_a_missing_or_wrong_record_is_a_named_refusal_and_changes_nothing(
    tmp_path: Path, profile: str, record: str | None
) -> None:
    paths = sealed_home(profile)
    await serve(paths, reads=1)
    vault.forget()
    rewrite_slot(paths, record)
    before = digests(paths)
    for opener in ("audit", "memory"):
        exc = refusal_of(paths, opener)
        assert exc.code == ErrorCode.KEY_ERROR and exc.details["reason"] == "profile_mismatch", exc
        assert exc.details["profile"] == profile, exc
    vault.forget()
    res = uomp(paths.home, "audit", "verify", "--json", e=env(UOMP_PASSPHRASE_FILE=str(pp_file(tmp_path))))
    assert res.returncode != 0 and "KEY_ERROR" in res.stdout + res.stderr, res.stdout + res.stderr
    assert digests(paths) == before  # nothing was rewritten under the wrong format
    rewrite_slot(paths, None if profile == OLD else profile)  # the right record back: all works
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    assert marked_value(paths, KEY) == {"v": 7}
    verify_cli(paths, tmp_path)


@pytest.mark.parametrize("record", ["sqlcipher9-future", 5], ids=["unknown-name", "not-a-name"])
def test_an_unknown_or_malformed_record_is_key_error(record: object) -> None:
    paths = sealed_home()
    vault.forget()
    rewrite_slot(paths, record)
    if isinstance(record, str):  # a slot that reads: the unlock works, the databases do not open
        vault.unlock_with_passphrase(paths, PASSPHRASE)
    with pytest.raises(UompError) as got:
        memdb.key_for(paths)
    assert got.value.code == ErrorCode.KEY_ERROR, got.value
    with pytest.raises(UompError) as audit:
        auditdb.connect(paths.audit_db, readonly=True)
    assert audit.value.code == ErrorCode.KEY_ERROR, audit.value
