"""The conformance cases and their runner (black-box: HTTP(S) only).

Setup contract (docs/conformance.md): the target holds the items of ``fixture.json`` and gives the
suite either an admin credential (``POST /v1/sessions`` + ``/grant`` on the management API: the
target itself in guard mode, ``admin_url`` in gateway mode), or a hand-made token for the
``conf.pref`` tag. Gateway mode also needs the user's CA certificate and one agent certificate and
key. A case whose setup piece is missing is skipped with the reason; a case never passes unseen.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import hashlib
import json
import os
import ssl
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
from cryptography.x509.oid import NameOID

from gateway.client import payloads
from gateway.conformance.report import Result
from gateway.core import jose, sealing
from gateway.errors import UompError

FIXTURE = Path(__file__).with_name("fixture.json")
AGENT_HEADER = "X-UOMP-Agent-Id"
# §8.4 codes a refusal may carry (the spec's list; implementations may add their own for new cases)
SPEC_CODES = {"INVALID_TOKEN", "TOKEN_EXPIRED", "SESSION_REVOKED", "ACCESS_DENIED", "QUOTA_EXCEEDED",
              "WRITE_NOT_AVAILABLE", "STORE_UNAVAILABLE", "SESSION_NOT_FOUND", "INVALID_REQUEST"}


class Skip(Exception):
    """The target cannot be set up for this case (the reason says which setup piece is missing)."""


class Fail(Exception):
    """The target broke the expectation."""


@dataclasses.dataclass
class Target:
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
    status: int
    body: Any
    headers: dict[str, str]

    def code(self) -> str | None:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err.get("code") if isinstance(err, dict) and isinstance(err.get("code"), str) else None


CaseFn = Callable[["Runner"], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    section: str
    expectation: str
    modes: tuple[str, ...]
    fn: CaseFn


CASES: list[Case] = []


def case(cid: str, section: str, expectation: str, modes: tuple[str, ...] = ("guard", "gateway")
         ) -> Callable[[CaseFn], CaseFn]:
    def deco(fn: CaseFn) -> CaseFn:
        CASES.append(Case(cid, section, expectation, modes, fn))
        return fn
    return deco


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Runner:
    def __init__(self, target: Target) -> None:
        self.t = target
        self._sessions: list[aiohttp.ClientSession] = []
        self._agent_cert: x509.Certificate | None = None

    # ------------------------------------------------------------------ transport
    def client_context(self, *, with_cert: bool = True, max_tls: ssl.TLSVersion | None = None,
                       cert: tuple[Path, Path] | None = None) -> ssl.SSLContext | None:
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
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx if ctx is not None else False,
                                                                 force_close=True),
                                  timeout=aiohttp.ClientTimeout(total=self.t.timeout))
        self._sessions.append(s)
        return s

    async def close(self) -> None:
        for s in self._sessions:
            await s.close()

    async def request(self, method: str, path: str, *, token: str | None = None, agent: str | bool | None = True,
                      json_body: Any = None, headers: dict[str, str] | None = None,
                      session: aiohttp.ClientSession | None = None) -> Answer:
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
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=self.t.timeout)) as s, \
                s.request(method, base + path, headers=hdrs, json=body) as resp:
            raw = await resp.read()
            try:
                parsed: Any = json.loads(raw)
            except ValueError:
                parsed = raw.decode("utf-8", "replace")
            return Answer(resp.status, parsed, dict(resp.headers))

    async def grant(self, read: dict[str, Any], *, agent_id: str | None = None, minutes: float = 10,
                    **extra: Any) -> dict[str, Any]:
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
        created = await self.admin("POST", "/v1/sessions", {
            "agent_id": agent_id or self.agent_id, "agent_name": "UOMP conformance suite",
            "requested_scopes": {"read": read}, "duration_minutes": minutes})
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
    if a.status not in statuses:
        raise Fail(f"expected HTTP {'/'.join(map(str, statuses))}, got {a.status} ({a.code()})")
    check_error_shape(a)
    if codes is not None and a.code() not in codes:
        raise Fail(f"expected code {'/'.join(codes)}, got {a.code()}")


def check_error_shape(a: Answer) -> None:
    body = a.body
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        raise Fail(f"error body is not the §8.4 shape {{\"error\": {{...}}}}: {str(body)[:120]!r}")
    err = body["error"]
    if not isinstance(err.get("code"), str) or not isinstance(err.get("message"), str):
        raise Fail("§8.4 error lacks string code and message")
    if not a.headers.get("content-type", "").startswith("application/json"):
        raise Fail(f"error content-type is {a.headers.get('content-type')!r}, not application/json")


def expect_ok(a: Answer) -> Any:
    if a.status != 200:
        raise Fail(f"expected 200, got {a.status} ({a.code()})")
    return a.body


def item_keys(body: Any) -> set[str]:
    items = body.get("items") if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise Fail("tag read answer has no items list")
    return {str(i.get("key")) for i in items if isinstance(i, dict)}


def tamper_signature(token: str) -> str:
    head, payload, sig = token.split(".")
    raw = bytearray(_unb64(sig))
    raw[len(raw) // 2] ^= 0x01
    return f"{head}.{payload}.{_b64(bytes(raw))}"


def tamper_claims(token: str, **changes: Any) -> str:
    head, payload, sig = token.split(".")
    claims = json.loads(_unb64(payload))
    claims.update(changes)
    return f"{head}.{_b64(json.dumps(claims).encode())}.{sig}"


def alg_none(token: str) -> str:
    _head, payload, _sig = token.split(".")
    return f"{_b64(json.dumps({'alg': 'none', 'typ': 'JWT'}).encode())}.{payload}."


AUTH_REFUSED = (401,)
TOKEN_CODES = ("INVALID_TOKEN", "TOKEN_EXPIRED", "SESSION_REVOKED", "TOKEN_BINDING_MISMATCH")

# ---------------------------------------------------------------------- §8.4


@case("ERR-01", "§8.4", "a read with no Authorization header is 401 with the §8.4 error body")
async def _no_auth(r: Runner) -> None:
    r.need_gateway_pieces()
    expect_error(await r.request("GET", "/v1/memory/conf.pref.theme"), AUTH_REFUSED, ("INVALID_TOKEN",))


@case("ERR-02", "§8.4", "a malformed bearer token is 401 INVALID_TOKEN")
async def _garbage(r: Runner) -> None:
    r.need_gateway_pieces()
    expect_error(await r.read_key("not-a-token", "conf.pref.theme"), AUTH_REFUSED, ("INVALID_TOKEN",))


@case("ERR-03", "§8.4 §10.1 §20.4", "an agent write (PUT/DELETE /v1/memory/{key}) is refused and nothing changes; "
      "the guard answers 403 WRITE_NOT_AVAILABLE (the gateway, which has no write route, any 4xx)")
async def _write(r: Runner) -> None:
    token = await r.pref_token()
    for method in ("PUT", "DELETE"):
        a = await r.request(method, "/v1/memory/conf.pref.theme", token=token, json_body={"value": "light"})
        if r.t.mode == "guard":
            expect_error(a, (403,), ("WRITE_NOT_AVAILABLE",))
        else:
            expect_error(a, (400, 401, 403, 404, 405))
    b = expect_ok(await r.read_key(token, "conf.pref.theme"))
    if b.get("value") != "dark":
        raise Fail("the refused write changed the item")


@case("ERR-04", "§8.4", "every refusal carries a known §8.4 code for its status")
async def _codes(r: Runner) -> None:
    token = await r.pref_token()
    answers = [await r.read_key(token, "conf.nope"), await r.read_key(tamper_signature(token), "conf.pref.theme"),
               await r.read_tag(token, "conf.private")]
    for a in answers:
        check_error_shape(a)
        code = a.code()
        if code not in SPEC_CODES:
            raise Fail(f"refusal code {code} is not a §8.4 code")
        if (a.status, code) not in {(401, "INVALID_TOKEN"), (401, "TOKEN_EXPIRED"), (401, "SESSION_REVOKED"),
                                    (403, "ACCESS_DENIED"), (429, "QUOTA_EXCEEDED"), (403, "WRITE_NOT_AVAILABLE"),
                                    (503, "STORE_UNAVAILABLE"), (404, "SESSION_NOT_FOUND"), (400, "INVALID_REQUEST")}:
            raise Fail(f"code {code} came with status {a.status}")


@case("ERR-05", "§8.4", "a 401 names the Bearer scheme in WWW-Authenticate")
async def _www_auth(r: Runner) -> None:
    r.need_gateway_pieces()
    a = await r.request("GET", "/v1/memory/conf.pref.theme")
    if a.status != 401:
        raise Fail(f"expected 401, got {a.status}")
    if "bearer" not in a.headers.get("www-authenticate", "").lower():
        raise Fail("401 without WWW-Authenticate: Bearer")


# ---------------------------------------------------------------------- §7.3


@case("TOK-01", "§7.3", "a token whose signature is altered is refused (401)")
async def _sig(r: Runner) -> None:
    token = await r.pref_token()
    await r.check_fixture(token)
    expect_error(await r.read_key(tamper_signature(token), "conf.pref.theme"), AUTH_REFUSED, TOKEN_CODES)


@case("TOK-02", "§7.3", "a token whose claims are altered (wider scope) under the old signature is refused")
async def _claims(r: Runner) -> None:
    token = await r.pref_token()
    forged = tamper_claims(token, scopes={"read": {"tags": ["conf.pref", "conf.holdings"], "keys": ["*"]}})
    expect_error(await r.read_key(forged, "conf.h.a"), AUTH_REFUSED, TOKEN_CODES)


@case("TOK-03", "§7.3", "a token re-signed with alg none is refused")
async def _none(r: Runner) -> None:
    token = await r.pref_token()
    expect_error(await r.read_key(alg_none(token), "conf.pref.theme"), AUTH_REFUSED, TOKEN_CODES)


@case("TOK-04", "§7.3", "a token with exp moved later under the old signature is refused")
async def _exp_forged(r: Runner) -> None:
    token = await r.pref_token()
    forged = tamper_claims(token, exp=int(time.time()) + 10 * 365 * 86400)
    expect_error(await r.read_key(forged, "conf.pref.theme"), AUTH_REFUSED, TOKEN_CODES)


def _claims_of(token: str) -> dict[str, Any]:
    try:
        claims = json.loads(_unb64(token.split(".")[1]))
    except (ValueError, IndexError) as exc:
        raise Fail("the token is not a JWS compact serialization") from exc
    if not isinstance(claims, dict):
        raise Fail("the token's payload is not a JSON object")
    return claims


def _iso_seconds(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@case("TOK-05", "§7.3", "exp never passes the session's expires_at, and once exp passes the token is refused")
async def _expired(r: Runner) -> None:
    # token_lifetime_seconds (>= 10) shortens the token; a target that ignores it is waited on for
    # its one-minute session instead (expiry_wait bounds the wait).
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, minutes=1, token_lifetime_seconds=10)
    token = str(g["token"])
    exp = _claims_of(token).get("exp")
    if not isinstance(exp, int | float):
        raise Fail("the token has no numeric exp")
    for name in ("session_expires_at", "expires_at"):
        if isinstance(g.get(name), str) and exp > _iso_seconds(g[name]) + 1:
            raise Fail(f"token exp is after the grant's {name}")
    expect_ok(await r.read_key(token, "conf.pref.theme"))
    deadline = time.monotonic() + r.t.expiry_wait
    while time.monotonic() < deadline:
        a = await r.read_key(token, "conf.pref.theme")
        if a.status != 200:
            if time.time() < exp - 2:
                raise Fail(f"refused {exp - time.time():.0f}s before exp ({a.status} {a.code()})")
            expect_error(a, AUTH_REFUSED, ("TOKEN_EXPIRED", "SESSION_REVOKED", "INVALID_TOKEN"))
            return
        await asyncio.sleep(0.5)
    raise Fail(f"the token still read {r.t.expiry_wait:.0f}s after the grant (exp in {exp - time.time():.0f}s)")


@case("TOK-06", "§7.3 §13.4", "a revoked session's token is refused on the very next request")
async def _revoked(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []})
    token = str(g["token"])
    expect_ok(await r.read_key(token, "conf.pref.theme"))
    rv = await r.admin("POST", f"/v1/sessions/{g['session_id']}/revoke")
    if rv.status != 200:
        raise Skip(f"setup: revoke answered {rv.status}")
    expect_error(await r.read_key(token, "conf.pref.theme"), AUTH_REFUSED, ("SESSION_REVOKED", "INVALID_TOKEN"))
    expect_error(await r.read_tag(token, "conf.pref"), AUTH_REFUSED, ("SESSION_REVOKED", "INVALID_TOKEN"))


@case("TOK-07", "§7.3 §13.4", "a closed session's token is refused on the very next request")
async def _closed(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []})
    token = str(g["token"])
    expect_ok(await r.read_key(token, "conf.pref.theme"))
    rv = await r.admin("POST", f"/v1/sessions/{g['session_id']}/close")
    if rv.status != 200:
        raise Skip(f"setup: close answered {rv.status}")
    expect_error(await r.read_key(token, "conf.pref.theme"), AUTH_REFUSED, ("SESSION_REVOKED", "INVALID_TOKEN"))


@case("TOK-08", "§7.3", "a token for another audience is refused")
async def _audience(r: Runner) -> None:
    other = "http://127.0.0.1:9" if r.t.mode == "guard" else "https://elsewhere.example:8443"
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, audience=other)
    expect_error(await r.read_key(str(g["token"]), "conf.pref.theme"), AUTH_REFUSED, ("INVALID_TOKEN",))


@case("TOK-09", "§7.3 §14", "a remote-profile token is refused on the local (guard) endpoint", modes=("guard",))
async def _remote_at_guard(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, profile="remote", audience="https://gw.example:8443")
    expect_error(await r.read_key(str(g["token"]), "conf.pref.theme"), AUTH_REFUSED, ("INVALID_TOKEN",))


@case("TOK-10", "§7.3 §15.2", "a local-profile token is refused by the gateway", modes=("gateway",))
async def _local_at_gateway(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, profile="local")
    expect_error(await r.read_key(str(g["token"]), "conf.pref.theme"), AUTH_REFUSED, ("INVALID_TOKEN",))


# ---------------------------------------------------------------------- §10.4 / §10.5


@case("POL-01", "§10.4", "deny_tags wins over an allowed tag, by key and in tag reads")
async def _deny_tag(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": [], "deny_tags": ["conf.private"]})
    token = str(g["token"])
    expect_error(await r.read_key(token, "conf.pref.private"), (403,), ("ACCESS_DENIED",))
    keys = item_keys(expect_ok(await r.read_tag(token, "conf.pref")))
    if "conf.pref.private" in keys:
        raise Fail("tag read returned an item carrying a denied tag")
    if "conf.pref.theme" not in keys:
        raise Fail("tag read lost an allowed item")


@case("POL-02", "§10.4", "deny_keys wins over an allowed key and tag; tag reads re-filter per key")
async def _deny_key(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": ["conf.pref.lang"], "deny_keys": ["conf.pref.lang"]})
    token = str(g["token"])
    expect_error(await r.read_key(token, "conf.pref.lang"), (403,), ("ACCESS_DENIED",))
    if "conf.pref.lang" in item_keys(expect_ok(await r.read_tag(token, "conf.pref"))):
        raise Fail("tag read returned a denied key")


@case("POL-03", "§10.4", "a high-sensitivity item is not readable through a tag grant, by key or by tag")
async def _high_tag(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []})
    token = str(g["token"])
    expect_error(await r.read_key(token, "conf.pref.passport"), (403,), ("ACCESS_DENIED",))
    if "conf.pref.passport" in item_keys(expect_ok(await r.read_tag(token, "conf.pref"))):
        raise Fail("tag read returned a high-sensitivity item")


@case("POL-04", "§10.4", "a high-sensitivity item is readable when its key is granted explicitly")
async def _high_key(r: Runner) -> None:
    g = await r.grant({"tags": [], "keys": ["conf.pref.passport"]})
    body = expect_ok(await r.read_key(str(g["token"]), "conf.pref.passport"))
    if body.get("value") != "X1234567":
        raise Fail("explicit key grant did not return the item")


@case("POL-05", "§10.4", "a tag or key outside the grant is refused 403")
async def _outside(r: Runner) -> None:
    token = await r.pref_token()
    expect_error(await r.read_key(token, "conf.h.a"), (403,), ("ACCESS_DENIED",))
    expect_error(await r.read_tag(token, "conf.holdings"), (403,), ("ACCESS_DENIED",))


@case("POL-06", "§10.4 §19.2", "allowed_fields: every returned item holds only the granted item fields")
async def _fields(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.profile"], "keys": [], "allowed_fields": ["key", "value"]})
    token = str(g["token"])
    body = expect_ok(await r.read_key(token, "conf.profile"))
    if not isinstance(body, dict) or set(body) != {"key", "value"}:
        raise Fail(f"item fields returned: {sorted(body) if isinstance(body, dict) else type(body).__name__}")
    items = expect_ok(await r.read_tag(token, "conf.profile")).get("items", [])
    if not items or any(not isinstance(i, dict) or set(i) - {"key", "value"} for i in items):
        raise Fail("tag read returned fields outside allowed_fields")


@case("POL-07", "§10.4 §19.2", "aggregation_only: key and tag reads refused, aggregates answered")
async def _agg_only(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.holdings"], "keys": []}, aggregation_only=True)
    token = str(g["token"])
    expect_error(await r.read_key(token, "conf.h.a"), (403,), ("ACCESS_DENIED",))
    expect_error(await r.read_tag(token, "conf.holdings"), (403,), ("ACCESS_DENIED",))
    body = expect_ok(await r.aggregate(token, "conf.holdings", "count"))
    if "4242" in json.dumps(body) or "symbol" in json.dumps(body):
        raise Fail("aggregate answer carries item values")


@case("AGG-01", "§10.5", "an aggregate over a single item does not disclose its value")
async def _agg_single(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.single"], "keys": []}, aggregation_only=True)
    token = str(g["token"])
    for op in ("sum", "avg"):
        a = await r.aggregate(token, "conf.single", op, "value.market_value")
        if "4242" in json.dumps(a.body):
            raise Fail(f"{op} over one item returned its value")


@case("AGG-02", "§10.5", "a sum over enough items is answered and matches the items")
async def _agg_sum(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.holdings"], "keys": []}, aggregation_only=True)
    body = expect_ok(await r.aggregate(str(g["token"]), "conf.holdings", "sum", "value.market_value"))
    if "600" not in json.dumps(body):
        raise Fail(f"sum over 100+200+300 answered {json.dumps(body)[:120]}")


# ---------------------------------------------------------------------- §21


def _comparable(a: Answer) -> tuple[int, str | None, str]:
    err = a.body.get("error", {}) if isinstance(a.body, dict) else {}
    return a.status, a.code(), json.dumps(sorted(err)) if isinstance(err, dict) else ""


@case("EXI-01", "§21", "a missing key and an existing but denied key get the same refusal")
async def _exist_key(r: Runner) -> None:
    token = await r.pref_token()
    await r.check_fixture(token)
    missing = await r.read_key(token, "conf.no.such.key")
    denied = await r.read_key(token, "conf.h.a")
    if _comparable(missing) != _comparable(denied):
        raise Fail(f"missing {_comparable(missing)} vs denied {_comparable(denied)}")
    if missing.status != 403:
        raise Fail(f"a missing key answered {missing.status}, not 403")
    check_error_shape(missing)
    check_error_shape(denied)
    m = missing.body["error"].get("message")
    d = denied.body["error"].get("message")
    if m != d:
        raise Fail("the messages differ between a missing and a denied key")


@case("EXI-02", "§21", "a high item reached by tag grant and a missing key refuse alike")
async def _exist_high(r: Runner) -> None:
    token = await r.pref_token()
    missing = await r.read_key(token, "conf.pref.nothing")
    high = await r.read_key(token, "conf.pref.passport")
    check_error_shape(missing)
    check_error_shape(high)
    if _comparable(missing) != _comparable(high) or missing.body["error"].get("message") != \
            high.body["error"].get("message"):
        raise Fail("a high item's refusal differs from a missing key's")


@case("EXI-03", "§21", "a tag with no items and an ungranted tag refuse alike")
async def _exist_tag(r: Runner) -> None:
    token = await r.pref_token()
    empty = await r.read_tag(token, "conf.no.such.tag")
    denied = await r.read_tag(token, "conf.holdings")
    if _comparable(empty) != _comparable(denied):
        raise Fail(f"empty tag {_comparable(empty)} vs denied tag {_comparable(denied)}")


# ---------------------------------------------------------------------- §15.2 gateway


def _self_signed(agent_id: str, workdir: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, agent_id)])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"uomp:agent:{agent_id}")]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cf, kf = workdir / "self.pem", workdir / "self.key"
    cf.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(kf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cf, kf


async def _refused_connection(r: Runner, ctx: ssl.SSLContext, token: str | None) -> str:
    """Returns how the gateway refused; raises Fail if a request got through."""
    try:
        a = await r.request("GET", "/v1/memory/conf.pref.theme", token=token, session=r.session(ctx))
    except (TimeoutError, aiohttp.ClientError, ssl.SSLError, OSError) as exc:
        return f"connection refused ({type(exc).__name__})"
    if a.status == 200:
        raise Fail("the request was answered 200")
    if a.status != 401:
        raise Fail(f"expected a refused handshake or 401, got {a.status}")
    check_error_shape(a)
    return f"401 {a.code()}"


@case("GW-01", "§15.2", "TLS 1.2 is refused: a client capped at TLS 1.2 gets no connection", modes=("gateway",))
async def _tls12(r: Runner) -> None:
    r.need_gateway_pieces()
    ctx = r.client_context(max_tls=ssl.TLSVersion.TLSv1_2)
    assert ctx is not None
    try:
        a = await r.request("GET", "/v1/health", session=r.session(ctx))
    except (TimeoutError, aiohttp.ClientError, ssl.SSLError, OSError):
        return
    raise Fail(f"a TLS 1.2 connection was accepted (answered {a.status})")


@case("GW-02", "§15.2", "a client with no certificate cannot read", modes=("gateway",))
async def _no_cert(r: Runner) -> None:
    r.need_gateway_pieces()
    token = await r.pref_token()
    ctx = r.client_context(with_cert=False)
    assert ctx is not None
    await _refused_connection(r, ctx, token)


@case("GW-03", "§15.2", "a self-signed client certificate (not from the user's CA) cannot read", modes=("gateway",))
async def _self_cert(r: Runner) -> None:
    r.need_gateway_pieces()
    token = await r.pref_token()
    with tempfile.TemporaryDirectory(prefix="uomp-conf-") as tmp:
        ctx = r.client_context(cert=_self_signed(r.agent_id, Path(tmp)))
    assert ctx is not None
    await _refused_connection(r, ctx, token)


@case("GW-04", "§15.2", "a token bound to another certificate is refused", modes=("gateway",))
async def _binding(r: Runner) -> None:
    other = _b64(hashlib.sha256(b"another certificate").digest())
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, cnf={"x5t#S256": other, "jkt": other})
    expect_error(await r.read_key(str(g["token"]), "conf.pref.theme"), AUTH_REFUSED, TOKEN_CODES)


@case("GW-05", "§15.2", "X-UOMP-Agent-Id different from the token's agent is refused", modes=("gateway",))
async def _agent_header(r: Runner) -> None:
    token = await r.pref_token()
    a = await r.read_key(token, "conf.pref.theme", agent="someone_else")
    expect_error(a, (401, 403))


@case("GW-06", "§15.2", "a token for another agent id, presented with this agent's certificate, is refused",
      modes=("gateway",))
async def _agent_binding(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, agent_id="conformance_other")
    a = await r.read_key(str(g["token"]), "conf.pref.theme", agent="conformance_other")
    expect_error(a, (401, 403))


@case("GW-07", "§15.2", "the management API (session create) is not reachable through the gateway",
      modes=("gateway",))
async def _no_mgmt(r: Runner) -> None:
    r.need_gateway_pieces()
    token = await r.pref_token()
    a = await r.request("POST", "/v1/sessions", token=token, json_body={"agent_id": "x", "agent_name": "x"})
    if a.status in (200, 201):
        raise Fail("a session was created through the gateway")
    check_error_shape(a)


# ---------------------------------------------------------------------- §15.5 refresh


async def _refresh(r: Runner, sid: str, refresh_token: str) -> Answer:
    return await r.request("POST", f"/v1/sessions/{quote(sid, safe='')}/refresh", token=refresh_token)


@case("REF-01", "§15.5", "a refresh token rotates: the new access token reads, the spent refresh token is refused",
      modes=("gateway",))
async def _rotate(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, refresh=True)
    if "refresh_token" not in g:
        raise Skip("the target issued no refresh token for a bound remote grant")
    a = await _refresh(r, str(g["session_id"]), str(g["refresh_token"]))
    body = expect_ok(a)
    if not isinstance(body, dict) or "token" not in body or "refresh_token" not in body:
        raise Fail("refresh answer lacks token and refresh_token")
    expect_ok(await r.read_key(str(body["token"]), "conf.pref.theme"))
    again = await _refresh(r, str(g["session_id"]), str(g["refresh_token"]))
    expect_error(again, AUTH_REFUSED)
    # reuse revokes the family (§15.5): the token rotated in is refused too
    expect_error(await _refresh(r, str(g["session_id"]), str(body["refresh_token"])), AUTH_REFUSED)


@case("REF-02", "§15.5", "a refresh token has no read scopes and never reads; an access token does not refresh",
      modes=("gateway",))
async def _kinds(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, refresh=True)
    if "refresh_token" not in g:
        raise Skip("the target issued no refresh token for a bound remote grant")
    scopes = _claims_of(str(g["refresh_token"])).get("scopes")
    if scopes not in (None, {}, [], ["refresh"], "refresh") and not (
            isinstance(scopes, dict) and all(not v for v in scopes.values())):
        raise Fail(f"the refresh token's scopes claim is not empty or refresh-only: {json.dumps(scopes)[:100]}")
    expect_error(await _refresh(r, str(g["session_id"]), str(g["token"])), AUTH_REFUSED)
    expect_error(await r.read_key(str(g["refresh_token"]), "conf.pref.theme"), AUTH_REFUSED)


@case("REF-03", "§15.5 §13.4", "a refresh token of a revoked session is refused", modes=("gateway",))
async def _refresh_revoked(r: Runner) -> None:
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, refresh=True)
    if "refresh_token" not in g:
        raise Skip("the target issued no refresh token for a bound remote grant")
    await r.admin("POST", f"/v1/sessions/{g['session_id']}/revoke")
    expect_error(await _refresh(r, str(g["session_id"]), str(g["refresh_token"])), AUTH_REFUSED)


# ---------------------------------------------------------------------- §15.6 payloads


async def _relay(r: Runner) -> None:
    r.need_gateway_pieces()
    a = await r.request("POST", "/v1/payload/upload", json_body={})
    if a.status == 404:
        raise Skip("the target has no payload relay (POST /v1/payload/upload answers 404)")


def _recipient(r: Runner) -> X25519PublicKey:
    if not r.t.payload_public_key:
        raise Skip("needs the user's payload public key (--payload-public-key, `uomp payload pubkey`)")
    try:
        return X25519PublicKey.from_public_bytes(base64.b64decode(r.t.payload_public_key, validate=True))
    except ValueError as exc:
        raise Skip("--payload-public-key is not base64 of 32 raw X25519 bytes") from exc


async def _sealed(r: Runner, **override: str) -> tuple[str, dict[str, Any]]:
    """A token with a session, and a correctly sealed §15.6 envelope for it (fields overridable)."""
    recipient = _recipient(r)
    g = await r.grant({"tags": ["conf.pref"], "keys": []})
    binding = sealing.Binding(payload_id=override.get("payload_id", payloads.new_payload_id()),
                              session_id=override.get("session_id", str(g["session_id"])),
                              agent_id=override.get("agent_id", r.agent_id), format="text/markdown")
    return str(g["token"]), payloads.seal_small(recipient, binding, b"# conformance\n" + os.urandom(64))


async def _upload(r: Runner, token: str, env: dict[str, Any]) -> Answer:
    return await r.request("POST", "/v1/payload/upload", token=token, json_body=env)


@case("PAY-01", "§15.6", "a payload upload with no token is refused 401", modes=("gateway",))
async def _pay_noauth(r: Runner) -> None:
    await _relay(r)
    expect_error(await r.request("POST", "/v1/payload/upload", json_body={}), AUTH_REFUSED)


@case("PAY-02", "§15.6", "an upload that is not a §15.6 envelope is refused 4xx", modes=("gateway",))
async def _pay_bad(r: Runner) -> None:
    await _relay(r)
    token = await r.pref_token()
    for body in ({"envelope": {"v": 1}}, {"payload_id": "pay_x", "ciphertext": "not base64!"}):
        a = await _upload(r, token, body)
        if not 400 <= a.status < 500:
            raise Fail(f"a malformed envelope answered {a.status}")
        check_error_shape(a)


@case("PAY-03", "§15.6", "a sealed envelope is accepted once; the same payload_id again is refused",
      modes=("gateway",))
async def _pay_ok(r: Runner) -> None:
    await _relay(r)
    token, env = await _sealed(r)
    a = await _upload(r, token, env)
    if a.status not in (200, 201):
        raise Fail(f"a correctly sealed envelope answered {a.status} {a.code()}")
    again = await _upload(r, token, env)
    if not 400 <= again.status < 500:
        raise Fail(f"a second upload of the same payload_id answered {again.status}")


@case("PAY-04", "§15.6", "an envelope whose ciphertext was altered (hash no longer matches) is refused",
      modes=("gateway",))
async def _pay_tampered(r: Runner) -> None:
    await _relay(r)
    token, env = await _sealed(r)
    raw = bytearray(base64.b64decode(env["ciphertext"]))
    raw[-1] ^= 0x01
    env["ciphertext"] = base64.b64encode(bytes(raw)).decode()
    a = await _upload(r, token, env)
    if not 400 <= a.status < 500:
        raise Fail(f"an altered ciphertext answered {a.status}")


@case("PAY-05", "§15.6", "an envelope naming another session or agent than the token's is refused",
      modes=("gateway",))
async def _pay_other(r: Runner) -> None:
    await _relay(r)
    for field, value in (("session_id", "sess_someone_else"), ("agent_id", "someone_else")):
        token, env = await _sealed(r, **{field: value})
        a = await _upload(r, token, env)
        if not 400 <= a.status < 500:
            raise Fail(f"an envelope with a foreign {field} answered {a.status}")


@case("PAY-06", "§15.6 §21", "an agent cannot fetch payloads: a stored id and an unknown id answer alike",
      modes=("gateway",))
async def _pay_get(r: Runner) -> None:
    await _relay(r)
    token, env = await _sealed(r)
    if (await _upload(r, token, env)).status not in (200, 201):
        raise Skip("setup: the sealed upload was not accepted (see PAY-03)")
    stored = await r.request("GET", "/v1/payload/" + quote(env["payload_id"], safe=""), token=token)
    unknown = await r.request("GET", "/v1/payload/pay_" + "A" * 24, token=token)
    if stored.status == 200:
        raise Fail("an agent read a stored payload back")
    if _comparable(stored) != _comparable(unknown):
        raise Fail(f"stored {_comparable(stored)} vs unknown {_comparable(unknown)}")


# ---------------------------------------------------------------------- runner


def selected(mode: str) -> list[Case]:
    return [c for c in CASES if mode in c.modes]


async def run(target: Target, *, only: list[str] | None = None) -> list[Result]:
    if target.mode not in ("guard", "gateway"):
        raise ValueError("mode must be guard or gateway")
    runner = Runner(target)
    out: list[Result] = []
    try:
        for c in selected(target.mode):
            if only and not any(c.id.startswith(p) for p in only):
                continue
            start = time.monotonic()
            try:
                await c.fn(runner)
                verdict, reason = "pass", ""
            except Skip as exc:
                verdict, reason = "skip", str(exc)
            except Fail as exc:
                verdict, reason = "fail", str(exc)
            except (TimeoutError, aiohttp.ClientError, OSError, ssl.SSLError) as exc:
                verdict, reason = "fail", f"transport error: {type(exc).__name__}: {str(exc)[:160]}"
            except Exception as exc:  # a case must never pass unseen; report and go on
                verdict, reason = "fail", f"unexpected {type(exc).__name__}: {str(exc)[:160]}"
            out.append(Result(c.id, c.section, c.expectation, verdict, reason, time.monotonic() - start))
    finally:
        await runner.close()
    return out
