"""Payload sealing (HPKE-wrapped file key, key commitment, 64 KiB STREAM): round trips at every
chunk boundary, every way to tamper refused, and our committed fixed vectors reproduced."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gateway.core import hpke, sealing
from gateway.core.sealing import CHUNK, PREFIX_LEN, TAG, Binding, SealError

SK = X25519PrivateKey.generate()
PK = SK.public_key()
B = Binding("pay_0001", "sess_a", "agent_a", "text/markdown")
VECTORS = Path(__file__).parents[1] / "vectors" / "payload-v1.json"


def _data(n: int) -> bytes:
    return random.Random(n).randbytes(n)


@pytest.mark.parametrize("size", [0, 1, 100, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 17])
def test_round_trip_at_chunk_boundaries(size: int) -> None:
    data = _data(size)
    enc, sealed = sealing.seal_bytes(PK, B, data)
    chunks = max(1, -(-size // CHUNK))
    assert len(sealed) == PREFIX_LEN + size + chunks * TAG
    assert sealing.open_bytes(SK, B, enc, sealed) == data
    # Streamed in awkward block sizes, both ways.
    s = sealing.Sealer(PK, B)
    rng = random.Random(size)
    parts, at = [s.prefix], 0
    while at < size:
        n = rng.randint(1, 3 * CHUNK)
        parts.append(s.update(data[at : at + n]))
        at += n
    parts.append(s.finish())
    streamed = b"".join(parts)
    blocks = [streamed[i : i + 777] for i in range(0, len(streamed), 777)]
    assert b"".join(sealing.open_stream(SK, B, s.encryption(), blocks)) == data


def _split(sealed: bytes) -> tuple[bytes, list[bytes]]:
    body = sealed[PREFIX_LEN:]
    return sealed[:PREFIX_LEN], [body[i : i + CHUNK + TAG] for i in range(0, len(body), CHUNK + TAG)]


def _flip(b: bytes, i: int) -> bytes:
    return b[:i] + bytes([b[i] ^ 0x20]) + b[i + 1 :]


DATA = _data(3 * CHUNK + 5)
ENC, SEALED = sealing.seal_bytes(PK, B, DATA)
PREFIX, CHUNKS = _split(SEALED)
OTHER_ENC, OTHER = sealing.seal_bytes(PK, B, _data(3 * CHUNK + 5))


@pytest.mark.parametrize(
    "sealed",
    [
        pytest.param(PREFIX + b"".join(CHUNKS[:-1]), id="final-chunk-dropped"),
        pytest.param(SEALED[:-1], id="cut-mid-chunk"),
        pytest.param(SEALED[: PREFIX_LEN + 10], id="cut-in-first-chunk"),
        pytest.param(SEALED[: PREFIX_LEN - 1], id="cut-in-key-block"),
        pytest.param(PREFIX + CHUNKS[1] + CHUNKS[0] + CHUNKS[2] + CHUNKS[3], id="reordered"),
        pytest.param(PREFIX + CHUNKS[0] + CHUNKS[0] + CHUNKS[1] + CHUNKS[2] + CHUNKS[3], id="duplicated"),
        pytest.param(PREFIX + CHUNKS[0] + CHUNKS[2] + CHUNKS[3], id="middle-dropped"),
        pytest.param(PREFIX + CHUNKS[0] + _split(OTHER)[1][1] + CHUNKS[2] + CHUNKS[3], id="chunk-from-other-payload"),
        pytest.param(SEALED + b"\x00", id="trailing-byte"),
        pytest.param(SEALED + CHUNKS[3], id="final-chunk-twice"),
        pytest.param(_flip(SEALED, 3), id="flip-wrapped-key"),
        pytest.param(_flip(SEALED, sealing.WRAPPED_LEN + 1), id="flip-commitment"),
        pytest.param(_flip(SEALED, PREFIX_LEN + 5), id="flip-body"),
        pytest.param(_flip(SEALED, len(SEALED) - 1), id="flip-last-tag"),
        pytest.param(OTHER[:PREFIX_LEN] + SEALED[PREFIX_LEN:], id="key-block-from-other-payload"),
    ],
)
def test_tampered_payloads_do_not_open(sealed: bytes) -> None:
    with pytest.raises(SealError):
        sealing.open_bytes(SK, B, ENC, sealed)
    with pytest.raises(SealError):
        b"".join(sealing.open_stream(SK, B, ENC, [sealed[i : i + 1000] for i in range(0, len(sealed), 1000)]))


@pytest.mark.parametrize(
    "binding",
    [
        Binding("pay_0002", "sess_a", "agent_a", "text/markdown"),
        Binding("pay_0001", "sess_b", "agent_a", "text/markdown"),
        Binding("pay_0001", "sess_a", "agent_b", "text/markdown"),
        Binding("pay_0001", "sess_a", "agent_a", "application/json"),
    ],
    ids=["other-payload-id", "other-session", "other-agent", "other-format"],
)
def test_binding_is_enforced(binding: Binding) -> None:
    with pytest.raises(SealError):
        sealing.open_bytes(SK, binding, ENC, SEALED)


def test_wrong_key_and_bad_headers() -> None:
    with pytest.raises(SealError):
        sealing.open_bytes(X25519PrivateKey.generate(), B, ENC, SEALED)
    for bad in [
        {**ENC, "algorithm": "ECDH-X25519-AES256GCM"},
        {**ENC, "nonce": "AAAA"},
        {**ENC, "sender_public_key": OTHER_ENC["sender_public_key"]},
        {**ENC, "nonce": OTHER_ENC["nonce"]},
        {k: v for k, v in ENC.items() if k != "nonce"},
        {**ENC, "nonce": "!!"},
    ]:
        with pytest.raises(SealError):
            sealing.open_bytes(SK, B, bad, SEALED)


def test_empty_final_chunk_after_full_chunk_refused() -> None:
    # A sealer never writes it; a forger that drops the real final chunk must not pass off an empty one.
    s = sealing.Sealer(PK, B)
    full = s.prefix + s._seal(_data(CHUNK), last=False) + s._seal(b"", last=True)
    with pytest.raises(SealError):
        sealing.open_bytes(SK, B, s.encryption(), full)


def _vector_inputs(v: dict[str, str]) -> tuple[X25519PrivateKey, sealing.Sealer, bytes]:
    sk = hpke.derive_key_pair(bytes.fromhex(v["recipient_ikm"]))
    eph = hpke.derive_key_pair(bytes.fromhex(v["ephemeral_ikm"]))
    b = Binding(v["payload_id"], v["session_id"], v["agent_id"], v["format"])
    s = sealing.Sealer(
        sk.public_key(), b, file_key=bytes.fromhex(v["file_key"]), nonce=bytes.fromhex(v["nonce"]), eph=eph
    )
    return sk, s, bytes.fromhex(v["plaintext"]) if "plaintext" in v else b"\x5a" * int(v["plaintext_len"])


def test_fixed_vectors() -> None:
    vectors = json.loads(VECTORS.read_text())
    assert len(vectors) >= 3
    for v in vectors:
        sk, s, pt = _vector_inputs(v)
        sealed = s.prefix + s.update(pt) + s.finish()
        assert s.encryption() == v["encryption"], v["name"]
        assert sealing.ciphertext_hash(sealed) == v["hash"], v["name"]
        if "ciphertext" in v:
            assert base64.b64encode(sealed).decode() == v["ciphertext"], v["name"]
        b = Binding(v["payload_id"], v["session_id"], v["agent_id"], v["format"])
        assert sealing.open_bytes(sk, b, v["encryption"], sealed) == pt
