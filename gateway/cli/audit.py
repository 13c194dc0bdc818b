"""``uomp audit [verify | proof EVENT_ID | verify-proof FILE]`` and ``uomp anchor deploy|status``.

``uomp audit`` shows what agents asked for and what they got; ``verify`` checks the whole
verifiable event log (every leaf, the tree, every signed checkpoint, and each anchored root against
the chain when one is configured); ``proof`` writes a self-contained bundle for one event, which
``verify-proof`` checks with nothing else (and, with ``--rpc``, against the chain).

Longer than ~500 lines on purpose: every action of ``uomp audit`` and ``uomp anchor`` reads the same
log with the same trust roots and prints findings the same way; the checks themselves live in
:mod:`gateway.ledger`.
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

from gateway import sqldriver
from gateway.atrest import auditdb, writers
from gateway.cli.main import paths_from
from gateway.config import AnchorConfig, GuardConfig, Paths, load_section
from gateway.core import merkle
from gateway.core.checkpoint import Checkpoint, NoteError
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write
from gateway.guard.audit import AuditLog, anchor_chain, ledger_refusal, open_audit_writing
from gateway.ledger import auditkey, cosign, integrity
from gateway.ledger import tree as stored_tree
from gateway.ledger.log import EventLog, LedgerError
from gateway.ledger.query import MAX_LIMIT, AuditFilter, parse_time
from gateway.ledger.verify import ProofBundleError, TrustedCheckpoint, verify_bundle, verify_log

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
        session_id=args.session,
        agent_id=args.agent,
        action=actions,
        allowed=True if args.allowed else (False if args.refused else None),
        since=parse_time(args.since, now=now) if args.since else None,
        until=parse_time(args.until, now=now) if args.until else None,
        limit=min(args.limit, MAX_LIMIT),
    ).checked()


def _described(flt: AuditFilter) -> str:
    """The filters of an empty answer, in words (an empty screen says nothing)."""

    def at(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

    parts = [f"{name} {value}" for name, value in (("session", flt.session_id), ("agent", flt.agent_id)) if value]
    if flt.action:
        parts.append("action " + ",".join(flt.action))
    if flt.allowed is not None:
        parts.append("allowed only" if flt.allowed else "refused only")
    if flt.since is not None:
        parts.append(f"since {at(flt.since)}")
    if flt.until is not None:
        parts.append(f"until {at(flt.until)}")
    return f" ({'; '.join(parts)})" if parts else " (the log is empty)"


def _line(e: dict[str, Any]) -> str:
    if e.get("pruned"):
        return (
            f"{e['timestamp']} {'ALLOW' if e.get('allowed') else 'DENY '} {e.get('session_id', '-')} "
            f"{e.get('agent_id', '-')} {e['action']}: (body past retention; leaf kept)  ({e['id']}, #{e['seq']})"
        )
    what = e.get("key") or ",".join(e.get("tags") or []) or "-"
    verdict = "ALLOW" if e.get("allowed") else "DENY "
    return (
        f"{e.get('timestamp', '-')} {verdict} {e.get('session_id', '-')} {e.get('agent_id', '-')} "
        f"{e['action']} {what}: {e.get('reason', '')}"
        + (f" [{e['detail']}]" if e.get("detail") else "")
        + f"  ({e['id']})"
    )


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
    # migrates an older version's audit_logs table on open (a writer); a refused log is still shown, said so
    audit = open_audit_writing(paths, _cfg(paths), strict=False)
    if audit.integrity is not None:
        print(f"!! {audit.integrity.code}: {audit.integrity.message}", file=sys.stderr)
    stop = _Stop() if args.follow else None
    try:
        if flt.session_id is not None and not audit.session_known(flt.session_id):
            raise UompError(
                ErrorCode.SESSION_NOT_FOUND,
                f"no session {flt.session_id[:80]} in the audit log; see 'uomp sessions list'",
            )
        events, pruned, cursor, damaged = _newest(audit, flt, args.limit, include_pruned=args.include_pruned)
        _emit(events, as_json=args.json, lines=args.follow)
        if not events and not args.json:
            print(f"no audit events match{_described(flt)}", file=sys.stderr)
        if damaged:
            print(
                f"!! {damaged} matching event(s) left out: their rows do not match their signed bodies (edited); "
                "run 'uomp audit verify'",
                file=sys.stderr,
            )
        if pruned:
            print(
                f"({pruned} older matching event(s) past retention not shown: their bodies are pruned, their "
                "leaves kept so earlier proofs still verify; --include-pruned lists them)",
                file=sys.stderr,
            )
        if stop is None:
            return 0
        while not stop.wait(FOLLOW_INTERVAL):
            while True:  # drain: a burst larger than one page is shown at once, in order
                page = audit.query(
                    dataclasses.replace(flt, after_seq=cursor, limit=MAX_LIMIT), include_pruned=args.include_pruned
                )
                _emit(page.events, as_json=args.json, lines=True)
                cursor = page.cursor
                if len(page.events) < MAX_LIMIT or stop.is_set():
                    break
        return 0
    finally:
        if stop is not None:
            stop.restore()
        audit.close()


def _newest(
    audit: AuditLog, flt: AuditFilter, want: int, *, include_pruned: bool
) -> tuple[list[dict[str, Any]], int, int, int]:
    """The newest ``want`` matching events (newest last), how many matching ones are pruned, and the
    cursor after them. Above one page (1000) the log is paged through from the start, keeping the
    newest ``want`` only."""
    if want <= MAX_LIMIT:
        page = audit.query(flt, include_pruned=include_pruned)
        return page.events, page.pruned, page.cursor, page.damaged
    tail: collections.deque[dict[str, Any]] = collections.deque(maxlen=want)
    cursor, pruned, first, damaged = 0, 0, True, 0
    while True:
        page = audit.query(dataclasses.replace(flt, after_seq=cursor, limit=MAX_LIMIT), include_pruned=include_pruned)
        tail.extend(page.events)
        damaged += page.damaged
        cursor = page.cursor
        if first:
            pruned, first = page.pruned, False
        if len(page.events) + page.damaged < MAX_LIMIT:
            return list(tail), pruned, cursor, damaged


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
    conn: sqlite3.Connection = auditdb.connect(paths.audit_db, readonly=True)
    return conn


def _backend(
    acfg: AnchorConfig,
    *,
    rpc: str | None = None,
    contract: str | None = None,
    chain_id: Any = None,
    kind: str | None = None,
    code_hash: str | None = None,
    rpc_attempts: int | None = None,
) -> Any:
    from gateway.anchor.ops import make_backend

    kind = kind or acfg.backend
    if kind == "none":
        return None
    cid = chain_id if chain_id is not None else (acfg.chain_id or None)
    if isinstance(cid, str):
        try:
            cid = int(cid, 16) if cid.startswith("0x") else int(cid)
        except ValueError:
            raise UompError(ErrorCode.INVALID_REQUEST, "--chain-id must be a decimal or 0x-hex integer") from None
    return make_backend(
        kind,
        rpc_url=rpc or acfg.rpc_url or None,
        contract=contract or acfg.contract or None,
        chain_id=cid,
        account=acfg.account or None,
        confirmations=acfg.confirmations,
        code_hash=code_hash or acfg.code_hash or None,
        rpc_attempts=rpc_attempts,
    )


async def _verify_anchors(conn: sqlite3.Connection, backend: Any) -> tuple[int, list[str]]:
    """Every confirmed anchor of the local table on chain, then the log against the newest anchor
    the chain itself holds (so a rollback that also deleted the local anchor rows is found)."""
    from gateway.anchor.base import AnchorError
    from gateway.ledger.anchoring import anchor_for, check_facts
    from gateway.ledger.verify import check_anchored_head

    problems: list[str] = []
    checked = 0
    newest = getattr(backend, "newest_anchor", None)
    if newest is not None:
        try:
            head = await newest()
            if head is not None:
                problem = check_anchored_head(conn, head["tree_size"], head["root"])
                if problem:
                    problems.append(f"{problem} (chain anchor in tx {head['tx']})")
        except AnchorError as exc:
            problems.append(f"the chain's newest anchor could not be read: {exc.code}: {exc.message}")
    rows = conn.execute(
        "SELECT a.size, a.ref, c.note FROM ledger_anchors a JOIN ledger_checkpoints c"
        " ON c.size = a.size WHERE a.state = 'confirmed' AND a.ref IS NOT NULL ORDER BY a.size"
    ).fetchall()
    try:
        for size, ref, note in rows:
            try:
                await backend.verify(anchor_for(conn, int(size), str(note)), str(ref))
                checked += 1
            except AnchorError as exc:
                problems.append(f"anchor of checkpoint {size} (tx {ref}): {exc.code}: {exc.message}")
        # The §18.4.1 events: each on chain is an audit event's, each confirmed one is on chain.
        chain_events: list[dict[str, Any]] | None = None
        listing = getattr(backend, "contract_events", None)
        if listing is not None:
            try:
                chain_events = await listing()
            except AnchorError as exc:
                problems.append(f"the contract's events could not be read: {exc.code}: {exc.message}")
        problems.extend(check_facts(conn, chain_events))
    finally:
        await backend.close()
    return checked, problems


def _verify(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    key = auditkey.load(paths)
    origin = auditkey.origin_for(key.public_key())
    trusted: list[TrustedCheckpoint] = []
    witness_problem: str | None = None
    external_warning: str | None = None
    try:
        witness = integrity.read_witness(paths.audit_witness, origin=origin, public_key=key.public_key())
    except UompError as exc:
        witness, witness_problem = None, exc.message
    if witness is not None:
        trusted.append(witness.trusted())
    conn = _ro(paths)
    try:
        trusted.extend(extra_trusted_checkpoints(paths, conn))
        configured = _cfg(paths).audit_witness_dir
        wdir = args.witness_dir or configured
        external, external_problem = _external_witness(Path(wdir), origin, key.public_key()) if wdir else (None, None)
        if external is not None:
            trusted.append(external)
        elif external_problem is not None and not args.witness_dir and not cosign.WitnessDir(Path(wdir)).has_cosigned():
            external_warning, external_problem = external_problem, None  # configured, not mounted or not begun
        report = verify_log(conn, origin=origin, public_key=key.public_key(), trusted=trusted)
        if witness_problem is not None:
            report.fail(None, witness_problem, inconsistent=True)
        if external_problem is not None:
            report.fail(None, external_problem, inconsistent=True)
        if external_warning is not None:
            report.warn(f"{external_warning} ([guard] audit_witness_dir)")
        elif witness is None and report.checkpoints:
            report.warn(
                f"no witness record ({paths.audit_witness}): nothing outside audit.db says how far the log "
                "went; the guard starts one at its next start"
            )
        acfg = load_section(AnchorConfig, "anchor", file=paths.config_file)
        anchored: tuple[int, list[str]] = (0, [])
        backend = _backend(acfg, rpc=args.rpc) if (acfg.backend != "none" or args.rpc) and not args.no_chain else None
        if backend is not None and not report.damaged:
            try:
                anchored = asyncio.run(_verify_anchors(conn, backend))
            except sqldriver.DATABASE as exc:
                anchored = (0, [f"the anchors cannot be read ({exc})"])
    finally:
        conn.close()
    problems = report.problems + anchored[1]
    out: dict[str, Any] = {
        "ok": report.ok and not anchored[1],
        "events": report.events,
        "pruned_bodies": report.pruned,
        "checkpoints": report.checkpoints,
        "anchors_verified": anchored[0],
        "first_bad_seq": report.first_bad_seq,
        "problems": problems,
        "warnings": report.warnings,
        "damaged": report.damaged,
        "inconsistent": report.inconsistent,
        "origin": origin,
        "witness_size": witness.checkpoint.size if witness is not None else None,
        "external_witness_size": external.size if external is not None else None,
        "verifier_key": EventLog(_mem(), origin=origin, key=key).verifier_key(),
        "encrypted": auditdb.is_encrypted(paths.audit_db),  # after conn.close(): it reads the file's header
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        state = "OK" if out["ok"] else "FAILED"
        print(
            f"audit log {state}: {report.events} events ({report.pruned} past retention, leaves kept), "
            f"{report.checkpoints} signed checkpoints, {anchored[0]} anchors checked on chain, "
            + (
                f"consistent with the witness record at {witness.checkpoint.size} events"
                if witness is not None and not report.inconsistent
                else ("NOT consistent with the witness record" if witness is not None else "no witness record")
            )
            + (f"; external witness at {external.size} events" if external is not None else "")
        )
        if report.first_bad_seq is not None:
            print(f"first bad event: #{report.first_bad_seq}")
        for p in problems:
            print(f"  - {p}")
        for w in report.warnings:
            print(f"  warning: {w}")
        print(f"verifier key: {out['verifier_key']}")
        print(
            "at rest: " + ("encrypted (SQLCipher, the audit key of the sealed home)" if out["encrypted"] else "plain")
        )
    return 0 if out["ok"] else 1


def extra_trusted_checkpoints(paths: Paths, conn: sqlite3.Connection) -> list[TrustedCheckpoint]:
    """Checkpoints known from outside ``audit.db``, besides the witness record, that the log must
    extend (``verify_log``'s ``trusted``): the hook for the newest anchor read from the chain (not
    from the local anchors table) and for kept checkpoints. None yet."""
    return []


def _external_witness(wdir: Path, origin: str, log_key: Any) -> tuple[TrustedCheckpoint | None, str | None]:
    """The external witness's newest cosigned checkpoint as a trusted checkpoint, once its
    cosignature verifies with the witness key and its signature with the audit key; else the
    problem (an untrusted directory vouches for nothing)."""
    wd = cosign.WitnessDir(wdir)
    try:
        name, wkey = wd.verifier()
        newest = wd.newest(origin=origin, log_key=log_key, name=name, witness_key=wkey)
    except cosign.WitnessDirError as exc:
        return None, f"the external witness is refused: {exc}"
    if newest is None:
        return None, f"the external witness {wdir} has cosigned nothing yet; run 'uomp audit witness --dir {wdir}'"
    return TrustedCheckpoint(newest.checkpoint.size, newest.checkpoint.root, f"the external witness {name}"), None


def _witness_refusal(problem: str, first: int | None, fix: str) -> UompError:
    return UompError(
        ErrorCode.AUDIT_LOG_INCONSISTENT,
        f"nothing cosigned: {problem}; {fix}",
        details={"first_bad_seq": first} if first is not None else None,
    )


def _witness(args: argparse.Namespace) -> int:
    """Cosign the appliance's newest signed checkpoint into ``--dir`` once it verifies and extends
    the last one cosigned there (gateway/ledger/cosign.py). 0: cosigned or up to date; 1: refused."""
    try:
        return _witness_run(args)
    except UompError as exc:
        if not args.json or exc.code != ErrorCode.AUDIT_LOG_INCONSISTENT:
            raise
        print(
            json.dumps(
                {
                    "ok": False,
                    "status": "refused",
                    "code": str(exc.code),
                    "problem": exc.message,
                    "first_bad_seq": (exc.details or {}).get("first_bad_seq"),
                },
                indent=2,
            )
        )
        return 1


def _witness_run(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    args.dir = args.dir or _cfg(paths).audit_witness_dir
    if not args.dir:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            "'uomp audit witness' needs --dir DIR (on another disk or machine) or [guard] audit_witness_dir",
        )
    auditkey.load(paths)  # no witness key is made for a home without an audit key
    wd = cosign.WitnessDir(Path(args.dir))
    made = wd.ensure_key()
    with wd.locked():
        return _witness_locked(args, paths, wd, made)


def _witness_locked(args: argparse.Namespace, paths: Paths, wd: cosign.WitnessDir, made: bool) -> int:
    key = auditkey.load(paths)
    log_key = key.public_key()
    origin = auditkey.origin_for(log_key)
    name, wkey = wd.signer()
    vkey = cosign.verifier_key(name, wkey.public_key())
    fix = (
        f"put back the audit.db that extends what {args.dir} cosigned (docs/audit.md, 'External witness'); "
        "never remove the witness's files to make this pass"
    )
    try:
        last = wd.newest(origin=origin, log_key=log_key, name=name, witness_key=wkey.public_key())
    except cosign.WitnessDirError as exc:
        raise _witness_refusal(str(exc), None, "restore the witness directory from where you keep it") from None
    conn = _ro(paths)
    try:
        row = conn.execute("SELECT note FROM ledger_checkpoints ORDER BY size DESC LIMIT 1").fetchone()
        if row is None and last is not None:
            held = stored_tree.leaf_count(conn)
            raise _witness_refusal(
                f"audit.db holds no signed checkpoint but the witness cosigned "
                f"{last.checkpoint.size} events: events {held + 1}-{last.checkpoint.size} are gone "
                "(rolled back)",
                min(int(held), last.checkpoint.size) + 1,
                fix,
            )
        if row is None:
            raise UompError(
                ErrorCode.NOT_FOUND,
                "the audit log has no signed checkpoint yet; run this again after the appliance has written one",
            )
        note = str(row[0])
        try:
            cp = Checkpoint.open(note, origin, log_key)
        except NoteError as exc:
            raise _witness_refusal(
                f"the newest checkpoint in audit.db is not signed by the audit key ({exc})", None, fix
            ) from None

        node = stored_tree.node_reader(conn)

        status = "cosigned"
        if last is not None:
            old = last.checkpoint
            if cp.size < old.size:
                raise _witness_refusal(
                    f"audit.db's newest checkpoint covers {cp.size} events but the witness cosigned "
                    f"{old.size}: events {cp.size + 1}-{old.size} are gone (rolled back)",
                    cp.size + 1,
                    fix,
                )
            try:
                if cp.size == old.size:
                    if cp.root != old.root:
                        raise merkle.ProofError("another root at the same size")
                else:
                    if merkle.root(node, cp.size) != cp.root:
                        raise merkle.ProofError("the tree does not hold the signed root")
                    merkle.verify_consistency(
                        old.size, cp.size, old.root, cp.root, merkle.consistency_proof(node, old.size, cp.size)
                    )
            except sqldriver.database_errors(merkle.ProofError) as exc:  # a file or tree that does not read
                raise _witness_refusal(
                    f"audit.db's checkpoint at {cp.size} events is not consistent with the one the "
                    f"witness cosigned at {old.size} ({exc}): a forked or replaced log, diverging "
                    f"at or before event {old.size}",
                    old.size,
                    fix,
                ) from None
            if cp.size == old.size:
                status = "up to date"
    finally:
        conn.close()
    if status == "cosigned":
        stamp = max(int(time.time()), last.timestamp if last is not None else 0)
        wd.store(cosign.Cosigned(cosign.cosign(note, name, wkey, stamp), cp, stamp))
    out = {
        "ok": True,
        "status": status,
        "size": cp.size,
        "origin": origin,
        "witness_key": vkey,
        "key_made": made,
        "previous_size": last.checkpoint.size if last is not None else None,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        if made:
            print(f"made the witness key {Path(args.dir) / cosign.KEY_FILE}; its verifier key: {vkey}")
        print(
            f"witness {name}: {status} {origin} at {cp.size} events"
            + (f" (consistent with {last.checkpoint.size})" if last is not None and status == "cosigned" else "")
        )
    return 0


def _mem() -> sqlite3.Connection:
    return sqlite3.connect(":memory:", isolation_level=None)


def proof_bundle(paths: Paths, event_id: str, *, sign_if_stopped: bool = False) -> dict[str, Any]:
    """The self-contained proof bundle of one event (``uomp audit proof``, the dashboard's download).

    An event not yet in a signed checkpoint: while a guard runs it signs one within
    ``audit_checkpoint_seconds`` (PROOF_PENDING, retry). With ``sign_if_stopped`` and no guard
    running, this process signs it (it holds the same audit key): under the appliance lock, so no
    ``uomp gateway start`` begins meanwhile, and only when nothing answers on the guard's socket (a
    guard started on its own, ``uomp guard serve``, holds no appliance lock). A process that may sign
    holds the home's writers' lock (:mod:`gateway.atrest.writers`) from before the log opens, so no
    seal or unseal rewrites audit.db under its checkpoint."""
    if sign_if_stopped:
        with writers.writing(paths):
            return _proof_bundle(paths, event_id, sign_if_stopped=True)
    return _proof_bundle(paths, event_id, sign_if_stopped=False)


def _proof_bundle(paths: Paths, event_id: str, *, sign_if_stopped: bool) -> dict[str, Any]:
    from gateway.ledger.anchoring import ensure_schema

    key = auditkey.load(paths)
    conn = auditdb.connect(paths.audit_db, timeout=_cfg(paths).db_busy_timeout_seconds)
    try:
        log = EventLog(
            conn,
            origin=auditkey.origin_for(key.public_key()),
            key=key,
            anchor_backend=load_section(AnchorConfig, "anchor", file=paths.config_file).backend,
        )
        ensure_schema(conn)  # an anchor confirmed without a recorded check is not bundled
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

    pending = UompError(
        ErrorCode.STORE_BUSY,
        "the event is not in a signed checkpoint yet; the running guard "
        "signs one within audit_checkpoint_seconds: try again shortly",
        details={"reason": "PROOF_PENDING"},
    )
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
            from gateway.ledger import integrity

            key = auditkey.load(paths)
            witness = integrity.read_witness(
                paths.audit_witness, origin=auditkey.origin_for(key.public_key()), public_key=key.public_key()
            )
            conn.execute("BEGIN IMMEDIATE")
            try:
                log.reload()
                # as the guard signs: consistent with the witness record first, the record before the commit
                problem = integrity.witness_problem(conn, log.size, witness)
                if problem is not None:
                    raise problem
                note = log.checkpoint(time.time())
                if note is not None:
                    integrity.write_witness(paths.audit_witness, note)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                log.reload()
                raise
        except LedgerError as exc:
            raise ledger_refusal(exc) from None
        except sqldriver.ERRORS as exc:
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
        print(
            f"proof of {args.target} (event #{bundle['event']['seq']}) written to {args.out}: checkpoint of "
            f"{bundle['tree_size']} events"
            + (f", anchored in tx {anchored['tx']}" if anchored else ", not anchored on a chain")
        )
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
    lines = [
        f"proof OK: event #{proof.seq} ({proof.event.get('action')}, {proof.event.get('timestamp', '')}) is in "
        f"the log of {proof.checkpoint.origin}, checkpoint of {proof.checkpoint.size} events"
    ]
    if trusted is None:
        lines.append(
            "  note: checked against the bundle's own key; pass --key with your appliance's verifier key "
            "(shown by 'uomp audit verify') to know it is yours"
        )
    anchor = proof.anchor
    if anchor:
        roots = _trust_roots(args)
        if roots is None:
            lines.append(
                f"  anchored in tx {anchor['tx']} (not checked: pass --rpc URL, --contract ADDRESS and "
                "--chain-id ID, or set [anchor] in your configuration, to check it on chain)"
            )
        else:
            claim = _claims_differ(anchor, roots)
            if claim:
                print(f"proof INVALID: the bundle's anchor names {claim}, not the one you trust")
                return 1
            from gateway.anchor.base import Anchor, AnchorError

            backend = _backend(
                roots["config"],
                rpc=roots["rpc"],
                contract=roots["contract"],
                chain_id=roots["chain_id"],
                kind=roots["backend"],
                code_hash=roots["code_hash"],
            )

            async def check() -> None:
                try:
                    await backend.verify(
                        Anchor.for_checkpoint(str(bundle["checkpoint"]), checkpoint_only=True), str(anchor["tx"])
                    )
                finally:
                    await backend.close()

            try:
                asyncio.run(check())
            except AnchorError as exc:
                print(f"proof INVALID on chain: {exc.code}: {exc.message}")
                return 1
            lines.append(
                f"  anchored: tx {anchor['tx']} checked on chain {roots['chain_id']} (contract "
                f"{roots['contract']}, from your {roots['source']})"
            )
    else:
        lines.append("  not anchored on a chain (signed checkpoint only)")
    print("\n".join(lines))
    return 0


def _trust_roots(args: argparse.Namespace) -> dict[str, Any] | None:
    """The chain a bundle's anchor is checked on, from flags, else the user's [anchor] settings;
    never from the bundle (its values are claims). None when no RPC, contract or chain id is known."""
    try:
        acfg = load_section(AnchorConfig, "anchor", file=paths_from(args).config_file)
    except UompError:
        acfg = AnchorConfig()
    flags = bool(args.contract or args.chain_id or args.code_hash)
    out = {
        "backend": acfg.backend if acfg.backend != "none" else "evm",
        "rpc": args.rpc or acfg.rpc_url or None,
        "contract": args.contract or acfg.contract or None,
        "chain_id": args.chain_id or (str(acfg.chain_id) if acfg.chain_id else None),
        "code_hash": args.code_hash or acfg.code_hash or None,
        "source": "flags" if flags else "configuration",
        "config": acfg,  # its account (Starknet) and confirmations
    }
    if not (out["rpc"] and out["contract"] and out["chain_id"]):
        return None
    return out


def _claims_differ(anchor: Any, roots: dict[str, Any]) -> str | None:
    """What the bundle claims that contradicts the trusted chain (contract, chain id, backend)."""

    def num(v: Any) -> int | None:
        try:
            return int(v, 16) if isinstance(v, str) and v.startswith("0x") else int(v)
        except (TypeError, ValueError):
            return None

    claimed = anchor.get("contract")
    if claimed is not None and str(claimed).lower() != str(roots["contract"]).lower():
        return f"contract {str(claimed)[:66]}"
    cid = anchor.get("chain_id")
    if cid is not None and num(cid) != num(roots["chain_id"]):
        return f"chain {str(cid)[:66]}"
    kind = anchor.get("backend")
    if kind is not None and kind != roots["backend"]:
        return f"backend {str(kind)[:20]}"
    return None


def _audit(args: argparse.Namespace) -> int:
    if args.action is None:
        if args.target:
            raise UompError(
                ErrorCode.INVALID_REQUEST, "unknown audit action; use verify, proof EVENT_ID or verify-proof FILE"
            )
        return _show(args)
    if args.action in ("proof", "verify-proof") and not args.target:
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"'uomp audit {args.action}' needs "
            + ("an event id (shown by 'uomp audit')" if args.action == "proof" else "a bundle file"),
        )
    return {"verify": _verify, "proof": _proof, "verify-proof": _verify_proof, "witness": _witness}[args.action](args)


def _anchor(args: argparse.Namespace) -> int:
    from gateway.anchor.ops import anchor_deploy, anchor_status

    paths = paths_from(args)
    acfg = load_section(AnchorConfig, "anchor", file=paths.config_file)
    if args.anchor_command == "deploy":
        rpc = args.rpc or acfg.rpc_url
        key_file = args.key_file or acfg.key_file
        if not rpc or not key_file:
            raise UompError(
                ErrorCode.CONFIG_ERROR, "deploy needs --rpc URL and --key-file FILE (or [anchor] rpc_url/key_file)"
            )
        out = asyncio.run(anchor_deploy(rpc, Path(key_file), chain_id=acfg.chain_id or None))
        print(json.dumps(out, indent=2))
        print(
            f'next: set [anchor] backend = "evm", contract = "{out.get("contract")}", chain_id = '
            f'{out.get("chain_id")}, code_hash = "{out.get("code_hash")}" in {paths.config_file} and restart '
            "the appliance",
            file=sys.stderr,
        )
        return 0
    return _anchor_status(paths, acfg, anchor_status)


def _anchor_status(paths: Paths, acfg: AnchorConfig, anchor_status: Any) -> int:
    """The backlog from audit.db (always, the chain reachable or not), then the chain's live view.
    JSON on standard output, a summary on standard error. Exit 0 when the report could be made,
    the chain unreachable included (the backlog waits and catches up: the report says so); 1 when
    anchors are rejected, the contract's code is not the expected one, or the backlog cannot be read."""
    from gateway.anchor.base import AnchorError
    from gateway.ledger.anchoring import backlog, summary

    status: dict[str, Any] = {"backend": acfg.backend, "backlog": None}
    try:
        conn = _ro(paths)
        try:
            status["backlog"] = backlog(conn)
        finally:
            conn.close()
    except sqldriver.errors(UompError) as exc:
        status["backlog_error"] = str(exc)[:200]
    ok = status["backlog"] is not None
    try:
        backend = _backend(acfg, rpc_attempts=1)
    except AnchorError as exc:
        backend, ok = None, False
        status["chain"] = {"reachable": False, "error": exc.code, "message": exc.message}
    if backend is not None:

        async def live() -> dict[str, Any]:
            try:
                out: dict[str, Any] = await anchor_status(backend)
                return out
            finally:
                await backend.close()

        try:
            report: dict[str, Any] = asyncio.run(live())
            status["chain"] = {"reachable": True, **report}
            if report.get("contract_matches_artifact") is False:
                ok = False
        except AnchorError as exc:
            status["chain"] = {"reachable": False, "error": exc.code, "message": exc.message}
    b = status["backlog"]
    if b is not None and b["counts"].get("rejected"):
        ok = False
    print(json.dumps(status, indent=2, default=str))
    lines = [
        f"anchoring: {acfg.backend}: "
        + (summary(b) if b is not None else f"backlog unknown ({status.get('backlog_error', 'no audit log')})")
    ]
    if b is not None and b["backlog_size"]:
        age = b["oldest_pending_seconds"]
        lines.append(
            f"  backlog: {b['backlog_size']} checkpoint(s) to anchor, oldest #{b['oldest_pending_tree_size']}"
            + (f" waiting {age:.0f} s" if age is not None else "")
            + f"; last error: {b['last_error'] or 'none'}"
        )
    chain = status.get("chain")
    if chain is not None and not chain.get("reachable"):
        lines.append(f"  chain NOT REACHABLE: {chain['error']}: {chain['message']} (the backlog waits and catches up)")
    elif chain is not None and not chain.get("contract_matches_artifact", True):
        lines.append("  !! the code at the contract address is not the expected UompAnchor (code hash differs)")
    print("\n".join(lines), file=sys.stderr)
    return 0 if ok else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp audit`` to the command line."""
    a = sub.add_parser(
        "audit",
        help="what agents asked for and got; verify the log; proofs for one event",
        description="uomp audit [filters] [--json] [--follow]: the events of the audit log (every "
        "decision of the guard and the gateway, session events, your own commands), newest last, "
        "the newest --limit of them. Filters combine (AND). "
        "uomp audit verify: check the whole log (leaves, tree, signed checkpoints, anchors). "
        "uomp audit proof EVENT_ID --out FILE: a self-contained proof bundle. "
        "uomp audit verify-proof FILE [--rpc URL]: check a bundle with nothing else. "
        "uomp audit witness --dir DIR: an external witness (DIR on another disk or machine) cosigns "
        "the newest checkpoint once it extends the last one cosigned there.",
        epilog="Times: ISO 8601 (2026-12-01, 2026-12-01T08:00:00Z; no zone = UTC) or a duration "
        "before now (90s, 15m, 1h, 2d, 1w). Events older than [guard] audit_retention_days (default "
        "90) keep only their leaf hash: they are counted, not shown, unless --include-pruned.",
    )
    a.add_argument("action", nargs="?", choices=["verify", "proof", "verify-proof", "witness"], help="what to do")
    a.add_argument("target", nargs="?", help="EVENT_ID for proof, FILE for verify-proof")
    a.add_argument("--session", help="only this session's events (an unknown session is SESSION_NOT_FOUND)")
    a.add_argument("--agent", help="only this agent's events")
    a.add_argument(
        "--action",
        dest="action_filter",
        action="append",
        metavar="ACTION",
        help="only these actions (read, aggregate, session_granted, ...; comma-separated or repeated)",
    )
    verdict = a.add_mutually_exclusive_group()
    verdict.add_argument("--allowed", action="store_true", help="only allowed events")
    verdict.add_argument("--refused", action="store_true", help="only refused events")
    a.add_argument("--since", metavar="TIME", help="only events at or after TIME")
    a.add_argument("--until", metavar="TIME", help="only events before TIME")
    a.add_argument(
        "--limit",
        type=int,
        default=100,
        help="how many of the newest matching events (default 100; above 1000 the log is paged through)",
    )
    a.add_argument(
        "--include-pruned",
        action="store_true",
        help="also list events past retention (id, time, action, session, agent, verdict only)",
    )
    a.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="then keep printing new matching events as they are written, until Ctrl-C or SIGTERM "
        "(with --json: one JSON object per line)",
    )
    a.add_argument("--json", action="store_true", help="JSON output: one array, newest last (JSON lines with --follow)")
    a.add_argument("--out", help="proof: write the bundle here (0600) instead of standard output")
    a.add_argument("--rpc", help="verify / verify-proof: chain RPC URL to check anchors against")
    a.add_argument(
        "--no-chain",
        action="store_true",
        help="verify: the log only, no anchor checked on chain "
        "(what the guard runs in the background after each start)",
    )
    a.add_argument(
        "--dir", help="witness: the witness directory (its key and cosigned checkpoints; another disk or machine)"
    )
    a.add_argument(
        "--witness-dir",
        metavar="DIR",
        help="verify: the log must extend the newest checkpoint the external witness in DIR cosigned",
    )
    a.add_argument("--key", help="verify-proof: the appliance's verifier key you trust (name+id+key)")
    a.add_argument(
        "--no-local-key",
        action="store_true",
        help="verify-proof: do not use this machine's audit key (checking a bundle from elsewhere)",
    )
    a.add_argument("--contract", help="verify-proof: the anchor contract you trust (default: [anchor] contract)")
    a.add_argument("--chain-id", help="verify-proof: the chain id you trust (default: [anchor] chain_id)")
    a.add_argument(
        "--code-hash",
        help="verify-proof: the contract code hash you trust (default: [anchor] "
        "code_hash, else the committed UompAnchor build's)",
    )
    a.set_defaults(func=_audit)

    n = sub.add_parser("anchor", help="anchoring the audit log's checkpoints on a chain (docs/anchoring.md)")
    nsub = n.add_subparsers(dest="anchor_command", metavar="ACTION", required=True)
    d = nsub.add_parser("deploy", help="deploy the UompAnchor contract (EVM) owned by --key-file's account")
    d.add_argument("--rpc", help="the chain's JSON-RPC URL")
    d.add_argument("--key-file", help="0600 file with the 0x-hex private key of the owner account")
    d.set_defaults(func=_anchor)
    st = nsub.add_parser(
        "status",
        help="the anchoring backlog (size, oldest, last error, rejections) and, when a "
        "chain is configured, its live state; JSON on stdout, a summary on stderr (exit 1 when "
        "anchors are rejected or the contract's code differs; an unreachable chain is reported)",
    )
    st.set_defaults(func=_anchor)
