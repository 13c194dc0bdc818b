"""The request path compiled with mypyc, used only when it was built from exactly these sources.

``python -m gateway.cli.native build`` (``scripts/setup.sh`` runs it) compiles :data:`MODULES` with
mypyc (mypy's compiler of type-annotated Python to C extensions) into
``<sys.prefix>/uomp-native/<digest>/`` (``UOMP_NATIVE_DIR`` elsewhere). The digest covers the bytes
of every module of the package (the compiled ones were type-checked against all of them) and the
interpreter's extension ABI. At ``import gateway``, :func:`install` looks for the build of the
sources as they are now: found, a finder serves the compiled modules; not found (never built, no C
compiler, a source edited since), everything runs as plain Python, which behaves the same, slower.

All or nothing: compiled modules call each other directly, so one stale module would run old code
inside new. ``UOMP_NATIVE=0`` turns it off (``uomp doctor`` says which one runs).

Only stdlib at import (it runs in every process at ``import gateway``): the build is found by the
sources' stamp (one ``stat`` per file, ~2 ms); their bytes are hashed only when the stamp matches no
build, and ``build`` then records the new stamp so that the next start is quick again.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

# Compiled: the HTTP server of the guard, the gateway and the dashboard; the gateway's request path
# (parse, check, forward, answer); the guard's read by key (its HTTP helpers, the agent call, the
# session cache, the policy, the auth.db worker, the audit leaf and tree). The rules they keep
# (tests/core/test_native_rules.py): no await inside an except clause, no async generator, no Python
# subclass elsewhere, no `raise ... from` (mypyc drops it: `raise caused_by(...)`). A class whose
# methods a test replaces stays out (a compiled class's methods cannot be patched).
MODULES: tuple[str, ...] = (
    "gateway.core.http1",
    "gateway.contract",
    "gateway.httpd",
    "gateway.remote.pathnorm",
    "gateway.remote.identity",
    "gateway.remote.upstream",
    "gateway.remote.guard_client",
    "gateway.remote.call",
    "gateway.remote.forward",
    "gateway.remote.transport",
    "gateway.remote.app",
    "gateway.core.canonical",
    "gateway.core.merkle",
    "gateway.core.policy",
    "gateway.core.tokencache",
    "gateway.ledger.log",
    "gateway.ledger.tree",
    "gateway.db",
    "gateway.guard.sessions",
    "gateway.guard.http",
    "gateway.guard.agent_call",
    "gateway.guard.routes.reads",
)
MANIFEST = "manifest.json"
OFF_ENV = "UOMP_NATIVE"
PACKAGE_DIR = Path(__file__).resolve().parent

# What install() found, for `uomp doctor`: "compiled (N modules)" or why plain Python runs.
status = "plain Python (not looked for yet)"


def source_path(module: str) -> Path:
    """The source file of a module of this package."""
    return PACKAGE_DIR.joinpath(*module.split(".")[1:]).with_suffix(".py")


def _sources() -> list[tuple[str, Path]]:
    """Every module of the package (relative name, path): the compiled ones were type-checked against
    all of them, so an edit to any makes a build stale."""
    out: list[tuple[str, Path]] = []

    def walk(d: Path, rel: str) -> None:
        with os.scandir(d) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        walk(Path(e.path), f"{rel}{e.name}/")
                elif e.name.endswith(".py"):
                    out.append((rel + e.name, Path(e.path)))

    walk(PACKAGE_DIR, "")
    out.sort()
    return out


def _abi() -> bytes:
    return str(sysconfig.get_config_var("EXT_SUFFIX")).encode()


def stamp() -> str:
    """Cheap (one stat per file): the sources' names, sizes and modification times."""
    h = hashlib.sha256(_abi())
    for rel, path in _sources():
        st = path.stat()
        h.update(f"\0{rel}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def digest() -> str:
    """A build's name: the sources' names and bytes, and the interpreter's extension ABI."""
    h = hashlib.sha256(_abi())
    for rel, path in _sources():
        h.update(f"\0{rel}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:32]


def root() -> Path:
    """Where builds live: beside the interpreter they were compiled for."""
    return Path(os.environ.get("UOMP_NATIVE_DIR") or Path(sys.prefix) / "uomp-native")


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the modules of one build (and its shared runtime library) from their files."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def _manifest(build: Path) -> tuple[str, dict[str, Path]] | None:
    """(stamp, module files by name) of a complete build, or None."""
    try:
        doc = json.loads((build / MANIFEST).read_text(encoding="utf-8"))
        files = {str(name): build / str(rel) for name, rel in doc["files"].items()}
        built_stamp = str(doc["stamp"])
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    if not set(MODULES) <= set(files) or not all(f.is_file() for f in files.values()):
        return None
    return built_stamp, files


def find() -> tuple[Path, dict[str, Path]] | None:
    """The build of the sources as they are now: by their stamp (a stat per file), else by their
    bytes (a checkout that touched files without changing them)."""
    base = root()
    try:
        builds = [p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return None
    now = stamp()
    for build in builds:
        found = _manifest(build)
        if found is not None and found[0] == now:
            return build, found[1]
    key = digest()
    found = _manifest(base / key)
    return None if found is None else (base / key, found[1])


def install() -> None:
    """Serve this source tree's compiled modules, if a build of exactly these sources exists."""
    global status
    if os.environ.get(OFF_ENV, "1") == "0":
        status = f"plain Python ({OFF_ENV}=0)"
        return
    if any(name in sys.modules for name in MODULES):
        status = "plain Python (imported before the compiled modules were looked for)"
        return
    try:
        hit = find()
    except OSError as exc:
        status = f"plain Python (sources unreadable: {exc.strerror})"
        return
    if hit is None:
        status = "plain Python (no build of these sources: python -m gateway.cli.native build)"
        return
    sys.meta_path.insert(0, _Finder(hit[1]))
    status = f"compiled ({len(MODULES)} modules, mypyc)"


# ----------------------------------------------------------------------------------------- build

KEEP_BUILDS = 3  # the newest builds kept (several checkouts may share one virtualenv)


def build_args() -> list[str]:
    """mypy's command line for the build, from the package's parent directory: the compiled modules,
    type-checked with this tree's config, and a package that is not installed typed as ``Any``. The
    modules are checked against the whole package, whose optional parts import the extras (keyring,
    redis, web3...); a build made with the required dependencies only must not depend on them."""
    return ["--ignore-missing-imports", *(str(source_path(m).relative_to(PACKAGE_DIR.parent)) for m in MODULES)]


def build(log: Callable[[str], None]) -> Path:
    """Compile :data:`MODULES` for the sources as they are now (nothing when that build exists);
    return its directory. Raises on any failure (no compiler, no mypy): the caller says so and the
    appliance runs as plain Python."""
    import shutil
    import tempfile
    import time

    hit = find()
    now = stamp()
    if hit is not None:
        doc = json.loads((hit[0] / MANIFEST).read_text(encoding="utf-8"))  # (find() checked it whole)
        if doc["stamp"] != now:  # found by the sources' bytes: keep their new stamp
            doc["stamp"] = now
            staged = hit[0] / (MANIFEST + ".tmp")
            staged.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
            os.replace(staged, hit[0] / MANIFEST)
        log(f"native: up to date ({hit[0]})")
        return hit[0]
    key = digest()
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    from mypyc.build import mypycify  # mypy's compiler: installed with the package's [native] extra

    distribution: Any = importlib.import_module("setuptools").Distribution  # (untyped: no stubs needed)

    started = time.monotonic()
    src_root = PACKAGE_DIR.parent
    with tempfile.TemporaryDirectory(prefix=".tmp-", dir=base) as tmp:
        work = Path(tmp)
        cwd = os.getcwd()
        os.chdir(src_root)  # mypy names the modules by their paths from here, with this tree's config
        try:
            exts = mypycify(build_args(), opt_level="3", target_dir=str(work / "c"))
            dist = distribution({"name": "uomp-native", "ext_modules": exts})
            cmd: Any = dist.get_command_obj("build_ext")
            cmd.build_lib, cmd.build_temp = str(work / "lib"), str(work / "obj")
            cmd.parallel = os.cpu_count() or 1
            dist.run_command("build_ext")
        finally:
            os.chdir(cwd)
        lib = work / "lib"
        suffix = str(sysconfig.get_config_var("EXT_SUFFIX"))
        files = {
            ".".join(p.relative_to(lib).parts)[: -len(suffix)]: str(p.relative_to(lib)) for p in lib.rglob("*" + suffix)
        }
        missing = set(MODULES) - set(files)
        if missing:
            raise RuntimeError(f"the build made no module for {', '.join(sorted(missing))}")
        doc = {"stamp": now, "digest": key, "files": files, "modules": list(MODULES)}
        (lib / MANIFEST).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        final = base / key
        if final.exists():
            shutil.rmtree(final)
        os.rename(lib, final)  # whole or absent: a manifest is written before the rename
    _prune(base, keep=final)
    log(f"native: compiled {len(MODULES)} modules in {time.monotonic() - started:.0f} s ({final})")
    return final


def _prune(base: Path, *, keep: Path) -> None:
    import shutil

    builds = sorted(
        (p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".") and p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in builds[KEEP_BUILDS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
