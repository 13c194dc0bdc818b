"""§19.5 on a real anvil: an abnormal session (ended without the deletion proof its agent owed) of an
agent installed from a registry is reported once, as one feedback record in that registry's
Reputation Registry, only when the user opted in and says --yes; nothing else is reported."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from anchorkit import ANVIL, ANVIL_MISSING, Anvil
from registrykit import DocServer, Registry, keccak, registration
from shortdir import short_dir
from web3 import Web3

from gateway.cli.main import main
from gateway.config import Paths
from gateway.keys import init_home

pytestmark = pytest.mark.skipif(not ANVIL.exists(), reason=ANVIL_MISSING)

ROOT = Path(__file__).resolve().parents[2]
BASE = json.loads((ROOT / "examples" / "calendar_agent" / "uom.json").read_text())
ANVIL_KEYS = {  # anvil's well-known development accounts (mnemonic "test test … junk")
    1: "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d",
    2: "0x5de4111afa1a4b94908f83103eb1f1706367c2e68ca870fc3fb9a804cdab365a",
}


def manifest(agent_id: str, proof_required: bool) -> bytes:
    doc = json.loads(json.dumps(BASE))
    doc["agent"]["id"] = agent_id
    doc["requires_remote"] = False
    doc["data_retention_policy"]["proof_required"] = proof_required
    return json.dumps(doc).encode()


def reputation_artifact() -> dict[str, Any]:
    from importlib import resources

    data: dict[str, Any] = json.loads(
        resources.files("gateway.registry").joinpath("Erc8004ReputationRegistry.json").read_text()
    )
    return data


@pytest.fixture(scope="module")
def chain() -> Iterator[tuple[Anvil, Registry, Any]]:
    work = short_dir("uomp-rep-")
    node = Anvil(work)
    node.start()
    try:
        reg = Registry.deploy(node)
        art = reputation_artifact()
        tx = (
            reg.w3.eth.contract(abi=art["abi"], bytecode=art["bytecode"])
            .constructor(reg.address)
            .transact({"from": reg.accounts[0]})
        )
        address = reg.w3.eth.wait_for_transaction_receipt(tx)["contractAddress"]
        yield node, reg, reg.w3.eth.contract(address=address, abi=art["abi"])
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


def publish(reg: Registry, docs: DocServer, body: bytes, tag: str) -> int:
    m_url = docs.put(f"/{tag}/uom.json", body)
    agent_id = reg.register(docs.url(f"/{tag}/registration.json"))
    docs.put(
        f"/{tag}/registration.json", registration(tag, agent_id, reg.id, manifest_url=m_url, manifest_hash=keccak(body))
    )
    return agent_id


def key_file(tmp_path: Path, index: int) -> Path:
    path = tmp_path / f"feedback-{index}.key"
    path.write_text(ANVIL_KEYS[index] + "\n")
    path.chmod(0o600)
    return path


def install_and_end(
    home: Paths, docs: DocServer, reg: Registry, body: bytes, tag: str, tmp_path: Path, capsys: Any
) -> tuple[int, str]:
    agent_id = publish(reg, docs, body, tag)
    out = tmp_path / tag
    flags = ["--ca-file", str(docs.ca_file), "--allow-internal"]
    assert uomp(home, "registry", "install", str(agent_id), "--out", str(out), *flags) == 0
    capsys.readouterr()
    assert uomp(home, "authorize", str(out), "--yes", "--print") == 0
    session = re.search(r"Session (\S+) active until", capsys.readouterr().out)
    assert session is not None
    assert uomp(home, "sessions", "revoke", session.group(1)) == 0
    capsys.readouterr()
    return agent_id, session.group(1)


def test_an_abnormal_session_is_reported_once_on_opt_in(
    chain: tuple[Anvil, Registry, Any], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg, rep = chain
    reporter = Web3.to_checksum_address(reg.accounts[2])
    assert (
        uomp(
            home,
            "registry",
            "add",
            reg.spec,
            "--rpc",
            anvil.url,
            "--reputation",
            rep.address,
            "--feedback-key",
            str(key_file(tmp_path, 2)),
        )
        == 0
    )
    owed, abnormal_sid = install_and_end(home, docs, reg, manifest("owes-proof", True), "owes", tmp_path, capsys)
    fine, _ = install_and_end(home, docs, reg, manifest("no-proof-owed", False), "fine", tmp_path, capsys)
    before = rep.functions.getLastIndex(owed, reporter).call()

    # without --yes: said, not sent
    assert uomp(home, "registry", "report") == 0
    said = capsys.readouterr().out
    assert f"would report session {abnormal_sid}" in said and "no-proof-owed" not in said
    assert rep.functions.getLastIndex(owed, reporter).call() == before

    assert uomp(home, "registry", "report", "--yes") == 0
    assert f"reported session {abnormal_sid}" in capsys.readouterr().out
    index = rep.functions.getLastIndex(owed, reporter).call()
    assert index == before + 1
    value, decimals, tag1, tag2, revoked = rep.functions.readFeedback(owed, reporter, index).call()
    assert (value, decimals, tag1, tag2, revoked) == (0, 0, "uomp-deletion-proof", "missing", False)
    assert rep.functions.getLastIndex(fine, reporter).call() == 0  # the normal session: nothing
    # the transaction names the agent, never the session
    logs = rep.events.NewFeedback().get_logs(from_block=0)
    tx = reg.w3.eth.get_transaction(logs[-1]["transactionHash"])
    assert abnormal_sid.encode().hex() not in bytes(tx["input"]).hex()

    # once only
    assert uomp(home, "registry", "report", "--yes") == 0
    assert "no abnormal session to report" in capsys.readouterr().out
    assert rep.functions.getLastIndex(owed, reporter).call() == index


def test_no_opt_in_no_report_and_self_feedback_is_refused(
    chain: tuple[Anvil, Registry, Any], docs: DocServer, home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anvil, reg, rep = chain
    assert uomp(home, "registry", "add", reg.spec, "--rpc", anvil.url) == 0
    owed, _ = install_and_end(home, docs, reg, manifest("owes-again", True), "again", tmp_path, capsys)
    assert uomp(home, "registry", "report", "--yes") == 0
    assert "has no Reputation Registry configured" in capsys.readouterr().out
    assert rep.functions.getClients(owed).call() == []
    # opting in with the agent owner's own account: the registry refuses self-feedback, nothing recorded
    assert (
        uomp(
            home,
            "registry",
            "add",
            reg.spec,
            "--rpc",
            anvil.url,
            "--reputation",
            rep.address,
            "--feedback-key",
            str(key_file(tmp_path, 1)),
        )
        == 0
    )
    assert uomp(home, "registry", "report", "--yes") == 1
    assert "error REGISTRY_UNAVAILABLE" in capsys.readouterr().err
    assert rep.functions.getClients(owed).call() == []
    assert not home.registry_reports.exists()
    # half an opt-in is refused
    assert uomp(home, "registry", "add", reg.spec, "--rpc", anvil.url, "--reputation", rep.address) == 1
    assert "go together" in capsys.readouterr().err
