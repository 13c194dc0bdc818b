"""SQLCipher is loaded only where an encrypted file is opened (gateway/sqldriver.py): importing the
whole package loads none of it, and once it is loaded, every module-level tuple of SQLite exception
classes also names SQLCipher's, so an ``except`` written against the tuples of gateway.sqldriver
catches a sealed home's errors too. A constant copied from those tuples at import (which would miss
SQLCipher's classes) is found by the scan. Which processes of a running appliance load it:
tests/cli/test_command_weight.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gateway import sqldriver

# In a fresh interpreter: import every module of the package, say whether sqlcipher3 came with them,
# load it through sqldriver, then list each module-level (or class-level) tuple that names one of
# sqlite3's exception classes without its sqlcipher3 counterpart.
SCAN = r"""
import importlib, json, pkgutil, sqlite3, sys
import gateway
for info in pkgutil.walk_packages(gateway.__path__, "gateway."):
    if info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
before = "sqlcipher3" in sys.modules or any(m.startswith("sqlcipher3.") for m in sys.modules)
from gateway import sqldriver
exec(sys.argv[1])  # a test's own module, imported like the package's
mod = sqldriver.cipher()
pairs = {getattr(sqlite3, n): getattr(mod, n) for n in dir(sqlite3)
         if isinstance(getattr(sqlite3, n), type) and issubclass(getattr(sqlite3, n), Exception)}

def stale(value):
    if not isinstance(value, tuple):
        return False
    return any(isinstance(c, type) and c in pairs and pairs[c] not in value for c in value)

found = []
for name, m in list(sys.modules.items()):
    if not (name == "gateway" or name.startswith("gateway.")):
        continue
    for attr, value in list(vars(m).items()):
        if stale(value):
            found.append(f"{name}.{attr}")
        if isinstance(value, type) and value.__module__ == name:
            found.extend(f"{name}.{attr}.{a}" for a, v in vars(value).items() if stale(v))
errors = [c.__module__ for c in sqldriver.ERRORS]
print(json.dumps({"loaded_by_imports": before, "stale": sorted(found), "errors": errors}))
"""


def scan(extra: str = "") -> dict[str, object]:
    res = subprocess.run([sys.executable, "-c", SCAN, extra], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def test_importing_the_package_loads_no_sqlcipher_and_no_module_keeps_a_stale_error_tuple() -> None:
    out = scan()
    assert out["loaded_by_imports"] is False
    assert out["stale"] == []
    # the partner: the tuples themselves did take SQLCipher's classes at its load
    assert out["errors"] == ["sqlite3", "sqlcipher3.dbapi2"]


# A module of the package that copies the tuples at import, as a constant and as a class attribute.
COPIER = """
import types
m = types.ModuleType("gateway._copier")
exec(
    "from gateway import sqldriver\\n"
    "COPIED = (*sqldriver.ERRORS, OSError)\\n"
    "class Store:\\n    FAILURES = sqldriver.OPERATIONAL\\n",
    m.__dict__,
)
sys.modules[m.__name__] = m
"""


def test_the_scan_finds_a_copied_tuple() -> None:
    """The partner of the scan: a module that copies a tuple at import is listed."""
    out = scan(COPIER)
    assert out["stale"] == ["gateway._copier.COPIED", "gateway._copier.Store.FAILURES"]


def test_an_except_on_the_tuples_catches_a_sealed_files_error(tmp_path: Path) -> None:
    """In this process (where SQLCipher may already be loaded by other tests, or not): open a file
    that is not a database with SQLCipher, and the tuples, read at the except, catch it."""
    from gateway.atrest import memdb

    bogus = tmp_path / "not-a-db"
    bogus.write_bytes(b"\x01" * 8192)
    caught = None
    try:
        conn = memdb.connect(str(bogus), b"\x00" * 32)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqldriver.DATABASE as exc:
        caught = exc
    assert caught is not None and type(caught).__module__ == "sqlcipher3.dbapi2"
    assert memdb.is_not_a_database(caught)
    assert sqldriver.cipher_loaded()
