"""The Auth Service signing keys and the user's admin credential, on disk.

Files under ``$UOMP_HOME/.secrets`` (0700):

* ``ed25519-private.jwk`` (0600): the current signing key, ``{kty, crv, x, d, kid, alg}`` as the
  TypeScript reference writes it;
* ``ed25519-public.jwk``: its public half (what the reference gateway reads);
* ``jwks.json``: ``{"keys": [...]}``, every public key still accepted, each with ``kid`` and, once
  rotated out, ``retired_at`` (epoch seconds). A retired key is dropped once no token it signed
  can still be alive (``max_token_lifetime`` after retirement);
* ``revoked-keys.json``: keys distrusted at once by ``uomp keys rotate --revoke-old``
  (``{"keys": [{"kid", "jkt", "revoked_at"}]}``). A *retired* key (in ``jwks.json`` with
  ``retired_at``) still verifies the tokens it signed until they expire; a *revoked* key verifies
  nothing, even if it reappears in ``jwks.json``;
* ``admin-token`` (0600): the credential the ``uomp`` CLI presents to the management API.

Before a key file is read, the data directory and ``.secrets`` must be owned by the user and not
group/other-writable (:func:`check_home`): keys found in a directory someone else controls are not
trusted. A running guard and gateway reload the keys at once on SIGHUP, which the commands that
change them send (:func:`gateway.reloads.notify_running`), and notice a file changed by hand within
their fallback look (:class:`KeyWatch`; the guard's ``key_watch_fallback_seconds``, the gateway's
``tls_watch_interval_seconds``).

Nothing here regenerates a key silently: a file that exists but cannot be read or parsed is a
``KEY_ERROR`` telling the user which file, never a new key that would orphan every live token.
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.atrest import vault
from gateway.config import Paths
from gateway.core import jose
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import Stamps, atomic_write, check_parents, check_private_dir, ensure_private_dir, stamps

# How often a running guard / gateway looks at the key files for a rotation or revocation.


def revoked_keys_path(paths: Paths) -> Path:
    return paths.revoked_keys


def check_home(paths: Paths, *, parents: bool = True) -> None:
    """UNSAFE_PERMISSIONS when the data directory, ``.secrets`` or ``ca/`` (those that exist) is
    owned by another user or writable by group/others, or (``parents``) a parent directory lets
    another user replace the data directory. Like ssh's StrictModes."""
    if parents:
        check_parents(paths.home)
    check_private_dir(paths.home, "data directory")
    check_private_dir(paths.secrets, "secrets directory")
    check_private_dir(paths.ca_dir, "CA directory")


def _check_secrets(paths: Paths) -> None:
    check_private_dir(paths.home, "data directory")
    check_private_dir(paths.secrets, "secrets directory")


def _new_kid() -> str:
    return "uomp-" + time.strftime("%Y%m%d", time.gmtime()) + "-" + secrets.token_hex(4)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{path} exists but cannot be read as JSON ({type(exc).__name__}); "
            "fix or restore it: keys are never regenerated silently",
        ) from exc


def _read_private_json(path: Path) -> Any:
    """A private key file as JSON, opened first when its home is sealed (gateway/atrest/vault.py)."""
    try:
        return json.loads(vault.read_key(path))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{path} exists but cannot be read as JSON ({type(exc).__name__}); "
            "fix or restore it: keys are never regenerated silently",
        ) from exc


def _dump(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


@dataclass(frozen=True)
class SigningKey:
    kid: str
    key: ed25519.Ed25519PrivateKey


def init_keys(paths: Paths) -> bool:
    """Create the signing key and JWKS if absent. Returns True when a key was made."""
    ensure_private_dir(paths.home, "data directory")
    ensure_private_dir(paths.secrets, "secrets directory")
    if paths.private_jwk.exists():
        load_signing_key(paths)  # validates; raises KEY_ERROR if broken
        if not paths.jwks.exists():
            _write_jwks(paths, [jose.public_jwk(load_signing_key(paths).key, kid=load_signing_key(paths).kid)])
        return False
    if paths.jwks.exists() or paths.public_jwk.exists():
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{paths.private_jwk} is missing but public keys exist; "
            "restore the private key or remove the .secrets directory deliberately",
        )
    key = ed25519.Ed25519PrivateKey.generate()
    kid = _new_kid()
    _install(paths, key, kid, previous=[])
    return True


def _write_jwks(paths: Paths, keys: list[dict[str, Any]]) -> None:
    atomic_write(paths.jwks, _dump({"keys": keys}), mode=0o644)


def _install(paths: Paths, key: ed25519.Ed25519PrivateKey, kid: str, previous: list[dict[str, Any]]) -> None:
    pub = jose.public_jwk(key, kid=kid)
    pub["alg"] = "EdDSA"
    # Order matters for a crash: the JWKS (what verifiers trust) first, then the private key, so a
    # crash in between leaves an extra trusted key, never a signing key nobody trusts.
    _write_jwks(paths, [pub, *previous])
    vault.write_key(paths.private_jwk, _dump(jose.private_jwk(key, kid=kid)))
    atomic_write(paths.public_jwk, _dump(pub), mode=0o644)


def load_signing_key(paths: Paths) -> SigningKey:
    _check_secrets(paths)
    try:
        st = paths.private_jwk.stat()
    except FileNotFoundError as exc:
        raise UompError(ErrorCode.KEY_ERROR, f"no signing key at {paths.private_jwk}; run 'uomp init'") from exc
    if st.st_mode & 0o077:
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"{paths.private_jwk} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it",
        )
    jwk = _read_private_json(paths.private_jwk)
    try:
        key = jose.load_private_jwk(jwk)
    except ValueError as exc:
        raise UompError(ErrorCode.KEY_ERROR, f"{paths.private_jwk} is not a valid Ed25519 private JWK: {exc}") from exc
    kid = jwk.get("kid")
    if not isinstance(kid, str) or not kid:
        raise UompError(ErrorCode.KEY_ERROR, f"{paths.private_jwk} has no kid")
    kids, jkts = _revoked(paths)
    if kid in kids or jose.key_thumbprint(key.public_key()) in jkts:
        raise UompError(
            ErrorCode.KEY_ERROR,
            f"the signing key {kid} in {paths.private_jwk} was revoked; run 'uomp keys rotate' to make a new one",
        )
    return SigningKey(kid, key)


def _revoked(paths: Paths) -> tuple[set[str], set[str]]:
    """(kids, RFC 7638 thumbprints) of revoked signing keys."""
    path = revoked_keys_path(paths)
    try:
        doc = _read_json(path)
    except FileNotFoundError:
        return set(), set()
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise UompError(ErrorCode.KEY_ERROR, f"{path} has no 'keys' list; fix or restore it")
    kids = {e["kid"] for e in entries if isinstance(e.get("kid"), str)}
    jkts = {e["jkt"] for e in entries if isinstance(e.get("jkt"), str)}
    return kids, jkts


def revoked_kids(paths: Paths) -> set[str]:
    return _revoked(paths)[0]


def load_public_keys(
    paths: Paths, *, now: float | None = None, max_token_lifetime: float | None = None
) -> dict[str, jose.PublicKey]:
    """kid -> public key for every key still accepted.

    Reads ``jwks.json``; a data directory written by the TypeScript reference has only
    ``ed25519-public.jwk``, which is then the one trusted key. Revoked keys are never returned.
    """
    _check_secrets(paths)
    revoked_kids_, revoked_jkts = _revoked(paths)
    if paths.jwks.exists():
        doc = _read_json(paths.jwks)
        entries = doc.get("keys") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise UompError(ErrorCode.KEY_ERROR, f"{paths.jwks} has no 'keys' list")
    elif paths.public_jwk.exists():
        entries = [_read_json(paths.public_jwk)]
    else:
        raise UompError(ErrorCode.KEY_ERROR, f"no public keys in {paths.secrets}; run 'uomp init'")
    out: dict[str, jose.PublicKey] = {}
    for jwk in entries:
        kid = jwk.get("kid") if isinstance(jwk, dict) else None
        if not isinstance(kid, str):
            raise UompError(ErrorCode.KEY_ERROR, f"a key in {paths.secrets} has no kid")
        retired = jwk.get("retired_at")
        if (
            retired is not None
            and now is not None
            and max_token_lifetime is not None
            and now > float(retired) + max_token_lifetime
        ):
            continue
        try:
            pub = jose.load_public_jwk(jwk)
        except ValueError as exc:
            raise UompError(ErrorCode.KEY_ERROR, f"public key {kid} is invalid: {exc}") from exc
        if kid in revoked_kids_ or jose.key_thumbprint(pub) in revoked_jkts:
            continue  # revoked: distrusted at once, whatever jwks.json says
        out[kid] = pub
    if not out:
        raise UompError(ErrorCode.KEY_ERROR, "no usable public key")
    return out


def rotate(paths: Paths, *, max_token_lifetime: float, now: float | None = None, revoke_old: bool = False) -> str:
    """Make a new signing key. Returns the new kid.

    By default the old public key stays trusted (retired) until no token it signed can be alive.
    ``revoke_old``: every earlier key (the current one and any retired one) is revoked instead:
    dropped from ``jwks.json`` and listed in ``revoked-keys.json``, so every token they signed is
    refused as soon as the guard and gateway reload their keys (they watch the files).
    """
    now = time.time() if now is None else now
    current = load_signing_key(paths)
    doc = _read_json(paths.jwks) if paths.jwks.exists() else {"keys": []}
    if revoke_old:
        old: list[dict[str, Any]] = [j for j in doc.get("keys", []) if isinstance(j, dict)]
        old.append(jose.public_jwk(current.key, kid=current.kid))
        kid = _new_kid()
        # The new JWKS (the new key alone) first: from that instant nothing old verifies here.
        _install(paths, ed25519.Ed25519PrivateKey.generate(), kid, previous=[])
        _record_revoked(paths, old, now)
        return kid
    kept: list[dict[str, Any]] = []
    for jwk in doc.get("keys", []):
        if jwk.get("kid") == current.kid:
            jwk = {**jwk, "retired_at": int(now)}
        retired = jwk.get("retired_at")
        if retired is not None and now > float(retired) + max_token_lifetime:
            continue  # nothing it signed can still be valid
        kept.append(jwk)
    if not any(j.get("kid") == current.kid for j in kept):
        kept.append({**jose.public_jwk(current.key, kid=current.kid), "alg": "EdDSA", "retired_at": int(now)})
    kid = _new_kid()
    _install(paths, ed25519.Ed25519PrivateKey.generate(), kid, previous=kept)
    return kid


def _record_revoked(paths: Paths, jwks: list[dict[str, Any]], now: float) -> None:
    path = revoked_keys_path(paths)
    try:
        doc = _read_json(path)
    except FileNotFoundError:
        doc = {"keys": []}
    entries: list[dict[str, Any]] = [e for e in doc.get("keys", []) if isinstance(e, dict)]
    have = {e.get("kid") for e in entries}
    for jwk in jwks:
        kid = jwk.get("kid")
        if not isinstance(kid, str) or kid in have:
            continue
        try:
            jkt = jose.key_thumbprint(jose.load_public_jwk(jwk))
        except ValueError:
            jkt = None
        entries.append({"kid": kid, "jkt": jkt, "revoked_at": int(now)})
        have.add(kid)
    atomic_write(path, _dump({"keys": entries}), mode=0o644)


def key_files(paths: Paths) -> tuple[Path, ...]:
    """The files a running guard or gateway reloads its keys from (what :class:`KeyWatch` watches)."""
    return (paths.jwks, paths.public_jwk, paths.private_jwk, revoked_keys_path(paths))


class KeyWatch:
    """Notices a change of the key files (rotation, revocation) by their stat stamps; cheap to poll."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self._stamp = self._read()

    def _read(self) -> Stamps:
        return stamps(key_files(self.paths))

    def changed(self) -> bool:
        """True once after each change (the next call compares with what this one saw)."""
        stamp = self._read()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


# ------------------------------------------------------------------------- admin credential


def init_admin(paths: Paths) -> bool:
    ensure_private_dir(paths.secrets, "secrets directory")
    if paths.admin_credential.exists():
        load_admin(paths)
        return False
    vault.write_key(paths.admin_credential, ("uadm_" + secrets.token_urlsafe(32) + "\n").encode())
    return True


def load_admin(paths: Paths) -> str:
    _check_secrets(paths)
    try:
        st = paths.admin_credential.stat()
        text = vault.read_key(paths.admin_credential).decode("utf-8", "replace").strip()
    except FileNotFoundError as exc:
        raise UompError(
            ErrorCode.KEY_ERROR, f"no admin credential at {paths.admin_credential}; run 'uomp init'"
        ) from exc
    except OSError as exc:
        raise UompError(ErrorCode.KEY_ERROR, f"cannot read {paths.admin_credential}: {exc.strerror}") from exc
    if st.st_mode & 0o077:
        raise UompError(ErrorCode.KEY_ERROR, f"{paths.admin_credential} is readable by others; chmod 600 it")
    if not text.startswith("uadm_") or len(text) < 40:
        raise UompError(ErrorCode.KEY_ERROR, f"{paths.admin_credential} is malformed")
    return text


def admin_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def init_home(paths: Paths) -> dict[str, bool]:
    """``uomp init``: data dir 0700, signing key, admin credential. Idempotent."""
    check_home(paths)
    ensure_private_dir(paths.home, "data directory")
    return {"signing_key": init_keys(paths), "admin_credential": init_admin(paths)}
