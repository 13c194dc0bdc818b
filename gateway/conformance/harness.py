"""The conformance suite's harness: the target, one HTTP(S) exchange, the case registry, and the
assertions every case uses. The cases are in ``cases_*.py``; :mod:`gateway.conformance.suite` runs them.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gateway.core import jose
from gateway.errors import UompError

FIXTURE = Path(__file__).with_name("fixture.json")
# Spelled here, not imported: the suite checks the wire against the spec, not against our own constants.
AGENT_HEADER = "X-UOMP-Agent-Id"
# §8.4 codes a refusal may carry (the spec's list; implementations may add their own for new cases)
SPEC_CODES = {
    "INVALID_TOKEN",
    "TOKEN_EXPIRED",
    "SESSION_REVOKED",
    "ACCESS_DENIED",
    "QUOTA_EXCEEDED",
    "WRITE_NOT_AVAILABLE",
    "STORE_UNAVAILABLE",
    "SESSION_NOT_FOUND",
    "INVALID_REQUEST",
}


class Skip(Exception):
    """The target cannot be set up for this case (the reason says which setup piece is missing)."""


class Fail(Exception):
    """The target broke the expectation."""


@dataclasses.dataclass
class Target:
    """What the suite runs against: a guard or gateway URL, how to reach its admin API, the agent's credentials."""

    url: str
    mode: str = "guard"  # guard | gateway
    admin_url: str | None = None  # http(s)://host:port or unix:/path/to/guard.sock
    admin_token: str | None = None
    token: str | None = None  # hand-made: a token that reads tag conf.pref (no high items)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    agent_id: str | None = None
    payload_public_key: str | None = None  # base64 of the user's X25519 payload key (§15.6 cases)
    timeout: float = 15.0
    expiry_wait: float = 75.0  # longest wait for a short token or session to expire (TOK-05)

    @property
    def base(self) -> str:
        return self.url.rstrip("/")


@dataclasses.dataclass
class Answer:
    """One HTTP answer as a case sees it: status, parsed body, headers."""

    status: int
    body: Any
    headers: dict[str, str]

    def code(self) -> str | None:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err.get("code") if isinstance(err, dict) and isinstance(err.get("code"), str) else None


CaseFn = Callable[["Runner"], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance case: its id, the spec section, what it expects, the modes it runs in."""

    id: str
    section: str
    expectation: str
    modes: tuple[str, ...]
    fn: CaseFn


CASES: list[Case] = []


def case(
    cid: str, section: str, expectation: str, modes: tuple[str, ...] = ("guard", "gateway")
) -> Callable[[CaseFn], CaseFn]:
    """Registers the decorated coroutine as conformance case ``cid`` of ``section``."""

    def deco(fn: CaseFn) -> CaseFn:
        CASES.append(Case(cid, section, expectation, modes, fn))
        return fn

    return deco


def b64(data: bytes) -> str:
    """Base64url without padding."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Runner:
    """Makes the requests of the cases against one :class:`Target` (sessions, tokens, TLS)."""

    def __init__(self, target: Target) -> None:
        self.t = target
        self._sessions: list[aiohttp.ClientSession] = []
        self._agent_cert: x509.Certificate | None = None

    # ------------------------------------------------------------------ transport
    def client_context(
        self, *, with_cert: bool = True, max_tls: ssl.TLSVersion | None = None, cert: tuple[Path, Path] | None = None
    ) -> ssl.SSLContext | None:
        if urlsplit(self.t.url).scheme != "https":
            return None
        ctx = ssl.create_default_context(cafile=str(self.t.ca_file) if self.t.ca_file else None)
        if max_tls is not None:
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.maximum_version = max_tls
        if cert is not None:
            ctx.load_cert_chain(str(cert[0]), str(cert[1]))
        elif with_cert and self.t.cert_file and self.t.key_file:
            ctx.load_cert_chain(str(self.t.cert_file), str(self.t.key_file))
        return ctx

    def session(self, ctx: ssl.SSLContext | None = None, *, default: bool = True) -> aiohttp.ClientSession:
        if default and ctx is None:
            ctx = self.client_context()
        s = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx if ctx is not None else False, force_close=True),
            timeout=aiohttp.ClientTimeout(total=self.t.timeout),
        )
        self._sessions.append(s)
        return s

    async def close(self) -> None:
        for s in self._sessions:
            await s.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        agent: str | bool | None = True,
        json_body: Any = None,
        headers: dict[str, str] | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> Answer:
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        if self.t.mode == "gateway" and agent is not False and agent is not None:
            hdrs[AGENT_HEADER] = agent if isinstance(agent, str) else self.agent_id
        s = session or self.session()
        async with s.request(method, self.t.base + path, headers=hdrs, json=json_body) as resp:
            raw = await resp.read()
            try:
                body: Any = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
            return Answer(resp.status, body, {k.lower(): v for k, v in resp.headers.items()})

    async def read_key(self, token: str, key: str, **kw: Any) -> Answer:
        return await self.request("GET", "/v1/memory/" + quote(key, safe=""), token=token, **kw)

    async def read_tag(self, token: str, tag: str, **kw: Any) -> Answer:
        return await self.request("GET", "/v1/memory?tag=" + quote(tag, safe=""), token=token, **kw)

    async def aggregate(self, token: str, tag: str, op: str, field: str | None = None) -> Answer:
        q = f"/v1/memory/aggregate?tag={quote(tag, safe='')}&op={op}"
        if field:
            q += "&field=" + quote(field, safe="")
        return await self.request("GET", q, token=token)

    # ------------------------------------------------------------------ setup contract
    @property
    def agent_id(self) -> str:
        return self.t.agent_id or "conformance_agent"

    def agent_cert(self) -> x509.Certificate:
        if self._agent_cert is None:
            if not self.t.cert_file:
                raise Skip("needs an agent certificate (--cert/--key)")
            self._agent_cert = x509.load_pem_x509_certificate(self.t.cert_file.read_bytes())
        return self._agent_cert

    def cnf(self) -> dict[str, str]:
        cert = self.agent_cert()
        out = {"x5t#S256": jose.cert_thumbprint(cert.public_bytes(serialization.Encoding.DER))}
        try:  # the key thumbprint only for key types jose knows (an RSA agent key gets x5t#S256 alone)
            out["jkt"] = jose.key_thumbprint(cert.public_key())  # type: ignore[arg-type]
        except (UompError, TypeError, ValueError):
            pass
        return out

    def need_gateway_pieces(self) -> None:
        if self.t.mode == "gateway" and not (self.t.ca_file and self.t.cert_file and self.t.key_file):
            raise Skip("gateway mode needs --ca, --cert and --key (setup contract)")

    async def admin(self, method: str, path: str, body: Any = None) -> Answer:
        if not self.t.admin_token:
            raise Skip("needs the admin credential (--admin-token) to create and grant sessions")
        url = self.t.admin_url or (self.t.base if self.t.mode == "guard" else None)
        if url is None:
            raise Skip("gateway mode needs --admin-url (the local management API) to grant sessions")
        hdrs = {"Authorization": f"Bearer {self.t.admin_token}"}
        if url.startswith("unix:"):
            conn: aiohttp.BaseConnector = aiohttp.UnixConnector(path=url[5:])
            base = "http://guard"
        else:
            conn = aiohttp.TCPConnector(force_close=True)
            base = url.rstrip("/")
        async with (
            aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=self.t.timeout)) as s,
            s.request(method, base + path, headers=hdrs, json=body) as resp,
        ):
            raw = await resp.read()
            try:
                parsed: Any = json.loads(raw)
            except ValueError:
                parsed = raw.decode("utf-8", "replace")
            return Answer(resp.status, parsed, dict(resp.headers))

    async def grant(
        self, read: dict[str, Any], *, agent_id: str | None = None, minutes: float = 10, **extra: Any
    ) -> dict[str, Any]:
        """Create + grant one session; returns the grant answer (token, session_id, ...)."""
        self.need_gateway_pieces()
        # every §7.1 scope member, spelled as the spec spells it (OPTIONAL ones too: empty lists)
        read = {"tags": [], "keys": [], "deny_tags": [], "deny_keys": [], **read}
        if self.t.mode == "gateway":
            extra.setdefault("profile", "remote")
            extra.setdefault("audience", self.t.base)
            extra.setdefault("cnf", self.cnf())
        else:
            extra.setdefault("audience", self.t.base)
        created = await self.admin(
            "POST",
            "/v1/sessions",
            {
                "agent_id": agent_id or self.agent_id,
                "agent_name": "UOMP conformance suite",
                "requested_scopes": {"read": read},
                "duration_minutes": minutes,
            },
        )
        if created.status not in (200, 201) or not isinstance(created.body, dict) or "session_id" not in created.body:
            raise Skip(f"setup: session create answered {created.status} {created.code()}")
        sid = created.body["session_id"]
        granted = await self.admin("POST", f"/v1/sessions/{sid}/grant", {"granted_scopes": {"read": read}, **extra})
        if granted.status != 200 or not isinstance(granted.body, dict) or "token" not in granted.body:
            raise Skip(f"setup: grant answered {granted.status} {granted.code()}")
        return {"session_id": sid, **granted.body}

    async def pref_token(self) -> str:
        """A token for tag conf.pref: granted when the admin credential is there, else the hand-made one."""
        self.need_gateway_pieces()
        if self.t.admin_token and (self.t.mode == "guard" or self.t.admin_url):
            return str((await self.grant({"tags": ["conf.pref"], "keys": []}))["token"])
        if self.t.token:
            return self.t.token
        raise Skip("needs the admin credential or a hand-made conf.pref token (--token)")

    async def check_fixture(self, token: str) -> None:
        a = await self.read_key(token, "conf.pref.theme")
        if a.status != 200:
            raise Skip(f"fixture not loaded? reading conf.pref.theme answered {a.status} {a.code()}")


# ---------------------------------------------------------------------- assertions


def expect_error(a: Answer, statuses: tuple[int, ...], codes: tuple[str, ...] | None = None) -> None:
    """Fails unless ``a`` is a §8.4 error with one of ``statuses`` (and of ``codes`` when given)."""
    if a.status not in statuses:
        raise Fail(f"expected HTTP {'/'.join(map(str, statuses))}, got {a.status} ({a.code()})")
    check_error_shape(a)
    if codes is not None and a.code() not in codes:
        raise Fail(f"expected code {'/'.join(codes)}, got {a.code()}")


def check_error_shape(a: Answer) -> None:
    """Fails unless ``a``'s body is the §8.4 error object with string code and message."""
    body = a.body
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        raise Fail(f'error body is not the §8.4 shape {{"error": {{...}}}}: {str(body)[:120]!r}')
    err = body["error"]
    if not isinstance(err.get("code"), str) or not isinstance(err.get("message"), str):
        raise Fail("§8.4 error lacks string code and message")
    if not a.headers.get("content-type", "").startswith("application/json"):
        raise Fail(f"error content-type is {a.headers.get('content-type')!r}, not application/json")


def expect_ok(a: Answer) -> Any:
    """The body of a 200 answer; fails on any other status."""
    if a.status != 200:
        raise Fail(f"expected 200, got {a.status} ({a.code()})")
    return a.body


def item_keys(body: Any) -> set[str]:
    """The keys of a tag read answer's items; fails when it has no items list."""
    items = body.get("items") if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise Fail("tag read answer has no items list")
    return {str(i.get("key")) for i in items if isinstance(i, dict)}


def tamper_signature(token: str) -> str:
    """``token`` with one bit of its signature flipped."""
    head, payload, sig = token.split(".")
    raw = bytearray(_unb64(sig))
    raw[len(raw) // 2] ^= 0x01
    return f"{head}.{payload}.{b64(bytes(raw))}"


def tamper_claims(token: str, **changes: Any) -> str:
    """``token`` with ``changes`` applied to its claims and the old signature kept."""
    head, payload, sig = token.split(".")
    claims = json.loads(_unb64(payload))
    claims.update(changes)
    return f"{head}.{b64(json.dumps(claims).encode())}.{sig}"


def alg_none(token: str) -> str:
    """``token``'s claims under an unsigned ``alg: none`` header."""
    _head, payload, _sig = token.split(".")
    return f"{b64(json.dumps({'alg': 'none', 'typ': 'JWT'}).encode())}.{payload}."


AUTH_REFUSED = (401,)
TOKEN_CODES = ("INVALID_TOKEN", "TOKEN_EXPIRED", "SESSION_REVOKED", "TOKEN_BINDING_MISMATCH")


def claims_of(token: str) -> dict[str, Any]:
    """A compact JWS's claims, unverified; fails when it is not one."""
    try:
        claims = json.loads(_unb64(token.split(".")[1]))
    except (ValueError, IndexError) as exc:
        raise Fail("the token is not a JWS compact serialization") from exc
    if not isinstance(claims, dict):
        raise Fail("the token's payload is not a JSON object")
    return claims


def comparable(a: Answer) -> tuple[int, str | None, str]:
    """What two refusals must share to be indistinguishable: status, code and the error's member names."""
    err = a.body.get("error", {}) if isinstance(a.body, dict) else {}
    return a.status, a.code(), json.dumps(sorted(err)) if isinstance(err, dict) else ""
