"""The §18.4.1 byte encodings (docs/anchoring.md), the Anchor value and what it refuses."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import pytest
from anchorkit import sample_anchor, signed_note
from eth_abi import encode as abi_encode

from gateway.anchor import encoding as enc
from gateway.anchor.base import (
    MAX_EVENTS_PER_ANCHOR,
    Anchor,
    AnchorBackend,
    GatewayAccess,
    SessionGranted,
    SessionRevoked,
    redact_url,
)
from gateway.errors import UompError

DOC = Path(__file__).resolve().parents[2] / "docs" / "anchoring.md"

# The worked example of docs/anchoring.md, word by word.
SESSION_ENCODING = (
    "0000000000000000000000000000000000000000000000000000000000000060"
    "00000000000000000000000000000000000000000000000000000000000000a0"
    "00000000000000000000000000000000000000000000000000000000000000e0"
    "000000000000000000000000000000000000000000000000000000000000000b"
    "736573735f616263313233000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000e"
    "63616c656e6461725f6167656e74000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000013"
    "5b22707265666572656e6365222c227569225d00000000000000000000000000"
)
SESSION_HASH = "a457e96643532ab50c4c66041405ebc2cfdd5130d365bab33d7c69d16845a867"
AGENT_HASH = "9378505e0bcce13900275a00e04156dfecdb2590875a0e02d2bcf4938c3936fa"
ENDPOINT_HASH = "8d37b6903c74a3be572ebb0ca9f316ad8208586ff7e3a840fee35aabb4d8879a"
PAYLOAD_HASH = "ae4b3280e56e2faf83f414a6e3dabe9d5fbe18976544c05fed121accb85b53fc"
DELETION_ENCODING = (
    "0000000000000000000000000000000000000000000000000000000000000060"
    "00000000000000000000000000000000000000000000000000000000000000a0"
    "00000000000000000000000000000000000000000000000000000000000000e0"
    "0000000000000000000000000000000000000000000000000000000000000007"
    "64656c5f78787800000000000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000b"
    "736573735f616263313233000000000000000000000000000000000000000000"
    "000000000000000000000000000000000000000000000000000000000000000d"
    "7368613235363a61626331323300000000000000000000000000000000000000"
)
DELETION_HASH = "c133153c5420f5ff591a15c3cbe0745c50adfed986f2f0cfe0d98abc8236f5ed"


def test_keccak_is_ethereums_not_sha3() -> None:
    assert enc.keccak256(b"").hex() == "c5d2460186f7233c927e7db2dcc703c0e500b653ca82273b7bfad8045d85a470"
    assert enc.keccak256(b"").hex() != hashlib.sha3_256(b"").hexdigest()


def test_worked_example_session_hash() -> None:
    tags = ["ui", "preference", "ui"]  # order and duplicates do not matter
    assert enc.granted_tags_json(tags) == b'["preference","ui"]'
    raw = enc.abi_encode_strings(b"sess_abc123", b"calendar_agent", enc.granted_tags_json(tags))
    assert raw.hex() == SESSION_ENCODING
    assert enc.keccak256(raw).hex() == SESSION_HASH
    assert enc.session_hash("sess_abc123", "calendar_agent", tags).hex() == SESSION_HASH
    assert enc.session_hash("sess_abc123", "calendar_agent", ["preference", "ui"]).hex() == SESSION_HASH


def test_worked_example_other_hashes() -> None:
    assert enc.agent_hash("calendar_agent").hex() == AGENT_HASH
    assert enc.endpoint_hash("/v1/memory/{key}").hex() == ENDPOINT_HASH
    assert enc.payload_hash(b"\x00\x01\x02").hex() == PAYLOAD_HASH
    raw = enc.abi_encode_strings(b"del_xxx", b"sess_abc123", b"sha256:abc123")
    assert raw.hex() == DELETION_ENCODING
    assert enc.deletion_proof_hash("del_xxx", "sess_abc123", "sha256:abc123").hex() == DELETION_HASH


def test_the_doc_shows_the_same_hex() -> None:
    words = "".join(re.findall(r"\b[0-9a-f]{64}\b", DOC.read_text()))
    for value in (
        SESSION_ENCODING,
        SESSION_HASH,
        AGENT_HASH,
        ENDPOINT_HASH,
        PAYLOAD_HASH,
        DELETION_ENCODING,
        DELETION_HASH,
    ):
        assert value in words


@pytest.mark.parametrize(
    "values",
    [
        ("", "", ""),
        ("a", "", "bc"),
        ("x" * 31, "y" * 32, "z" * 33),
        ("ünïcödé", "エージェント", "🙂"),
        ("sess_" + "9" * 200, "agent", '["a"]'),
    ],
    ids=["empty", "short", "word-boundaries", "non-ascii", "long"],
)
def test_abi_encoding_matches_eth_abi(values: tuple[str, str, str]) -> None:
    ours = enc.abi_encode_strings(*(v.encode() for v in values))
    assert ours == abi_encode(["string", "string", "string"], list(values))


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (("ab", "c", "[]"), ("a", "bc", "[]")),
        (("sess_1", "agent", '["x"]'), ("sess_1agent", "", '["x"]')),
        (("s", "a\x00", "[]"), ("s", "a", "\x00[]")),
    ],
    ids=["shifted-boundary", "merged-fields", "nul-padding"],
)
def test_session_encoding_is_injective_where_plain_concatenation_is_not(
    left: tuple[str, str, str], right: tuple[str, str, str]
) -> None:
    assert "".join(left) == "".join(right)  # a plain || would collide
    a = enc.abi_encode_strings(*(v.encode() for v in left))
    b = enc.abi_encode_strings(*(v.encode() for v in right))
    assert a != b and enc.keccak256(a) != enc.keccak256(b)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: enc.endpoint_hash("/v1/memory?tag=portfolio"), "route template"),
        (lambda: enc.endpoint_hash("/v1/memory/preference%2Etheme"), "route template"),
        (lambda: enc.endpoint_hash("/v1/memory#x"), "route template"),
        (lambda: enc.endpoint_hash("v1/memory"), "route template"),
        (lambda: enc.agent_hash("agent\ud800"), "lone surrogate"),
        (lambda: enc.session_hash("s" * 5000, "a", []), "longer than"),
        (lambda: enc.session_hash("s", "a", ["t"] * 2000), "more than"),
        (lambda: enc.session_hash("s", "a", ["\udfff"]), "lone surrogate"),
    ],
    ids=[
        "query",
        "percent-encoded",
        "fragment",
        "relative",
        "surrogate-agent",
        "long-session",
        "too-many-tags",
        "surrogate-tag",
    ],
)
def test_encoding_refusals(call: object, message: str) -> None:
    with pytest.raises((ValueError, UompError), match=message):
        call()  # type: ignore[operator]


def test_anchor_from_a_signed_checkpoint_note() -> None:
    root = hashlib.sha256(b"r").digest()
    note = signed_note(42, root)
    a = Anchor.for_checkpoint(note)
    assert (a.root, a.tree_size, a.checkpoint_hash) == (root, 42, hashlib.sha256(note.encode()).digest())
    assert a.anchor_id == a.checkpoint_hash and a.event_count == 0


H = b"\x11" * 32


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Anchor(b"\x00" * 31, 1, H), "root must be 32 bytes"),
        (lambda: Anchor(H, 1, b"\x00" * 33), "checkpoint_hash must be 32 bytes"),
        (lambda: Anchor(H, -1, H), "uint64"),
        (lambda: Anchor(H, 1 << 64, H), "uint64"),
        (lambda: Anchor(H, True, H), "integer"),
        (lambda: Anchor(H, 1, H, granted=[SessionGranted(H, H, 1)]), "tuple of SessionGranted"),  # type: ignore[arg-type]
        (lambda: Anchor(H, 1, H, granted=(SessionRevoked(H, H),)), "tuple of SessionGranted"),  # type: ignore[arg-type]
        (lambda: Anchor(H, 1, H, revoked=(SessionRevoked(H, H),) * (MAX_EVENTS_PER_ANCHOR + 1)), "more than"),
        (lambda: SessionGranted(H, H, -1), "expires_at"),
        (lambda: SessionGranted(H, H, 1 << 64), "expires_at"),
        (lambda: GatewayAccess(H, H, H, 1), "bool"),  # type: ignore[arg-type]
        (lambda: SessionRevoked("ab" * 16, H), "session_hash"),  # type: ignore[arg-type]
        (lambda: Anchor.for_checkpoint("origin\n12\nroot\n"), "not a signed checkpoint"),
        (lambda: Anchor.for_checkpoint(signed_note(5, H).replace("\n5\n", "\n05\n")), "decimal"),
        (lambda: Anchor.for_checkpoint(signed_note(5, H).replace("\n5\n", "\n-5\n")), "decimal"),
        (lambda: Anchor.for_checkpoint(signed_note(5, b"\x01" * 31)), "root must be 32 bytes"),
    ],
    ids=[
        "short-root",
        "long-checkpoint-hash",
        "negative-size",
        "size-over-uint64",
        "bool-size",
        "list-not-tuple",
        "wrong-kind",
        "too-many-events",
        "negative-expiry",
        "huge-expiry",
        "allowed-not-bool",
        "hex-string-hash",
        "note-without-signature",
        "leading-zero-size",
        "negative-note-size",
        "short-note-root",
    ],
)
def test_anchor_refusals(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_anchor_is_frozen_and_hashable() -> None:
    a = sample_anchor(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.root = H  # type: ignore[misc]
    assert hash(a) == hash(dataclasses.replace(a))


def test_backends_satisfy_the_protocol() -> None:
    from gateway.anchor.none import NoneBackend

    assert isinstance(NoneBackend(), AnchorBackend)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://mainnet.example/v3/0123456789abcdef", "https://mainnet.example"),
        ("http://user:pass@127.0.0.1:8545/?key=s3cret", "http://127.0.0.1:8545"),
        ("http://[::1]:99999/x", "<invalid url>"),
    ],
    ids=["path-key", "userinfo-and-query", "bad-port"],
)
def test_rpc_urls_are_redacted(url: str, shown: str) -> None:
    assert redact_url(url) == shown
