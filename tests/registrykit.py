"""Helpers for the registry tests: the ERC-8004 test registry on a real anvil, a loopback HTTPS
document server with certificates made in the test, and registration files.

    reg = Registry.deploy(anvil)                # contracts/Erc8004IdentityRegistry.sol, compiled
    agent = reg.register(uri, metadata={"registrationHash": keccak(body)})
    docs = DocServer(tmp_path)                   # https://127.0.0.1:PORT/, CA in docs.ca_file
    docs.put("/a.json", body)                    # or docs.behave("/slow", "drip")
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from anchorkit import Anvil
from certutil import make_cert_set
from web3 import HTTPProvider, Web3
from web3.logs import DISCARD

from gateway.anchor.encoding import keccak256
from gateway.registry.card import REGISTRATION_TYPE


def artifact() -> dict[str, Any]:
    text = resources.files("gateway.registry").joinpath("Erc8004IdentityRegistry.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def keccak(data: bytes) -> bytes:
    return keccak256(data)


class Registry:
    def __init__(self, anvil: Anvil, address: str) -> None:
        self.anvil = anvil
        self.w3 = Web3(HTTPProvider(anvil.url, request_kwargs={"timeout": 30}))
        self.address = Web3.to_checksum_address(address)
        self.contract = self.w3.eth.contract(address=self.address, abi=artifact()["abi"])
        self.accounts = self.w3.eth.accounts

    @classmethod
    def deploy(cls, anvil: Anvil) -> Registry:
        w3 = Web3(HTTPProvider(anvil.url, request_kwargs={"timeout": 30}))
        art = artifact()
        tx = (
            w3.eth.contract(abi=art["abi"], bytecode=art["bytecode"])
            .constructor()
            .transact({"from": w3.eth.accounts[0]})
        )
        receipt = w3.eth.wait_for_transaction_receipt(tx, timeout=60)
        return cls(anvil, receipt["contractAddress"])

    @property
    def spec(self) -> str:
        return f"31337:{self.address}"

    @property
    def id(self) -> str:
        return f"eip155:31337:{self.address.lower()}"

    def _wait(self, tx: Any) -> Any:
        receipt = self.w3.eth.wait_for_transaction_receipt(tx, timeout=60)
        assert receipt["status"] == 1
        return receipt

    def register(self, uri: str, *, metadata: dict[str, bytes] | None = None, sender: int = 1) -> int:
        entries = [(k, v) for k, v in (metadata or {}).items()]
        fn = self.contract.get_function_by_signature("register(string,(string,bytes)[])")
        receipt = self._wait(fn(uri, entries).transact({"from": self.accounts[sender]}))
        logs = self.contract.events.Registered().process_receipt(receipt, errors=DISCARD)
        return int(logs[0]["args"]["agentId"])

    def set_uri(self, agent_id: int, uri: str, *, sender: int = 1) -> None:
        self._wait(self.contract.functions.setAgentURI(agent_id, uri).transact({"from": self.accounts[sender]}))

    def set_metadata(self, agent_id: int, key: str, value: bytes, *, sender: int = 1) -> None:
        self._wait(self.contract.functions.setMetadata(agent_id, key, value).transact({"from": self.accounts[sender]}))

    def owner(self, sender: int = 1) -> str:
        return str(self.accounts[sender]).lower()


def registration(
    name: str,
    agent_id: int,
    registry_id: str,
    *,
    manifest_url: str | None = None,
    manifest_hash: bytes | None = None,
    description: str = "",
    services: list[dict[str, Any]] | None = None,
) -> bytes:
    svc = list(services or [])
    if manifest_url is not None:
        uomp: dict[str, Any] = {"name": "UOMP", "endpoint": manifest_url, "version": "draft-00"}
        if manifest_hash is not None:
            uomp["manifestHash"] = "0x" + manifest_hash.hex()
        svc.append(uomp)
    doc = {
        "type": REGISTRATION_TYPE,
        "name": name,
        "description": description,
        "services": svc,
        "registrations": [{"agentId": agent_id, "agentRegistry": registry_id}],
        "supportedTrust": ["reputation"],
    }
    return json.dumps(doc, indent=1).encode()


class DocServer:
    """HTTPS on 127.0.0.1 (certificate for 127.0.0.1/localhost from a CA made here): serves the
    bytes ``put`` at a path, or a behaviour: ``drip`` (one byte every 50 ms, forever),
    ``huge`` (Content-Length of 100 MB), ``huge_chunked`` (no length, 1 MiB chunks, forever),
    ``loop`` (redirects to itself), ``to_http`` (redirects to http://), ``redirect:PATH``.
    Counts the requests per path in ``hits``. ``plain=True``: http instead of https."""

    def __init__(self, workdir: Path, *, plain: bool = False) -> None:
        self.docs: dict[str, bytes] = {}
        self.behaviours: dict[str, str] = {}
        self.hits: dict[str, int] = {}
        self.stop_event = threading.Event()
        certs = make_cert_set(workdir / "docserver-certs", hostnames=("localhost", "127.0.0.1"), variants=())
        self.ca_file = certs.ca_cert
        self.other_ca_file = certs.other_ca_cert
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                outer.hits[path] = outer.hits.get(path, 0) + 1
                how = outer.behaviours.get(path)
                try:
                    if how is None:
                        body = outer.docs.get(path)
                        if body is None:
                            self.send_response(404)
                            self.send_header("Content-Length", "0")
                            self.end_headers()
                            return
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                    elif how == "drip":
                        self.send_response(200)
                        self.send_header("Content-Length", "1000")
                        self.end_headers()
                        while not outer.stop_event.is_set():
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            time.sleep(0.05)
                    elif how == "huge":
                        self.send_response(200)
                        self.send_header("Content-Length", str(100 * 1024 * 1024))
                        self.end_headers()
                        self.wfile.write(b"{" * 65536)
                    elif how == "huge_chunked":
                        self.send_response(200)
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        chunk = b"x" * (1 << 20)
                        for _ in range(64):
                            if outer.stop_event.is_set():
                                break
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.write(b"0\r\n\r\n")
                    elif how in ("loop", "to_http") or how.startswith("redirect:"):
                        if how == "loop":
                            where = path
                        elif how == "to_http":
                            where = f"http://127.0.0.1:{outer.port}/plain.json"
                        else:
                            where = how.split(":", 1)[1]
                        self.send_response(302)
                        self.send_header("Location", where)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if not plain:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(certs.server_cert, certs.server_key)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.scheme = "http" if plain else "https"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def put(self, path: str, body: bytes) -> str:
        self.docs[path] = body
        return self.url(path)

    def behave(self, path: str, how: str) -> str:
        self.behaviours[path] = how
        return self.url(path)

    def close(self) -> None:
        self.stop_event.set()
        self.httpd.shutdown()
        self.httpd.server_close()
