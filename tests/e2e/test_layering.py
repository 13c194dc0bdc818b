"""Layering rules that are not import rules, and the import contracts' presence.

The import contracts themselves (gateway.core without I/O, remote without guard, the SDK without
either server) are checked by ``lint-imports`` in scripts/test.sh; here: they stay declared, and only
gateway/cli prints (library code logs; a process's stdout/stderr belong to the command line).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "gateway"

# Library modules allowed to write to the terminal, each with its reason. A row that no longer
# matches anything fails the test (delete it then).
PRINT_EXCEPTIONS: dict[str, str] = {}


def terminal_writes(source: str) -> list[int]:
    """Line numbers of ``print(...)`` calls and of ``sys.stdout`` / ``sys.stderr`` uses in ``source``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in ("stdout", "stderr")
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module == "sys"
            and any(a.name in ("stdout", "stderr") for a in node.names)
        ):
            lines.append(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("print('x')\n", [1]),
        ("import sys\nsys.stderr.write('x')\n", [2]),
        ("import sys\nprint('x', file=sys.stderr)\n", [2, 2]),
        ("from sys import stdout\n", [1]),
        ("def f():\n    return print\n", []),  # a reference, not a call
        ("log.info('print(x)')  # print(y)\n", []),  # strings and comments
        ("obj.print('x')\n", []),  # somebody's method
        ("import sys\nsys.exit(1)\n", []),
    ],
    ids=[
        "print",
        "sys-stderr",
        "print-to-stderr",
        "from-sys-import",
        "reference",
        "string-comment",
        "method",
        "other-sys",
    ],
)
def test_scanner_finds_terminal_writes(source: str, found: list[int]) -> None:
    assert terminal_writes(source) == found


def test_only_the_cli_prints() -> None:
    offenders: dict[str, list[int]] = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("gateway/cli/"):
            continue
        lines = terminal_writes(path.read_text(encoding="utf-8"))
        if lines:
            offenders[rel] = lines
    unexplained = {k: v for k, v in offenders.items() if k not in PRINT_EXCEPTIONS}
    assert not unexplained, f"library code writes to the terminal (log, or move it to gateway/cli): {unexplained}"
    stale = sorted(set(PRINT_EXCEPTIONS) - set(offenders))
    assert not stale, f"PRINT_EXCEPTIONS rows no longer needed, delete them: {stale}"


def test_the_cli_does_print() -> None:
    """The partner case: the scan does reach gateway/cli, where printing is the job."""
    assert any(terminal_writes(p.read_text(encoding="utf-8")) for p in (GATEWAY / "cli").glob("*.py"))


def test_import_contracts_stay_declared() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    assert cfg["root_package"] == "gateway" and cfg["include_external_packages"] is True
    contracts = {c["id"]: c for c in cfg["contracts"]}
    for c in contracts.values():
        assert c["type"] in ("forbidden", "layers", "independence"), c["id"]
        assert not c.get("allow_indirect_imports", False), c["id"]
        assert not c.get("ignore_imports"), c["id"]
    assert set(contracts["core-pure"]["forbidden_modules"]) >= {
        "aiohttp",
        "sqlite3",
        "socket",
        "asyncio",
        "ssl",
        "subprocess",
    }
    assert contracts["core-pure"]["source_modules"] == ["gateway.core"]
    assert contracts["remote-fronts-any-guard"]["source_modules"] == ["gateway.remote"]
    assert contracts["remote-fronts-any-guard"]["forbidden_modules"] == ["gateway.guard"]
    assert contracts["client-without-server"]["source_modules"] == ["gateway.client"]
    assert set(contracts["client-without-server"]["forbidden_modules"]) == {"gateway.remote", "gateway.guard"}
    lint = (ROOT / "scripts" / "lint.sh").read_text(encoding="utf-8")
    assert "lint-imports" in lint
    assert "scripts/lint.sh" in (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")


DATA_DIRS = {"home", "secrets", "ca_dir", "gateway_dir"}  # Paths attributes whose files Paths names


def home_joins(source: str) -> list[int]:
    """Lines joining a data directory of Paths with a literal name (``paths.home / "x.db"``)."""
    return sorted(
        n.lineno
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.BinOp)
        and isinstance(n.op, ast.Div)
        and isinstance(n.left, ast.Attribute)
        and n.left.attr in DATA_DIRS
        and isinstance(n.right, ast.Constant | ast.JoinedStr)
    )


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('p = paths.gateway_dir / "quota.db"\n', [1]),
        ('p = self.paths.home / f"{name}.json"\n', [1]),
        ("p = paths.quota_db\n", []),
        ('p = out / "agent.crt"\n', []),  # an output directory the user chose, not $UOMP_HOME
    ],
    ids=["literal", "f-string", "property", "elsewhere"],
)
def test_scanner_finds_home_joins(source: str, found: list[int]) -> None:
    assert home_joins(source) == found


def test_files_under_home_are_named_in_paths_only() -> None:
    offenders = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "gateway/config.py":
            continue
        lines = home_joins(path.read_text(encoding="utf-8"))
        if lines:
            offenders[rel] = lines
    assert not offenders, f"name the file once, as a property of gateway.config.Paths: {offenders}"
