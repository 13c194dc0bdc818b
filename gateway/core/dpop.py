"""RFC 9449 DPoP proof verification, pure.

Requests that reach the gateway through a tunnel (TLS ends at the tunnel's edge, so no client
certificate arrives) prove possession of the agent key with a ``DPoP`` header instead: a compact
JWS whose header carries the public key (``jwk``) and whose claims bind the proof to one HTTP
request (``htm``, ``htu``), one moment (``iat``), one access token (``ath``) and one use
(``jti``). The access token's ``cnf.jkt`` names the key, so a stolen token alone is useless.

:func:`verify_dpop` runs the RFC 9449 §4.3 checks in this order, each refusal a
``UompError(ErrorCode.DPOP_INVALID)`` with its own fixed message (no token, key or claim value is ever
echoed):

1. exactly one proof was presented;
2. it is a compact JWS (``jose.parse_compact``: size bound, ``alg`` EdDSA or ES256 only, so
   ``none`` and every HMAC algorithm are refused before any key is looked at; no ``crit``);
3. ``typ`` is exactly ``dpop+jwt``;
4. ``jwk`` is a public OKP/Ed25519 or EC/P-256 key with no private members, matching ``alg``;
5. the signature verifies with that key;
6. ``jti`` is a bounded non-empty string, ``htm`` equals the request method, ``htu`` equals the
   request URI after RFC 3986 §6.2.2/§6.2.3 normalisation with query and fragment ignored;
7. ``iat`` lies within ``window_seconds`` of ``now`` on either side;
8. when an access token is presented, ``ath`` is required and must equal
   base64url(SHA-256(ASCII token));
9. the RFC 7638 thumbprint of ``jwk`` equals ``expected_jkt`` (the token's ``cnf.jkt``) when
   one is given;
10. ``jti`` has not been seen for this key within the window (:class:`ReplayCache`).

Replay state is recorded only for proofs that passed every other check, so garbage cannot
fill the cache. The gateway goes further: it verifies with ``record=False`` and records the proof
(:func:`record_proof`) only after the access token and the session passed their checks, so a
revoked agent records nothing. The cache is partitioned per key (``jkt``) with a per-key bound
sized from the proof lifetime, so a key that holds a valid token can fill only its own partition.

Server-provided nonces (RFC 9449 §8, ``DPoP-Nonce``) are neither issued nor checked; the ``iat``
window plus the per-key ``jti`` cache is the replay defence. Nonces would bound how far ahead a
stolen key could pre-make proofs, but they cost every agent a ``use_dpop_nonce`` 401 and a retry
on its first request and after each rotation, need retry logic in both SDKs (ours and the
TypeScript reference one, which does not send nonces), and would not change replay protection:
a proof is already single-use and bound to one token, method, URI and minute. The cache lives in
memory, so a restart forgets it: a proof captured before a restart could be replayed within its
remaining window (at most ``2 * window_seconds`` after it was made).

The ``url`` given to :func:`verify_dpop` must be the URI the agent addressed, i.e. the public
``https://…`` URL of the tunnel, not the loopback origin the request arrived on; that mapping is
the caller's business.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import jose
from gateway.errors import ErrorCode, UompError

DPOP_TYP = "dpop+jwt"
# Upper bound on the ``jti`` claim (RFC 9449 suggests 96 bits of randomness; 16-22 chars).
MAX_JTI_LENGTH = 256
# Upper bound on ``htu`` (and on the request URL we compare it with).
MAX_HTU_LENGTH = 4096
# JWK members that only private keys (or symmetric keys) have: never acceptable in a proof.
PRIVATE_JWK_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PCT = re.compile(r"%([0-9A-Fa-f]{2})")


def _fail(message: str) -> UompError:
    return UompError(ErrorCode.DPOP_INVALID, message)


def _too_many(live: int) -> UompError:
    """A key past its share of the replay cache: a valid proof sent too fast, not a bad one (429)."""
    return UompError(
        ErrorCode.RATE_LIMITED,
        f"too many DPoP proofs from this key ({live} still live); slow down and retry in a few seconds "
        "(the gateway's [gateway] dpop_max_proofs_per_second_per_key sets the pace)",
    )


# ------------------------------------------------------------------------------ replay cache


class _Partition:
    """One key's live entries: ``key -> expires_at`` and a min-heap of expiry times."""

    __slots__ = ("expiry", "heap")

    def __init__(self) -> None:
        self.expiry: dict[str, float] = {}
        self.heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self.expiry)

    def drop_stale_top(self) -> None:
        heap, expiry = self.heap, self.expiry
        while heap and expiry.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)

    def pop_soonest(self) -> tuple[str, float] | None:
        self.drop_stale_top()
        if not self.heap:
            return None
        exp, key = heapq.heappop(self.heap)
        del self.expiry[key]
        return key, exp


class ReplayCache:
    """Bounded in-memory ``key -> expires_at`` sets for DPoP ``jti`` values, one per partition.

    A partition is one DPoP key (its RFC 7638 thumbprint ``jkt``), so one agent's proofs can never
    crowd out another's. ``check_and_add`` first drops every entry whose ``expires_at`` has
    passed, then answers ``False`` when ``key`` is still live in its partition (a replay) and
    ``True`` after recording it.

    Bounds, both failing closed for the key that hits them and for no one else:

    * ``per_key_entries`` live entries per partition: a new proof from a key whose partition is
      full is refused ("replay cache is full") rather than forgetting a live entry (which would let
      that proof be replayed). :func:`verify_dpop` records a proof until ``iat + window`` and
      ``iat`` may be up to one window ahead of ``now``, so an entry lives at most two windows: size
      it as the highest proof rate one key needs times two windows (:meth:`sized`).
    * ``max_entries`` live entries in all partitions together. When that is reached, a key holding
      at least its fair share (``max_entries`` / live partitions) is refused; a key below its
      share takes the place of the soonest-expiring entry of the largest partition. So a few keys
      at their limit never lock a quiet key out; the price is that the heaviest key's oldest
      proofs may be forgotten a little early (a replay of one of those still needs its access
      token, which is bound to that same key).

    Each entry is a fixed-size hash, whatever the ``jti`` length. Not thread-safe: meant for one
    asyncio event loop. Work per call is O(log n) amortised, plus O(live partitions) when the
    global bound is reached.
    """

    def __init__(self, max_entries: int, *, per_key_entries: int | None = None) -> None:
        if max_entries < 1 or (per_key_entries is not None and per_key_entries < 1):
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self.per_key_entries = min(per_key_entries or max_entries, max_entries)
        self._parts: dict[str, _Partition] = {}
        self._total = 0
        self._heap: list[tuple[float, str, str]] = []  # (expires_at, partition, key), for purging
        self.evicted = 0  # live entries forgotten early under the global bound

    @classmethod
    def sized(cls, *, window_seconds: float, max_entries: int, proofs_per_second_per_key: float) -> ReplayCache:
        """A cache whose partitions hold ``proofs_per_second_per_key`` for an entry's whole life
        (two windows, see the class docstring), within ``max_entries`` in all."""
        per_key = max(1, math.ceil(proofs_per_second_per_key * 2 * window_seconds))
        return cls(max_entries, per_key_entries=per_key)

    def __len__(self) -> int:
        return self._total

    def partition_size(self, partition: str) -> int:
        part = self._parts.get(partition)
        return len(part) if part is not None else 0

    @property
    def partitions(self) -> int:
        return len(self._parts)

    def _purge(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] < now:
            exp, pname, key = heapq.heappop(heap)
            part = self._parts.get(pname)
            if part is None or part.expiry.get(key) != exp:
                continue
            del part.expiry[key]
            self._total -= 1
            part.drop_stale_top()
            if not part.expiry:
                del self._parts[pname]

    def seen(self, key: str, *, now: float, partition: str = "") -> bool:
        """True when ``key`` is live in ``partition`` (a replay); records nothing."""
        self._purge(now)
        part = self._parts.get(partition)
        return part is not None and key in part.expiry

    def check_and_add(self, key: str, expires_at: float, *, now: float, partition: str = "") -> bool:
        """True: ``key`` was new and is now recorded until ``expires_at``. False: a live replay.

        Raises ``RATE_LIMITED`` when ``partition`` may not hold another live entry (fail closed).
        """
        self._purge(now)
        part = self._parts.get(partition)
        if part is not None and key in part.expiry:
            return False
        if expires_at < now:  # already outside the window: nothing to remember
            return True
        size = len(part) if part is not None else 0
        if size >= self.per_key_entries:
            raise _too_many(size)
        if self._total >= self.max_entries:
            live = len(self._parts) + (0 if part is not None else 1)
            if size >= self.max_entries / live:
                raise _too_many(size)
            largest_name = max(self._parts, key=lambda n: len(self._parts[n]))
            largest = self._parts[largest_name]
            if largest.pop_soonest() is not None:
                self._total -= 1
                self.evicted += 1
            if not largest.expiry:
                del self._parts[largest_name]
        if part is None:
            part = self._parts[partition] = _Partition()
        part.expiry[key] = expires_at
        heapq.heappush(part.heap, (expires_at, key))
        heapq.heappush(self._heap, (expires_at, partition, key))
        self._total += 1
        return True


# ------------------------------------------------------------------------------ URI matching


def _normalise_pct(text: str) -> str:
    """RFC 3986 §6.2.2.1/§6.2.2.2: upper-case hex, decode percent-encoded unreserved characters."""

    def repl(m: re.Match[str]) -> str:
        ch = chr(int(m.group(1), 16))
        return ch if ch in _UNRESERVED else "%" + m.group(1).upper()

    return _PCT.sub(repl, text)


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4, for an absolute path."""
    out: list[str] = []
    segments = path.split("/")
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == ".":
            if last:
                out.append("")
        elif seg == "..":
            if len(out) > 1:
                out.pop()
            if last:
                out.append("")
        else:
            out.append(seg)
    result = "/".join(out)
    return result if result.startswith("/") else "/" + result


def normalise_htu(url: str) -> str:
    """The comparison form of an http(s) URI: RFC 9449 §4.3 item 9 with RFC 3986 normalisation.

    Scheme and host lower-cased, default port dropped, percent-encoding normalised, dot segments
    removed, empty path made ``/``; query and fragment dropped. Raises ValueError when ``url``
    is not an absolute http(s) URI with a host and without user information.
    """
    if not isinstance(url, str) or not url or len(url) > MAX_HTU_LENGTH:
        raise ValueError("not a URI")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise ValueError("URI contains white space or control characters")
    if re.search(r"%(?![0-9A-Fa-f]{2})", url):  # a stray '%' could form a new escape (found by fuzzing)
        raise ValueError("URI has a malformed percent-encoding")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError("not an http(s) URI")
    if not parts.netloc or "@" in parts.netloc:
        raise ValueError("URI has no host or carries user information")
    host = parts.hostname  # lower-cased by urllib; IPv6 without brackets
    if not host:
        raise ValueError("URI has no host")
    port = parts.port  # raises ValueError for a malformed or out-of-range port
    if ":" in host:
        host = f"[{host}]"
    authority = host if port is None or port == _DEFAULT_PORTS[scheme] else f"{host}:{port}"
    path = _remove_dot_segments(_normalise_pct(parts.path or "/"))
    return f"{scheme}://{authority}{path}"


def htu_matches(htu: str, url: str) -> bool:
    """True when the proof's ``htu`` and the request URI name the same resource (§4.3)."""
    try:
        return normalise_htu(htu) == normalise_htu(url)
    except ValueError:
        return False


# ------------------------------------------------------------------------------ verification


@dataclass(frozen=True)
class DpopResult:
    """A verified proof: the key's RFC 7638 thumbprint, the proof's ``jti`` and ``iat``.

    ``replay_key`` and ``expires_at`` are what :func:`record_proof` stores in the replay cache.
    """

    jkt: str
    jti: str
    iat: float
    replay_key: str = ""
    expires_at: float = 0.0


def access_token_hash(access_token: str) -> str:
    """RFC 9449 ``ath``: base64url(SHA-256(ASCII octets of the access token))."""
    return jose.b64u_encode(hashlib.sha256(access_token.encode("ascii")).digest())


def _single_proof(proof: str | Sequence[str] | None) -> str:
    if proof is None:
        raise _fail("DPoP proof is missing")
    if not isinstance(proof, str):
        values = list(proof)
        if len(values) != 1:
            raise _fail("exactly one DPoP proof is required")
        proof = values[0]
    if not isinstance(proof, str) or not proof.strip():
        raise _fail("DPoP proof is missing")
    # A compact JWS never contains ',' or white space: a folded multi-value header does.
    if "," in proof or any(c.isspace() for c in proof):
        raise _fail("exactly one DPoP proof is required")
    return proof


def _header_key(header: dict[str, Any]) -> tuple[jose.PublicKey, dict[str, Any]]:
    jwk = header.get("jwk")
    if not isinstance(jwk, dict):
        raise _fail("DPoP proof header has no jwk")
    if PRIVATE_JWK_MEMBERS.intersection(jwk):
        raise _fail("DPoP proof jwk contains private key material")
    try:
        key = jose.load_public_jwk(jwk)
    except (ValueError, TypeError) as exc:
        raise _fail("DPoP proof jwk is not a supported public key") from exc
    expected_alg = "EdDSA" if isinstance(key, ed25519.Ed25519PublicKey) else "ES256"
    if header.get("alg") != expected_alg:
        raise _fail("DPoP proof alg does not match its jwk")
    return key, jwk


def _claims(payload: dict[str, Any]) -> tuple[str, str, str, float]:
    jti, htm, htu, iat = payload.get("jti"), payload.get("htm"), payload.get("htu"), payload.get("iat")
    if not isinstance(jti, str) or not jti or len(jti) > MAX_JTI_LENGTH:
        raise _fail("DPoP proof jti is missing or malformed")
    if not isinstance(htm, str) or not htm:
        raise _fail("DPoP proof htm is missing")
    if not isinstance(htu, str) or not htu:
        raise _fail("DPoP proof htu is missing")
    if isinstance(iat, bool) or not isinstance(iat, int | float) or not math.isfinite(iat):
        raise _fail("DPoP proof iat is missing or not a number")
    return jti, htm, htu, float(iat)


def verify_dpop(
    proof: str | Sequence[str] | None,
    *,
    method: str,
    url: str,
    access_token: str | None,
    now: float,
    window_seconds: int,
    replay: ReplayCache,
    expected_jkt: str | None,
    record: bool = True,
) -> DpopResult:
    """Verify one DPoP proof for one request; see the module docstring for the checks.

    ``proof`` is the ``DPoP`` header value, or the list of all of them (exactly one allowed).
    ``url`` is the request URI as the agent addressed it (query and fragment are ignored).
    Returns the verified :class:`DpopResult`; raises ``UompError(ErrorCode.DPOP_INVALID)`` otherwise.

    ``record=False`` refuses a known replay but records nothing: the caller records the proof with
    :func:`record_proof` once the token and the session behind it have passed their checks too, so
    a revoked agent (or a token that fails any later check) cannot fill the cache.
    """
    token = _single_proof(proof)
    parsed = jose.parse_compact(token, what="DPoP proof", code=ErrorCode.DPOP_INVALID)
    header, payload = parsed.header, parsed.payload
    if header.get("typ") != DPOP_TYP:
        raise _fail("DPoP proof typ must be dpop+jwt")
    if header.get("alg") not in ("EdDSA", "ES256"):  # parse_compact already refused others
        raise _fail("DPoP proof algorithm is not accepted")
    key, jwk = _header_key(header)
    if not jose.verify_signature(parsed, key):
        raise _fail("DPoP proof signature is invalid")

    jti, htm, htu, iat = _claims(payload)
    if htm != method:
        raise _fail("DPoP proof htm does not match the request method")
    if not htu_matches(htu, url):
        raise _fail("DPoP proof htu does not match the request URI")
    if iat < now - window_seconds:
        raise _fail("DPoP proof is too old")
    if iat > now + window_seconds:
        raise _fail("DPoP proof is issued in the future")

    if access_token is not None:
        ath = payload.get("ath")
        if not isinstance(ath, str) or not ath:
            raise _fail("DPoP proof ath is required with an access token")
        try:
            expected_ath = access_token_hash(access_token)
        except UnicodeEncodeError as exc:
            raise _fail("access token is not ASCII") from exc
        if not hmac.compare_digest(ath.encode("ascii", "replace"), expected_ath.encode("ascii")):
            raise _fail("DPoP proof ath does not match the access token")

    try:
        jkt = jose.jwk_thumbprint(jwk)
    except (KeyError, ValueError) as exc:  # pragma: no cover - load_public_jwk checked the members
        raise _fail("DPoP proof jwk is not a supported public key") from exc
    if expected_jkt is not None and not hmac.compare_digest(
        jkt.encode("ascii"), expected_jkt.encode("ascii", "replace")
    ):
        raise _fail("DPoP proof key does not match the token's cnf.jkt")

    # The jti is scoped by the key (jkt is base64url, so the '|' join is unambiguous) and hashed
    # so every entry has the same small size whatever the jti length. The entry lives until the
    # proof would be refused as too old anyway.
    replay_key = jose.b64u_encode(hashlib.sha256(f"{jkt}|{jti}".encode()).digest())
    result = DpopResult(jkt=jkt, jti=jti, iat=iat, replay_key=replay_key, expires_at=iat + window_seconds)
    if record:
        record_proof(replay, result, now=now)
    elif replay.seen(replay_key, now=now, partition=jkt):
        raise _fail("DPoP proof jti was already used")
    return result


def record_proof(replay: ReplayCache, result: DpopResult, *, now: float) -> None:
    """Remember a verified proof in its key's partition; DPOP_INVALID if it was used meanwhile
    (two requests racing with one proof: only the first to get here passes) or the key's
    partition is full."""
    if not replay.check_and_add(result.replay_key, result.expires_at, now=now, partition=result.jkt):
        raise _fail("DPoP proof jti was already used")


# ------------------------------------------------------------------------------ creation


def _strip_query(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(query="", fragment="").geturl()


def make_dpop_proof(
    private_key: jose.PrivateKey,
    *,
    method: str,
    url: str,
    access_token: str | None = None,
    now: float,
    jti: str | None = None,
) -> str:
    """A DPoP proof for one request (for the SDK and tests). ``htu`` is ``url`` without query
    and fragment; ``ath`` is set when ``access_token`` is given; ``iat`` is ``int(now)``."""
    header: dict[str, Any] = {"typ": DPOP_TYP, "jwk": jose.public_jwk(private_key)}
    claims: dict[str, Any] = {
        "jti": jti if jti is not None else secrets.token_urlsafe(16),
        "htm": method,
        "htu": _strip_query(url),
        "iat": int(now),
    }
    if access_token is not None:
        claims["ath"] = access_token_hash(access_token)
    return jose.sign_compact(header, claims, private_key)
