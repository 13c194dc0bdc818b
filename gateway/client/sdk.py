"""The Python agent SDK: read the user's memory through a UOMP gateway (spec §8, §10, §15, §19).

This module is the public client class (every call an agent makes) and its user documentation
below, a little over ~500 lines for that reason. It is built from parts, each in its module:
a :class:`~.transport.ClientTransport` (+ :mod:`.tls`: URLs, TLS, pools, one exchange), a
:class:`~.tokens.BundleFile` and :class:`~.tokens.TokenManager` (tokens, refresh, the bundle file),
a :class:`~.certs.CertificateRenewer` (the agent certificate and its renewal); :mod:`.payloads`
seals, :mod:`.options` holds the options and constants. It imports neither ``gateway.remote`` nor
``gateway.guard``: an agent installs the client without the server.

::

    async with UompClient.from_bundle("bundle.json") as uomp:
        item = await uomp.get("preference.theme")
        items = await uomp.by_tag("preference")

Three transports (``mode``):

``"mtls"`` (default for a bundle with a certificate and key)
    TLS 1.3 to the gateway's mTLS listener with the agent's client certificate on every
    connection. The gateway's certificate is verified against the CA in the bundle and nothing
    else (no system roots), with the host name checked (:func:`gateway.client.tls.build_client_context`).
    There is no switch to turn verification off. Tokens go as ``Authorization: Bearer``; the
    gateway checks they are bound to this certificate (RFC 8705 ``cnf``).
``"dpop"`` (for the Cloudflare quick-tunnel URL)
    TLS ends at the tunnel's edge, so no client certificate can reach the gateway. Instead every
    request carries an RFC 9449 DPoP proof signed by the agent key from the bundle (``htm``,
    ``htu``, ``iat``, ``ath``, a fresh ``jti``) and ``Authorization: DPoP <token>``. The server
    certificate is verified against the system trust store (or ``ca_file``), TLS 1.3 only.
``"bearer"`` (Local Profile, :meth:`UompClient.from_env`)
    ``UOM_TOKEN`` as ``Authorization: Bearer`` to the local guard (``http://127.0.0.1:9374``).

Plain ``http://`` is accepted only when the host is a loopback address (``127.0.0.0/8``, ``::1``)
or ``localhost``: the Local Profile, and the tunnel-origin listener that ``cloudflared`` (running
on the gateway's host) forwards to. Any other ``http://`` URL is refused; mTLS is https only.

``public_url`` (DPoP mode): the URL the agent addresses as the world sees it, used for the
proof's ``htu`` and the ``Host`` header, apart from the address the client connects to. This is
what ``cloudflared`` does: the agent asks ``https://xxx.trycloudflare.com/v1/memory/k``,
Cloudflare forwards it over the tunnel and ``cloudflared`` hands it to the loopback origin
(``http://127.0.0.1:<port>``) with ``Host: xxx.trycloudflare.com`` unchanged, so the gateway
checks the proof against the public URL. Connecting straight to the origin
(``base_url="http://127.0.0.1:PORT"``) with ``public_url`` set (by default the bundle's
``gateway_url``) reproduces those requests byte for byte, which is how the tests run.

Tokens (§15.5): the access token is refreshed before it expires (when less than
``refresh_before_seconds`` or ``refresh_before_fraction`` of its life remains) and once more when
the gateway answers ``TOKEN_EXPIRED`` (the request is then retried once). Refresh tokens rotate on
every use and a spent one presented again revokes the session, so: concurrent calls share ONE
refresh (an ``asyncio.Lock``, plus an ``flock`` on ``<bundle>.lock`` across processes), and the
rotated pair is written back to the bundle file (atomically, 0600) before the call returns; a
restarted agent then starts from the live refresh token, never from a spent one. Use one bundle
per agent instance; processes sharing one take turns through the lock and adopt what the other
wrote.

Certificates (mTLS): once ``renew_at_fraction`` (2/3) of the certificate's life has passed, the
next call first renews it over ``POST /v1/certificates/renew`` (same key), writes it to the bundle
(``agent_cert``) and moves new connections to it (connections in flight finish on the old one).
An expired certificate cannot be renewed (the renewal is authenticated by the certificate
itself): the call fails with :class:`CertificateError` ``CERT_EXPIRED`` and the user must issue a
new one. The gateway renews only in the last third of a certificate's life (``RENEWAL_TOO_EARLY``
before; ``renew_at_fraction`` must stay >= 2/3) and a few times per hour per agent (``RATE_LIMITED``).
:meth:`UompClient.renew_certificate` with ``csr_key`` rotates the key (the new key is then
stored in the bundle, ``agent_key``); note that tokens are bound to the key they were granted for,
so after a key rotation the user must authorize the agent again.

Bounded: every call has a total time-out and a connect time-out, answers are read up to
``max_response_bytes``, redirects are not followed (they would carry the token elsewhere).

Secrets: no token or key appears in a log line, an exception or a ``repr``. The SDK logs to the
``uomp.client`` logger (refreshes, renewals, session ids; never tokens, keys or memory values).

Longer than ~500 lines on purpose: the SDK's public API, one method per protocol call with its
documented behaviour; the transport, the tokens and the certificates live in their own modules.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import hashlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote, urlsplit

from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.bundle import AgentBundle, load_bundle
from gateway.client import payloads, witness
from gateway.client.certs import CertificateRenewer, bundle_key
from gateway.client.errors import (
    AuditCheckpointInvalid,
    AuditLogForked,
    AuthError,
    ConfigError,
    ProtocolError,
    Unavailable,
    UompClientError,
    error_from_answer,
    scrub,
)
from gateway.client.options import (
    AGGREGATE_OPS,
    LOCAL_BASE_URL,
    RETRY_UPLOAD_CODES,
    RETRY_UPLOAD_STATUSES,
    SEGMENT_SAFE,
    AgentKey,
    ClientOptions,
    JSONObject,
    Mode,
    RenewedCertificate,
    log,
)
from gateway.client.tokens import BundleFile, TokenManager, token_claims
from gateway.client.transport import ClientTransport, check_url
from gateway.core.canonical import canonical_json
from gateway.core.deletion import sign_deletion_proof
from gateway.core.envelope import parse_public_key
from gateway.core.sealing import Binding
from gateway.core.tokens import iso
from gateway.errors import UompError

# the codes of a session that can no longer be used (is_active: False rather than an error)
ENDED_CODES = frozenset({"SESSION_REVOKED", "TOKEN_EXPIRED", "SESSION_NOT_FOUND", "REFRESH_REUSED"})


def memory_hash(items: Iterable[Mapping[str, Any]]) -> str:
    """``sha256:<hex>`` over the keys and values the agent read, for a deletion proof (§19.3).

    The spec says "SHA-256 of all accessed memory item keys concatenated with their values"; this
    SDK makes that unambiguous as SHA-256 of the RFC 8785 canonical JSON of ``[[key, value], ...]``
    sorted by key (one entry per key). Anyone holding the same items computes the same hash.
    """
    pairs: dict[str, Any] = {}
    for item in items:
        key = item.get("key")
        if not isinstance(key, str):
            raise ValueError("every item needs a string 'key'")
        pairs[key] = item.get("value")
    doc = [[k, pairs[k]] for k in sorted(pairs)]
    return "sha256:" + hashlib.sha256(canonical_json(doc)).hexdigest()


def _refuses_trailer(status: int, answer: Any) -> bool:
    """A gateway that takes the envelope's hash only before the bytes refused one that follows them
    (400 INVALID_REQUEST naming the hash field)."""
    err = answer.get("error") if isinstance(answer, dict) else None
    return (
        status == 400
        and isinstance(err, dict)
        and err.get("code") == "INVALID_REQUEST"
        and "field hash" in str(err.get("message", ""))
    )


# ------------------------------------------------------------------------------- the client


class UompClient:
    """An async UOMP client for one session of one agent. See the module docstring.

    Build it with :meth:`from_bundle` (Remote Profile) or :meth:`from_env`; the constructor is the
    low-level form both use. Use ``async with client:`` (or call :meth:`aclose`).
    """

    def __init__(
        self,
        *,
        agent_id: str,
        session_id: str,
        access_token: str,
        base_url: str,
        access_expires_at: str | float | None = None,
        refresh_token: str | None = None,
        refresh_expires_at: str | float | None = None,
        mode: Mode = "bearer",
        ca_cert: str | None = None,
        agent_cert: str | None = None,
        agent_key: AgentKey | None = None,
        bundle: AgentBundle | None = None,
        bundle_path: str | os.PathLike[str] | None = None,
        public_url: str | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        options: ClientOptions | None = None,
        clock: Callable[[], float] = time.time,
        witness_path: str | os.PathLike[str] | None = None,
        audit_verifier_key: str | None = None,
    ) -> None:
        if mode not in ("mtls", "dpop", "bearer"):
            raise ConfigError("CONFIG_ERROR", "mode must be mtls, dpop or bearer")
        if not agent_id or not session_id or not access_token:
            raise ConfigError("CONFIG_ERROR", "agent_id, session_id and an access token are required")
        self._agent_id = agent_id
        self._session_id = session_id
        opts = options or ClientOptions()
        base = check_url(base_url, "base_url", allow_loopback_http=mode != "mtls")
        bundle_file = Path(bundle_path) if bundle_path is not None else None
        if bundle_file is not None and bundle is None:
            raise ConfigError("CONFIG_ERROR", "bundle_path needs the bundle it was loaded from")
        # the agent as a witness of the audit log (gateway/client/witness.py): the kept checkpoints live
        # beside the bundle unless told otherwise; the trusted audit key is the bundle's
        if witness_path is None and bundle_file is not None:
            witness_path = bundle_file.parent / witness.WITNESS_FILE
        self._witness = (
            None
            if witness_path is None
            else witness.WitnessFile(Path(witness_path), lock_timeout_seconds=opts.lock_timeout_seconds)
        )
        self._audit_vkey = audit_verifier_key or (bundle.audit_verifier_key if bundle is not None else None)

        # where requests are addressed (DPoP htu, Host) vs where the client connects
        base_parts = urlsplit(base)
        public = base
        host_header = None
        if public_url is not None and mode != "dpop":
            raise ConfigError("CONFIG_ERROR", "public_url is for DPoP mode (a tunnel origin) only")
        if mode == "dpop":
            if agent_key is None:
                raise ConfigError("CONFIG_ERROR", "DPoP mode needs the agent key (bundle agent_key or agent_key_file)")
            if public_url is not None:
                public = check_url(public_url, "public_url", allow_loopback_http=False)
            elif base_parts.scheme == "http":
                raise ConfigError(
                    "CONFIG_ERROR",
                    "DPoP to a loopback http:// origin needs public_url: the https:// "
                    "URL cloudflared serves (proofs are checked against it)",
                )
            pub_parts = urlsplit(public)
            if public != base:
                if base_parts.scheme != "http":
                    raise ConfigError(
                        "CONFIG_ERROR",
                        "public_url may differ from base_url only when base_url is the "
                        "loopback tunnel origin (http://127.0.0.1:PORT)",
                    )
                if pub_parts.path.rstrip("/") != base_parts.path.rstrip("/"):
                    raise ConfigError("CONFIG_ERROR", "public_url and base_url must have the same path")
                host_header = pub_parts.netloc
        if ca_file is not None and mode == "mtls":
            raise ConfigError("CONFIG_ERROR", "mTLS trusts the CA in the bundle only; ca_file is for dpop/bearer")

        self._opts = opts
        # the parts: the transport, the bundle file, the tokens and the certificate over them
        self._transport = ClientTransport(
            mode=mode,
            agent_id=agent_id,
            session_id=session_id,
            options=opts,
            base=base,
            public=public,
            host_header=host_header,
            ca_file=Path(ca_file) if ca_file is not None else None,
            ca_cert=ca_cert,
            key=agent_key,
        )
        self._bundle = BundleFile(
            bundle, bundle_file, session_id=session_id, lock_timeout_seconds=opts.lock_timeout_seconds
        )
        self._tokens = TokenManager(
            self._transport,
            self._bundle,
            session_id=session_id,
            options=opts,
            clock=clock,
            access_token=access_token,
            access_expires_at=access_expires_at,
            refresh_token=refresh_token,
            refresh_expires_at=refresh_expires_at,
        )
        self._certs = CertificateRenewer(
            self._transport,
            self._bundle,
            agent_id=agent_id,
            session_id=session_id,
            options=opts,
            clock=clock,
            ca_cert=ca_cert,
            secrets=self._tokens.recent,
        )
        if mode == "mtls":
            if not ca_cert or not agent_cert or agent_key is None:
                raise ConfigError("CONFIG_ERROR", "mTLS needs the CA certificate, the agent certificate and its key")
            self._certs.set_certificate(agent_cert, agent_key)

    # ----------------------------------------------------------------------- constructors

    @classmethod
    def from_bundle(
        cls,
        path: str | os.PathLike[str],
        *,
        mode: Literal["auto", "mtls", "dpop"] = "auto",
        base_url: str | None = None,
        public_url: str | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        options: ClientOptions | None = None,
        clock: Callable[[], float] = time.time,
    ) -> UompClient:
        """A client from the agent bundle ``uomp authorize --remote`` wrote (mode 0600).

        ``mode="auto"``: mTLS (the bundle has a certificate and key). ``mode="dpop"``: through the
        tunnel; ``base_url`` then defaults to the bundle's ``gateway_url`` (the tunnel URL), and when
        ``base_url`` is the loopback origin ``public_url`` defaults to the bundle's ``gateway_url``.
        Rotated tokens and renewed certificates are written back to ``path``.
        """
        p = Path(path)
        try:
            bundle = load_bundle(p)
        except UompError as exc:
            raise ConfigError("CONFIG_ERROR", exc.message) from None
        key = bundle_key(bundle, p)
        chosen: Mode
        if mode == "auto":
            if not bundle.agent_cert or key is None:
                raise ConfigError(
                    "CONFIG_ERROR",
                    "the bundle has no agent certificate and key for mTLS (made with "
                    "--cert?); add agent_key_file or use mode='dpop'",
                )
            chosen = "mtls"
        elif mode in ("mtls", "dpop"):
            chosen = mode
        else:
            raise ConfigError("CONFIG_ERROR", "mode must be auto, mtls or dpop")
        base = base_url or bundle.gateway_url
        if chosen == "dpop" and public_url is None and urlsplit(base).scheme == "http":
            public_url = bundle.gateway_url
        return cls(
            agent_id=bundle.agent_id,
            session_id=bundle.session_id,
            access_token=bundle.access_token,
            access_expires_at=bundle.access_expires_at,
            refresh_token=bundle.refresh_token,
            refresh_expires_at=bundle.refresh_expires_at,
            base_url=base,
            mode=chosen,
            ca_cert=bundle.ca_cert,
            agent_cert=bundle.agent_cert,
            agent_key=key,
            bundle=bundle,
            bundle_path=p,
            public_url=public_url,
            ca_file=ca_file,
            options=options,
            clock=clock,
        )

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        options: ClientOptions | None = None,
        clock: Callable[[], float] = time.time,
    ) -> UompClient:
        """``UOMP_BUNDLE`` set: :meth:`from_bundle` (``UOMP_BASE_URL`` overrides its URL, ``UOMP_MODE``
        = ``auto``/``mtls``/``dpop`` picks the transport). Otherwise the Local Profile: ``UOM_TOKEN`` as
        a bearer token to ``UOMP_BASE_URL`` (default ``http://127.0.0.1:9374``), no refresh, no client
        certificate."""
        values = os.environ if env is None else env
        bundle = values.get("UOMP_BUNDLE")
        base = values.get("UOMP_BASE_URL") or None
        if bundle:
            modes: dict[str, Literal["auto", "mtls", "dpop"]] = {"auto": "auto", "mtls": "mtls", "dpop": "dpop"}
            mode = modes.get(values.get("UOMP_MODE") or "auto")
            if mode is None:
                raise ConfigError("CONFIG_ERROR", "UOMP_MODE must be auto, mtls or dpop")
            return cls.from_bundle(bundle, mode=mode, base_url=base, options=options, clock=clock)
        token = values.get("UOM_TOKEN", "").strip()
        if not token:
            raise ConfigError("CONFIG_ERROR", "set UOM_TOKEN (and UOMP_BASE_URL), or UOMP_BUNDLE")
        claims = token_claims(token)
        agent_id, session_id = claims.get("agent_id"), claims.get("session_id")
        if not isinstance(agent_id, str) or not isinstance(session_id, str):
            raise ConfigError("CONFIG_ERROR", "UOM_TOKEN is not a UOMP capability token")
        return cls(
            agent_id=agent_id,
            session_id=session_id,
            access_token=token,
            base_url=base or LOCAL_BASE_URL,
            mode="bearer",
            options=options,
            clock=clock,
        )

    # ------------------------------------------------------------------------- properties

    @property
    def agent_id(self) -> str:
        return self._agent_id

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def mode(self) -> Mode:
        return self._transport.mode

    @property
    def base_url(self) -> str:
        return self._transport.base

    @property
    def public_url(self) -> str:
        return self._transport.public

    @property
    def access_expires_at(self) -> float:
        """When the current access token expires (seconds since the epoch)."""
        return self._tokens.access_exp

    @property
    def refresh_count(self) -> int:
        """Token rotations done by this client (for monitoring and tests)."""
        return self._tokens.refresh_count

    @property
    def certificate_serial(self) -> str | None:
        """The agent certificate's serial (hex), None without one (DPoP, bearer)."""
        return self._certs.serial

    @property
    def certificate_not_after(self) -> dt.datetime | None:
        """When the agent certificate expires, None without one."""
        return self._certs.not_after

    def scrub(self, text: str) -> str:
        """``text`` with this client's live and recent tokens replaced by ``[redacted]`` (for a log
        line or a message that may quote one)."""
        return scrub(text, self._tokens.recent)

    def __repr__(self) -> str:
        return (
            f"UompClient(agent_id={self._agent_id!r}, session_id={self._session_id!r}, mode={self.mode!r}, "
            f"base_url={self.base_url!r}, tokens=<redacted>)"
        )

    __str__ = __repr__

    # ------------------------------------------------------------------------ life cycle

    async def open(self) -> None:
        """Create the connection pool (done on first use too)."""
        await self._transport.open()

    async def aclose(self) -> None:
        """Close every connection; the client cannot be used again."""
        await self._transport.aclose()

    async def __aenter__(self) -> UompClient:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -------------------------------------------------------------------------- the API

    async def get(self, key: str) -> JSONObject:
        """§10.2 ``GET /v1/memory/{key}``: one Memory Item."""
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty string")
        return self._object(await self._call("GET", "/v1/memory/" + quote(key, safe=SEGMENT_SAFE)))

    async def by_tag(self, tag: str) -> list[JSONObject]:
        """§10.3 ``GET /v1/memory?tag=``: every item with ``tag`` the grant lets through, following
        the pages' ``next`` cursors (one read query per page). For large tags use
        :meth:`iter_by_tag` (one page in memory) or :meth:`by_tag_page`."""
        return [item async for item in self.iter_by_tag(tag)]

    async def iter_by_tag(self, tag: str, *, limit: int | None = None) -> AsyncIterator[JSONObject]:
        """The items of :meth:`by_tag`, fetched a page (at most ``limit`` items) at a time."""
        cursor: str | None = None
        while True:
            items, nxt = await self.by_tag_page(tag, cursor=cursor, limit=limit)
            if nxt is not None and (nxt == cursor or not items):
                raise ProtocolError("BAD_RESPONSE", "the gateway's paging does not advance")
            for item in items:
                yield item
            if nxt is None:
                return
            cursor = nxt

    async def by_tag_page(
        self, tag: str, *, cursor: str | None = None, limit: int | None = None
    ) -> tuple[list[JSONObject], str | None]:
        """One page: its items and the opaque cursor of the next page (None after the last one)."""
        query = {"tag": tag}
        if cursor is not None:
            query["cursor"] = cursor
        if limit is not None:
            query["limit"] = str(int(limit))
        answer = self._object(await self._call("GET", "/v1/memory", query=query))
        nxt = answer.get("next")
        if nxt is not None and (not isinstance(nxt, str) or not nxt):
            raise ProtocolError("BAD_RESPONSE", "the gateway's answer has a malformed 'next' cursor")
        return self._list(answer, "items"), nxt

    async def aggregate(self, tag: str, op: str, field: str | None = None) -> JSONObject:
        """§10.5 ``GET /v1/memory/aggregate``: ``{"op", "result", ...}``, never item values."""
        if op not in AGGREGATE_OPS:
            raise ValueError(f"op must be one of {', '.join(AGGREGATE_OPS)}")
        query = {"tag": tag, "op": op}
        if field is not None:
            query["field"] = field
        return self._object(await self._call("GET", "/v1/memory/aggregate", query=query))

    async def propose(
        self,
        key: str,
        value: Any,
        *,
        tags: list[str] | None = None,
        sensitivity: str | None = None,
        description: str | None = None,
        base_version: int | None = None,
    ) -> JSONObject:
        """Propose creating or replacing ``key`` (docs/writes.md): nothing changes until the user
        approves it. The proposal (``proposal_id``, ``status`` "pending", ``base_version``)."""
        body: dict[str, Any] = {"value": value}
        for name, given in (
            ("tags", tags), ("sensitivity", sensitivity), ("description", description), ("base_version", base_version)
        ):  # fmt: skip
            if given is not None:
                body[name] = given
        return self._object(await self._call("PUT", "/v1/memory/" + quote(key, safe=SEGMENT_SAFE), body=body))

    async def propose_delete(self, key: str, *, base_version: int | None = None) -> JSONObject:
        """Propose deleting ``key``; it stays until the user approves."""
        body = {"base_version": base_version} if base_version is not None else None
        return self._object(await self._call("DELETE", "/v1/memory/" + quote(key, safe=SEGMENT_SAFE), body=body))

    async def proposals(self) -> list[JSONObject]:
        """This session's own proposals and their outcome (pending, approved, rejected, ...)."""
        return self._list(self._object(await self._call("GET", "/v1/proposals")), "proposals")

    async def withdraw(self, proposal_id: str) -> JSONObject:
        """Take back one of this session's pending proposals."""
        path = "/v1/proposals/" + quote(proposal_id, safe=SEGMENT_SAFE) + "/withdraw"
        return self._object(await self._call("POST", path))

    async def audit(self, limit: int | None = None) -> list[JSONObject]:
        """§18 ``GET /v1/audit``: this session's audit entries (newest first, ``limit`` 1-1000)."""
        query = {"session_id": self._session_id}
        if limit is not None:
            query["limit"] = str(int(limit))
        return self._list(self._object(await self._call("GET", "/v1/audit", query=query)), "logs")

    async def audit_proof(self, event_id: str) -> JSONObject:
        """``GET /v1/audit/{event_id}/proof``: the proof bundle of one of this session's allowed events
        (check it offline with ``gateway.ledger.verify.verify_bundle`` or ``uomp audit verify-proof``).
        Checked here first: the checkpoint's signature, the event's inclusion in it, and the log's
        consistency with the checkpoint this agent kept (:meth:`audit_checkpoint`)."""
        if not isinstance(event_id, str) or not event_id:
            raise ValueError("event_id must be a non-empty string")
        return await self._witnessed(f"/v1/audit/{quote(event_id, safe=SEGMENT_SAFE)}/proof", bundle=True)

    async def audit_checkpoint(self) -> JSONObject:
        """``GET /v1/audit/checkpoint?since=<kept size>``: the log's newest signed checkpoint, checked
        against the one this agent kept (signature under the bundle's ``audit_verifier_key``, RFC 9162
        consistency), which it then replaces. A log that does not extend the kept checkpoint raises
        :class:`~gateway.client.errors.AuditLogForked` (``AUDIT_LOG_INCONSISTENT``) and the kept one stays."""
        return await self._witnessed("/v1/audit/checkpoint", bundle=False)

    async def _witnessed(self, path: str, *, bundle: bool) -> JSONObject:
        store = self._witness
        gateway = self._transport.public
        kept = None if store is None else await asyncio.to_thread(store.get, gateway)
        try:
            answer = self._object(
                await self._call("GET", path, query=None if kept is None else {"since": str(kept.tree_size)})
            )
        except UompClientError as exc:
            if exc.code == "AUDIT_SIZE_UNKNOWN" and kept is not None:
                raise AuditLogForked(
                    "AUDIT_LOG_INCONSISTENT",
                    f"the gateway's audit log never signed tree size "
                    f"{kept.tree_size}, which this agent verified before: the log was rolled back "
                    "or forked; keep uomp-checkpoints.json as evidence and tell the user",
                    exc.status,
                    self._session_id,
                ) from None
            raise
        sent_key = answer.get("verifier_key")
        vkey = self._audit_vkey or (kept.verifier_key if kept is not None else sent_key)
        if not isinstance(vkey, str) or sent_key != vkey:
            raise AuditCheckpointInvalid(
                "AUDIT_CHECKPOINT_INVALID",
                "the gateway's checkpoint names another audit key than the one this agent trusts; tell the user",
                None,
                self._session_id,
            )
        cp, newer = witness.check(kept, vkey, answer.get("checkpoint"), answer.get("consistency"))
        if bundle:
            witness.check_inclusion(answer, cp)
        if store is not None and newer:
            await asyncio.to_thread(
                self._keep, store, gateway, kept, witness.Kept(vkey, cp.size, cp.root, str(answer["checkpoint"]))
            )
        return answer

    @staticmethod
    def _keep(store: witness.WitnessFile, gateway: str, seen: witness.Kept | None, new: witness.Kept) -> None:
        """Replace the kept checkpoint with ``new`` (proven consistent with ``seen``), unless another
        client replaced it meanwhile: then the next call proves the link from that one."""
        with store.locked():
            if store.get(gateway) == seen:
                store.put(gateway, new)

    async def submit_deletion_proof(
        self,
        *,
        identity_key: ed25519.Ed25519PrivateKey,
        memory_hash: str,
        fields_accessed: Sequence[str] | None,
        method: str,
        deletion_proof_id: str | None = None,
        deleted_at: str | dt.datetime | None = None,
    ) -> JSONObject:
        """§19.3/§19.4: sign and submit a deletion proof for this session.

        ``identity_key`` is the Ed25519 key of the ``did:key`` that signed the agent's ``uom.json``
        (the Auth Service verifies against it); ``memory_hash`` e.g. from :func:`memory_hash`;
        ``method`` must be the manifest's ``deletion_method``. Answers
        ``{"status": "accepted", "deletion_proof_id"}``; a task-bound session closes.
        """
        if deleted_at is None:
            when = iso(time.time())
        elif isinstance(deleted_at, dt.datetime):
            when = deleted_at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        else:
            when = deleted_at
        fields: JSONObject = {
            "deletion_proof_id": deletion_proof_id or f"del_{secrets.token_hex(12)}",
            "session_id": self._session_id,
            "agent_id": self._agent_id,
            "deleted_at": when,
            "memory_hash": memory_hash,
            "method": method,
        }
        if fields_accessed is not None:
            fields["fields_accessed"] = list(fields_accessed)
        proof = sign_deletion_proof(fields, identity_key)
        path = f"/v1/sessions/{quote(self._session_id, safe=SEGMENT_SAFE)}/deletion-proof"
        return self._object(await self._call("POST", path, body=proof))

    def token_claims(self) -> JSONObject:
        """The current access token's claims as sent (scopes, limits, expiry): for describing the
        grant, not verified here (the gateway verifies every token it is shown)."""
        return token_claims(self._tokens.access_token)

    async def session(self) -> JSONObject:
        """``GET /v1/sessions/{id}``: this session's own view (status, expiry, granted scopes,
        retention). A session that ended raises (``SESSION_REVOKED``, ``TOKEN_EXPIRED`` ...)."""
        return self._object(await self._call("GET", self._session_path()))

    async def is_active(self) -> bool:
        """True while this session can still be used; False once it was revoked, closed, expired
        or is unknown. Other failures (network, gateway down) raise."""
        try:
            answer = await self.session()
        except AuthError as exc:
            if exc.code in ENDED_CODES:
                return False
            raise
        return answer.get("status") == "active"

    async def validate_token(self) -> JSONObject:
        """§9.5 ``POST /v1/tokens/validate`` for this client's own access token:
        ``{"valid": true, "session_id", "agent_id", "expires_at", "status"}``; raises once it is not."""
        return self._object(await self._call("POST", "/v1/tokens/validate", body={"token": self._tokens.access_token}))

    async def close_session(self) -> JSONObject:
        """§9.3 ``POST /v1/sessions/{id}/close``: end this session now (``{"session_id", "status":
        "closed"}``). Its tokens stop working at once; submit a deletion proof first if one is due."""
        return self._object(await self._call("POST", self._session_path() + "/close"))

    def _session_path(self) -> str:
        return f"/v1/sessions/{quote(self._session_id, safe=SEGMENT_SAFE)}"

    async def upload_payload(self, data: bytes | os.PathLike[str], *, format: str, presigned: bool = False) -> str:
        """§15.6: seal ``data`` to the user's payload key (the bundle's ``payload_public_key``) and upload
        it; returns the ``payload_id``. Only the user can open it (``uomp payload pull``).

        ``bytes`` up to :data:`gateway.client.payloads.JSON_MAX_SEALED` go as the JSON envelope; a
        path (or larger bytes) is sealed while it is sent, its hash after the bytes
        (:class:`gateway.client.payloads.SealedStream`): memory stays constant and nothing sealed is
        written to disk; a retry seals the same bytes again and names their hash. The source must not
        change until this returns (a file that does fails the upload). ``presigned``: ask for a
        single-use upload URL first and upload to it.
        Refusals raise the usual errors (``PAYLOAD_TOO_LARGE``, ``PAYLOAD_QUOTA_EXCEEDED`` ...); the
        gateway checked the hash it answers against ours (:class:`ProtocolError` if not).
        """
        payloads.check_format(format)
        key_text = self._bundle.bundle.payload_public_key if self._bundle.bundle is not None else None
        if not key_text:
            raise ConfigError(
                "CONFIG_ERROR",
                "the bundle has no payload_public_key (it predates payloads): ask the "
                "user to authorize the agent again",
                None,
                self._session_id,
            )
        try:
            recipient = parse_public_key(key_text)
        except ValueError:
            raise ConfigError(
                "CONFIG_ERROR", "the bundle's payload_public_key is not an X25519 key", None, self._session_id
            ) from None
        binding = Binding(payloads.new_payload_id(), self._session_id, self._agent_id, format)
        if isinstance(data, bytes | bytearray) and not presigned and len(data) <= payloads.JSON_MAX_SEALED - 256:
            doc = await asyncio.to_thread(payloads.seal_small, recipient, binding, bytes(data))

            async def send_doc() -> tuple[int, Any]:
                return await self._upload_exchange(
                    lambda t: self._transport.send("POST", "/v1/payload/upload", None, doc, t)
                )

            answer = await self._upload_retrying(binding.payload_id, send_doc)
            return payloads.check_answer(answer, binding.payload_id, str(doc["hash"]), self._session_id)
        stream = payloads.SealedStream(recipient, binding, data if isinstance(data, bytes | bytearray) else Path(data))
        first = True  # the first try sends the hash after the bytes; every later one names it first

        async def send(method: str, path: str, query: Mapping[str, str] | None, token: str) -> tuple[int, Any]:
            nonlocal first
            if first:
                first = False
                env, body = stream.envelope, stream.body(trailer=True)
            else:
                await stream.learn_digest()
                env, body = stream.named(), stream.body(trailer=False)
            try:
                return await self._transport.send_stream(method, path, query, env, body, token)
            except BaseException:
                failed = await stream.failure()
                if failed is not None:
                    raise failed from None  # the seal's own error, rather than the broken-off request
                raise
            finally:
                await stream.close()  # the pass stops reading the source; the body ends with it

        async def send_file() -> tuple[int, Any]:
            while True:
                path, query, method = "/v1/payload/upload", None, "POST"
                if presigned:  # a URL is single-use: each try asks for its own, for the same bytes
                    grant = self._object(
                        await self._call("POST", "/v1/payload/upload-url", body={"size": stream.envelope.size})
                    )
                    url = grant.get("upload_url")
                    token = urlsplit(url).query.partition("t=")[2] if isinstance(url, str) else ""
                    if not token:
                        raise ProtocolError(
                            "BAD_RESPONSE", "the upload-url answer has no upload_url", None, self._session_id
                        )
                    path, query, method = "/v1/payload/presigned", {"t": token}, "PUT"
                trailed = first
                status, answer = await self._upload_exchange(
                    functools.partial(send, method, path, query), refresh_retry=query is None
                )
                if trailed and _refuses_trailer(status, answer):
                    continue  # a gateway that wants the hash before the bytes: the same bytes, hash named
                return status, answer

        try:
            answer = await self._upload_retrying(binding.payload_id, send_file)
            return payloads.check_answer(answer, binding.payload_id, await stream.learn_digest(), self._session_id)
        finally:
            await stream.close()

    async def _upload_exchange(
        self, send: Callable[[str], Awaitable[tuple[int, Any]]], *, refresh_retry: bool = True
    ) -> tuple[int, Any]:
        """One try of an upload: (status, answer), after the usual certificate and token upkeep; an
        access token refused as expired is refreshed and the same bytes sent once more."""
        await self.open()
        if self._transport.mode == "mtls":
            await self._certs.ensure()
        tokens = self._tokens
        if tokens.refresh_token and tokens.refresh_due():
            await tokens.refresh(stale=None, force=False)
        token = tokens.access_token
        status, answer = await send(token)
        if status >= 300 and refresh_retry and tokens.refresh_token:
            err = error_from_answer(status, answer, session_id=self._session_id, secrets=self._tokens.recent)
            if err.code == "TOKEN_EXPIRED":
                await tokens.refresh(stale=token, force=True)
                status, answer = await send(tokens.access_token)
        return status, answer

    async def _upload_retrying(self, payload_id: str, exchange: Callable[[], Awaitable[tuple[int, Any]]]) -> JSONObject:
        """Send one sealed upload until it is answered: a try that got no answer (connection closed or
        failed, timed out) or a 502/503/504 is sent again with the same envelope, the same payload_id
        and the same bytes, which the relay answers like the first (one payload, one event) whether
        or not the earlier try arrived. Never sealed anew: other bytes under that id would be 409
        PAYLOAD_EXISTS (a large payload is sealed again with the same keys, hence the same bytes).
        At most ``payload_retry_attempts`` tries, with the refresh back-off."""
        o = self._opts
        delay = o.refresh_retry_initial_seconds
        for attempt in range(1, o.payload_retry_attempts + 1):
            last = attempt >= o.payload_retry_attempts
            try:
                status, answer = await exchange()
            except Unavailable as exc:
                if exc.code not in RETRY_UPLOAD_CODES or last:
                    raise
                reason = exc.code
            else:
                if status < 300:
                    if answer is None:
                        raise ProtocolError(
                            "BAD_RESPONSE", "the gateway's answer is not JSON", status, self._session_id
                        )
                    return self._object(answer)
                if status not in RETRY_UPLOAD_STATUSES or last:
                    raise error_from_answer(status, answer, session_id=self._session_id, secrets=self._tokens.recent)
                reason = f"{error_from_answer(status, answer, session_id=self._session_id).code} (HTTP {status})"
            log.warning(
                "payload upload %s for session %s got no answer (%s); sending the same upload again in %.1f s "
                "(try %d of %d)",
                payload_id,
                self._session_id,
                reason,
                delay,
                attempt + 1,
                o.payload_retry_attempts,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, o.refresh_retry_max_seconds)
        raise AssertionError("unreachable")  # the last try returns or raises

    async def refresh(self) -> None:
        """Rotate the tokens now (normally automatic), and save them to the bundle."""
        await self.open()
        if self._transport.mode == "mtls":
            await self._certs.ensure()
        await self._tokens.refresh(stale=self._tokens.access_token, force=True)

    async def renew_certificate(self, csr_key: AgentKey | None = None) -> RenewedCertificate:
        """Renew the agent certificate now (normally automatic at 2/3 of its life); mTLS only.

        Without ``csr_key`` the new certificate has the same key. With ``csr_key`` (a new P-256 or
        Ed25519 key) a CSR moves the certificate to that key, and the key is saved in the bundle;
        tokens stay bound to the old key, so the user must authorize the agent again after that.
        """
        if self._transport.mode != "mtls":
            raise ConfigError("CONFIG_ERROR", "certificate renewal is an mTLS call (the gateway's mTLS listener)")
        await self.open()
        self._certs.check_not_expired()
        async with self._certs.lock:
            return await self._certs.renew(csr_key)

    # ------------------------------------------------------------------------- plumbing

    @staticmethod
    def _object(answer: Any) -> JSONObject:
        if not isinstance(answer, dict):
            raise ProtocolError("BAD_RESPONSE", "the gateway's answer is not a JSON object")
        return answer

    @staticmethod
    def _list(answer: JSONObject, name: str) -> list[JSONObject]:
        value = answer.get(name)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ProtocolError("BAD_RESPONSE", f"the gateway's answer has no '{name}' list")
        return value

    async def _call(
        self, method: str, path: str, *, query: Mapping[str, str] | None = None, body: Any = None, retried: bool = False
    ) -> Any:
        await self.open()
        if self._transport.mode == "mtls":
            await self._certs.ensure()
        tokens = self._tokens
        if tokens.refresh_token and tokens.refresh_due():
            await tokens.refresh(stale=None, force=False)
        token = tokens.access_token
        status, answer = await self._transport.send(method, path, query, body, token)
        if status < 300:
            return answer
        err = error_from_answer(status, answer, session_id=self._session_id, secrets=tokens.recent)
        if err.code == "TOKEN_EXPIRED" and not retried and tokens.refresh_token:
            log.info("access token refused as expired for session %s; refreshing and retrying once", self._session_id)
            await tokens.refresh(stale=token, force=True)
            return await self._call(method, path, query=query, body=body, retried=True)
        raise err


__all__ = ["UompClient", "memory_hash"]
