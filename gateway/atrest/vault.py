"""The process's view of sealed homes: which key files are sealed, the unlocked master keys, and
the two calls every key loader and writer goes through.

A home is *sealed* when ``.secrets/master.json`` exists. Then each of :func:`sealed_files`
(signing key, audit key, payload key, CA key, gateway TLS key, admin credential) is a sealed file
(:mod:`gateway.atrest.sealing`), and a plaintext file in its place is refused (``KEY_ERROR``):
someone put it there, and a planted CA or signing key must not be trusted. A home without a slot
is *plain*: its key files are PKCS#8 / JWK files as ``uomp init`` writes them.

:func:`read_key` and :func:`write_key` find the home from the file's place (``<home>/.secrets/...``,
``<home>/ca/...``), so the loaders keep their signatures. A file elsewhere (a witness directory, an
agent's output directory) is never sealed.

Unlocking: :func:`master` returns the home's master key once it is unlocked in this process,
else tries, in order, the key handed over by a parent process on an inherited pipe
(``UOMP_MASTER_FD``: the number only, the key never travels in the environment), the OS keychain
(a ``keyring`` slot), ``UOMP_PASSPHRASE_FILE``, and systemd's ``$CREDENTIALS_DIRECTORY/uomp-passphrase``
(``LoadCredential=uomp-passphrase:/path``); none of them: ``SECRETS_LOCKED`` with the fix. The CLI
asks in the terminal instead (:func:`open_home` with a prompt). A wrong passphrase is
``PASSPHRASE_WRONG``. The passphrase is never kept; the master key lives in this process's memory
only (and in a child's, handed over by :func:`child_handover`).

Before the state of a home is read, a seal or unseal that a crash interrupted is finished or
undone (:func:`gateway.atrest.journal.recover`): a committed one is rolled forward, a prepared
one is removed, so every process sees the old state or the new one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from gateway.atrest import journal, sealing
from gateway.atrest.sealing import MasterKey
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write, create_private_file

log = logging.getLogger(__name__)

PASSPHRASE_FILE_ENV = "UOMP_PASSPHRASE_FILE"
MASTER_FD_ENV = "UOMP_MASTER_FD"
CREDENTIAL_NAME = "uomp-passphrase"
PROMPT_ATTEMPTS = 3
MAX_KEY_BYTES = sealing.MAX_SEALED_BYTES

_lock = threading.RLock()
_unlocked: dict[Path, MasterKey] = {}
_handed_over: list[bytes] = []  # a master key read from UOMP_MASTER_FD, until the home asks for it
_prompt: list[Callable[[], str] | None] = [None]  # the terminal prompt the CLI set (set_prompt)


def _home_key(paths: Paths) -> Path:
    return Path(os.path.abspath(paths.home))


def role_of(path: Path) -> tuple[Paths, str] | None:
    """The home and role of a key file that is sealed in a sealed home; None for any other file."""
    path = Path(os.path.abspath(path))
    paths = Paths(path.parent.parent)
    for f, role in journal.sealed_files(paths):
        if f == path:
            return paths, role
    return None


def is_sealed_home(paths: Paths) -> bool:
    """Whether this home's keys are sealed (after settling an interrupted seal or unseal)."""

    journal.recover(paths)
    return paths.master_slot.exists()


def read_slot(paths: Paths) -> dict[str, object]:
    """The sealed master key's slot (method and KDF parameters), its bounds checked."""
    try:
        with open(paths.master_slot, "rb") as fh:
            raw = fh.read(sealing.MAX_SLOT_BYTES + 1)
    except FileNotFoundError:
        raise UompError(ErrorCode.KEY_ERROR, f"{paths.home} has no sealed master key") from None
    return sealing.parse_slot(raw, str(paths.master_slot))


def set_prompt(prompt: Callable[[], str] | None) -> None:
    """How :func:`master` asks the user when nothing else unlocks a home (the CLI's terminal prompt)."""
    _prompt[0] = prompt


def forget(paths: Paths | None = None) -> None:
    """Drop the unlocked master key of ``paths`` (all homes when None) from this process."""
    with _lock:
        if paths is None:
            _unlocked.clear()
        else:
            _unlocked.pop(_home_key(paths), None)


def remember(paths: Paths, master: MasterKey) -> None:
    """Keeps ``master`` as this process's unlocked key for the home."""
    with _lock:
        _unlocked[_home_key(paths)] = master


def unlocked(paths: Paths) -> MasterKey | None:
    """This process's unlocked master key for the home, if any."""
    with _lock:
        return _unlocked.get(_home_key(paths))


def unlock_with_passphrase(paths: Paths, passphrase: str | bytes) -> MasterKey:
    """The master key opened with ``passphrase``; PASSPHRASE_WRONG when it does not open it."""
    slot = read_slot(paths)
    if slot["method"] != "passphrase":
        raise UompError(
            ErrorCode.KEY_ERROR, f"{paths.home}'s master key is in the OS keychain, not sealed by a passphrase"
        )
    master = sealing.unwrap_with_passphrase(slot, passphrase)
    remember(paths, master)
    return master


def read_passphrase_file(path: Path) -> bytes:
    """A passphrase file's content without its one trailing newline (bounded; never logged)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UompError(
            ErrorCode.SECRETS_LOCKED, f"cannot read the passphrase file {path}: {exc.strerror}; check the path"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UompError(ErrorCode.SECRETS_LOCKED, f"the passphrase file {path} is not a regular file")
        if st.st_mode & 0o002:
            raise UompError(
                ErrorCode.UNSAFE_PERMISSIONS, f"the passphrase file {path} is writable by others; chmod o-w it"
            )
        if st.st_mode & 0o044:
            log.warning("the passphrase file %s is readable by group or others; chmod 600 it", path)
        raw = os.read(fd, sealing.MAX_PASSPHRASE_BYTES + 3)
    finally:
        os.close(fd)
    if raw.endswith(b"\r\n"):
        raw = raw[:-2]
    elif raw.endswith(b"\n"):
        raw = raw[:-1]
    return sealing.passphrase_bytes(raw)


def _take_handed_over() -> None:
    """Read the master key a parent handed over on ``UOMP_MASTER_FD`` (once; the fd is closed)."""
    value = os.environ.pop(MASTER_FD_ENV, None)
    if value is None:
        return
    try:
        fd = int(value)
        with os.fdopen(fd, "rb", closefd=True) as fh:
            raw = fh.read(256)
    except (ValueError, OSError):
        log.warning("%s does not name a readable pipe; ignored", MASTER_FD_ENV)
        return
    _handed_over.append(raw)


def _from_handover(paths: Paths, slot: dict[str, object]) -> MasterKey | None:
    _take_handed_over()
    with _lock:
        for i, raw in enumerate(_handed_over):
            try:
                doc = json.loads(raw)
                master = MasterKey(str(doc["id"]), bytes.fromhex(str(doc["key"])))
            except (ValueError, KeyError, TypeError):
                continue
            if master.home_id == slot["id"]:
                del _handed_over[i]
                return master
    return None


def _from_keyring(slot: dict[str, object]) -> MasterKey:
    try:
        import keyring  # optional: pip install 'uomp-gateway[keychain]'
    except ImportError:
        raise UompError(
            ErrorCode.SECRETS_LOCKED,
            "this home's master key is in the OS keychain, but the keyring package is not installed; "
            "pip install 'uomp-gateway[keychain]'",
        ) from None
    try:
        value = keyring.get_password(str(slot["service"]), str(slot["id"]))
    except Exception as exc:  # a backend's own failure (locked, unreachable, a damaged store file)
        raise UompError(
            ErrorCode.SECRETS_LOCKED,
            f"the OS keychain did not give the key ({type(exc).__name__}); unlock it (or repair it) and retry",
        ) from None
    if value is None:
        raise UompError(
            ErrorCode.SECRETS_LOCKED,
            f"the OS keychain has no entry {slot['service']}/{slot['id']}; unlock the keychain that holds it",
        )
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raw = b""
    return sealing.check_keyring_master(slot, raw)


def _passphrase_sources() -> list[Path]:
    out = []
    if os.environ.get(PASSPHRASE_FILE_ENV):
        out.append(Path(os.environ[PASSPHRASE_FILE_ENV]))
    cred_dir = os.environ.get("CREDENTIALS_DIRECTORY")
    if cred_dir and (Path(cred_dir) / CREDENTIAL_NAME).exists():
        out.append(Path(cred_dir) / CREDENTIAL_NAME)
    return out


PLAIN_WARNING = "--no-passphrase: anyone running as you can read the keys"


def at_rest_state(paths: Paths) -> dict[str, object]:
    """How the keys of ``paths`` are kept, without unlocking anything (for ``doctor`` / ``status``).

    ``sealed_by`` is ``passphrase`` (unlocked from a terminal prompt), ``passphrase-file``
    (``UOMP_PASSPHRASE_FILE``), ``credential`` (systemd ``$CREDENTIALS_DIRECTORY``), ``keychain``, or
    ``none`` for a plain home (0600 files, :data:`PLAIN_WARNING`). A slot that does not read is
    ``sealed_by: "unreadable"`` with the error's message."""
    journal.recover(paths)
    if not paths.master_slot.exists():
        return {"sealed": False, "sealed_by": "none", "warning": PLAIN_WARNING}
    try:
        slot = read_slot(paths)
    except UompError as exc:
        return {"sealed": True, "sealed_by": "unreadable", "problem": exc.message}
    out: dict[str, object] = {"sealed": True, "master_key_id": slot["id"]}
    if slot["method"] == "keyring":
        out["sealed_by"] = "keychain"
        return out
    cred_dir = os.environ.get("CREDENTIALS_DIRECTORY")
    if os.environ.get(PASSPHRASE_FILE_ENV):
        out["sealed_by"] = "passphrase-file"
    elif cred_dir and (Path(cred_dir) / CREDENTIAL_NAME).exists():
        out["sealed_by"] = "credential"
    else:
        out["sealed_by"] = "passphrase"
    kdf = slot["kdf"]
    assert isinstance(kdf, dict)
    out["kdf"] = {k: v for k, v in kdf.items() if k != "salt"}
    return out


def describe_state(state: dict[str, object]) -> str:
    """One line for a person: how the keys are kept (see :func:`at_rest_state`)."""
    by = state["sealed_by"]
    if by == "none":
        return f"keys NOT sealed: plain 0600 files ({PLAIN_WARNING}); 'uomp secrets seal' protects them"
    if by == "unreadable":
        return f"keys sealed, but the master key slot does not read: {state.get('problem')}"
    how = {
        "passphrase": "a passphrase (Argon2id; asked in the terminal)",
        "passphrase-file": f"a passphrase (Argon2id; read from {PASSPHRASE_FILE_ENV})",
        "credential": f"a passphrase (Argon2id; systemd credential {CREDENTIAL_NAME})",
        "keychain": "the OS keychain",
    }[str(by)]
    return f"keys sealed by {how}, master key {state.get('master_key_id')}"


def locked_error(paths: Paths) -> UompError:
    """SECRETS_LOCKED for a sealed home nothing unlocked, with how to unlock it."""
    return UompError(
        ErrorCode.SECRETS_LOCKED,
        f"the keys of {paths.home} are sealed and nothing unlocked them; run the command in a terminal "
        f"(it asks for the passphrase), or set {PASSPHRASE_FILE_ENV}=FILE "
        f"(systemd: LoadCredential={CREDENTIAL_NAME}:FILE)",
    )


def master(paths: Paths, *, prompt: Callable[[], str] | None = None) -> MasterKey:
    """The master key of the sealed home ``paths`` (see the module docstring for where it comes from).
    One caller at a time: two threads never both ask the user or both run the KDF."""
    with _lock:
        return _master(paths, prompt)


def _master(paths: Paths, prompt: Callable[[], str] | None) -> MasterKey:
    have = unlocked(paths)
    if have is not None:
        return have
    slot = read_slot(paths)
    handed = _from_handover(paths, slot)
    if handed is not None:
        remember(paths, handed)
        return handed
    if slot["method"] == "keyring":
        got = _from_keyring(slot)
        remember(paths, got)
        return got
    for source in _passphrase_sources():
        return unlock_with_passphrase(paths, read_passphrase_file(source))
    prompt = prompt if prompt is not None else _prompt[0]
    if prompt is None:
        raise locked_error(paths)
    last: UompError | None = None
    for _ in range(PROMPT_ATTEMPTS):
        try:
            return unlock_with_passphrase(paths, prompt())
        except UompError as exc:
            if exc.code != ErrorCode.PASSPHRASE_WRONG:
                raise
            last = exc
    assert last is not None
    raise last


def open_home(paths: Paths, *, prompt: Callable[[], str] | None = None) -> bool:
    """Finish or undo an interrupted seal / unseal; for a sealed home, unlock it (``prompt`` asks
    the user when no other source has the key). True when the home is sealed."""
    if not paths.secrets.exists():
        return False
    if not is_sealed_home(paths):
        return False
    master(paths, prompt=prompt)
    return True


# ------------------------------------------------------------------------------- key files


def read_bounded(path: Path) -> bytes:
    """A small file's bytes, refused past its size bound."""
    with open(path, "rb") as fh:
        raw = fh.read(MAX_KEY_BYTES + 1)
    if len(raw) > MAX_KEY_BYTES:
        raise UompError(ErrorCode.KEY_ERROR, f"{path} is too large to be a key file")
    return raw


def read_key(path: Path) -> bytes:
    """The plaintext of the key file at ``path`` (``FileNotFoundError`` when absent, as ``read_bytes``).

    In a sealed home a key file of :func:`sealed_files` is opened with the master key, and a
    plaintext one there is refused; elsewhere the file is returned as it is."""
    path = Path(path)
    raw = read_bounded(path)
    hit = role_of(path)
    if hit is None:
        if sealing.is_sealed(raw):
            raise UompError(
                ErrorCode.KEY_ERROR, f"{path} is a sealed key file outside the place it was sealed for; put it back"
            )
        return raw
    paths, role = hit
    if is_sealed_home(paths):
        if not sealing.is_sealed(raw):
            raise UompError(
                ErrorCode.KEY_ERROR,
                f"{path} is a plaintext key in a home whose keys are sealed: it was put there by someone "
                f"else; restore the sealed file from a backup (or 'uomp secrets unseal' first if you put it there)",
            )
        return sealing.open_file(master(paths), role, raw, str(path))
    if sealing.is_sealed(raw):
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{path} is sealed but {paths.master_slot} is missing; restore master.json from a backup",
        )
    return raw


def seal_for(path: Path, data: bytes) -> bytes:
    """What to write at ``path`` for the plaintext ``data``: sealed in a sealed home, else as is."""
    hit = role_of(path)
    if hit is None:
        return data
    paths, role = hit
    if not is_sealed_home(paths):
        return data
    return sealing.seal_file(master(paths), role, data)


def write_key(path: Path, data: bytes) -> None:
    """Write a key file atomically (0600), sealed when its home is."""
    atomic_write(Path(path), seal_for(Path(path), data), mode=0o600)


def create_key(path: Path, data: bytes) -> bool:
    """Create a key file unless one exists (:func:`gateway.fsutil.create_private_file`), sealed
    when its home is; True when this call made it."""
    return create_private_file(Path(path), seal_for(Path(path), data))


@contextlib.contextmanager
def ssl_key_file(path: Path) -> Iterator[tuple[str, bytes | None]]:
    """``(keyfile, password)`` for ``SSLContext.load_cert_chain``: the file itself when it is not
    sealed; for a sealed one, the key re-encrypted under a one-time random password in an anonymous
    memory file (``memfd``, never on disk), closed when the block ends."""
    path = Path(path)
    hit = role_of(path)
    if hit is None or not is_sealed_home(hit[0]):
        yield os.fspath(path), None
        return
    key = serialization.load_pem_private_key(read_key(path), password=None)
    password = secrets.token_bytes(32)
    enc = serialization.BestAvailableEncryption(password)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)
    if not hasattr(os, "memfd_create"):
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            "a sealed gateway TLS key is opened in an anonymous memory file, which this system lacks (Linux only); "
            "'uomp secrets unseal' to run here",
        )
    fd = os.memfd_create("uomp-tls-key", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        yield f"/proc/self/fd/{fd}", password
    finally:
        os.close(fd)


class Handover:
    """A pipe carrying the master key to one child process (``pass_fds``, ``env``)."""

    def __init__(self, paths: Paths) -> None:
        self.fds: tuple[int, ...] = ()
        self.env: dict[str, str] = {}
        got = unlocked(paths)
        if got is None:
            return
        r, w = os.pipe()
        try:
            os.write(w, json.dumps({"id": got.home_id, "key": got.key.hex()}).encode())
        finally:
            os.close(w)
        self.fds = (r,)
        self.env = {MASTER_FD_ENV: str(r)}

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = ()


def child_handover(paths: Paths) -> Handover:
    """For a child that opens the same home (the guard under ``uomp gateway start``): the unlocked
    master key on a pipe, so the child needs no passphrase. Empty for a plain or locked home."""
    return Handover(paths)
