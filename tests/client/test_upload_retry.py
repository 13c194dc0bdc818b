"""The SDK's payload upload survives a connection dropped after the relay received the upload: it sends
the SAME payload again (same payload_id, same sealed bytes, now with their hash named in the
envelope), which the relay answers idempotently, so one payload and one ``payload_uploaded`` event
come of it, never other bytes under that id (409 PAYLOAD_EXISTS) or a second payload.

Real parts: the guard on its Unix socket, the gateway's mTLS listener with real TLS 1.3, a bundle from
``uomp authorize --remote --csr``, the SDK. Between the SDK and the gateway a plain TCP relay (TLS
passes through it end to end) cuts the connection the moment the gateway starts answering an
upload, after the gateway has stored the payload and made its event durable (the gateway sends no
session tickets here, so its first bytes after the request are the answer)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from gatewaykit import Appliance
from test_payload_relay import acli, audit_rows, store_state
from test_sdk import authorize_csr, sdk_appliance
from test_upload_trailer import hashes_seen

from gateway.client import ClientOptions, InvalidRequest, Unavailable, UompClient
from gateway.config import Paths
from gateway.core.envelope import HASH_TRAILER

pytestmark = pytest.mark.timeout(90)

SECRET = b"MARKER-upload-retry-plaintext 41c7\n"
FAST = ClientOptions(refresh_retry_initial_seconds=0.05, refresh_retry_max_seconds=0.1)


class CuttingRelay:
    """127.0.0.1 TCP relay to the gateway. A connection whose client has sent more than ``threshold``
    bytes (an upload's body has passed) is cut, both ways, when the gateway's first answer bytes
    arrive: those bytes are never delivered. ``cuts`` such cuts are made, then it relays faithfully."""

    def __init__(self, target_port: int, threshold: int, cuts: int, *, mid_body: bool = False) -> None:
        self.target_port = target_port
        self.threshold = threshold
        self.mid_body = mid_body  # cut as soon as the client has sent more than threshold bytes
        self.cuts_left = cuts
        self.cut = 0
        self.uploads_seen = 0  # connections that carried more than threshold bytes
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> CuttingRelay:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await t
        await self.server.wait_closed()

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        sent = [0]
        counted = [False]
        done = asyncio.Event()

        def abort() -> None:
            cw.transport.abort()
            uw.transport.abort()
            done.set()

        async def up() -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await cr.read(65536):
                    sent[0] += len(data)
                    if sent[0] > self.threshold and not counted[0]:
                        counted[0] = True
                        self.uploads_seen += 1
                        if self.mid_body and self.cuts_left > 0:
                            self.cuts_left -= 1
                            self.cut += 1
                            abort()
                            return
                    uw.write(data)
                    await uw.drain()
            with contextlib.suppress(OSError):
                uw.write_eof()

        async def down() -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await ur.read(65536):
                    if sent[0] > self.threshold and self.cuts_left > 0:
                        self.cuts_left -= 1
                        self.cut += 1
                        abort()
                        return
                    cw.write(data)
                    await cw.drain()
            done.set()

        tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
        self._tasks.update(tasks)
        await done.wait()
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await t
            self._tasks.discard(t)
        for w in (cw, uw):
            w.close()


@contextlib.asynccontextmanager
async def relayed(
    app: Appliance, tmp: Path, *, threshold: int, cuts: int, mid_body: bool = False
) -> AsyncIterator[tuple[CuttingRelay, Path]]:
    assert app.gateway.port is not None and app.gateway.state is not None
    async with CuttingRelay(app.gateway.port, threshold, cuts, mid_body=mid_body) as relay:
        url = f"https://localhost:{relay.port}"
        app.gateway.state.add_endpoint(url)  # the relay's address is one the gateway serves
        yield relay, authorize_csr(app, tmp, url=url)


@pytest.fixture
async def app(home: Paths) -> AsyncIterator[Appliance]:
    # no session tickets: the only bytes the gateway sends after the request are its answer
    async with sdk_appliance(home, status_cache_seconds=0, payload_max_bytes=8 << 20, tls_session_tickets=0) as a:
        yield a


def uploads(app: Appliance) -> tuple[list[str], list[str]]:
    """(payload ids in the store, keys of payload_uploaded events)."""
    rows, _blobs, _tmp = store_state(app.paths)
    return sorted(rows), sorted(r["key"] for r in audit_rows(app.paths, "payload_uploaded"))


@pytest.mark.parametrize(
    ("form", "size"),
    [
        pytest.param("json", 4000, id="json-envelope"),
        pytest.param("stream", 600_000, id="streamed-file"),
        pytest.param("presigned", 600_000, id="presigned-url"),
    ],
)
async def test_dropped_answer_is_retried_with_the_same_envelope(
    app: Appliance, tmp_path: Path, form: str, size: int
) -> None:
    data = os.urandom(size)
    source: bytes | Path = data
    if form != "json":
        source = tmp_path / "big.bin"
        source.write_bytes(data)
    async with (
        relayed(app, tmp_path, threshold=size, cuts=1) as (relay, bundle),
        UompClient.from_bundle(bundle, options=FAST) as c,
    ):
        pid = await c.upload_payload(source, format="application/octet-stream", presigned=form == "presigned")
    assert relay.cut == 1 and relay.uploads_seen == 2  # the answer was lost once, the upload sent twice
    # one payload, one event, under the id the SDK returned: the retry was the same envelope
    assert uploads(app) == ([pid], [pid])
    assert audit_rows(app.paths, "payload_refused") == []
    if form == "stream":  # and it opens to the data (the same bytes: the relay compared their hash)
        out = tmp_path / "out.bin"
        rc, _, err = await acli(app.paths, "payload", "pull", pid, "--out", str(out))
        assert rc == 0, err
        assert out.read_bytes() == data


async def test_an_upload_cut_mid_body_is_sealed_again_and_sent_with_its_hash(
    app: Appliance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first try (sent while sealed, its hash to follow) is cut half-way: nothing of it is kept; the
    SDK seals the same bytes once more to learn their hash and sends them with it named."""
    seen = hashes_seen(monkeypatch)
    data = os.urandom(3 << 20)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    async with (
        relayed(app, tmp_path, threshold=1 << 20, cuts=1, mid_body=True) as (relay, bundle),
        UompClient.from_bundle(bundle, options=FAST) as c,
    ):
        pid = await c.upload_payload(source, format="application/octet-stream")
    assert relay.cut == 1 and relay.uploads_seen == 2
    assert uploads(app) == ([pid], [pid])
    blob = (app.paths.payload_dir / "blobs" / pid).read_bytes()
    assert seen == [HASH_TRAILER, "sha256:" + hashlib.sha256(blob).hexdigest()]
    _rows, blobs, tmp = store_state(app.paths)
    assert blobs == [pid] and tmp == []  # the cut try's part file is gone
    out = tmp_path / "out.bin"
    rc, _, err = await acli(app.paths, "payload", "pull", pid, "--out", str(out))
    assert rc == 0, err
    assert out.read_bytes() == data


async def test_retries_are_bounded_and_still_one_payload(app: Appliance, tmp_path: Path) -> None:
    opts = ClientOptions(refresh_retry_initial_seconds=0.05, refresh_retry_max_seconds=0.1, payload_retry_attempts=3)
    async with (
        relayed(app, tmp_path, threshold=2000, cuts=100) as (relay, bundle),
        UompClient.from_bundle(bundle, options=opts) as c,
    ):
        with pytest.raises(Unavailable) as e:
            await c.upload_payload(SECRET * 100, format="text/plain")
    assert e.value.code == "CONNECTION_CLOSED"
    assert relay.cut == 3 and relay.uploads_seen == 3  # exactly payload_retry_attempts tries
    rows, events = uploads(app)
    assert len(rows) == 1 and rows == events  # every try was the same payload: kept once


async def test_a_refusal_is_not_retried(home: Paths, tmp_path: Path) -> None:
    async with sdk_appliance(home, status_cache_seconds=0, payload_max_bytes=3000, tls_session_tickets=0) as small:
        async with (
            relayed(small, tmp_path, threshold=10**9, cuts=0) as (relay, bundle),
            UompClient.from_bundle(bundle, options=FAST) as c,
        ):
            with pytest.raises(InvalidRequest) as e:
                await c.upload_payload(os.urandom(5000), format="application/octet-stream")
        assert e.value.code == "PAYLOAD_TOO_LARGE"
        assert relay.cut == 0
        assert uploads(small) == ([], [])
        refused = audit_rows(small.paths, "payload_refused") + audit_rows(small.paths, "payload_upload")
        assert len([r for r in refused if not r["allowed"]]) == 1  # one try, one refusal
