"""RFC 9449 DPoP proofs: acceptance cases and a table of named refusals with their exact error."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from gateway.core import dpop, jose
from gateway.core.dpop import (
    DpopResult,
    ReplayCache,
    access_token_hash,
    htu_matches,
    make_dpop_proof,
    normalise_htu,
    verify_dpop,
)
from gateway.errors import UompError

NOW = 1_700_000_000.0
WINDOW = 60
METHOD = "GET"
URL = "https://gw.example.com/v1/memory/preference.theme"
TOKEN = "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJ4In0.c2ln"

ED = ed25519.Ed25519PrivateKey.generate()
ED_OTHER = ed25519.Ed25519PrivateKey.generate()
EC = ec.generate_private_key(ec.SECP256R1())


def _b64json(obj: Any) -> str:
    return jose.b64u_encode(json.dumps(obj).encode())


def craft(
    key: jose.PrivateKey = ED,
    *,
    header: dict[str, Any] | None = None,
    claims: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    jwk_of: jose.PrivateKey | None = None,
) -> str:
    """A proof signed by ``key`` whose header/claims are overridden (``None`` values removed)."""
    h: dict[str, Any] = {"typ": "dpop+jwt", "jwk": jose.public_jwk(jwk_of or key)}
    h.update(header or {})
    c: dict[str, Any] = {
        "jti": "jti-1",
        "htm": METHOD,
        "htu": URL,
        "iat": int(NOW),
        "ath": access_token_hash(TOKEN),
    }
    c.update(claims or {})
    for name in drop:
        h.pop(name, None)
        c.pop(name, None)
    return jose.sign_compact({k: v for k, v in h.items() if v is not None}, c, key)


def unsigned(alg: str) -> str:
    header = {"typ": "dpop+jwt", "alg": alg, "jwk": jose.public_jwk(ED)}
    claims = {"jti": "j", "htm": METHOD, "htu": URL, "iat": int(NOW), "ath": access_token_hash(TOKEN)}
    signing_input = f"{_b64json(header)}.{_b64json(claims)}"
    sig = b""
    if alg == "HS256":
        sig = hmac.new(b"secret", signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{jose.b64u_encode(sig)}"


def verify(proof: Any, **overrides: Any) -> DpopResult:
    kwargs: dict[str, Any] = {
        "method": METHOD,
        "url": URL,
        "access_token": TOKEN,
        "now": NOW,
        "window_seconds": WINDOW,
        "replay": ReplayCache(1000),
        "expected_jkt": jose.key_thumbprint(ED),
    }
    kwargs.update(overrides)
    return verify_dpop(proof, **kwargs)


# ----------------------------------------------------------------------------- acceptance


@pytest.mark.parametrize("key", [ED, EC], ids=["EdDSA", "ES256"])
def test_valid_proof_is_accepted(key: jose.PrivateKey) -> None:
    proof = make_dpop_proof(key, method=METHOD, url=URL, access_token=TOKEN, now=NOW)
    result = verify(proof, expected_jkt=jose.key_thumbprint(key))
    assert result.jkt == jose.key_thumbprint(key)
    assert result.iat == int(NOW)
    assert result.jti


def test_proof_without_token_needs_no_ath() -> None:
    proof = make_dpop_proof(ED, method="POST", url="https://gw.example.com/v1/token", now=NOW)
    assert verify(proof, method="POST", url="https://gw.example.com/v1/token", access_token=None)


def test_make_dpop_proof_shape() -> None:
    proof = make_dpop_proof(EC, method="GET", url=URL + "?tag=x#frag", access_token=TOKEN, now=NOW, jti="abc")
    parsed = jose.parse_compact(proof)
    assert parsed.header["typ"] == "dpop+jwt" and parsed.header["alg"] == "ES256"
    assert "d" not in parsed.header["jwk"]
    assert parsed.payload == {"jti": "abc", "htm": "GET", "htu": URL, "iat": int(NOW), "ath": access_token_hash(TOKEN)}


@pytest.mark.parametrize(
    ("htu", "url"),
    [
        ("HTTPS://GW.Example.COM:443/v1/memory/preference.theme", URL),
        (URL, URL + "?tag=preference&x=1#frag"),
        ("https://gw.example.com/v1/%6demory/./x/../preference.theme", URL),
        ("http://127.0.0.1:80/a", "http://127.0.0.1/a"),
        ("https://[::1]:8443/a", "https://[::1]:8443/a"),
        ("https://gw.example.com", "https://gw.example.com/"),
        ("https://gw.example.com/a%2fb", "https://gw.example.com/a%2Fb"),
    ],
)
def test_htu_normalisation_matches(htu: str, url: str) -> None:
    assert htu_matches(htu, url)
    proof = craft(claims={"htu": htu})
    assert verify(proof, url=url)


@pytest.mark.parametrize(
    ("htu", "url"),
    [
        ("https://gw.example.com/v1/memory/other", URL),
        ("https://evil.example.com/v1/memory/preference.theme", URL),
        ("https://gw.example.com:8443/v1/memory/preference.theme", URL),
        ("http://gw.example.com/v1/memory/preference.theme", URL),
        ("https://gw.example.com/A", "https://gw.example.com/a"),  # paths are case-sensitive
        ("https://gw.example.com/a%2fb", "https://gw.example.com/a/b"),  # %2F is not '/'
        ("https://user@gw.example.com/a", "https://gw.example.com/a"),
        ("ftp://gw.example.com/a", "ftp://gw.example.com/a"),
        ("/v1/memory/preference.theme", "/v1/memory/preference.theme"),
        ("https://gw.example.com:99999/a", "https://gw.example.com:99999/a"),
    ],
)
def test_htu_mismatches(htu: str, url: str) -> None:
    assert not htu_matches(htu, url)


def test_normalise_htu_drops_query_and_default_port() -> None:
    assert normalise_htu("HTTPS://Host.Example:443?q=1#f") == "https://host.example/"


def test_iat_at_the_edges_of_the_window_is_accepted() -> None:
    assert verify(craft(claims={"iat": int(NOW) - WINDOW}))
    assert verify(craft(claims={"iat": int(NOW) + WINDOW}))


def test_same_jti_from_another_key_is_not_a_replay() -> None:
    cache = ReplayCache(10)
    verify(craft(ED), replay=cache, expected_jkt=None)
    verify(craft(ED_OTHER), replay=cache, expected_jkt=None)
    assert len(cache) == 2


# ----------------------------------------------------------------------------- refusals


@dataclass
class Case:
    name: str
    proof: Callable[[], Any]
    message: str
    overrides: dict[str, Any] = field(default_factory=dict)


REFUSALS = [
    Case("missing", lambda: None, "DPoP proof is missing"),
    Case("empty", lambda: "", "DPoP proof is missing"),
    Case("two proofs", lambda: [craft(), craft()], "exactly one DPoP proof is required"),
    Case("folded header", lambda: craft() + "," + craft(), "exactly one DPoP proof is required"),
    Case("not a JWS", lambda: "abc.def", "DPoP proof is not a compact JWS"),
    Case("garbage segments", lambda: "a.b.c", "DPoP proof is malformed"),
    Case("alg none", lambda: unsigned("none"), "DPoP proof algorithm is not accepted"),
    Case("alg HS256", lambda: unsigned("HS256"), "DPoP proof algorithm is not accepted"),
    Case(
        "crit header",
        lambda: craft(header={"crit": ["exp"]}),
        "DPoP proof has critical header parameters this server does not understand",
    ),
    Case("wrong typ", lambda: craft(header={"typ": "jwt"}), "DPoP proof typ must be dpop+jwt"),
    Case("missing typ", lambda: craft(drop=("typ",)), "DPoP proof typ must be dpop+jwt"),
    Case("typ of a refresh token", lambda: craft(header={"typ": "uomp-rt+jwt"}), "DPoP proof typ must be dpop+jwt"),
    Case("no jwk", lambda: craft(drop=("jwk",)), "DPoP proof header has no jwk"),
    Case("jwk not an object", lambda: craft(header={"jwk": "x"}), "DPoP proof header has no jwk"),
    Case(
        "jwk with d (private key)",
        lambda: craft(header={"jwk": jose.private_jwk(ED, kid="k")}),
        "DPoP proof jwk contains private key material",
    ),
    Case(
        "symmetric jwk",
        lambda: craft(header={"jwk": {"kty": "oct", "k": "c2VjcmV0"}}),
        "DPoP proof jwk contains private key material",
    ),
    Case(
        "RSA jwk",
        lambda: craft(header={"jwk": {"kty": "RSA", "n": "AQAB", "e": "AQAB"}}),
        "DPoP proof jwk is not a supported public key",
    ),
    Case(
        "EC point not on curve",
        lambda: craft(
            EC,
            header={"jwk": {**jose.public_jwk(EC), "y": jose.b64u_encode(b"\x01" * 32)}},
        ),
        "DPoP proof jwk is not a supported public key",
    ),
    Case(
        "alg does not match jwk",
        lambda: craft(EC, jwk_of=ED),
        "DPoP proof alg does not match its jwk",
    ),
    Case(
        "signed by another key than the header jwk",
        lambda: craft(ED_OTHER, jwk_of=ED),
        "DPoP proof signature is invalid",
    ),
    Case("missing jti", lambda: craft(drop=("jti",)), "DPoP proof jti is missing or malformed"),
    Case("jti not a string", lambda: craft(claims={"jti": 7}), "DPoP proof jti is missing or malformed"),
    Case("jti too long", lambda: craft(claims={"jti": "x" * 257}), "DPoP proof jti is missing or malformed"),
    Case("missing htm", lambda: craft(drop=("htm",)), "DPoP proof htm is missing"),
    Case("missing htu", lambda: craft(drop=("htu",)), "DPoP proof htu is missing"),
    Case("missing iat", lambda: craft(drop=("iat",)), "DPoP proof iat is missing or not a number"),
    Case("iat as string", lambda: craft(claims={"iat": str(int(NOW))}), "DPoP proof iat is missing or not a number"),
    Case("iat as bool", lambda: craft(claims={"iat": True}), "DPoP proof iat is missing or not a number"),
    Case("wrong htm", lambda: craft(claims={"htm": "POST"}), "DPoP proof htm does not match the request method"),
    Case("lower-case htm", lambda: craft(claims={"htm": "get"}), "DPoP proof htm does not match the request method"),
    Case(
        "wrong htu path",
        lambda: craft(claims={"htu": "https://gw.example.com/v1/memory/other"}),
        "DPoP proof htu does not match the request URI",
    ),
    Case(
        "other host",
        lambda: craft(claims={"htu": "https://evil.example.com/v1/memory/preference.theme"}),
        "DPoP proof htu does not match the request URI",
    ),
    Case(
        "other port",
        lambda: craft(claims={"htu": "https://gw.example.com:8443/v1/memory/preference.theme"}),
        "DPoP proof htu does not match the request URI",
    ),
    Case(
        "other scheme",
        lambda: craft(claims={"htu": "http://gw.example.com/v1/memory/preference.theme"}),
        "DPoP proof htu does not match the request URI",
    ),
    Case(
        "relative htu",
        lambda: craft(claims={"htu": "/v1/memory/preference.theme"}),
        "DPoP proof htu does not match the request URI",
    ),
    Case("iat too old", lambda: craft(claims={"iat": int(NOW) - WINDOW - 1}), "DPoP proof is too old"),
    Case("iat too new", lambda: craft(claims={"iat": int(NOW) + WINDOW + 1}), "DPoP proof is issued in the future"),
    Case("missing ath", lambda: craft(drop=("ath",)), "DPoP proof ath is required with an access token"),
    Case(
        "ath of another token",
        lambda: craft(claims={"ath": access_token_hash("another.token.value")}),
        "DPoP proof ath does not match the access token",
    ),
    Case(
        "ath not hashed",
        lambda: craft(claims={"ath": TOKEN}),
        "DPoP proof ath does not match the access token",
    ),
    Case(
        "non-ASCII access token",
        lambda: craft(),
        "access token is not ASCII",
        {"access_token": "tök"},
    ),
    Case(
        "jkt mismatch (token bound to another key)",
        lambda: craft(ED_OTHER),
        "DPoP proof key does not match the token's cnf.jkt",
    ),
    Case(
        "ES256 proof for an EdDSA-bound token",
        lambda: craft(EC),
        "DPoP proof key does not match the token's cnf.jkt",
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c.name for c in REFUSALS])
def test_refusal(case: Case) -> None:
    with pytest.raises(UompError) as e:
        verify(case.proof(), **case.overrides)
    assert e.value.code == "DPOP_INVALID"
    assert e.value.status == 401
    assert e.value.message == case.message


def test_refusal_messages_never_echo_the_token() -> None:
    for case in REFUSALS:
        with pytest.raises(UompError) as e:
            verify(case.proof(), **case.overrides)
        assert TOKEN not in str(e.value)


def test_replayed_jti_is_refused() -> None:
    cache = ReplayCache(100)
    proof = make_dpop_proof(ED, method=METHOD, url=URL, access_token=TOKEN, now=NOW)
    verify(proof, replay=cache)
    with pytest.raises(UompError) as e:
        verify(proof, replay=cache, now=NOW + 5)
    assert (e.value.code, e.value.message) == ("DPOP_INVALID", "DPoP proof jti was already used")


def test_replay_after_window_is_refused_as_too_old() -> None:
    cache = ReplayCache(100)
    proof = craft()
    verify(proof, replay=cache)
    with pytest.raises(UompError) as e:
        verify(proof, replay=cache, now=NOW + WINDOW + 1)
    assert e.value.message == "DPoP proof is too old"


def test_refused_proofs_do_not_enter_the_cache() -> None:
    cache = ReplayCache(100)
    with pytest.raises(UompError):
        verify(craft(claims={"htm": "POST"}), replay=cache)
    assert len(cache) == 0


def test_cache_full_refuses_new_proofs_then_recovers() -> None:
    cache = ReplayCache(2)
    verify(craft(claims={"jti": "a"}), replay=cache)
    verify(craft(claims={"jti": "b"}), replay=cache)
    with pytest.raises(UompError) as e:
        verify(craft(claims={"jti": "c"}), replay=cache)
    assert e.value.code == "RATE_LIMITED" and "too many DPoP proofs from this key" in e.value.message
    # A replay of a live entry is still recognised as a replay, not forgotten.
    with pytest.raises(UompError) as e:
        verify(craft(claims={"jti": "a"}), replay=cache)
    assert e.value.message == "DPoP proof jti was already used"
    # Once the first entries expire, room is made by evicting them.
    later = NOW + WINDOW + 1
    verify(craft(claims={"jti": "c", "iat": int(later)}), replay=cache, now=later)
    assert len(cache) == 1


# ----------------------------------------------------------------------------- ReplayCache


def test_replay_cache_basics() -> None:
    cache = ReplayCache(3)
    assert cache.check_and_add("k1", 110.0, now=100.0)
    assert not cache.check_and_add("k1", 110.0, now=105.0)
    assert not cache.check_and_add("k1", 110.0, now=110.0)  # still live at its expiry instant
    assert cache.check_and_add("k1", 130.0, now=111.0)  # expired, so new again
    assert len(cache) == 1


def test_replay_cache_evicts_expired_before_refusing() -> None:
    cache = ReplayCache(2)
    assert cache.check_and_add("a", 10.0, now=0.0)
    assert cache.check_and_add("b", 50.0, now=0.0)
    with pytest.raises(UompError):
        cache.check_and_add("c", 50.0, now=5.0)
    assert cache.check_and_add("c", 50.0, now=11.0)  # "a" expired and was evicted
    assert not cache.check_and_add("b", 50.0, now=11.0)
    assert len(cache) == 2


def test_replay_cache_ignores_already_expired_entries() -> None:
    cache = ReplayCache(1)
    assert cache.check_and_add("old", 5.0, now=10.0)
    assert len(cache) == 0


def test_replay_cache_rejects_bad_size() -> None:
    with pytest.raises(ValueError):
        ReplayCache(0)


# ------------------------------------------------------------- partitions


def test_partition_size_comes_from_the_proof_lifetime() -> None:
    cache = ReplayCache.sized(window_seconds=60, max_entries=100_000, proofs_per_second_per_key=50)
    assert cache.per_key_entries == 50 * 2 * 60  # an entry lives up to two windows
    assert ReplayCache.sized(window_seconds=60, max_entries=10, proofs_per_second_per_key=50).per_key_entries == 10


def test_one_key_filling_its_partition_does_not_lock_out_another() -> None:
    cache = ReplayCache(1000, per_key_entries=3)
    for jti in "abc":
        verify(craft(claims={"jti": jti}), replay=cache)
    with pytest.raises(UompError) as e:
        verify(craft(claims={"jti": "d"}), replay=cache)
    assert e.value.code == "RATE_LIMITED" and "slow down" in e.value.message
    # another key is untouched, and a replay is still a replay on both
    other = make_dpop_proof(ED_OTHER, method=METHOD, url=URL, access_token=TOKEN, now=NOW)
    verify(other, replay=cache, expected_jkt=jose.key_thumbprint(ED_OTHER))
    for proof, jkt in ((craft(claims={"jti": "a"}), jose.key_thumbprint(ED)), (other, jose.key_thumbprint(ED_OTHER))):
        with pytest.raises(UompError) as e:
            verify(proof, replay=cache, expected_jkt=jkt)
        assert e.value.message == "DPoP proof jti was already used"


@pytest.mark.parametrize(
    ("held", "newcomer_size", "accepted"),
    [
        pytest.param({"a": 5, "b": 5}, 0, True, id="new key below its share takes the oldest of the largest"),
        pytest.param({"a": 6, "b": 4}, 4, True, id="small key below its share"),
        pytest.param({"a": 5, "b": 5}, 5, False, id="key at its fair share is refused"),
    ],
)
def test_global_bound_is_shared_fairly(held: dict[str, int], newcomer_size: int, accepted: bool) -> None:
    cache = ReplayCache(10 + newcomer_size, per_key_entries=10)
    for part, n in held.items():
        for i in range(n):
            assert cache.check_and_add(f"{part}{i}", 100.0 + i, now=0.0, partition=part)
    for i in range(newcomer_size):
        assert cache.check_and_add(f"c{i}", 100.0, now=0.0, partition="c")
    assert len(cache) == cache.max_entries
    if accepted:
        assert cache.check_and_add("new", 100.0, now=0.0, partition="c")
        assert len(cache) == cache.max_entries and cache.evicted == 1
        assert cache.partition_size("a") == held["a"] - 1  # the largest partition gave its soonest entry
        assert cache.seen("a1", now=0.0, partition="a") and not cache.seen("a0", now=0.0, partition="a")
    else:
        with pytest.raises(UompError) as e:
            cache.check_and_add("new", 100.0, now=0.0, partition="c")
        assert e.value.code == "RATE_LIMITED"


def test_verify_without_recording_refuses_a_replay_but_records_nothing() -> None:
    cache = ReplayCache(10)
    result = verify(craft(), replay=cache, record=False)
    assert len(cache) == 0
    dpop.record_proof(cache, result, now=NOW)
    with pytest.raises(UompError) as e:
        verify(craft(), replay=cache, record=False)
    assert e.value.message == "DPoP proof jti was already used"
    with pytest.raises(UompError):  # two requests racing with one proof: the second to record loses
        dpop.record_proof(cache, result, now=NOW)


def test_partitions_disappear_when_their_entries_expire() -> None:
    cache = ReplayCache(100, per_key_entries=10)
    for p in ("a", "b", "c"):
        cache.check_and_add("k", 10.0, now=0.0, partition=p)
    assert cache.partitions == 3
    cache.check_and_add("k", 50.0, now=11.0, partition="d")
    assert (cache.partitions, len(cache)) == (1, 1)
