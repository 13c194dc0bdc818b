"""``uomp doctor``: check the data directory, keys, CA, config, addresses, ports and cloudflared.

Each check prints ``ok`` or ``PROBLEM`` with what to do; the exit status is 1 when any problem was
found (0 otherwise). Nothing is changed: the fixes are commands for the user.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway import appliance, ca_store
from gateway.cli.main import paths_from
from gateway.config import GatewayConfig, GuardConfig, Paths, TunnelSettings, load_section
from gateway.errors import ErrorCode, UompError

CERT_WARN_DAYS = 7
# How to give a sealed home's passphrase to a one-shot command (gateway/atrest/vault.py's sources).
UNLOCK_FIX = (
    "give the passphrase to check them: run 'uomp doctor' in a terminal (it asks), or "
    "UOMP_PASSPHRASE_FILE=FILE uomp doctor (systemd: LoadCredential=uomp-passphrase:FILE; or the keychain "
    "after 'uomp secrets seal --keyring')"
)


class Report:
    """What ``uomp doctor`` found: its lines, and how many problems."""

    def __init__(self) -> None:
        self.problems = 0
        self.lines: list[str] = []
        self.flagged: set[Path] = set()  # files with a problem said already (said once)

    def ok(self, text: str) -> None:
        self.lines.append(f"ok       {text}")

    def problem(self, text: str, fix: str) -> None:
        self.problems += 1
        self.lines.append(f"PROBLEM  {text}\n         fix: {fix}")

    def note(self, text: str) -> None:
        self.lines.append(f"note     {text}")

    def locked(self, text: str, fix: str) -> None:
        """A sealed key that could not be checked because nothing unlocked it: not a problem."""
        self.lines.append(f"locked   {text}\n         fix: {fix}")


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _check_private(r: Report, p: Path, what: str, *, dir_: bool = False, plain: bool = False) -> bool:
    """``ok`` for a private file or directory (``plain``: the ``ok`` says the file is not sealed)."""
    if not p.exists():
        if dir_:
            r.problem(f"{what} {p} is missing", "run: uomp init")
        return False  # a missing key file: homefiles says which fix is safe for it
    want = 0o700 if dir_ else 0o600
    m = _mode(p)
    if m & 0o077:
        r.problem(f"{what} {p} is readable by others (mode {m:o})", f"chmod {want:o} {p}")
        r.flagged.add(p)
        return False
    if p.stat().st_uid != os.getuid():
        r.problem(
            f"{what} {p} belongs to uid {p.stat().st_uid}, not to this user ({os.getuid()})", f"chown {os.getuid()} {p}"
        )
        r.flagged.add(p)
        return False
    r.ok(f"{p} is private (mode {m:o})" + (", plaintext: NOT sealed" if plain else ""))
    return True


def _configs(r: Report, paths: Paths) -> tuple[GatewayConfig | None, GuardConfig | None, TunnelSettings | None]:
    out: list[Any] = []
    seen: set[str] = set()
    for cls, section in ((GatewayConfig, "gateway"), (GuardConfig, "guard"), (TunnelSettings, "tunnel")):
        try:
            out.append(load_section(cls, section, file=paths.config_file))
        except UompError as exc:
            if exc.message not in seen:  # a whole-file problem is said once, not once per section
                seen.add(exc.message)
                r.problem(f"config: {exc.message}", f"edit {paths.config_file}")
            out.append(None)
    if all(x is not None for x in out):
        r.ok(f"config {paths.config_file if paths.config_file.exists() else '(defaults, no config.toml)'}")
    return out[0], out[1], out[2]


def _ca(r: Report, paths: Paths, gcfg: GatewayConfig | None) -> None:
    from cryptography import x509

    from gateway.cli import homefiles
    from gateway.core import ca

    plain = not paths.master_slot.exists()
    _check_private(r, ca_store.ca_key_path(paths), "CA key", plain=plain)
    _check_private(r, ca_store.server_key_path(paths), "gateway key", plain=plain)
    bad, good = homefiles.check(paths)
    locked = [f for f in bad if f.cause is ErrorCode.SECRETS_LOCKED]
    for f in bad:
        if f.path not in r.flagged and f not in locked:
            r.problem(f"{f.what} {f.path} {f.problem}", f.fix)
    if locked:
        r.locked(
            "sealed, not checked (no passphrase given): " + ", ".join(f.what for f in locked),
            UNLOCK_FIX,
        )
    for line in good:
        r.ok(f"{line} (parsed)")
    cp = ca_store.server_cert_path(paths)
    try:
        cert = x509.load_pem_x509_certificate(cp.read_bytes())
    except FileNotFoundError:
        r.problem(f"gateway certificate {cp} is missing", "run: uomp init")
        return
    except (OSError, ValueError) as exc:
        r.problem(f"gateway certificate {cp} cannot be read ({exc})", f"delete {cp} and run: uomp init")
        return
    left = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    if left.total_seconds() <= 0:
        r.problem(f"gateway certificate expired on {cert.not_valid_after_utc:%Y-%m-%d}", "run: uomp init (renews it)")
    elif left.days < CERT_WARN_DAYS:
        r.problem(f"gateway certificate expires in {left.days} days", "run: uomp init (renews it)")
    else:
        r.ok(f"gateway certificate valid until {cert.not_valid_after_utc:%Y-%m-%d}")
    if gcfg is None:
        return
    names = ca.server_cert_names(cert)
    try:
        urls = appliance.public_urls(paths, gcfg)
    except UompError as exc:
        r.problem(exc.message, f"fix or delete {appliance.addresses_path(paths)}")
        return
    for url in urls:
        host = (urlsplit(url).hostname or "").lower()
        if host not in names:
            r.problem(
                f"public URL {url}: the gateway certificate does not name {host} "
                f"(names: {', '.join(sorted(names))}); agents would fail the TLS name check",
                f"run: uomp init --hostname {url}, then restart the gateway (or send it SIGHUP)",
            )
        else:
            r.ok(f"public URL {url} is an accepted endpoint and named by the gateway certificate")
    if not urls:
        r.note(
            f"no public URL recorded: agents reach this gateway as https://localhost:{gcfg.listen_port} only "
            "(set one with uomp init --hostname HOST, or use --tunnel)"
        )


def _ports(r: Report, paths: Paths, gcfg: GatewayConfig | None, guard: GuardConfig | None) -> None:
    if appliance.is_running(paths):
        info = appliance.read_run(paths) or {}
        r.ok(f"the appliance runs (pid {info.get('pid', '?')}): its ports are its own")
        return
    checks: list[tuple[str, int, str, str]] = []
    if gcfg is not None:
        checks.append((gcfg.listen_host, gcfg.listen_port, "the gateway", "--listen HOST:PORT"))
        if gcfg.tunnel_origin_port > 0:
            checks.append(
                (gcfg.tunnel_origin_host, gcfg.tunnel_origin_port, "the tunnel origin", "--tunnel-origin-port")
            )
    if guard is not None and guard.serve_tcp:
        checks.append((guard.tcp_host, guard.tcp_port, "the Local Profile", "[guard] tcp_port or --no-local-port"))
    for host, port, what, flag in checks:
        try:
            appliance.check_port_free(host, port, what, flag)
        except UompError as exc:
            r.problem(exc.message.split(";")[0], exc.message.split(";", 1)[-1].strip())
        else:
            r.ok(f"{what}: {host}:{port} is free")
    from gateway.netutil import socket_is_live

    if paths.guard_sock.exists():
        if socket_is_live(paths.guard_sock):
            r.problem(
                f"a guard answers on {paths.guard_sock} although no appliance runs on this home",
                "stop that guard (uomp guard serve) before uomp gateway start",
            )
        else:
            r.note(f"stale socket file {paths.guard_sock} (removed at the next start)")


def _tunnel(r: Report, t: TunnelSettings | None) -> None:
    from gateway.tunnel import INSTALL_HINT, find_cloudflared, user_configs

    binary = find_cloudflared(t.cloudflared if t and t.cloudflared else None)
    mode = t.mode if t else "none"
    if binary is None:
        if mode != "none":
            r.problem(
                f"[tunnel] mode = {mode} but cloudflared is not found "
                f"({t.cloudflared if t and t.cloudflared else 'on PATH'})",
                INSTALL_HINT,
            )
        else:
            r.note("cloudflared not found (only needed for --tunnel)")
        return
    r.ok(f"cloudflared: {binary}")
    if mode in ("named", "tcp") and t is not None:
        from gateway.cli.gateway import check_tunnel

        try:
            check_tunnel(t)
        except UompError as exc:
            r.problem(exc.message.split(";")[0], exc.message.split(";", 1)[-1].strip())
    if mode == "quick":
        for p in user_configs():
            r.note(
                f"{p} can stop a quick tunnel (the supervisor hides ~/ configs from cloudflared; others: move it aside)"
            )


def _guard_health(r: Report, paths: Paths) -> None:
    if not appliance.is_running(paths):
        return
    from gateway.cli.status import collect

    s = collect(paths)
    if s["guard"].get("reachable"):
        r.ok("the running gateway reaches its guard")
    else:
        r.problem(
            f"the running gateway cannot reach its guard ({s['guard'].get('last_error')})",
            "see the appliance's log; the supervisor restarts the guard; uomp status shows restarts",
        )


def _audit_log(r: Report, paths: Paths) -> None:
    from gateway.cli.status import audit_integrity

    a = audit_integrity(paths)
    if a.get("ok") is False:
        message = str(a["message"])
        problem, _, fix = message.partition("; ")
        r.problem(
            f"{a['code']}: {problem}" + (f" (first bad event #{a['first_bad_seq']})" if a.get("first_bad_seq") else ""),
            fix or "run: uomp audit verify",
        )
    elif a.get("ok") is None:
        r.note(f"audit log not checked: {a.get('message')}")
    else:
        w = a.get("witness_size")
        if w is None and a.get("events"):
            r.note(f"audit log: {a['events']} events, no witness record yet (the guard starts one at its next start)")
        else:
            r.ok(
                f"audit log: {a.get('events', 0)} events, tail checked, consistent with the witness record"
                + (f" at {w} events" if w is not None else "")
            )


def _speed(r: Report) -> None:
    """What the servers run on: the HTTP parser of the guard and the gateway (llhttp, which has no
    pure-Python fallback), aiohttp's C HTTP parser (the agent SDK's client and the chain clients), the
    event loop, the JSON codec. The last three are only speed (the pure-Python fallbacks behave the
    same), so these are notes, not problems."""
    from importlib.metadata import PackageNotFoundError, version

    from gateway import eventloop, jsonio, native

    try:
        r.ok(f"HTTP servers parse with llhttp (httptools {version('httptools')})")
    except PackageNotFoundError:  # pragma: no cover - a dependency of the package
        r.problem("httptools is not installed: the guard and the gateway cannot serve HTTP", "bash scripts/setup.sh")

    try:
        import aiohttp.http_parser as hp

        active = hp.HttpRequestParser.__module__ == "aiohttp._http_parser"
    except ImportError:
        active = False
    if active:
        r.ok("aiohttp C extensions active (HTTP parser aiohttp._http_parser: the SDK's and the chain clients)")
    else:
        r.note(
            "aiohttp C extensions OFF (pure-Python HTTP parser: slower; AIOHTTP_NO_EXTENSIONS is "
            + ("set" if os.environ.get("AIOHTTP_NO_EXTENSIONS") else "unset: no binary wheel?")
            + ")"
        )
    loop = eventloop.describe()
    (r.ok if loop.startswith("uvloop") else r.note)(f"event loop {loop}")
    (r.ok if native.status.startswith("compiled") else r.note)(f"request path {native.status}")
    codec = jsonio.backend()
    (r.ok if codec.startswith("orjson") else r.note)(f"JSON {codec}")


def _anchoring(r: Report, paths: Paths) -> None:
    from gateway.anchor.ops import rpc_warnings
    from gateway.config import AnchorConfig

    acfg = load_section(AnchorConfig, "anchor", file=paths.config_file)
    for w in rpc_warnings(acfg.backend, acfg.rpc_url):
        r.note(f"WARNING: {w}")


def _vps_checks(r: Report, paths: Paths) -> Report:
    """A VPS gateway holds its TLS identities and public material only: check those, and that
    nothing that must stay at home is here."""
    from gateway.uplink import certs

    r.note(f"{paths.home} is a VPS gateway's data directory (its guard is at home, docs/vps.md)")
    gcfg, _guard, tunnel = _configs(r, paths)
    for p, what in ((paths.gateway_key, "gateway key"), (paths.uplink_server_key, "uplink key")):
        if not p.exists():
            r.problem(f"{what} {p} is missing", "at home: uomp uplink init --vps-host HOST --out DIR, copy DIR here")
        else:
            _check_private(r, p, what)
    try:
        certs.load_pins(paths.uplink_pins)
        r.ok(f"the home side's pin {paths.uplink_pins}")
    except UompError as exc:
        r.problem(exc.message.split(";")[0], exc.message.split(";", 1)[-1].strip())
    for p, what in (
        (paths.private_jwk, "the token signing key"),
        (paths.ca_key, "the agent CA key"),
        (paths.uplink_ca_key, "the uplink CA key"),
        (paths.audit_key, "the audit key"),
        (paths.payload_private_key, "the payload key"),
        (paths.admin_credential, "the admin credential"),
        (paths.memory_db, "the memory store"),
    ):
        if p.exists():
            r.problem(f"{what} is on this VPS ({p}); it belongs at home", f"move it home, then remove {p}")
    if appliance.is_running(paths):
        try:
            up = json.loads(paths.gateway_status.read_text()).get("uplink") or {}
        except (OSError, ValueError):
            up = {}
        if up.get("connected"):
            r.ok("the home side is connected over the uplink")
        else:
            r.problem(
                f"no home side is connected ({up.get('last_error') or 'never connected'})",
                "at home: uomp guard uplink https://THIS-HOST:PORT (the uplink listener of `uomp status`)",
            )
    steps: list[Callable[[], None]] = [
        lambda: _ports(r, paths, gcfg, None),
        lambda: _tunnel(r, tunnel),
        lambda: _speed(r),
    ]
    for step in steps:
        try:
            step()
        except UompError as exc:
            r.problem(exc.message, "see the message")
    return r


def _at_rest(r: Report, paths: Paths) -> None:
    """How the keys are kept: sealed (and by what), or plain 0600 files, said as such."""
    from gateway.atrest import vault

    if not paths.secrets.exists():
        return
    state = vault.at_rest_state(paths)
    line = vault.describe_state(state)
    if state["sealed_by"] == "unreadable":
        r.problem(line, "restore .secrets/master.json from a backup of this home")
    elif state["sealed"]:
        r.ok(line)
        _audit_at_rest(r, paths)
        try:
            vault.master(paths)
        except UompError as exc:
            if exc.code is ErrorCode.SECRETS_LOCKED:
                r.locked("the keys are locked: sealed, and no passphrase was given to this command", UNLOCK_FIX)
            else:
                problem, _, fix = exc.message.partition("; ")
                r.problem(f"{exc.code.value}: {problem}", fix or "see the message")
    else:
        r.note(line)


def _audit_at_rest(r: Report, paths: Paths) -> None:
    """A sealed home's audit log is encrypted; a plaintext one is converted at its next open."""
    from gateway.atrest import auditdb, memdb

    if auditdb.is_encrypted(paths.audit_db):
        r.ok(f"the audit log {paths.audit_db} is encrypted at rest (SQLCipher, its own key)")
    elif memdb.is_plaintext(paths.audit_db):
        r.problem(
            f"the audit log {paths.audit_db} is a plaintext file in a sealed home",
            "run 'uomp audit verify' (or start the appliance): its first open encrypts it",
        )


def run_checks(paths: Paths) -> Report:
    """Every check of the home, in order; a missing home is the one problem reported."""
    r = Report()
    steps: list[Callable[[], None]] = []
    if not paths.home.exists():
        r.problem(f"data directory {paths.home} does not exist", "run: uomp init (or uomp gateway start)")
        return r
    try:
        appliance.check_home_writable(paths.home)
    except UompError as exc:
        r.problem(exc.message.split(";")[0], exc.message.split(";", 1)[-1].strip())
    _check_private(r, paths.home, "data directory", dir_=True)
    if not paths.private_jwk.exists() and paths.uplink_server_cert.exists():
        return _vps_checks(r, paths)  # a VPS gateway's directory (uomp uplink init): its own checks
    plain = not paths.master_slot.exists()
    _check_private(r, paths.private_jwk, "signing key", plain=plain)
    _check_private(r, paths.admin_credential, "admin credential", plain=plain)
    _check_private(r, paths.items_key, "item sealing key", plain=plain)  # made by the store's first open
    _at_rest(r, paths)
    gcfg, guard, tunnel = _configs(r, paths)
    steps += [
        lambda: _ca(r, paths, gcfg),
        lambda: _ports(r, paths, gcfg, guard),
        lambda: _tunnel(r, tunnel),
        lambda: _guard_health(r, paths),
        lambda: _anchoring(r, paths),
        lambda: _audit_log(r, paths),
        lambda: _speed(r),
    ]
    for step in steps:
        try:
            step()
        except UompError as exc:
            if not any(exc.message in line for line in r.lines):  # e.g. the config problem, said above
                r.problem(exc.message, "see the message")
    return r


def _doctor(args: argparse.Namespace) -> int:
    paths = paths_from(args, needs_init=False)
    r = run_checks(paths)
    print("\n".join(r.lines))
    if r.problems:
        print(f"{r.problems} problem(s) found")
        return 1
    print("no problems found")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp doctor`` to the command line."""
    p = sub.add_parser(
        "doctor",
        help="check permissions, keys, CA, config, addresses vs certificate, ports and "
        "cloudflared; each problem with its fix (exit 1 when any)",
    )
    p.set_defaults(func=_doctor)
