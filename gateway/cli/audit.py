"""``uomp audit [verify | proof EVENT_ID | verify-proof FILE]`` and ``uomp anchor deploy|status``.

``uomp audit`` shows what agents asked for and what they got; ``verify`` checks the whole
verifiable event log (every leaf, the tree, every signed checkpoint, and each anchored root against
the chain when one is configured); ``proof`` writes a self-contained bundle for one event, which
``verify-proof`` checks with nothing else (and, with ``--rpc``, against the chain).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gateway.cli.main import paths_from
from gateway.config import AnchorConfig, GuardConfig, Paths, load_section
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write
from gateway.guard.audit import AuditLog, anchor_chain, ledger_refusal, open_audit
from gateway.ledger import auditkey
from gateway.ledger.log import EventLog, LedgerError
from gateway.ledger.query import MAX_LIMIT, AuditFilter, parse_time
from gateway.ledger.verify import ProofBundleError, verify_bundle, verify_log

MAX_BUNDLE_BYTES = 1 << 20


def _cfg(paths: Paths) -> GuardConfig:
    return load_section(GuardConfig, "guard", file=paths.config_file)


FOLLOW_INTERVAL = 0.5  # seconds between two polls of --follow


def _filter(args: argparse.Namespace) -> AuditFilter:
    if args.limit < 1:
        raise UompError(ErrorCode.INVALID_REQUEST, "--limit must be at least 1")
    now = time.time()
    actions = tuple(a.strip() for part in (args.action_filter or []) for a in part.split(",") if a.strip())
    return AuditFilter(
        session_id=args.session, agent_id=args.agent, action=actions,
        allowed=True if args.allowed else (False if args.refused else None),
        since=parse_time(args.since, now=now) if args.since else None,
        until=parse_time(args.until, now=now) if args.until else None,
        limit=min(args.limit, MAX_LIMIT)).checked()


def _line(e: dict[str, Any]) -> str:
    if e.get("pruned"):
        return (f"{e['timestamp']} {'ALLOW' if e.get('allowed') else 'DENY '} {e.get('session_id', '-')} "
                f"{e.get('agent_id', '-')} {e['action']}: (body past retention; leaf kept)  ({e['id']}, #{e['seq']})")
    what = e.get("key") or ",".join(e.get("tags") or []) or "-"
    verdict = "ALLOW" if e.get("allowed") else "DENY "
    return (f"{e.get('timestamp', '-')} {verdict} {e.get('session_id', '-')} {e.get('agent_id', '-')} "
            f"{e['action']} {what}: {e.get('reason', '')}" + (f" [{e['detail']}]" if e.get("detail") else "")
            + f"  ({e['id']})")


def _emit(events: list[dict[str, Any]], *, as_json: bool, lines: bool) -> None:
    if as_json and not lines:
        print(json.dumps(events, indent=2))
    else:
        for e in events:
            print(json.dumps(e, separators=(",", ":")) if as_json else _line(e))
    sys.stdout.flush()


def _show(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    flt = _filter(args)
    audit = open_audit(paths, _cfg(paths))  # migrates an older version's audit_logs table on open
    stop = _Stop() if args.follow else None
    try:
        if flt.session_id is not None and not audit.session_known(flt.session_id):
            raise UompError(ErrorCode.SESSION_NOT_FOUND, f"no session {flt.session_id[:80]} in the audit log; see "
                            "'uomp sessions list'")
        events, pruned, cursor = _newest(audit, flt, args.limit, include_pruned=args.include_pruned)
        _emit(events, as_json=args.json, lines=args.follow)
        if pruned:
            print(f"({pruned} older matching event(s) past retention not shown: their bodies are pruned, their "
                  "leaves kept so earlier proofs still verify; --include-pruned lists them)", file=sys.stderr)
        if stop is None:
            return 0
        while not stop.wait(FOLLOW_INTERVAL):
            while True:  # drain: a burst larger than one page is shown at once, in order
                page = audit.query(dataclasses.replace(flt, after_seq=cursor, limit=MAX_LIMIT),
                                   include_pruned=args.include_pruned)
                _emit(page.events, as_json=args.json, lines=True)
                cursor = page.cursor
                if len(page.events) < MAX_LIMIT or stop.is_set():
                    break
        return 0
    finally:
        if stop is not None:
            stop.restore()
        audit.close()


def _newest(audit: AuditLog, flt: AuditFilter, want: int, *, include_pruned: bool
            ) -> tuple[list[dict[str, Any]], int, int]:
    """The newest ``want`` matching events (newest last), how many matching ones are pruned, and the
    cursor after them. Above one page (1000) the log is paged through from the start, keeping the
    newest ``want`` only."""
    if want <= MAX_LIMIT:
        page = audit.query(flt, include_pruned=include_pruned)
        return page.events, page.pruned, page.cursor
    tail: collections.deque[dict[str, Any]] = collections.deque(maxlen=want)
    cursor, pruned, first = 0, 0, True
    while True:
        page = audit.query(dataclasses.replace(flt, after_seq=cursor, limit=MAX_LIMIT), include_pruned=include_pruned)
        tail.extend(page.events)
        cursor = page.cursor
        if first:
            pruned, first = page.pruned, False
        if len(page.events) < MAX_LIMIT:
            return list(tail), pruned, cursor


class _Stop:
    """--follow ends cleanly on Ctrl-C or SIGTERM (exit 0): the signal only sets an event."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._old = {sig: signal.signal(sig, self._set) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _set(self, signum: int, frame: Any) -> None:
        self._event.set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)

    def is_set(self) -> bool:
        return self._event.is_set()

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _ro(paths: Paths) -> sqlite3.Connection:
    if not paths.audit_db.exists():
        raise UompError(ErrorCode.NOT_FOUND, f"no audit log at {paths.audit_db}; run 'uomp init'")
    conn = sqlite3.connect(f"file:{paths.audit_db}?mode=ro", uri=True, isolation_level=None)
    return conn


def _backend(acfg: AnchorConfig, *, rpc: str | None = None, contract: str | None = None,
             chain_id: Any = None, kind: str | None = None) -> Any:
    from gateway.anchor.ops import make_backend

    kind = kind or acfg.backend
    if kind == "none":
        return None
    cid = chain_id if chain_id is not None else (acfg.chain_id or None)
    if isinstance(cid, str):
        cid = int(cid, 16) if cid.startswith("0x") else int(cid)
    return make_backend(kind, rpc_url=rpc or acfg.rpc_url or None, contract=contract or acfg.contract or None,
                        chain_id=cid, account=acfg.account or None, confirmations=acfg.confirmations)


async def _verify_anchors(conn: sqlite3.Connection, backend: Any) -> tuple[int, list[str]]:
    from gateway.anchor.base import Anchor, AnchorError

    problems: list[str] = []
    checked = 0
    rows = conn.execute("SELECT a.size, a.ref, c.note FROM ledger_anchors a JOIN ledger_checkpoints c"
                        " ON c.size = a.size WHERE a.state = 'confirmed' AND a.ref IS NOT NULL ORDER BY a.size"
                        ).fetchall()
    try:
        for size, ref, note in rows:
            try:
                await backend.verify(Anchor.for_checkpoint(str(note)), str(ref))
                checked += 1
            except AnchorError as exc:
                problems.append(f"anchor of checkpoint {size} (tx {ref}): {exc.code}: {exc.message}")
    finally:
        await backend.close()
    return checked, problems


def _verify(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    key = auditkey.load(paths)
    origin = auditkey.origin_for(key.public_key())
    conn = _ro(paths)
    try:
        report = verify_log(conn, origin=origin, public_key=key.public_key())
        acfg = load_section(AnchorConfig, "anchor", file=paths.config_file)
        anchored: tuple[int, list[str]] = (0, [])
        backend = _backend(acfg, rpc=args.rpc) if (acfg.backend != "none" or args.rpc) else None
        if backend is not None:
            anchored = asyncio.run(_verify_anchors(conn, backend))
    finally:
        conn.close()
    problems = report.problems + anchored[1]
    out: dict[str, Any] = {"ok": report.ok and not anchored[1], "events": report.events, "pruned_bodies": report.pruned,
           "checkpoints": report.checkpoints, "anchors_verified": anchored[0], "first_bad_seq": report.first_bad_seq,
           "problems": problems, "origin": origin,
           "verifier_key": EventLog(_mem(), origin=origin, key=key).verifier_key()}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        state = "OK" if out["ok"] else "FAILED"
        print(f"audit log {state}: {report.events} events ({report.pruned} past retention, leaves kept), "
              f"{report.checkpoints} signed checkpoints, {anchored[0]} anchors checked on chain")
        if report.first_bad_seq is not None:
            print(f"first bad event: #{report.first_bad_seq}")
        for p in problems:
            print(f"  - {p}")
        print(f"verifier key: {out['verifier_key']}")
    return 0 if out["ok"] else 1


def _mem() -> sqlite3.Connection:
    return sqlite3.connect(":memory:", isolation_level=None)


def proof_bundle(paths: Paths, event_id: str, *, sign_if_stopped: bool = False) -> dict[str, Any]:
    """The self-contained proof bundle of one event (``uomp audit proof``, the dashboard's download).

    An event not yet in a signed checkpoint: while a guard runs it signs one within
    ``audit_checkpoint_seconds`` (PROOF_PENDING, retry). With ``sign_if_stopped`` and no guard
    running, this process signs it (it holds the same audit key): under the appliance lock, so no
    ``uomp gateway start`` begins meanwhile, and only when nothing answers on the guard's socket (a
    guard started on its own, ``uomp guard serve``, holds no appliance lock)."""
    key = auditkey.load(paths)
    conn = sqlite3.connect(paths.audit_db, isolation_level=None, timeout=_cfg(paths).db_busy_timeout_seconds)
    try:
        log = EventLog(conn, origin=auditkey.origin_for(key.public_key()), key=key,
                       anchor_backend=load_section(AnchorConfig, "anchor", file=paths.config_file).backend)
        try:
            return log.proof_bundle(event_id, chain=anchor_chain(paths))
        except LedgerError as exc:
            if exc.code != ErrorCode.PROOF_PENDING or not sign_if_stopped:
                raise ledger_refusal(exc) from None
        _sign_while_stopped(paths, conn, log)
        try:
            return log.proof_bundle(event_id, chain=anchor_chain(paths))
        except LedgerError as exc:
            raise ledger_refusal(exc) from None
    finally:
        conn.close()


def _sign_while_stopped(paths: Paths, conn: sqlite3.Connection, log: EventLog) -> None:
    """Sign a checkpoint of the whole log, only with no guard running (see :func:`proof_bundle`)."""
    from gateway import appliance
    from gateway.netutil import socket_is_live

    pending = UompError(ErrorCode.STORE_BUSY, "the event is not in a signed checkpoint yet; the running guard "
                        "signs one within audit_checkpoint_seconds: try again shortly",
                        details={"reason": "PROOF_PENDING"})
    lock = appliance.ApplianceLock(paths)
    try:
        lock.acquire()
    except UompError as exc:
        if exc.code == ErrorCode.ALREADY_RUNNING:
            raise pending from None
        raise
    try:
        if socket_is_live(paths.guard_sock):
            raise pending
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                log.reload()
                log.checkpoint(time.time())
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                log.reload()
                raise
        except LedgerError as exc:
            raise ledger_refusal(exc) from None
        except sqlite3.Error as exc:
            from gateway.db import db_error

            raise db_error(exc, what="audit log") from exc
    finally:
        lock.release()


def _proof(args: argparse.Namespace) -> int:
    bundle = proof_bundle(paths_from(args), args.target, sign_if_stopped=True)
    data = json.dumps(bundle, indent=2).encode() + b"\n"
    if args.out:
        atomic_write(Path(args.out), data, mode=0o600)
        anchored = bundle["anchor"]
        print(f"proof of {args.target} (event #{bundle['event']['seq']}) written to {args.out}: checkpoint of "
              f"{bundle['tree_size']} events" + (f", anchored in tx {anchored['tx']}" if anchored else
                                                 ", not anchored on a chain"))
    else:
        sys.stdout.write(data.decode())
    return 0


def _verify_proof(args: argparse.Namespace) -> int:
    path = Path(args.target)
    try:
        raw = path.read_bytes()[: MAX_BUNDLE_BYTES + 1]
    except OSError as exc:
        raise UompError(ErrorCode.NOT_FOUND, f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_BUNDLE_BYTES:
        raise UompError(ErrorCode.INVALID_REQUEST, f"{path} is larger than a proof bundle can be")
    try:
        bundle = json.loads(raw)
    except ValueError:
        raise UompError(ErrorCode.INVALID_REQUEST, f"{path} is not JSON") from None
    trusted = args.key
    if trusted is None and not args.no_local_key:
        try:
            paths = paths_from(args)
            k = auditkey.load(paths)
            trusted = EventLog(_mem(), origin=auditkey.origin_for(k.public_key()), key=k).verifier_key()
        except UompError:
            trusted = None
    try:
        proof = verify_bundle(bundle, trusted_key=trusted)
    except ProofBundleError as exc:
        print(f"proof INVALID: {exc}")
        return 1
    lines = [f"proof OK: event #{proof.seq} ({proof.event.get('action')}, {proof.event.get('timestamp', '')}) is in "
             f"the log of {proof.checkpoint.origin}, checkpoint of {proof.checkpoint.size} events"]
    if trusted is None:
        lines.append("  note: checked against the bundle's own key; pass --key with your appliance's verifier key "
                     "(shown by 'uomp audit verify') to know it is yours")
    anchor = proof.anchor
    if anchor:
        if args.rpc:
            from gateway.anchor.base import Anchor, AnchorError

            backend = _backend(AnchorConfig(), rpc=args.rpc, contract=anchor.get("contract"),
                               chain_id=anchor.get("chain_id"), kind=str(anchor.get("backend", "evm")))

            async def check() -> None:
                try:
                    await backend.verify(Anchor.for_checkpoint(str(bundle["checkpoint"])), str(anchor["tx"]))
                finally:
                    await backend.close()
            try:
                asyncio.run(check())
            except AnchorError as exc:
                print(f"proof INVALID on chain: {exc.code}: {exc.message}")
                return 1
            lines.append(f"  anchored: tx {anchor['tx']} checked on chain (contract {anchor.get('contract')})")
        else:
            lines.append(f"  anchored in tx {anchor['tx']} (not checked: pass --rpc URL to check it on chain)")
    else:
        lines.append("  not anchored on a chain (signed checkpoint only)")
    print("\n".join(lines))
    return 0


def _audit(args: argparse.Namespace) -> int:
    if args.action is None:
        if args.target:
            raise UompError(
                ErrorCode.INVALID_REQUEST, "unknown audit action; use verify, proof EVENT_ID or verify-proof FILE")
        return _show(args)
    if args.action in ("proof", "verify-proof") and not args.target:
        raise UompError(ErrorCode.INVALID_REQUEST, f"'uomp audit {args.action}' needs "
                        + ("an event id (shown by 'uomp audit')" if args.action == "proof" else "a bundle file"))
    return {"verify": _verify, "proof": _proof, "verify-proof": _verify_proof}[args.action](args)


def _anchor(args: argparse.Namespace) -> int:
    from gateway.anchor.ops import anchor_deploy, anchor_status

    paths = paths_from(args)
    acfg = load_section(AnchorConfig, "anchor", file=paths.config_file)
    if args.anchor_command == "deploy":
        rpc = args.rpc or acfg.rpc_url
        key_file = args.key_file or acfg.key_file
        if not rpc or not key_file:
            raise UompError(
                ErrorCode.CONFIG_ERROR, "deploy needs --rpc URL and --key-file FILE (or [anchor] rpc_url/key_file)")
        out = asyncio.run(anchor_deploy(rpc, Path(key_file), chain_id=acfg.chain_id or None))
        print(json.dumps(out, indent=2))
        print(f"next: set [anchor] backend = \"evm\", contract = \"{out.get('contract')}\", chain_id = "
              f"{out.get('chain_id')} in {paths.config_file} and restart the appliance", file=sys.stderr)
        return 0
    conn = _ro(paths)
    try:
        from gateway.ledger.anchoring import backlog

        status: dict[str, Any] = {"backend": acfg.backend, "backlog": backlog(conn)}
    except sqlite3.Error:
        status = {"backend": acfg.backend, "backlog": None}
    finally:
        conn.close()
    backend = _backend(acfg)
    if backend is not None:
        async def live() -> dict[str, Any]:
            try:
                return await anchor_status(backend)
            finally:
                await backend.close()
        status["chain"] = asyncio.run(live())
    print(json.dumps(status, indent=2, default=str))
    return 0


def _init_key(paths: Paths) -> dict[str, bool]:
    return {"audit signing key (.secrets/audit-ed25519.key)": auditkey.ensure(paths)}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from gateway.cli import home

    if _init_key not in home.INIT_HOOKS:
        home.INIT_HOOKS.append(_init_key)
    a = sub.add_parser("audit", help="what agents asked for and got; verify the log; proofs for one event",
                       description="uomp audit [filters] [--json] [--follow]: the events of the audit log (every "
                       "decision of the guard and the gateway, session events, your own commands), newest last, "
                       "the newest --limit of them. Filters combine (AND). "
                       "uomp audit verify: check the whole log (leaves, tree, signed checkpoints, anchors). "
                       "uomp audit proof EVENT_ID --out FILE: a self-contained proof bundle. "
                       "uomp audit verify-proof FILE [--rpc URL]: check a bundle with nothing else.",
                       epilog="Times: ISO 8601 (2026-12-01, 2026-12-01T08:00:00Z; no zone = UTC) or a duration "
                       "before now (90s, 15m, 1h, 2d, 1w). Events older than [guard] audit_retention_days (default "
                       "90) keep only their leaf hash: they are counted, not shown, unless --include-pruned.")
    a.add_argument("action", nargs="?", choices=["verify", "proof", "verify-proof"], help="what to do")
    a.add_argument("target", nargs="?", help="EVENT_ID for proof, FILE for verify-proof")
    a.add_argument("--session", help="only this session's events (an unknown session is SESSION_NOT_FOUND)")
    a.add_argument("--agent", help="only this agent's events")
    a.add_argument("--action", dest="action_filter", action="append", metavar="ACTION",
                   help="only these actions (read, aggregate, session_granted, ...; comma-separated or repeated)")
    verdict = a.add_mutually_exclusive_group()
    verdict.add_argument("--allowed", action="store_true", help="only allowed events")
    verdict.add_argument("--refused", action="store_true", help="only refused events")
    a.add_argument("--since", metavar="TIME", help="only events at or after TIME")
    a.add_argument("--until", metavar="TIME", help="only events before TIME")
    a.add_argument("--limit", type=int, default=100, help="how many of the newest matching events (default 100; "
                   "above 1000 the log is paged through)")
    a.add_argument("--include-pruned", action="store_true",
                   help="also list events past retention (id, time, action, session, agent, verdict only)")
    a.add_argument("--follow", "-f", action="store_true",
                   help="then keep printing new matching events as they are written, until Ctrl-C or SIGTERM "
                   "(with --json: one JSON object per line)")
    a.add_argument("--json", action="store_true", help="JSON output: one array, newest last (JSON lines with "
                   "--follow)")
    a.add_argument("--out", help="proof: write the bundle here (0600) instead of standard output")
    a.add_argument("--rpc", help="verify / verify-proof: chain RPC URL to check anchors against")
    a.add_argument("--key", help="verify-proof: the appliance's verifier key you trust (name+id+key)")
    a.add_argument("--no-local-key", action="store_true",
                   help="verify-proof: do not use this machine's audit key (checking a bundle from elsewhere)")
    a.set_defaults(func=_audit)

    n = sub.add_parser("anchor", help="anchoring the audit log's checkpoints on a chain (docs/anchoring.md)")
    nsub = n.add_subparsers(dest="anchor_command", metavar="ACTION", required=True)
    d = nsub.add_parser("deploy", help="deploy the UompAnchor contract (EVM) owned by --key-file's account")
    d.add_argument("--rpc", help="the chain's JSON-RPC URL")
    d.add_argument("--key-file", help="0600 file with the 0x-hex private key of the owner account")
    d.set_defaults(func=_anchor)
    st = nsub.add_parser("status", help="the anchoring backlog and, when a chain is configured, its live state")
    st.set_defaults(func=_anchor)
