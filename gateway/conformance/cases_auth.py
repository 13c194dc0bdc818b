"""Conformance cases: the error body (§8.4) and token checks (§7.3), registered with :func:`~.harness.case`."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

from gateway.conformance.harness import (
    AUTH_REFUSED,
    SPEC_CODES,
    TOKEN_CODES,
    Fail,
    Runner,
    Skip,
    alg_none,
    case,
    check_error_shape,
    claims_of,
    expect_error,
    expect_ok,
    tamper_claims,
    tamper_signature,
)

# ---------------------------------------------------------------------- §8.4


@case("ERR-01", "§8.4", "a read with no Authorization header is 401 with the §8.4 error body")
async def _no_auth(r: Runner) -> None:
    r.need_gateway_pieces()
    expect_error(await r.request("GET", "/v1/memory/conf.pref.theme"), AUTH_REFUSED, ("INVALID_TOKEN",))


@case("ERR-02", "§8.4", "a malformed bearer token is 401 INVALID_TOKEN")
async def _garbage(r: Runner) -> None:
    r.need_gateway_pieces()
    expect_error(await r.read_key("not-a-token", "conf.pref.theme"), AUTH_REFUSED, ("INVALID_TOKEN",))


@case(
    "ERR-03",
    "§8.4 §10.1 §20.4",
    "an agent write (PUT/DELETE /v1/memory/{key}) is refused and nothing changes; "
    "the guard answers 403 WRITE_NOT_AVAILABLE (the gateway, which has no write route, any 4xx)",
)
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
    answers = [
        await r.read_key(token, "conf.nope"),
        await r.read_key(tamper_signature(token), "conf.pref.theme"),
        await r.read_tag(token, "conf.private"),
    ]
    for a in answers:
        check_error_shape(a)
        code = a.code()
        if code not in SPEC_CODES:
            raise Fail(f"refusal code {code} is not a §8.4 code")
        if (a.status, code) not in {
            (401, "INVALID_TOKEN"),
            (401, "TOKEN_EXPIRED"),
            (401, "SESSION_REVOKED"),
            (403, "ACCESS_DENIED"),
            (429, "QUOTA_EXCEEDED"),
            (403, "WRITE_NOT_AVAILABLE"),
            (503, "STORE_UNAVAILABLE"),
            (404, "SESSION_NOT_FOUND"),
            (400, "INVALID_REQUEST"),
        }:
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


def _iso_seconds(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@case("TOK-05", "§7.3", "exp never passes the session's expires_at, and once exp passes the token is refused")
async def _expired(r: Runner) -> None:
    # token_lifetime_seconds (>= 10) shortens the token; a target that ignores it is waited on for
    # its one-minute session instead (expiry_wait bounds the wait).
    g = await r.grant({"tags": ["conf.pref"], "keys": []}, minutes=1, token_lifetime_seconds=10)
    token = str(g["token"])
    exp = claims_of(token).get("exp")
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
