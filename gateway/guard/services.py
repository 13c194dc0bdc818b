"""The guard's services, shared by both listeners: audit log, Auth Service, memory store, read
state, the agents' proposals over the store, and the auth.db worker thread every Auth Service call
runs on."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway import keys as keyfiles
from gateway.atrest import writers
from gateway.config import GuardConfig, Paths
from gateway.core import checks
from gateway.db import DbWorker
from gateway.guard.audit import (
    AuditLog,
    open_audit,
)
from gateway.guard.auth import AuthService
from gateway.guard.history import set_retention
from gateway.guard.proposal_rules import WriteBudgets
from gateway.guard.proposals import ProposalBook
from gateway.guard.reads import ReadState
from gateway.guard.revocation import RevokedCertificates
from gateway.guard.storage import MemoryStorage
from gateway.guard.stores import open_memory_store

T = TypeVar("T")


@dataclass
class GuardServices:
    """What the guard's handlers share: the settings, audit log, Auth Service, memory store, read state and the auth.db
    worker."""

    paths: Paths
    cfg: GuardConfig
    audit: AuditLog
    auth: AuthService
    store: MemoryStorage
    admin_credential: str
    # the one thread that runs every Auth Service call (auth.db), off the event loop
    auth_worker: DbWorker
    reads: ReadState
    # Local Profile audiences this guard answers to (the configured port, and the bound one)
    local_audiences: set[str] = dataclasses.field(default_factory=set)
    reads_in_flight: int = 0  # reads by key being answered (see get_key)
    proposals: ProposalBook | None = None  # made on first use: proposal_book()
    # agent certificates revoked in this home, held to the gateway's assertion (guard/revocation.py)
    revoked: RevokedCertificates | None = None
    # the home's writers' lock (gateway/atrest/writers.py), shared, from before the first database is
    # opened until close(): no seal or unseal rewrites memory.db or audit.db under a guard
    writers_hold: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)

    def add_local_port(self, port: int) -> None:
        self.local_audiences.update(
            checks.norm_endpoint(u) for u in (f"http://127.0.0.1:{port}", f"http://localhost:{port}")
        )

    def proposal_book(self) -> ProposalBook:
        """The agents' proposals over this guard's memory store, made on first use (which applies
        ``[guard] history_max_versions`` to the store); call it off the event loop (it may write)."""
        if self.proposals is None:
            set_retention(self.store, self.cfg.history_max_versions)
            self.proposals = ProposalBook(self.store, WriteBudgets.from_config(self.cfg))
        return self.proposals

    @classmethod
    def open(cls, paths: Paths, cfg: GuardConfig) -> GuardServices:
        """Open the guard's databases and services, holding the home's writers' lock (shared) from
        before the first of them until :meth:`close`; a guard started during a seal waits for it (at
        most ``writers.WAIT_SECONDS``, then STORE_BUSY)."""
        hold = contextlib.ExitStack()
        hold.enter_context(writers.writing(paths))
        try:
            svc = cls._open(paths, cfg)
        except BaseException:
            hold.close()
            raise
        svc.writers_hold = hold
        return svc

    @classmethod
    def _open(cls, paths: Paths, cfg: GuardConfig) -> GuardServices:
        audit = open_audit(paths, cfg, strict=False)  # a refused log: served as refusals (errors_middleware)
        auth = AuthService(paths, cfg, audit)
        store = open_memory_store(paths, cfg)
        # a read that is the guard's only one has its event written by this worker (get_key)
        worker = DbWorker(
            "auth",
            what="session database",
            queue_timeout=cfg.db_queue_timeout_seconds,
            durable=audit.writer.write_here_if_idle,
        )
        reads = ReadState(
            paths.reads_db,
            max_sets_per_session=cfg.aggregate_max_sets_per_session,
            max_rows=cfg.aggregate_history_max_rows,
        )
        svc = cls(paths, cfg, audit, auth, store, keyfiles.load_admin(paths), worker, reads)
        svc.revoked = RevokedCertificates(paths)
        svc.add_local_port(cfg.tcp_port)
        return svc

    async def authdb(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (an Auth Service method) on the auth.db worker thread: the event loop never
        waits for a lock on auth.db (or for the audit flush the Auth Service does itself)."""
        return await self.auth_worker.run(fn, *args)

    def close(self) -> None:
        """Close the databases, then let go of the writers' lock."""
        try:
            self.auth_worker.close()
            self.auth.close_db()
            self.store.close()
            self.reads.close()
            self.audit.close()
        finally:
            self.writers_hold.close()
