"""The steps ``uomp init`` and ``uomp gateway start`` run on a home after its signing keys, in this
order (:data:`gateway.cli.home.INIT_HOOKS`): the memory store and its item sealing key, the agent CA
with the gateway's certificate and CRL, the audit signing key, the payload key. Each returns
``{what: created?}`` and changes nothing that is already there.

Each step imports its code when it runs, and this module imports none of the commands' own modules
(``uomp memory``'s import and export code, ``uomp audit``'s log readers, ``uomp payload``'s client):
``gateway start`` runs the steps on every start, and its process keeps what it imported for as
long as it serves.
"""

from __future__ import annotations

from gateway.cli import home
from gateway.config import Paths


def cert_hostnames(paths: Paths, extra: list[str]) -> list[str]:
    """Host names for the gateway certificate: the listen host and the public addresses
    (:func:`gateway.appliance.cert_hostnames`), plus ``extra``."""
    from gateway import appliance
    from gateway.config import GatewayConfig, load_section

    cfg = load_section(GatewayConfig, "gateway", file=paths.config_file)
    return appliance.cert_hostnames(paths, cfg, extra)


def init_store(paths: Paths) -> dict[str, bool]:
    """Create the (empty) Memory Store and its item sealing key if they are not there yet."""
    from gateway.atrest import itemseal, memdb
    from gateway.guard.store import MemoryStore

    existed = paths.memory_db.exists()
    had_key = itemseal.items_key_path(paths).exists()
    MemoryStore(paths.memory_db, create=True, key=memdb.key_for(paths), sealer=itemseal.sealer_for(paths)).close()
    return {"memory store": not existed, "item sealing key": not had_key}


def init_ca(paths: Paths) -> dict[str, bool]:
    """The CA, the gateway server certificate (configured names) and the CRL."""
    from gateway import ca_store

    return ca_store.init_all(paths, cert_hostnames(paths, []))


def init_audit_key(paths: Paths) -> dict[str, bool]:
    """The audit log's signing key."""
    from gateway.ledger import auditkey

    return {"audit signing key (.secrets/audit-ed25519.key)": auditkey.ensure(paths)}


def init_payload_key(paths: Paths) -> dict[str, bool]:
    """The user's payload key (agents seal payloads to it)."""
    from gateway.payloads import userkey

    return {"payload key": userkey.ensure(paths)}


for _step in (init_store, init_ca, init_audit_key, init_payload_key):
    if _step not in home.INIT_HOOKS:  # (at import: `uomp init` and `gateway start` import this module for it)
        home.INIT_HOOKS.append(_step)
