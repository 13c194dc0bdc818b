"""``uomp payload pubkey|list|pull|rm``: the user's side of the encrypted payload relay.

These commands talk to the running guard over its Unix socket (``$UOMP_HOME/guard.sock``, 0600) with
the admin credential, rather than opening ``$UOMP_HOME/payloads`` themselves: the guard is the one
place where the user's payload actions are written to the audit log (``payload_opened``,
``payload_removed``), the same credential gates them as every other management call, and the CLI
never races the gateway's crash recovery or expiry sweep on the store's files.

``pull`` opens the payload here, with the private key that never leaves this machine, in constant
memory: the sealed bytes stream from the socket in 1 MiB blocks through
:func:`gateway.core.sealing.open_stream`. The plaintext goes to a private temporary file
(:mod:`gateway.payloads.pulltemp`: an anonymous 0600 file in the ``--out`` directory, or a
recognisable named one registered in a journal where the file system cannot make anonymous files).
``--out`` appears, at once and complete, only after the whole stream authenticated, the
ciphertext's SHA-256 matched the index *and* the guard made the ``payload_opened`` event durable; a
tampered, truncated or foreign payload, a guard that went away, an error, SIGTERM, SIGINT or SIGHUP
leave no output and no plaintext at all (a SIGKILL leaves none either with an anonymous file; a
named one is removed by the next pull or the guard's start-up). So a failed pull is retried as it
was, without ``--force``; an existing file at ``--out`` is never replaced without ``--force``.

``uomp init`` makes the payload key (:func:`gateway.cli.initsteps.init_payload_key`); any command that needs it
makes it when an older data directory has none.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import http.client
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gateway import keys
from gateway.cli.main import paths_from
from gateway.config import Paths
from gateway.core import sealing
from gateway.errors import ErrorCode, UompError, parse_code
from gateway.payloads import pulltemp, userkey
from gateway.payloads.store import fault_hold

READ_BLOCK = 1024 * 1024
SOCKET_TIMEOUT_SECONDS = 60.0
CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interrupted(BaseException):
    """A signal ended the pull (raised from its handler so that the clean-up runs)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_end_the_pull() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise :class:`Interrupted` here (main thread only; elsewhere the
    caller's handlers stay)."""
    try:
        old = {s: signal.signal(s, _interrupted) for s in CLEANUP_SIGNALS}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


class GuardClient:
    """Admin calls to the guard over its Unix socket (sync; one connection per call)."""

    def __init__(self, paths: Paths, *, timeout: float = SOCKET_TIMEOUT_SECONDS) -> None:
        self.paths = paths
        self.timeout = timeout
        self.credential = keys.load_admin(paths)

    @contextlib.contextmanager
    def request(self, method: str, path: str) -> Iterator[http.client.HTTPResponse]:
        conn = _UnixConnection(self.paths.guard_sock, self.timeout)
        try:
            try:
                conn.request(method, path, headers={"Authorization": f"Bearer {self.credential}"})
                resp = conn.getresponse()
            except OSError as exc:
                raise UompError(
                    ErrorCode.STORE_UNAVAILABLE,
                    f"cannot reach the guard on {self.paths.guard_sock} "
                    f"({exc.strerror or type(exc).__name__}); is 'uomp gateway start' running?",
                ) from None
            if resp.status >= 400:
                raise _error(resp)
            yield resp
        finally:
            conn.close()

    def json(self, method: str, path: str) -> Any:
        with self.request(method, path) as resp:
            try:
                return json.loads(resp.read(16 * 1024 * 1024))
            except ValueError:
                raise UompError(ErrorCode.UPSTREAM_ERROR, "the guard answered with invalid JSON") from None


def _error(resp: http.client.HTTPResponse) -> UompError:
    try:
        err = json.loads(resp.read(64 * 1024))["error"]
        code, message = parse_code(err["code"], ErrorCode.UPSTREAM_ERROR), str(err["message"])
    except (ValueError, KeyError, TypeError):
        return UompError(ErrorCode.UPSTREAM_ERROR, f"the guard answered HTTP {resp.status}")
    return UompError(code, message)


def _ago(ts: float) -> str:
    s = max(0, int(time.time() - ts))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit}"
    return f"{s}s"


def _pubkey(args: argparse.Namespace) -> int:
    print(userkey.public_b64(paths_from(args)))
    return 0


def _list(args: argparse.Namespace) -> int:
    client = GuardClient(paths_from(args))
    path = "/v1/payloads" + (f"?session_id={quote(args.session, safe='')}" if args.session else "")
    payloads = client.json("GET", path)["payloads"]
    if args.json:
        print(json.dumps(payloads, indent=2))
        return 0
    if not payloads:
        print("no payloads waiting")
        return 0
    print(f"{'PAYLOAD':<30} {'SESSION':<28} {'AGENT':<20} {'FORMAT':<18} {'SIZE':>12} {'AGE':>5}  OPENED")
    for p in payloads:
        print(
            f"{p['payload_id']:<30} {p['session_id']:<28} {p['agent_id'][:20]:<20} {p['format'][:18]:<18} "
            f"{p['size']:>12} {_ago(p['created_at']):>5}  {'yes' if p['opened'] else 'no'}"
        )
    return 0


def open_payload(paths: Paths, payload_id: str) -> tuple[dict[str, Any], Iterator[bytes]]:
    """A payload's index entry and its plaintext as blocks, opened here with the user's key.

    The iterator streams the sealed bytes from the guard and yields authenticated plaintext; it
    raises PAYLOAD_INVALID when a block does not open or, at the end, when the ciphertext's length
    or SHA-256 differ from the index (so a caller must not treat the output as good before the
    iterator is exhausted). Nothing is written anywhere; :func:`mark_opened` records the opening."""
    if not payload_id.startswith("pay_"):
        raise UompError(ErrorCode.INVALID_REQUEST, "a payload id starts with pay_")
    userkey.ensure(paths)  # a home from before payloads gets its key here too
    private = userkey.load_private(paths)
    client = GuardClient(paths)
    pid = quote(payload_id, safe="")
    meta = client.json("GET", f"/v1/payloads/{pid}")
    binding = sealing.Binding(meta["payload_id"], meta["session_id"], meta["agent_id"], meta["format"])

    def plaintext() -> Iterator[bytes]:
        digest = hashlib.sha256()
        received = 0
        with client.request("GET", f"/v1/payloads/{pid}/ciphertext") as resp:

            def blocks() -> Iterator[bytes]:
                nonlocal received
                while block := resp.read(READ_BLOCK):
                    received += len(block)
                    digest.update(block)
                    yield block

            try:
                for plain in sealing.open_stream(private, binding, meta["encryption"], blocks()):
                    yield bytes(plain)
            except sealing.SealError as exc:
                raise UompError(
                    ErrorCode.PAYLOAD_INVALID, f"payload {payload_id} does not open: {exc}; nothing was written"
                ) from None
            except (OSError, http.client.HTTPException):
                raise UompError(
                    ErrorCode.STORE_UNAVAILABLE, "the guard's answer broke off; nothing was written"
                ) from None
        if received != meta["size"] or "sha256:" + digest.hexdigest() != meta["hash"]:
            raise UompError(
                ErrorCode.PAYLOAD_INVALID,
                f"payload {payload_id}'s ciphertext does not match its recorded hash; nothing was written",
            )

    return dict(meta), plaintext()


def mark_opened(paths: Paths, payload_id: str) -> None:
    """Tells the guard the user opened ``payload_id`` (the guard records ``payload_opened``)."""
    GuardClient(paths).json("POST", f"/v1/payloads/{quote(payload_id, safe='')}/opened")


def pull(paths: Paths, payload_id: str, out: Path, *, force: bool = False) -> dict[str, Any]:
    """Fetch, check and open one payload into ``out`` (see the module docstring). Returns its index entry."""
    if not payload_id.startswith("pay_"):
        raise UompError(ErrorCode.INVALID_REQUEST, "a payload id starts with pay_")
    out = Path(out)
    with contextlib.suppress(OSError):
        pulltemp.sweep(paths)  # what a killed pull left (named part files only)
    if (out.exists() or out.is_symlink()) and not force:
        raise UompError(ErrorCode.INVALID_REQUEST, f"{out} exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise UompError(ErrorCode.INVALID_REQUEST, f"{out.parent} is not a directory")
    meta, blocks = open_payload(paths, payload_id)
    with _signals_end_the_pull():
        plain: pulltemp.PlainFile | None = None
        try:
            plain = pulltemp.PlainFile(paths, out.parent)
            written = 0
            for block in blocks:
                plain.write(block)
                written += len(block)
                if written >= READ_BLOCK:
                    fault_hold("pull_mid_decrypt")
            plain.sync()
            try:  # the opening is audited before the plaintext has a name
                mark_opened(paths, payload_id)
            except UompError as exc:
                raise UompError(
                    exc.code,
                    f"{exc.message}; the opening could not be recorded, so nothing was "
                    "written: run the same command again",
                ) from None
            fault_hold("pull_after_opened")
            try:
                plain.publish(out, force=force)
            except FileExistsError:
                raise UompError(
                    ErrorCode.INVALID_REQUEST, f"{out} appeared meanwhile; pass --force to replace it"
                ) from None
        finally:
            old = signal.pthread_sigmask(signal.SIG_BLOCK, CLEANUP_SIGNALS)  # the clean-up is not cut short
            try:
                if plain is not None:
                    plain.discard()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return meta


def _pull(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    try:
        meta = pull(paths, args.payload_id, Path(args.out), force=args.force)
    except Interrupted as stop:
        print(f"interrupted by {signal.Signals(stop.signum).name}; nothing was written", file=sys.stderr)
        signal.signal(stop.signum, signal.SIG_DFL)
        os.kill(os.getpid(), stop.signum)  # exit as the signal says
        return 128 + stop.signum
    created = dt.datetime.fromtimestamp(meta["created_at"], dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(
        f"opened {meta['payload_id']} ({meta['format']}, from {meta['agent_id']}, session {meta['session_id']}, "
        f"uploaded {created}) -> {args.out}",
        file=sys.stderr,
    )
    return 0


def _rm(args: argparse.Namespace) -> int:
    client = GuardClient(paths_from(args))
    client.json("DELETE", f"/v1/payloads/{quote(args.payload_id, safe='')}")
    print(f"removed {args.payload_id}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp payload`` to the command line."""
    p = sub.add_parser("payload", help="encrypted payloads agents sent you: list, pull (decrypt), remove")
    psub = p.add_subparsers(dest="payload_command", metavar="ACTION", required=True)
    k = psub.add_parser("pubkey", help="print your payload public key (what agents seal to; in every agent bundle)")
    k.set_defaults(func=_pubkey)
    ls = psub.add_parser("list", help="payloads waiting: session, agent, format, size, age, opened")
    ls.add_argument("--session", help="only this session's payloads")
    ls.add_argument("--json", action="store_true", help="the index as JSON")
    ls.set_defaults(func=_list)
    pl = psub.add_parser(
        "pull", help="fetch, check and decrypt a payload into a file (nothing written unless every byte authenticates)"
    )
    pl.add_argument("payload_id", metavar="ID")
    pl.add_argument("--out", required=True, metavar="FILE", help="where the plaintext goes")
    pl.add_argument("--force", action="store_true", help="replace FILE if it exists")
    pl.set_defaults(func=_pull)
    rm = psub.add_parser("rm", help="remove a payload from the relay")
    rm.add_argument("payload_id", metavar="ID")
    rm.set_defaults(func=_rm)
