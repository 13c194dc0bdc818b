"""One fuzz target per parser: ``TARGETS[name](data: bytes) -> None``.

Each target feeds arbitrary bytes to one parser and checks its contract: the only exception that
may escape is the module's documented error (UompError with the documented code, SealError,
ProofError, NoteError); anything else (TypeError, KeyError, IndexError, RecursionError, an
AssertionError from a property) is a bug. The same functions run under hypothesis in the normal
suite (tests/e2e/test_properties_fuzz_targets.py, bounded) and under atheris, coverage-guided, in
``scripts/fuzz.sh`` (bounded by time), with the seed corpus in tests/fuzz/corpus/<name>/.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gateway.core import capability, checkpoint, dpop, envelope, http1, jose, merkle, sealing, tokens
from gateway.errors import UompError
from gateway.guard.importer import import_file
from gateway.guard.store import MemoryStore
from gateway.remote import pathnorm

NOW = 1_780_000_000.0

# Fixed keys so the targets are deterministic (the fuzzer mutates inputs, not keys).
SIGNING = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"uomp fuzz signing").digest())
KID = "fuzz-kid"
KEYS: dict[str, jose.PublicKey] = {KID: SIGNING.public_key()}
PAYLOAD_KEY = X25519PrivateKey.from_private_bytes(hashlib.sha256(b"uomp fuzz payload").digest())
NOTE_KEY = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"uomp fuzz note").digest())
NOTE_NAME = "uomp.fuzz/log"
BINDING = sealing.Binding("pay_fuzzfuzzfuzz", "sess_fuzz", "fuzz_agent", "text/plain")


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def good_token(**changes: Any) -> str:
    claims = tokens.capability_claims(
        session_id="sess_fuzz",
        agent_id="fuzz_agent",
        read=capability.Scope(tags=("preference",)),
        now=NOW - 10,
        expires=NOW + 300,
        max_read_queries=10,
        profile="local",
        audience="http://127.0.0.1:8750",
    )
    claims.update(changes)
    return tokens.sign_token(claims, SIGNING, KID)


def t_token(data: bytes) -> None:
    """Token parser + verifier: only INVALID_TOKEN / TOKEN_EXPIRED; a byte changed in a good token
    is never accepted with different claims."""
    text = _text(data)
    try:
        tokens.verify_token(text, KEYS, now=NOW)
    except UompError as exc:
        assert exc.code in ("INVALID_TOKEN", "TOKEN_EXPIRED"), exc.code
    # mutate a valid token at a position chosen by the input
    tok = good_token()
    if data:
        i = data[0] * 256 + (data[1] if len(data) > 1 else 0)
        i %= len(tok)
        repl = chr(data[-1] % 94 + 33)
        if repl != tok[i]:
            forged = tok[:i] + repl + tok[i + 1 :]
            try:
                cap = tokens.verify_token(forged, KEYS, now=NOW)
            except UompError as exc:
                assert exc.code in ("INVALID_TOKEN", "TOKEN_EXPIRED"), exc.code
            else:
                # base64url has non-canonical spellings of the last character; the claims must not change
                orig = tokens.verify_token(tok, KEYS, now=NOW)
                assert cap == orig, "an altered token was accepted with other claims"


def t_jose(data: bytes) -> None:
    try:
        parsed = jose.parse_compact(_text(data))
    except UompError as exc:
        assert exc.code == "INVALID_TOKEN"
        return
    for key in KEYS.values():
        assert isinstance(jose.verify_signature(parsed, key), bool)


def t_dpop(data: bytes) -> None:
    replay = dpop.ReplayCache(1000)
    parts = _text(data).split("\n", 2)
    proof = parts[0]
    url = parts[1] if len(parts) > 1 else "https://gw.example/v1/memory/x"
    try:
        dpop.verify_dpop(
            proof,
            method="GET",
            url=url,
            access_token="tok",
            now=NOW,
            window_seconds=60,
            replay=replay,
            expected_jkt=None,
        )
    except UompError as exc:
        assert exc.code in ("DPOP_INVALID", "INVALID_REQUEST"), exc.code
    try:
        n = dpop.normalise_htu(url)
    except ValueError:  # documented: not an absolute http(s) URI
        pass
    else:
        assert dpop.normalise_htu(n) == n, "normalise_htu is not idempotent"


def t_pathnorm(data: bytes) -> None:
    raw = data.decode("latin-1")
    try:
        t = pathnorm.normalize_target(raw)
    except UompError as exc:
        assert exc.code == "INVALID_REQUEST", exc.code
        return
    up = t.upstream_target
    assert up.startswith("/"), up
    # what goes upstream is itself a normal target and stays the same (no double decoding)
    again = pathnorm.normalize_target(up)
    assert again.upstream_target == up, (raw, up, again.upstream_target)


def t_envelope(data: bytes) -> None:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        doc = None
    for streaming, trailer in ((False, False), (False, True), (True, False), (True, True)):
        try:
            env, text = envelope.parse(doc, streaming=streaming, trailer=trailer)
        except UompError as exc:
            assert exc.code == "INVALID_REQUEST", exc.code
            continue
        assert not env.trailer or (streaming and trailer)  # the hash after the bytes: uploads streamed only
        assert envelope.decode_header(envelope.encode_header(env), trailer=trailer) == env
        if text is not None:
            try:
                envelope.decode_ciphertext(text)
            except UompError as exc:
                assert exc.code == "INVALID_REQUEST"
    for trailer in (False, True):
        try:
            env = envelope.decode_header(data.decode("latin-1"), trailer=trailer)
        except UompError as exc:
            assert exc.code == "INVALID_REQUEST"
        else:
            assert trailer or not env.trailer


_ENC, _SEALED = sealing.seal_bytes(PAYLOAD_KEY.public_key(), BINDING, b"fuzz plaintext " * 300)


def t_sealing(data: bytes) -> None:
    """Stream decryptor: arbitrary sealed bytes, and the good ciphertext with one byte changed or cut,
    never open (SealError only); the untouched one opens to its plaintext in any block split."""
    try:
        sealing.open_bytes(PAYLOAD_KEY, BINDING, _ENC, data)
    except sealing.SealError:
        pass
    else:
        raise AssertionError("random bytes opened")
    if not data:
        return
    buf = bytearray(_SEALED)
    i = int.from_bytes(data[:3].ljust(3, b"\0"), "big") % (len(buf) + 1)
    if len(data) > 3 and data[3] % 2:
        cut = bytes(buf[:i])  # truncation (or the whole thing when i == len)
        if i == len(buf):
            return
        mutated = cut
    else:
        if i == len(buf):
            i -= 1
        buf[i] ^= data[-1] or 1
        mutated = bytes(buf)
    step = max(1, data[0] * 97 + 1)
    try:
        out = b"".join(
            sealing.open_stream(
                PAYLOAD_KEY, BINDING, _ENC, (mutated[j : j + step] for j in range(0, len(mutated), step))
            )
        )
    except sealing.SealError:
        return
    raise AssertionError(f"altered ciphertext opened ({len(out)} bytes)")


def t_merkle(data: bytes) -> None:
    """Inclusion and consistency verification: arbitrary proofs raise ProofError only; a real proof
    with a byte or a size changed is refused."""
    tree = merkle.MemoryTree()
    n = 1 + (data[0] % 40 if data else 0)
    for k in range(n):
        tree.append(merkle.leaf_hash(b"leaf %d" % k))
    idx = (data[1] if len(data) > 1 else 0) % n
    leaf = merkle.leaf_hash(b"leaf %d" % idx)
    proof = tree.inclusion_proof(idx)
    merkle.verify_inclusion(idx, n, leaf, proof, tree.root())
    rest = data[2:]
    # arbitrary proof from the input
    path = [rest[j : j + 32].ljust(32, b"\0") for j in range(0, min(len(rest), 32 * 12), 32)]
    try:
        merkle.verify_inclusion(idx, n, leaf, path, tree.root())
    except merkle.ProofError:
        pass
    else:
        assert path == proof, "a forged inclusion proof verified"
    if proof and rest:
        j = rest[0] % len(proof)
        bad = list(proof)
        b = bytearray(bad[j])
        b[rest[-1] % 32] ^= 1
        bad[j] = bytes(b)
        try:
            merkle.verify_inclusion(idx, n, leaf, bad, tree.root())
        except merkle.ProofError:
            pass
        else:
            raise AssertionError("an altered inclusion proof verified")
    old = 1 + (data[2] % n if len(data) > 2 else 0)
    cproof = tree.consistency_proof(old, n)
    merkle.verify_consistency(old, n, tree.root(old), tree.root(), cproof)
    try:
        merkle.verify_consistency(old, n, tree.root(old), tree.root(), path)
    except merkle.ProofError:
        pass
    else:
        assert path == cproof or old == n, "a forged consistency proof verified"


def t_upstream(data: bytes) -> None:
    try:
        status, _keep, headers, _framing = http1.parse_head(data)
    except UompError as exc:
        assert exc.code == "UPSTREAM_ERROR", exc.code
        return
    assert 100 <= status <= 599
    for name, value in headers:
        assert "\r" not in value and "\n" not in value and "\0" not in value
        assert name and ":" not in name


_NOTE_TEXT = "uomp.fuzz/log\n3\n" + base64.b64encode(bytes(32)).decode() + "\n"
_NOTE = checkpoint.sign_note(_NOTE_TEXT, NOTE_NAME, NOTE_KEY)


def t_checkpoint(data: bytes) -> None:
    text = _text(data)
    try:
        opened = checkpoint.open_note(text, NOTE_NAME, NOTE_KEY.public_key())
    except checkpoint.NoteError:
        pass
    else:
        assert opened == _NOTE_TEXT, f"a note not signed by our key verified: {opened[:40]!r}"
    try:
        checkpoint.Checkpoint.parse(text)
    except checkpoint.NoteError:
        pass
    if data:
        i = int.from_bytes(data[:2].ljust(2, b"\0"), "big") % len(_NOTE)
        c = chr(data[-1] % 94 + 33)
        if c != _NOTE[i]:
            forged = _NOTE[:i] + c + _NOTE[i + 1 :]
            try:
                got = checkpoint.open_note(forged, NOTE_NAME, NOTE_KEY.public_key())
            except checkpoint.NoteError:
                pass
            else:
                assert got == _NOTE_TEXT, "an altered note verified with other text"


# The importer's scratch files: in the fuzz run's own work directory (tests/fuzz/run.py names it;
# scripts/fuzz.sh removes it), else (under pytest) a temporary directory removed at exit.
if os.environ.get("UOMP_FUZZ_WORK"):
    _IMPORT_DIR = Path(os.environ["UOMP_FUZZ_WORK"]) / "importer-scratch"
    _IMPORT_DIR.mkdir(parents=True, exist_ok=True)
else:
    _IMPORT_DIR = Path(tempfile.mkdtemp(prefix="uomp-fuzz-import-"))
    atexit.register(shutil.rmtree, _IMPORT_DIR, True)


def t_importer(data: bytes) -> None:
    """CSV / JSON importer: IMPORT_INVALID / INVALID_REQUEST only; nothing stored when it refuses."""
    kind = "json" if data[:1] in (b"[", b"{", b" ") else "csv"
    src = _IMPORT_DIR / f"in.{kind}"
    src.write_bytes(data)
    db = _IMPORT_DIR / "memory.db"
    store = MemoryStore(db)
    try:
        try:
            import_file(store, src, sensitivity="low")
        except UompError as exc:
            assert exc.code in ("IMPORT_INVALID", "INVALID_REQUEST"), exc.code
            assert store.count() == 0, "a refused import stored rows"
    finally:
        store.close()
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(str(db) + suffix)
            except FileNotFoundError:
                pass


TARGETS: dict[str, Callable[[bytes], None]] = {
    "token": t_token,
    "jose": t_jose,
    "dpop": t_dpop,
    "pathnorm": t_pathnorm,
    "envelope": t_envelope,
    "sealing": t_sealing,
    "merkle": t_merkle,
    "upstream": t_upstream,
    "checkpoint": t_checkpoint,
    "importer": t_importer,
}
