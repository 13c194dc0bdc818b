"""The trust material the VPS gateway needs from home, carried over the uplink: the agent CA's CRL,
the token-verification keys (``jwks.json``) and the revoked signing keys (``revoked-keys.json``).

How it travels: the gateway (the uplink's HTTP/2 client) keeps one long-poll stream of its own on
the pinned home connection, ``GET /uplink/v1/trust?have=ETAG`` with the ``:authority``
:data:`AUTHORITY` (agent requests are always forwarded with another authority, and the gateway's
route table has no such path: an agent can neither ask for nor answer it). The home side answers
it itself (never the guard): at once when its files differ from ``have`` (so on every connect and
on every change, seen within :data:`LOOK_SECONDS`), else 204 after at most ``wait`` seconds.

What the VPS accepts (:class:`TrustSink`), each part on its own:

* the CRL only through :meth:`gateway.remote.tls.TLSReloader.install_crl`: parsed, signed by the
  agent CA the listener trusts, not past nextUpdate, never older (CRL Number, thisUpdate) than the
  newest accepted; then written atomically and loaded for new handshakes (and the per-request
  check of serials on live connections);
* ``jwks.json``: a ``keys`` list of public JWKs, each with a ``kid`` and no private member;
* ``revoked-keys.json``: never shrinks (a key revoked on the VPS stays revoked).

A refused part is logged and counted, and the files held stay as they were.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gateway.config import Paths
from gateway.core import jose
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import Stamps, atomic_write, ensure_private_dir, stamps
from gateway.remote.tls import CRLMark

log = logging.getLogger("uomp.uplink")

AUTHORITY = b"uomp-uplink"  # the :authority of the gateway's own streams (agents' are "uomp-guard")
PATH = "/uplink/v1/trust"
MAX_PART_BYTES = 4 * 1024 * 1024  # one CRL / jwks.json / revoked-keys.json
MAX_BUNDLE_BYTES = 3 * MAX_PART_BYTES * 2  # JSON-escaped
MAX_WAIT = 30.0  # the longest a long-poll is held at home
WAIT = 20.0  # what the gateway asks for
LOOK_SECONDS = 0.2  # the home side looks at its files this often while a poll is held
PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "k"})
PARTS = ("crl", "jwks", "revoked_keys")


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_PART_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_PART_BYTES:
        raise UompError(ErrorCode.CONFIG_ERROR, f"{path} is larger than {MAX_PART_BYTES} bytes")
    return data


@dataclass(frozen=True)
class Bundle:
    """The files as read at home (None: that file does not exist there) and their digest."""

    crl: bytes | None
    jwks: bytes | None
    revoked_keys: bytes | None

    @property
    def etag(self) -> str:
        h = hashlib.sha256()
        for part in (self.crl, self.jwks, self.revoked_keys):
            h.update(b"-" if part is None else b"+%d:" % len(part) + part)
        return h.hexdigest()[:32]

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"etag": self.etag}
        for name in PARTS:
            part = getattr(self, name)
            doc[name] = None if part is None else part.decode("utf-8")
        return json.dumps(doc).encode()

    @staticmethod
    def decode(raw: bytes) -> Bundle:
        """The bundle of a home side's answer; UPSTREAM_ERROR when it is not one."""
        try:
            doc = json.loads(raw)
            parts: dict[str, bytes | None] = {}
            for name in PARTS:
                v = doc[name]
                if v is not None and not isinstance(v, str):
                    raise TypeError(name)
                parts[name] = None if v is None else v.encode("utf-8")
                if v is not None and len(parts[name] or b"") > MAX_PART_BYTES:
                    raise ValueError(name)
        except (ValueError, KeyError, TypeError) as exc:
            raise UompError(ErrorCode.UPSTREAM_ERROR, "the home side's trust answer is not a trust bundle") from exc
        return Bundle(parts["crl"], parts["jwks"], parts["revoked_keys"])


# ------------------------------------------------------------------------------------ home


class TrustSource:
    """At home: the CRL and the key files as they are now, read again only when a file changed."""

    def __init__(self, paths: Paths) -> None:
        self.files = (paths.crl, paths.jwks, paths.revoked_keys)
        self._stamp: Stamps | None = None
        self._bundle: Bundle | None = None
        self.sent_at: float | None = None  # a bundle last went to the gateway (wall clock)
        self.sent_etag: str | None = None
        self.acked_at: float | None = None  # the gateway last said it holds what was sent
        self.vps_crl_number: int | None = None  # the CRL Number the gateway says it holds

    def _stamps(self) -> Stamps:
        return stamps(self.files)

    def current(self) -> Bundle:
        """The bundle of the files now (a file replaced while read is read again next time)."""
        stamp = self._stamps()
        if self._bundle is None or stamp != self._stamp:
            crl, jwks, revoked = (_read(p) for p in self.files)
            self._bundle = Bundle(crl, jwks, revoked)
            self._stamp = stamp if stamp == self._stamps() else None
        return self._bundle

    def polled(self, have: str, vps_crl: int | None) -> None:
        """The gateway polled saying it holds ``have`` (and CRL Number ``vps_crl``)."""
        if vps_crl is not None:
            self.vps_crl_number = vps_crl
        if have and have == self.sent_etag:
            self.acked_at = time.time()

    def sent(self, bundle: Bundle) -> None:
        self.sent_at = time.time()
        self.sent_etag = bundle.etag


# ------------------------------------------------------------------------------------- VPS


class CrlInstaller(Protocol):
    """What installs a CRL on the gateway (:class:`gateway.remote.tls.TLSReloader`)."""

    crl_mark: CRLMark | None

    def install_crl(self, pem: bytes) -> bool: ...


def _check_jwks(raw: bytes) -> None:
    try:
        doc = json.loads(raw)
        keys = doc["keys"]
        if not isinstance(keys, list) or not keys:
            raise ValueError("no keys")
        for jwk in keys:
            if not isinstance(jwk, dict) or not isinstance(jwk.get("kid"), str) or PRIVATE_MEMBERS & jwk.keys():
                raise ValueError("a key without kid, or with a private member")
            jose.load_public_jwk(jwk)
    except (ValueError, KeyError, TypeError, UompError) as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, "the jwks.json received is not a set of public keys") from exc


def _revoked_kids(raw: bytes) -> set[str]:
    try:
        doc = json.loads(raw)
        entries = doc["keys"]
        if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("kid"), str) for e in entries
        ):
            raise ValueError("bad entries")
    except (ValueError, KeyError, TypeError) as exc:
        raise UompError(ErrorCode.CONFIG_ERROR, "the revoked-keys.json received is not a revoked-key list") from exc
    return {e["kid"] for e in entries}


class TrustSink:
    """On the VPS: apply what the home side sent (see the module's docstring for what is accepted)."""

    def __init__(self, paths: Paths, crl: CrlInstaller, *, on_keys: Callable[[], None] | None = None) -> None:
        self.paths = paths
        self.crl = crl
        self.on_keys = on_keys  # the gateway reloads its verification keys (blocking)
        self.applied_etag = ""
        self.crl_pushed_at: float | None = None  # a CRL from home last accepted (wall clock)
        self.keys_pushed_at: float | None = None
        self.refused = 0
        self.last_refusal: str | None = None

    def _refuse(self, what: str, exc: UompError) -> None:
        self.refused += 1
        self.last_refusal = f"{what}: {exc.message}"
        log.warning("uplink: refused the %s sent from home: %s", what, exc.message)

    def apply(self, bundle: Bundle) -> None:
        """Blocking (file writes, a TLS reload): run it in a worker thread."""
        if bundle.crl is not None:
            try:
                self.crl.install_crl(bundle.crl)
                self.crl_pushed_at = time.time()
            except UompError as exc:
                self._refuse("CRL", exc)
        changed = False
        if bundle.revoked_keys is not None:
            try:
                changed |= self._revoked_keys(bundle.revoked_keys)
            except UompError as exc:
                self._refuse("revoked-keys.json", exc)
        if bundle.jwks is not None:
            try:
                _check_jwks(bundle.jwks)
                changed |= self._write(self.paths.jwks, bundle.jwks)
            except UompError as exc:
                self._refuse("jwks.json", exc)
        if changed:
            self.keys_pushed_at = time.time()
            if self.on_keys is not None:
                self.on_keys()
        self.applied_etag = bundle.etag

    def _revoked_keys(self, raw: bytes) -> bool:
        new = _revoked_kids(raw)
        try:
            held = _revoked_kids(self.paths.revoked_keys.read_bytes())
        except FileNotFoundError:
            held = set()
        except UompError:
            held = set()  # an unreadable local copy: the home's replaces it
        lost = held - new
        if lost:
            raise UompError(
                ErrorCode.CONFIG_ERROR,
                f"it no longer lists {len(lost)} key(s) revoked here; a revoked key stays revoked (kept the list)",
            )
        return self._write(self.paths.revoked_keys, raw)

    def _write(self, path: Path, data: bytes) -> bool:
        try:
            if path.read_bytes() == data:
                return False
        except OSError:
            pass
        ensure_private_dir(path.parent, "secrets directory")
        atomic_write(path, data, mode=0o644)
        return True

    @property
    def crl_number(self) -> int | None:
        """The CRL Number of the CRL held (None: none accepted yet)."""
        mark = self.crl.crl_mark
        return None if mark is None else mark.number

    def snapshot(self) -> dict[str, object]:
        return {
            "crl_number": self.crl_number,
            "crl_pushed_at": self.crl_pushed_at,
            "keys_pushed_at": self.keys_pushed_at,
            "refused": self.refused,
            "last_refusal": self.last_refusal,
        }


async def follow(
    fetch: Callable[[str], Awaitable[tuple[int, bytes]]],
    alive: Callable[[], bool],
    sink: TrustSink,
    retry_seconds: float,
) -> None:
    """The gateway's long-poll: ``fetch(target)`` the home's trust answer and apply each new bundle,
    while ``alive()`` (the link it runs on is the live one)."""
    loop = asyncio.get_running_loop()
    while alive():
        started = loop.time()
        crl = sink.crl_number
        target = f"{PATH}?have={sink.applied_etag}&wait={WAIT:g}" + (f"&crl={crl}" if crl is not None else "")
        try:
            status, raw = await fetch(target)
            if status == 204:  # nothing new within the wait (a home side that answers at once: paced)
                await asyncio.sleep(max(0.0, 1.0 - (loop.time() - started)))
                continue
            if status != 200 or len(raw) > MAX_BUNDLE_BYTES:
                raise UompError(ErrorCode.UPSTREAM_ERROR, f"the home side answered the trust poll {status}")
            await loop.run_in_executor(None, sink.apply, Bundle.decode(raw))
        except UompError as exc:
            if not alive():
                return
            log.warning("uplink: fetching the CRL and keys from home failed (%s); trying again", exc.message)
            await asyncio.sleep(retry_seconds)
        except Exception as exc:  # a broken apply never ends the loop silently
            log.warning("uplink: applying the CRL and keys from home failed (%s)", type(exc).__name__)
            await asyncio.sleep(retry_seconds)
