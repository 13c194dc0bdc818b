"""What token checking costs per request, in-process, one run: µs per call and the ratios.

    .venv/bin/python benchmarks/bench_tokens.py [--iterations N] [--rounds R]

Rows (each the median over ``--rounds`` of the mean over ``--iterations`` calls):

* ``tokens.verify_token``: the pure check (compact JWS parse, Ed25519 signature, claim shapes,
  ``exp``/``expires_at``): what every request would cost without a cache (the guard's
  ``AuthService.verify`` and the gateway's ``GatewayState.verify`` both cache it by token hash),
  and its parts alone: ``jose.parse_compact``, the Ed25519 signature check, ``tokens.parse_claims``;
* ``AuthService.verify``, cache warm: SHA-256 of the token + dict lookup + expiry check;
* ``AuthService.verify``, cache cold: the cache is emptied before every call (verify + insert);
* ``AuthService.authenticate``: verify (warm) + session row (SELECT + four json.loads) +
  blacklist lookup (SELECT): the guard's §10.4 steps 1-4 on every agent request;
  and its parts measured alone: ``_row`` and the blacklist query;
* ``AuthService.consume_read``: the quota step, amortised (it persists a reservation, a SQLite
  commit with synchronous=FULL, on the calling thread once per reservation block: ``limit // 64``
  within 16..4096, so every 4096 reads for this session's 10,000,000), and that commit alone.

The tokens are real ones: a session created and granted through ``AuthService`` on a throwaway
UOMP_HOME under /tmp (one local-profile token, one remote token with ``cnf`` like the gateway's).
A couple of hundred unrelated sessions and blacklisted tokens make the tables non-trivial.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import _common as c

MAX_ITERATIONS = 200_000


def per_call_us(
    fn: Callable[[], object], iterations: int | None, rounds: int, budget: float, calls: list[int]
) -> float:
    """Median over ``rounds`` of the mean µs per call; ``iterations`` None: calibrated to ``budget`` seconds.

    Appends the calls per round to ``calls``."""
    if iterations is None:
        t0 = time.perf_counter()
        k = 0
        while k < 3 or (time.perf_counter() - t0 < 0.02 and k < MAX_ITERATIONS):
            fn()
            k += 1
        per_call = (time.perf_counter() - t0) / k
        iterations = max(3, min(MAX_ITERATIONS, int(budget / rounds / per_call)))
    calls.append(iterations)
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _i in range(iterations):
            fn()
        samples.append((time.perf_counter() - t0) / iterations * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--duration",
        type=float,
        default=0.6,
        help="seconds spent per row, all rounds together (default 0.6; ~10 s in all)",
    )
    ap.add_argument("--iterations", type=int, default=None, help="fixed calls per round instead of --duration")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the median is printed (default 5)")
    ap.add_argument(
        "--clients", type=int, default=1, help="accepted for a uniform command line; in-process, one thread: always 1"
    )
    ap.add_argument("--keep", action="store_true", help="keep the throwaway UOMP_HOME")
    args = ap.parse_args()
    if not (
        0 < args.duration <= 60
        and 1 <= args.rounds <= 50
        and (args.iterations is None or 1 <= args.iterations <= MAX_ITERATIONS)
    ):
        raise SystemExit(f"--duration 0..60 s, --rounds 1..50, --iterations 1..{MAX_ITERATIONS}")
    if args.clients != 1:
        print("note: --clients is ignored (in-process measurement, one thread)")
    r = args.rounds

    from gateway.config import GuardConfig
    from gateway.core import jose, tokens
    from gateway.guard.audit import AuditLog
    from gateway.guard.auth import AuthService, token_hash

    print(f"bench_tokens: {c.machine_line()}")
    with c.bench_home(args.keep) as paths:
        cfg = GuardConfig(tcp_port=9374)
        audit = AuditLog(paths.audit_db)
        auth = AuthService(paths, cfg, audit)
        try:
            read = {"tags": ["preference"], "keys": ["user.display_name"]}
            body = {"agent_id": c.AGENT_ID, "requested_scopes": {"read": read}, "duration_minutes": 60}
            # background: other sessions, some revoked (their tokens land in the blacklist)
            for i in range(200):
                sid = auth.create_session({**body, "agent_id": f"other_{i}"})["session_id"]
                auth.grant(sid, {"granted_scopes": {"read": read}})
                if i % 2:
                    auth.revoke(sid)
            sid = auth.create_session(body)["session_id"]
            local_tok = auth.grant(sid, {"granted_scopes": {"read": read}, "limits": {"max_read_queries": 10_000_000}})[
                "token"
            ]
            sid2 = auth.create_session(body)["session_id"]
            remote_tok = auth.grant(
                sid2,
                {
                    "granted_scopes": {"read": read},
                    "profile": "remote",
                    "audience": "https://localhost:9443",
                    "cnf": {"x5t#S256": "A" * 43, "jkt": "B" * 43},
                    "limits": {"max_read_queries": 10_000_000},
                },
            )["token"]
            keys = auth.public_keys
            cap = auth.verify(local_tok)
            blacklisted = auth.db.execute("SELECT count(*) FROM token_blacklist").fetchone()[0]

            def cold() -> None:
                auth._verified.clear()
                auth.verify(local_tok)

            res: list[tuple[str, float, int]] = []

            def row(name: str, fn: Callable[[], object], iterations: int | None = args.iterations) -> None:
                calls: list[int] = []
                us = per_call_us(fn, iterations, r, args.duration, calls)
                res.append((name, us, calls[0]))

            row("tokens.verify_token (local token)", lambda: tokens.verify_token(local_tok, keys, now=time.time()))
            row(
                "tokens.verify_token (remote token, cnf)",
                lambda: tokens.verify_token(remote_tok, keys, now=time.time()),
            )
            parsed = jose.parse_compact(local_tok)
            key = keys[parsed.header["kid"]]
            row("  part: jose.parse_compact (b64 + JSON)", lambda: jose.parse_compact(local_tok))
            row("  part: Ed25519 signature check", lambda: jose.verify_signature(parsed, key))
            row("  part: tokens.parse_claims", lambda: tokens.parse_claims(parsed.header, parsed.payload))
            row("AuthService.verify, cache cold", cold)
            auth.verify(local_tok)
            row("AuthService.verify, cache warm (hit)", lambda: auth.verify(local_tok))
            row("  of which token_hash (SHA-256 hex)", lambda: token_hash(local_tok))
            row("AuthService.authenticate (warm cache)", lambda: auth.authenticate(local_tok))
            row("  part: _row (session cache hit + data_version)", lambda: auth._row(sid))
            auth.rows.enabled = False  # UOMP_SESSION_CACHE=0: the row read and decoded per request
            row("AuthService.authenticate (session cache off)", lambda: auth.authenticate(local_tok))
            row("  part: _row (SELECT session + json.loads)", lambda: auth._row(sid))
            auth.rows.enabled = True
            th = token_hash(local_tok)
            row(
                "  part: blacklist SELECT",
                lambda: auth.db.execute("SELECT 1 FROM token_blacklist WHERE token_hash=?", (th,)).fetchone(),
            )
            sess_row = auth.session(sid)
            row("AuthService.consume_read (amortised)", lambda: auth.consume_read(cap, sess_row))
            # hot-path JSON (gateway/jsonio.py): a read answer encoded, a stored value decoded
            import json

            from gateway import jsonio

            answer = {
                "key": "preference.item0001",
                "value": {"value": "setting number 1", "n": 1, "on": False},
                "tags": ["preference", "ui"],
                "updated_at": c.NOW_ISO,
                "description": "bench item 1 é",
            }
            stored = json.dumps(answer["value"])
            row(
                "JSON encode read answer: json.dumps",
                lambda: json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode(),
            )
            row("JSON encode read answer: jsonio.dumps (orjson)", lambda: jsonio.dumps(answer))
            row("JSON decode stored value: json.loads", lambda: json.loads(stored))
            row("JSON decode stored value: jsonio.loads (orjson)", lambda: jsonio.loads(stored))
            marks = iter(range(10**9, 2 * 10**9))  # a new value each time (SQLite skips no-op rewrites)
            row(
                "  one reservation commit (FULL)",
                lambda: auth._quota_persist("sess_other", next(marks)),
                None if args.iterations is None else max(1, args.iterations // 20),
            )
        finally:
            auth.close_db()
            audit.close()

    print(
        f"median of {r} rounds per row, ~{args.duration:g} s per row; {blacklisted} blacklisted tokens, "
        f"{len(local_tok)}-byte local token, {len(remote_tok)}-byte remote token\n"
    )
    w = max(len(k) for k, _, _ in res)
    print(f"{'operation':<{w}}  {'µs/call':>9}  {'calls/s':>9}  {'calls/round':>11}")
    print("-" * (w + 35))
    for name, us, calls in res:
        print(f"{name:<{w}}  {us:>9.2f}  {1e6 / us:>9.0f}  {calls:>11}")
    d = {name: us for name, us, _ in res}
    verify, warm = d["tokens.verify_token (local token)"], d["AuthService.verify, cache warm (hit)"]
    authn = d["AuthService.authenticate (warm cache)"]
    enc = d["JSON encode read answer: jsonio.dumps (orjson)"] / d["JSON encode read answer: json.dumps"]
    dec = d["JSON decode stored value: jsonio.loads (orjson)"] / d["JSON decode stored value: json.loads"]
    print(
        f"\nRATIOS verify_token / cached verify = {verify / warm:.1f}x (the cache saves {verify - warm:.1f} µs "
        f"per request); authenticate = {authn:.1f} µs/request ({authn / verify:.2f}x one verify_token); "
        f"cold/warm verify {d['AuthService.verify, cache cold'] / warm:.1f}x; authenticate session cache "
        f"on/off {authn / d['AuthService.authenticate (session cache off)']:.2f}; JSON orjson/json encode "
        f"{enc:.2f}, decode {dec:.2f}"
    )


if __name__ == "__main__":
    main()
