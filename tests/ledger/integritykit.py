"""A real guard process (``uomp guard serve``) on a home's Unix socket, for the audit log's
integrity and clock tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import aiohttp
from guardkit import admin_headers

from gateway.config import Paths

UOMP = [sys.executable, "-m", "gateway.cli.main"]


class Guard:
    """A real guard process on the home's Unix socket."""

    def __init__(self, paths: Paths, env: dict[str, str] | None = None) -> None:
        self.paths = paths
        self.proc = subprocess.Popen(
            [*UOMP, "--home", str(paths.home), "guard", "serve", "--no-tcp"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.health: dict[str, Any] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return
            try:
                status, body = self.call("GET", "/v1/health")
            except (aiohttp.ClientError, OSError):
                time.sleep(0.05)
                continue
            if status == 200:
                self.health = body
                return
        raise AssertionError("the guard did not answer")

    def call(self, method: str, path: str, body: Any = None, *, admin: bool = False) -> tuple[int, Any]:
        async def go() -> tuple[int, Any]:
            conn = aiohttp.UnixConnector(path=str(self.paths.guard_sock))
            async with (
                aiohttp.ClientSession(connector=conn) as s,
                s.request(
                    method, "http://guard" + path, json=body, headers=admin_headers(self.paths) if admin else None
                ) as resp,
            ):
                return resp.status, await resp.json(content_type=None)

        return asyncio.run(go())

    def refusing(self, within: float = 0.0) -> dict[str, Any] | None:
        deadline = time.monotonic() + within
        while True:
            status, body = self.call("GET", "/v1/health")
            assert status == 200
            if body.get("status") == "refusing":
                return dict(body["audit"]["error"])
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def output(self) -> str:
        self.stop()
        assert self.proc.stdout is not None
        return self.proc.stdout.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
