"""The Auth Service's per-token caches follow the tokens alive, not every token ever seen: an
appliance whose agents refresh all day holds no more than one that has just started (the soak's
steady RSS rise). Real SQLite files, the real AuthService and its refresh rotation, on a clock the
test moves."""

from __future__ import annotations

from typing import Any

import pytest
from guardkit import guard_config, seed

from gateway.config import Paths
from gateway.errors import UompError
from gateway.guard.audit import open_audit
from gateway.guard.auth import AuthService

CNF = {"x5t#S256": "A" * 43, "jkt": "B" * 43}
GRANT: dict[str, Any] = {
    "granted_scopes": {"read": {"tags": ["preference"], "keys": []}},
    "profile": "remote",
    "audience": "https://gw.example:9443",
    "cnf": CNF,
    "refresh": True,
}


def test_caches_hold_only_live_tokens_after_a_day_of_refreshes(home: Paths) -> None:
    seed(home)
    now = [1_800_000_000.0]
    cfg = guard_config()
    auth = AuthService(home, cfg, open_audit(home, cfg), clock=lambda: now[0])
    try:
        sid = auth.create_session(
            {
                "agent_id": "a1",
                "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
                "duration_minutes": 7 * 24 * 60,
                "profile": "remote",
            }
        )["session_id"]
        answer = auth.grant(sid, GRANT)
        access, rt = answer["token"], answer["refresh_token"]
        for _ in range(720):  # a refresh every 2 minutes for a day; each access token used 3 times
            for _ in range(3):
                auth.authenticate(access)
            now[0] += 120
            answer = auth.refresh(rt, session_id=sid, presented_x5t=CNF["x5t#S256"], presented_jkt=None)
            access, rt = answer["access_token"], answer["refresh_token"]
        auth.authenticate(access)
        sizes = auth.cache_sizes()
        # alive: the access tokens of the last 10 minutes (at most 6), plus the dead ones of at most
        # one sweep interval; spent refresh tokens are not kept at all
        assert all(n <= 7 for n in sizes.values()), sizes
        assert sizes["verified"] >= 1 and sizes["used"] >= 1  # the live token is kept ...
        now[0] += 601  # ... and, expired, never served from the cache
        with pytest.raises(UompError) as exc:
            auth.authenticate(access)
        assert exc.value.code == "TOKEN_EXPIRED"
    finally:
        auth.close_db()
        auth.audit.close()
