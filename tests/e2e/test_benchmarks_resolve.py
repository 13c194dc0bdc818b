"""The benchmarks call the product's own helpers; none is run by the suite (they take minutes), so a
renamed or removed helper would break a script silently. Every name a script takes from ``gateway``
(``from gateway.x import y``, and ``x.y`` on a module imported from ``gateway``) must exist."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


def _references(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(module, attribute, line) for each name the script takes from a gateway module."""
    modules: dict[str, str] = {}  # local name -> gateway module
    refs: list[tuple[str, str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gateway":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                try:
                    importlib.import_module(full)
                except ImportError:
                    refs.append((node.module, alias.name, node.lineno))
                else:
                    modules[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gateway" and alias.asname:
                    modules[alias.asname] = alias.name
    # a name the script also binds otherwise (a variable, an argument) is not the module everywhere
    rebound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    rebound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    for name in rebound:
        modules.pop(name, None)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            refs.append((modules[node.value.id], node.attr, node.lineno))
    return refs


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_every_name_a_benchmark_takes_from_the_product_exists(script: Path) -> None:
    missing = [
        f"{script.name}:{line}: {module}.{attr}"
        for module, attr, line in _references(ast.parse(script.read_text()))
        if not hasattr(importlib.import_module(module), attr)
    ]
    assert not missing, missing


def test_the_check_sees_a_missing_name() -> None:
    tree = ast.parse("from gateway.core import ca\nca.no_such_helper('x')\nfrom gateway.contract import NO_SUCH\n")
    found = {(m, a) for m, a, _ in _references(tree)}
    assert ("gateway.core.ca", "no_such_helper") in found and ("gateway.contract", "NO_SUCH") in found
    assert not hasattr(importlib.import_module("gateway.core.ca"), "no_such_helper")
