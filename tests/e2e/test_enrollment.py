"""Enrollment without copying secrets (docs/enrollment.md), as a user and an agent run it: a real
``uomp gateway start`` process on real TLS, ``uomp agent invite`` / ``uomp requests`` on the user's
side and ``uomp enroll`` as a separate process with a home of its own on the agent's side.

Allowed: the happy path (the agent's key made on its side and never on the user's; the grant made
only on approval; the bundle reads through mTLS). Denied partners: a wrong code, a replayed code,
an expired code, the code with another manifest (all four one answer, byte for byte), a wrong CA
fingerprint (nothing sent), a wrong poll secret, a request the user denies, the consent refusals
of ``uomp authorize`` at approval, and the rate limit (past it even the right code is refused)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from gatewaykit import ledger_events
from portkit import own_ports_env
from shortdir import short_dir

from gateway import ca_store, enrollment
from gateway.cli.main import main
from gateway.client import UompClient
from gateway.client.tls import build_client_context
from gateway.config import Paths
from gateway.core import ca, enrolment

UOMP = [sys.executable, "-m", "gateway.cli.main"]
ROOT = Path(__file__).parents[2]
CALENDAR = ROOT / "examples" / "calendar_agent"

pytestmark = pytest.mark.timeout(120)
PER_SOURCE = 6


def run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A user-side ``uomp`` command, in this process (the CLI's own entry point, real files; the
    gateway and the agent are processes of their own)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["--home", str(home), *args])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def ok(home: Path, *args: str) -> str:
    res = run(home, *args)
    assert res.returncode == 0, f"uomp {' '.join(args)} -> {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


class Gateway:
    """``uomp gateway start`` as a child process; its stdout collected by a thread."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.proc = subprocess.Popen(
            [*UOMP, "--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.out: list[str] = []
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()
        self.port = int(self._wait(r"^gateway: https://localhost:(\d+) ").group(1))
        self.url = f"https://localhost:{self.port}"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self.out.append(line)

    def _wait(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.out):
                if m := rx.search(line):
                    return m
            if self.proc.poll() is not None:
                raise AssertionError("gateway exited:\n" + "".join(self.out))
            time.sleep(0.05)
        raise AssertionError("gateway not ready:\n" + "".join(self.out))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        self._t.join(5)


MADE: list[Path] = []  # temporary homes of this module (keys and tokens inside): removed at its end


def _tmpdir(prefix: str) -> Path:
    d = short_dir(prefix)  # short: Unix socket paths are limited
    MADE.append(d)
    return d


def _new_home(config: str) -> tuple[Path, dict[str, str]]:
    base = _tmpdir("uomp-en-")
    home = base / "home"
    env = own_ports_env()
    ok(home, "init")
    cfg = home / "config.toml"
    cfg.write_text((cfg.read_text() if cfg.exists() else "") + config)
    ok(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    return home, env


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    # each test that makes refused attempts makes them from a loopback address of its own
    home, env = _new_home(f"[gateway]\nenroll_max_failures_per_source = {PER_SOURCE}\n")
    g = Gateway(home, env)
    try:
        yield g
    finally:
        g.stop()
        for d in MADE:
            shutil.rmtree(d, ignore_errors=True)


def invite(g: Gateway, manifest: Path = CALENDAR) -> str:
    out = ok(g.home, "agent", "invite", str(manifest), "--expires", "10m")
    m = re.search(r"^  (https://\S+/enroll#code=\S+)$", out, re.M)
    assert m, out
    return m.group(1)


class Enroller:
    """``uomp enroll`` on the agent's side: its own HOME and working directory, a process of its own."""

    def __init__(self, line: str, manifest: Path = CALENDAR, *extra: str) -> None:
        self.base = _tmpdir("uomp-agent-")
        self.out = self.base / "agent-files"
        env = dict(os.environ, HOME=str(self.base), UOMP_HOME=str(self.base / "never-used"))
        self.proc = subprocess.Popen(
            [*UOMP, "enroll", line, "--manifest", str(manifest), "--out", str(self.out), "--wait", "1m", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=self.base,
        )
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.readline()  # "Request enr_... sent to ...; agent key <jkt>"

    def request(self) -> tuple[str, str]:
        m = re.match(r"Request (enr_[0-9a-f]+) sent to \S+; agent key (\S+)", self.first)
        assert m, self.first + (self.proc.stderr.read() if self.proc.stderr and self.proc.poll() is not None else "")
        return m.group(1), m.group(2)

    def finish(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=90)
        return self.proc.returncode, self.first + out, err


def _pending(g: Gateway) -> list[dict[str, Any]]:
    return [r for r in json.loads(ok(g.home, "requests", "list", "--json")) if r["status"] == "pending"]


def _all_bytes(root: Path) -> bytes:
    blob = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_socket():
            try:
                blob.append(p.read_bytes())
            except OSError:
                pass
    return b"\n".join(blob)


def test_enrollment_happy_path_key_never_on_the_user_side(gw: Gateway) -> None:
    line = invite(gw)
    agent = Enroller(line)
    request_id, fingerprint = agent.request()
    # the user sees what the agent asked for, with the key fingerprint the agent printed
    [row] = [r for r in _pending(gw) if r["request_id"] == request_id]
    assert (row["agent_id"], row["key_fingerprint"], row["client"]) == ("calendar_agent", fingerprint, "127.0.0.1")
    listed = ok(gw.home, "requests", "list")
    assert request_id in listed and fingerprint[:12] in listed
    # nothing granted before the approval
    sessions = json.loads(ok(gw.home, "sessions", "list", "--json"))
    assert not [s for s in sessions if s["agent_id"] == "calendar_agent"]

    shown = ok(gw.home, "requests", "approve", request_id, "--yes")
    assert fingerprint in shown and "Retention:" in shown and "UNVERIFIED PUBLISHER" in shown
    assert "tags=['preference']" in shown
    rc, out, err = agent.finish()
    assert rc == 0, out + err
    assert "Approved" in out

    files = agent.out
    assert {p.name for p in files.iterdir()} == {"agent.key", "agent.crt", "ca.crt", "bundle.json"}
    assert (files / "agent.key").stat().st_mode & 0o777 == 0o600
    assert (files / "bundle.json").stat().st_mode & 0o777 == 0o600
    bundle = json.loads((files / "bundle.json").read_text())
    assert bundle["agent_key"] is None and bundle["agent_key_file"] == str((files / "agent.key").resolve())

    async def read() -> Any:
        async with UompClient.from_bundle(files / "bundle.json") as c:
            return (await c.get("preference.theme"))["value"]

    assert asyncio.run(read()) == "dark"

    # the user's home never held the agent's private key, nor (in the clear) its tokens
    key = serialization.load_pem_private_key((files / "agent.key").read_bytes(), password=None)
    secrets_of_agent = [
        (files / "agent.key").read_bytes().strip(),
        key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        key.private_numbers().private_value.to_bytes(32, "big"),  # type: ignore[union-attr]
        bundle["access_token"].encode(),
        bundle["refresh_token"].encode(),
    ]
    pem_body = b"".join((files / "agent.key").read_bytes().splitlines()[1:-1])
    user_side = _all_bytes(gw.home)
    for s in [*secrets_of_agent, pem_body, base64.b64decode(pem_body)]:
        assert s not in user_side
    assert not list(gw.home.rglob("agent.key"))

    # the decisions are in the user's audit log
    paths = Paths(gw.home)
    assert [e["key"] for e in ledger_events(paths, action="enroll", allowed=True)][-1] == request_id
    actions = [e["action"] for e in ledger_events(paths, agent_id="calendar_agent")]
    assert {"enroll_invited", "enroll_approved", "cert_issued", "session_granted"} <= set(actions)

    # the same code again: refused
    status, body = asyncio.run(_post(gw, "/v1/enroll", _csr_body(_code(line), (CALENDAR / "uom.json").read_bytes())))
    assert (status, body["error"]["code"]) == (403, "ENROLL_CODE_INVALID")


# --------------------------------------------------------------------------- HTTP level


def _csr_body(code: str, manifest: bytes, agent_id: str = "calendar_agent") -> dict[str, str]:
    key = ca.new_key("p256")
    seal = (
        X25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    return {
        "code": code,
        "manifest": manifest.decode(),
        "csr": ca.make_csr(key, agent_id).public_bytes(serialization.Encoding.PEM).decode(),
        "seal_key": enrolment.b64u(seal),
    }


async def _post(g: Gateway, path: str, body: dict[str, Any], *, source: str = "127.0.0.1") -> tuple[int, Any]:
    ctx = build_client_context(ca_store.ca_cert_path(Paths(g.home)))
    connector = aiohttp.TCPConnector(ssl=ctx, local_addr=(source, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(g.url + path, json=body) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


def _code(line: str) -> str:
    return enrolment.parse_line(line).code


async def test_every_bad_code_gets_the_same_answer(gw: Gateway) -> None:
    manifest = (CALENDAR / "uom.json").read_bytes()
    # replayed: a code already spent on a request
    spent = _code(invite(gw))
    status, opened = await _post(gw, "/v1/enroll", _csr_body(spent, manifest))
    assert status == 202, opened
    # expired: a code whose time is over (made in the real store, as the CLI makes it, ten minutes ago)
    old = enrollment.create_invite(
        Paths(gw.home),
        agent_id="calendar_agent",
        manifest_digest=enrolment.manifest_digest(manifest),
        gateway_url=gw.url,
        seconds=60,
        now=time.time() - 600,
    )
    # other manifest: a live code presented with a manifest it was not issued for
    live = _code(invite(gw))
    other = json.loads(manifest)
    other["requested_scopes"]["read"]["tags"].append("identity")
    other_raw = json.dumps(other).encode()
    wrong = "0" * 12
    cases = {
        "wrong": _csr_body(wrong, manifest),
        "replayed": _csr_body(spent, manifest),
        "expired": _csr_body(enrolment.normalize_code(old.code) or "", manifest),
        "other-manifest": _csr_body(live, other_raw),
        "missing": {k: v for k, v in _csr_body(wrong, manifest).items() if k != "code"},
    }
    answers = {name: await _post(gw, "/v1/enroll", body, source="127.0.0.3") for name, body in cases.items()}
    first = answers["wrong"]
    assert first[0] == 403 and first[1]["error"]["code"] == "ENROLL_CODE_INVALID", first
    for name, answer in answers.items():
        assert answer == first, name  # status and body, byte for byte the same
    # the user's log says which it was
    reasons = [e["reason"] for e in ledger_events(Paths(gw.home), action="enroll", allowed=False)]
    for why in ("unknown code", "already used", "expired", "another manifest"):
        assert any(why in r for r in reasons), (why, reasons)
    # the live code was not spent by the wrong manifest: with its own manifest it opens a request
    status, body = await _post(gw, "/v1/enroll", _csr_body(live, manifest))
    assert status == 202, body
    # a re-indented copy of the same manifest is the same manifest
    again = _code(invite(gw))
    status, body = await _post(gw, "/v1/enroll", _csr_body(again, json.dumps(json.loads(manifest), indent=7).encode()))
    assert status == 202, body


async def test_poll_with_a_wrong_secret_learns_nothing(gw: Gateway) -> None:
    manifest = (CALENDAR / "uom.json").read_bytes()
    status, opened = await _post(gw, "/v1/enroll", _csr_body(_code(invite(gw)), manifest))
    assert status == 202
    rid = opened["request_id"]
    mine = await _post(gw, f"/v1/enroll/{rid}/status", {"poll_token": opened["poll_token"]})
    assert mine[0] == 202 and mine[1]["status"] == "pending"
    wrong_secret = await _post(gw, f"/v1/enroll/{rid}/status", {"poll_token": "x" * 43}, source="127.0.0.4")
    unknown_id = await _post(
        gw, "/v1/enroll/enr_0000000000000000/status", {"poll_token": opened["poll_token"]}, source="127.0.0.4"
    )
    assert wrong_secret == unknown_id
    assert wrong_secret[0] == 404 and wrong_secret[1]["error"]["code"] == "NOT_FOUND"


async def test_wrong_ca_fingerprint_sends_nothing(gw: Gateway) -> None:
    line = invite(gw)
    forged = re.sub(r"ca=sha256:[0-9a-f]{64}", "ca=sha256:" + "ab" * 32, line)
    before = len(ledger_events(Paths(gw.home), action="enroll"))
    agent = Enroller(forged)
    rc, out, err = agent.finish()
    assert rc == 1 and "error CA_ERROR" in err and "fingerprint mismatch" in err, out + err
    assert not (agent.out / "agent.key").exists()
    assert len(ledger_events(Paths(gw.home), action="enroll")) == before  # the code never reached the gateway
    # the code is still good for the real gateway
    status, body = await _post(gw, "/v1/enroll", _csr_body(_code(line), (CALENDAR / "uom.json").read_bytes()))
    assert status == 202, body


def test_denied_request_grants_nothing(gw: Gateway) -> None:
    agent = Enroller(invite(gw))
    rid, _ = agent.request()
    before = json.loads(ok(gw.home, "sessions", "list", "--json"))
    out = ok(gw.home, "requests", "deny", rid, "--reason", "not today")
    assert "Denied" in out
    rc, out, err = agent.finish()
    assert rc == 1 and "error ENROLL_DENIED" in err and "not today" in err, out + err
    assert list(agent.out.iterdir()) == []  # nothing left behind: the same --out can enroll again
    assert json.loads(ok(gw.home, "sessions", "list", "--json")) == before
    # decided once: neither approve nor deny acts on it again
    again = run(gw.home, "requests", "approve", rid, "--yes")
    assert again.returncode == 1 and "INVALID_STATE" in again.stderr


def test_approval_has_the_consent_rules_of_authorize(gw: Gateway) -> None:
    agent = Enroller(invite(gw))
    rid, _ = agent.request()
    wider = run(gw.home, "requests", "approve", rid, "--yes", "--tag", "identity")
    assert wider.returncode == 1 and "add --widen" in wider.stderr, wider.stderr
    unverified = run(gw.home, "requests", "approve", rid, "--yes", "--require-verified")
    assert unverified.returncode == 1 and "ACCESS_DENIED" in unverified.stderr, unverified.stderr
    no_tty = subprocess.run(
        [*UOMP, "--home", str(gw.home), "requests", "approve", rid],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )  # its own process: stdin is not a terminal
    assert no_tty.returncode == 1 and "pass --yes" in no_tty.stderr
    assert [r["request_id"] for r in _pending(gw) if r["request_id"] == rid] == [rid]  # still pending
    # narrowing is the user's right; --widen grants beyond the request, said in red on the panel
    out = ok(gw.home, "requests", "approve", rid, "--yes", "--tag", "preference", "--tag", "identity", "--widen")
    assert "WIDER THAN REQUESTED" in out
    rc, _, err = agent.finish()
    assert rc == 0, err
    bundle = json.loads((agent.out / "bundle.json").read_text())
    claims = json.loads(base64.urlsafe_b64decode(bundle["access_token"].split(".")[1] + "=="))
    assert sorted(claims["scopes"]["read"]["tags"]) == ["identity", "preference"]


def test_approval_applies_the_trust_require_policy(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """[trust] require (spec §16.4) holds for an approval as for uomp authorize: an unverified
    publisher gets no session and no certificate, and the request stays pending; without the
    policy the same request is granted."""
    agent = Enroller(invite(gw))
    rid, _ = agent.request()
    sessions = json.loads(ok(gw.home, "sessions", "list", "--json"))
    certs = ok(gw.home, "agent", "list", "--json")
    monkeypatch.setenv("UOMP_TRUST_REQUIRE", "did:key")
    refused = run(gw.home, "requests", "approve", rid, "--yes")
    assert refused.returncode == 1 and "error ACCESS_DENIED" in refused.stderr, refused.stderr
    assert "no session is created" in refused.stderr
    assert json.loads(ok(gw.home, "sessions", "list", "--json")) == sessions
    assert ok(gw.home, "agent", "list", "--json") == certs
    assert [r["request_id"] for r in _pending(gw) if r["request_id"] == rid] == [rid]
    monkeypatch.delenv("UOMP_TRUST_REQUIRE")
    ok(gw.home, "requests", "approve", rid, "--yes")
    rc, _, err = agent.finish()
    assert rc == 0, err


async def test_rate_limit_refuses_even_the_right_code(gw: Gateway) -> None:
    manifest = (CALENDAR / "uom.json").read_bytes()
    good = _code(invite(gw))
    for _ in range(PER_SOURCE):
        status, body = await _post(gw, "/v1/enroll", _csr_body("1" * 12, manifest), source="127.0.0.5")
        assert (status, body["error"]["code"]) == (403, "ENROLL_CODE_INVALID")
    before = len(enrollment.list_requests(Paths(gw.home)))
    status, body = await _post(gw, "/v1/enroll", _csr_body(good, manifest), source="127.0.0.5")
    assert (status, body["error"]["code"]) == (429, "RATE_LIMITED"), body
    assert "wait a few minutes" in body["error"]["message"]
    assert len(enrollment.list_requests(Paths(gw.home))) == before  # the right code opened nothing
    # another address is not held back by this one's failures, and the code was not spent
    status, body = await _post(gw, "/v1/enroll", _csr_body(good, manifest), source="127.0.0.6")
    assert status == 202, body


async def _dashboard_agents_page(home: Path) -> str:
    from gateway.config import DashboardConfig
    from gateway.dashboard import security
    from gateway.dashboard.server import Dashboard

    d = Dashboard(Paths(home), DashboardConfig(port=0))
    await d.start()
    try:
        async with aiohttp.ClientSession() as http:
            link = d.login_link()
            async with http.get(link, allow_redirects=False) as r:
                m = re.match(rf"{security.COOKIE_NAME}=([^;]+);", r.headers["Set-Cookie"])
                assert m
            cookie = {"Cookie": f"{security.COOKIE_NAME}={m.group(1)}"}
            async with http.get(d.base_url + "/agents", headers=cookie) as r:
                assert r.status == 200
                return await r.text()
    finally:
        await d.stop()


async def test_dashboard_shows_what_a_pending_request_asks_for(gw: Gateway) -> None:
    manifest = (CALENDAR / "uom.json").read_bytes()
    status, opened = await _post(gw, "/v1/enroll", _csr_body(_code(invite(gw)), manifest))
    assert status == 202
    html = await _dashboard_agents_page(gw.home)
    row = html[html.index(opened["request_id"]) :]
    row = row[: row.index("</tr>")]
    assert "pending" in row and "Calendar Assistant" in row
    assert "read tags [&#39;preference&#39;]" in row or "read tags ['preference']" in row
    assert "Retention: keeps data up to 300 s" in row
    assert "Publisher: &#34;example-org&#34; (not verified" in row or 'Publisher: "example-org" (not verified' in row
    assert f"uomp requests approve {opened['request_id']}" in row and opened["key_fingerprint"] in row
    assert opened["poll_token"] not in html  # the agent's poll secret is never shown


def test_a_request_decided_during_the_approval_leaves_no_grant(gw: Gateway) -> None:
    """The user answers the panel on a terminal while the request is denied from another one: the
    approval finds it no longer pending, and ends the session and revokes the certificate it made."""
    import pty

    before = {s["session_id"] for s in json.loads(ok(gw.home, "sessions", "list", "--json"))}
    agent = Enroller(invite(gw))
    rid, _ = agent.request()
    leader, follower = pty.openpty()
    approve = subprocess.Popen(
        [*UOMP, "--home", str(gw.home), "requests", "approve", rid],
        stdin=follower,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # stdin a terminal: the panel asks
    os.close(follower)
    try:
        assert approve.stdout is not None
        fd = approve.stdout.fileno()
        seen = b""
        deadline = time.monotonic() + 60
        while b"Grant this access?" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                chunk = os.read(fd, 4096)  # the panel, then input()'s prompt (flushed)
                if not chunk:
                    break
                seen += chunk
        assert b"Grant this access?" in seen, seen
        ok(gw.home, "requests", "deny", rid, "--reason", "changed my mind")
        os.write(leader, b"y\n")
        rest, err = approve.communicate(timeout=60)
        out = seen.decode() + rest
    finally:
        os.close(leader)
    assert approve.returncode == 1 and "INVALID_STATE" in err, out + err
    rc, _, agent_err = agent.finish()
    assert rc == 1 and "changed my mind" in agent_err
    [made] = [s for s in json.loads(ok(gw.home, "sessions", "list", "--json")) if s["session_id"] not in before]
    assert made["status"] == "revoked" and "authorize did not finish" in made.get("status_reason", ""), made
    [issued] = [e for e in ledger_events(Paths(gw.home), action="cert_issued") if rid in (e.get("detail") or "")]
    serial = re.search(r"serial ([0-9a-f]+)", issued["detail"])
    assert serial
    [cert] = [c for c in json.loads(ok(gw.home, "agent", "list", "--json")) if c["serial"] == serial.group(1)]
    assert cert["status"] == "revoked", cert


@pytest.mark.parametrize("field", ["manifest", "csr", "seal_key", "code"])
async def test_malformed_requests_are_clear_refusals(gw: Gateway, field: str) -> None:
    source = f"127.0.1.{['manifest', 'csr', 'seal_key', 'code'].index(field) + 1}"  # (its own failure count)
    body = _csr_body("0" * 12, (CALENDAR / "uom.json").read_bytes())
    raw = json.dumps({**body, field: "PLACEHOLDER"}).replace('"PLACEHOLDER"', '"\\ud800"').encode()
    ctx = build_client_context(ca_store.ca_cert_path(Paths(gw.home)))
    connector = aiohttp.TCPConnector(ssl=ctx, local_addr=(source, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(gw.url + "/v1/enroll", data=raw, headers={"Content-Type": "application/json"}) as r,
    ):
        answer = await r.json(content_type=None)
    expected = 403 if field == "code" else 400  # a code that is no code is a wrong code
    assert r.status == expected, answer
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, local_addr=(source, 0))) as s,
        s.post(gw.url + "/v1/enroll/enr_0/status", data=b'{"poll_token": "\\ud800"}') as r,
    ):
        assert r.status == 400, await r.text()


def test_approve_grants_the_write_scope_only_with_grant_writes(gw: Gateway) -> None:
    """An enrolled agent whose manifest asks to write gets proposals rights only when the user approves with
    ``--grant-writes``; approved without it, its token carries no write scope."""
    doc = json.loads((CALENDAR / "uom.json").read_text())
    doc["requested_scopes"]["write"] = {"tags": ["preference"], "keys": []}
    for flag in ((), ("--grant-writes",)):
        where = _tmpdir("uomp-writer-") / "manifest"
        where.mkdir()
        (where / "uom.json").write_text(json.dumps(doc))
        agent = Enroller(invite(gw, where), where)
        rid, _ = agent.request()
        out = ok(gw.home, "requests", "approve", rid, "--yes", *flag)
        rc, _, err = agent.finish()
        assert rc == 0, err
        bundle = json.loads((agent.out / "bundle.json").read_text())
        claims = json.loads(base64.urlsafe_b64decode(bundle["access_token"].split(".")[1] + "=="))
        if flag:
            assert claims["scopes"]["write"]["tags"] == ["preference"] and "granted as proposals" in out
        else:
            write = claims["scopes"].get("write") or {}
            assert not write.get("tags") and not write.get("keys") and "Writes:    NOT granted" in out
