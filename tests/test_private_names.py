"""No module of gateway/ uses another module's private names: neither ``from gateway.x import _y``
nor ``x._y`` on an imported module. A name another module needs is public (no leading underscore)
and documented where it is defined; dunder names (``__version__``) are not private."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gateway"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_uses(root: Path = ROOT) -> list[str]:
    """Every use of another module's private name in ``root/gateway``, as ``file:line: what``."""
    found: list[str] = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        here = _module_of(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        modules: dict[str, str] = {}  # local name -> the gateway module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == PACKAGE:
                        if alias.asname:
                            modules[alias.asname] = alias.name
                        else:
                            modules.setdefault(PACKAGE, PACKAGE)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, here, path.name == "__init__.py")
                if source.split(".")[0] != PACKAGE or source == here:
                    continue
                for alias in node.names:
                    if _is_private(alias.name):
                        found.append(f"{path.relative_to(root)}:{node.lineno}: from {source} import {alias.name}")
                    elif _is_module(f"{source}.{alias.name}", root):
                        modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                chain: list[str] = [node.attr]
                value = node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in modules:
                    target = ".".join([modules[value.id], *reversed(chain[1:])])
                    if target != here and _is_module(target, root):
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {target}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    uses = private_uses()
    assert uses == [], "make the name public where it is defined:\n" + "\n".join(uses)


def test_the_check_sees_both_forms(tmp_path: Path) -> None:
    # the denied partners: each form of private reach is found; public names and a module's own are not
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("_hidden = 1\nshown = 2\n__version__ = '1'\nx = _hidden\n")
    (pkg / "b.py").write_text(
        "from gateway.sub.a import _hidden, shown, __version__\n"
        "from gateway.sub import a\n"
        "import gateway.sub.a as aa\n"
        "from .sub.a import _hidden as h2\n"
        "y = a._hidden + aa._hidden + a.shown\n"
        "class C:\n    _own = 1\n    def f(self) -> int:\n        return self._own\n"
    )
    assert private_uses(tmp_path) == [
        "gateway/b.py:1: from gateway.sub.a import _hidden",
        "gateway/b.py:4: from gateway.sub.a import _hidden",
        "gateway/b.py:5: gateway.sub.a._hidden",
        "gateway/b.py:5: gateway.sub.a._hidden",
    ]
