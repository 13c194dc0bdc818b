"""The external witness (``uomp audit witness --dir DIR``, C2SP tlog-cosignature/v1), on real files:
it cosigns only a checkpoint signed by the audit key that extends the last one it cosigned; a
rolled-back or forked ``audit.db`` is refused and DIR stays as it was; ``uomp audit verify
--witness-dir DIR`` holds the log to what the witness cosigned, even when the appliance's own
witness record went with the rollback; a tampered cosignature or another witness key vouches for
nothing."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from test_audit_integrity import _checkpoints, _fill, _rollback, _uomp

from gateway.config import Paths
from gateway.core.checkpoint import SIG_PREFIX, Checkpoint
from gateway.keys import init_home
from gateway.ledger import auditkey, cosign

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def wdir(tmp_path: Path) -> Path:
    return tmp_path / "other-disk" / "witness"


def _witness(paths: Paths, wdir: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    r = _uomp(paths, "audit", "witness", "--dir", str(wdir), "--json")
    return r, json.loads(r.stdout) if r.stdout.strip() else {}


def _verify(paths: Paths, *extra: str) -> dict[str, Any]:
    r = _uomp(paths, "audit", "verify", "--no-chain", "--json", *extra)
    out: dict[str, Any] = json.loads(r.stdout)
    assert (r.returncode == 0) == out["ok"], r
    return out


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _cosignature(note: str) -> tuple[str, bytes]:
    """The last signature line: (signer name, decoded blob)."""
    line = note.rstrip("\n").split("\n")[-1]
    assert line.startswith(SIG_PREFIX)
    name, b64 = line[len(SIG_PREFIX) :].split(" ")
    return name, base64.b64decode(b64)


def _other_home_with_the_same_key(paths: Paths, tmp_path: Path) -> Paths:
    other = Paths(tmp_path / "forger-home")
    init_home(other)
    shutil.copy2(paths.audit_key, other.audit_key)
    return other


def test_the_first_run_makes_the_key_in_dir_and_cosigns_in_the_c2sp_form(home: Paths, wdir: Path) -> None:
    _fill(home, 200)
    r, out = _witness(home, wdir)
    assert r.returncode == 0, r
    assert out["status"] == "cosigned" and out["size"] == 200 and out["key_made"] is True
    key_file = wdir / cosign.KEY_FILE
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert not list(home.home.rglob(cosign.KEY_FILE))  # the witness key lives in DIR only
    name, pub = cosign.parse_verifier_key(out["witness_key"])
    assert (wdir / cosign.VKEY_FILE).read_text().strip() == out["witness_key"]

    note = (wdir / cosign.CHECKPOINT_FILE).read_text()
    text = note.split("\n\n")[0] + "\n"
    audit_pub = auditkey.load(home).public_key()
    assert Checkpoint.open(note, auditkey.origin_for(audit_pub), audit_pub).size == 200
    # the cosignature line, byte for byte: key id (0x04 type byte) || u64 big-endian time || Ed25519 sig
    signer, blob = _cosignature(note)
    raw = pub.public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert signer == name and len(blob) == 4 + 8 + 64
    assert blob[:4] == hashlib.sha256(name.encode() + b"\n\x04" + raw).digest()[:4]
    (stamp,) = struct.unpack(">Q", blob[4:12])
    pub.verify(blob[12:], f"cosignature/v1\ntime {stamp}\n".encode() + text.encode())  # raises if not
    assert len((wdir / cosign.HISTORY_FILE).read_text().splitlines()) == 1

    before = _snapshot(wdir)
    r, out = _witness(home, wdir)  # nothing new: up to date, nothing rewritten, the key kept
    assert r.returncode == 0 and out["status"] == "up to date" and out["key_made"] is False
    assert _snapshot(wdir) == before


def test_a_grown_log_is_cosigned_after_a_consistency_check(home: Paths, wdir: Path) -> None:
    _fill(home, 200)
    assert _witness(home, wdir)[0].returncode == 0
    _fill(home, 100)
    r, out = _witness(home, wdir)
    assert r.returncode == 0, r
    assert out["status"] == "cosigned" and out["size"] == 300 and out["previous_size"] == 200
    history = [json.loads(line) for line in (wdir / cosign.HISTORY_FILE).read_text().splitlines()]
    assert [h["size"] for h in history] == [200, 300]
    assert history[-1]["note"] == (wdir / cosign.CHECKPOINT_FILE).read_text()


def test_a_rolled_back_log_is_refused_and_dir_is_unchanged(home: Paths, wdir: Path) -> None:
    _fill(home, 200)
    _fill(home, 100)
    assert _witness(home, wdir)[0].returncode == 0
    before = _snapshot(wdir)
    _rollback(home, 200)
    r, out = _witness(home, wdir)
    assert r.returncode == 1, r
    assert out["code"] == "AUDIT_LOG_INCONSISTENT" and out["first_bad_seq"] == 201 and "201-300" in out["problem"]
    assert _snapshot(wdir) == before
    r = _uomp(home, "audit", "witness", "--dir", str(wdir))  # the text form names the code too
    assert r.returncode == 1 and "AUDIT_LOG_INCONSISTENT" in r.stderr
    assert _snapshot(wdir) == before


@pytest.mark.parametrize("fork_size", [200, 300])
def test_a_forked_log_under_the_same_key_is_refused(home: Paths, wdir: Path, tmp_path: Path, fork_size: int) -> None:
    """Another history signed with the audit key: at the same size another root, or a longer log
    whose first 200 events are not the cosigned ones."""
    _fill(home, 200)
    assert _witness(home, wdir)[0].returncode == 0
    before = _snapshot(wdir)
    forger = _other_home_with_the_same_key(home, tmp_path)
    _fill(forger, 200)
    if fork_size > 200:
        _fill(forger, fork_size - 200)
    assert _checkpoints(forger)[200] != _checkpoints(home)[200]
    r, out = _witness(forger, wdir)
    assert r.returncode == 1, r
    assert out["code"] == "AUDIT_LOG_INCONSISTENT" and out["first_bad_seq"] == 200
    assert _snapshot(wdir) == before
    assert _witness(home, wdir)[0].returncode == 0  # the honest log is still up to date


def test_verify_with_the_witness_dir_catches_a_rollback_that_took_the_witness_record(home: Paths, wdir: Path) -> None:
    _fill(home, 200)
    _fill(home, 100)
    assert _witness(home, wdir)[0].returncode == 0
    out = _verify(home, "--witness-dir", str(wdir))
    assert out["ok"] and out["external_witness_size"] == 300
    _rollback(home, 200)
    home.audit_witness.unlink()
    assert _verify(home)["ok"]  # nothing on this machine remembers events 201-300 any more
    out = _verify(home, "--witness-dir", str(wdir))
    assert not out["ok"] and out["inconsistent"] and out["first_bad_seq"] == 201


def _tamper_cosignature(wdir: Path) -> None:
    note = (wdir / cosign.CHECKPOINT_FILE).read_text()
    signer, blob = _cosignature(note)
    bad = blob[:-1] + bytes([blob[-1] ^ 1])
    head = note.rstrip("\n").rsplit("\n", 1)[0]
    (wdir / cosign.CHECKPOINT_FILE).write_text(f"{head}\n{SIG_PREFIX}{signer} {base64.b64encode(bad).decode()}\n")


def _backdate_cosignature(wdir: Path) -> None:
    """A valid-looking line whose time was changed: the signature covers the time line."""
    note = (wdir / cosign.CHECKPOINT_FILE).read_text()
    signer, blob = _cosignature(note)
    (stamp,) = struct.unpack(">Q", blob[4:12])
    bad = blob[:4] + struct.pack(">Q", stamp - 3600) + blob[12:]
    head = note.rstrip("\n").rsplit("\n", 1)[0]
    (wdir / cosign.CHECKPOINT_FILE).write_text(f"{head}\n{SIG_PREFIX}{signer} {base64.b64encode(bad).decode()}\n")


def _swap_key(wdir: Path, tmp_path: Path, home: Paths) -> None:
    """Another witness's key in DIR, beside the checkpoint the first one cosigned."""
    other = tmp_path / "another-witness"
    cosign.WitnessDir(other).ensure_key()
    for f in (cosign.KEY_FILE, cosign.VKEY_FILE):
        shutil.copy2(other / f, wdir / f)


def _swap_vkey_only(wdir: Path, tmp_path: Path, home: Paths) -> None:
    other = tmp_path / "another-witness"
    cosign.WitnessDir(other).ensure_key()
    shutil.copy2(other / cosign.VKEY_FILE, wdir / cosign.VKEY_FILE)


def _forged_checkpoint(wdir: Path, tmp_path: Path, home: Paths) -> None:
    """The witness's real cosignature, over a checkpoint body that was edited (a larger size)."""
    note = (wdir / cosign.CHECKPOINT_FILE).read_text()
    lines = note.split("\n")
    lines[1] = str(int(lines[1]) + 100)
    (wdir / cosign.CHECKPOINT_FILE).write_text("\n".join(lines))


@pytest.mark.parametrize(
    "tamper", [_tamper_cosignature, _backdate_cosignature, _swap_key, _swap_vkey_only, _forged_checkpoint]
)
def test_a_tampered_cosignature_or_another_witness_key_is_never_trusted(
    home: Paths, wdir: Path, tmp_path: Path, tamper: Any
) -> None:
    _fill(home, 200)
    assert _witness(home, wdir)[0].returncode == 0
    assert _verify(home, "--witness-dir", str(wdir))["ok"]
    if tamper in (_tamper_cosignature, _backdate_cosignature):
        tamper(wdir)
    else:
        tamper(wdir, tmp_path, home)
    out = _verify(home, "--witness-dir", str(wdir))
    assert not out["ok"] and out["external_witness_size"] is None
    assert any("external witness is refused" in p for p in out["problems"]), out["problems"]
    if tamper is _swap_vkey_only:
        return  # the key file still signs; only what verify trusts was replaced
    before = _snapshot(wdir)
    _fill(home, 100)
    r, out = _witness(home, wdir)  # the witness itself cosigns nothing on top of a state it cannot verify
    assert r.returncode == 1 and out["code"] == "AUDIT_LOG_INCONSISTENT"
    assert _snapshot(wdir) == before


def test_a_log_rolled_back_below_every_checkpoint_is_refused(home: Paths, wdir: Path) -> None:
    _fill(home, 300)  # one checkpoint, at 300
    assert _witness(home, wdir)[0].returncode == 0
    before = _snapshot(wdir)
    _rollback(home, 200)
    r, out = _witness(home, wdir)
    assert r.returncode == 1, r
    assert out["code"] == "AUDIT_LOG_INCONSISTENT" and out["first_bad_seq"] == 201
    assert _snapshot(wdir) == before


def test_verify_with_an_empty_or_missing_witness_dir_is_red(home: Paths, wdir: Path) -> None:
    _fill(home, 100)
    out = _verify(home, "--witness-dir", str(wdir))
    assert not out["ok"] and any("run 'uomp audit witness" in p for p in out["problems"])


def test_the_configured_witness_dir_is_used_and_a_missing_one_only_warns(home: Paths, wdir: Path) -> None:
    home.config_file.write_text(f'[guard]\naudit_witness_dir = "{wdir}"\n')
    _fill(home, 100)
    out = _verify(home)  # not mounted yet: a warning, the log is still checked as before
    assert out["ok"] and out["external_witness_size"] is None
    assert any("audit_witness_dir" in w for w in out["warnings"]), out["warnings"]
    r, out = _uomp_witness_from_config(home)  # --dir from the configuration
    assert r.returncode == 0 and out["status"] == "cosigned" and (wdir / cosign.CHECKPOINT_FILE).exists()
    assert _verify(home)["external_witness_size"] == 100
    _rollback(home, 50)
    home.audit_witness.unlink()
    out = _verify(home)
    assert not out["ok"] and out["first_bad_seq"] == 51
    _tamper_cosignature(wdir)  # present but not valid: red, never a warning
    out = _verify(home)
    assert not out["ok"] and any("external witness is refused" in p for p in out["problems"])


def _uomp_witness_from_config(paths: Paths) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    r = _uomp(paths, "audit", "witness", "--json")
    return r, json.loads(r.stdout) if r.stdout.strip() else {}
