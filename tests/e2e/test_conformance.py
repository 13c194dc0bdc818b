"""Our guard and gateway pass the black-box conformance suite (gateway/conformance/).

The real appliance runs (guard on its Unix socket and loopback TCP listener, gateway with TLS 1.3
mutual TLS); the suite reaches it over HTTP(S) only, through the `uomp conformance run` CLI, and
must report zero failures. Skips are printed (pytest -s) and must each carry a reason.
"""

from __future__ import annotations

import ast
import asyncio
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from gatewaykit import appliance
from guardkit import guard_config, running_guard

from gateway import keys
from gateway.cli.main import main
from gateway.config import Paths
from gateway.conformance import report, suite
from gateway.guard.importer import import_file
from gateway.guard.store import MemoryStore
from gateway.payloads import userkey

PACKAGE = Path(suite.__file__).parent


def _load_fixture(paths: Paths) -> None:
    store = MemoryStore(paths.memory_db)
    try:
        import_file(store, suite.FIXTURE, replace=True)
    finally:
        store.close()


def _admin_file(paths: Paths) -> Path:
    f = paths.home / "conformance-admin"
    f.write_text(keys.load_admin(paths))
    f.chmod(0o600)
    return f


def _check(out: Path, mode: str) -> dict[str, object]:
    data = json.loads((out / "r.json").read_text())
    results = [report.Result(**c) for c in data["cases"]]
    failed = [f"{r.id} ({r.section}): {r.reason}" for r in results if r.verdict == "fail"]
    assert not failed, "\n".join(failed)
    skipped = [r for r in results if r.verdict == "skip"]
    assert all(r.reason for r in skipped)
    print(f"\n{mode}: {data['counts']} by section {data['by_section']}")
    for r in skipped:
        print(f"  skip {r.id}: {r.reason}")
    junit = ET.parse(out / "r.xml").getroot()
    assert junit.get("tests") == str(len(results)) and junit.get("failures") == "0"
    assert "cases:" in (out / "r.txt").read_text()
    assert {r.id for r in results} == {c.id for c in suite.selected(mode)}
    return dict(data["counts"])


async def test_guard_passes_conformance(home: Paths, tmp_path: Path) -> None:
    async with running_guard(home, guard_config()) as g:
        _load_fixture(home)
        rc = await asyncio.to_thread(
            main,
            [
                "conformance",
                "run",
                "--target",
                f"http://127.0.0.1:{g.tcp_port}",
                "--mode",
                "guard",
                "--admin-token-file",
                str(_admin_file(home)),
                "--report",
                str(tmp_path / "r.txt"),
                "--junit",
                str(tmp_path / "r.xml"),
                "--json",
                str(tmp_path / "r.json"),
            ],
        )
    counts = _check(tmp_path, "guard")
    assert rc == 0
    assert counts["skip"] == 0  # with the admin credential, every guard-mode case can be set up


async def test_gateway_passes_conformance(home: Paths, tmp_path: Path) -> None:
    async with appliance(home) as app:
        _load_fixture(home)
        agent = app.agent("conformance_agent")
        rc = await asyncio.to_thread(
            main,
            [
                "conformance",
                "run",
                "--target",
                app.base,
                "--mode",
                "gateway",
                "--admin-url",
                f"unix:{home.guard_sock}",
                "--admin-token-file",
                str(_admin_file(home)),
                "--ca",
                str(agent.files.ca_file),
                "--cert",
                str(agent.files.cert_file),
                "--key",
                str(agent.files.key_file),
                "--agent-id",
                "conformance_agent",
                "--payload-public-key",
                userkey.public_b64(home),
                "--report",
                str(tmp_path / "r.txt"),
                "--junit",
                str(tmp_path / "r.xml"),
                "--json",
                str(tmp_path / "r.json"),
            ],
        )
    counts = _check(tmp_path, "gateway")
    assert rc == 0
    assert counts["skip"] == 0


async def test_missing_setup_pieces_skip_with_reason_never_pass(home: Paths, tmp_path: Path) -> None:
    """Without the admin credential or a token nothing that needs one can pass: skipped, with why."""
    async with running_guard(home, guard_config()) as g:
        results = await suite.run(suite.Target(url=f"http://127.0.0.1:{g.tcp_port}", mode="guard"))
    by_id = {r.id: r for r in results}
    for cid in ("TOK-01", "TOK-06", "POL-01", "AGG-01", "EXI-01"):
        assert by_id[cid].verdict == "skip" and "admin credential" in by_id[cid].reason
    # what needs no setup still runs and passes
    assert by_id["ERR-01"].verdict == "pass" and by_id["ERR-02"].verdict == "pass"


async def test_gateway_mode_without_certificates_skips(home: Paths) -> None:
    results = await suite.run(suite.Target(url="https://127.0.0.1:9", mode="gateway"))
    assert results and all(r.verdict == "skip" and "--ca" in r.reason for r in results), results


async def test_a_broken_target_fails_cases(home: Paths, tmp_path: Path) -> None:
    """The suite is not a rubber stamp: a guard that answers every read 200 fails the token cases."""
    from aiohttp import web

    async def yes(request: web.Request) -> web.Response:
        return web.json_response({"key": "conf.pref.theme", "value": "dark", "items": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", yes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        tok = "eyJhbGciOiJFUzI1NiJ9.eyJzZXNzaW9uX2lkIjoicyJ9.c2ln"
        results = await suite.run(suite.Target(url=f"http://127.0.0.1:{port}", mode="guard", token=tok))
    finally:
        await runner.cleanup()
    by_id = {r.id: r for r in results}
    for cid in ("ERR-01", "ERR-02", "TOK-01", "TOK-03", "EXI-01"):
        assert by_id[cid].verdict == "fail", (cid, by_id[cid])


def test_suite_is_black_box() -> None:
    """The suite must not import the guard or the gateway it judges."""
    for f in [*PACKAGE.glob("*.py"), PACKAGE.parent / "cli" / "conformance.py"]:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for n in names:
                assert not n.startswith(("gateway.guard", "gateway.remote")), (f.name, n)


@pytest.mark.parametrize("mode", ["guard", "gateway"])
def test_case_ids_unique_and_sections_named(mode: str) -> None:
    cases = suite.selected(mode)
    assert len({c.id for c in cases}) == len(cases)
    assert all(c.section.startswith("§") and c.expectation for c in cases)
