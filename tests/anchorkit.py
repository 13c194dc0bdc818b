"""Helpers for the anchoring tests: a real anvil node on 127.0.0.1, sample anchors.

anvil comes from the npm package @foundry-rs/anvil-linux-amd64, installed by
scripts/setup-anvil.sh into anchor-tools/node_modules (scripts/test.sh runs it). Without it the
chain tests skip with that reason.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gateway.anchor import encoding as enc
from gateway.anchor.base import (
    Anchor,
    DataDeletionProofSubmitted,
    GatewayAccess,
    PayloadAnchored,
    SessionGranted,
    SessionRevoked,
)

ROOT = Path(__file__).resolve().parent.parent
ANVIL = ROOT / "anchor-tools" / "node_modules" / "@foundry-rs" / "anvil-linux-amd64" / "bin" / "anvil"
ANVIL_MISSING = (
    f"anvil not installed at {ANVIL.relative_to(ROOT)} (run scripts/setup-anvil.sh; needs node/npm on linux-x64)"
)
START_DEADLINE_S = 60.0  # generous: seven test runs share two cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def closed_port() -> int:
    """A loopback port nothing listens on (bound then released; nothing else binds loopback here)."""
    return free_port()


class Anvil:
    """One anvil process; ``stop`` + ``start`` keep its chain (``--state`` dumps it on exit)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.state = workdir / "anvil-state.json"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.proc is None
        self.proc = subprocess.Popen(
            [
                str(ANVIL),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--silent",
                "--chain-id",
                "31337",
                "--state",
                str(self.state),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self.proc = None
                raise RuntimeError(f"anvil exited at start: {err[-500:]}")
            try:
                self.rpc("eth_chainId")
                return
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("anvil did not answer in time") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.send_signal(signal.SIGINT)  # anvil dumps --state on a clean exit
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()

    def rpc(self, method: str, *params: Any) -> Any:
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": list(params)}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            out = json.loads(resp.read())
        if "error" in out:
            raise RuntimeError(f"anvil {method}: {out['error']}")
        return out["result"]

    def mine(self, blocks: int = 1) -> None:
        self.rpc("anvil_mine", hex(blocks))

    def fund(self, address: str, wei: int = 10**20) -> None:
        self.rpc("anvil_setBalance", address, hex(wei))


async def included(backend: Any, submitted: Any, *, deadline_s: float = 60.0) -> Any:
    """Poll ``status`` until the transaction is in a block (anvil's auto-mining is asynchronous:
    the hash comes back before the block exists)."""
    import asyncio

    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        st = await backend.status(submitted)
        if st.state != "pending":
            return st
        if loop.time() > end:
            raise AssertionError("transaction not mined before the deadline")
        await asyncio.sleep(0.02)


def signed_note(size: int, root: bytes, *, origin: str = "uomp.test/log", sig: bytes = b"") -> str:
    """A note in the C2SP signed-checkpoint shape (the signature bytes are opaque here)."""
    text = f"{origin}\n{size}\n{base64.b64encode(root).decode()}\ntimestamp 1790000000\n"
    blob = base64.b64encode(b"\x01\x02\x03\x04" + (sig or hashlib.sha256(text.encode()).digest() * 2)).decode()
    return f"{text}\n\u2014 {origin} {blob}\n"


def sample_anchor(n: int = 0, *, events: bool = True) -> Anchor:
    """A distinct anchor per ``n``, with one event of every §18.4.1 kind when ``events``."""
    root = hashlib.sha256(f"root {n} {os.getpid()} {time.time_ns()}".encode()).digest()
    note = signed_note(10 + n, root)
    if not events:
        return Anchor.for_checkpoint(note)
    sh = enc.session_hash(f"sess_{n}", "calendar_agent", ["calendar", "preference"])
    ah = enc.agent_hash("calendar_agent")
    return Anchor.for_checkpoint(
        note,
        granted=(SessionGranted(sh, ah, 1790000600),),
        revoked=(SessionRevoked(sh, ah),),
        access=(
            GatewayAccess(sh, ah, enc.endpoint_hash("/v1/memory/{key}"), True),
            GatewayAccess(sh, ah, enc.endpoint_hash("/v1/memory"), False),
        ),
        payloads=(PayloadAnchored(enc.payload_hash(b"ciphertext bytes"), sh, ah),),
        deletions=(DataDeletionProofSubmitted(sh, ah, enc.deletion_proof_hash("del_1", f"sess_{n}", "sha256:00")),),
    )
