"""Agent certificate life cycle, against the real
appliance on 127.0.0.1: renewal only late in a certificate's life, rate-limited per agent, off the
event loop and audited; the registry indexed and bounded; revoking a serial revokes every
certificate renewed from it and the sessions bound to those keys; ``authorize --remote`` reuses
a good certificate; ``uomp agent revoke`` revokes the agent's sessions unless told not to."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from gatewaykit import Agent, Appliance, agent_call, agent_session, appliance, ledger_events
from guardkit import admin_headers, call
from test_authorize import MANIFEST, write_manifest

from gateway import ca_registry, ca_store
from gateway.bundle import load_bundle
from gateway.cli.main import main
from gateway.client.tls import build_client_context
from gateway.config import Paths
from gateway.core import ca
from gateway.errors import UompError
from gateway.remote import agent_routes

HOUR = dt.timedelta(hours=1)


def due_agent(app: Appliance, agent_id: str, *, sub: str | None = None, elapsed: float = 0.8) -> Agent:
    """An agent whose one-hour certificate has lived ``elapsed`` of its life (0.8: due for renewal)."""
    issued = ca.utcnow() - HOUR * elapsed
    files = ca_store.issue_with_key(
        app.paths, agent_id, app.paths.home / "agents-test" / (sub or agent_id), HOUR, now=issued
    )
    return Agent(agent_id, files)


async def renew_call(app: Appliance, agent: Agent | None, body: Any = None) -> tuple[int, Any]:
    async with agent_session(agent, app.paths) as s:
        status, answer, _ = await agent_call(
            s,
            app.base,
            "/v1/certificates/renew",
            token=None,
            agent_id=None,
            method="POST",
            json_body=body if body is not None else {},
        )
    return status, answer


def access_events(paths: Paths, action: str) -> list[dict[str, Any]]:
    """The one log: the guard's ledger holds the gateway's events too."""
    return ledger_events(paths, action=action)


def as_agent(agent: Agent, pem: str, name: str) -> Agent:
    """The same key with another certificate (what the holder of a renewed certificate has)."""
    out = agent.files.out_dir.parent / name
    out.mkdir(mode=0o700, exist_ok=True)
    (out / "agent.crt").write_text(pem)
    (out / "agent.key").write_bytes(agent.files.key_file.read_bytes())
    (out / "ca.crt").write_bytes(agent.files.ca_file.read_bytes())
    cert = x509.load_pem_x509_certificate(pem.encode())
    files = ca_store.IssuedFiles(
        out,
        out / "agent.key",
        out / "agent.crt",
        out / "ca.crt",
        ca.serial_hex(cert.serial_number),
        cert.not_valid_after_utc,
        False,
    )
    return Agent(agent.agent_id, files)


# ------------------------------------------------------------------------------- renewal window


async def test_renewal_only_in_the_last_third_and_audited(home: Paths) -> None:
    async with appliance(home) as app:
        due = due_agent(app, "agent_a")
        status, body = await renew_call(app, due)
        assert status == 200, body
        new = x509.load_pem_x509_certificate(body["certificate"].encode())
        assert ca.agent_id_from_cert(new) == "agent_a" and body["serial"] != due.files.serial
        # the access event names the outcome and both serials
        ok = access_events(home, "renew")[-1]
        assert ok["allowed"] and ok["cert_serial"] == due.files.serial and body["serial"] in ok["reason"]
        # refused partners: a fresh certificate, one half-way through its life, and the certificate
        # just renewed (fresh); each refusal is audited with its code
        for name, agent in (
            ("fresh", app.agent("agent_b")),
            ("half", due_agent(app, "agent_c", elapsed=0.5)),
            ("just renewed", as_agent(due, body["certificate"], "renewed")),
        ):
            status, err = await renew_call(app, agent)
            assert (status, err["error"]["code"]) == (409, "RENEWAL_TOO_EARLY"), name
            ev = access_events(home, "renew")[-1]
            assert ev["code"] == "RENEWAL_TOO_EARLY" and not ev["allowed"] and ev["cert_serial"] == agent.files.serial
        status, err = await renew_call(app, None)
        assert (status, err["error"]["code"]) == (401, "CERT_REQUIRED")


async def test_renewal_window_is_configurable(home: Paths) -> None:
    async with appliance(home, renew_window_fraction=0.6) as app:
        status, body = await renew_call(app, due_agent(app, "agent_a", elapsed=0.5))
        assert status == 200, body
        status, err = await renew_call(app, due_agent(app, "agent_b", elapsed=0.3))
        assert err["error"]["code"] == "RENEWAL_TOO_EARLY"


def test_ca_refuses_early_renewal_whoever_asks(home: Paths, tmp_path: Path) -> None:
    ca_store.init_all(home)
    files = ca_store.issue_with_key(home, "bot", tmp_path / "bot")
    with pytest.raises(UompError) as exc:
        ca_store.renew(home, files.cert_file.read_bytes())
    assert exc.value.code == "RENEWAL_TOO_EARLY"
    # the SDK renews at 2/3 of the lifetime: that is inside the window, even with its clock a little fast
    cert = x509.load_pem_x509_certificate(files.cert_file.read_bytes())
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    sdk_time = cert.not_valid_before_utc + life * 2 / 3 - dt.timedelta(seconds=30)
    assert ca_store.renew(home, files.cert_file.read_bytes(), now=sdk_time)


async def test_renewal_rate_limited_per_agent(home: Paths) -> None:
    async with appliance(home, renew_max_per_agent=2) as app:
        a = due_agent(app, "agent_a")
        for _ in range(2):
            status, body = await renew_call(app, a)
            assert status == 200, body
        status, err = await renew_call(app, a)
        assert (status, err["error"]["code"]) == (429, "RATE_LIMITED")
        assert access_events(home, "renew")[-1]["code"] == "RATE_LIMITED"
        # another certificate of the same agent does not reset the count; another agent is unaffected
        status, err = await renew_call(app, due_agent(app, "agent_a", sub="second"))
        assert err["error"]["code"] == "RATE_LIMITED"
        status, body = await renew_call(app, due_agent(app, "agent_b"))
        assert status == 200, body
    # the count is durable: a restarted gateway still refuses
    async with appliance(home, renew_max_per_agent=2) as app:
        status, err = await renew_call(app, a)
        assert err["error"]["code"] == "RATE_LIMITED"


async def test_renewal_does_not_block_the_event_loop(home: Paths) -> None:
    """While a renewal waits for the CA lock (another ``uomp`` process writing), the gateway answers."""
    async with appliance(home) as app:
        a = due_agent(app, "agent_a")
        held, release = threading.Event(), threading.Event()
        gave_up: list[bool] = []

        def hold_lock() -> None:
            with ca_registry.locked(home):
                held.set()
                # a blocked event loop could never tell us to let go: give up after a generous wait
                gave_up.append(not release.wait(30))

        holder = threading.Thread(target=hold_lock)
        holder.start()
        try:
            assert held.wait(30)
            renewal = asyncio.ensure_future(renew_call(app, a))
            busy = getattr(agent_routes, "_RENEWING", {})
            for _ in range(600):  # until the renewal is in the handler (its thread waits for the lock)
                if "agent_a" in busy.get(app.gateway.state, ()) or renewal.done():
                    break
                await asyncio.sleep(0.05)
            async with agent_session(a, home, force_close=True) as s:
                status, body, _ = await agent_call(s, app.base, "/v1/health", token=None, agent_id=None)
            assert status == 200, body
            assert not renewal.done()  # still waiting for the lock, off the loop
        finally:
            release.set()
            holder.join()
        assert gave_up == [False]
        status, body = await asyncio.wait_for(renewal, timeout=60)
        assert status == 200, body


# ------------------------------------------------------------------------------------ registry


def test_registry_is_indexed_sqlite_and_issuance_adds_a_row(home: Paths, tmp_path: Path) -> None:
    ca_store.init_all(home)
    for i in range(50):
        ca_store.issue_with_key(home, f"a{i}", tmp_path / f"a{i}")
    db = sqlite3.connect(ca_registry.registry_path(home))
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        plan = " ".join(str(r) for r in db.execute("EXPLAIN QUERY PLAN SELECT * FROM certs WHERE renewed_from = 'x'"))
        assert "INDEX" in plan.upper()
        assert db.execute("SELECT COUNT(*) FROM certs").fetchone()[0] == 50
    finally:
        db.close()
    assert not ca_registry.legacy_registry_path(home).exists()


def test_registry_prunes_dead_chains_but_keeps_ancestors_of_live_ones(home: Paths, tmp_path: Path) -> None:
    ca_store.init_all(home)
    now = ca.utcnow()
    long_ago = now - dt.timedelta(days=60)
    for i in range(100):
        ca_store.issue_with_key(home, f"old{i}", tmp_path / f"old{i}", HOUR, now=long_ago)
    # a chain started long ago and renewed ever since: its first certificate expired long ago
    root = ca_store.issue_with_key(home, "chain", tmp_path / "chain", dt.timedelta(days=30), now=long_ago)
    pem = root.cert_file.read_bytes()
    pem = ca_store.renew(home, pem, None, dt.timedelta(days=40), now=long_ago + dt.timedelta(days=25))
    assert len(ca_store.list_agents(home)) == 102
    ca_store.issue_with_key(home, "fresh", tmp_path / "fresh", now=now)  # any write prunes
    agents = [r.agent_id for r in ca_store.list_agents(home)]
    # the 100 dead rows are gone; the chain's long-expired first certificate stays with its renewal
    assert sorted(agents) == ["chain", "chain", "fresh"]
    # and revoking the long-expired root still reaches its live renewal
    revoked = ca_store.revoke(home, f"serial:{root.serial}")
    assert ca.serial_hex(x509.load_pem_x509_certificate(pem).serial_number) in revoked


def test_legacy_json_registry_is_migrated(home: Paths, tmp_path: Path) -> None:
    ca_store.init_all(home)
    legacy = {
        "version": 1,
        "crl_number": 41,
        "certs": [
            {
                "serial": "abc1",
                "agent_id": "old",
                "not_before": "2026-01-01T00:00:00Z",
                "not_after": "2099-01-01T00:00:00Z",
                "issued_at": "2026-01-01T00:00:00Z",
                "status": "revoked",
                "revoked_at": "2026-01-02T00:00:00Z",
                "renewed_from": None,
            },
            {
                "serial": "abc2",
                "agent_id": "old",
                "not_before": "2026-01-01T00:00:00Z",
                "not_after": "2099-01-01T00:00:00Z",
                "issued_at": "2026-01-01T00:00:00Z",
                "status": "active",
                "revoked_at": None,
                "renewed_from": "abc1",
            },
        ],
    }
    ca_registry.legacy_registry_path(home).write_text(json.dumps(legacy))
    rows = {r.serial: r for r in ca_store.list_agents(home)}
    assert rows["abc1"].status == "revoked" and rows["abc2"].renewed_from == "abc1"
    assert not ca_registry.legacy_registry_path(home).exists()
    assert ca_store.revoke(home, "serial:abc1") == ["abc2"]  # lineage survived the migration
    crl = x509.load_pem_x509_crl(ca_store.crl_path(home).read_bytes())
    assert ca.crl_number(crl) > 41


# ------------------------------------------------------------------------------------- lineage


def test_revoking_a_serial_revokes_every_renewal_from_it(home: Paths, tmp_path: Path) -> None:
    ca_store.init_all(home)
    start = ca.utcnow() - dt.timedelta(hours=20)
    leaked = ca_store.issue_with_key(home, "bot", tmp_path / "bot", dt.timedelta(hours=24), now=start)
    sibling = ca_store.issue_with_key(home, "bot", tmp_path / "bot2", dt.timedelta(hours=24), now=start)
    pem = leaked.cert_file.read_bytes()
    legit = ca_store.renew(home, pem, None, dt.timedelta(hours=3), now=start + dt.timedelta(hours=17))
    thief = ca_store.renew(home, pem, None, dt.timedelta(hours=3), now=start + dt.timedelta(hours=18))
    thief2 = ca_store.renew(home, thief, None, dt.timedelta(hours=3), now=ca.utcnow() + dt.timedelta(minutes=30))

    def serial(p: bytes) -> str:
        return ca.serial_hex(x509.load_pem_x509_certificate(p).serial_number)

    # revoking the thief's first renewal takes its descendant, not its parent or sibling
    assert sorted(ca_store.revoke(home, serial(thief))) == sorted([serial(thief), serial(thief2)])
    assert serial(legit) not in {ca.serial_hex(s) for s in ca_store.revoked_serials(home)}
    # revoking the leaked certificate takes every renewal from it
    done = ca_store.revoke_target(home, f"serial:{leaked.serial}")
    assert sorted(done.revoked) == sorted([leaked.serial, serial(legit)])
    assert sorted(done.serials) == sorted([leaked.serial, serial(legit), serial(thief), serial(thief2)])
    on_crl = {ca.serial_hex(s) for s in ca_store.revoked_serials(home)}
    assert {leaked.serial, serial(legit), serial(thief), serial(thief2)} <= on_crl
    assert sibling.serial not in on_crl
    # and a revoked one cannot be renewed again
    with pytest.raises(UompError, match="was revoked"):
        ca_store.renew(home, legit, now=start + dt.timedelta(hours=19, minutes=30))


async def test_thief_renewal_dies_with_the_leaked_serial_and_its_token(
    home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    async with appliance(home) as app:
        victim = due_agent(app, "agent_a")
        other = app.agent("agent_b")
        g = await app.grant(victim, refresh=True)
        g_other = await app.grant(other)
        # the thief has the victim's key and certificate: renews, and uses the key-bound token
        status, body = await renew_call(app, victim)
        assert status == 200, body
        thief = as_agent(victim, body["certificate"], "thief")
        async with agent_session(thief, home) as s:
            st, item, _ = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id="agent_a"
            )
            assert st == 200, item
        # the user revokes the leaked certificate by serial
        assert main(["--home", str(home.home), "agent", "revoke", f"serial:{victim.files.serial}"]) == 0
        out = capsys.readouterr().out
        assert f"revoked {thief.files.serial}" in out and g["session_id"] in out
        assert app.gateway.reloader is not None
        app.gateway.reloader.reload_if_changed()  # what the watcher does within its interval
        # the renewed certificate is refused by name ...
        async with agent_session(thief, home) as s:
            st, item, _ = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id="agent_a"
            )
        assert (st, item["error"]["reason"], item["error"]["details"]["serial"]) == (401, "revoked", thief.files.serial)
        # ... and the session holding the key-bound token is revoked (its refresh token too)
        status, info, _ = await call(app.admin, "GET", f"/v1/sessions/{g['session_id']}", headers=admin_headers(home))
        assert info["status"] == "revoked", info
        # a session bound to another agent's key is untouched
        async with agent_session(other, home) as s:
            st, item, _ = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=g_other["token"], agent_id="agent_b"
            )
            assert st == 200, item


# ----------------------------------------------------------------------- agent revoke: sessions


async def _bound_sessions(app: Appliance, agent: Agent, n: int) -> list[str]:
    return [(await app.grant(agent))["session_id"] for _ in range(n)]


async def session_status(app: Appliance, sid: str) -> str:
    _, info, _ = await call(app.admin, "GET", f"/v1/sessions/{sid}", headers=admin_headers(app.paths))
    return str(info["status"])


async def test_agent_revoke_revokes_its_sessions_by_default(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    async with appliance(home) as app:
        a, b = app.agent("agent_a"), app.agent("agent_b")
        mine = await _bound_sessions(app, a, 2)
        local = (await app.grant(a, profile="local", bind=False, audience=None))["session_id"]
        theirs = await _bound_sessions(app, b, 1)
        assert main(["--home", str(home.home), "agent", "revoke", "agent_a"]) == 0
        out = capsys.readouterr().out
        assert "2 live session(s) bound to these certificates revoked too" in out
        assert all(sid in out for sid in mine) and local in out  # the local one is named, and left alone
        assert [await session_status(app, sid) for sid in mine] == ["revoked", "revoked"]
        assert await session_status(app, local) == "active"
        assert await session_status(app, theirs[0]) == "active"


async def test_agent_revoke_keep_sessions(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    async with appliance(home) as app:
        a = app.agent("agent_a")
        mine = await _bound_sessions(app, a, 1)
        assert main(["--home", str(home.home), "agent", "revoke", "agent_a", "--keep-sessions"]) == 0
        assert "kept (--keep-sessions)" in capsys.readouterr().out
        assert await session_status(app, mine[0]) == "active"


# -------------------------------------------------------------------- authorize reuses the cert


def test_authorize_remote_reuses_the_agents_good_certificate(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca_store.init_all(home)
    agent = write_manifest(tmp_path / "agent", MANIFEST)

    def authorize(*extra: str) -> str:
        bundle = tmp_path / "bundle.json"
        assert (
            main(
                [
                    "--home",
                    str(home.home),
                    "authorize",
                    str(agent),
                    "--yes",
                    "--remote",
                    "--gateway-url",
                    "https://gw.example:9443",
                    "--bundle",
                    str(bundle),
                    *extra,
                ]
            )
            == 0
        )
        b = load_bundle(bundle)
        return ca.serial_hex(x509.load_pem_x509_certificate((b.agent_cert or "").encode()).serial_number)

    first = authorize()
    assert authorize() == first and authorize() == first
    assert "reused" in capsys.readouterr().out
    assert len([r for r in ca_store.list_agents(home) if r.agent_id == "calendar_agent"]) == 1
    # asked for: a new one
    second = authorize("--new-cert")
    assert second != first
    # a revoked certificate is never reused
    ca_store.revoke(home, f"serial:{second}")
    third = authorize()
    assert third not in (first, second)
    assert len([r for r in ca_store.list_agents(home) if r.agent_id == "calendar_agent"]) == 3


def test_certificate_due_for_renewal_is_not_reused(home: Paths, tmp_path: Path) -> None:
    ca_store.init_all(home)
    out = tmp_path / "a"
    old = ca_store.issue_with_key(home, "bot", out, HOUR, now=ca.utcnow() - HOUR * 0.8)
    again = ca_store.issue_with_key(home, "bot", out, reuse=True)
    assert not again.reused_cert and again.serial != old.serial
    assert ca_store.issue_with_key(home, "bot", out, reuse=True).serial == again.serial
    # another agent's certificate in that directory is not reused for this one
    other = ca_store.issue_with_key(home, "other", out, reuse=True)
    assert (
        not other.reused_cert
        and ca.agent_id_from_cert(x509.load_pem_x509_certificate(other.cert_file.read_bytes())) == "other"
    )
    ctx = build_client_context(other.ca_file, other.cert_file, other.key_file)
    assert ctx is not None
