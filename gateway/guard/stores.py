"""The production choice of memory store: ``[guard] store`` names one of :data:`MEMORY_STORES`, and
:func:`open_memory_store` opens it. The guard's services open their store here, and
``tests/guard/test_seams.py`` runs its contract tests over every name in the same table, so a store
added here is one the seam tests hold to the :class:`~gateway.guard.storage.MemoryStorage` contract.
The user's tools (``uomp memory``, ``uomp proposals``, ``uomp export``/``import``, the dashboard)
open the SQLite store directly with :func:`open_user_store`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from gateway.atrest import itemseal, memdb, writers
from gateway.config import GuardConfig, Paths, load_section
from gateway.errors import ErrorCode, UompError
from gateway.guard.history import set_retention
from gateway.guard.storage import MemoryStorage
from gateway.guard.store import MemoryStore

MemoryStoreFactory = Callable[[Paths, GuardConfig], MemoryStorage]

# name (the value of ``[guard] store``) -> how to open that store under $UOMP_HOME
MEMORY_STORES: dict[str, MemoryStoreFactory] = {
    # SQLite; a SQLCipher file in a sealed home (gateway/atrest/memdb.py)
    "sqlite": lambda paths, cfg: MemoryStore(
        paths.memory_db,
        busy_timeout=cfg.db_busy_timeout_seconds,
        key=memdb.key_for(paths),
        sealer=itemseal.sealer_for(paths),
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


class UserStore(MemoryStore):
    """The memory store as a user's tool opened it: it holds the home's writers' lock
    (:func:`gateway.atrest.writers.writing`) from before its file was opened until it is closed, so
    a ``uomp secrets seal`` never rewrites the file under it."""

    def __init__(self, paths: Paths, hold: contextlib.ExitStack) -> None:
        self.writers_hold = hold
        super().__init__(paths.memory_db, create=True, key=memdb.key_for(paths), sealer=itemseal.sealer_for(paths))

    def close(self) -> None:
        """Close the store, then let go of the writers' lock."""
        try:
            super().close()
        finally:
            self.writers_hold.close()


def open_user_store(paths: Paths, cfg: GuardConfig | None = None) -> MemoryStore:
    """``memory.db`` as the user's tools open it: created if absent, SQLCipher under the home's key
    in a sealed home, high-sensitivity values sealed per item (:mod:`gateway.atrest.itemseal`), the
    history retention of ``[guard] history_max_versions`` applied (``cfg``, else the home's config
    file), the home's writers' lock held until it is closed (:class:`UserStore`)."""
    if cfg is None:
        cfg = load_section(GuardConfig, "guard", file=paths.config_file)
    hold = contextlib.ExitStack()
    hold.enter_context(writers.writing(paths))  # before the file is opened and its key decided
    try:
        store = UserStore(paths, hold)
    except BaseException:
        hold.close()
        raise
    try:
        set_retention(store, cfg.history_max_versions)
    except BaseException:
        store.close()
        raise
    return store
