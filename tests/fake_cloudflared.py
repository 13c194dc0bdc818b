#!/usr/bin/env python3
"""A stand-in for `cloudflared`, for tests: the real service cannot be reached from here.

It accepts the command lines the tunnel supervisor uses, prints what cloudflared prints (to
stderr, timestamped, the quick-tunnel URL in its box), and in the normal case runs an "edge":
a plain HTTP server on 127.0.0.1 that forwards every request to the origin (`--url`) with the
public host name in `Host`, `X-Forwarded-Proto: https` and `Cf-Connecting-Ip`, as Cloudflare's
edge does after ending TLS. Tests find the edge's port in the file named by FAKE_CF_EDGE_FILE.

Behaviour is chosen by FAKE_CF_MODE:
  ok (default)     print the URL, serve until killed
  exit             exit 1 at once with an error line
  no-url           print the banner, never a URL, keep running
  rate-limited     print cloudflared's 429 / error 1015 lines and exit 1
  die-after:N      serve like ok, exit 1 after N seconds
Every start writes a new random host name, so a restart changes the URL like the real one.
Standard library only (it runs with whatever python3 is on PATH).
"""

from __future__ import annotations

import http.client
import http.server
import os
import secrets
import sys
import threading
import time
from datetime import datetime, timezone
from urllib.parse import urlsplit

WORDS = ["amber", "brook", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper"]


def say(level: str, text: str) -> None:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: UP017 - any python3
    sys.stderr.write(f"{stamp} {level} {text}\n")
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--version"] or argv[:1] == ["version"]:
        print("cloudflared version 2025.1.0 (stand-in for tests)")
        return 0
    mode = os.environ.get("FAKE_CF_MODE", "ok")
    origin = None
    if "--url" in argv:
        origin = argv[argv.index("--url") + 1]
    named = "run" in argv
    if named and not os.environ.get("TUNNEL_TOKEN"):
        say(
            "ERR",
            '"cloudflared tunnel run" requires the ID or name of the tunnel to run as the last command '
            "line argument or in the configuration file.",
        )
        return 1
    say(
        "INF",
        "Thank you for trying Cloudflare Tunnel. Doing so, without a Cloudflare account, is a quick way "
        "to experiment and try it out.",
    )
    if mode == "exit":
        say("ERR", "failed to start tunnel: stand-in told to exit")
        return 1
    if not named:
        say("INF", "Requesting new quick Tunnel on trycloudflare.com...")
    if mode == "rate-limited":
        say(
            "ERR",
            "Error unmarshaling QuickTunnel response: error code: 1015 error=\"invalid character 'e' "
            'looking for beginning of value" status_code="429 Too Many Requests"',
        )
        sys.stderr.write("failed to unmarshal quick Tunnel: invalid character 'e' looking for beginning of value\n")
        return 1
    if mode == "no-url":
        while True:
            time.sleep(3600)
    host = "-".join(secrets.choice(WORDS) for _ in range(3)) + "-" + secrets.token_hex(2) + ".trycloudflare.com"
    if named:
        host = os.environ.get("FAKE_CF_HOSTNAME", "gw.example.test")
    edge = start_edge(origin, host)
    if path := os.environ.get("FAKE_CF_EDGE_FILE"):
        with open(path + ".tmp", "w") as fh:
            fh.write(f"{edge} {host}\n")
        os.replace(path + ".tmp", path)
    if not named:
        say("INF", "+--------------------------------------------------------------------------------------------+")
        say("INF", "|  Your quick Tunnel has been created! Visit it at (it may take some time to be reachable):  |")
        say("INF", f"|  https://{host:<88}|")
        say("INF", "+--------------------------------------------------------------------------------------------+")
    say("INF", "Version 2025.1.0 (stand-in)")
    token = "set" if os.environ.get("TUNNEL_TOKEN") else "unset"
    say("DBG", f"stand-in: HOME={os.environ.get('HOME', '')} token={token}")
    say(
        "INF",
        f"Registered tunnel connection connIndex=0 connection={secrets.token_hex(8)} event=0 "
        "ip=127.0.0.1 location=test01 protocol=quic",
    )
    if mode.startswith("die-after:"):
        time.sleep(float(mode.split(":", 1)[1]))
        say("ERR", 'Connection terminated error="stand-in told to die"')
        return 1
    while True:
        time.sleep(3600)


def start_edge(origin: str | None, host: str) -> int:
    target = urlsplit(origin or "http://127.0.0.1:1")

    class Edge(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in ("host", "connection", "keep-alive", "transfer-encoding")
            }
            headers["Host"] = host
            headers["X-Forwarded-Proto"] = "https"
            headers["Cf-Connecting-Ip"] = self.client_address[0]
            try:
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except OSError:
                self.send_response(502)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("content-length", "connection", "transfer-encoding"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            conn.close()

        do_GET = do_POST = do_PUT = do_DELETE = _forward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Edge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return int(server.server_address[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
