"""Enrollment codes that open nothing answer alike in time too: the median answer time of a used, an
expired and an other-manifest code, as ratios to a wrong code's (docs/enrollment.md), in shuffled
order. Against a running appliance on a test home (it adds codes to that home's enroll.db; set
[gateway] enroll_max_failures_per_source and enroll_max_failures high enough first):

    python benchmarks/bench_enroll_codes.py HOME https://localhost:PORT
"""

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gateway import ca_store, enrollment
from gateway.client.tls import build_client_context
from gateway.config import Paths
from gateway.core import ca, enrolment

home, url = Path(sys.argv[1]), sys.argv[2]
paths = Paths(home)
manifest = Path("examples/calendar_agent/uom.json").read_bytes()
digest = enrolment.manifest_digest(manifest)
key = ca.new_key("p256")
csr = ca.make_csr(key, "calendar_agent").public_bytes(serialization.Encoding.PEM).decode()
seal = enrolment.b64u(
    X25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
)


def body(code, m=manifest):
    return {"code": code, "manifest": m.decode(), "csr": csr, "seal_key": seal}


used = enrollment.create_invite(paths, agent_id="calendar_agent", manifest_digest=digest, gateway_url=url, seconds=600)
enrollment.redeem(
    paths,
    code=enrolment.normalize_code(used.code),
    manifest_digest=digest,
    manifest=manifest,
    csr=csr,
    seal_key=seal,
    key_fingerprint="x",
    client=None,
)
expired = enrollment.create_invite(
    paths, agent_id="calendar_agent", manifest_digest=digest, gateway_url=url, seconds=60, now=time.time() - 600
)
live = enrollment.create_invite(paths, agent_id="calendar_agent", manifest_digest=digest, gateway_url=url, seconds=600)
other = json.loads(manifest)
other["agent"]["version"] = "9.9.9"
other = json.dumps(other).encode()
cases = {
    "wrong": body("0" * 12),
    "replayed": body(enrolment.normalize_code(used.code)),
    "expired": body(enrolment.normalize_code(expired.code)),
    "other-manifest": body(enrolment.normalize_code(live.code), other),
}


async def main():
    ctx = build_client_context(ca_store.ca_cert_path(paths))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        times = {k: [] for k in cases}
        for _ in range(150):
            order = list(cases.items())
            random.shuffle(order)
            for k, b in order:
                t = time.perf_counter()
                async with s.post(url + "/v1/enroll", json=b) as r:
                    await r.read()
                    assert r.status == 403, r.status
                times[k].append(time.perf_counter() - t)
        base = statistics.median(times["wrong"])
        for k, v in times.items():
            print(f"{k:15s} median/wrong = {statistics.median(v) / base:.2f}")


asyncio.run(main())
