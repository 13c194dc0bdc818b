"""The encrypted payload relay end to end on 127.0.0.1: the real guard on its Unix socket,
the gateway with real TLS 1.3 (mTLS listener and the DPoP tunnel-origin listener), bundles made by
the real ``uomp authorize --remote``, the SDK sealing and uploading, the CLI pulling and opening.
Every accepted case has refused partners, each with its code; refusals leave nothing behind."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import sqlite3
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from gatewaykit import Appliance, agent_session, ledger_events
from guardkit import admin_headers, call, grant, guard_config, running_guard, seed, unix_session
from test_sdk import TUNNEL, access_events, authorize_csr, authorize_out, sdk_appliance

from gateway import ca_store
from gateway.bundle import load_bundle, write_bundle
from gateway.cli.main import main as uomp
from gateway.client import (
    AccessDenied,
    ConfigError,
    InvalidRequest,
    PayloadRejected,
    QuotaExceeded,
    UompClient,
)
from gateway.client import payloads as sdk_payloads
from gateway.config import Paths
from gateway.core import envelope, sealing
from gateway.payloads import userkey

pytestmark = pytest.mark.timeout(120)

SECRET = b"MARKER-plaintext-7f3a9c annual report: portfolio up 12%\n"
UOMP = [sys.executable, "-m", "gateway.cli.main"]


@pytest.fixture
async def app(home: Paths) -> AsyncIterator[Appliance]:
    async with sdk_appliance(
        home, status_cache_seconds=0, payload_max_bytes=8 << 20, payload_max_json_bytes=64 << 10
    ) as a:
        yield a


def store_state(paths: Paths) -> tuple[list[str], list[str], list[str]]:
    """(index rows, blob files, temporary files) of the payload store."""
    root = paths.payload_dir
    conn = sqlite3.connect(root / "index.db")
    try:
        rows = [r[0] for r in conn.execute("SELECT payload_id FROM payloads")]
    finally:
        conn.close()
    return rows, sorted(p.name for p in (root / "blobs").iterdir()), sorted(p.name for p in (root / "tmp").iterdir())


def audit_rows(paths: Paths, action: str | None = None) -> list[dict[str, Any]]:
    from gateway.ledger.query import MAX_LIMIT, AuditFilter, query_events

    conn = sqlite3.connect(paths.audit_db)
    try:
        return query_events(conn, AuditFilter(action=(action,) if action else (), limit=MAX_LIMIT)).events
    finally:
        conn.close()


def cli(paths: Paths, *args: str, capsys: pytest.CaptureFixture[str] | None = None) -> tuple[int, str, str]:
    rc = uomp(["--home", str(paths.home), *args])
    if capsys is None:
        return rc, "", ""
    out = capsys.readouterr()
    return rc, out.out, out.err


async def acli(paths: Paths, *args: str) -> tuple[int, str, str]:
    """The CLI in a subprocess (the guard serves in this process's event loop)."""
    proc = await asyncio.create_subprocess_exec(
        *UOMP, "--home", str(paths.home), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# ---------------------------------------------------------------------------------- keys


def test_init_makes_the_payload_key_and_an_old_home_gets_one(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    assert not home.payload_private_key.exists()  # a home from before payloads (conftest: init_home only)
    rc, out, _ = cli(home, "payload", "pubkey", capsys=capsys)
    assert rc == 0 and len(base64.b64decode(out.strip())) == 32
    assert oct(home.payload_private_key.stat().st_mode & 0o777) == "0o600"
    rc, out2, _ = cli(home, "payload", "pubkey", capsys=capsys)
    assert out2 == out  # never replaced
    rc, out3, _ = cli(home, "init", capsys=capsys)
    assert rc == 0 and "payload key: kept" in out3
    # a broken key file is an error naming it, never silently replaced
    home.payload_private_key.write_bytes(b"garbage")
    rc, _, err = cli(home, "payload", "pubkey", capsys=capsys)
    assert rc == 1 and "KEY_ERROR" in err and str(home.payload_private_key) in err
    home.payload_private_key.unlink()
    os.chmod(home.secrets, 0o700)
    rc, out4, _ = cli(home, "init", capsys=capsys)
    assert "payload key: created" in out4


def test_concurrent_creation_yields_one_key(home: Paths) -> None:
    results: list[str] = []

    def make() -> None:
        results.append(userkey.public_b64(home))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 8
    assert [p.name for p in home.secrets.iterdir() if "payload" in p.name] == ["payload-x25519.key"]


# ------------------------------------------------------------------------ the happy paths


async def test_sdk_uploads_cli_lists_pulls_and_removes(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(app, tmp_path)
    b = load_bundle(bundle)
    assert b.payload_public_key == userkey.public_b64(app.paths)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    async with UompClient.from_bundle(bundle) as c:
        small = await c.upload_payload(SECRET, format="text/markdown")
        streamed = await c.upload_payload(big, format="application/octet-stream")
        via_url = await c.upload_payload(SECRET * 10, format="text/plain", presigned=True)
        empty = await c.upload_payload(b"", format="text/plain")
    rc, out, err = await acli(app.paths, "payload", "list", "--json")
    assert rc == 0, err
    listed = {p["payload_id"]: p for p in json.loads(out)}
    assert set(listed) == {small, streamed, via_url, empty}
    assert listed[small]["session_id"] == b.session_id and listed[small]["agent_id"] == b.agent_id
    assert listed[small]["format"] == "text/markdown" and not listed[small]["opened"]
    rc, table, _ = await acli(app.paths, "payload", "list")
    assert small in table and "text/markdown" in table
    for pid, want in ((small, SECRET), (streamed, big.read_bytes()), (via_url, SECRET * 10), (empty, b"")):
        out_file = tmp_path / f"{pid}.out"
        rc, _, err = await acli(app.paths, "payload", "pull", pid, "--out", str(out_file))
        assert rc == 0, err
        assert out_file.read_bytes() == want
        assert oct(out_file.stat().st_mode & 0o777) == "0o600"
    rc, out, _ = await acli(app.paths, "payload", "list", "--json")
    assert all(p["opened"] for p in json.loads(out))
    # every accepted payload is one payload_uploaded event carrying its hash
    uploaded = audit_rows(app.paths, "payload_uploaded")
    assert sorted(r["key"] for r in uploaded) == sorted(listed)
    for r in uploaded:
        assert r["detail"] == listed[r["key"]]["hash"] and r["allowed"] == 1 and r["session_id"] == b.session_id
    assert len(audit_rows(app.paths, "payload_opened")) == 4
    rc, _, err = await acli(app.paths, "payload", "rm", small)
    assert rc == 0, err
    rows, blobs, tmp = store_state(app.paths)
    assert small not in rows and small not in blobs and tmp == []
    rc, _, err = await acli(app.paths, "payload", "pull", small, "--out", str(tmp_path / "gone"))
    assert rc == 1 and "NOT_FOUND" in err and not (tmp_path / "gone").exists()


async def test_dpop_upload_through_the_tunnel_origin(app: Appliance, tmp_path: Path) -> None:
    bundle = authorize_out(app, tmp_path, url=TUNNEL)
    origin = f"http://127.0.0.1:{app.gateway.tunnel_port}"
    data = os.urandom(600 * 1024)
    async with UompClient.from_bundle(bundle, mode="dpop", base_url=origin) as c:
        pid = await c.upload_payload(SECRET, format="text/markdown")
        pid2 = await c.upload_payload(data, format="application/octet-stream")
        pid3 = await c.upload_payload(data[:1000], format="text/plain", presigned=True)
        with pytest.raises(InvalidRequest) as nf:
            await c._call("GET", f"/v1/payload/{pid}")
        assert nf.value.code == "NOT_FOUND"
    for p, want in ((pid, SECRET), (pid2, data), (pid3, data[:1000])):
        rc, _, err = await acli(app.paths, "payload", "pull", p, "--out", str(tmp_path / p))
        assert rc == 0, err
        assert (tmp_path / p).read_bytes() == want
    # one event per upload (the guard's, with the gateway's fields), on the listener it came in on
    uploads = [e for e in access_events(app.paths) if e["action"] in ("payload_upload", "payload_uploaded")]
    assert {e["action"] for e in uploads} == {"payload_uploaded"} and len(uploads) == 3
    assert {e["listener"] for e in uploads} == {"tunnel"}


# ------------------------------------------------------------------------- raw uploads

CAP = 64 * 1024  # payload_max_bytes of the small appliance below


@pytest.fixture
async def small(home: Paths) -> AsyncIterator[Appliance]:
    async with sdk_appliance(
        home, status_cache_seconds=0, payload_max_bytes=CAP, payload_max_json_bytes=32 * 1024, payload_max_per_session=3
    ) as a:
        yield a


@dataclasses.dataclass
class Sealed:
    doc: dict[str, Any]  # the JSON envelope (with ciphertext)
    sealed: bytes

    def header(self) -> dict[str, Any]:
        return {k: v for k, v in self.doc.items() if k != "ciphertext"}


def seal(
    paths: Paths, sid: str, aid: str, data: bytes = SECRET, *, fmt: str = "text/plain", recipient: Any = None
) -> Sealed:
    pub = recipient or envelope.parse_public_key(userkey.public_b64(paths))
    binding = sealing.Binding(sdk_payloads.new_payload_id(), sid, aid, fmt)
    return Sealed(sdk_payloads.seal_small(pub, binding, data), sealing.seal_bytes(pub, binding, data)[1])


def seal_consistent(paths: Paths, sid: str, aid: str, data: bytes = SECRET) -> Sealed:
    doc = sdk_payloads.seal_small(
        envelope.parse_public_key(userkey.public_b64(paths)),
        sealing.Binding(sdk_payloads.new_payload_id(), sid, aid, "text/plain"),
        data,
    )
    return Sealed(doc, base64.b64decode(doc["ciphertext"]))


def b64h(doc: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()


async def chunks(data: bytes, size: int = 4096) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@dataclasses.dataclass
class Agent:
    session: aiohttp.ClientSession
    base: str
    token: str
    agent_id: str
    session_id: str

    async def send(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, data: Any = None, json_body: Any = None
    ) -> tuple[int, Any]:
        hdrs = {"Authorization": f"Bearer {self.token}", "X-UOMP-Agent-Id": self.agent_id, **(headers or {})}
        async with self.session.request(method, self.base + path, headers=hdrs, data=data, json=json_body) as r:
            raw = await r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw

    async def stream(
        self,
        s: Sealed,
        body: Any = None,
        *,
        header: dict[str, Any] | None = None,
        path: str = "/v1/payload/upload",
        method: str = "POST",
    ) -> tuple[int, Any]:
        return await self.send(
            method,
            path,
            data=s.sealed if body is None else body,
            headers={"Content-Type": "application/octet-stream", envelope.HEADER_NAME: b64h(header or s.header())},
        )


@contextlib.asynccontextmanager
async def agent_for(app: Appliance, agent_id: str = "calendar_agent") -> AsyncIterator[Agent]:
    agent = app.agent(agent_id)
    g = await app.grant(agent)
    async with agent_session(agent, app.paths) as session:
        yield Agent(session, app.base, g["token"], agent_id, g["session_id"])


def _doc(**changes: Any) -> Callable[[Sealed], tuple[str, Any]]:
    def make(s: Sealed) -> tuple[str, Any]:
        doc = dict(s.doc)
        for k, v in changes.items():
            if v is KeyError:
                doc.pop(k)
            else:
                doc[k] = v
        return "json", doc

    return make


def _enc(**changes: Any) -> Callable[[Sealed], tuple[str, Any]]:
    def make(s: Sealed) -> tuple[str, Any]:
        return "json", {**s.doc, "encryption": {**s.doc["encryption"], **changes}}

    return make


def _flip(s: Sealed) -> tuple[str, Any]:
    ct = bytearray(s.sealed)
    ct[100] ^= 1
    return "json", {**s.doc, "ciphertext": base64.b64encode(bytes(ct)).decode()}


OTHER_HASH = "sha256:" + "ab" * 32
JSON_ATTACKS: list[tuple[str, Callable[[Sealed], tuple[str, Any]], int, str]] = [
    ("wrong-session", _doc(session_id="sess_someone_else"), 403, "ACCESS_DENIED"),
    ("wrong-agent", _doc(agent_id="stock-analyst"), 403, "AGENT_MISMATCH"),
    ("hash-mismatch", _doc(hash=OTHER_HASH), 400, "PAYLOAD_HASH_MISMATCH"),
    ("ciphertext-changed-after-hashing", _flip, 400, "PAYLOAD_HASH_MISMATCH"),
    (
        "size-not-ciphertext-length",
        lambda s: ("json", {**s.doc, "size": s.doc["size"] + 1}),
        400,
        "PAYLOAD_SIZE_MISMATCH",
    ),
    ("declared-oversize", _doc(size=CAP + 1), 400, "PAYLOAD_SIZE_MISMATCH"),
    ("missing-hash", _doc(hash=KeyError), 400, "INVALID_REQUEST"),
    ("extra-field", _doc(note="hi"), 400, "INVALID_REQUEST"),
    ("bad-payload-id", _doc(payload_id="../../etc/passwd"), 400, "INVALID_REQUEST"),
    ("bad-format", _doc(format="text/markdown\r\nX: y"), 400, "INVALID_REQUEST"),
    ("size-is-bool", _doc(size=True), 400, "INVALID_REQUEST"),
    ("size-below-minimum", _doc(size=10), 400, "INVALID_REQUEST"),
    ("bad-timestamp", _doc(timestamp="yesterday"), 400, "INVALID_REQUEST"),
    ("spec-example-algorithm", _enc(algorithm="ECDH-X25519-AES256GCM"), 400, "INVALID_REQUEST"),
    ("short-sender-key", _enc(sender_public_key=base64.b64encode(b"k" * 31).decode()), 400, "INVALID_REQUEST"),
    ("encryption-extra-field", _enc(iv="AAAA"), 400, "INVALID_REQUEST"),
    ("ciphertext-not-base64", _doc(ciphertext="%%%"), 400, "INVALID_REQUEST"),
    ("not-an-object", lambda s: ("json", [s.doc]), 400, "INVALID_REQUEST"),
    ("oversize-json-body", lambda s: ("json", {**s.doc, "ciphertext": "A" * (40 * 1024)}), 413, "PAYLOAD_TOO_LARGE"),
]


@pytest.mark.parametrize(("mutate", "status", "code"), [a[1:] for a in JSON_ATTACKS], ids=[a[0] for a in JSON_ATTACKS])
async def test_json_envelope_refusals_leave_nothing(
    small: Appliance, mutate: Callable[[Sealed], tuple[str, Any]], status: int, code: str
) -> None:
    async with agent_for(small) as a:
        s = seal_consistent(small.paths, a.session_id, a.agent_id)
        _, doc = mutate(s)
        got = await a.send("POST", "/v1/payload/upload", json_body=doc)
        assert (got[0], got[1]["error"]["code"]) == (status, code), got
        assert store_state(small.paths) == ([], [], [])
        refused = audit_rows(small.paths, "payload_refused")
        assert [r["detail"] for r in refused] == [code] and refused[0]["session_id"] == a.session_id
        assert audit_rows(small.paths, "payload_uploaded") == []
        # the partner: the same agent's honest envelope is stored
        ok = await a.send("POST", "/v1/payload/upload", json_body=s.doc)
        assert ok[0] == 201 and ok[1]["hash"] == s.doc["hash"] and ok[1]["payload_id"] == s.doc["payload_id"]


STREAM_ATTACKS: list[tuple[str, Callable[[Sealed], tuple[dict[str, Any], Any, dict[str, str]]], int, str]] = [
    ("wrong-session", lambda s: ({**s.header(), "session_id": "sess_x"}, s.sealed, {}), 403, "ACCESS_DENIED"),
    ("wrong-agent", lambda s: ({**s.header(), "agent_id": "x"}, s.sealed, {}), 403, "AGENT_MISMATCH"),
    ("hash-mismatch", lambda s: ({**s.header(), "hash": OTHER_HASH}, s.sealed, {}), 400, "PAYLOAD_HASH_MISMATCH"),
    ("declared-oversize", lambda s: ({**s.header(), "size": CAP + 1}, s.sealed, {}), 413, "PAYLOAD_TOO_LARGE"),
    (
        "actual-oversize-chunked",
        lambda s: (s.header(), chunks(s.sealed + b"x" * (CAP + 10)), {}),
        413,
        "PAYLOAD_TOO_LARGE",
    ),
    ("longer-than-declared-chunked", lambda s: (s.header(), chunks(s.sealed + b"x"), {}), 413, "PAYLOAD_TOO_LARGE"),
    ("shorter-than-declared-chunked", lambda s: (s.header(), chunks(s.sealed[:-1]), {}), 400, "PAYLOAD_SIZE_MISMATCH"),
    ("content-length-not-size", lambda s: (s.header(), s.sealed[:-1], {}), 400, "PAYLOAD_SIZE_MISMATCH"),
    ("ciphertext-in-header", lambda s: ({**s.header(), "ciphertext": "AAAA"}, s.sealed, {}), 400, "INVALID_REQUEST"),
    (
        "header-not-base64url",
        lambda s: (s.header(), s.sealed, {envelope.HEADER_NAME: "{not base64}"}),
        400,
        "INVALID_REQUEST",
    ),
    ("wrong-content-type", lambda s: (s.header(), s.sealed, {"Content-Type": "text/plain"}), 400, "INVALID_REQUEST"),
]


@pytest.mark.parametrize(
    ("mutate", "status", "code"), [a[1:] for a in STREAM_ATTACKS], ids=[a[0] for a in STREAM_ATTACKS]
)
async def test_streaming_refusals_leave_nothing(small: Appliance, mutate: Any, status: int, code: str) -> None:
    async with agent_for(small) as a:
        s = seal_consistent(small.paths, a.session_id, a.agent_id, os.urandom(20000))
        header, body, extra = mutate(s)
        headers = {"Content-Type": "application/octet-stream", envelope.HEADER_NAME: b64h(header), **extra}
        got = await a.send("POST", "/v1/payload/upload", headers=headers, data=body)
        assert (got[0], got[1]["error"]["code"]) == (status, code), got
        assert store_state(small.paths) == ([], [], [])
        assert [r["detail"] for r in audit_rows(small.paths, "payload_refused")] == [code]
        ok = await a.stream(s, chunks(s.sealed))  # chunked, honest
        assert ok[0] == 201, ok
        assert store_state(small.paths)[0] == [s.doc["payload_id"]]


async def test_header_given_twice_and_duplicate_ids_and_session_caps(small: Appliance) -> None:
    async with agent_for(small) as a:
        s = seal_consistent(small.paths, a.session_id, a.agent_id)
        h = b64h(s.header())
        got = await a.send(
            "POST",
            "/v1/payload/upload",
            data=s.sealed,
            headers={"Content-Type": "application/octet-stream", envelope.HEADER_NAME: f"{h}, {h}"},
        )
        assert got[0] == 400
        first = await a.stream(s)
        assert first[0] == 201
        again = await a.stream(s)  # the same upload sent again: the same answer, idempotent
        assert again == first
        other = seal_consistent(small.paths, a.session_id, a.agent_id)  # other bytes under the same id
        clash = {**other.header(), "payload_id": s.doc["payload_id"]}
        got = await a.stream(other, header=clash)
        assert (got[0], got[1]["error"]["code"]) == (409, "PAYLOAD_EXISTS")
        # one payload_uploaded event per stored payload: the retry is an access event, the clash a refusal
        assert [r["key"] for r in audit_rows(small.paths, "payload_uploaded")] == [s.doc["payload_id"]]
        for _ in range(2):
            assert (await a.stream(seal_consistent(small.paths, a.session_id, a.agent_id)))[0] == 201
        full = await a.stream(seal_consistent(small.paths, a.session_id, a.agent_id))
        assert (full[0], full[1]["error"]["code"]) == (429, "PAYLOAD_QUOTA_EXCEEDED")
        assert len(audit_rows(small.paths, "payload_uploaded")) == 3
        rows, blobs, tmp = store_state(small.paths)
        assert len(rows) == 3 and sorted(rows) == blobs and tmp == []
    # another session of the same agent has its own cap
    async with agent_for(small) as b:
        assert (await b.stream(seal_consistent(small.paths, b.session_id, b.agent_id)))[0] == 201


async def test_refresh_token_and_revoked_session_cannot_upload(small: Appliance) -> None:
    agent = small.agent("calendar_agent")
    g = await small.grant(agent, refresh=True)
    async with agent_session(agent, small.paths) as session:
        a = Agent(session, small.base, g["refresh_token"], agent.agent_id, g["session_id"])
        s = seal_consistent(small.paths, a.session_id, a.agent_id)
        got = await a.stream(s)
        assert (got[0], got[1]["error"]["code"]) == (401, "INVALID_TOKEN")
        a.token = g["token"]
        status, _, _ = await call(
            small.admin, "POST", f"/v1/sessions/{g['session_id']}/revoke", headers=admin_headers(small.paths)
        )
        assert status == 200
        got = await a.stream(s)
        assert (got[0], got[1]["error"]["code"]) == (401, "SESSION_REVOKED")
    async with agent_session(None, small.paths) as anon:  # no client certificate
        got = await Agent(anon, small.base, g["token"], agent.agent_id, g["session_id"]).stream(s)
        assert got[0] == 401
    assert store_state(small.paths) == ([], [], [])


# ---------------------------------------------------------------------- single-use URLs


async def test_upload_urls_are_single_use_bound_and_short_lived(home: Paths) -> None:
    async with sdk_appliance(
        home, status_cache_seconds=0, payload_max_bytes=CAP, payload_upload_url_seconds=1.0
    ) as app:
        async with agent_for(app) as a, agent_for(app) as other:
            s = seal_consistent(app.paths, a.session_id, a.agent_id)

            async def url(agent: Agent, size: int) -> str:
                st, body = await agent.send("POST", "/v1/payload/upload-url", json_body={"size": size})
                assert st == 201, body
                assert body["method"] == "PUT" and body["max_size"] == size
                return (
                    str(body["upload_url"]).split(app.base, 1)[1]
                    if app.base in body["upload_url"]
                    else "/v1/payload/presigned?" + body["upload_url"].split("?", 1)[1]
                )

            # refused partners first: bigger than bound, another session's URL, spent, late, malformed
            u_small = await url(a, s.doc["size"] - 1)
            got = await a.stream(s, path=u_small, method="PUT")
            assert (got[0], got[1]["error"]["code"]) == (413, "PAYLOAD_TOO_LARGE")
            u = await url(a, s.doc["size"])
            got = await other.stream(seal_consistent(app.paths, other.session_id, other.agent_id), path=u, method="PUT")
            assert (got[0], got[1]["error"]["code"]) == (403, "UPLOAD_URL_INVALID")
            got = await a.stream(s, path=u, method="PUT")  # spent by the refused attempt: one use only
            assert (got[0], got[1]["error"]["code"]) == (403, "UPLOAD_URL_INVALID")
            u = await url(a, s.doc["size"])
            assert (await a.stream(s, path=u, method="PUT"))[0] == 201
            s2 = seal_consistent(app.paths, a.session_id, a.agent_id)
            got = await a.stream(s2, path=u, method="PUT")  # reused
            assert (got[0], got[1]["error"]["code"]) == (403, "UPLOAD_URL_INVALID")
            late = await url(a, s2.doc["size"])
            await asyncio.sleep(1.3)
            got = await a.stream(s2, path=late, method="PUT")
            assert (got[0], got[1]["error"]["code"]) == (403, "UPLOAD_URL_INVALID")
            for bad in (
                "/v1/payload/presigned",
                "/v1/payload/presigned?t=short",
                "/v1/payload/presigned?t=" + "A" * 43,
            ):
                got = await a.stream(s2, path=bad, method="PUT")
                assert (got[0], got[1]["error"]["code"]) == (403, "UPLOAD_URL_INVALID"), bad
            st, body = await a.send("POST", "/v1/payload/upload-url", json_body={"size": CAP + 1})
            assert (st, body["error"]["code"]) == (413, "PAYLOAD_TOO_LARGE")
            st, body = await a.send("POST", "/v1/payload/upload-url", json_body={"size": "big"})
            assert (st, body["error"]["code"]) == (400, "INVALID_REQUEST")
        rows, blobs, tmp = store_state(app.paths)
        assert rows == [s.doc["payload_id"]] == blobs and tmp == []


# --------------------------------------------------------------------- agents never read


async def test_agent_get_is_always_the_same_404(small: Appliance) -> None:
    async with agent_for(small) as a, agent_for(small, "stock-analyst") as b:
        own = seal_consistent(small.paths, a.session_id, a.agent_id)
        theirs = seal_consistent(small.paths, b.session_id, b.agent_id)
        assert (await a.stream(own))[0] == 201 and (await b.stream(theirs))[0] == 201
        answers = set()
        for pid in (own.doc["payload_id"], theirs.doc["payload_id"], "pay_doesnotexist123", "x"):
            st, body = await a.send("GET", f"/v1/payload/{pid}")
            answers.add((st, json.dumps(body, sort_keys=True)))
        assert len(answers) == 1 and next(iter(answers))[0] == 404
        # the guard's user routes are not reachable through the gateway at all
        for path in ("/v1/payloads", f"/v1/payloads/{own.doc['payload_id']}/ciphertext"):
            st, _ = await a.send("GET", path)
            assert st == 404
    # nor on the guard's socket without the admin credential
    st, _, _ = await call(small.admin, "GET", "/v1/payloads")
    assert st == 401


# --------------------------------------------------------------------------- faults


async def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def tmp_bytes(paths: Paths) -> int:
    return sum(p.stat().st_size for p in (paths.payload_dir / "tmp").iterdir())


async def open_raw_upload(
    app_port: int, agent_ssl: ssl.SSLContext, a: Agent, s: Sealed, sent: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Headers of an honest streaming upload and its first ``sent`` body bytes, on a raw TLS socket."""
    reader, writer = await asyncio.open_connection("127.0.0.1", app_port, ssl=agent_ssl, server_hostname="localhost")
    head = (
        f"POST /v1/payload/upload HTTP/1.1\r\nHost: localhost:{app_port}\r\n"
        f"Authorization: Bearer {a.token}\r\nX-UOMP-Agent-Id: {a.agent_id}\r\n"
        f"Content-Type: application/octet-stream\r\n{envelope.HEADER_NAME}: {b64h(s.header())}\r\n"
        f"Content-Length: {len(s.sealed)}\r\n\r\n"
    ).encode()
    writer.write(head + s.sealed[:sent])
    await writer.drain()
    return reader, writer


async def test_upload_dropped_mid_body_leaves_nothing(home: Paths) -> None:
    async with sdk_appliance(home, status_cache_seconds=0) as app:
        agent = app.agent("calendar_agent")
        g = await app.grant(agent)
        a = Agent(None, app.base, g["token"], agent.agent_id, g["session_id"])  # type: ignore[arg-type]
        s = seal_consistent(app.paths, a.session_id, a.agent_id, os.urandom(3 * 1024 * 1024))
        assert app.gateway.port is not None
        _, writer = await open_raw_upload(app.gateway.port, agent.ssl(), a, s, 2 * 1024 * 1024)
        await wait_for(lambda: tmp_bytes(app.paths) > 0, "the upload to reach the temporary file")
        writer.transport.abort()  # the connection drops mid-body
        await wait_for(lambda: store_state(app.paths) == ([], [], []), "the partial upload to be removed")
        await wait_for(lambda: bool(audit_rows(app.paths, "payload_refused")), "the refusal to be audited")
        assert audit_rows(app.paths, "payload_uploaded") == []
        # the gateway still serves the next upload of the same payload
        async with agent_session(agent, app.paths) as session:
            a.session = session
            assert (await a.stream(s))[0] == 201


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], id="bit-flipped-in-body"),
        pytest.param(lambda b: b[:10] + bytes([b[10] ^ 1]) + b[11:], id="bit-flipped-in-key-block"),
        pytest.param(lambda b: b[:-16], id="truncated"),
        pytest.param(lambda b: b + b"\x00" * 16, id="bytes-appended"),
    ],
)
async def test_tampered_ciphertext_does_not_open_and_writes_nothing(
    app: Appliance, tmp_path: Path, tamper: Callable[[bytes], bytes]
) -> None:
    small = app
    async with agent_for(small) as a:
        s = seal_consistent(small.paths, a.session_id, a.agent_id, SECRET * 3000)
        assert (await a.stream(s))[0] == 201
    blob = small.paths.payload_dir / "blobs" / s.doc["payload_id"]
    blob.write_bytes(tamper(blob.read_bytes()))  # changed on the relay's disk
    out = tmp_path / "report.md"
    rc, _, err = await acli(small.paths, "payload", "pull", s.doc["payload_id"], "--out", str(out))
    assert rc == 1 and "PAYLOAD_INVALID" in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    rc, listing, _ = await acli(small.paths, "payload", "list", "--json")
    assert not json.loads(listing)[0]["opened"]


async def test_payload_sealed_for_another_users_key_does_not_open(small: Appliance, tmp_path: Path) -> None:
    stranger = X25519PrivateKey.generate().public_key()
    async with agent_for(small) as a:
        s = seal(small.paths, a.session_id, a.agent_id, SECRET, recipient=stranger)
        assert (await a.send("POST", "/v1/payload/upload", json_body=s.doc))[0] == 201  # the relay cannot tell
    out = tmp_path / "report.md"
    rc, _, err = await acli(small.paths, "payload", "pull", s.doc["payload_id"], "--out", str(out))
    assert rc == 1 and "PAYLOAD_INVALID" in err and "not sealed to this key" in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # and a bundle whose payload key is not the user's: same (an agent given a forged bundle)
    bundle = authorize_csr(small, tmp_path / "b")
    b = load_bundle(bundle)
    write_bundle(
        bundle, dataclasses.replace(b, payload_public_key=base64.b64encode(userkey.public_raw(stranger)).decode())
    )
    async with UompClient.from_bundle(bundle) as c:
        pid = await c.upload_payload(SECRET, format="text/plain")
    rc, _, err = await acli(small.paths, "payload", "pull", pid, "--out", str(out))
    assert rc == 1 and "PAYLOAD_INVALID" in err and not out.exists()


async def test_sdk_refusals_are_typed(small: Appliance, tmp_path: Path) -> None:
    bundle = authorize_csr(small, tmp_path)
    big = tmp_path / "big"
    big.write_bytes(b"\x00" * (16 << 20))  # far over the cap: refused from the header, before the body
    async with UompClient.from_bundle(bundle) as c:
        with pytest.raises(InvalidRequest) as e:
            await c.upload_payload(big, format="application/octet-stream")
        assert e.value.code == "PAYLOAD_TOO_LARGE" and e.value.status == 413
        with pytest.raises(ValueError):
            await c.upload_payload(b"x", format="not a media type")
        for _ in range(3):
            await c.upload_payload(b"x", format="text/plain")
        with pytest.raises(QuotaExceeded) as q:
            await c.upload_payload(b"x", format="text/plain")
        assert q.value.code == "PAYLOAD_QUOTA_EXCEEDED"
        with pytest.raises(QuotaExceeded):
            await c.upload_payload(b"x", format="text/plain", presigned=True)
    assert not [
        p
        for p in Path(os.environ.get("TMPDIR", "/tmp")).glob("uomp-payload-*.sealed")
        if p.stat().st_mtime > time.time() - 120
    ]  # the SDK's sealed temp files are gone
    b = load_bundle(bundle)
    write_bundle(bundle, dataclasses.replace(b, payload_public_key=None))
    async with UompClient.from_bundle(bundle) as c:
        with pytest.raises(ConfigError):
            await c.upload_payload(b"x", format="text/plain")
    _ = (AccessDenied, PayloadRejected)


async def test_expired_payloads_are_collected(home: Paths) -> None:
    async with sdk_appliance(
        home, status_cache_seconds=0, payload_ttl_seconds=1.0, payload_gc_interval_seconds=0.2
    ) as app:
        async with agent_for(app) as a:
            s = seal_consistent(app.paths, a.session_id, a.agent_id)
            assert (await a.stream(s))[0] == 201
        assert store_state(app.paths)[0] == [s.doc["payload_id"]]
        await wait_for(lambda: store_state(app.paths) == ([], [], []), "the expired payload to be collected")


async def test_no_plaintext_key_or_token_in_any_log(
    app: Appliance, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    bundle = authorize_csr(app, tmp_path)
    b = load_bundle(bundle)
    report = tmp_path / "report.md"
    report.write_bytes(SECRET * 50000)
    async with UompClient.from_bundle(bundle) as c:
        pids = [
            await c.upload_payload(SECRET, format="text/markdown"),
            await c.upload_payload(report, format="text/markdown"),
            await c.upload_payload(SECRET, format="text/markdown", presigned=True),
        ]
        grant_answer = await c._call("POST", "/v1/payload/upload-url", body={"size": 500})
        url_token = grant_answer["upload_url"].split("t=", 1)[1]
    async with agent_for(app) as a:  # refusals too
        s = seal_consistent(app.paths, a.session_id, a.agent_id)
        await a.send("POST", "/v1/payload/upload", json_body={**s.doc, "hash": OTHER_HASH})
        await a.stream(s, chunks(s.sealed[:-5]))
    rc, _, err = await acli(app.paths, "-v", "payload", "pull", pids[1], "--out", str(tmp_path / "o"))
    assert rc == 0, err
    private_pem = app.paths.payload_private_key.read_bytes()
    secrets_ = [
        SECRET.strip(),
        b.access_token.encode(),
        (b.refresh_token or "").encode(),
        url_token.encode(),
        private_pem.split(b"\n")[1],
        base64.b64encode(SECRET)[:40],
        envelope.HEADER_NAME.encode() + b":",
    ]
    sources = {
        "gateway spool": (app.paths.gateway_dir / "access.jsonl").read_bytes(),
        "the one log (ledger)": json.dumps(ledger_events(app.paths)).encode(),
        "guard audit log": json.dumps(audit_rows(app.paths)).encode(),
        "python logging": caplog.text.encode(),
        "cli stderr": err.encode(),
        "payload index": (app.paths.payload_dir / "index.db").read_bytes(),
    }
    for name, text in sources.items():
        for secret in secrets_:
            assert secret not in text, f"{secret[:12]!r}... in the {name}"
    assert len(ledger_events(app.paths, action="payload_uploaded")) == 3  # one event per upload, not two
    assert not ledger_events(app.paths, action="payload_upload")
    # each refused upload is one event too: the guard's, with the gateway's listener and the code
    refused = [e for e in ledger_events(app.paths, allowed=False) if str(e["action"]).startswith("payload")]
    assert [e["action"] for e in refused] == ["payload_refused", "payload_refused"]
    assert all(e.get("listener") and str(e.get("code", "")).startswith("PAYLOAD_") for e in refused)


async def _read_line(proc: asyncio.subprocess.Process, prefix: str, timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = (await asyncio.wait_for(proc.stdout.readline(), max(0.1, deadline - time.monotonic()))).decode()
        if line.startswith(prefix):
            return line
        if not line:
            break
    raise AssertionError(f"no {prefix!r} line from the gateway")


async def _gateway_process(paths: Paths) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        *UOMP,
        "--home",
        str(paths.home),
        "gateway",
        "serve",
        "--listen",
        "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    line = await _read_line(proc, "gateway: https://")
    return proc, int(line.split()[1].rsplit(":", 1)[1])


async def test_kill_9_of_the_gateway_mid_upload_leaves_nothing_after_restart(home: Paths) -> None:
    ca_store.init_all(home)
    seed(home)
    async with running_guard(home, guard_config(), serve_tcp=False), unix_session(home) as admin:
        proc, port = await _gateway_process(home)
        try:
            base = f"https://localhost:{port}"
            agent_files = ca_store.issue_with_key(home, "calendar_agent", home.home / "agent-files")
            from gatewaykit import Agent as KitAgent

            agent = KitAgent("calendar_agent", agent_files)
            g = await grant(
                admin,
                home,
                read={"tags": ["preference"], "keys": []},
                agent_id="calendar_agent",
                profile="remote",
                audience=base,
                cnf={"x5t#S256": agent.x5t, "jkt": agent.jkt},
            )
            a = Agent(None, base, g["token"], agent.agent_id, g["session_id"])  # type: ignore[arg-type]
            s = seal_consistent(home, a.session_id, a.agent_id, os.urandom(4 * 1024 * 1024))
            _, writer = await open_raw_upload(port, agent.ssl(), a, s, 3 * 1024 * 1024)
            await wait_for(lambda: tmp_bytes(home) >= 1024 * 1024, "the upload to reach the temporary file")
            proc.kill()  # SIGKILL: no clean-up code runs
            await proc.wait()
            writer.transport.abort()
            rows, blobs, tmp = store_state(home)
            assert rows == [] and blobs == [] and len(tmp) == 1  # the crash left a partial temporary file
            # and a crash after the rename, before the index row, would leave a blob without a row
            (home.payload_dir / "blobs" / s.doc["payload_id"]).write_bytes(s.sealed[:1000])
            st, listed, _ = await call(admin, "GET", "/v1/payloads", headers=admin_headers(home))
            assert st == 200 and listed["payloads"] == []  # never visible: no index row
            proc, port = await _gateway_process(home)  # restart: the store's recovery runs at open
            await wait_for(lambda: store_state(home) == ([], [], []), "the leftovers to be removed")
            assert audit_rows(home, "payload_uploaded") == []
            # the cut upload's removal is recorded, once, with whom it was from
            assert [(r["key"], r["session_id"]) for r in audit_rows(home, "payload_refused")] == [
                (s.doc["payload_id"], a.session_id)
            ]
            a.base = f"https://localhost:{port}"
            g = await grant(
                admin,
                home,
                read={"tags": ["preference"], "keys": []},
                agent_id="calendar_agent",
                profile="remote",
                audience=a.base,
                cnf={"x5t#S256": agent.x5t, "jkt": agent.jkt},
            )
            a.token, a.session_id = g["token"], g["session_id"]
            s = seal_consistent(home, a.session_id, a.agent_id, os.urandom(100_000))
            async with agent_session(agent, home) as session:
                a.session = session
                got = await a.stream(s)
            assert got[0] == 201, got
            st, listed, _ = await call(admin, "GET", "/v1/payloads", headers=admin_headers(home))
            assert [p["payload_id"] for p in listed["payloads"]] == [s.doc["payload_id"]]
        finally:
            if proc.returncode is None:
                proc.terminate()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 30)
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()


async def test_json_envelope_arriving_in_slow_pieces_is_read_whole(small: Appliance) -> None:
    """A JSON envelope whose body arrives in several TCP segments (read(n) returns only what has
    arrived; the relay must read to the end)."""
    async with agent_for(small) as a:
        s = seal_consistent(small.paths, a.session_id, a.agent_id, os.urandom(20_000))
        raw = json.dumps(s.doc).encode()

        async def slow() -> AsyncIterator[bytes]:
            for i in range(0, len(raw), 5000):
                yield raw[i : i + 5000]
                await asyncio.sleep(0.05)

        got = await a.send("POST", "/v1/payload/upload", data=slow(), headers={"Content-Type": "application/json"})
        assert got[0] == 201, got


@pytest.mark.parametrize(
    ("body", "agent_header", "code"),
    [
        ({"action": "payload_deleted", "session_id": "s", "agent_id": "a"}, "a", "INVALID_REQUEST"),
        (
            {
                "action": "payload_uploaded",
                "session_id": "s",
                "agent_id": "a",
                "payload_id": "pay_abcdefgh12",
                "hash": "md5:00",
                "size": 10,
            },
            "a",
            "INVALID_REQUEST",
        ),
        (
            {
                "action": "payload_uploaded",
                "session_id": "s",
                "agent_id": "a",
                "payload_id": "../x",
                "hash": OTHER_HASH,
                "size": 10,
            },
            "a",
            "INVALID_REQUEST",
        ),
        (
            {
                "action": "payload_uploaded",
                "session_id": "s",
                "agent_id": "a",
                "payload_id": "pay_abcdefgh12",
                "hash": OTHER_HASH,
                "size": -1,
            },
            "a",
            "INVALID_REQUEST",
        ),
        ({"action": "payload_refused", "session_id": "s", "agent_id": "a", "code": "lower"}, "a", "INVALID_REQUEST"),
        ({"action": "payload_refused", "session_id": "s", "agent_id": "a", "code": "X"}, "b", "AGENT_MISMATCH"),
    ],
    ids=["unknown-action", "bad-hash", "bad-payload-id", "negative-size", "bad-code", "agent-not-verified-one"],
)
async def test_guard_audit_route_takes_only_well_formed_payload_events(
    home: Paths, body: dict[str, Any], agent_header: str, code: str
) -> None:
    async with running_guard(home, guard_config(), serve_tcp=False), unix_session(home) as s:
        st, answer, _ = await call(
            s, "POST", "/v1/payload/audit", json_body=body, headers={"X-UOMP-Verified-Agent": agent_header}
        )
        assert (st, answer["error"]["code"]) in ((400, code), (403, code)), answer
        ok = {"action": "payload_refused", "session_id": "s", "agent_id": "a", "code": "X"}
        st, answer, _ = await call(s, "POST", "/v1/payload/audit", json_body=ok, headers={"X-UOMP-Verified-Agent": "a"})
        assert st == 200 and answer == {"recorded": True}
    assert [r["action"] for r in audit_rows(home)] == ["payload_refused"]
    # the route does not exist on the Local Profile port
    async with running_guard(home, guard_config(), serve_tcp=True) as g, aiohttp.ClientSession() as tcp:
        st, _, _ = await call(tcp, "POST", "/v1/payload/audit", json_body=ok, base=f"http://127.0.0.1:{g.tcp_port}")
        assert st == 404
        st, _, _ = await call(
            tcp, "GET", "/v1/payloads", headers=admin_headers(home), base=f"http://127.0.0.1:{g.tcp_port}"
        )
        assert st == 404


async def test_in_front_of_a_guard_without_the_audit_route_nothing_is_kept(home: Paths) -> None:
    """The gateway in front of a guard over loopback HTTP (as with the TypeScript reference): the
    Local Profile listener has no payload audit route, so uploads are refused, never kept unaudited."""
    from gateway.config import GatewayConfig
    from gateway.remote.server import GatewayRunner

    ca_store.init_all(home)
    seed(home)
    async with running_guard(home, guard_config(), serve_tcp=True) as g, unix_session(home) as admin:
        gw = GatewayRunner(
            home, dataclasses.replace(GatewayConfig(listen_port=0), upstream=f"http://127.0.0.1:{g.tcp_port}")
        )
        await gw.start()
        try:
            app = Appliance(home, gw, admin)
            async with agent_for(app) as a:
                s = seal_consistent(home, a.session_id, a.agent_id)
                got = await a.stream(s)
                assert (got[0], got[1]["error"]["code"]) == (503, "STORE_UNAVAILABLE"), got
        finally:
            await gw.stop()
    assert store_state(home) == ([], [], [])
