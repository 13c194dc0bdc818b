"""The production choice of memory store: ``[guard] store`` names one of :data:`MEMORY_STORES`, and
:func:`open_memory_store` opens it. The guard's services open their store here, and
``tests/guard/test_seams.py`` runs its contract tests over every name in the same table, so a store
added here is one the seam tests hold to the :class:`~gateway.guard.storage.MemoryStorage` contract.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.atrest import memdb
from gateway.config import GuardConfig, Paths
from gateway.errors import ErrorCode, UompError
from gateway.guard.storage import MemoryStorage
from gateway.guard.store import MemoryStore

MemoryStoreFactory = Callable[[Paths, GuardConfig], MemoryStorage]

# name (the value of ``[guard] store``) -> how to open that store under $UOMP_HOME
MEMORY_STORES: dict[str, MemoryStoreFactory] = {
    # SQLite; a SQLCipher file in a sealed home (gateway/atrest/memdb.py)
    "sqlite": lambda paths, cfg: MemoryStore(
        paths.memory_db, busy_timeout=cfg.db_busy_timeout_seconds, key=memdb.key_for(paths)
    ),
}


def open_memory_store(paths: Paths, cfg: GuardConfig) -> MemoryStorage:
    """The memory store ``cfg.store`` names, opened (created if absent). An unknown name is
    CONFIG_ERROR listing the valid ones; the store's own failures are STORE_UNAVAILABLE."""
    factory = MEMORY_STORES.get(cfg.store)
    if factory is None:
        valid = ", ".join(sorted(MEMORY_STORES))
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            f"guard.store must be one of {valid}, not {cfg.store!r}; set [guard] store in config.toml",
        )
    return factory(paths, cfg)
