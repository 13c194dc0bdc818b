"""A command line imports only what its command needs: ``uomp --help`` none of the heavy libraries,
a one-shot command none of the other commands' (each run in a fresh interpreter, its
``sys.modules`` read at exit); the command table in gateway/cli/main.py says what the modules
register; the commands that run the init hooks still run every module's."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main as cli_main
from gateway.config import Paths

# Libraries no quick command needs (the server, the crypto stack, the chains, the templates).
HEAVY = ("aiohttp", "web3", "starknet_py", "jinja2", "uvloop", "gateway.conformance", "gateway.remote")
HEAVY_FOR_HELP = (*HEAVY, "cryptography", "asyncio", "sqlite3", "gateway.guard", "gateway.ledger")

PROBE = """
import json, sys
from gateway.cli.main import main
rc = None
try:
    rc = main(json.loads(sys.argv[1]))
except SystemExit as exc:
    rc = exc.code
sys.stderr.flush()
with open(sys.argv[2], "w") as f:
    json.dump({"rc": rc, "modules": sorted(sys.modules)}, f)
"""


def run_cli(tmp_path: Path, *argv: str) -> tuple[object, set[str], str]:
    """The command in a fresh interpreter: its exit code, the modules it had loaded, its stdout."""
    out = tmp_path / f"modules-{len(list(tmp_path.iterdir()))}.json"
    env = {k: v for k, v in os.environ.items() if k != "UOMP_HOME"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(argv)), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    data = json.loads(out.read_text())
    return data["rc"], set(data["modules"]), proc.stdout


def loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if n in modules or any(m.startswith(n + ".") for m in modules))


def test_help_imports_no_heavy_module_and_lists_every_command(tmp_path: Path) -> None:
    rc, modules, out = run_cli(tmp_path, "--help")
    assert rc == 0
    assert loaded(modules, HEAVY_FOR_HELP) == []
    assert not [m for m in cli_main.COMMAND_MODULES if m in modules]
    for name, (_module, text) in cli_main.COMMANDS.items():
        assert name in out
        assert text.split()[0] in out
    # the bare command is the same short help (exit 2: no command given)
    rc, modules, out = run_cli(tmp_path, "--home", str(tmp_path / "h"))
    assert rc == 2 and "COMMAND" in out and loaded(modules, HEAVY_FOR_HELP) == []


@pytest.mark.parametrize(
    ("argv", "own"),
    [
        (["status", "--help"], "gateway.cli.status"),
        (["memory", "show", "k"], "gateway.cli.memory"),
        (["sessions", "list"], "gateway.cli.guard"),
    ],
)
def test_a_command_imports_its_own_module_only(tmp_path: Path, argv: list[str], own: str) -> None:
    home = tmp_path / "h"
    rc, modules, _out = run_cli(tmp_path, "--home", str(home), *argv)
    assert rc in (0, 1)  # (not initialised: refused with NOT_INITIALISED, which is exit 1)
    assert own in modules
    assert loaded(modules, HEAVY) == []
    # a module another command needs is not loaded, unless this command's module imports it itself
    others = [m for m in cli_main.COMMAND_MODULES if m in modules and m != own]
    assert "gateway.cli.conformance" not in others and "gateway.cli.dashboard" not in others


def test_the_command_table_says_what_the_modules_register() -> None:
    registered: dict[str, tuple[str, str]] = {}
    for module in cli_main.COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        for action in sub._choices_actions:
            registered[action.dest] = (module, str(action.help))
    assert registered == cli_main.COMMANDS
    assert list(registered) == list(cli_main.COMMANDS)  # the help lists them in registration order


def test_command_word_skips_global_options() -> None:
    word = cli_main.command_word
    assert word(["--home", "memory", "status"]) == "status"  # --home takes a value, even a command's name
    assert word(["-v", "--home=/x", "memory", "show"]) == "memory"
    assert word(["--help"]) is None and word([]) is None and word(["--", "status"]) is None
    assert cli_main.modules_for(["status"]) == ("gateway.cli.status",)
    assert cli_main.modules_for(["init"]) == ("gateway.cli.home", *cli_main.INIT_HOOK_MODULES)
    assert cli_main.modules_for(["gateway", "start"]) == ("gateway.cli.gateway", *cli_main.INIT_HOOK_MODULES)
    assert cli_main.modules_for(["statsu"]) == cli_main.COMMAND_MODULES  # a misspelling: every name to suggest from
    assert cli_main.modules_for(["--version"]) == ()


def test_the_init_hook_modules_are_every_module_with_an_init_step() -> None:
    """A module that appends to INIT_HOOKS must be in INIT_HOOK_MODULES, or `uomp init` and
    `uomp gateway start` would skip its step; and no module is listed that has none."""
    cli_dir = Path(cli_main.__file__).parent
    with_hooks = {f"gateway.cli.{p.stem}" for p in cli_dir.glob("*.py") if "INIT_HOOKS.append(" in p.read_text()}
    assert with_hooks and set(cli_main.INIT_HOOK_MODULES) == with_hooks


def test_init_still_runs_every_modules_init_step(tmp_path: Path) -> None:
    home = tmp_path / "h"
    rc, modules, _out = run_cli(tmp_path, "--home", str(home), "init")
    assert rc == 0
    assert all(m in modules for m in cli_main.INIT_HOOK_MODULES)
    assert "gateway.cli.conformance" not in modules and "gateway.conformance" not in modules
    paths = Paths(home)
    assert paths.memory_db.exists()  # the memory store's step
    assert any((home / "ca").iterdir())  # the CA's step


def test_a_misspelt_command_is_still_refused_with_a_suggestion(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli.main", "--home", str(tmp_path / "h"), "statsu"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "did you mean 'status'" in proc.stderr
