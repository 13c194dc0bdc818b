"""Round-trip and tamper properties of the parsers (bounded hypothesis runs).

The arbitrary-input side (only the documented error escapes) is in test_properties_fuzz_targets.py;
here valid inputs are generated and must survive a round trip, and any single change must be refused.
"""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.client import payloads
from gateway.core import capability, envelope, merkle, sealing, tokens
from gateway.errors import UompError
from gateway.remote import pathnorm

KEY = Ed25519PrivateKey.generate()
KEYS = {"k1": KEY.public_key()}
NOW = 1_780_000_000.0
PAYLOAD_KEY = X25519PrivateKey.generate()
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._:-", min_size=1, max_size=24)


def _token(read: capability.Scope, agent: str, fields: list[str] | None, agg: bool) -> str:
    claims = tokens.capability_claims(
        session_id="sess_p",
        agent_id=agent,
        now=NOW - 5,
        expires=NOW + 300,
        read=read,
        max_read_queries=5,
        allowed_fields=fields,
        aggregation_only=agg,
        audience="http://127.0.0.1:9374",
    )
    return tokens.sign_token(claims, KEY, "k1")


SCOPES = st.builds(
    lambda t, k, dt, dk: capability.Scope(tags=tuple(t), keys=tuple(k), deny_tags=tuple(dt), deny_keys=tuple(dk)),
    st.lists(NAMES, max_size=4, unique=True),
    st.lists(NAMES, max_size=4, unique=True),
    st.lists(NAMES, max_size=3, unique=True),
    st.lists(NAMES, max_size=3, unique=True),
)


@settings(max_examples=60, deadline=None)
@given(
    read=SCOPES,
    agent=NAMES,
    fields=st.none() | st.lists(st.sampled_from(["key", "value", "tags"]), unique=True),
    agg=st.booleans(),
    pos=st.integers(min_value=0),
    ch=st.sampled_from("AQgw_-0z"),
)
def test_token_round_trip_and_any_change_refused(
    read: capability.Scope, agent: str, fields: list[str] | None, agg: bool, pos: int, ch: str
) -> None:
    tok = _token(read, agent, fields, agg)
    cap = tokens.verify_token(tok, KEYS, now=NOW)
    assert (cap.read.tags, cap.read.keys, cap.agent_id, cap.aggregation_only) == (read.tags, read.keys, agent, agg)
    i = pos % len(tok)
    if tok[i] == "." or tok[i] == ch:
        return
    forged = tok[:i] + ch + tok[i + 1 :]
    try:
        got = tokens.verify_token(forged, KEYS, now=NOW)
    except UompError as exc:
        assert exc.code in ("INVALID_TOKEN", "TOKEN_EXPIRED")
    else:  # only a non-canonical base64url spelling of the same bytes may pass
        assert got == cap


@settings(max_examples=25, deadline=None)
@given(
    data=st.binary(max_size=70_000), split=st.integers(1, 70_000), fmt=st.sampled_from(["text/plain", "text/markdown"])
)
def test_payload_seal_envelope_open_round_trip(data: bytes, split: int, fmt: str) -> None:
    binding = sealing.Binding(payloads.new_payload_id(), "sess_p", "agent_p", fmt)
    env_doc = payloads.seal_small(PAYLOAD_KEY.public_key(), binding, data)
    env, text = envelope.parse(env_doc, streaming=False)
    assert envelope.decode_header(envelope.encode_header(env)) == env
    assert text is not None
    sealed = envelope.decode_ciphertext(text)
    assert sealing.ciphertext_hash(sealed) == env.hash and len(sealed) == env.size
    blocks = [sealed[j : j + split] for j in range(0, len(sealed), split)]
    assert b"".join(sealing.open_stream(PAYLOAD_KEY, env.binding(), env.encryption, blocks)) == data
    other = sealing.Binding(binding.payload_id, "sess_other", binding.agent_id, fmt)
    with pytest.raises(sealing.SealError):
        sealing.open_bytes(PAYLOAD_KEY, other, env.encryption, sealed)


@settings(max_examples=40, deadline=None)
@given(
    field=st.sampled_from(["payload_id", "session_id", "agent_id", "timestamp", "format", "size", "hash"]),
    value=st.one_of(st.text(max_size=80), st.integers(), st.none(), st.booleans(), st.lists(st.integers())),
)
def test_envelope_field_changed_is_refused_or_well_formed(field: str, value: object) -> None:
    binding = sealing.Binding(payloads.new_payload_id(), "sess_p", "agent_p", "text/plain")
    doc = payloads.seal_small(PAYLOAD_KEY.public_key(), binding, b"x")
    doc[field] = value
    try:
        env, _ = envelope.parse(doc, streaming=False)
    except UompError as exc:
        assert exc.code == "INVALID_REQUEST"
    else:
        assert getattr(env, field) == value


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), data=st.data())
def test_merkle_proofs_round_trip_and_wrong_index_refused(n: int, data: st.DataObject) -> None:
    tree = merkle.MemoryTree()
    for k in range(n):
        tree.append(merkle.leaf_hash(b"%d" % k))
    idx = data.draw(st.integers(0, n - 1))
    leaf = merkle.leaf_hash(b"%d" % idx)
    proof = tree.inclusion_proof(idx)
    merkle.verify_inclusion(idx, n, leaf, proof, tree.root())
    if n > 1:
        with pytest.raises(merkle.ProofError):
            merkle.verify_inclusion((idx + 1) % n, n, leaf, proof, tree.root())
    old = data.draw(st.integers(1, n))
    merkle.verify_consistency(old, n, tree.root(old), tree.root(), tree.consistency_proof(old, n))
    if old < n:
        with pytest.raises(merkle.ProofError):
            merkle.verify_consistency(old, n, tree.root(), tree.root(), tree.consistency_proof(old, n))


SEGMENT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x24F, exclude_characters="/"), min_size=1, max_size=12
).filter(lambda s: s not in (".", ".."))


@settings(max_examples=150, deadline=None)
@given(st.lists(SEGMENT, min_size=1, max_size=5))
def test_pathnorm_encoded_path_decodes_once_and_is_stable(segments: list[str]) -> None:
    from urllib.parse import quote

    raw = "/" + "/".join(quote(s, safe="") for s in segments)
    try:
        t = pathnorm.normalize_target(raw)
    except UompError as exc:
        assert exc.code == "INVALID_REQUEST"
        return
    assert t.segments == tuple(segments)
    again = pathnorm.normalize_target(t.upstream_target)
    assert again.upstream_target == t.upstream_target and again.segments == t.segments


def test_envelope_b64_of_wrong_length_refused() -> None:
    binding = sealing.Binding(payloads.new_payload_id(), "sess_p", "agent_p", "text/plain")
    doc = payloads.seal_small(PAYLOAD_KEY.public_key(), binding, b"x")
    doc["encryption"]["nonce"] = base64.b64encode(b"short").decode()
    with pytest.raises(UompError):
        envelope.parse(doc, streaming=False)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(NAMES, c, max_size=3),
    max_leaves=8,
)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            NAMES,
            JSON_VALUES,
            st.lists(NAMES, min_size=1, max_size=3, unique=True),
            st.sampled_from(["low", "medium", "high"]),
        ),
        min_size=1,
        max_size=6,
        unique_by=lambda r: r[0],
    )
)
def test_json_import_round_trip(
    rows: list[tuple[str, object, list[str], str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    import json

    from gateway.guard.importer import import_file
    from gateway.guard.store import MemoryStore

    d = tmp_path_factory.mktemp("imp")
    src = d / "items.json"
    src.write_text(json.dumps([{"key": k, "value": v, "tags": t, "sensitivity": s} for k, v, t, s in rows]))
    store = MemoryStore(d / "memory.db")
    try:
        import_file(store, src)
        for k, v, t, s in rows:
            item = store.get(k.strip())
            assert item is not None and item.value == v and item.sensitivity == s
            assert set(item.tags) == {x.strip() for x in t if x.strip()}
    finally:
        store.close()
