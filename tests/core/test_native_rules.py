"""What the modules compiled by mypyc (gateway/native.py MODULES) must not do, checked on their
source so that a change breaks the build here and not at run time:

* no ``await`` (nor ``async for`` / ``async with``) inside an ``except`` clause: a compiled
  coroutine that suspends there leaves the caught exception "being handled" on the loop's thread,
  where it becomes the context of unrelated exceptions and keeps their objects alive;
* no async generator (mypyc compiles none);
* no class elsewhere in the package that subclasses one of their classes (a Python class cannot
  inherit a compiled one), unless that class is marked ``native_class=False``."""

from __future__ import annotations

import ast
from pathlib import Path

from gateway import native

ROOT = native.PACKAGE_DIR


def _tree(module: str) -> ast.Module:
    return ast.parse(native.source_path(module).read_text(encoding="utf-8"))


def _awaits_inside_except(tree: ast.AST) -> list[int]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
                    found.append(sub.lineno)
    return found


def _async_generators(tree: ast.AST) -> list[int]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncFunctionDef) and any(
            isinstance(sub, (ast.Yield, ast.YieldFrom)) for sub in ast.walk(node)
        ):
            found.append(node.lineno)
    return found


def test_no_compiled_module_awaits_inside_an_except_clause_or_yields_from_a_coroutine() -> None:
    problems = {}
    for module in native.MODULES:
        tree = _tree(module)
        awaits, gens = _awaits_inside_except(tree), _async_generators(tree)
        if awaits or gens:
            problems[module] = {"await inside except": awaits, "async generator": gens}
    assert not problems, problems


def test_the_rules_catch_what_they_name() -> None:
    """Partners: each check finds its case in a small source, and passes its fixed form."""
    leaky = "async def f():\n    try:\n        pass\n    except ValueError:\n        await g()\n"
    fixed = (
        "async def f():\n    failed = False\n    try:\n        pass\n    except ValueError:\n"
        "        failed = True\n    if failed:\n        await g()\n"
    )
    assert _awaits_inside_except(ast.parse(leaky)) == [5]
    assert _awaits_inside_except(ast.parse(fixed)) == []
    gen = "async def f():\n    yield 1\n"
    assert _async_generators(ast.parse(gen)) == [1]
    assert _async_generators(ast.parse("async def f():\n    return 1\n")) == []


def _python_classes() -> dict[str, set[str]]:
    """Class names defined in each compiled module, without those kept as Python classes."""
    out: dict[str, set[str]] = {}
    for module in native.MODULES:
        names = set()
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.ClassDef):
                kept_python = any("native_class=False" in ast.unparse(d) for d in node.decorator_list)
                if not kept_python:
                    names.add(node.name)
        out[module] = names
    return out


def test_nothing_in_the_package_subclasses_a_compiled_class() -> None:
    compiled = _python_classes()
    short = {m.rsplit(".", 1)[1]: m for m in native.MODULES}
    problems = []
    for path in sorted(Path(ROOT).rglob("*.py")):
        rel = ".".join(("gateway", *path.relative_to(ROOT).with_suffix("").parts))
        if rel in native.MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                text = ast.unparse(base)
                head, _, name = text.rpartition(".")
                module = short.get(head.rsplit(".", 1)[-1]) if head else None
                if module is not None and name in compiled[module]:
                    problems.append(f"{rel}.{node.name}({text})")
    assert not problems, problems
