"""The streaming form whose hash follows the bytes (envelope hash ``sha256:trailer``): what lets the
SDK send a payload while it seals it.

On the real appliance (guard on its Unix socket, gateway with real TLS 1.3 mTLS): the body is the
sealed bytes then their raw 32-byte SHA-256; the relay keeps the bytes, never the trailer, and checks
the trailer before anything is kept, exactly as it checks a hash named in the envelope. A wrong,
short or long trailer, room for none, the trailer hash in the JSON form or in an uplink offer, and a
trailer-form upload under a taken id are each refused with nothing left; their partners are kept.

The SDK's side (:class:`gateway.client.payloads.SealedStream`): every pass seals the same bytes
(a retry is the same upload), sends them then their hash, runs at most a few blocks ahead of its
sender and stops with it, and fails when the source changes; nothing sealed is written to disk.
Through ``upload_payload``: a source that cannot be read raises its own error, and in front of a
gateway that wants the hash first the same bytes go again with the hash named, one payload kept."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from gatewaykit import Appliance
from test_payload_relay import CAP, acli, agent_for, audit_rows, b64h, chunks, seal_consistent, small, store_state
from test_sdk import authorize_csr, resign, sdk_appliance

from gateway.bundle import load_bundle, write_bundle
from gateway.client import AuthError, UompClient
from gateway.client import payloads as sdk_payloads
from gateway.config import Paths
from gateway.core import envelope, sealing, tokens
from gateway.core.envelope import HASH_TRAILER
from gateway.errors import ErrorCode, UompError
from gateway.payloads import userkey
from gateway.remote import payload_routes
from gateway.uplink.relay import META_HEADER, PATH, Inbox

pytestmark = pytest.mark.timeout(120)

__all__ = ["small"]  # the fixture, used by name


def trailed(s: Any) -> tuple[dict[str, Any], bytes]:
    """(the header naming the trailer, the sealed bytes followed by their SHA-256)."""
    return {**s.header(), "hash": HASH_TRAILER}, s.sealed + hashlib.sha256(s.sealed).digest()


async def post(
    a: Any, header: dict[str, Any], body: Any, path: str = "/v1/payload/upload", method: str = "POST"
) -> Any:
    headers = {"Content-Type": "application/octet-stream", envelope.HEADER_NAME: b64h(header)}
    return await a.send(method, path, headers=headers, data=body)


async def test_the_trailer_form_is_kept_without_its_trailer(small: Appliance) -> None:
    async with agent_for(small) as a:
        for body_of in (lambda b: b, lambda b: chunks(b, 777)):  # Content-Length, then chunked in odd pieces
            s = seal_consistent(small.paths, a.session_id, a.agent_id, os.urandom(20000))
            header, body = trailed(s)
            got = await post(a, header, body_of(body))
            assert got[0] == 201, got
            assert got[1]["hash"] == s.doc["hash"] and got[1]["size"] == len(s.sealed)
            blob = small.paths.payload_dir / "blobs" / s.doc["payload_id"]
            assert blob.read_bytes() == s.sealed  # the trailer is not part of the payload
            # a retry of the same bytes names the hash: the same payload, answered alike
            again = await a.stream(s)
            assert again == got
        events = audit_rows(small.paths, "payload_uploaded")
        assert len(events) == 2 and all(e["detail"].startswith("sha256:") and len(e["detail"]) == 71 for e in events)
        assert audit_rows(small.paths, "payload_refused") == []
    assert store_state(small.paths)[2] == []


def _flip_trailer(s: Any) -> tuple[dict[str, Any], Any]:
    header, body = trailed(s)
    return header, body[:-1] + bytes([body[-1] ^ 1])


def _flip_bytes(s: Any) -> tuple[dict[str, Any], Any]:
    header, body = trailed(s)
    return header, body[:50] + bytes([body[50] ^ 1]) + body[51:]  # the trailer is of the bytes before the flip


TRAILER_ATTACKS: list[tuple[str, Any, int, str]] = [
    ("trailer-of-other-bytes", _flip_trailer, 400, "PAYLOAD_HASH_MISMATCH"),
    ("bytes-changed-after-hashing", _flip_bytes, 400, "PAYLOAD_HASH_MISMATCH"),
    (
        "trailer-hex-not-raw",
        lambda s: (trailed(s)[0], chunks(s.sealed + hashlib.sha256(s.sealed).hexdigest().encode())),
        413,
        "PAYLOAD_TOO_LARGE",
    ),
    ("trailer-short-chunked", lambda s: (trailed(s)[0], chunks(trailed(s)[1][:-1])), 400, "PAYLOAD_SIZE_MISMATCH"),
    ("no-trailer-chunked", lambda s: (trailed(s)[0], chunks(s.sealed)), 400, "PAYLOAD_SIZE_MISMATCH"),
    (
        "a-byte-after-the-trailer-chunked",
        lambda s: (trailed(s)[0], chunks(trailed(s)[1] + b"x")),
        413,
        "PAYLOAD_TOO_LARGE",
    ),
    ("content-length-without-room", lambda s: (trailed(s)[0], s.sealed), 400, "PAYLOAD_SIZE_MISMATCH"),
    ("content-length-one-more", lambda s: (trailed(s)[0], trailed(s)[1] + b"x"), 400, "PAYLOAD_SIZE_MISMATCH"),
    (
        "hash-neither-hex-nor-trailer",
        lambda s: ({**s.header(), "hash": "sha256:later"}, trailed(s)[1]),
        400,
        "INVALID_REQUEST",
    ),
    (
        "trailer-in-a-declared-oversize",
        lambda s: ({**trailed(s)[0], "size": CAP + 1}, trailed(s)[1]),
        413,
        "PAYLOAD_TOO_LARGE",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "status", "code"), [a[1:] for a in TRAILER_ATTACKS], ids=[a[0] for a in TRAILER_ATTACKS]
)
async def test_trailer_refusals_leave_nothing(small: Appliance, mutate: Any, status: int, code: str) -> None:
    async with agent_for(small) as a:
        s = seal_consistent(small.paths, a.session_id, a.agent_id, os.urandom(20000))
        header, body = mutate(s)
        got = await post(a, header, body)
        assert (got[0], got[1]["error"]["code"]) == (status, code), got
        assert store_state(small.paths) == ([], [], [])
        assert [r["detail"] for r in audit_rows(small.paths, "payload_refused")] == [code]
        assert audit_rows(small.paths, "payload_uploaded") == []
        header, body = trailed(s)  # the partner: the honest trailer form of the same bytes
        ok = await post(a, header, chunks(body))
        assert ok[0] == 201 and ok[1]["hash"] == s.doc["hash"], ok
        assert store_state(small.paths)[0] == [s.doc["payload_id"]]


async def test_the_trailer_is_for_uploads_streamed_by_agents_only(small: Appliance) -> None:
    async with agent_for(small) as a:
        s = seal_consistent(small.paths, a.session_id, a.agent_id)
        # the JSON form names its hash
        got = await a.send("POST", "/v1/payload/upload", json_body={**s.doc, "hash": HASH_TRAILER})
        assert (got[0], got[1]["error"]["code"]) == (400, "INVALID_REQUEST"), got
        assert store_state(small.paths) == ([], [], [])
        # an id already kept: the trailer form cannot say it is the same upload, so it is refused ...
        assert (await a.stream(s))[0] == 201
        header, body = trailed(s)
        got = await post(a, header, body)
        assert (got[0], got[1]["error"]["code"]) == (409, "PAYLOAD_EXISTS"), got
        assert "names their hash" in got[1]["error"]["message"]
        # ... while the same bytes with their hash named are the same payload again
        assert (await a.stream(s))[0] == 201
        assert [r["key"] for r in audit_rows(small.paths, "payload_uploaded")] == [s.doc["payload_id"]]
        # an upload URL takes the trailer form too
        u = seal_consistent(small.paths, a.session_id, a.agent_id, os.urandom(5000))
        st, grant = await a.send("POST", "/v1/payload/upload-url", json_body={"size": len(u.sealed)})
        assert st == 201, grant
        target = "/v1/payload/presigned?" + grant["upload_url"].partition("?")[2]
        header, body = trailed(u)
        got = await post(a, header, body, path=target, method="PUT")
        assert got[0] == 201 and got[1]["hash"] == u.doc["hash"], got
    # the home end of an uplink takes only offers naming their hash (the VPS gateway checked it)
    s = seal_consistent(small.paths, "sess_x", "agent_x")
    for value, ok in ((b64h(trailed(s)[0]), False), (b64h(s.header()), True)):
        headers = [(META_HEADER, value.encode())]
        if ok:
            assert Inbox.offer("PUT", PATH + s.doc["payload_id"], headers).hash == s.doc["hash"]
        else:
            with pytest.raises(UompError) as refused:
                Inbox.offer("PUT", PATH + s.doc["payload_id"], headers)
            assert refused.value.code == ErrorCode.INVALID_REQUEST


# ------------------------------------------------------------------------------ the SDK's side


def _recipient(paths: Paths) -> Any:
    return envelope.parse_public_key(userkey.public_b64(paths))


BINDING = sealing.Binding("pay_trailer_tee_1", "sess_t", "agent_t", "application/octet-stream")


async def _drain(body: Any) -> bytes:
    return b"".join([bytes(b) async for b in body])


@pytest.mark.parametrize("kind", ["file", "bytes"])
@pytest.mark.parametrize("size", [0, 1, sealing.CHUNK, sealing.CHUNK + 1, 3 * sdk_payloads.READ_BLOCK + 5])
async def test_every_pass_seals_the_same_bytes(home: Paths, tmp_path: Path, size: int, kind: str) -> None:
    data = os.urandom(size)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    stream = sdk_payloads.SealedStream(_recipient(home), BINDING, src if kind == "file" else data)
    assert stream.envelope.size == sealing.sealed_size(size) and stream.envelope.trailer and stream.digest is None
    sent = await _drain(stream.body(trailer=True))
    sealed, trailer = sent[:-32], sent[-32:]
    assert len(sealed) == stream.envelope.size and trailer == hashlib.sha256(sealed).digest()
    assert stream.digest == "sha256:" + trailer.hex() == await stream.learn_digest()
    named = stream.named()
    assert named.hash == stream.digest and named.timestamp == stream.envelope.timestamp and not named.trailer
    # a retry seals again: the same bytes, no trailer
    assert await _drain(stream.body(trailer=False)) == sealed
    opened = sealing.open_bytes(userkey.load_private(home), BINDING, stream.envelope.encryption, sealed)
    assert opened == data
    # another upload of the same source: other keys, other bytes
    other = sdk_payloads.SealedStream(_recipient(home), BINDING, data)
    assert (await _drain(other.body(trailer=False)))[: sealing.PREFIX_LEN] != sealed[: sealing.PREFIX_LEN]
    assert list(tmp_path.iterdir()) == [src]  # nothing sealed is written anywhere


async def test_a_pass_waits_for_its_sender_and_stops_with_it(home: Paths, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(12 * sdk_payloads.READ_BLOCK))
    stream = sdk_payloads.SealedStream(_recipient(home), BINDING, src)
    body = stream.body(trailer=True)
    first = await body.__anext__()
    assert len(first) == sealing.PREFIX_LEN
    running = stream._running
    assert running is not None
    await asyncio.sleep(0.5)
    assert not running.done()  # held back: at most PASS_AHEAD blocks ahead of a sender that is not reading
    await stream.close()  # the sender goes away: the pass stops and is waited for
    assert running.done() and isinstance(running.exception(), sdk_payloads.SealStopped)
    assert stream.digest is None and await stream.failure() is None
    with pytest.raises(RuntimeError):
        await _drain(body)  # the cut body breaks the request off rather than ending it
    # the hash of a pass cut short is learnt by sealing once more, without sending
    digest = await stream.learn_digest()
    assert digest == "sha256:" + hashlib.sha256(await _drain(stream.body(trailer=False))).hexdigest()


@pytest.mark.parametrize("change", ["grows", "shrinks", "same-length-other-bytes"])
async def test_a_source_changing_fails_the_pass(home: Paths, tmp_path: Path, change: str) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(8 * sdk_payloads.READ_BLOCK))
    stream = sdk_payloads.SealedStream(_recipient(home), BINDING, src)
    if change == "same-length-other-bytes":
        await _drain(stream.body(trailer=True))  # the first pass tells the hash ...
        src.write_bytes(os.urandom(8 * sdk_payloads.READ_BLOCK))
        with pytest.raises(ValueError, match="changed while it was sent"):  # ... a retry of other bytes fails
            await _drain(stream.body(trailer=False))
        return
    if change == "grows":
        with src.open("ab") as f:
            f.write(b"x" * 100)
    else:
        os.truncate(src, 5 * sdk_payloads.READ_BLOCK)
    with pytest.raises(ValueError, match="changed length"):
        await _drain(stream.body(trailer=True))
    await stream.close()
    assert stream.digest is None


@pytest.fixture
async def app(home: Paths) -> AsyncIterator[Appliance]:
    async with sdk_appliance(home, status_cache_seconds=0, payload_max_bytes=32 << 20) as a:
        yield a


def hashes_seen(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hash field of every streamed upload's envelope the gateway reads, in order."""
    seen: list[str] = []
    taken = payload_routes._header_envelope

    def spy(request: Any) -> envelope.Envelope:
        env = taken(request)
        seen.append(env.hash)
        return env

    monkeypatch.setattr(payload_routes, "_header_envelope", spy)
    return seen


def _temp_files(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("uomp-payload-"))


async def test_sdk_sends_while_sealing_and_falls_back_for_a_gateway_that_wants_the_hash_first(
    app: Appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = authorize_csr(app, tmp_path)
    sealtmp = tmp_path / "sealtmp"
    sealtmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(sealtmp))
    monkeypatch.setattr("tempfile.tempdir", None)
    data = os.urandom(5 * sdk_payloads.READ_BLOCK + 3)
    seen = hashes_seen(monkeypatch)
    async with UompClient.from_bundle(bundle) as c:
        pid = await c.upload_payload(data, format="application/octet-stream")
        pid_url = await c.upload_payload(data[:400_000], format="application/octet-stream", presigned=True)
    assert seen == [HASH_TRAILER, HASH_TRAILER]  # each sent while sealed, once
    assert audit_rows(app.paths, "payload_refused") == []
    # a gateway that takes the hash only before the bytes (as before the trailer existed)
    seen.clear()

    def old(request: Any) -> envelope.Envelope:
        values = request.headers.getall(envelope.HEADER_NAME, [])
        env = envelope.decode_header(values[0].strip())  # no trailer: INVALID_REQUEST naming the hash field
        seen.append(env.hash)
        return env

    monkeypatch.setattr(payload_routes, "_header_envelope", old)
    async with UompClient.from_bundle(bundle) as c:
        pid_old = await c.upload_payload(data, format="application/octet-stream")
        pid_old_url = await c.upload_payload(data[:400_000], format="application/octet-stream", presigned=True)
    assert len(seen) == 2 and all(h.startswith("sha256:") and h != HASH_TRAILER for h in seen)
    assert [r["detail"] for r in audit_rows(app.paths, "payload_refused")] == ["INVALID_REQUEST"] * 2
    for p, want in ((pid, data), (pid_url, data[:400_000]), (pid_old, data), (pid_old_url, data[:400_000])):
        rc, _, err = await acli(app.paths, "payload", "pull", p, "--out", str(tmp_path / p))
        assert rc == 0, err
        assert (tmp_path / p).read_bytes() == want
    assert len(audit_rows(app.paths, "payload_uploaded")) == 4
    assert _temp_files(sealtmp) == [] and store_state(app.paths)[2] == []
    # a source that cannot be read: its own error, nothing sent or kept, no temporary file
    unreadable = tmp_path / "a-directory"
    unreadable.mkdir()
    async with UompClient.from_bundle(bundle) as c:
        with pytest.raises(IsADirectoryError):
            await c.upload_payload(unreadable, format="application/octet-stream")
    assert len(store_state(app.paths)[0]) == 4 and _temp_files(sealtmp) == []


async def test_an_upload_refused_for_an_expired_token_is_sent_again_with_its_hash(
    app: Appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway refuses the expired token before it reads the body, so the first pass never ran to
    its end: after the refresh the SDK learns the hash by sealing once more, then names it."""
    bundle = authorize_csr(app, tmp_path)
    b = load_bundle(bundle)
    now = time.time()
    expired = resign(b.access_token, app.paths, exp=int(now) - 5, expires_at=tokens.iso(now - 5))
    data = os.urandom(3 * sdk_payloads.READ_BLOCK + 11)
    seen = hashes_seen(monkeypatch)
    write_bundle(bundle, dataclasses.replace(b, access_token=expired))
    async with UompClient.from_bundle(bundle) as c:
        pid = await c.upload_payload(data, format="application/octet-stream")
        assert c.refresh_count == 1
    named = "sha256:" + hashlib.sha256((app.paths.payload_dir / "blobs" / pid).read_bytes()).hexdigest()
    assert seen == [named]  # the expired try was refused before its envelope was read; the retry names it
    rc, _, err = await acli(app.paths, "payload", "pull", pid, "--out", str(tmp_path / "out"))
    assert rc == 0, err
    assert (tmp_path / "out").read_bytes() == data
    # partner: without a refresh token the refusal is the caller's, and nothing is kept (a body
    # that fits the sockets' buffers: the refused connection then closes at once, never lingering)
    write_bundle(bundle, dataclasses.replace(b, access_token=expired, refresh_token=None, refresh_expires_at=None))
    async with UompClient.from_bundle(bundle) as c:
        with pytest.raises(AuthError) as exc:
            await c.upload_payload(data[:600_000], format="application/octet-stream")
        assert exc.value.code == "TOKEN_EXPIRED"
    assert store_state(app.paths)[0] == [pid] and store_state(app.paths)[2] == []
