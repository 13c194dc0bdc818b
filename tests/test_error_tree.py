"""Every server-side refusal of the payload relay is a UompError: routes answer it as it is (its code,
its status, the §8.4 body) without re-wrapping it, and the CLI's one ``except UompError`` sees it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import Paths
from gateway.errors import STATUS, ErrorCode, UompError
from gateway.payloads.store import Limits, PayloadError, PayloadStore


def test_a_payload_error_is_a_uomp_error_with_its_codes_status() -> None:
    exc = PayloadError(ErrorCode.PAYLOAD_STORE_FULL, "the payload store's disk is full; nothing was kept")
    assert isinstance(exc, UompError)
    assert exc.status == STATUS[ErrorCode.PAYLOAD_STORE_FULL]
    assert exc.body() == {
        "error": {"code": "PAYLOAD_STORE_FULL", "message": "the payload store's disk is full; nothing was kept"}
    }
    # the denied partner: a code that is not an ErrorCode is refused as for any UompError
    with pytest.raises(ValueError):
        PayloadError("NOT_A_CODE", "x")  # type: ignore[arg-type]


def test_a_store_refusal_is_caught_as_a_uomp_error(tmp_path: Path) -> None:
    store = PayloadStore(tmp_path / "payloads", limits=Limits())
    try:
        with pytest.raises(UompError) as e:
            store.get("pl_" + "0" * 32)
        assert isinstance(e.value, PayloadError)
        assert e.value.code == ErrorCode.NOT_FOUND
        assert e.value.status == 404
    finally:
        store.close()


# ------------------------------------------------------------------------------ the audit ledger


def test_a_ledger_error_is_a_uomp_error_whose_message_is_the_sentence_alone() -> None:
    from gateway.ledger.log import LedgerError

    exc = LedgerError(ErrorCode.PROOF_PENDING, "the event is not in a signed checkpoint yet; try again shortly")
    assert isinstance(exc, UompError)
    assert exc.code == ErrorCode.PROOF_PENDING and exc.status == STATUS[ErrorCode.PROOF_PENDING]
    assert exc.message == "the event is not in a signed checkpoint yet; try again shortly"
    with pytest.raises(ValueError):
        LedgerError("NOT_A_CODE", "x")  # type: ignore[arg-type]


def test_a_reader_refusal_from_the_ledger_carries_no_code_prefix(home: Paths) -> None:
    """What an agent reads in the §8.4 body is the ledger's sentence, mapped to the reader's code."""
    from guardkit import guard_config

    from gateway.guard.audit import ledger_refusal, open_audit
    from gateway.ledger.log import LedgerError

    log = open_audit(home, guard_config(audit_checkpoint_events=100, audit_checkpoint_seconds=3600.0))
    try:
        with pytest.raises(UompError) as e:
            log.checkpoint_since(None, "sess_x")  # nothing signed yet
        assert e.value.code == ErrorCode.STORE_BUSY and (e.value.details or {}).get("reason") == "PROOF_PENDING"
        assert e.value.message == "the log has no signed checkpoint yet; try again shortly"
    finally:
        log.close()
    other = ledger_refusal(LedgerError(ErrorCode.KEY_ERROR, "no audit signing key"))
    assert other.code == ErrorCode.STORE_UNAVAILABLE
    assert other.message == "the audit log cannot answer (no audit signing key); run 'uomp audit verify'"
    missing = ledger_refusal(LedgerError(ErrorCode.NOT_FOUND, "no such event"), session_id="sess_x")
    assert (missing.code, missing.message, missing.session_id) == (ErrorCode.NOT_FOUND, "no such event", "sess_x")


def test_a_ledger_that_disagrees_with_its_tree_refuses_the_write_as_store_unavailable(home: Paths) -> None:
    """A LedgerError under a write is answered STORE_UNAVAILABLE with the fix, not as its own code
    (the more general ``except UompError`` there must not take it first)."""
    import sqlite3

    from guardkit import guard_config

    from gateway.guard.audit import make_row, open_audit

    def row(i: int) -> Any:
        return make_row(session_id="s", agent_id="a", action="read", allowed=True, reason="ok", key=f"k.{i}")

    log = open_audit(home, guard_config(audit_checkpoint_events=100, audit_full_verify_at_start=False))
    try:
        log.write_now([row(0), row(1)])
        with sqlite3.connect(home.audit_db, isolation_level=None) as side:  # an event with no leaf
            side.execute(
                "INSERT INTO ledger_events (seq, id, ts, action, leaf) VALUES (99, 'evt_stray', 0, 'read', x'00')"
            )
        with pytest.raises(UompError) as e:
            log.write_now([row(2)])
        assert e.value.code == ErrorCode.STORE_UNAVAILABLE
        assert e.value.message.startswith("the audit log is inconsistent (the log has ")
        assert e.value.message.endswith("; run 'uomp audit verify'") and "LOG_CORRUPT" not in e.value.message
    finally:
        log.close()
