"""Several gateway processes behind one load balancer: the state each keeps in memory that must be
shared, kept in Redis instead (``shared_redis_url``; redis-py's asyncio client).

What must be shared, and why only this:

* **The DPoP proof replay cache** (RFC 9449 §11.1): a proof accepted by one replica must be refused
  by every other one. Each proof is ``SET <prefix>dpop:jti:<hash(jkt|jti)> 1 NX PX <ttl>``, the
  entry living until the proof would be refused as too old anyway (``iat + window``).
* **The DPoP rate per key** (``dpop_max_proofs_per_second_per_key``, the bound the in-process
  cache enforces through its partition size): a sliding window per key (a sorted set of its
  accepted proofs), so two replicas do not double it.
* Both in one Lua script (atomic, one round trip), with ``<prefix>dpop:born``: when the cache was
  (re)born. A proof issued in a second before that is refused, so a Redis that restarted empty (or
  lost its keys) does not reopen the replay window of proofs it forgot; agents' next proofs pass.
  A replica that already saw the cache and finds it gone dates the birth "now"; one that never
  saw it (a first start) dates it one rate window back, so a first deployment refuses nothing.
  What remains open: proofs of the very second of the loss, and a loss that every replica
  restarted across (docs/vps.md). Run Redis with
  ``maxmemory-policy noeviction`` (an evicted entry is a forgotten proof).

Not here, because it is already shared: session status and revocation, read quotas, refresh-token
single use (families in auth.db) and the audit log live in the one guard behind every replica; a
replica remembers a session's status for at most ``status_cache_seconds``, so a revocation holds on
every replica within that. Certificate renewal limits are counted in the CA registry (issued.db) of
the home they share.

Redis away (refused, a time-out of ``shared_timeout_seconds``, an error): fail closed for DPoP —
no proof is accepted without the shared cache (503 ``SHARED_STATE_UNAVAILABLE``, with Retry-After);
mTLS requests need no shared state and go on. Every key is under ``shared_key_prefix`` (one per
appliance sharing a Redis) and expires by itself; no token, proof or value is stored, only hashes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from gateway.core import dpop
from gateway.errors import ErrorCode, UompError
from gateway.remote.identity import verify_proof
from gateway.remote.request import Call
from gateway.remote.state import GatewayState

# One round trip, atomic: KEYS = born, rate set of this key, the proof's entry;
# ARGV = now ms, the proof's iat ms, rate window ms, rate limit, entry TTL ms, born if missing.
# -1: the proof is from a second before the cache's birth (Redis lost its data since: fail closed);
# -2: over the rate; 0: a replay; 1: accepted.
_CLAIM = """
local born = redis.call('GET', KEYS[1])
if not born then redis.call('SET', KEYS[1], ARGV[6]); born = ARGV[6] end
if math.floor(tonumber(ARGV[2]) / 1000) < math.floor(tonumber(born) / 1000) then return -1 end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[3]))
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return -2 end
if not redis.call('SET', KEYS[3], '1', 'NX', 'PX', ARGV[5]) then return 0 end
redis.call('ZADD', KEYS[2], ARGV[1], KEYS[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""
ACCEPTED, REPLAYED, OVER_RATE, PREDATES = 1, 0, -2, -1
MAX_CONNECTIONS = 64  # to Redis, per gateway process


def _unavailable() -> UompError:
    return UompError(
        ErrorCode.SHARED_STATE_UNAVAILABLE,
        "the gateways' shared state (Redis) is unreachable, so no DPoP proof can be accepted; "
        "retry shortly (operator: start Redis or fix shared_redis_url)",
    )


class SharedState:
    """The replicas' shared DPoP replay cache and per-key rate in Redis (fails closed when Redis is away)."""

    def __init__(self, url: str, *, prefix: str, timeout_seconds: float) -> None:
        self.prefix = prefix
        # a bounded pool: a request waits at most the time-out for a connection, then fails closed
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout_seconds,
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._pool = pool
        self.redis: Any = aioredis.Redis(connection_pool=pool)
        self._claim = self.redis.register_script(_CLAIM)
        self.failures = 0  # operations that found Redis away
        self.seen_born = False  # this replica has seen the cache's birth mark (so its loss is a loss)

    async def _do(self, op: Any) -> Any:
        try:
            return await op
        except (redis.exceptions.RedisError, OSError) as exc:
            self.failures += 1
            raise _unavailable() from exc

    async def claim_proof(
        self, jkt: str, replay_key: str, *, iat: float, ttl_seconds: float, limit: int, window_seconds: float
    ) -> int:
        """Record one DPoP proof for every replica: :data:`ACCEPTED`, :data:`REPLAYED`,
        :data:`OVER_RATE` (``limit`` proofs of this key in the last ``window_seconds``) or
        :data:`PREDATES` (issued before this cache was born: Redis restarted empty, and a proof
        from before could be one it has forgotten)."""
        now_ms = int(time.time() * 1000)
        n = await self._do(
            self._claim(
                keys=[
                    f"{self.prefix}dpop:born",
                    f"{self.prefix}dpop:rate:{jkt}",
                    f"{self.prefix}dpop:jti:{replay_key}",
                ],
                args=[
                    now_ms,
                    int(iat * 1000),
                    max(1000, math.ceil(window_seconds * 1000)),
                    limit,
                    max(1000, math.ceil(ttl_seconds * 1000)),
                    now_ms if self.seen_born else now_ms - max(1000, math.ceil(window_seconds * 1000)),
                ],
            )
        )
        self.seen_born = True
        return int(n)

    async def ping(self) -> bool:
        try:
            await self._do(self.redis.ping())
        except UompError:
            return False
        return True

    async def close(self) -> None:
        await self.redis.aclose()
        await self._pool.disconnect()


def install(state: GatewayState, shared: SharedState) -> None:
    """The tunnel listener's DPoP check, with the replay cache and the per-key rate in Redis."""
    cfg = state.cfg
    per_key = max(1, math.ceil(cfg.dpop_max_proofs_per_second_per_key * 2 * cfg.dpop_window_seconds))
    rate_window = 2 * cfg.dpop_window_seconds

    async def claim(result: dpop.DpopResult) -> None:
        verdict = await shared.claim_proof(
            result.jkt,
            result.replay_key,
            iat=result.iat,
            ttl_seconds=result.expires_at - time.time() + 1.0,
            limit=per_key,
            window_seconds=rate_window,
        )
        if verdict == REPLAYED:
            raise UompError(ErrorCode.DPOP_INVALID, "DPoP proof jti was already used")
        if verdict == OVER_RATE:
            raise UompError(ErrorCode.DPOP_INVALID, "too many DPoP proofs for this key; slow down")
        if verdict == PREDATES:
            raise UompError(ErrorCode.DPOP_INVALID, "DPoP proof is older than the shared replay cache; make a new one")
        if verdict != ACCEPTED:
            raise _unavailable()

    async def dpop_identity_shared(call: Call) -> None:
        result = verify_proof(call)  # nothing recorded in this process: Redis is the one cache
        # claimed once the token and the session passed their checks (a revoked agent records nothing)
        call.on_authenticated.append(lambda: claim(result))

    state.transport_auth["tunnel"] = dpop_identity_shared
