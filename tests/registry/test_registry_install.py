"""`uomp registry add|search|show|install` against the ERC-8004 test registry on a real anvil, the
files served by a loopback HTTPS server with a CA made here, and what `uomp authorize` then shows.

One anvil and one registry per module (deploying is the slow part); each test registers its own
agents, so their ids differ but the checks are the same.
"""

from __future__ import annotations

import base64
import json
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from anchorkit import ANVIL, ANVIL_MISSING, Anvil, free_port
from registrykit import DocServer, Registry, keccak, registration
from shortdir import short_dir

from gateway.cli.main import main
from gateway.config import Paths
from gateway.keys import init_home

pytestmark = pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = (ROOT / "examples" / "calendar_agent" / "uom.json").read_bytes()


@pytest.fixture(scope="module")
def chain() -> Iterator[tuple[Anvil, Registry]]:
    work = short_dir("uomp-reg-")
    node = Anvil(work)
    node.start()
    try:
        yield node, Registry.deploy(node)
    finally:
        node.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def docs(tmp_path: Path) -> Iterator[DocServer]:
    server = DocServer(tmp_path)
    yield server
    server.close()


@pytest.fixture
def home(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "home")
    init_home(paths)
    return paths


def uomp(paths: Paths, *args: str) -> int:
    return main(["--home", str(paths.home), *args])


def fetch_flags(docs: DocServer) -> list[str]:
    return ["--ca-file", str(docs.ca_file), "--allow-internal"]


def add(paths: Paths, anvil: Anvil, reg: Registry) -> None:
    assert uomp(paths, "registry", "add", reg.spec, "--rpc", anvil.url) == 0


def publish(
    reg: Registry,
    docs: DocServer,
    name: str,
    *,
    manifest: bytes = MANIFEST,
    pin_registration: bool = True,
    pin_manifest: bool = True,
    names_id: int | None = None,
    names_registry: str | None = None,
    description: str = "",
) -> int:
    """Register an agent whose registration file and uom.json the doc server serves; its id."""
    tag = f"{name.replace(' ', '-')}-{len(docs.docs)}"
    m_url = docs.put(f"/{tag}/uom.json", manifest)
    reg_path = f"/{tag}/registration.json"
    agent_id = reg.register(docs.url(reg_path))
    body = registration(
        name,
        names_id if names_id is not None else agent_id,
        names_registry or reg.id,
        manifest_url=m_url,
        manifest_hash=keccak(manifest) if pin_manifest else None,
        description=description,
    )
    docs.put(reg_path, body)
    if pin_registration:
        reg.set_metadata(agent_id, "registrationHash", keccak(body))
    return agent_id


def nothing_installed(out: Path) -> bool:
    return not (out / "uom.json").exists() and not (out / "registry.json").exists()


# ------------------------------------------------------------------------------ the whole path


def test_search_install_then_authorize_shows_the_listing(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    agent_id = publish(reg, docs, "Calendar Helper", description="Schedules your meetings")
    other = publish(reg, docs, "Portfolio Watcher", description="Watches holdings")
    add(home, anvil, reg)
    capsys.readouterr()

    assert uomp(home, "registry", "search", "calendar", "--json", *fetch_flags(docs)) == 0
    found = json.loads(capsys.readouterr().out)
    ids = [r["agent_id"] for r in found["results"]]
    assert agent_id in ids and other not in ids
    hit = next(r for r in found["results"] if r["agent_id"] == agent_id)
    assert hit["owner"] == reg.owner() and "UOMP" in hit["services"]
    # denied partner: a keyword nothing matches finds nothing
    assert uomp(home, "registry", "search", "no-such-agent-anywhere", "--json", *fetch_flags(docs)) == 0
    assert json.loads(capsys.readouterr().out)["results"] == []

    out = tmp_path / "installed"
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), *fetch_flags(docs)) == 0
    said = capsys.readouterr().out
    assert "matches the hash the registry records" in said and "matches the manifestHash" in said
    assert (out / "uom.json").read_bytes() == MANIFEST
    record = json.loads((out / "registry.json").read_text())
    assert record["registry"] == reg.id and record["agent_id"] == agent_id and record["owner"] == reg.owner()

    assert uomp(home, "authorize", str(out), "--yes", "--print", "--allow-local") == 0
    shown = capsys.readouterr().out
    assert f"listed in registry {reg.id} as agent {agent_id}, owner {reg.owner()}" in shown
    assert "takes no part in this decision" in shown

    # denied partner: a uom.json edited after install is not covered by the listing
    (out / "uom.json").write_bytes(MANIFEST.replace(b"Calendar", b"Kalendar"))
    assert uomp(home, "authorize", str(out), "--yes", "--print", "--allow-local") == 0
    shown = capsys.readouterr().out
    assert "listed in registry" not in shown
    assert "did not install this uom.json (or it changed since)" in shown


def test_a_registry_json_shipped_with_an_agent_claims_nothing(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The listing comes from the user's own install record, never from a file beside the manifest."""
    anvil, reg = chain
    agent_id = publish(reg, docs, "Genuine")
    add(home, anvil, reg)
    out = tmp_path / "genuine"
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), *fetch_flags(docs)) == 0
    forged = tmp_path / "forged"
    forged.mkdir()
    forged_bytes = MANIFEST.replace(b"Calendar Assistant", b"Calendar Assistant Plus")
    (forged / "uom.json").write_bytes(forged_bytes)
    claim = json.loads((out / "registry.json").read_text())  # a real install's record, made to match
    claim["manifest_keccak256"] = "0x" + keccak(forged_bytes).hex()
    (forged / "registry.json").write_text(json.dumps(claim))
    capsys.readouterr()
    assert uomp(home, "authorize", str(forged), "--yes", "--print", "--allow-local") == 0
    shown = capsys.readouterr().out
    assert "listed in registry" not in shown and "no listing is shown" in shown
    # the same record in another user's home: that home never installed it
    other = Paths(tmp_path / "other-home")
    init_home(other)
    assert uomp(other, "authorize", str(out), "--yes", "--print", "--allow-local") == 0
    assert "listed in registry" not in capsys.readouterr().out


def test_authorize_without_registry_install_says_nothing_of_registries(
    home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    assert uomp(home, "authorize", str(ROOT / "examples" / "calendar_agent"), "--yes", "--print", "--allow-local") == 0
    assert "Registry:" not in capsys.readouterr().out


def test_show_reads_the_chain_and_the_file(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    agent_id = publish(reg, docs, "Shown Agent", pin_registration=False)
    add(home, anvil, reg)
    capsys.readouterr()
    assert uomp(home, "registry", "show", f"{reg.spec}:{agent_id}", *fetch_flags(docs)) == 0
    said = capsys.readouterr().out
    assert "Shown Agent" in said and reg.owner() in said
    assert "not pinned by the registry" in said
    # denied partner: an agent id the registry never minted
    assert uomp(home, "registry", "show", "999999", *fetch_flags(docs)) == 1
    assert "error NOT_FOUND" in capsys.readouterr().err


def test_data_uri_registration_is_read_in_place(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    m_url = docs.put("/data-agent/uom.json", MANIFEST)
    agent_id = reg.register("data:application/json;base64,")  # the id first, then the file naming it
    body = registration("Inline Agent", agent_id, reg.id, manifest_url=m_url, manifest_hash=keccak(MANIFEST))
    reg.set_uri(agent_id, "data:application/json;base64," + base64.b64encode(body).decode())
    add(home, anvil, reg)
    out = tmp_path / "inline"
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), *fetch_flags(docs)) == 0
    assert "stored on chain" in capsys.readouterr().out
    assert json.loads((out / "registry.json").read_text())["registration_pinned"] == "data-uri"


# ------------------------------------------------------------------------------ refusals


def test_registration_naming_another_agent_is_refused(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    victim = publish(reg, docs, "Real Agent")
    copycat = publish(reg, docs, "Copycat", names_id=victim)
    add(home, anvil, reg)
    out = tmp_path / "copy"
    assert uomp(home, "registry", "install", str(copycat), "--out", str(out), *fetch_flags(docs)) == 1
    err = capsys.readouterr().err
    assert "error REGISTRATION_INVALID" in err and "belongs to another agent" in err
    assert nothing_installed(out)
    # the same number in another registry is another agent too
    other_registry = "eip155:31337:0x" + "11" * 20
    elsewhere = publish(reg, docs, "Elsewhere", names_registry=other_registry)
    assert uomp(home, "registry", "install", str(elsewhere), "--out", str(out), *fetch_flags(docs)) == 1
    assert "error REGISTRATION_INVALID" in capsys.readouterr().err
    assert nothing_installed(out)
    # denied partner's allowed twin: the real agent installs
    assert uomp(home, "registry", "install", str(victim), "--out", str(out), *fetch_flags(docs)) == 0


def test_registration_whose_hash_differs_from_the_registry_is_refused(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    agent_id = publish(reg, docs, "Swapped")
    path = next(p for p in docs.docs if p.endswith("registration.json") and b"Swapped" in docs.docs[p])
    docs.docs[path] = docs.docs[path].replace(
        b'"name": "Swapped"', b'"name": "Swapper"'
    )  # the server now serves other bytes
    add(home, anvil, reg)
    out = tmp_path / "swapped"
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), *fetch_flags(docs)) == 1
    assert "error CONTENT_HASH_MISMATCH" in capsys.readouterr().err
    assert nothing_installed(out)
    # a recorded hash of the wrong length is refused too
    reg.set_metadata(agent_id, "registrationHash", b"\x01" * 31)
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), *fetch_flags(docs)) == 1
    assert "error REGISTRATION_INVALID" in capsys.readouterr().err
    # the registry records the new bytes' hash: accepted
    reg.set_metadata(agent_id, "registrationHash", keccak(docs.docs[path]))
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), *fetch_flags(docs)) == 0


def test_manifest_whose_hash_differs_is_refused(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    agent_id = publish(reg, docs, "Manifest Swap")
    m_path = next(p for p in docs.docs if p.endswith("uom.json") and p.startswith("/Manifest-Swap"))
    docs.docs[m_path] = MANIFEST.replace(b'"preference"', b'"financial"')
    add(home, anvil, reg)
    out = tmp_path / "mswap"
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), *fetch_flags(docs)) == 1
    assert "error CONTENT_HASH_MISMATCH" in capsys.readouterr().err
    assert nothing_installed(out)
    # an unpinned manifest installs, and says so
    loose = publish(reg, docs, "Loose", pin_manifest=False)
    assert uomp(home, "registry", "install", str(loose), "--out", str(out), *fetch_flags(docs)) == 0
    assert "NOT pinned by a hash" in capsys.readouterr().out


def test_invalid_manifest_and_missing_uomp_service_are_refused(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    bad = publish(reg, docs, "Broken", manifest=b'{"uomp_version": "1.0"}')
    add(home, anvil, reg)
    out = tmp_path / "broken"
    assert uomp(home, "registry", "install", str(bad), "--out", str(out), *fetch_flags(docs)) == 1
    assert "error MANIFEST_INVALID" in capsys.readouterr().err
    assert nothing_installed(out)
    agent_id = reg.register(docs.url("/no-uomp/registration.json"))
    docs.put("/no-uomp/registration.json", registration("No UOMP", agent_id, reg.id))
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), *fetch_flags(docs)) == 1
    assert "has no UOMP service" in capsys.readouterr().err
    assert nothing_installed(out)


def test_fetch_rules_apply_to_install(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the CA or without --allow-internal the loopback server is not reached; plain http is refused."""
    anvil, reg = chain
    agent_id = publish(reg, docs, "Rules")
    add(home, anvil, reg)
    out = tmp_path / "rules"
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), "--allow-internal") == 1
    assert "TLS certificate not trusted" in capsys.readouterr().err
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), "--ca-file", str(docs.ca_file)) == 1
    assert "non-public address" in capsys.readouterr().err
    assert nothing_installed(out)
    plain = reg.register("http://example.com/registration.json")
    assert uomp(home, "registry", "install", str(plain), "--out", str(out), *fetch_flags(docs)) == 1
    assert "plain http is refused" in capsys.readouterr().err
    local_file = reg.register("file:///etc/passwd")
    assert uomp(home, "registry", "install", str(local_file), "--out", str(out), *fetch_flags(docs)) == 1
    assert "only https:// URLs" in capsys.readouterr().err
    assert nothing_installed(out)


# ------------------------------------------------------------------------------ registries


def test_unknown_registry_and_none_configured(
    chain: tuple[Anvil, Registry], home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    assert uomp(home, "registry", "search", "x") == 1
    assert "error REGISTRY_UNKNOWN" in capsys.readouterr().err
    add(home, anvil, reg)
    assert uomp(home, "registry", "install", f"31337:0x{'22' * 20}:1", "--out", "/tmp/never-written") == 1
    assert "error REGISTRY_UNKNOWN" in capsys.readouterr().err
    assert not Path("/tmp/never-written").exists()
    assert uomp(home, "registry", "list") == 0
    assert reg.id in capsys.readouterr().out
    assert uomp(home, "registry", "rm", reg.spec) == 0
    assert uomp(home, "registry", "search", "x") == 1
    assert "error REGISTRY_UNKNOWN" in capsys.readouterr().err


def test_add_refuses_wrong_chain_no_code_and_non_registry(
    chain: tuple[Anvil, Registry], home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    assert uomp(home, "registry", "add", f"1:{reg.address}", "--rpc", anvil.url) == 1
    assert "is on chain 31337, not chain 1" in capsys.readouterr().err
    account = reg.accounts[3]
    assert uomp(home, "registry", "add", f"31337:{account}", "--rpc", anvil.url) == 1
    assert "no contract at" in capsys.readouterr().err
    # a contract that is not an ERC-721: the anchor contract
    from web3 import HTTPProvider, Web3

    from gateway.anchor.evm import artifact as anchor_artifact

    w3 = Web3(HTTPProvider(anvil.url))
    art = anchor_artifact()
    tx = w3.eth.contract(abi=art["abi"], bytecode=art["bytecode"]).constructor().transact({"from": w3.eth.accounts[0]})
    anchor_address = w3.eth.wait_for_transaction_receipt(tx)["contractAddress"]
    assert uomp(home, "registry", "add", f"31337:{anchor_address}", "--rpc", anvil.url) == 1
    assert "is not an ERC-721" in capsys.readouterr().err
    assert not home.registries_file.exists()
    # the RPC URL's path (where an API key lives) is never echoed
    assert uomp(home, "registry", "add", reg.spec, "--rpc", anvil.url + "/secret-api-key-123") in (0, 1)
    captured = capsys.readouterr()
    assert "secret-api-key-123" not in captured.out + captured.err


class _Garbage(BaseHTTPRequestHandler):
    answers: ClassVar[list[bytes]] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = self.answers[0] if len(self.answers) == 1 else self.answers.pop(0)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize(
    "answers",
    [
        pytest.param([b"<html>not json</html>"], id="not-json"),
        pytest.param([b"[1,2,3]"], id="not-an-object"),
        pytest.param([b'{"jsonrpc":"2.0","id":1,"result":{"x":1}}'], id="chain-id-not-a-number"),
        pytest.param(
            [b'{"jsonrpc":"2.0","id":1,"result":"0x7a69"}', b'{"jsonrpc":"2.0","id":1,"result":"0xzz"}'],
            id="code-not-hex",
        ),
        pytest.param(
            [
                b'{"jsonrpc":"2.0","id":1,"result":"0x7a69"}',
                b'{"jsonrpc":"2.0","id":1,"result":"0x6001"}',
                b'{"jsonrpc":"2.0","id":1,"result":"0x01"}',
            ],
            id="supports-interface-garbage",
        ),
    ],
)
def test_a_chain_that_answers_garbage_is_refused(
    answers: list[bytes], home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    handler = type("G", (_Garbage,), {"answers": list(answers)})
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert uomp(home, "registry", "add", f"31337:0x{'33' * 20}", "--rpc", url) == 1
        assert "error REGISTRY_UNAVAILABLE" in capsys.readouterr().err
        assert not home.registries_file.exists()
    finally:
        server.shutdown()
        server.server_close()


class _Drip(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(2000):  # one byte every 20 ms: each read is quick, the answer never ends in time
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.02)
        except OSError:
            pass


def test_a_chain_that_drips_its_answer_is_cut_at_the_rpc_timeout(
    home: Paths, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UOMP_REGISTRY_RPC_TIMEOUT_SECONDS", "0.5")
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Drip)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert uomp(home, "registry", "add", f"31337:0x{'33' * 20}", "--rpc", url) == 1
        assert "did not finish answering eth_chainId in 0.5 s" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_chain_is_refused(home: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert uomp(home, "registry", "add", f"31337:0x{'33' * 20}", "--rpc", url) == 1
    assert "error REGISTRY_UNAVAILABLE" in capsys.readouterr().err


def test_search_is_cached_and_follows_uri_updates(
    chain: tuple[Anvil, Registry], docs: DocServer, home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg = chain
    agent_id = publish(reg, docs, "Cached Agent")
    add(home, anvil, reg)
    capsys.readouterr()
    reg_path = next(p for p in docs.docs if p.startswith("/Cached-Agent") and p.endswith("registration.json"))
    assert uomp(home, "registry", "search", "cached", "--json", *fetch_flags(docs)) == 0
    assert agent_id in [r["agent_id"] for r in json.loads(capsys.readouterr().out)["results"]]
    before = docs.hits[reg_path]
    assert uomp(home, "registry", "search", "cached", "--json", *fetch_flags(docs)) == 0
    assert agent_id in [r["agent_id"] for r in json.loads(capsys.readouterr().out)["results"]]
    assert docs.hits[reg_path] == before  # served from the index, not fetched again
    # the publisher points the token at a new file: the next search reads it
    new_body = registration("Renamed Agent", agent_id, reg.id, manifest_url=docs.url("/x"))
    reg.set_uri(agent_id, docs.put("/renamed/registration.json", new_body))
    assert uomp(home, "registry", "search", "renamed", "--json", *fetch_flags(docs)) == 0
    assert agent_id in [r["agent_id"] for r in json.loads(capsys.readouterr().out)["results"]]
    assert uomp(home, "registry", "search", "cached agent", "--json", *fetch_flags(docs)) == 0
    assert agent_id not in [r["agent_id"] for r in json.loads(capsys.readouterr().out)["results"]]
    assert home.registries_file.stat().st_mode & 0o777 == 0o600


def test_search_halves_a_block_range_whose_logs_are_over_the_answer_bound(
    chain: tuple[Anvil, Registry],
    docs: DocServer,
    home: Paths,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many registrations in one log range (10,000 agents do it at 16 MiB) must not make search fail."""
    import gateway.registry.chain as chain_mod

    anvil, reg = chain
    first = publish(reg, docs, "Needle One")
    second = publish(reg, docs, "Needle Two")
    add(home, anvil, reg)
    capsys.readouterr()
    monkeypatch.setattr(chain_mod, "MAX_LOGS_ANSWER_BYTES", 2500)  # one block's two logs per answer at most
    assert uomp(home, "registry", "search", "needle", "--json", *fetch_flags(docs)) == 0
    ids = [r["agent_id"] for r in json.loads(capsys.readouterr().out)["results"]]
    assert first in ids and second in ids
    # one block whose logs alone are over the bound is still refused, not skipped
    monkeypatch.setattr(chain_mod, "MAX_LOGS_ANSWER_BYTES", 200)
    home.registry_cache_dir.joinpath(f"31337-{reg.address.lower()}.json").unlink()
    assert uomp(home, "registry", "search", "needle", *fetch_flags(docs)) == 1
    assert "error REGISTRY_UNAVAILABLE" in capsys.readouterr().err
