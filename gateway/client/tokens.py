"""Tokens in the agent SDK (spec §15.5): when the access token is due for refresh, one refresh for
all concurrent callers (a lock here, an ``flock`` on ``<bundle>.lock`` across processes), retried
with back-off when no answer came, and the rotated pair written back to the bundle file before the
call returns; tokens another process rotated are adopted from the file.

Two parts of :class:`~gateway.client.sdk.UompClient`: :class:`BundleFile` (the bundle on disk, its
lock and atomic write-back, shared with the certificate renewer) and :class:`TokenManager` (the
tokens, their times and the refresh over a :class:`~gateway.client.transport.ClientTransport`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gateway.bundle import AgentBundle, load_bundle, write_bundle
from gateway.client.errors import AuthError, ConfigError, ProtocolError, Unavailable, error_from_answer
from gateway.client.options import (
    REMEMBERED_SECRETS,
    RETRY_REFRESH_CODES,
    RETRY_REFRESH_STATUSES,
    SEGMENT_SAFE,
    ClientOptions,
    JSONObject,
    log,
)
from gateway.client.transport import ClientTransport
from gateway.core import jose
from gateway.core.tokens import iso, parse_iso
from gateway.errors import UompError


def token_claims(token: str) -> JSONObject:
    """The claims of a compact JWS, NOT verified: only for scheduling and ids (the gateway verifies)."""
    try:
        return dict(jose.parse_compact(token).payload)
    except UompError:
        return {}


def iso_ts(value: Any) -> float | None:
    """An ISO 8601 timestamp as seconds since the epoch, or None when it is not one."""
    try:
        return parse_iso(value)
    except (ValueError, OverflowError, TypeError):
        return None


def num(value: Any) -> float | None:
    """A JSON number as a float, or None (booleans are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class BundleFile:
    """The agent bundle as loaded (``bundle``) and where it lives (``path``; None: nothing is
    written back). :meth:`lock` is the ``flock`` every writer holds; :meth:`persist` writes under it."""

    def __init__(
        self, bundle: AgentBundle | None, path: Path | None, *, session_id: str, lock_timeout_seconds: float
    ) -> None:
        self.bundle = bundle
        self.path = path
        self._session_id = session_id
        self._lock_timeout = lock_timeout_seconds

    @contextlib.asynccontextmanager
    async def lock(self) -> AsyncIterator[None]:
        """``flock`` on ``<bundle>.lock``: one refresh at a time across processes sharing the bundle."""
        if self.path is None:
            yield
            return
        lock_path = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError("CONFIG_ERROR", f"cannot open the lock file {lock_path}: {exc.strerror}") from None
        try:
            deadline = time.monotonic() + self._lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise Unavailable(
                            "LOCK_TIMEOUT",
                            f"another process held {lock_path} for more than {self._lock_timeout:g} s",
                            None,
                            self._session_id,
                        ) from None
                    await asyncio.sleep(0.05)
            yield
        finally:
            os.close(fd)  # releases the lock

    async def persist(self, update: Callable[[AgentBundle], AgentBundle], what: str) -> None:
        """Write ``update(bundle)`` to the bundle file (caller holds the bundle lock)."""
        path, mine = self.path, self.bundle
        if path is None or mine is None:
            return

        def write() -> AgentBundle:
            base = mine
            with contextlib.suppress(UompError):
                disk = load_bundle(path)
                if disk.session_id == mine.session_id:
                    base = disk  # keep what another process wrote (newer tokens or certificate)
            new = update(base)
            write_bundle(path, new)
            return new

        try:
            self.bundle = await asyncio.to_thread(write)
        except OSError as exc:
            log.error("could not save %s to the agent bundle %s", what, path)
            raise ConfigError(
                "CONFIG_ERROR",
                f"could not save {what} to {path} ({exc.strerror}); fix this before the "
                "agent restarts: a restarted agent holding a spent refresh token revokes its own "
                "session",
                None,
                self._session_id,
            ) from None


class TokenManager:
    """The session's tokens (``access_token``, ``refresh_token`` and their times) and their
    rotation: one refresh at a time for every caller of this client (a lock) and of this bundle (the
    bundle's ``flock``), the rotated pair saved before it is used. ``recent`` holds the last secrets
    seen, for redaction in errors; ``refresh_count`` the rotations done."""

    def __init__(
        self,
        transport: ClientTransport,
        bundle: BundleFile,
        *,
        session_id: str,
        options: ClientOptions,
        clock: Callable[[], float],
        access_token: str,
        access_expires_at: str | float | None,
        refresh_token: str | None,
        refresh_expires_at: str | float | None,
    ) -> None:
        self._transport = transport
        self._bundle = bundle
        self._session_id = session_id
        self._opts = options
        self._clock = clock
        self.access_token = access_token
        self.access_exp, self.access_iat = self.token_times(access_token, access_expires_at)
        self.refresh_token = refresh_token
        self.refresh_exp: float | None = None
        if refresh_token:
            self.refresh_exp = (
                iso_ts(refresh_expires_at) if isinstance(refresh_expires_at, str) else num(refresh_expires_at)
            ) or num(token_claims(refresh_token).get("exp"))
        self.recent: deque[str] = deque(maxlen=REMEMBERED_SECRETS)
        self.remember(access_token, refresh_token)
        self._lock = asyncio.Lock()
        self.refresh_count = 0

    def remember(self, *tokens: str | None) -> None:
        for t in tokens:
            if t and t not in self.recent:
                self.recent.append(t)

    @staticmethod
    def token_times(token: str, expires_at: str | float | None) -> tuple[float, float | None]:
        claims = token_claims(token)
        exp = iso_ts(expires_at) if isinstance(expires_at, str) else num(expires_at)
        if exp is None:
            exp = num(claims.get("exp")) or iso_ts(claims.get("expires_at"))
        iat = num(claims.get("iat")) or iso_ts(claims.get("issued_at"))
        return (exp if exp is not None else float("inf")), iat

    def refresh_due(self) -> bool:
        remaining = self.access_exp - self._clock()
        margin = self._opts.refresh_before_seconds
        if self.access_iat is not None:
            life = self.access_exp - self.access_iat
            if life > 0:
                margin = min(max(margin, life * self._opts.refresh_before_fraction), life / 2)
        return remaining <= margin

    async def refresh(self, *, stale: str | None, force: bool) -> None:
        """One refresh for all concurrent callers. ``force``: the gateway refused ``stale`` as
        expired (skip if another caller already replaced it)."""
        async with self._lock, self._bundle.lock():
            self._adopt_from_disk()
            if force:
                if stale is not None and self.access_token != stale:
                    return
            elif not self.refresh_due():
                return
            answer = await self._post_refresh()
            self._apply_tokens(answer)
            self.refresh_count += 1
            log.info(
                "tokens rotated for session %s; access token valid until %s", self._session_id, answer["expires_at"]
            )
            await self._bundle.persist(lambda b: b.with_tokens(answer), "the rotated tokens")

    async def _post_refresh(self) -> JSONObject:
        rt = self.refresh_token
        if not rt:
            raise AuthError(
                "TOKEN_EXPIRED",
                "the access token expired and this client has no refresh token; ask "
                "the user to authorize the agent again",
                None,
                self._session_id,
            )
        if self.refresh_exp is not None and self._clock() >= self.refresh_exp:
            raise AuthError(
                "TOKEN_EXPIRED",
                f"the refresh token expired at {iso(self.refresh_exp)}; ask the user to authorize the agent again",
                None,
                self._session_id,
            )
        path = f"/v1/sessions/{quote(self._session_id, safe=SEGMENT_SAFE)}/refresh"
        # The answer may be lost after the token was spent (gateway or guard killed, network cut). The
        # Auth Service lets the same key retry a spent token until its successor pair is first used,
        # so retrying with bounded back-off is safe, as is a later refresh by a restarted agent.
        o = self._opts
        delay = o.refresh_retry_initial_seconds
        for attempt in range(1, max(1, o.refresh_retry_attempts) + 1):
            last = attempt >= o.refresh_retry_attempts
            try:
                status, answer = await self._transport.send("POST", path, None, None, rt)
            except Unavailable as exc:
                if exc.code not in RETRY_REFRESH_CODES or last:
                    raise
                reason = exc.code
            else:
                code = error_from_answer(status, answer, session_id=self._session_id).code if status >= 300 else ""
                if status not in RETRY_REFRESH_STATUSES or last:
                    break
                reason = f"{code} (HTTP {status})"
            log.warning(
                "refresh for session %s got no answer (%s); retrying in %.1f s (try %d of %d)",
                self._session_id,
                reason,
                delay,
                attempt + 1,
                o.refresh_retry_attempts,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, o.refresh_retry_max_seconds)
        if status >= 300:
            err = error_from_answer(status, answer, session_id=self._session_id, secrets=self.recent)
            if err.code == "REFRESH_REUSED":
                log.error(
                    "the gateway saw a spent refresh token for session %s: the session is revoked "
                    "(was the bundle copied, or restored from an old copy?)",
                    self._session_id,
                )
            raise err
        if not isinstance(answer, dict) or not all(
            isinstance(answer.get(k), str) and answer.get(k) for k in ("access_token", "expires_at")
        ):
            raise ProtocolError(
                "BAD_RESPONSE", "the refresh answer has no access_token/expires_at", status, self._session_id
            )
        for k in ("refresh_token", "refresh_expires_at"):
            if answer.get(k) is not None and not isinstance(answer.get(k), str):
                raise ProtocolError(
                    "BAD_RESPONSE", f"the refresh answer's {k} is not a string", status, self._session_id
                )
        return answer

    def _apply_tokens(self, answer: Mapping[str, Any]) -> None:
        self.access_token = str(answer["access_token"])
        self.access_exp, self.access_iat = self.token_times(self.access_token, answer["expires_at"])
        new_rt = answer.get("refresh_token")
        if isinstance(new_rt, str) and new_rt:
            self.refresh_token = new_rt
            self.refresh_exp = iso_ts(answer.get("refresh_expires_at")) or num(token_claims(new_rt).get("exp"))
        self.remember(self.access_token, self.refresh_token)

    def _adopt_from_disk(self) -> None:
        """Another process of this agent may have rotated the tokens in the bundle: take them."""
        if self._bundle.path is None:
            return
        try:
            disk = load_bundle(self._bundle.path)
        except UompError:
            return
        if (
            disk.session_id != self._session_id
            or disk.refresh_token == self.refresh_token
            or disk.access_token == self.access_token
        ):
            return
        exp = iso_ts(disk.access_expires_at)
        if exp is None or exp < self.access_exp:
            return
        log.info("adopting tokens another process rotated for session %s", self._session_id)
        self._apply_tokens(
            {
                "access_token": disk.access_token,
                "expires_at": disk.access_expires_at,
                "refresh_token": disk.refresh_token,
                "refresh_expires_at": disk.refresh_expires_at,
            }
        )
        self._bundle.bundle = disk
