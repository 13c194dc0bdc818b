"""The user's trust list (spec §16.4): which publisher identities the user vouches for, by name.

A verified manifest signature proves only that the holder of some key signed it: anyone can make
a ``did:key`` and write ``"publisher": "Big Bank Inc."``. Only the user can say that a key belongs
to a publisher, and that is this list. ``uomp authorize`` names a publisher only by the name the
user gave here, never by the manifest's own claim.

Stored in ``$UOMP_HOME/trust.json`` (mode 0600, atomic writes; changes are serialised by a lock
file so two ``uomp trust add`` at once cannot lose one)::

    {"uomp_trust": 1,
     "entries": [{"kind": "did", "id": "did:key:z6Mk…", "name": "Big Bank", "fingerprint": "SHA256:…",
                  "added_at": "2026-07-12T10:00:00Z", "how": "trust add" | "authorize"}]}

Kinds: ``did`` (``did:key`` with an Ed25519 key, or ``did:web``, resolved when a manifest names
it), ``x509-ca`` (a CA certificate, its PEM in ``data``, id its SHA-256 fingerprint: manifests
signed by a code-signing certificate chaining to it verify, gateway/identity/x509pub.py) and
``openpgp`` (a public key, armored in ``data``, id its fingerprint: gateway/identity/openpgp.py).
Other DID methods and registries are refused when added, since no manifest could ever be verified
against them. A file written by a later version with other kinds is read, and those entries are
kept and listed.

A trust list writable by anyone else than its owner would let them vouch for keys: such a file is
refused (CONFIG_ERROR), as is one that is not a valid list (never silently treated as empty).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.config import Paths
from gateway.core import didkey
from gateway.core.manifest import MAX_DID, MAX_NAME, is_display_safe
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write

TRUST_VERSION = 1
MAX_TRUST_FILE_BYTES = 4 * 1024 * 1024
MAX_TRUST_ENTRIES = 10_000
MAX_ENTRY_DATA = 64 * 1024


@dataclass(frozen=True)
class TrustEntry:
    kind: str
    id: str
    name: str
    fingerprint: str | None
    added_at: str
    how: str = "trust add"
    data: str | None = None  # x509-ca: the CA certificate (PEM); openpgp: the public key (armored)


@dataclass(frozen=True)
class TrustList:
    entries: tuple[TrustEntry, ...] = ()

    def find_did(self, did: str | None) -> TrustEntry | None:
        if not did:
            return None
        for e in self.entries:
            if e.kind == "did" and e.id == did:
                return e
        return None

    def of_kind(self, kind: str) -> tuple[TrustEntry, ...]:
        return tuple(e for e in self.entries if e.kind == kind and e.data)

    def to_json(self) -> bytes:
        rows = [{k: v for k, v in asdict(e).items() if not (k == "data" and v is None)} for e in self.entries]
        doc = {"uomp_trust": TRUST_VERSION, "entries": rows}
        return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME or not is_display_safe(name):
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"the publisher name must be 1-{MAX_NAME} printable characters "
            "(no control or bidirectional-override characters)",
        )
    return name.strip()


def check_did(did: Any) -> tuple[str, str | None]:
    """A trustable DID and its key fingerprint; INVALID_REQUEST for anything this version cannot verify."""
    if not isinstance(did, str) or not did.startswith("did:") or len(did) > MAX_DID or not is_display_safe(did):
        raise UompError(ErrorCode.INVALID_REQUEST, "give a DID such as did:key:z6Mk…")
    if did.startswith("did:web:"):
        from gateway.identity.didweb import DidWebError, did_web_url

        try:
            did_web_url(did)
        except DidWebError as exc:
            raise UompError(ErrorCode.INVALID_REQUEST, f"not a valid did:web: {exc}") from exc
        return did, None
    if not did.startswith("did:key:"):
        method = ":".join(did.split(":")[:2])
        raise UompError(
            ErrorCode.INVALID_REQUEST,
            f"{method} identities cannot be verified by this version, so trusting "
            "one would never match a manifest; only did:key (Ed25519) and did:web can be trusted",
        )
    try:
        pub = didkey.public_key_from_did_key(did)
    except ValueError as exc:
        raise UompError(ErrorCode.INVALID_REQUEST, f"not a valid Ed25519 did:key: {exc}") from exc
    return did, didkey.fingerprint(pub)


def _entry(obj: Any, where: str) -> TrustEntry:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is not an object")
    texts: dict[str, str] = {}
    for label in ("kind", "id", "name"):
        v = obj.get(label)
        if not isinstance(v, str) or not v or len(v) > MAX_DID or not is_display_safe(v):
            raise ValueError(f"{where}.{label} is missing or not printable text")
        texts[label] = v
    kind, ident, name = texts["kind"], texts["id"], texts["name"]
    fp, added, how = obj.get("fingerprint"), obj.get("added_at", ""), obj.get("how", "trust add")
    data = obj.get("data")
    if data is not None and (not isinstance(data, str) or len(data) > MAX_ENTRY_DATA):
        raise ValueError(f"{where}.data is not text of at most {MAX_ENTRY_DATA} characters")
    if fp is not None and not isinstance(fp, str):
        raise ValueError(f"{where}.fingerprint is not text")
    if not isinstance(added, str) or not isinstance(how, str):
        raise ValueError(f"{where} has a malformed added_at or how")
    if kind == "did" and ident.startswith("did:key:"):
        try:
            fp = didkey.fingerprint(didkey.public_key_from_did_key(ident))
        except ValueError as exc:
            raise ValueError(f"{where}.id is not a valid did:key") from exc
    return TrustEntry(kind=kind, id=ident, name=name, fingerprint=fp, added_at=added, how=how, data=data)


def _check_file(path: Path) -> None:
    st = path.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            f"{path} is writable by other users, who could vouch for keys; check its entries, then chmod 600 it",
        )
    if st.st_uid != os.getuid():
        raise UompError(ErrorCode.CONFIG_ERROR, f"{path} belongs to another user; refusing to trust its entries")


def load(paths: Paths) -> TrustList:
    """The user's trust list (empty when there is none yet)."""
    path = paths.trust_file
    try:
        _check_file(path)
        with path.open("rb") as fh:
            raw = fh.read(MAX_TRUST_FILE_BYTES + 1)
    except FileNotFoundError:
        return TrustList()
    except OSError as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, f"cannot read the trust list {path}: {exc.strerror}") from exc
    if len(raw) > MAX_TRUST_FILE_BYTES:
        raise UompError(ErrorCode.CONFIG_ERROR, f"the trust list {path} is larger than {MAX_TRUST_FILE_BYTES} bytes")
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("uomp_trust") != TRUST_VERSION:
            raise ValueError(f"not a version {TRUST_VERSION} trust list")
        items = doc.get("entries")
        if not isinstance(items, list) or len(items) > MAX_TRUST_ENTRIES:
            raise ValueError(f"entries must be a list of at most {MAX_TRUST_ENTRIES}")
        entries = tuple(_entry(e, f"entries[{i}]") for i, e in enumerate(items))
    except (ValueError, RecursionError) as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, f"the trust list {path} is invalid ({exc}); fix or remove it") from exc
    return TrustList(entries)


@contextlib.contextmanager
def _locked(paths: Paths) -> Iterator[None]:
    paths.home.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(paths.trust_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def add(paths: Paths, did: str, name: str, *, how: str = "trust add") -> tuple[TrustEntry, TrustEntry | None]:
    """Trust ``did`` as ``name``. Returns (the entry, the entry it replaced, if it was there already)."""
    did, fp = check_did(did)
    name = check_name(name)
    with _locked(paths):
        current = load(paths)
        old = current.find_did(did)
        if old is not None and old.name == name:
            return old, old
        if old is None and len(current.entries) >= MAX_TRUST_ENTRIES:
            raise UompError(ErrorCode.INVALID_REQUEST, f"the trust list already holds {MAX_TRUST_ENTRIES} entries")
        entry = TrustEntry(kind="did", id=did, name=name, fingerprint=fp, added_at=_now(), how=how)
        kept = [e for e in current.entries if e is not old]
        atomic_write(paths.trust_file, TrustList((*kept, entry)).to_json(), mode=0o600)
    return entry, old


def remove(paths: Paths, ident: str) -> TrustEntry:
    """Stop trusting ``ident`` (a DID, or any entry id); INVALID_REQUEST when it is not in the list."""
    with _locked(paths):
        current = load(paths)
        gone = [e for e in current.entries if e.id == ident]
        if not gone:
            raise UompError(ErrorCode.INVALID_REQUEST, "that identity is not in your trust list (see uomp trust list)")
        kept = tuple(e for e in current.entries if e.id != ident)
        atomic_write(paths.trust_file, TrustList(kept).to_json(), mode=0o600)
    return gone[0]


def add_entry(paths: Paths, entry: TrustEntry) -> tuple[TrustEntry, TrustEntry | None]:
    """Trust ``entry`` (an ``x509-ca`` or ``openpgp`` entry); replaces the one of the same kind and id."""
    name = check_name(entry.name)
    with _locked(paths):
        current = load(paths)
        old = next((e for e in current.entries if e.kind == entry.kind and e.id == entry.id), None)
        if old is not None and old.name == name and old.data == entry.data:
            return old, old
        if old is None and len(current.entries) >= MAX_TRUST_ENTRIES:
            raise UompError(ErrorCode.INVALID_REQUEST, f"the trust list already holds {MAX_TRUST_ENTRIES} entries")
        new = TrustEntry(
            kind=entry.kind,
            id=entry.id,
            name=name,
            fingerprint=entry.fingerprint,
            added_at=_now(),
            how=entry.how,
            data=entry.data,
        )
        kept = [e for e in current.entries if e is not old]
        atomic_write(paths.trust_file, TrustList((*kept, new)).to_json(), mode=0o600)
    return new, old
