"""Cost of a DPoP proof check (EdDSA and ES256) against an EdDSA access-token check, one run.

Each DPoP iteration verifies a fresh proof (distinct ``jti``; the replay cache is part of the
cost), exactly what the tunnel listener does per request. Proof creation is done beforehand and
not timed. Prints µs per verification and the ratios; no assertion, no threshold.

    .venv/bin/python benchmarks/bench_dpop.py [iterations]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from gateway.core import capability, jose, tokens
from gateway.core.dpop import ReplayCache, make_dpop_proof, verify_dpop

URL = "https://gw.example.com/v1/memory/preference.theme"
WINDOW = 60
ROUNDS = 5


def _best_us(fn: Callable[[int], None], n: int) -> float:
    """Median over ROUNDS of the per-call time in µs (each round runs fn over n items)."""
    samples = []
    for r in range(ROUNDS):
        t0 = time.perf_counter()
        fn(r)
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    now = time.time()

    signer = ed25519.Ed25519PrivateKey.generate()
    keys: dict[str, jose.PublicKey] = {"k1": signer.public_key()}
    claims = tokens.capability_claims(
        session_id="sess_bench",
        agent_id="bench_agent",
        now=now,
        expires=now + 3600,
        read=capability.Scope(tags=("preference",)),
        profile="remote",
        cnf={"jkt": "x" * 43},
    )
    access_token = tokens.sign_token(claims, signer, "k1")

    def token_run(_: int) -> None:
        for _i in range(n):
            tokens.verify_token(access_token, keys, now=now)

    results: dict[str, float] = {"access token (EdDSA)": _best_us(token_run, n)}

    for label, agent_key in (
        ("DPoP proof (EdDSA)", ed25519.Ed25519PrivateKey.generate()),
        ("DPoP proof (ES256)", ec.generate_private_key(ec.SECP256R1())),
    ):
        jkt = jose.key_thumbprint(agent_key)
        proofs = [
            [
                make_dpop_proof(agent_key, method="GET", url=URL, access_token=access_token, now=now, jti=f"{r}-{i}")
                for i in range(n)
            ]
            for r in range(ROUNDS)
        ]
        cache = ReplayCache(ROUNDS * n + 1)

        def dpop_run(r: int, proofs: list[list[str]] = proofs, cache: ReplayCache = cache, jkt: str = jkt) -> None:
            for proof in proofs[r]:
                verify_dpop(
                    proof,
                    method="GET",
                    url=URL,
                    access_token=access_token,
                    now=now,
                    window_seconds=WINDOW,
                    replay=cache,
                    expected_jkt=jkt,
                )

        results[label] = _best_us(dpop_run, n)

    base = results["access token (EdDSA)"]
    print(f"iterations per round: {n}, rounds: {ROUNDS} (median shown)")
    for label, us in results.items():
        print(f"  {label:<22} {us:8.1f} µs/verify   {us / base:5.2f}x access-token verify")
    both = results["DPoP proof (EdDSA)"] + base
    print(f"  token + EdDSA proof per tunnel request: {both:.1f} µs ({both / base:.2f}x token alone)")


if __name__ == "__main__":
    main()
