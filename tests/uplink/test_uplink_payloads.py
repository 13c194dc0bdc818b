"""Sealed payloads uploaded at a VPS gateway come home over the uplink (gateway/uplink/relay.py):
the agent uploads over mTLS to the VPS, the user pulls and opens at home; what is changed,
relabelled, sealed to another key or named with path tricks is refused at home and never visible;
a home side killed mid-transfer leaves nothing visible, and its restart completes the transfer."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from gatewaykit import Agent, Appliance, ledger_events
from guardkit import admin_headers
from uplinkkit import Split, home_process, split

from gateway.client import payloads as sdk_payloads
from gateway.config import Paths
from gateway.core import envelope, sealing
from gateway.payloads import userkey
from gateway.payloads.store import PayloadStore
from gateway.uplink import relay, trust

pytestmark = pytest.mark.timeout(90)


async def _upload(
    app: Appliance, a: Agent, g: dict[str, Any], plain: bytes, *, to: Any = None, pid: str | None = None
) -> tuple[sealing.Binding, bytes]:
    """The agent seals ``plain`` (to the home's payload key, or ``to``) and streams it to the VPS gateway."""
    recipient = to or envelope.parse_public_key(userkey.public_b64(app.paths))
    binding = sealing.Binding(pid or sdk_payloads.new_payload_id(), g["session_id"], a.agent_id, "text/plain")
    enc, sealed = sealing.seal_bytes(recipient, binding, plain)
    env = envelope.Envelope(
        binding.payload_id,
        binding.session_id,
        binding.agent_id,
        "2026-12-03T12:00:00Z",
        enc,
        binding.format,
        len(sealed),
        sealing.ciphertext_hash(sealed),
    )
    hdrs = {
        "Authorization": f"Bearer {g['token']}",
        "X-UOMP-Agent-Id": a.agent_id,
        "Content-Type": "application/octet-stream",
        envelope.HEADER_NAME: envelope.encode_header(env),
    }
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=a.ssl())) as sess,
        sess.post(app.base + "/v1/payload/upload", data=sealed, headers=hdrs) as r,
    ):
        assert r.status == 201, (r.status, await r.text())
    return binding, sealed


async def _home_get(app: Appliance, pid: str, what: str = "") -> tuple[int, bytes]:
    async with app.admin.get(f"http://guard/v1/payloads/{pid}{what}", headers=admin_headers(app.paths)) as r:
        return r.status, await r.read()


def _vps_ids(s: Split) -> set[str]:
    store = PayloadStore(s.vps.payload_dir)
    try:
        return {m.payload_id for m in store.list()}
    finally:
        store.close()


def _home_rows(home: Paths) -> dict[str, str]:
    store = PayloadStore(home.payload_dir)
    try:
        return {r[0]: r[1] for r in store.conn.execute("SELECT payload_id, state FROM payloads")}
    finally:
        store.close()


async def _wait(pred: Any, what: str, seconds: float = 30.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if await pred() if asyncio.iscoroutinefunction(pred) else pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached: {what}")


def _fast(s: Split) -> relay.Outbox:
    """The VPS's outbox, looking often (None only on a gateway that relays nothing home)."""
    hub = s.gateway.uplink
    assert hub is not None
    out = hub.payloads
    if out is not None:
        out.look_seconds = 0.05
        out.retry_seconds = 0.1
    return out  # type: ignore[return-value]


async def _offer(
    link: Any, path: str, header: str, body: bytes = b"x" * 200, *, end: bool = True
) -> tuple[int, dict[str, Any]]:
    """An offer as a VPS may make it, on the gateway's own stream: (status, answer)."""
    st = link.open_stream(
        [
            (b":method", b"PUT"),
            (b":scheme", b"https"),
            (b":authority", trust.AUTHORITY),
            (b":path", path.encode()),
            (relay.META_HEADER, header.encode()),
        ],
        end_stream=False,
    )
    try:
        with contextlib.suppress(Exception):
            await link.send_data(st.sid, body, end_stream=end)
        raw_headers = await asyncio.wait_for(st.response_headers(), 10)
        status = int(dict(raw_headers)[b":status"])
        data = b""
        while piece := await asyncio.wait_for(st.read_chunk(), 10):
            data += piece
        return status, json.loads(data)
    finally:
        link.forget(st)


async def _pulled_and_opened(app: Appliance, binding: sealing.Binding, plain: bytes) -> None:
    status, meta = await _home_get(app, binding.payload_id)
    assert status == 200, meta
    doc = json.loads(meta)
    status, sealed = await _home_get(app, binding.payload_id, "/ciphertext")
    assert status == 200 and sealing.ciphertext_hash(sealed) == doc["hash"]
    key = userkey.load_private(app.paths)
    assert sealing.open_bytes(key, binding, doc["encryption"], sealed) == plain


async def test_uploaded_at_the_vps_pulled_and_opened_at_home(home: Paths) -> None:
    async with split(home) as s:
        app = s.app
        out = _fast(s)
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        plain = os.urandom(300_000)  # several HTTP/2 windows' worth of DATA frames
        binding, _sealed = await _upload(app, a, g, plain)
        pid = binding.payload_id
        await _wait(lambda: pid not in _vps_ids(s), "the VPS removed its copy once home held it")
        await _pulled_and_opened(app, binding, plain)
        assert out.relayed == 1 and out.refused == 0
        assert not any((home.payload_dir / "arriving").iterdir())
        assert not (s.vps.payload_dir / "blobs" / pid).exists()
        # audited once as uploaded (at the VPS), once as arrived, saying over which uplink
        up = ledger_events(home, action="payload_uploaded", key=pid)
        arrived = ledger_events(home, action="payload_arrived", key=pid)
        assert len(up) == 1 and len(arrived) == 1, (up, arrived)
        assert arrived[0]["via"] == f"uplink:localhost:{s.gateway.uplink_port}" and arrived[0]["allowed"] is True
        assert arrived[0]["detail"] == up[0]["detail"]  # the same hash
        # the same offer again (an acknowledgement lost): answered as held, nothing written, no second event
        store = PayloadStore(home.payload_dir)
        try:
            meta = store.get(pid)
        finally:
            store.close()
        hub = s.gateway.uplink
        assert hub is not None and hub.link is not None
        (s.vps.payload_dir / "blobs").mkdir(exist_ok=True)
        vps_store = PayloadStore(s.vps.payload_dir)
        try:
            vps_store.blobs.joinpath(pid).write_bytes(_sealed)
            vps_store.conn.execute(
                "INSERT INTO payloads (payload_id, session_id, agent_id, format, size, hash, encryption, created_at,"
                " expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    pid,
                    meta.session_id,
                    meta.agent_id,
                    meta.format,
                    meta.size,
                    meta.hash,
                    json.dumps(meta.encryption),
                    meta.created_at,
                    meta.expires_at,
                ),
            )
        finally:
            vps_store.close()
        await _wait(lambda: pid not in _vps_ids(s), "the re-offered copy acknowledged too")
        assert len(ledger_events(home, action="payload_arrived", key=pid)) == 1
        # `uomp status`'s source: the home side counts what arrived
        assert out.relayed == 2


async def test_changed_relabelled_or_foreign_payloads_are_refused_at_home(home: Paths) -> None:
    async with split(home) as s:
        app = s.app
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        out = _fast(s)
        out.paused = True  # they wait on the VPS
        await asyncio.sleep(0.2)
        changed, _ = await _upload(app, a, g, b"the bytes the agent sent" * 100)
        foreign, _ = await _upload(app, a, g, b"sealed to someone else", to=X25519PrivateKey.generate().public_key())
        good, _ = await _upload(app, a, g, b"this one is fine")
        swapped, _ = await _upload(app, a, g, b"what the agent sealed")
        assert {changed.payload_id, foreign.payload_id, good.payload_id, swapped.payload_id} <= _vps_ids(s)
        # a VPS that reseals other bytes to the home's key for the same payload, and rewrites its index to match
        enc, other = sealing.seal_bytes(
            envelope.parse_public_key(userkey.public_b64(home)), swapped, b"what the VPS wants you to read"
        )
        (s.vps.payload_dir / "blobs" / swapped.payload_id).write_bytes(other)
        vps_store = PayloadStore(s.vps.payload_dir)
        try:
            vps_store.conn.execute(
                "UPDATE payloads SET hash = ?, size = ?, encryption = ? WHERE payload_id = ?",
                (sealing.ciphertext_hash(other), len(other), json.dumps(enc), swapped.payload_id),
            )
        finally:
            vps_store.close()
        blob = s.vps.payload_dir / "blobs" / changed.payload_id
        raw = bytearray(blob.read_bytes())
        raw[-5] ^= 0x01  # changed on the VPS after the upload: same size, same recorded hash
        blob.write_bytes(bytes(raw))
        out.paused = False
        await _wait(lambda: good.payload_id not in _vps_ids(s), "the good one went home")
        await _wait(lambda: out.refused >= 3, "the three bad ones refused")
        await _pulled_and_opened(app, good, b"this one is fine")
        for bad, code in (
            (changed, "PAYLOAD_HASH_MISMATCH"),
            (foreign, "PAYLOAD_INVALID"),
            (swapped, "PAYLOAD_HASH_MISMATCH"),  # not the hash the home's log recorded at upload
        ):
            assert (await _home_get(app, bad.payload_id))[0] == 404  # never visible
            assert bad.payload_id not in _home_rows(home)
            assert not (home.payload_dir / "blobs" / bad.payload_id).exists()
            assert bad.payload_id in _vps_ids(s)  # kept on the VPS, offered again later
            refused = ledger_events(home, action="payload_refused", key=bad.payload_id)
            assert [e["detail"] for e in refused] == [code], refused
        assert not any((home.payload_dir / "arriving").iterdir())

        # a VPS that offers what it should not: raw offers on the gateway's own streams
        hub = s.gateway.uplink
        assert hub is not None and hub.link is not None and hub.payloads is not None
        link = hub.link
        vps = PayloadStore(s.vps.payload_dir)
        try:
            meta = vps.get(changed.payload_id)  # sealed to this home's key
        finally:
            vps.close()
        # relabelled: a good payload's bytes offered as another session's (the key block is bound to it)
        env = envelope.Envelope(
            meta.payload_id, "ses_someone_else", meta.agent_id, "2026-12-03T12:00:00Z",
            dict(meta.encryption), meta.format, meta.size, meta.hash,
        )  # fmt: skip
        before = set((home.payload_dir / "blobs").iterdir())

        async def offer(path: str, header: str, body: bytes = b"x" * 200) -> tuple[int, dict[str, Any]]:
            return await _offer(link, path, header, body)

        hdr = envelope.encode_header(env)
        status, body = await offer(relay.PATH + meta.payload_id, hdr, blob.read_bytes())
        assert status == 400 and body["error"]["code"] == "PAYLOAD_INVALID", body
        good_hdr = envelope.encode_header(dataclasses.replace(env, session_id=meta.session_id))
        for path in (
            relay.PATH + "../blobs/" + meta.payload_id,
            relay.PATH + "..%2F" + meta.payload_id,
            relay.PATH + meta.payload_id + "/../../index.db",
            relay.PATH + "pay_../../../../tmp/x",
            relay.PATH + "pay_AAAAAAAAAAAA",  # a well-formed id that is not the envelope's
        ):
            status, body = await offer(path, good_hdr)
            assert status == 400 and body["error"]["code"] == "INVALID_REQUEST", (path, body)
        status, body = await offer(relay.PATH + meta.payload_id, "not-an-envelope!")
        assert status == 400 and body["error"]["code"] == "INVALID_REQUEST"
        assert set((home.payload_dir / "blobs").iterdir()) == before
        assert not any((home.payload_dir / "arriving").iterdir())


async def test_offers_beyond_the_bounds_are_refused_and_leave_nothing(home: Paths) -> None:
    async with split(home, home_side=False) as s:
        app = s.app
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        side = s.home_side()
        assert side.inbox is not None
        side.inbox.idle_seconds = 0.5
        task = asyncio.get_running_loop().create_task(side.run())
        try:
            await s.wait_connected()
            out = _fast(s)
            out.paused = True
            await asyncio.sleep(0.2)
            plain = os.urandom(200_000)
            binding, sealed = await _upload(app, a, g, plain)
            vps = PayloadStore(s.vps.payload_dir)
            try:
                meta = vps.get(binding.payload_id)
            finally:
                vps.close()
            env = envelope.Envelope(
                meta.payload_id, meta.session_id, meta.agent_id, "2026-12-03T12:00:00Z",
                dict(meta.encryption), meta.format, meta.size, meta.hash,
            )  # fmt: skip
            hub = s.gateway.uplink
            assert hub is not None and hub.link is not None
            link = hub.link
            path = relay.PATH + meta.payload_id

            def hdr(**change: Any) -> str:
                return envelope.encode_header(dataclasses.replace(env, **change))

            # more bytes than the envelope says: cut off at its size
            status, body = await _offer(link, path, hdr(size=len(sealed) - 100), sealed)
            assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE", body
            # fewer: the size is checked before anything is kept
            status, body = await _offer(link, path, hdr(), sealed[:-100])
            assert body["error"]["code"] == "PAYLOAD_SIZE_MISMATCH", body
            # beyond this home's limit: refused before a byte is read
            status, body = await _offer(link, path, hdr(size=1 << 40), sealed[:100])
            assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE", body
            # offers that stall: at most two at once (a third is busy), each given up after the idle time
            stalled = [asyncio.ensure_future(_offer(link, path, hdr(), sealed[:1000], end=False)) for _ in range(2)]
            await _wait(lambda: side.inbox is not None and side.inbox.snapshot()["busy"] == 2, "two arrivals held")
            status, body = await _offer(link, path, hdr(), sealed)
            assert status == 503 and body["error"]["code"] == "STORE_BUSY", body
            for t in stalled:
                status, body = await asyncio.wait_for(t, 10)
                assert status == 400 and "sent nothing" in body["error"]["message"], body
            assert not any((home.payload_dir / "arriving").iterdir())
            assert meta.payload_id not in _home_rows(home)
            assert (await _home_get(app, meta.payload_id))[0] == 404
            # the home side still takes the genuine offer whole
            out.paused = False
            await _wait(lambda: meta.payload_id not in _vps_ids(s), "the genuine payload went home")
            await _pulled_and_opened(app, binding, plain)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.mark.parametrize("point", ["arrival_mid_body", "arrival_before_event"])
async def test_home_side_killed_mid_transfer_then_restarted(home: Paths, tmp_path: Path, point: str) -> None:
    async with split(home, home_side=False) as s:
        app = s.app
        a = app.agent("calendar_agent")
        g = await app.grant(a)
        plain = os.urandom(3 << 20)  # more than one write block at home: the kill comes with bytes on disk
        out = _fast(s)
        out.paused = True
        side = asyncio.get_running_loop().create_task(s.home_side().run())
        try:
            await s.wait_connected()
            binding, _ = await _upload(app, a, g, plain)  # held on the VPS
        finally:
            side.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await side
        await s.wait_connected(False)
        out.paused = False
        pid = binding.payload_id
        arm = tmp_path / "arm"
        arm.write_text("")
        proc = home_process(home, s.uplink_url, fault=point, arm=arm)
        try:
            held = Path(str(arm) + ".held")
            await _wait(held.exists, f"the home side held at {point}")
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=10) == -9
            # nothing visible at home; the VPS still holds it
            assert (await _home_get(app, pid))[0] == 404
            rows = _home_rows(home)
            if point == "arrival_mid_body":
                assert pid not in rows and any((home.payload_dir / "arriving").iterdir())
                assert not (home.payload_dir / "blobs" / pid).exists()
            else:
                assert rows.get(pid) == "arriving"  # durable, checked, not yet audited: invisible
            assert pid in _vps_ids(s)
            assert not ledger_events(home, action="payload_arrived", key=pid)
            await s.wait_connected(False)
            proc = home_process(home, s.uplink_url)
            await s.wait_connected()
            await _wait(lambda: pid not in _vps_ids(s), "the transfer completed after the restart")
            await _pulled_and_opened(app, binding, plain)
            assert not any((home.payload_dir / "arriving").iterdir())  # the killed part file was removed
            assert len(ledger_events(home, action="payload_arrived", key=pid)) == 1
            assert len(ledger_events(home, action="payload_uploaded", key=pid)) == 1
        finally:
            proc.kill()
            proc.wait()


def test_the_envelope_header_round_trips() -> None:
    """What the VPS sends as the offer's envelope is what the home parses (no field lost)."""
    key = X25519PrivateKey.generate()
    binding = sealing.Binding("pay_" + "A" * 20, "ses_1", "agent_1", "text/plain")
    enc, sealed = sealing.seal_bytes(key.public_key(), binding, b"x")
    env = envelope.Envelope(
        binding.payload_id, "ses_1", "agent_1", "2026-12-03T12:00:00Z", enc, "text/plain", len(sealed),
        sealing.ciphertext_hash(sealed),
    )  # fmt: skip
    hdr = envelope.encode_header(env).encode()
    got = relay.Inbox.offer("PUT", relay.PATH + binding.payload_id, [(relay.META_HEADER, hdr)])
    assert got == env
    with pytest.raises(Exception, match="PUT"):
        relay.Inbox.offer("GET", relay.PATH + binding.payload_id, [(relay.META_HEADER, hdr)])
    with pytest.raises(Exception, match="exactly one"):
        relay.Inbox.offer("PUT", relay.PATH + binding.payload_id, [(relay.META_HEADER, hdr)] * 2)
    assert base64.b64decode(enc["nonce"])  # the encryption header travels as the agent sent it
