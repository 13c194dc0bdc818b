"""Keys sealed at rest (gateway/atrest/), in process, on real files: every private key of a home
sealed under a passphrase, opened by the real loaders after an unlock, and every way a sealed home
is refused: locked, wrong passphrase, a plaintext key planted, a sealed file swapped, truncated,
changed or from another home, a tampered slot."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from shortdir import short_dir

from gateway import ca_store, keys
from gateway.atrest import itemseal, journal, migrate, sealing, vault
from gateway.config import Paths
from gateway.core import ca
from gateway.errors import ErrorCode, UompError
from gateway.ledger import auditkey
from gateway.payloads import userkey
from gateway.remote.tls import build_server_context

PASSPHRASE = "tr0ub4dor&3-sealed-marker"
# The lowest parameters a slot may hold, to keep this file fast; one test seals with the defaults.
FAST = {"alg": "argon2id", "iterations": 1, "lanes": 1, "memory_kib": 8 * 1024}


@pytest.fixture(autouse=True)
def _clean_vault() -> Iterator[None]:
    vault.forget()
    vault.set_prompt(None)
    old = {
        k: os.environ.pop(k, None) for k in (vault.PASSPHRASE_FILE_ENV, vault.MASTER_FD_ENV, "CREDENTIALS_DIRECTORY")
    }
    yield
    vault.forget()
    for k, v in old.items():
        if v is not None:
            os.environ[k] = v


def make_home() -> Paths:
    paths = Paths(short_dir("uomp-sk-") / "home")
    keys.init_home(paths)
    ca_store.init_all(paths, ["localhost"])
    auditkey.ensure(paths)
    userkey.ensure(paths)
    itemseal.sealer_for(paths)  # .secrets/items.key, as the memory store's first open makes it
    return paths


def raw_private(key: object) -> bytes:
    return key.private_bytes(  # type: ignore[attr-defined, no-any-return]
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def loaded(paths: Paths) -> dict[str, bytes]:
    """Each key through the loader the appliance uses, as comparable bytes (private scalars/DER)."""
    ca_key, _ = ca_store.load_ca(paths)
    gw = ca_store.load_key_file(paths.gateway_key, "gateway key")
    der = serialization.Encoding.DER
    pk8 = serialization.PrivateFormat.PKCS8
    none = serialization.NoEncryption()
    return {
        "signing": raw_private(keys.load_signing_key(paths).key),
        "audit": raw_private(auditkey.load(paths)),
        "payload": raw_private(userkey.load_private(paths)),
        "ca": ca_key.private_bytes(der, pk8, none),
        "gateway": gw.private_bytes(der, pk8, none),
        "admin": keys.load_admin(paths).encode(),
        "items": vault.read_key(itemseal.items_key_path(paths)),
    }


def secret_markers(paths: Paths) -> list[bytes]:
    """Byte strings that would betray a key if found in a file: raw key bytes, their base64 (as in
    a JWK or PEM), each PEM body line, and the passphrase."""
    out = [PASSPHRASE.encode()]
    for value in loaded(paths).values():
        out += [value, base64.b64encode(value), base64.urlsafe_b64encode(value).rstrip(b"=")]
    for f, _role in journal.sealed_files(paths):
        raw = f.read_bytes()
        if raw.startswith(b"-----BEGIN"):
            out += [line for line in raw.splitlines() if line and not line.startswith(b"-----")]
    return out


def scan(root: Path, markers: list[bytes]) -> list[str]:
    hits = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_socket():
                continue
            data = p.read_bytes()
            hits += [f"{p}: {m[:12]!r}" for m in markers if m in data]
    return hits


def test_sealed_keys_open_with_the_passphrase_and_are_nowhere_in_plaintext() -> None:
    paths = make_home()
    before = loaded(paths)
    markers = secret_markers(paths)
    assert scan(paths.home, markers), "the markers must find the plaintext keys before sealing"

    migrate.seal(paths, passphrase=PASSPHRASE)

    assert json.loads(paths.master_slot.read_bytes())["kdf"]["memory_kib"] == sealing.DEFAULT_KDF["memory_kib"]
    for f, _role in journal.sealed_files(paths):
        assert f.read_bytes().startswith(sealing.SEALED_MAGIC), f
        assert f.stat().st_mode & 0o777 == 0o600
    assert paths.master_slot.stat().st_mode & 0o777 == 0o600
    assert scan(paths.home, markers) == []
    assert not [n for n in os.listdir(paths.secrets) if n.startswith(".atrest-")], "no stage or journal left"

    vault.forget()
    with pytest.raises(UompError) as locked:
        keys.load_signing_key(paths)
    assert locked.value.code == ErrorCode.SECRETS_LOCKED
    assert "UOMP_PASSPHRASE_FILE" in locked.value.message

    with pytest.raises(UompError) as wrong:
        vault.unlock_with_passphrase(paths, PASSPHRASE + "x")
    assert wrong.value.code == ErrorCode.PASSPHRASE_WRONG
    assert vault.unlocked(paths) is None

    vault.unlock_with_passphrase(paths, PASSPHRASE)
    assert loaded(paths) == before
    # the TLS server context loads the sealed gateway key without any file of plaintext
    ctx = build_server_context(paths.gateway_cert, paths.gateway_key, paths.ca_cert, paths.crl)
    assert ctx.get_ca_certs() is not None
    assert scan(paths.home, markers) == []


def test_passphrase_file_and_systemd_credential_unlock(tmp_path: Path) -> None:
    paths = make_home()
    before = loaded(paths)
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    vault.forget()
    pp = tmp_path / "pp"
    pp.write_text(PASSPHRASE + "\n")
    pp.chmod(0o600)
    os.environ[vault.PASSPHRASE_FILE_ENV] = str(pp)
    assert loaded(paths) == before
    vault.forget()
    pp.write_text(PASSPHRASE + "-not\n")
    with pytest.raises(UompError) as wrong:
        keys.load_signing_key(paths)
    assert wrong.value.code == ErrorCode.PASSPHRASE_WRONG
    del os.environ[vault.PASSPHRASE_FILE_ENV]

    cred = tmp_path / "creds"
    cred.mkdir()
    (cred / vault.CREDENTIAL_NAME).write_text(PASSPHRASE)
    os.environ["CREDENTIALS_DIRECTORY"] = str(cred)
    assert loaded(paths) == before
    vault.forget()
    (cred / vault.CREDENTIAL_NAME).write_text("")
    with pytest.raises(UompError) as empty:
        keys.load_signing_key(paths)
    assert empty.value.code == ErrorCode.PASSPHRASE_WRONG
    pp.chmod(0o602)
    os.environ[vault.PASSPHRASE_FILE_ENV] = str(pp)
    with pytest.raises(UompError) as unsafe:
        keys.load_signing_key(paths)
    assert unsafe.value.code == ErrorCode.UNSAFE_PERMISSIONS


def test_prompt_is_asked_and_three_wrong_answers_refuse() -> None:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    vault.forget()
    answers = iter(["no", "nope", PASSPHRASE])
    vault.set_prompt(lambda: next(answers))
    keys.load_signing_key(paths)
    vault.forget()
    asked = []
    vault.set_prompt(lambda: asked.append(1) or "wrong")  # type: ignore[func-returns-value]
    with pytest.raises(UompError) as wrong:
        keys.load_signing_key(paths)
    assert wrong.value.code == ErrorCode.PASSPHRASE_WRONG
    assert len(asked) == vault.PROMPT_ATTEMPTS


def test_a_plaintext_key_planted_in_a_sealed_home_is_refused() -> None:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    planted = ca.key_pem(ca.new_key("p256"))
    paths.ca_key.write_bytes(planted)
    with pytest.raises(UompError) as exc:
        ca_store.load_ca(paths)
    assert (
        exc.value.code == ErrorCode.KEY_ERROR and "plaintext key in a home whose keys are sealed" in exc.value.message
    )
    # the same plaintext file in a plain home is what it always was: a key
    plain = make_home()
    plain.gateway_key.write_bytes(planted)
    ca_store.load_key_file(plain.gateway_key, "gateway key")


@pytest.mark.parametrize("damage", ["swap", "truncate", "flip", "other_home", "master_missing"])
def test_a_damaged_or_foreign_sealed_file_is_refused(damage: str) -> None:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    audit, payload = paths.audit_key.read_bytes(), paths.payload_private_key.read_bytes()
    if damage == "swap":
        paths.audit_key.write_bytes(payload)
        paths.payload_private_key.write_bytes(audit)
    elif damage == "truncate":
        paths.audit_key.write_bytes(audit[: len(audit) // 2])
    elif damage == "flip":
        body = json.loads(audit[len(sealing.SEALED_MAGIC) :])
        ct = bytearray(base64.b64decode(body["ct"]))
        ct[3] ^= 1
        body["ct"] = base64.b64encode(bytes(ct)).decode()
        paths.audit_key.write_bytes(sealing.SEALED_MAGIC + json.dumps(body).encode())
    elif damage == "other_home":
        other = make_home()
        migrate.seal(other, passphrase=PASSPHRASE, kdf=FAST)
        paths.audit_key.write_bytes(other.audit_key.read_bytes())
    elif damage == "master_missing":
        paths.master_slot.unlink()
    with pytest.raises(UompError) as exc:
        auditkey.load(paths)
    assert exc.value.code == ErrorCode.KEY_ERROR, exc.value
    assert str(paths.audit_key) in exc.value.message
    # the partner: an undamaged sealed key of the same home still opens
    if damage not in ("swap", "master_missing"):
        userkey.load_private(paths)


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("memory_kib", 64 * 1024 * 1024, ErrorCode.KEY_ERROR),  # 64 GiB: refused before any work
        ("iterations", 0, ErrorCode.KEY_ERROR),
        ("wrapped", "flip", ErrorCode.PASSPHRASE_WRONG),
        ("iterations", 4, ErrorCode.PASSPHRASE_WRONG),  # parameters are authenticated (and derive another key)
    ],
)
def test_a_tampered_master_slot_is_refused(field: str, value: object, code: ErrorCode) -> None:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    vault.forget()
    slot = json.loads(paths.master_slot.read_bytes())
    if field == "wrapped":
        raw = bytearray(base64.b64decode(slot["wrapped"]))
        raw[0] ^= 1
        slot["wrapped"] = base64.b64encode(bytes(raw)).decode()
    else:
        slot["kdf"][field] = value
    paths.master_slot.write_text(json.dumps(slot))
    with pytest.raises(UompError) as exc:
        vault.unlock_with_passphrase(paths, PASSPHRASE)
    assert exc.value.code == code


def test_unseal_puts_back_the_same_keys_and_a_second_seal_or_unseal_is_refused() -> None:
    paths = make_home()
    before = loaded(paths)
    master = migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    with pytest.raises(UompError) as twice:
        migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    assert twice.value.code == ErrorCode.INVALID_STATE
    migrate.unseal(paths, master)
    assert not paths.master_slot.exists()
    for f, _role in journal.sealed_files(paths):
        assert f.read_bytes().startswith((b"-----BEGIN", b"{", b"uadm_"))
    vault.forget()
    assert loaded(paths) == before  # no unlock needed any more
    with pytest.raises(UompError) as again:
        migrate.unseal(paths, master)
    assert again.value.code == ErrorCode.INVALID_STATE


def test_keys_made_in_a_sealed_home_are_sealed_too() -> None:
    paths = make_home()
    paths.payload_private_key.unlink()
    paths.gateway_key.unlink()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    assert userkey.ensure(paths) is True
    assert paths.payload_private_key.read_bytes().startswith(sealing.SEALED_MAGIC)
    ca_store.init_all(paths, ["localhost"])  # re-issues the gateway certificate with a new key
    assert paths.gateway_key.read_bytes().startswith(sealing.SEALED_MAGIC)
    kid = keys.rotate(paths, max_token_lifetime=600)
    assert paths.private_jwk.read_bytes().startswith(sealing.SEALED_MAGIC)
    vault.forget()
    vault.unlock_with_passphrase(paths, PASSPHRASE)
    assert keys.load_signing_key(paths).kid == kid
    userkey.load_private(paths)


def test_a_sealed_file_outside_a_home_is_not_mistaken_for_a_key(tmp_path: Path) -> None:
    paths = make_home()
    migrate.seal(paths, passphrase=PASSPHRASE, kdf=FAST)
    moved = tmp_path / "x" / "audit.key"
    moved.parent.mkdir(mode=0o700)
    moved.write_bytes(paths.audit_key.read_bytes())
    moved.chmod(0o600)
    with pytest.raises(UompError) as exc:
        vault.read_key(moved)
    assert exc.value.code == ErrorCode.KEY_ERROR
    plain = tmp_path / "x" / "plain.key"
    plain.write_bytes(b"-----BEGIN PRIVATE KEY-----\n")
    assert vault.read_key(plain).startswith(b"-----BEGIN")
