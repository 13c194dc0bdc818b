"""``uomp status [--json]``: is the appliance running, where, and is it healthy.

Reads only what the running appliance and the data directory say: the appliance lock and
``gateway/appliance.json`` (pid, listeners), ``gateway/status.json`` (guard health, tunnel state,
written by the running gateway), ``gateway/addresses.json`` (public URLs), the CA registry
(certificate expiries), ``auth.db`` (active sessions) and, at a home that serves a VPS gateway,
``uplink/home-status.json`` (the home side of the uplink, written by ``uomp guard uplink``). Exit
status 0 when the appliance runs and its guard answers, 3 when it is not running, 1 when it runs
but something is unhealthy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

from gateway import appliance, ca_store
from gateway.cli.main import paths_from
from gateway.config import GatewayConfig, Paths, load_section

STALE_STATUS_SECONDS = 30.0  # status.json older than this while "running": the gateway is hung


def _cert_expiry(paths: Paths) -> dict[str, Any] | None:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(ca_store.server_cert_path(paths).read_bytes())
    except (OSError, ValueError):
        return None
    from gateway.core import ca

    left = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    return {
        "not_after": f"{cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}",
        "days_left": left.days,
        "names": sorted(ca.server_cert_names(cert)),
    }


def _agents(paths: Paths) -> list[dict[str, Any]]:
    try:
        rows = ca_store.list_agents(paths)
    except Exception:  # no CA yet, or a registry problem (uomp doctor says which)
        return []
    return [
        {
            "agent_id": r.agent_id,
            "serial": r.serial,
            "not_after": f"{r.not_after:%Y-%m-%dT%H:%M:%SZ}",
            "status": r.status,
        }
        for r in rows
    ]


def _sessions(paths: Paths) -> list[dict[str, Any]] | None:
    if not paths.auth_db.exists():
        return []
    from gateway.cli.guard import open_auth
    from gateway.config import GuardConfig
    from gateway.ledger.integrity import CHANGE_TAIL_EVENTS

    try:
        # only read here: the log's own bounded check is audit_integrity's (the one status reports),
        # so this open reads the short tail of a one-shot command, not the guard's again
        auth = open_auth(
            paths, load_section(GuardConfig, "guard", file=paths.config_file), audit_tail=CHANGE_TAIL_EVENTS
        )
    except Exception:
        return None
    try:
        return [
            {
                "session_id": s["session_id"],
                "agent_id": s["agent_id"],
                "profile": s.get("profile"),
                "expires_at": s["expires_at"],
            }
            for s in auth.list_sessions(status="active")
        ]
    except Exception:
        return None
    finally:
        auth.close_db()
        auth.audit.close()


def _home_uplink(paths: Paths) -> dict[str, Any] | None:
    """The home side of the uplink (``uomp guard uplink``) as ``uplink/home-status.json`` says, read
    as the dashboard reads it; None when this home never ran one."""
    from gateway.uplink import homestatus

    return homestatus.read(paths)


def _keys_at_rest(paths: Paths) -> dict[str, object] | None:
    from gateway.atrest import vault

    return vault.at_rest_state(paths) if paths.secrets.exists() else None


def collect(paths: Paths) -> dict[str, Any]:
    """Everything ``uomp status`` reports, as one document (running, addresses, guard health,
    certificates, sessions)."""
    gcfg = load_section(GatewayConfig, "gateway", file=paths.config_file)
    running = appliance.is_running(paths)
    run = appliance.read_run(paths) if running else None
    status: dict[str, Any] | None = None
    try:
        status = json.loads(paths.gateway_status.read_text())
    except (OSError, ValueError):
        status = None
    if status is not None and not running:
        status = None  # left by a stopped gateway
    guard = (status or {}).get("guard")
    upstream = (status or {}).get("upstream")
    stale = False
    if status and status.get("updated_at"):
        try:
            updated = dt.datetime.strptime(status["updated_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
            stale = time.time() - updated.timestamp() > STALE_STATUS_SECONDS
        except ValueError:
            stale = False
    audit_log = audit_integrity(paths)
    healthy = bool(running and upstream and upstream.get("up") and not stale and audit_log.get("ok") is not False)
    return {
        "home": str(paths.home),
        "initialised": paths.private_jwk.exists(),
        "running": running,
        "pid": run.get("pid") if run else None,
        "started_at": run.get("started_at") if run else None,
        "listeners": run.get("listeners") if run else {},
        "healthy": healthy,
        "status_file_stale": stale,
        "guard": {
            "reachable": upstream.get("up") if upstream else None,
            "last_error": upstream.get("last_error") if upstream else None,
            **(
                {
                    "pid": guard.get("pid"),
                    "restarts": guard.get("restarts"),
                    "last_restart_reason": guard.get("last_restart_reason"),
                }
                if guard
                else {}
            ),
        },
        "uplink": (status or {}).get("uplink"),
        "home_uplink": _home_uplink(paths),
        "public_urls": appliance.public_urls(paths, gcfg),
        "tunnel": (
            (status or {}).get("tunnel") or (run or {}).get("tunnel") or appliance.load_addresses(paths)["tunnel"]
        ),
        "endpoints": (run or {}).get("endpoints") or appliance.accepted_endpoints(paths, gcfg),
        "gateway_certificate": _cert_expiry(paths),
        "agent_certificates": _agents(paths),
        "active_sessions": _sessions(paths),
        "anchoring": _anchoring(paths),
        "audit_log": audit_log,
        "keys_at_rest": _keys_at_rest(paths),
    }


def audit_integrity(paths: Paths) -> dict[str, Any]:
    """The audit log's bounded integrity check (gateway/ledger/integrity.py) on the files, read-only:
    what the guard checks at start, so a refused log shows whether or not the appliance runs."""
    from gateway.errors import UompError
    from gateway.ledger import auditkey, integrity

    if not paths.audit_key.exists():
        return {"ok": True, "events": 0, "witness_size": None}
    try:
        key = auditkey.load(paths)
    except UompError as exc:
        return {"ok": None, "message": exc.message}
    pub = key.public_key()
    state = integrity.home_state(paths.audit_db, paths.audit_witness, origin=auditkey.origin_for(pub), public_key=pub)
    if state.get("ok") is not False:
        refused = _guard_refusal(paths)  # what a running guard found since (its full verify in the background)
        if refused is not None:
            details = refused.get("details") if isinstance(refused.get("details"), dict) else {}
            state = {
                **state,
                "ok": False,
                "code": refused.get("code"),
                "message": refused.get("message"),
                "first_bad_seq": (details or {}).get("first_bad_seq"),
                "found_by": "the running guard",
            }
    return state


def _guard_refusal(paths: Paths) -> dict[str, Any] | None:
    """The error body a running guard answers for its audit log (GET /v1/health on guard.sock, 1 s at
    most), None when it serves or does not answer."""
    import socket

    if not paths.guard_sock.exists():
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(str(paths.guard_sock))
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: guard\r\nConnection: close\r\n\r\n")
            data = b""
            while len(data) < 65536 and (chunk := s.recv(65536)):
                data += chunk
    except OSError:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return None
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    err = (
        answer.get("audit", {}).get("error")
        if isinstance(answer, dict) and answer.get("status") == "refusing"
        else None
    )
    return err if isinstance(err, dict) else None


def _anchoring(paths: Paths) -> dict[str, Any]:
    """The audit log's checkpoints and the anchoring backlog (read-only; docs/audit.md)."""
    from gateway import sqldriver
    from gateway.atrest import auditdb
    from gateway.config import AnchorConfig
    from gateway.errors import UompError
    from gateway.ledger.anchoring import backlog, summary

    try:
        backend = load_section(AnchorConfig, "anchor", file=paths.config_file).backend
    except UompError as exc:
        return {"configured": False, "backlog": None, "note": f"[anchor] is invalid: {exc.message}"}
    out: dict[str, Any] = {"configured": backend != "none", "backend": backend, "backlog": None}
    try:
        conn = auditdb.connect(paths.audit_db, readonly=True)
        try:
            cp = conn.execute("SELECT MAX(size) FROM ledger_checkpoints").fetchone()[0]
            out["checkpointed_events"] = int(cp or 0)
            if backend != "none":
                out["backlog"] = backlog(conn)
        finally:
            conn.close()
    except sqldriver.errors(UompError):  # no table yet, or a sealed home not unlocked here
        pass
    if backend == "none":
        out["note"] = (
            f"signed checkpoints only ({out.get('checkpointed_events', 0)} events checkpointed); "
            "set [anchor] to anchor them on a chain (docs/anchoring.md)"
        )
    else:
        b = out["backlog"]
        out["rejected"] = bool(b and b["counts"].get("rejected"))
        out["note"] = f"{backend}: {summary(b)}"
    return out


def _text(s: dict[str, Any]) -> None:
    if not s["initialised"] and Paths(Path(s["home"])).uplink_server_cert.exists():
        print(f"VPS gateway data directory {s['home']} (from 'uomp uplink init'; its guard is at home)")
    elif not s["initialised"]:
        print(
            f"data directory {s['home']} has not been set up: run 'uomp init' (or pass --home / set UOMP_HOME "
            "to the one you use)"
        )
    if s["running"]:
        print(f"appliance: running (pid {s['pid']}, since {s['started_at']}), data {s['home']}")
    else:
        print(f"appliance: not running (data {s['home']}); start it with: uomp gateway start")
    for name, url in (s["listeners"] or {}).items():
        print(f"  {name:<14} {url}")
    g = s["guard"]
    if s["running"]:
        state = "answers" if g.get("reachable") else f"NOT REACHABLE ({g.get('last_error') or 'unknown'})"
        extra = f", pid {g['pid']}, restarts {g.get('restarts', 0)}" if g.get("pid") else ""
        print(
            f"guard: {state}{extra}"
            + (f"; last restart: {g['last_restart_reason']}" if g.get("last_restart_reason") else "")
        )
        if s["status_file_stale"]:
            print("  !! the status file has not been updated for a while: the gateway may be hung")
    up = s.get("uplink")
    if s["running"] and up:
        state = "home side connected" if up.get("connected") else f"NO HOME SIDE ({up.get('last_error') or 'never'})"
        print(
            f"uplink: {state}; {up.get('connects', 0)} connections accepted, {up.get('refused', 0)} refused, "
            f"{up.get('in_flight', 0)} requests in flight"
        )
    h = s.get("home_uplink")
    if h:
        if not h["running"]:
            state = f"home side NOT RUNNING (start it: uomp guard uplink {h['target']}; last status {h['updated_at']})"
        elif h["connected"]:
            state = f"connected since {h['connected_since']}"
        else:
            state = "NOT CONNECTED, dialling again"
        print(
            f"uplink to {h['target']}: {state}; {h['reconnects']} reconnect(s), {h['failures']} failed dial(s)"
            + (f"; last error: {h['last_error']}" if h["last_error"] else "")
        )
    for u in s["public_urls"]:
        print(f"public URL: {u} (mTLS)")
    t = s["tunnel"]
    if t:
        print(
            f"tunnel: {t.get('mode')} {t.get('status', 'recorded')} {t.get('public_url') or t.get('url') or ''}"
            + (f" ({t['last_error']})" if t.get("last_error") else "")
        )
    else:
        print("tunnel: none")
    print(f"accepted endpoints: {', '.join(s['endpoints'])}")
    c = s["gateway_certificate"]
    if c:
        print(f"gateway certificate: until {c['not_after']} ({c['days_left']} days), names {', '.join(c['names'])}")
    else:
        print("gateway certificate: none yet (uomp init)")
    active = [a for a in s["agent_certificates"] if a["status"] == "active"]
    print(f"agent certificates: {len(active)} active of {len(s['agent_certificates'])}")
    for a in active:
        print(f"  {a['agent_id']:<24} until {a['not_after']}  serial {a['serial']}")
    sessions = s["active_sessions"]
    if sessions is None:
        print("active sessions: unknown (auth.db could not be read; uomp doctor)")
    else:
        print(f"active sessions: {len(sessions)}")
        for x in sessions[:20]:
            print(f"  {x['session_id']:<24} {x['agent_id']:<24} {x.get('profile') or '-':<7} until {x['expires_at']}")
    if s["keys_at_rest"] is not None:
        from gateway.atrest import vault

        print(vault.describe_state(s["keys_at_rest"]))
    print(f"anchoring: {s['anchoring']['note']}")
    if s["anchoring"].get("rejected"):
        print("  !! anchors REJECTED: the chain does not show what the node claimed; see 'uomp anchor status'")
    a = s["audit_log"]
    if a.get("ok") is False:
        print(f"audit log: REFUSED {a['code']}: {a['message']}")
    elif a.get("ok") is None:
        print(f"audit log: not checked ({a.get('message')})")
    else:
        print(
            f"audit log: {a.get('events', 0)} events, tail checked, consistent with the witness record"
            + (f" at {a['witness_size']} events" if a.get("witness_size") is not None else " (none yet)")
        )


def _status(args: argparse.Namespace) -> int:
    paths = paths_from(args, needs_init=False)
    s = collect(paths)
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        _text(s)
    if not s["running"]:
        return 3
    return 0 if s["healthy"] else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp status`` to the command line."""
    p = sub.add_parser(
        "status",
        help="is the appliance running, where, its tunnel, guard health, certificates, "
        "sessions (exit 0 healthy, 1 unhealthy, 3 not running)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_status)
