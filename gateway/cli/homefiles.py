"""The keys and certificates of a set-up data directory, each parsed, with what to do when one is
missing or broken. ``uomp doctor`` reports them; ``uomp gateway start`` refuses to run on a home
where one is missing or broken instead of making it anew.

Why not re-make at start: a file that vanished from a home that had it is news the user must hear
(a restore gone wrong, a disk fault, someone else). The repairs that are safe stay one explicit
command away (``uomp init`` re-makes a CA certificate from its key, a gateway certificate or a CRL
from the CA); the ones that are not (a CA key, the signing key, the CA's registry of issued and
revoked certificates) are never made silently: a new CA orphans every agent, and a new registry
would forget every revocation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from gateway import ca_store, keys
from gateway.config import Paths
from gateway.errors import ErrorCode, UompError

REMAKE = "run: uomp init (re-makes it from your CA; agents keep working)"
RESTORE = "restore it from your backup of {home}; it is never re-made silently"


@dataclass(frozen=True)
class FileProblem:
    """A file the home depends on that is missing or broken, and the fix to print."""

    path: Path
    what: str
    problem: str  # "is missing" or what is wrong with it
    fix: str
    code: ErrorCode = ErrorCode.KEY_ERROR
    cause: ErrorCode | None = None  # the code of the error that loading it raised, if any

    def error(self) -> UompError:
        return UompError(self.code, f"{self.what} {self.path} {self.problem}; {self.fix}")


def _loads(check: Callable[[], object]) -> tuple[str, ErrorCode | None] | None:
    try:
        check()
    except UompError as exc:
        return exc.message, exc.code
    except (OSError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}", None
    return None


def check(paths: Paths) -> tuple[list[FileProblem], list[str]]:
    """(problems, what was checked and is fine) for the files ``uomp init`` makes."""
    restore = RESTORE.format(home=paths.home)
    bad: list[FileProblem] = []
    good: list[str] = []

    def one(
        path: Path,
        what: str,
        load: Callable[[], object],
        fix_missing: str,
        *,
        code: ErrorCode = ErrorCode.KEY_ERROR,
        fix_broken: str | None = None,
    ) -> bool:
        if not path.exists():
            bad.append(FileProblem(path, what, "is missing", fix_missing, code))
            return False
        failed = _loads(load)
        if failed is not None:
            why, cause = failed
            bad.append(FileProblem(path, what, f"cannot be used ({why})", fix_broken or restore, code, cause))
            return False
        good.append(f"{what} {path}")
        return True

    one(paths.private_jwk, "signing key", lambda: keys.load_signing_key(paths), restore)
    one(paths.admin_credential, "admin credential", lambda: keys.load_admin(paths), restore)
    ca_key = one(
        ca_store.ca_key_path(paths),
        "CA key",
        lambda: ca_store.load_key_file(ca_store.ca_key_path(paths), "CA key"),
        restore,
    )
    ca_cert = one(
        ca_store.ca_cert_path(paths),
        "CA certificate",
        lambda: ca_store.load_ca(paths),
        REMAKE if ca_key else restore,
        code=ErrorCode.CA_ERROR,
        fix_broken=f"move it aside and {REMAKE}" if ca_key else restore,
    )
    server_key = one(
        ca_store.server_key_path(paths),
        "gateway key",
        lambda: ca_store.load_key_file(ca_store.server_key_path(paths), "gateway key"),
        REMAKE,
        fix_broken=f"move it and ca/gateway.crt aside, then {REMAKE}",
    )
    if ca_key and ca_cert:
        ca_cert_obj = ca_store.load_ca_cert(paths)

        def server() -> None:
            cert = x509.load_pem_x509_certificate(ca_store.server_cert_path(paths).read_bytes())
            key = ca_store.load_key_file(ca_store.server_key_path(paths), "gateway key")
            if cert.public_key() != key.public_key():
                raise ValueError("it does not match ca/gateway.key")
            try:
                cert.verify_directly_issued_by(ca_cert_obj)
            except (InvalidSignature, ValueError, TypeError) as exc:
                raise ValueError("it was not issued by your CA") from exc

        def crl() -> None:
            c = x509.load_pem_x509_crl(ca_store.crl_path(paths).read_bytes())
            if not c.is_signature_valid(ca_cert_obj.public_key()):  # type: ignore[arg-type]
                raise ValueError("it is not signed by your CA")

        if server_key:
            one(
                ca_store.server_cert_path(paths),
                "gateway certificate",
                server,
                REMAKE,
                code=ErrorCode.CA_ERROR,
                fix_broken=f"move it aside and {REMAKE}",
            )
        one(
            ca_store.crl_path(paths),
            "CRL",
            crl,
            REMAKE,
            code=ErrorCode.CA_ERROR,
            fix_broken=f"move it aside and {REMAKE}",
        )
        registry = (
            paths.ca_registry
            if paths.ca_registry.exists() or not paths.ca_registry_legacy.exists()
            else paths.ca_registry_legacy
        )  # an older home's JSON registry, migrated on first use
        one(
            registry,
            "CA registry",
            lambda: None,
            restore + ": it lists every certificate your CA issued and revoked, and a new one would forget every "
            "revocation",
            code=ErrorCode.CA_ERROR,
        )
    return bad, good


def require_intact(paths: Paths) -> None:
    """At start on a home that was set up: the first missing or broken file, as the error."""
    bad, _ = check(paths)
    if bad:
        raise bad[0].error()
