"""How fast the CA issues certificates and how many new mTLS handshakes the gateway context takes.

    .venv/bin/python benchmarks/bench_ca.py [--certs N] [--handshakes N] [--concurrency C]

Prints rates measured in this one run and ratios between them (never asserted anywhere):

* certificates per second: pure builder (CSR path: parse + verify CSR + sign; public-key path),
  and the on-disk CA (``ca_store``: file lock, registry rewrite, fsync'd atomic writes), for the
  CSR path and the key+cert path (new key, three files written);
* new mTLS handshakes per second against a local asyncio TLS server on 127.0.0.1 built with
  ``build_server_context`` (and through ``TLSReloader``'s SNI switch), client side
  ``build_client_context`` with an agent certificate; each connection completes the handshake,
  has the server run ``ClientCertChecker.check`` and send one line, and closes. Client and server
  share one process and one core, so the figure is for both ends together.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import shutil
import ssl
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from gateway import ca_store
from gateway.client.tls import build_client_context
from gateway.config import Paths
from gateway.core import ca
from gateway.remote.tls import ClientCertChecker, TLSReloader, build_server_context


def rate(n: int, fn: Callable[[int], object]) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - start)


def bench_issuance(n: int, work: Path) -> dict[str, float]:
    ca_key, ca_cert = ca.create_ca()
    keys = [ca.new_key() for _ in range(n)]
    csrs = [ca.make_csr(k, f"agent-{i}").public_bytes(serialization.Encoding.PEM) for i, k in enumerate(keys)]
    out: dict[str, float] = {}
    out["core: CSR -> cert (parse, verify, sign)"] = rate(
        n, lambda i: ca.issue_agent_cert(ca_key, ca_cert, csrs[i], f"agent-{i}")
    )
    out["core: public key -> cert (sign)"] = rate(
        n, lambda i: ca.issue_agent_cert(ca_key, ca_cert, keys[i].public_key(), f"agent-{i}")
    )
    out["core: new P-256 key + cert"] = rate(
        n, lambda i: ca.issue_agent_cert(ca_key, ca_cert, ca.new_key().public_key(), f"agent-{i}")
    )

    paths = Paths(work / "home")
    ca_store.init_all(paths)
    out["ca_store: issue_from_csr (lock, registry, fsync)"] = rate(
        n, lambda i: ca_store.issue_from_csr(paths, f"agent-{i}", csrs[i])
    )
    paths2 = Paths(work / "home2")
    ca_store.init_all(paths2)
    out["ca_store: issue_with_key (key + 3 files)"] = rate(
        n, lambda i: ca_store.issue_with_key(paths2, f"agent-{i}", work / "out" / str(i))
    )
    out["ca_store: revoke one serial (re-sign CRL)"] = rate(
        min(n, 50), lambda i: ca_store.revoke(paths, f"agent:agent-{i}")
    )
    return out


async def _serve(ctx: ssl.SSLContext) -> tuple[asyncio.Server, int]:
    checker = ClientCertChecker()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ident = checker.check(writer.get_extra_info("ssl_object").getpeercert(binary_form=True))
            writer.write(ident.agent_id.encode() + b"\n")
            await writer.drain()
        except Exception:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    return server, server.sockets[0].getsockname()[1]


async def _handshakes(ctx: ssl.SSLContext, client: ssl.SSLContext, n: int, concurrency: int) -> float:
    server, port = await _serve(ctx)
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="localhost")
            line = await reader.readline()
            if not line:
                raise RuntimeError("handshake refused")
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, ssl.SSLError):
                pass

    await asyncio.gather(*(one() for _ in range(min(20, n))))  # warm-up
    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    elapsed = time.perf_counter() - start
    server.close()
    await server.wait_closed()
    return n / elapsed


def bench_handshakes(n: int, concurrency: int, work: Path) -> dict[str, float]:
    paths = Paths(work / "tls")
    ca_store.init_all(paths)
    files = (
        ca_store.server_cert_path(paths),
        ca_store.server_key_path(paths),
        ca_store.ca_cert_path(paths),
        ca_store.crl_path(paths),
    )
    # a CRL with some entries, as after a while of use
    for i in range(50):
        ca_store.issue_from_csr(
            paths, f"old-{i}", ca.make_csr(ca.new_key(), f"old-{i}").public_bytes(serialization.Encoding.PEM)
        )
        ca_store.revoke(paths, f"agent:old-{i}")
    p256 = ca_store.issue_with_key(paths, "bench", work / "p256")
    ed = ca_store.issue_with_key(paths, "bench-ed", work / "ed", key_type="ed25519")
    client_p256 = build_client_context(files[2], p256.cert_file, p256.key_file)
    client_ed = build_client_context(files[2], ed.cert_file, ed.key_file)
    plain = build_server_context(*files)
    reloader = TLSReloader(*files)
    out: dict[str, float] = {}
    out["sequential, build_server_context, P-256 agent"] = asyncio.run(_handshakes(plain, client_p256, n, 1))
    out["sequential, TLSReloader front (SNI switch), P-256"] = asyncio.run(
        _handshakes(reloader.context, client_p256, n, 1)
    )
    out["sequential, build_server_context, Ed25519 agent"] = asyncio.run(_handshakes(plain, client_ed, n, 1))
    out[f"{concurrency} concurrent, TLSReloader front, P-256"] = asyncio.run(
        _handshakes(reloader.context, client_p256, n, concurrency)
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--certs", type=int, default=300, help="certificates per issuance measurement")
    ap.add_argument("--handshakes", type=int, default=400, help="connections per handshake measurement")
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="uomp-bench-"))
    try:
        t0 = dt.datetime.now(dt.UTC)
        print(f"UOMP CA / TLS benchmark  ({ssl.OPENSSL_VERSION}; n={args.certs} certs, {args.handshakes} handshakes)")
        print("\ncertificates issued per second")
        issued = bench_issuance(args.certs, work)
        for name, r in issued.items():
            print(f"  {name:<52} {r:9.0f} /s")
        core = issued["core: CSR -> cert (parse, verify, sign)"]
        disk = issued["ca_store: issue_from_csr (lock, registry, fsync)"]
        print(f"  ratio on-disk / pure (CSR path): {disk / core:.2f}")

        print("\nnew mTLS handshakes per second (client + server in one process)")
        hs = bench_handshakes(args.handshakes, args.concurrency, work)
        for name, r in hs.items():
            print(f"  {name:<52} {r:9.0f} /s")
        base = hs["sequential, build_server_context, P-256 agent"]
        front = hs["sequential, TLSReloader front (SNI switch), P-256"]
        print(f"  ratio reloader / plain context: {front / base:.2f}")
        print(f"\ntotal {(dt.datetime.now(dt.UTC) - t0).total_seconds():.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
