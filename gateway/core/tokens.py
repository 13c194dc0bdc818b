"""Capability and refresh tokens (spec §7, §15.5), pure.

Wire shape, compatible with the public TypeScript reference:

* header ``{"alg": "EdDSA", "kid": "..."}`` (refresh tokens add ``"typ": "uomp-rt+jwt"``);
* snake_case claims of spec §7.1/§7.2 plus ``iat``, ``exp`` and ``jti``;
* inside ``scopes`` and ``limits`` the reference writes camelCase (``denyTags``, ``denyKeys``,
  ``allowedFields``, ``maxReadQueries``); we accept both spellings and write snake_case.

Verification is "bytes in, verified object out": :func:`verify_token` needs only the token, the
trusted public keys by ``kid`` and the current time. Session status, blacklist and quota are the
caller's business (they need storage).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.core import checks, jose
from gateway.core.capability import EMPTY_SCOPE, Capability, Scope
from gateway.errors import ErrorCode, UompError

TOKEN_VERSION = "1.0"
REFRESH_TYP = "uomp-rt+jwt"
# Clock skew tolerated on ``iat`` in the future (the issuer is the same host or the user's own).
IAT_SKEW_SECONDS = 60
# Bounds on claim shapes: a token is attacker-supplied input until verified, and even after.
MAX_LIST_ITEMS = 1024
MAX_STRING = 1024


_iso_last: tuple[int, str] = (-1, "")


def iso(ts: float) -> str:
    """UTC ISO 8601 with a ``Z`` suffix, second resolution (the last second's text is reused: every
    audit event formats the current second)."""
    global _iso_last
    sec = int(ts)
    last = _iso_last  # one read: another thread may replace it, never half
    if last[0] == sec:
        return last[1]
    text = datetime.fromtimestamp(sec, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    _iso_last = (sec, text)
    return text


def parse_iso(text: Any) -> float:
    """Seconds since the epoch from an ISO 8601 timestamp; naive times are taken as UTC."""
    if not isinstance(text, str) or not text or len(text) > 64:
        raise ValueError("not an ISO 8601 timestamp")
    s = text.strip()
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    dt = datetime.fromisoformat(s)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _fail(message: str) -> UompError:
    return UompError(ErrorCode.INVALID_TOKEN, message)


def _str(claims: Mapping[str, Any], name: str, *, required: bool = True) -> str | None:
    value = claims.get(name)
    if value is None:
        if required:
            raise _fail(f"claim {name} is missing")
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_STRING:
        raise _fail(f"claim {name} must be a non-empty string")
    return value


def _str_list(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        raise _fail(f"claim {name} must be a list of strings")
    for item in value:
        if not isinstance(item, str) or len(item) > MAX_STRING:
            raise _fail(f"claim {name} must be a list of strings")
    return tuple(value)


def _pick(obj: Mapping[str, Any], snake: str, camel: str) -> Any:
    return obj[snake] if snake in obj else obj.get(camel)


def parse_scope(obj: Any, name: str) -> Scope:
    """A scope from its claim object (both spellings of each member); INVALID_TOKEN for a malformed one."""
    if obj is None:
        return EMPTY_SCOPE
    if not isinstance(obj, dict):
        raise _fail(f"scope {name} must be an object")
    af = _pick(obj, "allowed_fields", "allowedFields")
    return Scope(
        tags=_str_list(obj.get("tags"), f"scopes.{name}.tags"),
        keys=_str_list(obj.get("keys"), f"scopes.{name}.keys"),
        deny_tags=_str_list(_pick(obj, "deny_tags", "denyTags"), f"scopes.{name}.deny_tags"),
        deny_keys=_str_list(_pick(obj, "deny_keys", "denyKeys"), f"scopes.{name}.deny_keys"),
        allowed_fields=None if af is None else _str_list(af, f"scopes.{name}.allowed_fields"),
    )


def _opt_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(f"claim {name} must be a non-negative integer")
    return value


def _opt_bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _fail(f"claim {name} must be a boolean")
    return value


def parse_claims(header: Mapping[str, Any], claims: Mapping[str, Any]) -> Capability:
    """Normalise claims (signature already checked). Unknown shapes are INVALID_TOKEN."""
    token_use = "refresh" if header.get("typ") == REFRESH_TYP or claims.get("token_use") == "refresh" else "access"
    session_id = _str(claims, "session_id")
    agent_id = _str(claims, "agent_id")
    assert session_id is not None and agent_id is not None
    exp = claims.get("exp")
    iat = claims.get("iat")
    for name, value in (("exp", exp), ("iat", iat)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(f"claim {name} must be a number")
    assert isinstance(exp, int | float) and isinstance(iat, int | float)
    # §7.2 MUST claims (version, issued_at, expires_at). The
    # reference writes them snake_case; camelCase spellings are read too.
    version = claims.get("version")
    if not isinstance(version, str) or version.split(".", 1)[0] != TOKEN_VERSION.split(".", 1)[0]:
        raise _fail("claim version is missing or not a supported token format version")
    raw_exp_at, raw_iss_at = _pick(claims, "expires_at", "expiresAt"), _pick(claims, "issued_at", "issuedAt")
    if raw_exp_at is None or raw_iss_at is None:
        raise _fail("claims issued_at and expires_at are required")
    try:
        expires_at = parse_iso(raw_exp_at)
        issued_at = parse_iso(raw_iss_at)
    except (ValueError, OverflowError) as exc:
        raise _fail("claims expires_at/issued_at must be ISO 8601 timestamps") from exc

    scopes = claims.get("scopes")
    if token_use == "refresh":
        # §15.5: a refresh token's scopes are empty or only "refresh". It never grants a read.
        if scopes not in (None, {}, [], ["refresh"], {"refresh": True}):
            raise _fail("refresh token must not carry scopes")
        read = write = EMPTY_SCOPE
    else:
        if not isinstance(scopes, dict):
            raise _fail("claim scopes must be an object")
        read = parse_scope(scopes.get("read"), "read")
        write = parse_scope(scopes.get("write"), "write")

    # §7.2: ``limits`` is OPTIONAL. What it says is informational for the agent: the read quota is
    # the session's grant, enforced by the Auth Service whatever the token carries.
    limits = claims.get("limits")
    if limits is not None and not isinstance(limits, dict):
        raise _fail("claim limits must be an object")
    limits = limits or {}
    profile = claims.get("profile", "local")
    if profile not in ("local", "remote"):
        raise _fail("claim profile must be local or remote")
    audience = _str(claims, "audience", required=False)
    ae = claims.get("allowed_endpoints")
    af = claims.get("allowed_fields")
    cnf = claims.get("cnf")
    if cnf is not None and not isinstance(cnf, dict):
        raise _fail("claim cnf must be an object")
    cnf = cnf or {}
    x5t, jkt = cnf.get("x5t#S256"), cnf.get("jkt")
    for name, value in (("cnf.x5t#S256", x5t), ("cnf.jkt", jkt)):
        if value is not None and (not isinstance(value, str) or len(value) != 43):
            raise _fail(f"claim {name} must be a base64url SHA-256 value")
    return Capability(
        session_id=session_id,
        agent_id=agent_id,
        issued_at=issued_at,
        expires_at=expires_at,
        read=read,
        write=write,
        max_read_queries=_opt_int(_pick(limits, "max_read_queries", "maxReadQueries"), "limits.max_read_queries"),
        max_write_queries=_opt_int(_pick(limits, "max_write_queries", "maxWriteQueries"), "limits.max_write_queries"),
        profile=profile,
        audience=audience,
        allowed_endpoints=None if ae is None else _str_list(ae, "allowed_endpoints"),
        allowed_fields=(_str_list(af, "allowed_fields") if af is not None else read.allowed_fields),
        aggregation_only=_opt_bool(claims.get("aggregation_only"), "aggregation_only"),
        task_bound=_opt_bool(claims.get("task_bound"), "task_bound"),
        jti=_str(claims, "jti", required=False),
        kid=str(header.get("kid", "")),
        token_use=token_use,
        cnf_x5t=x5t,
        cnf_jkt=jkt,
        family_id=_str(claims, "family_id", required=False),
        claims=dict(claims),
    )


def verify_token(token: str, keys: Mapping[str, jose.PublicKey], *, now: float) -> Capability:
    """Signature (EdDSA only, key by ``kid``), claim shapes, ``exp`` and ``expires_at``.

    Raises INVALID_TOKEN or TOKEN_EXPIRED. Never returns a token that failed any check.
    """
    parsed = jose.parse_compact(token)
    if parsed.header.get("alg") != "EdDSA":
        raise _fail("token algorithm must be EdDSA")
    key = keys[checks.check_kid(parsed.header.get("kid"), keys)]
    if not isinstance(key, ed25519.Ed25519PublicKey) or not jose.verify_signature(parsed, key):
        raise _fail("token signature is invalid")
    cap = parse_claims(parsed.header, parsed.payload)
    exp = parsed.payload["exp"]
    if now >= exp or now >= cap.expires_at:
        raise UompError(ErrorCode.TOKEN_EXPIRED, "token has expired", session_id=cap.session_id)
    if parsed.payload["iat"] > now + IAT_SKEW_SECONDS:
        raise _fail("token is issued in the future")
    return cap


def new_jti() -> str:
    """A fresh random token id."""
    return "jti_" + secrets.token_urlsafe(18)


def capability_claims(
    *,
    session_id: str,
    agent_id: str,
    now: float,
    expires: float,
    read: Scope,
    write: Scope = EMPTY_SCOPE,
    max_read_queries: int | None = None,
    max_write_queries: int | None = 0,
    profile: str = "local",
    audience: str | None = None,
    allowed_endpoints: list[str] | None = None,
    allowed_fields: list[str] | None = None,
    aggregation_only: bool = False,
    task_bound: bool = False,
    cnf: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The claim set of an access token, exactly the §7.1 names plus iat/exp/jti (and cnf)."""
    claims: dict[str, Any] = {
        "version": TOKEN_VERSION,
        "session_id": session_id,
        "agent_id": agent_id,
        "issued_at": iso(now),
        "expires_at": iso(expires),
        "scopes": {"read": read.to_claim(), "write": write.to_claim()},
        "limits": {"max_read_queries": max_read_queries, "max_write_queries": max_write_queries},
        "profile": profile,
        "aggregation_only": aggregation_only,
        "task_bound": task_bound,
        "iat": int(now),
        "exp": int(expires),
        "jti": new_jti(),
    }
    if max_read_queries is None:
        del claims["limits"]["max_read_queries"]
    if audience is not None:
        claims["audience"] = audience
    if allowed_endpoints is not None:
        claims["allowed_endpoints"] = list(allowed_endpoints)
    if allowed_fields is not None:
        claims["allowed_fields"] = list(allowed_fields)
    if cnf:
        claims["cnf"] = dict(cnf)
    return claims


def refresh_claims(
    *,
    session_id: str,
    agent_id: str,
    now: float,
    expires: float,
    family_id: str,
    audience: str | None,
    cnf: dict[str, str] | None,
) -> dict[str, Any]:
    """The claims of a refresh token for one session and token family."""
    claims: dict[str, Any] = {
        "version": TOKEN_VERSION,
        "token_use": "refresh",
        "session_id": session_id,
        "agent_id": agent_id,
        "issued_at": iso(now),
        "expires_at": iso(expires),
        "scopes": {},
        "profile": "remote",
        "family_id": family_id,
        "iat": int(now),
        "exp": int(expires),
        "jti": new_jti(),
    }
    if audience is not None:
        claims["audience"] = audience
    if cnf:
        claims["cnf"] = dict(cnf)
    return claims


def sign_token(claims: dict[str, Any], key: ed25519.Ed25519PrivateKey, kid: str, *, refresh: bool = False) -> str:
    """``claims`` as a compact EdDSA JWS signed with the Auth Service's key ``kid``."""
    header: dict[str, Any] = {"alg": "EdDSA", "kid": kid}
    if refresh:
        header["typ"] = REFRESH_TYP
    return jose.sign_compact(header, claims, key)
