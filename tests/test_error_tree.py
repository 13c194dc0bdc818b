"""Every server-side refusal of the payload relay is a UompError: routes answer it as it is (its code,
its status, the §8.4 body) without re-wrapping it, and the CLI's one ``except UompError`` sees it."""

from __future__ import annotations

from pathlib import Path

import pytest

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
