"""What the dashboard shows and does, read from (and written to) the stores the CLI uses, the
same way the CLI does: sessions through the Auth Service on ``auth.db`` (as ``uomp sessions``),
the audit log and its ledger read-only (as ``uomp audit``/``uomp status``), certificates through
:mod:`gateway.ca_store` (as ``uomp agent``), payloads through the guard's admin API on its Unix
socket (as ``uomp payload``: the guard stays the one writer of the payload store and audits the
user's actions). Every function here is blocking; the server runs them in a thread.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway import ca_store
from gateway.config import GuardConfig, Paths, load_section
from gateway.dashboard import words
from gateway.errors import STATUS, UompError

MAX_TIMELINE = 500
PERIODS = {"hour": 3600.0, "day": 86400.0, "week": 7 * 86400.0, "all": 0.0}
SESSION_ACTIONS = ("session_created", "session_granted", "session_revoked", "session_closed", "session_expired")


def _guard_cfg(paths: Paths) -> GuardConfig:
    return load_section(GuardConfig, "guard", file=paths.config_file)


def _ro(paths: Paths) -> sqlite3.Connection | None:
    if not paths.audit_db.exists():
        return None
    conn = sqlite3.connect(f"file:{paths.audit_db}?mode=ro", uri=True, isolation_level=None, timeout=5.0)
    conn.row_factory = sqlite3.Row
    return conn


# ----------------------------------------------------------------------------- sessions


def _reads_left(paths: Paths, session_ids: list[str]) -> dict[str, int]:
    """The latest ``query_count_remaining`` the guard recorded per session (its one quota counter)."""
    conn = _ro(paths)
    if conn is None or not session_ids:
        return {}
    try:
        out: dict[str, int] = {}
        for sid in session_ids:
            row = conn.execute("SELECT query_count_remaining FROM audit_logs WHERE session_id = ? AND "
                               "query_count_remaining IS NOT NULL ORDER BY seq DESC LIMIT 1", (sid,)).fetchone()
            if row is not None:
                out[sid] = int(row[0])
        return out
    except sqlite3.Error:
        return {}
    finally:
        conn.close()


def list_sessions(paths: Paths) -> list[dict[str, Any]]:
    """Every session, newest first, with its scope in words and its quota use."""
    if not paths.auth_db.exists():
        return []
    from gateway.cli.guard import open_auth

    auth = open_auth(paths, _guard_cfg(paths))
    try:
        rows = auth.list_sessions(limit=500)
        limits = {r["session_id"]: auth.session(r["session_id"]).options.get("max_read_queries") for r in rows}
    finally:
        auth.close_db()
        auth.audit.close()
    left = _reads_left(paths, [r["session_id"] for r in rows])
    for r in rows:
        granted = r.get("granted_scopes")
        r["scope_words"] = words.scope(granted if granted else r.get("requested_scopes"))
        r["scope_is_request"] = not granted
        mrq = limits.get(r["session_id"])
        limit = mrq if isinstance(mrq, int) and not isinstance(mrq, bool) else None
        if limit is not None and granted:
            r["scope_words"].append(f"at most {limit} reads")
        remaining = left.get(r["session_id"])
        r["quota"] = (f"{limit - remaining} of {limit} reads used" if limit is not None and remaining is not None
                      else f"0 of {limit} reads used" if limit is not None else "no read limit")
        r["live"] = r["status"] in ("created", "active")
    return rows


def end_session(paths: Paths, session_id: str, how: str) -> dict[str, Any]:
    """Revoke or close a session, as ``uomp sessions revoke|close`` does (effect at once)."""
    from gateway.cli.guard import open_auth

    auth = open_auth(paths, _guard_cfg(paths))
    try:
        if how == "revoke":
            return auth.revoke(session_id, reason="revoked by the user (dashboard)")
        return auth.close(session_id, reason="closed by the user (dashboard)")
    finally:
        auth.close_db()
        auth.audit.close()


# ----------------------------------------------------------------------------- audit


@dataclass(frozen=True)
class Filters:
    session: str = ""
    agent: str = ""
    verdict: str = ""  # "", "allowed", "refused"
    period: str = "all"

    def query(self) -> dict[str, str]:
        return {k: v for k, v in (("session", self.session), ("agent", self.agent), ("verdict", self.verdict),
                                  ("period", self.period)) if v and not (k == "period" and v == "all")}


def parse_filters(q: Any) -> Filters:
    def one(name: str, allowed: tuple[str, ...] | None = None) -> str:
        v = str(q.get(name, "") or "")[:200]
        return v if allowed is None or v in allowed else ""
    return Filters(one("session"), one("agent"), one("verdict", ("allowed", "refused")),
                   one("period", tuple(PERIODS)) or "all")


def _proof_states(conn: sqlite3.Connection) -> tuple[int, list[int], list[dict[str, Any]]]:
    try:
        cp = int(conn.execute("SELECT MAX(size) FROM ledger_checkpoints").fetchone()[0] or 0)
        anchors = [dict(r) for r in conn.execute(
            "SELECT size, ref, backend, block_number FROM ledger_anchors WHERE state = 'confirmed' AND ref IS NOT "
            "NULL ORDER BY size")]
    except sqlite3.Error:
        return 0, [], []
    return cp, [a["size"] for a in anchors], anchors


def timeline(paths: Paths, f: Filters, *, limit: int = 200, now: float | None = None) -> list[dict[str, Any]]:
    """Audit events, newest first, each with its verification state:
    ``anchored`` (a confirmed on-chain anchor covers it), ``checkpointed`` (a signed checkpoint
    covers it) or ``pending``."""
    conn = _ro(paths)
    if conn is None:
        return []
    now = time.time() if now is None else now
    where: list[str] = []
    args: list[Any] = []
    if f.session:
        where.append("a.session_id = ?")
        args.append(f.session)
    if f.agent:
        where.append("a.agent_id = ?")
        args.append(f.agent)
    if f.verdict:
        where.append("a.allowed = ?")
        args.append(1 if f.verdict == "allowed" else 0)
    if PERIODS.get(f.period):
        where.append("a.ts >= ?")
        args.append(now - PERIODS[f.period])
    sql_where = (" WHERE " + " AND ".join(where)) if where else ""
    try:
        try:
            rows = conn.execute(
                "SELECT a.*, e.seq AS leaf, e.code AS code FROM audit_logs a LEFT JOIN ledger_events e ON e.id = a.id"
                + sql_where + " ORDER BY a.seq DESC LIMIT ?", (*args, max(1, min(limit, MAX_TIMELINE)))).fetchall()
        except sqlite3.OperationalError:  # no ledger tables (a log from before the verifiable audit)
            rows = conn.execute("SELECT a.*, NULL AS leaf, NULL AS code FROM audit_logs a" + sql_where
                                + " ORDER BY a.seq DESC LIMIT ?", (*args, max(1, min(limit, MAX_TIMELINE)))).fetchall()
        cp, sizes, anchors = _proof_states(conn)
    finally:
        conn.close()
    out = []
    for r in rows:
        d = dict(r)
        leaf = d.get("leaf")
        d["allowed"] = bool(d["allowed"])
        try:
            d["tags"] = ", ".join(json.loads(d["tags"])) if d.get("tags") else None
        except (ValueError, TypeError):
            d["tags"] = None
        detail = str(d.get("detail") or "")
        code = d.get("code") or (detail if detail in STATUS else None)
        d["code"] = code
        d["explained"] = None if d["allowed"] else words.refusal(code, str(d.get("reason") or ""),
                                                                  None if detail == code else detail)
        d["action_words"] = words.action(str(d["action"]))
        d["when"] = words.when(float(d["ts"]))
        d["proof"] = "pending"
        d["tx"] = None
        if leaf is not None:
            i = bisect.bisect_left(sizes, int(leaf))
            if i < len(sizes):
                d["proof"] = "anchored"
                d["tx"] = anchors[i]["ref"]
            elif int(leaf) <= cp:
                d["proof"] = "checkpointed"
        out.append(d)
    return out


GATEWAY_TAIL_BYTES = 512 * 1024  # how much of the gateway's access log the timeline reads (its newest part)
GUARD_MADE = "refused by the memory guard"  # such refusals are in audit.db already


def gateway_refusals(paths: Paths, f: Filters, *, limit: int = 200, now: float | None = None) -> list[dict[str, Any]]:
    """Refusals the gateway made on its own (no client certificate, agent mismatch, wrong audience,
    its quota, a revocation it caught), from the newest part of its hash-chained access log
    (``gateway/access.jsonl``): they are not in the guard's Merkle log yet, so they carry no proof."""
    if f.verdict == "allowed":
        return []
    path = paths.gateway_dir / "access.jsonl"
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - GATEWAY_TAIL_BYTES))
            raw = fh.read(GATEWAY_TAIL_BYTES)
    except OSError:
        return []
    lines = raw.split(b"\n")
    if len(raw) == GATEWAY_TAIL_BYTES:
        lines = lines[1:]  # the first line may be cut
    since = ((time.time() if now is None else now) - PERIODS[f.period]) if PERIODS.get(f.period) else None
    out: list[dict[str, Any]] = []
    for line in reversed(lines):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if not isinstance(ev, dict) or ev.get("allowed") is not False or ev.get("reason") == GUARD_MADE:
            continue
        try:
            ts = dt.datetime.fromisoformat(str(ev.get("timestamp", ""))).timestamp()
        except ValueError:
            continue
        sid, agent = str(ev.get("session_id") or "-"), str(ev.get("agent_id") or "unknown")
        if (f.session and sid != f.session) or (f.agent and agent != f.agent) or (since and ts < since):
            continue
        code = ev.get("code") if isinstance(ev.get("code"), str) else None
        reason = str(ev.get("reason", ""))
        out.append({"id": f"gw-{ev.get('seq')}", "ts": ts, "when": words.when(ts), "session_id": sid,
                    "agent_id": agent, "action": str(ev.get("action")),
                    "action_words": words.action(str(ev.get("action"))), "key": ev.get("key") or ev.get("path"),
                    "tags": ev.get("tag"), "allowed": False, "reason": reason, "code": code,
                    "explained": words.refusal(code, reason), "via": f"gateway {ev.get('listener') or ''}".strip(),
                    "proof": "gateway", "tx": None})
        if len(out) >= limit:
            break
    return out


def merged_timeline(paths: Paths, f: Filters, *, limit: int = 200) -> list[dict[str, Any]]:
    """The guard's verifiable events and the gateway's own refusals, newest first."""
    rows = timeline(paths, f, limit=limit) + gateway_refusals(paths, f, limit=limit)
    rows.sort(key=lambda r: float(r["ts"]), reverse=True)
    return rows[:limit]


def known_agents_and_sessions(paths: Paths) -> tuple[list[str], list[str]]:
    conn = _ro(paths)
    if conn is None:
        return [], []
    try:
        agents = [r[0] for r in conn.execute("SELECT DISTINCT agent_id FROM audit_logs ORDER BY agent_id LIMIT 200")]
        sessions = [r[0] for r in conn.execute("SELECT session_id FROM audit_logs GROUP BY session_id "
                                               "ORDER BY MAX(seq) DESC LIMIT 200")]
        return agents, sessions
    except sqlite3.Error:
        return [], []
    finally:
        conn.close()


def proof_bundle(paths: Paths, event_id: str) -> dict[str, Any]:
    from gateway.cli.audit import proof_bundle as bundle

    return bundle(paths, event_id)


def activity(paths: Paths, *, hours: int = 24, now: float | None = None) -> dict[str, list[tuple[int, int]]]:
    """Per agent, per hour of the last ``hours``: (reads allowed, refusals). Session bookkeeping is
    left out (it is the user's doing, not the agent's)."""
    conn = _ro(paths)
    if conn is None:
        return {}
    now = time.time() if now is None else now
    start = now - hours * 3600
    out: dict[str, list[tuple[int, int]]] = {}
    try:
        rows = conn.execute(
            "SELECT agent_id, allowed, CAST((ts - ?) / 3600 AS INTEGER) AS bucket, COUNT(*) FROM audit_logs "
            f"WHERE ts >= ? AND action NOT IN ({','.join('?' * len(SESSION_ACTIONS))}) GROUP BY 1, 2, 3",
            (start, start, *SESSION_ACTIONS)).fetchall()
    except sqlite3.Error:
        return {}
    finally:
        conn.close()
    for agent, allowed, bucket, n in rows:
        series = out.setdefault(str(agent), [(0, 0)] * hours)
        b = min(max(int(bucket), 0), hours - 1)
        ok, bad = series[b]
        series[b] = (ok + int(n), bad) if allowed else (ok, bad + int(n))
    return dict(sorted(out.items())[:20])


# ----------------------------------------------------------------------------- agents


def agents(paths: Paths) -> list[dict[str, Any]]:
    """Certificates by agent, with renewals chained (``renewed_from``)."""
    try:
        rows = ca_store.list_agents(paths)
    except UompError:
        return []
    now = time.time()
    return [{"agent_id": r.agent_id, "serial": r.serial, "not_after": words.when(r.not_after.timestamp()),
             "expires_in": words.ago(r.not_after.timestamp(), now), "status": r.status,
             "renewed_from": r.renewed_from,
             "revoked_at": words.when(r.revoked_at.timestamp()) if r.revoked_at else None} for r in rows]


def revoke_agent(paths: Paths, target: str) -> dict[str, Any]:
    from gateway.cli.agent import revoke_agent as revoke

    done, sweep = revoke(paths, target, via="dashboard: revoke")
    return {"revoked": done.revoked, "sessions": [sid for sid, _ in sweep.matched],
            "unbound": [sid for sid, _ in sweep.unbound]}


# ----------------------------------------------------------------------------- payloads


def payloads(paths: Paths) -> list[dict[str, Any]]:
    from gateway.cli.payload import GuardClient

    items: list[dict[str, Any]] = GuardClient(paths, timeout=10.0).json("GET", "/v1/payloads")["payloads"]
    for p in items:
        p["size_words"] = words.size(int(p["size"]))
        p["received"] = words.when(float(p["created_at"]))
        p["expires"] = words.ago(float(p["expires_at"]))
    return items


def open_payload(paths: Paths, payload_id: str, *, max_bytes: int) -> tuple[dict[str, Any], bytes]:
    """Decrypt a payload in memory (never written anywhere) and record that it was opened."""
    from gateway.cli.payload import mark_opened, open_payload

    meta, blocks = open_payload(paths, payload_id)
    if int(meta["size"]) > max_bytes:
        raise UompError("PAYLOAD_TOO_LARGE", f"payload {payload_id} is larger than the dashboard opens in memory; "
                        "use 'uomp payload pull'")
    plain = b"".join(_bounded(blocks, max_bytes))
    mark_opened(paths, payload_id)
    return meta, plain


def _bounded(blocks: Iterator[bytes], limit: int) -> Iterator[bytes]:
    total = 0
    for b in blocks:
        total += len(b)
        if total > limit:
            raise UompError("PAYLOAD_TOO_LARGE", "the payload opens to more than the dashboard holds in memory")
        yield b


def delete_payload(paths: Paths, payload_id: str) -> None:
    from urllib.parse import quote

    from gateway.cli.payload import GuardClient

    GuardClient(paths, timeout=10.0).json("DELETE", f"/v1/payloads/{quote(payload_id, safe='')}")


# ----------------------------------------------------------------------------- appliance


def appliance(paths: Paths) -> dict[str, Any]:
    from gateway.cli.status import collect

    return collect(paths)
