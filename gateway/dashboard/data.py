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
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway import ca_store, sqldriver
from gateway.atrest import auditdb
from gateway.config import GuardConfig, Paths, load_section
from gateway.dashboard import words
from gateway.errors import STATUS, ErrorCode, UompError
from gateway.ledger import query

MAX_TIMELINE = 500
PERIODS = {"hour": 3600.0, "day": 86400.0, "week": 7 * 86400.0, "all": 0.0}
SESSION_ACTIONS = ("session_created", "session_granted", "session_revoked", "session_closed", "session_expired")


def _guard_cfg(paths: Paths) -> GuardConfig:
    return load_section(GuardConfig, "guard", file=paths.config_file)


def _ro(paths: Paths) -> sqlite3.Connection | None:
    if not paths.audit_db.exists():
        return None
    conn: sqlite3.Connection = auditdb.connect(paths.audit_db, readonly=True, timeout=5.0, rows=True)
    return conn


# ----------------------------------------------------------------------------- sessions


def _reads_left(paths: Paths, session_ids: list[str]) -> dict[str, int]:
    """The latest ``query_count_remaining`` the guard recorded per session (its one quota counter)."""
    conn = _ro(paths)
    if conn is None or not session_ids:
        return {}
    try:
        return query.quota_remaining(conn, session_ids)
    except sqldriver.ERRORS:
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
        r["quota"] = (
            f"{limit - remaining} of {limit} reads used"
            if limit is not None and remaining is not None
            else f"0 of {limit} reads used"
            if limit is not None
            else "no read limit"
        )
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
        return {
            k: v
            for k, v in (
                ("session", self.session),
                ("agent", self.agent),
                ("verdict", self.verdict),
                ("period", self.period),
            )
            if v and not (k == "period" and v == "all")
        }


def parse_filters(q: Any) -> Filters:
    def one(name: str, allowed: tuple[str, ...] | None = None) -> str:
        v = str(q.get(name, "") or "")[:200]
        return v if allowed is None or v in allowed else ""

    return Filters(
        one("session"), one("agent"), one("verdict", ("allowed", "refused")), one("period", tuple(PERIODS)) or "all"
    )


def _proof_states(conn: sqlite3.Connection) -> tuple[int, list[int], list[dict[str, Any]], list[tuple[int, str]]]:
    """The newest checkpoint, the confirmed anchors (``confirmed`` is set only after the chain was
    read and checked), and the open rejected ones with their reason."""
    try:
        cp = int(conn.execute("SELECT MAX(size) FROM ledger_checkpoints").fetchone()[0] or 0)
        anchors = [
            dict(r)
            for r in conn.execute(
                "SELECT size, ref, backend, block_number FROM ledger_anchors WHERE state = 'confirmed' AND ref IS NOT "
                "NULL ORDER BY size"
            )
        ]
        rejected = [
            (int(r[0]), str(r[1] or ""))
            for r in conn.execute("SELECT size, last_error FROM ledger_anchors WHERE state = 'rejected' ORDER BY size")
        ]
    except sqldriver.ERRORS:
        return 0, [], [], []
    return cp, [a["size"] for a in anchors], anchors, rejected


def timeline(paths: Paths, f: Filters, *, limit: int = 200, now: float | None = None) -> list[dict[str, Any]]:
    """Events of the one log (the guard's decisions and the gateway's own refusals alike), newest
    first, each with its verification state: ``anchored`` (an anchor checked on chain covers it),
    ``rejected`` (a signed checkpoint covers it; its anchor was rejected), ``checkpointed`` (a signed
    checkpoint covers it) or ``pending``."""
    conn = _ro(paths)
    if conn is None:
        return []
    now = time.time() if now is None else now
    flt = query.AuditFilter(
        session_id=f.session or None,
        agent_id=f.agent or None,
        allowed=None if not f.verdict else f.verdict == "allowed",
        since=(now - PERIODS[f.period]) if PERIODS.get(f.period) else None,
        limit=max(1, min(limit, MAX_TIMELINE)),
    )
    try:
        try:
            events = query.query_events(conn, flt).events
        except sqldriver.OPERATIONAL:  # no event log yet (the guard has not opened this audit.db)
            return []
        cp, sizes, anchors, rejected = _proof_states(conn)
    finally:
        conn.close()
    out = []
    for ev in reversed(events):  # newest first
        d = dict(ev)
        leaf = d.get("seq")
        d["allowed"] = bool(d.get("allowed"))
        tags = d.get("tags")
        d["tags"] = ", ".join(str(t) for t in tags) if isinstance(tags, list) and tags else None
        detail = str(d.get("detail") or "")
        code = d.get("code") or (detail if detail in STATUS else None)
        d["code"] = code
        d["explained"] = (
            None
            if d["allowed"]
            else words.refusal(code, str(d.get("reason") or ""), None if detail == code else detail)
        )
        d["action_words"] = words.action(str(d.get("action")))
        ts = float(d["ts"]) if "ts" in d else _ts(str(d.get("timestamp", "")))
        d["ts"] = ts
        d["when"] = words.when(ts)
        via = d.get("via")
        if d.get("listener"):
            via = f"{via or 'gateway'} {d['listener']}"
        d["via"] = via
        d["proof"] = "pending"
        d["tx"] = None
        if leaf is not None:
            i = bisect.bisect_left(sizes, int(leaf))
            j = bisect.bisect_left([r[0] for r in rejected], int(leaf))
            if i < len(sizes):
                d["proof"] = "anchored"
                d["tx"] = anchors[i]["ref"]
            elif j < len(rejected) and int(leaf) <= cp:
                d["proof"] = "rejected"
                d["anchor_error"] = rejected[j][1][:200]
            elif int(leaf) <= cp:
                d["proof"] = "checkpointed"
        out.append(d)
    return out


def _ts(text: str) -> float:
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def known_agents_and_sessions(paths: Paths) -> tuple[list[str], list[str]]:
    conn = _ro(paths)
    if conn is None:
        return [], []
    try:
        return query.known_agents(conn), query.known_sessions(conn)
    except sqldriver.ERRORS:
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
        rows = query.hourly_counts(conn, since=start, exclude_actions=SESSION_ACTIONS)
    except sqldriver.ERRORS:
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
    return [
        {
            "agent_id": r.agent_id,
            "serial": r.serial,
            "not_after": words.when(r.not_after.timestamp()),
            "expires_in": words.ago(r.not_after.timestamp(), now),
            "status": r.status,
            "renewed_from": r.renewed_from,
            "revoked_at": words.when(r.revoked_at.timestamp()) if r.revoked_at else None,
        }
        for r in rows
    ]


def revoke_agent(paths: Paths, target: str) -> dict[str, Any]:
    from gateway.cli.agent import revoke_agent as revoke

    done, sweep = revoke(paths, target, via="dashboard: revoke")
    return {
        "revoked": done.revoked,
        "sessions": [sid for sid, _ in sweep.matched],
        "unbound": [sid for sid, _ in sweep.unbound],
    }


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
        raise UompError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"payload {payload_id} is larger than the dashboard opens in memory; use 'uomp payload pull'",
        )
    plain = b"".join(_bounded(blocks, max_bytes))
    mark_opened(paths, payload_id)
    return meta, plain


def _bounded(blocks: Iterator[bytes], limit: int) -> Iterator[bytes]:
    total = 0
    for b in blocks:
        total += len(b)
        if total > limit:
            raise UompError(ErrorCode.PAYLOAD_TOO_LARGE, "the payload opens to more than the dashboard holds in memory")
        yield b


def delete_payload(paths: Paths, payload_id: str) -> None:
    from urllib.parse import quote

    from gateway.cli.payload import GuardClient

    GuardClient(paths, timeout=10.0).json("DELETE", f"/v1/payloads/{quote(payload_id, safe='')}")


# ----------------------------------------------------------------------------- appliance


def appliance(paths: Paths) -> dict[str, Any]:
    from gateway.cli.status import collect

    out = collect(paths)
    out["home_uplink"] = home_uplink(paths)
    return out


def home_uplink(paths: Paths) -> dict[str, Any] | None:
    """The home side of the uplink (``uomp guard uplink``), :func:`gateway.uplink.homestatus.read`."""
    from gateway.uplink import homestatus

    return homestatus.read(paths)
