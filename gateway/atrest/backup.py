"""``uomp backup create FILE`` / ``uomp backup restore FILE``: a whole home in one encrypted file.

The file: ``UOMP-BACKUP/1`` on the first line, a JSON header on the second (Argon2id parameters
and salt, a random nonce prefix, the chunk size), then a tar stream in chunks of at most
:data:`CHUNK` bytes, each ``[4-byte length][AES-256-GCM ciphertext]`` under a key derived from the
backup passphrase, with the header's hash, the chunk's number and whether it is the last as
associated data, and a check value of the key (HMAC) that tells a wrong passphrase from damage:
a changed byte, a chunk removed, reordered or cut off (truncation), or anything
after the last chunk is ``BACKUP_INVALID``.

The tar holds every file of the home (sockets, locks, SQLite ``-wal``/``-shm`` companions and run
state left out) and, last, ``MANIFEST.json``: each file's path, size and SHA-256. SQLite databases
are copied with SQLite's online backup (a consistent snapshot while the appliance runs; a sealed
home's memory.db stays SQLCipher under its own key), into ``.backup-stage`` in the home, removed
when done. Order: plain files first (the audit witness record among them), databases after, the
audit log last, so the log in the backup is never behind its witness record.

Encrypted to a recipient instead (``--to-recipient PUBKEY``, the idea of age's X25519 recipients):
the header (``v: 2``) carries a fresh ephemeral X25519 public key and the recipient's; the chunk
key is ``HKDF-SHA256(X25519(ephemeral, recipient), salt = ephemeral || recipient, info =
"uomp-backup/2/x25519")``. Only the recipient's identity file opens it: another identity or any
passphrase is ``BACKUP_KEY_WRONG``. :func:`verify` reads every chunk, every member's hash and the
manifest without writing anything.

Restore goes into a new directory beside the target (``<home>.restore-<tag>``): each member's name
is checked (relative, no ``..``, regular files), every hash against the manifest, nothing missing
and nothing extra; then one ``rename`` makes it the home. A crash before it leaves the target as it
was. A target that exists and is not empty is refused (``HOME_NOT_EMPTY``) unless ``force``, which
moves it aside to ``<home>.before-restore-<time>`` (never deleted).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import os
import secrets
import shutil
import sqlite3
import struct
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway import sqldriver
from gateway.atrest import auditdb, memdb, recipient, sealing, vault
from gateway.config import Paths
from gateway.durable import fault_point
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import fsync_dir

MAGIC = b"UOMP-BACKUP/1\n"
CHUNK = 64 * 1024
MAX_HEADER = 4096
MANIFEST = "MANIFEST.json"
MAX_MEMBERS = 100_000
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
SKIP_SUFFIXES = ("-wal", "-shm", "-journal", ".lock", ".tmp", ".convert")
SKIP_NAMES = {".lock", ".atrest.lock", "appliance.json", "status.json"}


def _key_wrong(why: str) -> UompError:
    return UompError(ErrorCode.BACKUP_KEY_WRONG, why)


def _check_value(key: bytes) -> str:
    """A value in the header that tells a wrong passphrase from a damaged first chunk."""
    return hmac.new(key, b"uomp-backup/check", "sha256").hexdigest()[:32]


def _invalid(why: str) -> UompError:
    return UompError(
        ErrorCode.BACKUP_INVALID,
        f"the backup is damaged, truncated or not a UOMP backup ({why}); nothing was restored: use another copy",
    )


class _Writer(io.RawIOBase):
    """A write-only stream that encrypts what it gets in chunks (see the module docstring)."""

    def __init__(self, out: IO[bytes], key: bytes, header: bytes) -> None:
        self.out, self.aead, self.buf, self.n = out, AESGCM(key), bytearray(), 0
        self.prefix = json.loads(header)["nonce_prefix"]
        self.hh = hashlib.sha256(header).digest()
        out.write(MAGIC + header + b"\n")

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.buf += bytes(b)
        while len(self.buf) > CHUNK:
            self._emit(bytes(self.buf[:CHUNK]), final=False)
            del self.buf[:CHUNK]
        return len(b)

    def _emit(self, data: bytes, *, final: bool) -> None:
        nonce = bytes.fromhex(self.prefix) + struct.pack(">I", self.n)
        ct = self.aead.encrypt(nonce, data, self.hh + struct.pack(">Q?", self.n, final))
        self.out.write(struct.pack(">I", len(ct)) + ct)
        self.n += 1

    def finish(self) -> None:
        self._emit(bytes(self.buf), final=True)
        self.buf.clear()


class _Reader(io.RawIOBase):
    """The reverse of :class:`_Writer`: every chunk checked; a missing last chunk is an error."""

    def __init__(self, src: IO[bytes], passphrase: bytes | None, identity: X25519PrivateKey | None) -> None:
        if src.read(len(MAGIC)) != MAGIC:
            raise _invalid("no UOMP-BACKUP/1 line")
        header = src.readline(MAX_HEADER)
        if not header.endswith(b"\n"):
            raise _invalid("no header")
        header = header[:-1]
        try:
            doc = json.loads(header)
            self.prefix = bytes.fromhex(doc["nonce_prefix"])
            if len(self.prefix) != 8 or doc.get("v") not in (1, 2):
                raise ValueError("header")
            if doc["v"] == 1:
                kdf = sealing.kdf_params(doc["kdf"])
            else:
                epk, rpk = bytes.fromhex(doc["epk"]), bytes.fromhex(doc["recipient"])
                if len(epk) != 32 or len(rpk) != 32:
                    raise ValueError("recipient")
        except (ValueError, KeyError, TypeError) as exc:
            raise _invalid(f"bad header: {exc}") from None
        self.recipient = doc["v"] == 2
        if doc["v"] == 1:
            if passphrase is None:
                raise _key_wrong("this backup is encrypted to a passphrase, not to an identity; give its passphrase")
            key = sealing.derive(sealing.passphrase_bytes(passphrase), kdf)
        else:
            if identity is None:
                raise _key_wrong(
                    f"this backup is encrypted to the recipient {recipient.PREFIX}{rpk.hex()}, not to a passphrase; "
                    "give that recipient's identity file (--identity FILE)"
                )
            if recipient.raw(identity.public_key()) != rpk:
                raise _key_wrong(
                    f"this backup is encrypted to {recipient.PREFIX}{rpk.hex()}, not to this identity; give that "
                    "recipient's identity file"
                )
            key = recipient.derive_key(identity.exchange(X25519PublicKey.from_public_bytes(epk)), epk, rpk)
        check = doc.get("check")
        self.checked = isinstance(check, str)  # a backup made without one: a bad first chunk may be either
        if self.checked and not hmac.compare_digest(str(check), _check_value(key)):
            if doc["v"] == 1:
                raise UompError(
                    ErrorCode.PASSPHRASE_WRONG, "the passphrase does not open this backup; give the backup's passphrase"
                )
            raise _invalid("its header does not match its recipient")
        self.src, self.aead = src, AESGCM(key)
        self.hh = hashlib.sha256(header).digest()
        self.n, self.buf, self.done, self.first = 0, b"", False, True

    def readable(self) -> bool:
        return True

    def _next(self) -> None:
        head = self.src.read(4)
        if len(head) != 4:
            raise _invalid("cut off before its end")
        (size,) = struct.unpack(">I", head)
        if size > CHUNK + 16:
            raise _invalid("chunk too large")
        ct = self.src.read(size)
        if len(ct) != size:
            raise _invalid("cut off inside a chunk")
        nonce = self.prefix + struct.pack(">I", self.n)
        for final in (False, True):
            try:
                self.buf = self.aead.decrypt(nonce, ct, self.hh + struct.pack(">Q?", self.n, final))
            except InvalidTag:
                continue
            self.first = False
            self.n += 1
            if final:
                self.done = True
                if self.src.read(1):
                    raise _invalid("data after its end")
            return
        if self.first and not self.recipient and not self.checked:
            raise UompError(
                ErrorCode.PASSPHRASE_WRONG,
                "the passphrase does not open this backup (or its first part is damaged); give the backup's passphrase",
            )
        raise _invalid(f"chunk {self.n} does not open")

    def readinto(self, b: Any) -> int:
        while not self.buf:
            if self.done:
                return 0
            self._next()
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n


def _skip(rel: str, name: str) -> bool:
    return name in SKIP_NAMES or name.endswith(SKIP_SUFFIXES) or rel.startswith((".backup-stage", "guard.sock"))


def _snapshot(paths: Paths, src: Path, dst: Path) -> None:
    """SQLite online backup of ``src`` into ``dst`` (SQLCipher under its own key for a sealed home's
    memory.db and audit.db: the copy is as encrypted as the file).

    Every open of ``src`` is SQLite's, through the driver its other users in this process have (the
    standard library's for a plain file, SQLCipher's for an encrypted one): this process may hold
    connections to it (a guard's store, a tool's), and closing a descriptor SQLite does not manage
    would drop their POSIX locks. So whether memory.db is encrypted is decided from the home's
    sealed state and the connection itself (a plaintext store left from before the seal does not
    read under the key), never by reading the file's header beside SQLite."""
    if src == paths.audit_db:  # its one opener (no second descriptor of a file the guard may hold)
        key = auditdb.key_for(src)
        a = auditdb.connect(src, readonly=True)
        b = memdb.connect(str(dst), key) if key is not None else sqlite3.connect(str(dst))
    elif src == paths.memory_db and vault.is_sealed_home(paths) and (a := _sealed_source(paths, src)) is not None:
        b = memdb.connect(str(dst), memdb.memory_key(paths))
    else:
        a = sqlite3.connect(src.resolve().as_uri() + "?mode=ro", uri=True)
        b = sqlite3.connect(str(dst))
    try:
        a.backup(b)
    finally:
        b.close()
        a.close()


def _sealed_source(paths: Paths, src: Path) -> Any:
    """A read-only SQLCipher connection to a sealed home's memory.db, its first page read under the
    key; None for a file that does not read under it as SQLCipher (empty, or plaintext from before
    the seal: copied as it is)."""
    if src.stat().st_size == 0:
        return None
    a = memdb.connect(src.resolve().as_uri() + "?mode=ro", memdb.memory_key(paths), uri=True)
    try:
        a.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqldriver.DATABASE:
        a.close()
        return None
    return a


def _files(paths: Paths) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirs, names in os.walk(paths.home):
        dirs[:] = [d for d in dirs if d != paths.backup_stage.name]
        for name in sorted(names):
            p = Path(dirpath) / name
            rel = p.relative_to(paths.home).as_posix()
            if _skip(rel, name) or not p.is_file() or p.is_symlink():
                continue
            out.append((rel, p))
    db_rank = {paths.audit_db: 2}
    out.sort(key=lambda rp: (rp[1].suffix == ".db", db_rank.get(rp[1], 1), rp[0]))
    return out


def create(
    paths: Paths,
    out: Path,
    passphrase: bytes | None = None,
    *,
    kdf: dict[str, Any] | None = None,
    to: X25519PublicKey | None = None,
) -> dict[str, Any]:
    """Write the backup of ``paths`` to ``out`` (atomically: a temp file renamed), encrypted to
    ``passphrase`` or to the recipient ``to``; its manifest."""
    doc: dict[str, Any] = {"nonce_prefix": secrets.token_hex(8), "chunk": CHUNK}
    if to is not None:
        eph = X25519PrivateKey.generate()
        epk, rpk = recipient.raw(eph.public_key()), recipient.raw(to)
        key = recipient.derive_key(eph.exchange(to), epk, rpk)
        doc.update({"v": 2, "alg": "x25519-hkdf-sha256", "epk": epk.hex(), "recipient": rpk.hex()})
    else:
        if passphrase is None:
            raise UompError(ErrorCode.USAGE, "a backup needs a passphrase or a recipient; give one")
        params = dict(sealing.DEFAULT_KDF if kdf is None else kdf)
        params["salt"] = sealing.b64(secrets.token_bytes(16))
        params = sealing.kdf_params(params)
        key = sealing.derive(sealing.passphrase_bytes(passphrase), params)
        doc.update({"v": 1, "kdf": params})
    doc["check"] = _check_value(key)
    header = json.dumps(doc, sort_keys=True).encode()
    shutil.rmtree(paths.backup_stage, ignore_errors=True)
    os.mkdir(paths.backup_stage, 0o700)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    manifest: dict[str, Any] = {"format": "uomp-backup/1", "created_at": int(time.time()), "files": []}
    try:
        with open(tmp, "xb") as fh:
            os.chmod(tmp, 0o600)
            w = _Writer(fh, key, header)
            with tarfile.open(fileobj=w, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for rel, p in _files(paths):
                    src = p
                    if p.suffix == ".db":
                        src = paths.backup_stage / f"{len(manifest['files'])}.db"
                        _snapshot(paths, p, src)
                    size, digest = _add_file(tar, rel, src)
                    manifest["files"].append({"path": rel, "size": size, "sha256": digest})
                    if src != p:
                        src.unlink()
                        fault_point("atrest.backup_after_snapshot")
                manifest["sealed"] = paths.master_slot.exists()
                manifest["encrypted_to"] = "recipient" if to is not None else "passphrase"
                _add(tar, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            w.finish()
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        shutil.rmtree(paths.backup_stage, ignore_errors=True)
    return manifest


class _Hashing(io.RawIOBase):
    """Reads a file for the tar stream and hashes what it gave."""

    def __init__(self, fh: IO[bytes], size: int) -> None:
        self.fh, self.h, self.left = fh, hashlib.sha256(), size

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.fh.read(min(len(b), self.left))  # never past the size in the member's header
        self.left -= len(data)
        b[: len(data)] = data
        self.h.update(data)
        return len(data)


def _add_file(tar: tarfile.TarFile, name: str, path: Path) -> tuple[int, str]:
    """One member from ``path`` streamed (bounded memory); its size and SHA-256 as written."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size  # a file that grows meanwhile is cut at this size
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o600, int(time.time())
        src = _Hashing(fh, size)
        tar.addfile(info, io.BufferedReader(src, CHUNK))
        return size, src.h.hexdigest()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
    tar.addfile(info, io.BytesIO(data))


@contextlib.contextmanager
def _members(src: Path, passphrase: bytes | None, identity: X25519PrivateKey | None) -> Iterator[tarfile.TarFile]:
    with open(src, "rb") as fh:
        reader = io.BufferedReader(_Reader(fh, passphrase, identity), CHUNK)
        try:
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                yield tar
        except tarfile.TarError as exc:
            raise _invalid(f"the archive inside does not read: {exc}") from None


def _safe(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and ".." not in parts and "" not in parts and "\\" not in name


def _read_all(
    src: Path, passphrase: bytes | None, identity: X25519PrivateKey | None, stage: Path | None
) -> dict[str, Any]:
    """Every member read, hashed and checked against the manifest (written under ``stage`` when one
    is given); the manifest. BACKUP_INVALID for any damage, BACKUP_KEY_WRONG / PASSPHRASE_WRONG for
    the wrong secret."""
    got: dict[str, str] = {}
    manifest: dict[str, Any] | None = None
    with _members(src, passphrase, identity) as tar:
        for n, info in enumerate(tar):
            if n > MAX_MEMBERS or not info.isreg() or not _safe(info.name) or manifest is not None:
                raise _invalid(f"unexpected member {info.name[:80]!r}")
            f = tar.extractfile(info)
            assert f is not None
            if info.name == MANIFEST:
                if info.size > MAX_MANIFEST_BYTES:
                    raise _invalid("manifest too large")
                try:
                    manifest = json.loads(f.read())
                except ValueError:
                    raise _invalid("unreadable manifest") from None
                continue
            if info.name in got:
                raise _invalid(f"member {info.name[:80]!r} twice")
            h = hashlib.sha256()
            if stage is None:
                while block := f.read(CHUNK):
                    h.update(block)
            else:
                target = stage / info.name
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with open(target, "xb") as out:
                    os.chmod(target, 0o600)
                    while block := f.read(CHUNK):
                        h.update(block)
                        out.write(block)
                    out.flush()
                    os.fsync(out.fileno())
            got[info.name] = h.hexdigest()
    if not isinstance(manifest, dict):
        raise _invalid("no manifest")
    try:
        want = {e["path"]: e["sha256"] for e in manifest.get("files", [])}
    except (TypeError, KeyError, AttributeError):
        raise _invalid("unreadable manifest") from None
    if want != got:
        raise _invalid("its files do not match its manifest")
    return manifest


def verify(src: Path, passphrase: bytes | None = None, *, identity: X25519PrivateKey | None = None) -> dict[str, Any]:
    """Check every chunk, every member's hash and the manifest of the backup ``src`` without
    restoring (nothing is written); its manifest."""
    return _read_all(src, passphrase, identity, None)


def restore(
    src: Path,
    home: Path,
    passphrase: bytes | None = None,
    *,
    force: bool = False,
    identity: X25519PrivateKey | None = None,
) -> dict[str, Any]:
    """Restore the backup ``src`` as the home ``home`` (see the module docstring); its manifest."""
    home = Path(os.path.abspath(home))
    if home.exists() and any(home.iterdir()) and not force:
        raise UompError(
            ErrorCode.HOME_NOT_EMPTY,
            f"{home} is not empty; restore into a new directory (--home), or pass --force to move the "
            f"current one aside first (to {home.name}.before-restore-<time>)",
        )
    home.parent.mkdir(parents=True, exist_ok=True)
    for old in home.parent.glob(f"{home.name}.restore-*"):  # a restore killed before its rename
        shutil.rmtree(old, ignore_errors=True)
    stage = home.with_name(f"{home.name}.restore-{secrets.token_hex(4)}")
    os.mkdir(stage, 0o700)
    try:
        manifest = _read_all(src, passphrase, identity, stage)
        _modes(stage)
        fault_point("atrest.restore_before_rename")
        if home.exists():
            if any(home.iterdir()):
                aside = home.with_name(f"{home.name}.before-restore-{time.strftime('%Y%m%dT%H%M%S')}")
                os.rename(home, aside)
                manifest["moved_aside"] = str(aside)
            else:
                os.rmdir(home)
        os.rename(stage, home)
        fsync_dir(home.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    vault.forget(Paths(home))
    return manifest


def _modes(stage: Path) -> None:
    """Directories 0700; certificates and public keys readable (as ``uomp init`` makes them)."""
    for dirpath, _dirs, names in os.walk(stage):
        os.chmod(dirpath, 0o700)
        for name in names:
            if name.endswith((".crt", ".pem", ".pub", "jwks.json", "ed25519-public.jwk")):
                os.chmod(Path(dirpath) / name, 0o644)
