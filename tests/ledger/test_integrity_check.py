"""The bounded start-up check and the verifier's trusted-checkpoint hook, in-process on real SQLite
files: what the start-up check sees (the tail, the counts, the witness) and what only the full
verify sees (an edit deep in the log), and a trusted checkpoint from elsewhere (the hook an
on-chain anchor plugs into) caught the same way as the witness record."""

from __future__ import annotations

import sqlite3

from guardkit import guard_config

from gateway.config import Paths
from gateway.core import merkle
from gateway.guard.audit import make_row, open_audit
from gateway.ledger import auditkey, integrity
from gateway.ledger.verify import TrustedCheckpoint, verify_log


def _fill(paths: Paths, n: int) -> None:
    log = open_audit(paths, guard_config(audit_checkpoint_events=100))
    try:
        for b in range(0, n, 500):
            log.write_now(
                [
                    make_row(session_id="s", agent_id="a", action="read", allowed=True, reason="ok", key=f"k.{i}")
                    for i in range(b, min(n, b + 500))
                ]
            )
    finally:
        log.close()


def _check(paths: Paths, conn: sqlite3.Connection) -> integrity.Checked:
    key = auditkey.load(paths)
    origin = auditkey.origin_for(key.public_key())
    witness = integrity.read_witness(paths.audit_witness, origin=origin, public_key=key.public_key())
    return integrity.check_log(conn, origin=origin, public_key=key.public_key(), witness=witness)


def _edit(conn: sqlite3.Connection, seq: int) -> None:
    body = str(conn.execute("SELECT body FROM ledger_events WHERE seq = ?", (seq,)).fetchone()[0])
    conn.execute("UPDATE ledger_events SET body = ? WHERE seq = ?", (body.replace('"ok"', '"OK"'), seq))


def test_the_start_up_check_sees_the_tail_and_leaves_the_deep_past_to_the_full_verify(home: Paths) -> None:
    _fill(home, 2000)
    key = auditkey.load(home)
    origin = auditkey.origin_for(key.public_key())
    with sqlite3.connect(home.audit_db, isolation_level=None) as conn:
        checked = _check(home, conn)
        assert checked.error is None and checked.checked_from == 2000 - integrity.TAIL_EVENTS
        _edit(conn, 1990)  # in the tail
        checked = _check(home, conn)
        assert checked.error is not None and checked.error.code == "AUDIT_LOG_DAMAGED"
        assert (checked.error.details or {})["first_bad_seq"] == 1990
        conn.execute("UPDATE ledger_events SET body = replace(body, '\"OK\"', '\"ok\"') WHERE seq = 1990")
        assert _check(home, conn).error is None  # put back
        _edit(conn, 10)  # deep: only the full verify reads it
        assert _check(home, conn).error is None
        report = verify_log(conn, origin=origin, public_key=key.public_key())
        assert not report.ok and report.first_bad_seq == 10 and report.damaged


def test_a_trusted_checkpoint_from_elsewhere_catches_a_rollback_and_a_fork(home: Paths) -> None:
    """``trusted`` is the hook for the newest on-chain anchor: a trusted size beyond the log's end is
    the first missing size; a different root at a trusted size is a fork."""
    _fill(home, 300)
    key = auditkey.load(home)
    origin = auditkey.origin_for(key.public_key())
    with sqlite3.connect(home.audit_db, isolation_level=None) as conn:
        root200 = merkle.root(
            lambda lv, i: bytes(
                conn.execute("SELECT hash FROM merkle_nodes WHERE level = ? AND idx = ?", (lv, i)).fetchone()[0]
            ),
            200,
        )
        good = verify_log(
            conn, origin=origin, public_key=key.public_key(), trusted=[TrustedCheckpoint(200, root200, "the anchor")]
        )
        assert good.ok
        ahead = verify_log(
            conn, origin=origin, public_key=key.public_key(), trusted=[TrustedCheckpoint(400, root200, "the anchor")]
        )
        assert not ahead.ok and ahead.inconsistent and ahead.first_bad_seq == 301
        assert "the anchor signed 400 events" in ahead.problems[0]
        fork = verify_log(
            conn, origin=origin, public_key=key.public_key(), trusted=[TrustedCheckpoint(200, bytes(32), "the anchor")]
        )
        assert not fork.ok and fork.inconsistent and fork.first_bad_seq == 200


async def test_an_edited_session_column_never_hands_a_proof_or_a_listing_to_another_session(home: Paths) -> None:
    """b's read moved to a's session in the index column only (the guard running, so the edit is not
    seen at start): a's GET /v1/audit does not list it and a's proof request is the unknown-id 404;
    the partner: a's own read still gets its proof."""
    import aiohttp
    from guardkit import call, grant, running_guard, seed, unix_session

    seed(home)
    read = {"tags": ["preference"], "keys": []}
    async with (
        running_guard(home, guard_config(audit_checkpoint_events=1)) as g,
        unix_session(home) as s,
        aiohttp.ClientSession() as tcp,
    ):
        base = f"http://127.0.0.1:{g.tcp_port}"
        a = await grant(s, home, read=read, audience=base)
        b = await grant(s, home, read=read, audience=base, agent_id="other")
        assert (await call(tcp, "GET", "/v1/memory/preference.lang", token=b["token"], base=base))[0] == 200
        assert (await call(tcp, "GET", "/v1/memory/preference.theme", token=a["token"], base=base))[0] == 200
        logs_b = (await call(tcp, "GET", "/v1/audit", token=b["token"], base=base))[1]["logs"]
        theirs = next(e["id"] for e in logs_b if e["action"] == "read")
        with sqlite3.connect(home.audit_db) as conn:
            conn.execute("UPDATE ledger_events SET session_id = ? WHERE id = ?", (a["session_id"], theirs))
        logs_a = (await call(tcp, "GET", "/v1/audit", token=a["token"], base=base))[1]["logs"]
        assert theirs not in [e["id"] for e in logs_a]
        status, body, _ = await call(tcp, "GET", f"/v1/audit/{theirs}/proof", token=a["token"], base=base)
        assert status == 404 and body["error"]["code"] == "NOT_FOUND"
        mine = next(e["id"] for e in logs_a if e["action"] == "read")
        assert (await call(tcp, "GET", f"/v1/audit/{mine}/proof", token=a["token"], base=base))[0] == 200


def test_a_witness_record_that_is_not_this_keys_checkpoint_is_refused(home: Paths) -> None:
    """Garbage, or a checkpoint signed by another key (another home's record copied in): nothing is
    vouched for, the log is refused; the partner: the home's own record passes."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gateway.core.checkpoint import Checkpoint

    _fill(home, 120)
    key = auditkey.load(home)
    origin = auditkey.origin_for(key.public_key())

    def state() -> dict[str, object]:
        return integrity.home_state(home.audit_db, home.audit_witness, origin=origin, public_key=key.public_key())

    assert state()["ok"] is True and state()["witness_size"] == 120
    own = home.audit_witness.read_bytes()
    home.audit_witness.write_text("{not json")
    assert state()["code"] == "AUDIT_LOG_INCONSISTENT"
    other = Ed25519PrivateKey.generate()
    forged = Checkpoint(origin, 120, bytes(32), 1).sign(origin, other)
    integrity.write_witness(home.audit_witness, forged)
    assert state()["code"] == "AUDIT_LOG_INCONSISTENT"
    home.audit_witness.write_bytes(own)
    assert state()["ok"] is True
