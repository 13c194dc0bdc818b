"""New mTLS connections: what a handshake costs the gateway, by key type, CRL size and resumption.

    .venv/bin/python benchmarks/bench_handshake.py [--handshakes N] [--crl-sizes 0,1000,10000]
        [--e2e-seconds S] [--e2e-clients N] [--no-e2e]

Part 1, in this process, no sockets (OpenSSL over memory BIOs, the product's contexts:
``TLSReloader`` with its SNI switch on the server side, ``build_client_context`` on the client
side): the **server side's** CPU per handshake (µs, the time spent in the server's
``do_handshake`` calls only; the client's share is timed apart), for

* the user CA + gateway key and the agent key each ECDSA P-256, Ed25519 or RSA-2048 (the product's
  CA makes P-256 by default and supports Ed25519; RSA agent certificates are built here by hand
  with the same extensions, only to see what a client with an RSA key would cost);
* a full handshake and a resumed one (TLS 1.3 PSK + ECDHE, the ticket from the full one);
* CRLs of 0 / 1,000 / 10,000 revoked serials: the full handshake (no CRL lookup in it since the
  gateway judges revocation after the handshake), the
  reload of the CRL (``TLSReloader.reload``: parse + context build) and the per-request check of
  a serial against the revoked set (``ClientCertChecker.check(trust=...)``).

Part 2, end to end (unless ``--no-e2e``): the appliance as ``uomp gateway start`` lays it out
(``_common.start_server``), two of them: tickets on (the default) and tickets off; ``--e2e-clients``
client *processes* (stdlib ``ssl`` sockets: the only Python client that can offer a session) each
loop ``connect + TLS 1.3 mTLS handshake + GET /v1/health (Connection: close) + close``, rounds
alternated: (a) tickets-off appliance, full handshakes (what every connection cost before);
(b) tickets-on appliance, full handshakes (clients offer nothing); (c) tickets-on, clients offer
the last session (returning agents). Connections per second and the gateway process's CPU per
connection, in the same run; the ratio (c)/(a) is the issue's "new connections >= 2x" aim for
returning agents, (b)/(a) says what tickets cost a client that never resumes.

``--baseline PATH`` replaces part 2 with the comparison the issue asks for: this tree's appliance
and one started from another checkout (e.g. the code when issue 13 was filed, 8be383b): its own
``benchmarks/_common.py serve`` with ``PYTHONPATH=PATH`` (its home, CA and agent made by its own
code too; the ``gateway`` module each side imports is printed). Rounds alternate the trees and,
in each, the same client processes with and without resumption (a client offers the last session;
a tree without tickets gives it a full handshake); then keep-alive ``GET /v1/memory/<key>`` through
each gateway (``--ka-clients`` connections, ``_common.run_load``) and the gateway process's RSS per
idle keep-alive mTLS connection (``--idle``). ``--asyncio-too``: a third appliance, this tree on
asyncio's loop (``UOMP_UVLOOP=0``: no native TLS), to tell the loop's share from the rest.
``--floor``: also a bare TLS server (the product's ``TLSReloader`` context on the loop's own TLS
server, a fixed answer, no aiohttp): what TLS and the event loop alone cost per connection.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import _common as c
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.client.tls import build_client_context
from gateway.core import ca
from gateway.remote.tls import ClientCertChecker, TLSReloader

KEYS = ("p256", "ed25519", "rsa2048")


def _new_key(kind: str) -> Any:
    if kind == "rsa2048":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return ca.new_key(kind)  # type: ignore[arg-type]


def _rsa_cert(ca_key: Any, ca_cert: x509.Certificate, pub: Any, *, agent_id: str | None) -> x509.Certificate:
    """An RSA-key certificate with the extensions the product's CA writes (benchmark only)."""
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, agent_id or "UOMP gateway")]))
        .issuer_name(ca_cert.subject)
        .public_key(pub)
        .serial_number(ca.random_serial())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    )
    if agent_id:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False).add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(ca.AGENT_URI_PREFIX + agent_id)]),
            critical=False,
        )
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False).add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
        )
    algo = (
        None
        if ca_key.__class__.__name__.startswith("_Ed25519") or "Ed25519" in type(ca_key).__name__
        else hashes.SHA256()
    )
    return b.sign(ca_key, algo)


def _pem_key(key: Any) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class Setup:
    """CA, gateway certificate and key, CRL (n revoked serials), one agent certificate, on disk."""

    def __init__(self, work: Path, server_kind: str, agent_kind: str, crl_size: int, tickets: int = 1) -> None:
        d = Path(tempfile.mkdtemp(prefix=f"{server_kind}-{agent_kind}-{crl_size}-", dir=work))
        ca_kind = "p256" if server_kind == "rsa2048" else server_kind
        ca_key, ca_cert = ca.create_ca(key_type=ca_kind)  # type: ignore[arg-type]
        skey = _new_key(server_kind)
        scert = (
            _rsa_cert(ca_key, ca_cert, skey.public_key(), agent_id=None)
            if server_kind == "rsa2048"
            else ca.issue_server_cert(ca_key, ca_cert, skey.public_key(), ["localhost"])
        )
        akey = _new_key(agent_kind)
        acert = (
            _rsa_cert(ca_key, ca_cert, akey.public_key(), agent_id="bench")
            if agent_kind == "rsa2048"
            else ca.issue_agent_cert(ca_key, ca_cert, akey.public_key(), "bench")
        )
        self.ca_key, self.ca_cert, self.dir = ca_key, ca_cert, d
        then = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
        self.revoked = [(ca.random_serial(), then) for _ in range(crl_size)]
        files = {
            "ca.crt": ca.cert_pem(ca_cert),
            "gw.crt": ca.cert_pem(scert),
            "gw.key": _pem_key(skey),
            "agent.crt": ca.cert_pem(acert),
            "agent.key": _pem_key(akey),
            "crl.pem": ca.crl_pem(ca.build_crl(ca_key, ca_cert, self.revoked)),
        }
        for name, data in files.items():
            (d / name).write_bytes(data)
            os.chmod(d / name, 0o600)
        self.reloader = TLSReloader(d / "gw.crt", d / "gw.key", d / "ca.crt", d / "crl.pem", session_tickets=tickets)
        self.client = build_client_context(d / "ca.crt", d / "agent.crt", d / "agent.key")
        self.agent_der = acert.public_bytes(serialization.Encoding.DER)


def handshake(setup: Setup, session: ssl.SSLSession | None = None) -> tuple[float, float, ssl.SSLSession | None, bool]:
    """One handshake over memory BIOs: (server seconds, client seconds, the session, resumed)."""
    sin, sout, cin, cout = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    srv = setup.reloader.context.wrap_bio(sin, sout, server_side=True)
    cli = setup.client.wrap_bio(cin, cout, server_hostname="localhost", session=session)
    ts = tc = 0.0
    done_c = done_s = False
    for _ in range(10):
        t0 = time.perf_counter()
        try:
            cli.do_handshake()
            done_c = True
        except ssl.SSLWantReadError:
            pass
        t1 = time.perf_counter()
        sin.write(cout.read())
        try:
            srv.do_handshake()
            done_s = True
        except ssl.SSLWantReadError:
            pass
        t2 = time.perf_counter()
        cin.write(sout.read())
        tc += t1 - t0
        ts += t2 - t1
        if done_c and done_s:
            break
    if not (done_c and done_s):
        raise SystemExit("handshake did not complete")
    # the ticket travels after the handshake: one byte of application data brings it over
    t0 = time.perf_counter()
    srv.write(b"x")
    ts += time.perf_counter() - t0
    cin.write(sout.read())
    cli.read(1)
    return ts, tc, cli.session, srv.session_reused


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def part1(args: argparse.Namespace, work: Path) -> None:
    n = args.handshakes
    print(
        f"\npart 1: in-process handshakes (OpenSSL over memory BIOs), median of {n} each; server = the "
        "gateway's side only"
    )
    print(
        f"{'CA+gateway key':<15} {'agent key':<10} {'CRL':>6} {'full srv µs':>12} {'full cli µs':>12} "
        f"{'resumed srv µs':>15} {'resumed cli µs':>15} {'srv full/resumed':>17}"
    )
    base = None
    for server_kind in KEYS:
        for agent_kind in KEYS:
            s = Setup(work, server_kind, agent_kind, 0)
            full_s, full_c, res_s, res_c = [], [], [], []
            for _ in range(5):  # warm-up
                sess = handshake(s)[2]
                handshake(s, sess)
            for _ in range(n):
                a, b, sess, resumed = handshake(s)
                assert not resumed
                full_s.append(a)
                full_c.append(b)
            for _ in range(n):
                a, b, _, resumed = handshake(s, sess)
                assert resumed, "the ticket was not accepted"
                res_s.append(a)
                res_c.append(b)
            fs, rs = _median_us(full_s), _median_us(res_s)
            if base is None:
                base = fs
            print(
                f"{server_kind:<15} {agent_kind:<10} {0:>6} {fs:>12.0f} {_median_us(full_c):>12.0f} "
                f"{rs:>15.0f} {_median_us(res_c):>15.0f} {fs / rs:>16.1f}x"
            )
    print("\nCRL size (P-256 everywhere): full handshake, CRL reload, per-request revoked-serial check")
    print(f"{'revoked':>8} {'full srv µs':>12} {'reload ms':>10} {'check µs':>9} {'CRL KiB':>8}")
    checker = ClientCertChecker()
    first = None
    for size in args.crl_sizes:
        s = Setup(work, "p256", "p256", size)
        handshake(s)
        samples = [handshake(s)[0] for _ in range(n)]
        t0 = time.perf_counter()
        reloads = 5
        for _ in range(reloads):
            s.reloader._stamp = ()  # type: ignore[assignment]  # force: same files, full reload
            s.reloader.reload()
        reload_ms = (time.perf_counter() - t0) / reloads * 1e3
        revoked = s.reloader.revoked
        assert len(revoked) == size
        trust = s.reloader.trust
        checker.check(s.agent_der, trust=trust)
        t0 = time.perf_counter()
        k = 20000
        for _ in range(k):
            checker.check(s.agent_der, trust=trust)
        check_us = (time.perf_counter() - t0) / k * 1e6
        fs = _median_us(samples)
        first = first or fs
        print(
            f"{size:>8} {fs:>12.0f} {reload_ms:>10.1f} {check_us:>9.2f} "
            f"{(s.dir / 'crl.pem').stat().st_size / 1024:>8.0f}"
        )
    print(
        "(the per-request check is a frozenset lookup: O(1) whatever the CRL's size; OpenSSL sorts the "
        "CRL once and searches it per full handshake)"
    )


# ------------------------------------------------------------------------------ end to end

CLIENT = r"""
import json, socket, ssl, sys, time
spec = json.loads(sys.argv[1])
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.minimum_version = ssl.TLSVersion.TLSv1_3
ctx.load_verify_locations(spec["ca"])
ctx.load_cert_chain(spec["cert"], spec["key"])
req = b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
sess = None
done = resumed = errors = 0
start = time.monotonic() + spec["warmup"]
stop = start + spec["seconds"]
counting = False
while True:
    now = time.monotonic()
    if now >= stop:
        break
    if not counting and now >= start:
        counting, done, resumed, errors = True, 0, 0, 0
    try:
        with socket.create_connection(("127.0.0.1", spec["port"]), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="localhost", session=sess) as tls:
            tls.sendall(req)
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
            if not data.startswith(b"HTTP/1.1 200"):
                errors += 1
                continue
            done += 1
            resumed += tls.session_reused
            if spec["resume"]:
                sess = tls.session
    except (OSError, ssl.SSLError):
        errors += 1
print(json.dumps({"done": done, "resumed": resumed, "errors": errors}))
"""


def _e2e_round(app: dict[str, Any], args: argparse.Namespace, resume: bool) -> dict[str, float]:
    spec = {
        "port": app["port"],
        "ca": str(app["agent"]["ca"]),
        "cert": str(app["agent"]["cert"]),
        "key": str(app["agent"]["key"]),
        "resume": resume,
        "seconds": args.e2e_seconds,
        "warmup": 1.0,
    }
    procs = [
        subprocess.Popen([sys.executable, "-c", CLIENT, json.dumps(spec)], stdout=subprocess.PIPE, text=True)
        for _ in range(args.e2e_clients)
    ]
    time.sleep(1.0)
    cpu0 = app["srv"].cpu_seconds()
    t0 = time.monotonic()
    outs = [json.loads(p.communicate(timeout=args.e2e_seconds + 60)[0]) for p in procs]
    seconds = time.monotonic() - t0
    cpu = app["srv"].cpu_seconds() - cpu0
    done = sum(o["done"] for o in outs)
    return {
        "rps": done / args.e2e_seconds,
        "resumed": sum(o["resumed"] for o in outs) / max(1, done),
        "errors": sum(o["errors"] for o in outs),
        "cpu_us": cpu / max(1, done) * 1e6,
        "cpu_share": cpu / seconds,
    }


def part2(args: argparse.Namespace) -> None:
    print(
        f"\npart 2: end to end through the appliance, {args.e2e_clients} client processes, "
        f"{args.rounds} x {args.e2e_seconds:g} s per phase, rounds alternated"
    )
    apps: dict[str, dict[str, Any]] = {}
    try:
        for label, tickets in (("off", 0), ("on", 1)):
            paths = c.make_home()
            c.seed_store(paths)
            agent = c.issue_agent(paths)
            srv = c.start_server(
                paths, gateway=True, what=f"tickets {label}", gateway_config={"tls_session_tickets": tickets}
            )
            apps[label] = {"paths": paths, "agent": agent, "srv": srv, "port": srv.info["gateway_port"]}
        runs: dict[str, list[dict[str, float]]] = {"a": [], "b": [], "c": []}
        for _ in range(args.rounds):
            runs["a"].append(_e2e_round(apps["off"], args, resume=True))  # offers, gets nothing
            runs["b"].append(_e2e_round(apps["on"], args, resume=False))
            runs["c"].append(_e2e_round(apps["on"], args, resume=True))
    finally:
        for a in apps.values():
            a["srv"].stop()
            c.remove_home(a["paths"], False)
    merged = {k: {f: statistics.mean(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    names = {
        "a": "(a) tickets off: every connection a full handshake",
        "b": "(b) tickets on, client never resumes",
        "c": "(c) tickets on, returning agent resumes",
    }
    print(f"{'phase':<56} {'conn/s':>8} {'resumed':>8} {'gw cpu µs/conn':>15} {'gw cpu':>7} {'errors':>7}")
    for k, m in merged.items():
        print(
            f"{names[k]:<56} {m['rps']:>8.0f} {m['resumed']:>8.0%} {m['cpu_us']:>15.0f} "
            f"{m['cpu_share']:>7.0%} {m['errors']:>7.0f}"
        )
        print(f"    rounds conn/s {[round(r['rps']) for r in runs[k]]}")
    a, b, cc = merged["a"], merged["b"], merged["c"]
    print(
        f"\nRATIOS resumed/full conn/s {cc['rps'] / a['rps']:.2f} (aim >= 2: "
        f"{'met' if cc['rps'] / a['rps'] >= 2 else 'NOT met'}), gateway CPU per connection resumed/full "
        f"{cc['cpu_us'] / a['cpu_us']:.2f}; tickets on but unused / off conn/s {b['rps'] / a['rps']:.2f}"
    )


# ---------------------------------------------------------------------- --baseline: two trees

BASE_HELPER = textwrap.dedent(r"""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, str(Path(sys.argv[1]) / "benchmarks"))
    import _common as c
    import gateway
    from gateway.config import Paths
    if sys.argv[2] == "setup":
        p = c.make_home()
        c.seed_store(p)
        print(json.dumps({"home": str(p.home), "agent": c.issue_agent(p), "gateway_file": gateway.__file__}))
    else:
        spec = json.loads(sys.argv[3])
        g = c.grant(Paths(Path(spec["home"])), profile="remote", audience=spec["audience"], cnf=spec["cnf"])
        print(json.dumps({"token": g["token"]}))
""")


class TreeApp:
    """One appliance, from this tree (``root`` None) or from the checkout at ``root``."""

    def __init__(self, label: str, root: Path | None, env: dict[str, str] | None = None) -> None:
        self.label, self.root = label, root
        self.env = {**os.environ, "PYTHONPATH": str(root)} if root is not None else None
        if root is None:
            import gateway

            paths = c.make_home()
            self.home = paths.home
            self.keys = c.seed_store(paths)
            self.agent = c.issue_agent(paths)
            self.gateway_file = gateway.__file__
            self.srv = c.start_server(paths, gateway=True, what=label, env=env)
        else:
            info = self._helper("setup")
            self.home, self.agent, self.gateway_file = Path(info["home"]), info["agent"], info["gateway_file"]
            self.keys = [f"preference.item{i:04d}" for i in range(200)]  # seed_store's keys
            cmd = [
                sys.executable,
                str(root / "benchmarks" / "_common.py"),
                "serve",
                "--home",
                str(self.home),
                "--gateway",
                "--layout",
                "split",
            ]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=self.env)
            try:
                self.srv = c.ServerProc(proc, c._read_json_line(proc, 60, label))
            except BaseException:
                proc.kill()
                raise
        self.port = int(self.srv.info["gateway_port"])
        audience = f"https://localhost:{self.port}"
        cnf = {"x5t#S256": self.agent["x5t"], "jkt": self.agent["jkt"]}
        if root is None:
            from gateway.config import Paths

            token = c.grant(Paths(self.home), profile="remote", audience=audience, cnf=cnf)["token"]
        else:
            spec = json.dumps({"home": str(self.home), "audience": audience, "cnf": cnf})
            token = self._helper("grant", spec)["token"]
        hdrs = {"Authorization": f"Bearer {token}", "X-UOMP-Agent-Id": self.agent["agent_id"]}
        self.reqs = [c.http_get(f"/v1/memory/{k}", host=f"localhost:{self.port}", headers=hdrs) for k in self.keys]
        self.target = c.Target(
            "tls", port=self.port, ca=self.agent["ca"], cert=self.agent["cert"], key=self.agent["key"]
        )
        self.health = c.http_get("/v1/health", host=f"localhost:{self.port}")

    def _helper(self, *argv: str) -> dict[str, Any]:
        assert self.root is not None
        out = subprocess.run(
            [sys.executable, "-c", BASE_HELPER, str(self.root), *argv],
            env=self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if out.returncode != 0:
            raise SystemExit(f"{self.label}: helper {argv[0]} failed: {out.stderr[-2000:]}")
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    def as_dict(self) -> dict[str, Any]:
        return {"port": self.port, "agent": self.agent, "srv": self.srv}

    def keepalive(self, args: argparse.Namespace) -> dict[str, Any]:
        r = c.run_load(
            self.target,
            self.reqs,
            clients=args.ka_clients,
            duration=args.e2e_seconds,
            warmup=1.0,
            server_pid=self.srv.pids,
        )
        c.check_ok(f"{self.label}: keep-alive GET by key", r)
        gw_cpu = r.get("server_cpu_parts", {}).get("gateway")
        done = sum(int(v) for v in r["statuses"].values())
        return {
            "rps": float(r["rps"]),
            "gw_us": (gw_cpu * r["elapsed"] / max(1, done) * 1e6) if gw_cpu is not None else float("nan"),
        }

    def rss(self, idle: int) -> dict[str, float]:
        time.sleep(0.5)
        before = self.srv.rss_kib()
        holder = c.Holder(self.target, self.health, idle)
        time.sleep(1.0)
        during = self.srv.rss_kib()
        opened = int(holder.info["opened"])
        holder.release()
        return {"opened": opened, "per_conn": (during - before) / max(1, opened)}

    def stop(self) -> None:
        try:
            self.srv.stop()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)


FLOOR_SERVER = textwrap.dedent(r"""
    import asyncio, json, sys
    from gateway import eventloop
    from gateway.remote.tls import TLSReloader
    reloader = TLSReloader(*sys.argv[1:5], session_tickets=1)
    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    class Answer(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
        def data_received(self, data):
            self.transport.write(ANSWER)
            self.transport.close()
    async def main():
        srv = await asyncio.get_running_loop().create_server(Answer, "127.0.0.1", 0, ssl=reloader.context,
                                                             ssl_handshake_timeout=10)
        print(json.dumps({"gateway_port": srv.sockets[0].getsockname()[1]}), flush=True)
        await asyncio.sleep(3600)
    eventloop.run(main())
""")


class FloorApp:
    """The floor under the gateway: the product's TLS context (TLSReloader, tickets on) on the loop's
    own TLS server (uvloop's native one), a protocol that answers every connection's first bytes
    with a fixed 200 and closes: no aiohttp, no gateway. What TLS and the loop cost per connection."""

    def __init__(self) -> None:
        from gateway.config import GatewayConfig, Paths
        from gateway.remote.server import tls_paths

        paths = c.make_home()
        self.home, self.agent = paths.home, c.issue_agent(paths)
        files = [str(p) for p in tls_paths(Paths(self.home), GatewayConfig())]
        proc = subprocess.Popen(
            [sys.executable, "-c", FLOOR_SERVER, *files], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
        )
        try:
            self.srv = c.ServerProc(proc, c._read_json_line(proc, 60, "floor"))
        except BaseException:
            proc.kill()
            raise
        self.port = int(self.srv.info["gateway_port"])
        self.gateway_file = "(bare TLS server, this tree's TLSReloader context)"

    def as_dict(self) -> dict[str, Any]:
        return {"port": self.port, "agent": self.agent, "srv": self.srv}

    def stop(self) -> None:
        try:
            self.srv.stop()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)


def part2_baseline(args: argparse.Namespace) -> None:
    root = Path(args.baseline).resolve()
    if not (root / "gateway" / "__init__.py").exists() or not (root / "benchmarks" / "_common.py").exists():
        raise SystemExit(f"--baseline {root}: not a checkout of this project (gateway/, benchmarks/_common.py)")
    print(
        f"\npart 2: this tree vs the baseline {root}, {args.e2e_clients} client processes (stdlib ssl), "
        f"{args.rounds} x {args.e2e_seconds:g} s per phase, trees and phases alternated"
    )
    apps: dict[str, TreeApp] = {}
    floor: FloorApp | None = None
    try:
        apps["base"] = TreeApp("baseline", root)
        apps["ours"] = TreeApp("this tree", None)
        if args.asyncio_too:
            apps["ours-asyncio"] = TreeApp("this tree, UOMP_UVLOOP=0", None, env={"UOMP_UVLOOP": "0"})
        if args.floor:
            floor = FloorApp()
        every: dict[str, TreeApp | FloorApp] = {**apps, **({"floor": floor} if floor is not None else {})}
        for k, a in every.items():
            print(f"  {k:<13} gateway module {a.gateway_file}, port {a.port}, gateway pid {a.srv.pid}")
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for resume in (False, True):
                for k, a in every.items():
                    runs.setdefault((k, "resume" if resume else "full"), []).append(
                        _e2e_round(a.as_dict(), args, resume=resume)
                    )
            if args.ka_clients:
                for k, a in apps.items():
                    runs.setdefault((k, "keepalive"), []).append(a.keepalive(args))
        rss = {k: a.rss(args.idle) for k, a in apps.items()} if args.idle else {}
    finally:
        for a in apps.values():
            a.stop()
        if floor is not None:
            floor.stop()
    m = {key: {f: statistics.mean(r[f] for r in v) for f in v[0]} for key, v in runs.items()}
    print(
        f"\n{'appliance':<13} {'clients':<22} {'conn/s':>8} {'resumed':>8} {'gw cpu µs/conn':>15} "
        f"{'gw cpu':>7} {'errors':>7}  rounds conn/s"
    )
    for k in every:
        for phase, title in (("full", "no session offered"), ("resume", "offer last session")):
            r = m[(k, phase)]
            print(
                f"{k:<13} {title:<22} {r['rps']:>8.0f} {r['resumed']:>8.0%} {r['cpu_us']:>15.0f} "
                f"{r['cpu_share']:>7.0%} {r['errors']:>7.0f}  {[round(x['rps']) for x in runs[(k, phase)]]}"
            )
    if args.ka_clients:
        print(f"\nkeep-alive GET by key through the gateway, {args.ka_clients} connections")
        for k in apps:
            r = m[(k, "keepalive")]
            print(
                f"{k:<13} {r['rps']:>8.0f} req/s   gateway CPU {r['gw_us']:>6.0f} µs/request   "
                f"rounds {[round(x['rps']) for x in runs[(k, 'keepalive')]]}"
            )
    for k, r in rss.items():
        print(f"{k:<13} RSS per idle keep-alive mTLS connection: {r['per_conn']:.1f} KiB ({r['opened']:.0f} held)")
    base_full = m[("base", "full")]["rps"]
    ours = m[("ours", "resume")]["rps"]
    print(
        f"\nRATIOS vs baseline conn/s: returning agents (resume) {ours / base_full:.2f} (aim >= 2: "
        f"{'met' if ours / base_full >= 2 else 'NOT met'}), no resumption "
        f"{m[('ours', 'full')]['rps'] / base_full:.2f}; gateway CPU per connection resume/base "
        f"{m[('ours', 'resume')]['cpu_us'] / m[('base', 'full')]['cpu_us']:.2f}, full/base "
        f"{m[('ours', 'full')]['cpu_us'] / m[('base', 'full')]['cpu_us']:.2f}"
    )
    if args.ka_clients:
        ka = m[("ours", "keepalive")]["rps"] / m[("base", "keepalive")]["rps"]
        print(f"RATIO keep-alive req/s ours/base {ka:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--handshakes", type=int, default=300, help="in-process handshakes per row (300)")
    ap.add_argument("--crl-sizes", default="0,1000,10000")
    ap.add_argument("--e2e-seconds", type=float, default=5.0)
    ap.add_argument("--e2e-clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--no-part1", action="store_true")
    ap.add_argument("--baseline", metavar="PATH", help="part 2 against the appliance of another checkout")
    ap.add_argument("--asyncio-too", action="store_true", help="with --baseline: this tree on asyncio's loop too")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="with --baseline: also a bare TLS server with the product's context (what TLS alone costs)",
    )
    ap.add_argument("--ka-clients", type=int, default=20, help="with --baseline: keep-alive connections (0: none)")
    ap.add_argument("--idle", type=int, default=200, help="with --baseline: idle connections for RSS (0: none)")
    args = ap.parse_args()
    args.crl_sizes = [int(x) for x in args.crl_sizes.split(",")]
    if not (
        1 <= args.handshakes <= 100_000
        and 1 <= args.e2e_clients <= 64
        and 0 < args.e2e_seconds <= 600
        and all(0 <= x <= 100_000 for x in args.crl_sizes)
        and 1 <= args.rounds <= 10
    ):
        raise SystemExit("--handshakes 1..100000, --e2e-clients 1..64, --e2e-seconds 0..600, CRL sizes 0..100000")
    print(f"bench_handshake: {c.machine_line()}  {ssl.OPENSSL_VERSION}")
    work = Path(tempfile.mkdtemp(prefix="uomp-hs-"))
    try:
        if not args.no_part1:
            part1(args, work)
        if args.baseline and not args.no_e2e:
            part2_baseline(args)
        elif not args.no_e2e:
            part2(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
