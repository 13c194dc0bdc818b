"""The two SQLite drivers: the standard library's ``sqlite3`` for plain files, ``sqlcipher3`` for the
encrypted ones of a sealed home (gateway/atrest/).

SQLCipher is loaded by :func:`cipher`, when a process first opens or converts an encrypted file,
never at import: the processes of a plain home (the default) do not map its library, which carries
its own SQLite and OpenSSL (~5 MiB of resident memory in each of the appliance's processes).

The exception tuples hold the classes of every driver loaded so far: the standard library's, and
SQLCipher's from the moment :func:`cipher` has loaded it. Before that no SQLCipher connection
exists, so none of its exceptions can be raised. The rule that keeps this true: match them through
this module at the time of the ``except`` (``except sqldriver.ERRORS``, ``except
sqldriver.errors(OSError)``), never through a constant built from them at import, which would miss SQLCipher's
classes. tests/atrest/test_lazy_cipher.py loads every module of the package, then SQLCipher, and
looks for such a constant.
"""

from __future__ import annotations

import importlib
import sqlite3
import threading
from typing import Any

ERRORS: tuple[type[Exception], ...] = (sqlite3.Error,)
PROGRAMMING: tuple[type[Exception], ...] = (sqlite3.ProgrammingError,)
OPERATIONAL: tuple[type[Exception], ...] = (sqlite3.OperationalError,)
INTEGRITY: tuple[type[Exception], ...] = (sqlite3.IntegrityError,)
DATABASE: tuple[type[Exception], ...] = (sqlite3.DatabaseError,)

_cipher: Any = None
_lock = threading.Lock()


def cipher() -> Any:
    """``sqlcipher3.dbapi2``, loaded on first use; its exception classes join the tuples above
    before it is returned, so that every connection it makes is matched by them."""
    global ERRORS, PROGRAMMING, OPERATIONAL, INTEGRITY, DATABASE, _cipher
    if _cipher is not None:
        return _cipher
    with _lock:
        if _cipher is None:
            mod = importlib.import_module("sqlcipher3.dbapi2")
            ERRORS = (sqlite3.Error, mod.Error)
            PROGRAMMING = (sqlite3.ProgrammingError, mod.ProgrammingError)
            OPERATIONAL = (sqlite3.OperationalError, mod.OperationalError)
            INTEGRITY = (sqlite3.IntegrityError, mod.IntegrityError)
            DATABASE = (sqlite3.DatabaseError, mod.DatabaseError)
            _cipher = mod
    return _cipher


def errors(*also: type[BaseException]) -> tuple[type[BaseException], ...]:
    """Every loaded driver's errors and ``also``, for one ``except`` clause (built when it runs)."""
    return (*ERRORS, *also)


def database_errors(*also: type[BaseException]) -> tuple[type[BaseException], ...]:
    """Every loaded driver's ``DatabaseError`` and ``also``, for one ``except`` clause."""
    return (*DATABASE, *also)


def cipher_loaded() -> bool:
    """True once this process has loaded SQLCipher."""
    return _cipher is not None
