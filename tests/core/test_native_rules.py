"""What the modules compiled by mypyc (gateway/native.py MODULES) must not do, checked on their
source so that a change breaks the build here and not at run time:

* no ``await`` (nor ``async for`` / ``async with``) inside an ``except`` clause: a compiled
  coroutine that suspends there leaves the caught exception "being handled" on the loop's thread,
  where it becomes the context of unrelated exceptions and keeps their objects alive;
* no async generator (mypyc compiles none);
* no class elsewhere in the package that subclasses one of their classes (a Python class cannot
  inherit a compiled one), unless that class is marked ``native_class=False``;
* no ``raise ... from ...`` (mypyc drops the clause: the cause is lost, and a hidden context shows):
  a new exception raised while handling another is ``raise caused_by(err, exc_or_None)``, ruff's
  B904 being off for exactly these files (pyproject.toml)."""

from __future__ import annotations

import ast
import re
import tomllib
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


def _subclasses_of_compiled(source: str, compiled: dict[str, set[str]]) -> list[str]:
    """``Class(base)`` of ``source`` whose base is a class of a compiled module, named through its
    module (``httpd.Server``) or imported by name (``from gateway.httpd import Server``, aliased too)."""
    short = {m.rsplit(".", 1)[1]: m for m in compiled}
    tree = ast.parse(source)
    by_name = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in compiled
        for alias in node.names
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for base in node.bases:
            text = ast.unparse(base)
            head, _, name = text.rpartition(".")
            if head:
                module = short.get(head.rsplit(".", 1)[-1])
            else:
                module, name = by_name.get(text, (None, text))
            if module is not None and name in compiled[module]:
                found.append(f"{node.name}({text})")
    return found


def test_nothing_in_the_package_subclasses_a_compiled_class() -> None:
    compiled = _python_classes()
    problems = []
    for path in sorted(Path(ROOT).rglob("*.py")):
        rel = ".".join(("gateway", *path.relative_to(ROOT).with_suffix("").parts))
        if rel not in native.MODULES:
            problems += [f"{rel}.{c}" for c in _subclasses_of_compiled(path.read_text(encoding="utf-8"), compiled)]
    assert not problems, problems


def test_the_subclass_rule_sees_each_way_of_naming_a_base() -> None:
    compiled = {"gateway.httpd": {"Server", "Request"}, "gateway.db": {"DbWorker"}}
    source = (
        "from gateway import httpd\nfrom gateway.db import DbWorker\nfrom gateway.httpd import Server as S\n"
        "class A(httpd.Server): pass\nclass B(DbWorker): pass\nclass C(S): pass\n"
        "class D(httpd.Other): pass\nclass E(Exception): pass\nclass F(Server): pass\n"  # partners
    )
    assert _subclasses_of_compiled(source, compiled) == ["A(httpd.Server)", "B(DbWorker)", "C(S)"]


def _walk_here(node: ast.AST) -> list[ast.AST]:
    """``node`` and what it holds, without the bodies of functions defined in it (they run later)."""
    out = [node]
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out += _walk_here(child)
    return out


def _raise_problems(tree: ast.AST) -> list[int]:
    """Lines of ``raise X from Y``, and of a new exception raised inside an ``except`` clause other
    than through ``caused_by(...)`` (a bare ``raise`` and re-raising the caught name are fine)."""
    found = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.cause is not None}
    for handler in ast.walk(tree):
        if not isinstance(handler, ast.ExceptHandler):
            continue
        for n in _walk_here(handler):
            if not isinstance(n, ast.Raise) or n.exc is None:
                continue
            if isinstance(n.exc, ast.Name) and n.exc.id == handler.name:
                continue
            if isinstance(n.exc, ast.Call) and ast.unparse(n.exc.func) == "caused_by":
                continue
            found.add(n.lineno)
    return sorted(found)


def test_no_compiled_module_raises_from() -> None:
    problems = {m: lines for m in native.MODULES if (lines := _raise_problems(_tree(m)))}
    assert not problems, problems


def test_the_raise_rule_catches_what_it_names() -> None:
    bad = (
        "try:\n    f()\nexcept E as exc:\n    raise X() from exc\n"
        "try:\n    f()\nexcept E:\n    raise X() from None\n"
        "try:\n    f()\nexcept E:\n    raise X()\n"
    )
    assert _raise_problems(ast.parse(bad)) == [4, 8, 12]
    good = (
        "try:\n    f()\nexcept E as exc:\n    raise caused_by(X(), exc)\n"
        "try:\n    f()\nexcept E as exc:\n    raise exc\n"
        "try:\n    f()\nexcept E:\n    raise\n"
        "try:\n    f()\nexcept E:\n    def later():\n        raise X()\n"
        "raise X()\n"
    )
    assert _raise_problems(ast.parse(good)) == []


def _expand(pattern: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in _expand(pattern[: m.start()] + alt + pattern[m.end() :])]


def test_ruff_leaves_b904_to_this_file_for_exactly_the_compiled_modules() -> None:
    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text(encoding="utf-8"))
    ignores = config["tool"]["ruff"]["lint"]["per-file-ignores"]
    off = {path for pattern, codes in ignores.items() if "B904" in codes for path in _expand(pattern)}
    compiled = {str(native.source_path(m).relative_to(ROOT.parent)) for m in native.MODULES}
    assert off == compiled
