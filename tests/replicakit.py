"""Test helpers for gateway replicas: a real redis-server and a real haproxy (Debian's, installed by
scripts/setup-redis.sh and scripts/setup-haproxy.sh), each on its own free loopback port, in a temp
directory, stopped by the test. Missing binaries: the tests fail under CI and skip locally."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from portkit import free_port


def need(binary: str) -> str:
    path = shutil.which(binary) or (f"/usr/sbin/{binary}" if Path(f"/usr/sbin/{binary}").exists() else None)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{binary} is missing: scripts/setup-redis.sh / setup-haproxy.sh install it")
        pytest.skip(f"{binary} not installed (bash scripts/setup-redis.sh; bash scripts/setup-haproxy.sh)")
    return path


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    for _ in range(400):
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited: {proc.stderr.read().decode(errors='replace') if proc.stderr else ''}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.025)
    raise AssertionError(f"{what} is not listening on {port}")


class Redis:
    """One redis-server; :meth:`kill` and :meth:`start` again on the same port (empty: no persistence)."""

    def __init__(self, workdir: Path) -> None:
        self.binary = need("redis-server")
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--maxmemory-policy", "noeviction",
                "--protected-mode", "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        _wait_port(self.port, self.proc, "redis-server")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[Redis]:
    r = Redis(workdir)
    r.start()
    try:
        yield r
    finally:
        r.kill()


@contextlib.contextmanager
def haproxy(workdir: Path, backends: list[int], *, check: bool = False, port: int | None = None) -> Iterator[int]:
    """haproxy in TCP mode on a free port, round robin over ``backends`` (one backend per connection).
    ``check``: a TCP health check every 100 ms (down after one failure) and a failed connect retried
    on another backend (``retries`` + ``option redispatch``), as one runs replicas in production."""
    binary = need("haproxy")
    port = free_port() if port is None else port
    opts = " check inter 100ms fall 1 rise 2" if check else ""
    servers = "\n".join(f"  server g{i} 127.0.0.1:{p}{opts}" for i, p in enumerate(backends))
    if check:
        servers = "  retries 3\n  option redispatch\n" + servers
    cfg = workdir / "haproxy.cfg"
    cfg.write_text(
        f"""global
  maxconn 256
defaults
  mode tcp
  timeout connect 2s
  timeout client 30s
  timeout server 30s
frontend agents
  bind 127.0.0.1:{port}
  default_backend gateways
backend gateways
  balance roundrobin
{servers}
"""
    )
    proc = subprocess.Popen([binary, "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_port(port, proc, "haproxy")
        yield port
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()
